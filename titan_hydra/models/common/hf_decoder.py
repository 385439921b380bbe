"""Our decoders <-> Hugging Face's ``*ForCausalLM`` checkpoints: names, expert layouts, the loops.

HF's decoders share one naming scheme (``model.layers.<i>.self_attn.q_proj``, ``mlp.gate_proj``,
``input_layernorm``, ...); families differ in which entries exist (QK-norm, biases, MLA), in
tensor layout (rotary pairing) and in how routed experts are stored (one tensor per expert, or
fused ``gate_up_proj`` / ``down_proj``, transposed or not, gate and up concatenated or
interleaved). ``DecoderHFAdapter`` converts in both directions from a family's tables
(``block_names`` / ``extra_names``, an ``ExpertLayout``, per-tensor hooks); each family's
``hf.py`` declares those and its config.json mapping.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable, Mapping

import torch

from titan_hydra.models.common.decoder import MULTIPLIERS
from titan_hydra.models.protocol import HFAdapter

# our suffix within a block -> HF suffix within model.layers.<i>.
BLOCK_NAMES = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_TOP_INV = {v: k for k, v in TOP_NAMES.items()}
_OURS_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# our stacked expert projection -> HF per-expert projection
EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_EXPERT_INV = {v: k for k, v in EXPERT_NAMES.items()}
_HF_EXPERT_RE = re.compile(r"^(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFConversionError(ValueError):
    """A tensor or config that has no counterpart on the other side."""


# Where a layer's attention multiplier folds, first present wins: a weighted norm on the query
# path (Qwen3's QK-norm, MLA's latent norm: nothing after it rescales q), else the projection.
QUERY_FOLDS = ("attention.q_norm.weight", "attention.wq_b.weight", "attention.wq.weight")


def fold_multipliers(sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """``sd`` with a width parametrization's forward multipliers (``decoder.Multipliers``) folded
    into weights HF's classes have, whose configs hold no multipliers: the logit multiplier into
    ``lm_head``, the attention one into each layer's queries (q, hence every score, scales with
    it; rotary and the softmax scale are linear in q). CompleteP's residual multiplier is refused."""
    logit, attn, residual = (float(getattr(args, k, 1.0)) for k in MULTIPLIERS)
    if residual != 1.0:
        raise HFConversionError(f"model.residual_mult={residual:g} (parametrization=completep) has no counterpart "
                                "in transformers' decoders: export a parametrization=sp or mup model")
    if logit != 1.0 and args.tie_word_embeddings:
        raise HFConversionError("model.logit_mult cannot fold into a tied lm_head (it would scale the embeddings)")
    out = dict(sd)
    if logit != 1.0:
        out["output.weight"] = sd["output.weight"] * logit
    for i in range(args.n_layers) if attn != 1.0 else ():
        name = next((f"layers.{i}.{s}" for s in QUERY_FOLDS if f"layers.{i}.{s}" in sd), None)
        if name is None:
            raise HFConversionError(f"model.attn_mult={attn:g}: layer {i} has no query weight to fold it into")
        out[name] = sd[name] * attn
        bias = name.removesuffix("weight") + "bias"
        if name.endswith("wq.weight") and bias in sd:
            out[bias] = sd[bias] * attn
    return out


def refuse_moved_expert_bias(fqn: str, bias: torch.Tensor, no_bias: str) -> None:
    """An MoE export to an HF class without a selection-only routing bias needs ours at 0.

    ``no_bias`` says so for the HF class, e.g. "HF GPT-OSS has no selection-only routing bias".
    """
    if bool((bias != 0).any()):
        raise HFConversionError(
            f"{fqn} is non-zero (trained with model.moe.load_balance_coeff>0); {no_bias}, so its expert choices "
            "would differ: export needs load_balance_coeff=0")


def ffn_names(ours: str, hf: str) -> dict[str, str]:
    """A SwiGLU feed-forward's weights, ours ``<ours>.w1`` / ``w3`` / ``w2`` -> HF's ``<hf>.gate_proj``
    / ``up_proj`` / ``down_proj``: the one naming of every dense FFN and shared expert HF writes
    (only the module paths differ between families)."""
    return {f"{ours}.{w}.weight": f"{hf}.{proj}.weight" for w, proj in EXPERT_NAMES.items()}


# The routing fields an HF MoE class may fix, in the order a refusal names the model's values.
ROUTING_FIELDS = ("score_func", "route_norm", "route_scale", "num_shared_experts", "num_expert_groups",
                  "score_before_experts")


