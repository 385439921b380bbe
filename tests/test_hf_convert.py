"""HF safetensors in and out: names, rotary layout, config.json, round trips, logits."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import convert  # noqa: E402
from titan_hydra.checkpoint import CheckpointError  # noqa: E402
from titan_hydra.models.hf_adapter import from_hf_rows, to_hf_rows  # noqa: E402
from titan_hydra.models.llama3 import Llama3, build_from_args  # noqa: E402

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random HF Llama (GQA, intermediate size not from Meta's rule) saved locally."""
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "llama"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return path


TOKENS = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))


def hf_logits(path: Path) -> torch.Tensor:
    model = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(ckpt: Path) -> torch.Tensor:
    args, sd = convert.read_model(ckpt)
    model = build_from_args(args).eval()
    model.load_state_dict(sd)
    with torch.no_grad():
        return model(TOKENS)


def test_rotary_permutation_is_inverse():
    w = torch.randn(4 * 16, 8)
    assert torch.equal(from_hf_rows(to_hf_rows(w, 4), 4), w)
    assert not torch.equal(to_hf_rows(w, 4), w)


def test_hf_to_ours_to_hf(hf_dir, tmp_path):
    """HF -> ours -> HF is tensor-identical; our model reproduces HF's logits."""
    from safetensors.torch import load_file

    convert.from_hf(hf_dir, tmp_path / "ckpt" / "step-0")
    convert.to_hf(tmp_path / "ckpt" / "step-0", tmp_path / "back")
    a, b = load_file(str(hf_dir / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = hf_logits(hf_dir)
    assert (our_logits(tmp_path / "ckpt" / "step-0") - ref).abs().max().item() < 1e-5
    assert torch.equal(hf_logits(tmp_path / "back"), ref)


def test_ours_to_hf_to_ours(tmp_path):
    """A checkpoint of our model exports to HF (same logits there) and re-imports with equal logits."""
    from titan_hydra.checkpoint.manager import FORMAT_VERSION, model_signature
    from titan_hydra.checkpoint.storage import save_plain
    from dataclasses import asdict

    torch.manual_seed(0)
    model = Llama3(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
                   rope_scaling=True, rope_theta=500000.0)
    marker = {"format": FORMAT_VERSION, "step": 3, "kind": "full",
              "model": {"flavor": "custom", "args": asdict(model.args), "signature": model_signature(model.args)}}
    save_plain(tmp_path / "step-3", {f"model.{k}": v for k, v in model.state_dict().items()}, marker)
    before = our_logits(tmp_path / "step-3")
    convert.to_hf(tmp_path / "step-3", tmp_path / "hf")
    assert (hf_logits(tmp_path / "hf") - before).abs().max().item() < 1e-4
    convert.from_hf(tmp_path / "hf", tmp_path / "again" / "step-0")
    assert torch.equal(our_logits(tmp_path / "again" / "step-0"), before)


def test_bad_hf_dir(hf_dir, tmp_path):
    import json
    import shutil

    bad = tmp_path / "tied"
    shutil.copytree(hf_dir, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=rf"HF checkpoint {bad}: .*tie_word_embeddings"):
        convert.from_hf(bad, tmp_path / "out")
