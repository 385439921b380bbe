"""Sampling (titan_hydra/generate.py, recipes/generate.py): greedy decoding equals transformers'
``generate`` on the same weights for several families, the top-k / top-p filters keep exactly the
tokens they should, seeded sampling repeats, and the CLI reads HF and titan_hydra checkpoints and
refuses bad input in one line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from titan_hydra.spec import spec_of
from titan_hydra.errors import ConfigError
from titan_hydra.generate import SamplingConfig, filter_logits, generate
from numerics import assert_fp32_close

transformers = pytest.importorskip("transformers")
from test_hf_convert import HF_CLASSES, hf_config  # noqa: E402  (tiny random configs per family)

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
from generate import main  # noqa: E402  (the command line)

from titan_hydra.checkpoint.offline import load_model  # noqa: E402


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe", "gpt_oss", "llama4_text", "deepseek_v3"])
def test_greedy_equals_transformers_generate(tmp_path, kind):
    torch.manual_seed(0)
    hf = HF_CLASSES[kind](hf_config(kind, False)).eval()
    hf.save_pretrained(tmp_path / "hf")
    _, args, ours = load_model(tmp_path / "hf")
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    cfg = SamplingConfig(max_new_tokens=10, temperature=0.0, stop_at_eos=False)
    got = generate(ours, prompt, cfg, args.max_seq_len)
    with torch.no_grad():
        ref = hf.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=10,
                          min_new_tokens=10, pad_token_id=0, eos_token_id=None)
    assert got.shape == (2, 15)
    assert torch.equal(got, ref), (got, ref)


def test_filters_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(filter_logits(logits, 2, None)).tolist() == [[True, True, False, False]]
    # top-p 0.8: 0.5 then 0.3 reach it; the third token (mass before it 0.8) is dropped
    assert torch.isfinite(filter_logits(logits, None, 0.8)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(filter_logits(logits, None, 0.81)).tolist() == [[True, True, True, False]]
    assert torch.isfinite(filter_logits(logits, None, 0.1)).tolist() == [[True, False, False, False]]
    shuffled = logits[:, [2, 0, 3, 1]]  # order in the vocabulary does not matter
    assert torch.isfinite(filter_logits(shuffled, None, 0.8)).tolist() == [[False, True, False, True]]


class Fixed(torch.nn.Module):
    """A 'model' whose next-token distribution is fixed: logits of ``probs`` at every position."""

    def __init__(self, probs):
        super().__init__()
        self.logits = torch.log(torch.tensor(probs))

    def forward(self, tokens):
        return self.logits.expand(tokens.shape[0], tokens.shape[1], -1)


def test_sampling_is_seeded_and_respects_the_filters():
    model = Fixed([0.4, 0.3, 0.2, 0.1])
    prompt = torch.zeros(64, 1, dtype=torch.long)
    run = lambda **kw: generate(model, prompt, SamplingConfig(max_new_tokens=8, temperature=1.0, **kw), 100)  # noqa: E731
    a, b = run(seed=1), run(seed=1)
    assert torch.equal(a, b) and not torch.equal(a, run(seed=2))
    assert set(run(top_k=2)[:, 1:].unique().tolist()) == {0, 1}
    assert set(run()[:, 1:].unique().tolist()) == {0, 1, 2, 3}
    greedy = generate(model, prompt, SamplingConfig(max_new_tokens=3), 100)
    assert greedy[:, 1:].unique().tolist() == [0]


def test_generation_stops_at_eos_and_at_the_context():
    model = Fixed([0.1, 0.9])  # greedy picks token 1
    out = generate(model, torch.zeros(1, 2, dtype=torch.long), SamplingConfig(max_new_tokens=10), 100, eos_id=1)
    assert out.tolist() == [[0, 0, 1]]
    out = generate(model, torch.zeros(1, 2, dtype=torch.long), SamplingConfig(max_new_tokens=10), 5)
    assert out.shape == (1, 5)  # max_seq_len bounds the sequence
    with pytest.raises(ConfigError, match=r"prompt has 5 tokens, not fewer than the model's max_seq_len=5"):
        generate(model, torch.zeros(1, 5, dtype=torch.long), SamplingConfig(), 5)
    with pytest.raises(ConfigError, match=r"top_p=1.5 must be in \(0, 1\]"):
        SamplingConfig(top_p=1.5)


@pytest.mark.slow
def test_cli_samples_from_a_training_checkpoint_and_refuses_bad_input(tmp_path, capsys):
    from helpers import compose_cfg

    from titan_hydra.train.pretrain import run

    cfg = compose_cfg(["experiment=debug_tiny", "checkpoint=default", "checkpoint.interval=0", "training.steps=3",
                       "training.val_freq=0"])
    run(spec_of(cfg), str(tmp_path / "run"))
    step = tmp_path / "run" / "checkpoint" / "step-3"
    capsys.readouterr()
    assert main([str(step), "--prompt", "def main(", "--max-new-tokens", "8", "--temperature", "0.8",
                 "--top-k", "20", "--num-samples", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and out.count("def main(") == 2
    cases = [([str(tmp_path / "nowhere"), "--prompt", "x"], "does not exist"),
             ([str(step), "--prompt", " ".join(f"v{i}" for i in range(800))], "not fewer than the model's max_seq_len="),
             ([str(step), "--prompt", "x", "--top-p", "0"], "top_p=0.0 must be in")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and "\n" not in err, err
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "generate.py"), str(step), "--prompt", "import"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("import"), proc.stderr[-2000:]


CACHE_CASES = {"llama3_debug": [], "qwen3_debug": [], "qwen3_moe_debug": [], "deepseek_v3_debug": [],
               "gpt_oss_debug": ["model.sliding_window=8"],  # windows, sinks
               "llama4_debug": ["model.attention_chunk_size=8", "model.floor_scale=4"],  # chunks, NoPE temperature
               # Gated DeltaNet state + conv window: the prompt in chunks of 8 (prefill), then one token at a time
               "qwen3_5_debug": ["model.linear_chunk_size=8"], "qwen3_5_moe_debug": ["model.linear_chunk_size=8"]}


@pytest.mark.parametrize("name", list(CACHE_CASES))
def test_kv_cache_decoding_equals_full_recomputation(name):
    """Prompt, one token, then the rest through the cache: logits equal one full forward (the
    windows / chunks / temperature positions act: 30 tokens against window/chunk 8, floor 4), and
    cached greedy sampling emits the same tokens as re-running the sequence."""
    from helpers import compose_cfg

    from titan_hydra.models.common.kv_cache import KVCache
    from titan_hydra.models.registry import build_model

    torch.manual_seed(0)
    _, model = build_model(compose_cfg([f"model={name}", "model.n_layers=4", *CACHE_CASES[name]]).model)
    model.init_weights("cpu")
    model.eval()
    tokens = torch.randint(0, 2000, (2, 30))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache()
        steps = [model(tokens[:, :13], cache=cache), model(tokens[:, 13:14], cache=cache), model(tokens[:, 14:], cache=cache)]
    assert cache.length == 30
    # whole models have no fp64 form (norms, rotary, routers compute in fp32): bounded by fp32 unit
    # roundoff times 1e4 terms (4 layers of ~2000-term sums: projections, FFN, norms), numerics.FP32_REL
    assert_fp32_close({"logits": torch.cat(steps, dim=1)}, {"logits": full})
    prompt = tokens[:, :11]
    cfg = SamplingConfig(max_new_tokens=12)
    assert torch.equal(generate(model, prompt, cfg, 2048), generate(model, prompt, cfg, 2048, use_cache=False))
