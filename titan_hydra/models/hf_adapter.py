"""Our Llama3 <-> Hugging Face ``LlamaForCausalLM``: names, rotary layout, config.json.

Two differences besides names matter:

* Rotary layout. Our attention (like Meta's reference) rotates interleaved pairs of the head
  dimension (2i, 2i+1); HF's ``rotate_half`` rotates pairs (i, i + head_dim/2). Attention
  scores are invariant to permuting q and k's head dimension the same way, so converting is a
  fixed row permutation of ``wq`` and ``wk`` within each head (``to_hf_rows`` / its inverse);
  ``wv``/``wo`` are untouched.
* The FFN width. HF stores ``intermediate_size``; we derive it from ``multiple_of`` and
  ``ffn_dim_multiplier`` (Meta's rule), so importing picks values that reproduce it exactly.

Loading uses ``safetensors`` only (no pickle).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from titan_hydra.models.llama3 import ROPE_HIGH_FREQ_FACTOR, ROPE_LOW_FREQ_FACTOR, ROPE_ORIGINAL_CONTEXT, LlamaArgs

# our suffix within a block -> HF suffix within model.layers.<i>.
_BLOCK = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight"}
_BLOCK_INV = {v: k for k, v in _BLOCK.items()}
_TOP_INV = {v: k for k, v in _TOP.items()}
_OURS_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


class HFConversionError(ValueError):
    """A tensor or config that has no counterpart on the other side."""


def to_hf_name(fqn: str) -> str:
    if fqn in _TOP:
        return _TOP[fqn]
    m = _OURS_RE.match(fqn)
    if not m or m.group(2) not in _BLOCK:
        raise HFConversionError(f"no HF Llama name for parameter {fqn!r}")
    return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"


def from_hf_name(name: str) -> str:
    if name in _TOP_INV:
        return _TOP_INV[name]
    m = _HF_RE.match(name)
    if not m or m.group(2) not in _BLOCK_INV:
        raise HFConversionError(f"HF tensor {name!r} has no counterpart in this Llama model")
    return f"layers.{m.group(1)}.{_BLOCK_INV[m.group(2)]}"


# --------------------------------------------------------------------------- rotary layout


def to_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Interleaved (Meta) -> half-split (HF) rows of a q/k projection [n_heads*hd, dim]."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, hd // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def from_hf_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Half-split (HF) -> interleaved (Meta) rows; the inverse of ``to_hf_rows``."""
    out_dim, in_dim = w.shape
    hd = out_dim // n_heads
    return w.view(n_heads, 2, hd // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim).contiguous()


def _heads_for(fqn: str, args: LlamaArgs) -> int | None:
    if fqn.endswith("attention.wq.weight"):
        return args.n_heads
    if fqn.endswith("attention.wk.weight"):
        return args.kv_heads
    return None


def to_hf_state(sd: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for fqn, t in sd.items():
        heads = _heads_for(fqn, args)
        out[to_hf_name(fqn)] = to_hf_rows(t, heads) if heads else t.contiguous()
    return out


def from_hf_state(sd: dict[str, torch.Tensor], args: LlamaArgs) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in sd.items():
        if name.endswith("rotary_emb.inv_freq"):
            continue  # old HF checkpoints carry the (recomputable) rope buffer
        fqn = from_hf_name(name)
        heads = _heads_for(fqn, args)
        out[fqn] = from_hf_rows(t, heads) if heads else t
    return out


# --------------------------------------------------------------------------- config.json

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def hf_config(args: LlamaArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(args.rope_theta)}
    if args.rope_scaling:
        rope.update(rope_type="llama3", factor=float(args.rope_scaling_factor),
                    low_freq_factor=ROPE_LOW_FREQ_FACTOR, high_freq_factor=ROPE_HIGH_FREQ_FACTOR,
                    original_max_position_embeddings=ROPE_ORIGINAL_CONTEXT)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "dtype": _DTYPE_NAMES.get(dtype, "float32"),
    }


def _ffn_fields(dim: int, intermediate: int) -> dict[str, Any]:
    """multiple_of / ffn_dim_multiplier that make Meta's FFN rule give ``intermediate``."""
    base = int(2 * (4 * dim) / 3)
    if base <= intermediate:
        fields: dict[str, Any] = {"multiple_of": intermediate, "ffn_dim_multiplier": None}
    else:
        fields = {"multiple_of": 1, "ffn_dim_multiplier": (intermediate + 0.5) / base}
    return fields


def args_from_hf_config(cfg: dict[str, Any]) -> LlamaArgs:
    if cfg.get("model_type", "llama") != "llama":
        raise HFConversionError(f"config.json model_type={cfg.get('model_type')!r}; only llama is supported")
    if cfg.get("tie_word_embeddings"):
        raise HFConversionError("config.json has tie_word_embeddings=true; this Llama has separate output weights")
    dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    if int(cfg.get("head_dim") or dim // heads) != dim // heads:
        raise HFConversionError(f"config.json head_dim={cfg['head_dim']} != hidden_size/num_attention_heads")
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    rope.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type") or legacy.get("rope_type") or legacy.get("type") or "default"
    scaling = {**legacy, **rope}
    if rope_type not in ("default", "llama3"):
        raise HFConversionError(f"rope type {rope_type!r} is not supported (default or llama3)")
    if rope_type == "llama3":
        expected = (ROPE_LOW_FREQ_FACTOR, ROPE_HIGH_FREQ_FACTOR, ROPE_ORIGINAL_CONTEXT)
        got = (scaling.get("low_freq_factor"), scaling.get("high_freq_factor"),
               scaling.get("original_max_position_embeddings"))
        if tuple(float(x) for x in got) != tuple(float(x) for x in expected):
            raise HFConversionError(f"llama3 rope scaling {got} differs from the supported {expected}")
    args = LlamaArgs(
        dim=dim,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        vocab_size=int(cfg["vocab_size"]),
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=rope_type == "llama3",
        rope_scaling_factor=float(scaling.get("factor", 8.0)),
        max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
        **_ffn_fields(dim, int(cfg["intermediate_size"])),
    )
    if args.ffn_hidden_dim != int(cfg["intermediate_size"]):
        raise HFConversionError(f"cannot represent intermediate_size={cfg['intermediate_size']}")
    return args


# --------------------------------------------------------------------------- files


def is_hf_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def load_hf_checkpoint(path: str | Path) -> tuple[LlamaArgs, dict[str, torch.Tensor]]:
    """(our args, our full state dict) from an HF Llama directory."""
    from safetensors.torch import load_file

    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
        args = args_from_hf_config(cfg)
        hf: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            hf.update(load_file(str(f)))
        return args, from_hf_state(hf, args)
    except (HFConversionError, KeyError, ValueError, OSError) as e:
        from titan_hydra.checkpoint.storage import CheckpointError

        raise CheckpointError(f"HF checkpoint {path}: {e}") from None


def save_hf_checkpoint(path: str | Path, sd: dict[str, torch.Tensor], args: LlamaArgs,
                       dtype: torch.dtype = torch.float32) -> None:
    """Write config.json and model.safetensors (HF names, HF rotary layout)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = {k: v.to(dtype) if v.is_floating_point() else v for k, v in to_hf_state(sd, args).items()}
    save_file(hf, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2, sort_keys=True))
    (path / "titan_hydra_args.json").write_text(json.dumps(asdict(args), indent=2, sort_keys=True))
