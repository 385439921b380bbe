"""HF safetensors in and out, per family: names, rotary layout, tied embeddings, config.json,
round trips, logits (Llama <-> LlamaForCausalLM, Qwen3 <-> Qwen3ForCausalLM)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))

import convert  # noqa: E402
from titan_hydra.checkpoint import CheckpointError  # noqa: E402
from titan_hydra.checkpoint.manager import FORMAT_VERSION  # noqa: E402
from titan_hydra.checkpoint.storage import save_plain  # noqa: E402
from titan_hydra.models.hf_io import load_hf_checkpoint  # noqa: E402
from titan_hydra.models.llama3 import FAMILY as LLAMA  # noqa: E402
from titan_hydra.models.llama3 import Llama3  # noqa: E402
from titan_hydra.models.llama3.hf import from_hf_rows, to_hf_rows  # noqa: E402
from titan_hydra.models.qwen3 import FAMILY as QWEN3  # noqa: E402
from titan_hydra.models.qwen3 import Qwen3  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 128
TOKENS = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
HF_CLASSES = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}
FAMILIES = {"llama": LLAMA, "qwen3": QWEN3}
# Bars for our logits vs HF's (fp32): Llama keeps its old 1e-5, Qwen3 has the 1e-4.
# Measured max |diff| (OMP_NUM_THREADS=1; logits std 0.8-1.3, max |logit| ~3.5):
#   HF -> ours: llama untied 1.7e-06, tied 1.8e-06; qwen3 untied 1.9e-06, tied 1.4e-06
#   ours -> HF: llama untied 1.2e-07, tied 9.5e-07; qwen3 untied 6.0e-07, tied 9.5e-07
LOGIT_BAR = {"llama": 1e-5, "qwen3": 1e-4}


def hf_config(kind: str, tied: bool):
    """A tiny HF config: GQA, an intermediate size not from Meta's rule, and for Qwen3 a head_dim
    (32) that is not hidden/heads (16)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  tie_word_embeddings=tied, initializer_range=0.1)
    if kind == "llama":
        return transformers.LlamaConfig(**common, rms_norm_eps=1e-5,
                                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6,
                                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def randomize_norms(model: torch.nn.Module) -> None:
    """Norm weights start at 1; make them distinct so a swapped name (q_norm/k_norm, input/post
    layernorm) cannot go unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))


CASES = [("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True)]
IDS = [f"{k}-{'tied' if t else 'untied'}" for k, t in CASES]


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def hf_dir(request, tmp_path_factory):
    """A tiny random HF model (fp32) saved locally; returns (kind, tied, path)."""
    kind, tied = request.param
    torch.manual_seed(0)
    model = HF_CLASSES[kind](hf_config(kind, tied))
    randomize_norms(model)
    path = tmp_path_factory.mktemp("hf") / f"{kind}-{tied}"
    model.save_pretrained(path)
    return kind, tied, path


def hf_logits(kind: str, path: Path) -> torch.Tensor:
    model = HF_CLASSES[kind].from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def our_logits(ckpt: Path) -> torch.Tensor:
    family, args, sd = convert.read_model(ckpt)
    model = family.build(args).eval()
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

    kind, tied, path = hf_dir
    convert.from_hf(path, tmp_path / "ckpt" / "step-0")
    family, args, sd = convert.read_model(tmp_path / "ckpt" / "step-0")
    assert family is FAMILIES[kind] and args.tie_word_embeddings == tied
    if kind == "qwen3":
        assert (args.head_dim, args.dim // args.n_heads, args.qk_norm) == (32, 16, True)
    convert.to_hf(tmp_path / "ckpt" / "step-0", tmp_path / "back")
    a, b = load_file(str(path / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert ("lm_head.weight" in a) == (not tied)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ref = hf_logits(kind, path)
    diff = (our_logits(tmp_path / "ckpt" / "step-0") - ref).abs().max().item()
    assert diff < LOGIT_BAR[kind], diff
    assert torch.equal(hf_logits(kind, tmp_path / "back"), ref)
    cfg = json.loads((tmp_path / "back" / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["tie_word_embeddings"] == tied


def make_ours(kind: str, tied: bool):
    torch.manual_seed(0)
    if kind == "llama":
        model = Llama3(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, max_seq_len=64,
                       rope_scaling=True, rope_theta=500000.0, tie_word_embeddings=tied)
    else:
        model = Qwen3(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96,
                      vocab_size=VOCAB, max_seq_len=64, tie_word_embeddings=tied)
    model.init_weights()
    randomize_norms(model)
    return FAMILIES[kind], model


@pytest.mark.parametrize("kind,tied", CASES, ids=IDS)
def test_ours_to_hf_to_ours(tmp_path, kind, tied):
    """A checkpoint of our model exports to HF (same logits there) and re-imports with equal logits."""
    family, model = make_ours(kind, tied)
    marker = {"format": FORMAT_VERSION, "step": 3, "kind": "full",
              "model": {"family": family.name, "flavor": "custom", "args": family.args_fields(model.args),
                        "signature": family.signature(model.args)}}
    sd = model.state_dict()
    if tied:
        assert sd["output.weight"].data_ptr() == sd["tok_embeddings.weight"].data_ptr()
    save_plain(tmp_path / "step-3", {f"model.{k}": v.clone() for k, v in sd.items()}, marker)
    before = our_logits(tmp_path / "step-3")
    convert.to_hf(tmp_path / "step-3", tmp_path / "hf")
    diff = (hf_logits(kind, tmp_path / "hf") - before).abs().max().item()
    assert diff < 1e-4, diff
    convert.from_hf(tmp_path / "hf", tmp_path / "again" / "step-0")
    assert torch.equal(our_logits(tmp_path / "again" / "step-0"), before)


def edited_copy(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("hf") / "qwen3"
    transformers.Qwen3ForCausalLM(hf_config("qwen3", False)).save_pretrained(path)
    return path


@pytest.mark.parametrize("key", ["use_sliding_window", "attention_bias"])
def test_qwen3_unsupported_features_refused(qwen3_dir, tmp_path, key):
    bad = edited_copy(qwen3_dir, tmp_path / "bad", **{key: True})
    with pytest.raises(CheckpointError, match=rf"HF checkpoint {bad}: .*{key}=true") as err:
        convert.from_hf(bad, tmp_path / "out")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_hf_dir_of_another_family_refused(qwen3_dir, tmp_path):
    # the run fixes the family (initial_load_path of a llama3 run): a qwen3 directory is refused
    with pytest.raises(CheckpointError, match=r"model_type='qwen3', but this run's model family 'llama3' reads 'llama'") as err:
        load_hf_checkpoint(qwen3_dir, LLAMA)
    assert "\n" not in str(err.value)
    # no family given: picked from model_type; an unknown one is named with the known ones
    family, args, _ = load_hf_checkpoint(qwen3_dir)
    assert family is QWEN3 and args.head_dim == 32
    other = edited_copy(qwen3_dir, tmp_path / "mistral", model_type="mistral")
    with pytest.raises(CheckpointError, match=r"model_type='mistral' is not supported \(known: llama, qwen3\)") as err:
        convert.from_hf(other, tmp_path / "out")
    assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="model_type='mistral'"):
        load_hf_checkpoint(other, QWEN3)


# ------------------------------------------------------------------ initial_load_path=<HF dir>

# A run's first loss, after checkpoint.initial_load_path=<HF dir>, equals HF's own loss on the
# same first batch: the weights arrived (names, rotary layout, tying) through the engine's path.
RUN_SHAPES = {
    "llama": (["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2"],
              dict(intermediate_size=256, rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    "qwen3": (["model=qwen3_debug", "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2",
               "model.head_dim=32", "model.ffn_hidden_dim=192"],
              dict(intermediate_size=192, head_dim=32, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True)),
}


@pytest.mark.parametrize("kind", list(RUN_SHAPES))
def test_initial_load_path_reads_an_hf_directory(tmp_path, kind):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from helpers import compose_cfg

    from titan_hydra.train.loss import cross_entropy_loss
    from titan_hydra.train.pretrain import build_dataset, run

    overrides, hf_fields = RUN_SHAPES[kind]
    rope = hf_fields.pop("rope_theta")
    cfg_cls = transformers.LlamaConfig if kind == "llama" else transformers.Qwen3Config
    hf_cfg = cfg_cls(vocab_size=2048, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=2048,
                     rope_parameters={"rope_type": "default", "rope_theta": rope}, **hf_fields)
    torch.manual_seed(0)
    hf_model = HF_CLASSES[kind](hf_cfg).eval()
    randomize_norms(hf_model)
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = compose_cfg(overrides + [
        "training.seq_len=32", "training.local_batch_size=2", "training.steps=1", "training.val_freq=0",
        "training.mixed_precision=fp32", "lr_scheduler.warmup_steps=0", "data.max_documents=40", "logger=minimal",
        f"checkpoint.initial_load_path={tmp_path / 'hf'}",
    ])
    inputs, labels = next(build_dataset(cfg).loader("train", 2))
    with torch.no_grad():
        expected = cross_entropy_loss(hf_model(inputs).logits, labels).item()
    got = run(cfg, str(tmp_path / "run"))["losses"][0]
    assert abs(got - expected) < 1e-4, (got, expected)