def refuse_other_routing(moe: Any, how: str, **fixed: Any) -> None:
    """Raise HFConversionError unless ``moe`` (``MoEArgs``) routes as the HF class does: ``how``
    says how that class routes, ``fixed`` maps each field it fixes (of ``ROUTING_FIELDS``) to the
    value it has, or to a test of the value (a callable). No HF class here scales the gates or
    limits routing to expert groups, so route_scale 1 and one group are always fixed. The line
    names the model's values of every fixed field, so one reading shows what to change."""
    fixed = {"route_scale": 1.0, "num_expert_groups": lambda n: n <= 1, **fixed}
    if all(want(getattr(moe, k)) if callable(want) else getattr(moe, k) == want for k, want in fixed.items()):
        return
    values = ", ".join(f"{k}={getattr(moe, k)}" for k in ROUTING_FIELDS if k in fixed)
    raise HFConversionError(f"{how}; this model has {values}")


@dataclass(frozen=True)
class ExpertLayout:
    """How HF stores our routed experts of one MoE layer.

    Ours are stacked per projection: ``feed_forward.experts.w1`` (gate) and ``w3`` (up)
    [E, hidden, dim], ``w2`` (down) [E, dim, hidden], optionally ``w1_bias`` / ``w3_bias``
    [E, hidden] and ``w2_bias`` [E, dim]. HF keeps them under ``model.layers.<i>.<module>.experts``
    either one 2-D tensor per expert (``<j>.gate_proj.weight``, ...; ``per_expert``) or fused:
    ``gate_up_proj`` (gate and up joined along the hidden axis, ``gate_up`` says how),
    ``down_proj`` and, with ``biases``, ``gate_up_proj_bias`` / ``down_proj_bias``. ``transposed``:
    HF's fused weights are [E, in, out] (ours are [E, out, in]). A per-expert layout also reads
    the fused, untransposed pair that transformers holds in memory (its files are per expert).
    """

    module: str = "mlp"
    per_expert: bool = True
    gate_up: str = "concat"  # "concat": gate half first; "interleave": gate at even, up at odd positions
    transposed: bool = False
    biases: bool = False

    def _join(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """Along the last dim (the hidden axis)."""
        if self.gate_up == "interleave":
            return torch.stack((gate, up), dim=-1).flatten(-2)
        return torch.cat((gate, up), dim=-1)

    def _split(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.gate_up == "interleave":
            return t[..., 0::2], t[..., 1::2]
        gate, up = t.chunk(2, dim=-1)
        return gate, up

    def to_hf(self, fqn: str, layer: str, w: str, t: torch.Tensor, sd: dict[str, torch.Tensor]
              ) -> dict[str, torch.Tensor]:
        """HF tensors for our ``layers.<layer>.feed_forward.experts.<w>`` (``fqn``)."""
        proj, bias = w.removesuffix("_bias"), w.endswith("_bias")
        if proj not in EXPERT_NAMES or (bias and (self.per_expert or not self.biases)):
            raise HFConversionError(f"no HF name for parameter {fqn!r}")
        hf = f"model.layers.{layer}.{self.module}.experts"
        if self.per_expert:
            return {f"{hf}.{j}.{EXPERT_NAMES[proj]}.weight": t[j].contiguous() for j in range(t.shape[0])}
        tail = "_bias" if bias else ""
        if proj == "w3":
            return {}  # written with w1
        if proj == "w2":
            return {f"{hf}.down_proj{tail}": (t.transpose(1, 2) if self.transposed and not bias else t).contiguous()}
        up = sd[f"layers.{layer}.feed_forward.experts.w3{tail}"]
        if bias:
            return {f"{hf}.gate_up_proj_bias": self._join(t, up).contiguous()}
        fused = self._join(t.transpose(1, 2), up.transpose(1, 2))  # [E, dim, 2 x hidden]
        return {f"{hf}.gate_up_proj": (fused if self.transposed else fused.transpose(1, 2)).contiguous()}

    def from_hf(self, suffix: str, t: torch.Tensor) -> dict[str, torch.Tensor] | tuple[int, str] | None:
        """For HF's ``model.layers.<i>.<suffix>``: our stacked tensors {w: tensor} from a fused one,
        (expert, w) for a per-expert one, or None when it is not a routed-expert tensor."""
        rest = suffix.removeprefix(f"{self.module}.experts.")
        if rest == suffix:
            return None
        if self.per_expert and (m := _HF_EXPERT_RE.match(rest)):
            return int(m.group(1)), _EXPERT_INV[m.group(2)]
        if rest == "gate_up_proj":
            gate, up = self._split(t if self.transposed else t.transpose(1, 2))
            return {"w1": gate.transpose(1, 2).contiguous(), "w3": up.transpose(1, 2).contiguous()}
        if rest == "down_proj":
            return {"w2": (t.transpose(1, 2) if self.transposed else t).contiguous()}
        if self.biases and rest == "gate_up_proj_bias":
            gate, up = self._split(t)
            return {"w1_bias": gate.contiguous(), "w3_bias": up.contiguous()}
        if self.biases and rest == "down_proj_bias":
            return {"w2_bias": t}
        return None


class DecoderHFAdapter(HFAdapter):
    """Our state dict <-> an HF ``*ForCausalLM`` checkpoint, driven by the family's tables.

    A family declares ``block_names`` (our suffix within ``layers.<i>.`` -> HF's within
    ``model.layers.<i>.``; default: the Llama-style table above) and ``extra_names`` (its additions
    and overrides; import also reads ``block_names``' HF names), ``experts`` (an ``ExpertLayout``
    for MoE layers), ``no_routing_bias`` (HF has no selection-only bias: export refuses a moved
    ``expert_bias`` with that phrase, import starts it at 0 in ``moe_layer_ids``) and, where a
    tensor's layout differs, ``to_hf_tensor`` / ``from_hf_tensor``. This class does the loops:
    tied ``lm_head.weight`` is neither written nor read (HF ties it on load), old checkpoints'
    ``rotary_emb.inv_freq`` buffers are skipped, per-expert tensors are stacked after a count check.
    """

    block_names: ClassVar[Mapping[str, str]] = BLOCK_NAMES
    extra_names: ClassVar[Mapping[str, str]] = {}
    experts: ClassVar[ExpertLayout | None] = None
    no_routing_bias: ClassVar[str | None] = None
    skip_layers_beyond_model = False  # import skips model.layers.<i >= hf_layers(args)> (multi-token prediction)

    def __init__(self) -> None:
        self._names = {**self.block_names, **self.extra_names}
        self._names_inv = {**{v: k for k, v in self.block_names.items()},
                           **{v: k for k, v in self.extra_names.items()}}

    # --- hooks --------------------------------------------------------------------------------
    def check_export(self, args: Any) -> None:
        """Raise HFConversionError for a model the HF class cannot express (before any tensor)."""

    def hf_layers(self, args: Any) -> int:
        """Decoder layers the files number ``model.layers.<i>`` that import reads (the rest are
        skipped when ``skip_layers_beyond_model``): the model's, plus any multi-token prediction ones."""
        return args.n_layers

    def moe_layer_ids(self, args: Any) -> Iterable[int]:
        return range(getattr(args, "n_dense_layers", 0), args.n_layers)

    def to_hf_tensor(self, suffix: str, t: torch.Tensor, args: Any) -> torch.Tensor:
        return t.contiguous()

    def from_hf_tensor(self, suffix: str, t: torch.Tensor, args: Any) -> torch.Tensor:
        return t

    # --- the loops ----------------------------------------------------------------------------
    def to_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        self.check_export(args)
        sd = fold_multipliers(sd, args)
        out: dict[str, torch.Tensor] = {}
        for fqn, t in sd.items():
            if fqn == "output.weight" and args.tie_word_embeddings:
                continue
            if fqn in TOP_NAMES:
                out[TOP_NAMES[fqn]] = t.contiguous()
                continue
            m = _OURS_RE.match(fqn)
            if m is None:
                raise HFConversionError(f"no HF name for parameter {fqn!r}")
            layer, suffix = m.groups()
            if suffix == "feed_forward.expert_bias" and self.no_routing_bias:
                refuse_moved_expert_bias(fqn, t, self.no_routing_bias)
            elif self.experts and suffix.startswith("feed_forward.experts."):
                out.update(self.experts.to_hf(fqn, layer, suffix.removeprefix("feed_forward.experts."), t, sd))
            elif suffix in self._names:
                out[f"model.layers.{layer}.{self._names[suffix]}"] = self.to_hf_tensor(suffix, t, args)
            else:
                raise HFConversionError(f"no HF name for parameter {fqn!r}")
        return out

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        pieces: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # (layer, w) -> {expert: tensor}
        for name, t in sd.items():
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and args.tie_word_embeddings):
                continue  # old HF checkpoints carry the (recomputable) rope buffer; HF ties lm_head on load
            if name in _TOP_INV:
                out[_TOP_INV[name]] = t
                continue
            m = _HF_RE.match(name)
            if m is None:
                raise HFConversionError(f"HF tensor {name!r} has no counterpart in this model")
            layer, suffix = int(m.group(1)), m.group(2)
            if self.skip_layers_beyond_model and layer >= self.hf_layers(args):
                continue
            got = self.experts.from_hf(suffix, t) if self.experts else None
            if isinstance(got, tuple):
                pieces.setdefault((layer, got[1]), {})[got[0]] = t
            elif got is not None:
                out.update({f"layers.{layer}.feed_forward.experts.{w}": v for w, v in got.items()})
            elif suffix in self._names_inv:
                ours = self._names_inv[suffix]
                out[f"layers.{layer}.{ours}"] = self.from_hf_tensor(ours, t, args)
            else:
                raise HFConversionError(f"HF tensor {name!r} has no counterpart in this model")
        for (layer, w), per_expert in sorted(pieces.items()):
            n = args.moe.num_experts
            if sorted(per_expert) != list(range(n)):
                missing, extra = sorted(set(range(n)) - set(per_expert)), sorted(set(per_expert) - set(range(n)))
                what = f"{missing[:4]} of {n} missing" if missing else f"{extra[:4]} beyond the {n} of this model"
                raise HFConversionError(f"layer {layer}: HF experts {what} for {EXPERT_NAMES[w]}")
            out[f"layers.{layer}.feed_forward.experts.{w}"] = torch.stack([per_expert[j] for j in range(n)])
        if self.no_routing_bias:  # HF has no selection-only bias: ours starts at 0
            for i in self.moe_layer_ids(args):
                out[f"layers.{i}.feed_forward.expert_bias"] = torch.zeros(args.moe.num_experts, dtype=torch.float32)
        if args.tie_word_embeddings and "tok_embeddings.weight" in out:
            out["output.weight"] = out["tok_embeddings.weight"]
        return out


def decoder_hf_config(args, *, architecture: str, model_type: str, ffn_dim: int, head_dim: int,
                      rope: dict, dtype: torch.dtype) -> dict:
    """config.json fields every Llama-style HF decoder has; a family adds its own keys."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": args.dim,
        "intermediate_size": ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "rope_parameters": rope,
        "hidden_act": "silu",
        "tie_word_embeddings": bool(args.tie_word_embeddings),
        "attention_bias": False,
        "dtype": DTYPE_NAMES.get(dtype, "float32"),
    }


def rope_theta_of(cfg: dict) -> tuple[float, dict]:
    """(rope_theta, scaling dict) from a config.json, new (rope_parameters) or legacy style."""
    rope = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    return float(theta), {**legacy, **rope}


def rope_of(cfg: dict, supported: tuple[str, ...], family: str = "") -> tuple[float, dict, str]:
    """(rope_theta, scaling dict, rope type) from a config.json; a type outside ``supported`` is refused."""
    theta, scaling = rope_theta_of(cfg)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in supported:
        which = " or ".join(supported) if len(supported) > 1 else f"{supported[0]} only"
        raise HFConversionError(f"rope type {rope_type!r} is not supported{' for ' + family if family else ''} ({which})")
    return theta, scaling, rope_type


def decoder_args_of(cfg: dict, *, norm_eps: float, max_seq_len: int) -> dict[str, Any]:
    """Our args fields that ``decoder_hf_config`` writes, read back; a missing optional key takes the
    HF class's default (``norm_eps``, ``max_seq_len`` are the family's)."""
    dim, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    return {
        "dim": dim,
        "n_layers": int(cfg["num_hidden_layers"]),
        "n_heads": heads,
        "n_kv_heads": int(cfg.get("num_key_value_heads") or heads),
        "head_dim": int(cfg.get("head_dim") or dim // heads),
        "vocab_size": int(cfg["vocab_size"]),
        "norm_eps": float(cfg.get("rms_norm_eps", norm_eps)),
        "max_seq_len": int(cfg.get("max_position_embeddings", max_seq_len)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
    }


def check_model_type(cfg: dict, expected: str) -> None:
    got = cfg.get("model_type", expected)
    if got != expected:
        raise HFConversionError(f"config.json model_type={got!r}; this family reads {expected!r}")
