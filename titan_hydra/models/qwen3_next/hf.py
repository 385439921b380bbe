"""Our Qwen3.5-MoE model <-> Hugging Face ``Qwen3NextForCausalLM`` (``model_type: qwen3_next``).

Qwen3-Next (Qwen3-Next-80B-A3B) computes what Qwen3.5-MoE computes: the same hybrid layers, gated
attention, (1 + w) norms and gated shared expert. Its checkpoints differ in how the Gated DeltaNet
input projections are stored: fused and grouped by key head,

* ``in_proj_qkvz`` [Hk x (dk + dk + r dv + r dv), dim]: for each key head g its query, key, then
  the r = Hv / Hk value heads and output-gate heads it serves,
* ``in_proj_ba`` [Hk x (r + r), dim]: for each key head g the r betas, then the r decays,

against Qwen3.5's ``in_proj_qkv`` = [all queries | all keys | all values], ``in_proj_z``,
``in_proj_b`` and ``in_proj_a`` (ours hold the q, k, v parts apart: ``qwen3_5/hf.py`` splits and
fuses them around this). Export regroups rows, import ungroups them (a permutation: the function
is unchanged). Routing may leave the gates unnormalized (``norm_topk_prob``); layers
must all be MoE (``decoder_sparse_step`` 1, no ``mlp_only_layers``), as released.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from titan_hydra.models.common.hf_decoder import HFConversionError, refuse_other_routing
from titan_hydra.models.qwen3_5_moe.hf import Qwen35MoeHFAdapter
from titan_hydra.models.qwen3_5_moe.model import Qwen35MoeArgs

_FUSED = re.compile(r"^(model\.layers\.\d+\.linear_attn\.)in_proj_(qkvz|ba)\.weight$")


def _group(args: Qwen35MoeArgs) -> tuple[int, int, int, int]:
    hk, hv = args.linear_num_key_heads, args.linear_num_value_heads
    return hk, hv // hk, args.linear_key_head_dim, args.linear_value_head_dim


def fuse(prefix: str, hf: dict[str, torch.Tensor], args: Qwen35MoeArgs) -> dict[str, torch.Tensor]:
    """Qwen3.5's four projections of one layer (popped from ``hf``) -> Qwen3-Next's two."""
    hk, r, dk, dv = _group(args)
    qkv, z, b, a = (hf.pop(f"{prefix}in_proj_{n}.weight") for n in ("qkv", "z", "b", "a"))
    q, k, v = qkv.split([hk * dk, hk * dk, hk * r * dv])
    per_head = [t.reshape(hk, -1, t.shape[-1]) for t in (q, k, v, z)]
    return {f"{prefix}in_proj_qkvz.weight": torch.cat(per_head, dim=1).flatten(0, 1).contiguous(),
            f"{prefix}in_proj_ba.weight": torch.cat([b.view(hk, r, -1), a.view(hk, r, -1)], dim=1).flatten(0, 1)}


def unfuse(prefix: str, kind: str, t: torch.Tensor, args: Qwen35MoeArgs) -> dict[str, torch.Tensor]:
    """One of Qwen3-Next's fused projections -> the Qwen3.5 projections it holds."""
    hk, r, dk, dv = _group(args)
    if kind == "ba":
        b, a = t.view(hk, 2 * r, -1).split([r, r], dim=1)
        return {f"{prefix}in_proj_b.weight": b.flatten(0, 1), f"{prefix}in_proj_a.weight": a.flatten(0, 1)}
    q, k, v, z = t.view(hk, -1, t.shape[-1]).split([dk, dk, r * dv, r * dv], dim=1)
    return {f"{prefix}in_proj_qkv.weight": torch.cat([q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)]),
            f"{prefix}in_proj_z.weight": z.flatten(0, 1).contiguous()}


class Qwen3NextHFAdapter(Qwen35MoeHFAdapter):
    model_type = "qwen3_next"

    def check_export(self, args: Qwen35MoeArgs) -> None:
        refuse_other_routing(args.moe, "HF Qwen3-Next routes by softmax top-k with one gated shared expert",
                             score_func="softmax", num_shared_experts=lambda n: n >= 1, score_before_experts=False)

    def hf_config(self, args: Qwen35MoeArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        cfg = super().hf_config(args, dtype)
        return {**cfg, "architectures": ["Qwen3NextForCausalLM"], "model_type": self.model_type,
                "norm_topk_prob": bool(args.moe.route_norm), "decoder_sparse_step": 1, "mlp_only_layers": []}

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Qwen35MoeArgs:
        if int(cfg.get("decoder_sparse_step", 1) or 1) != 1 or cfg.get("mlp_only_layers"):
            raise HFConversionError("config.json makes some Qwen3-Next layers dense (decoder_sparse_step / "
                                    "mlp_only_layers); every layer is MoE here")
        args = super().args_from_hf_config(cfg)
        args.moe.route_norm = bool(cfg.get("norm_topk_prob", True))
        return args

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        hf = super().to_hf_state(sd, args)
        for prefix in sorted({k.removesuffix("in_proj_qkv.weight") for k in hf if k.endswith("in_proj_qkv.weight")}):
            hf.update(fuse(prefix, hf, args))
        return hf

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        plain: dict[str, torch.Tensor] = {}
        for name, t in sd.items():
            m = _FUSED.match(name)
            plain.update(unfuse(m.group(1), m.group(2), t, args) if m else {name: t})
        return super().from_hf_state(plain, args)
