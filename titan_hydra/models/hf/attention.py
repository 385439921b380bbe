"""``model.attn_implementation``: which attention a transformers architecture runs, and the
platform's own (``auto``) registered with transformers' ``AttentionInterface``.

transformers' modern architectures call attention through one dispatch table
(``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``, the class says so with
``_supports_attention_backend``). ``auto`` registers ``titan_attention`` there, under ``NAME``, with
SDPA's mask builder (``sdpa_mask``: None for a plain causal call, a boolean mask for windows and
packed documents), and exposes on each attention module the two hooks the platform's kernel
policies fill from outside, as on the native ``Attention``: ``causal_kernel`` (the small-head CPU
kernel or the score-matrix kernel, ``kernels/attention_policy.py``) and ``sdpa_dtype``
(``kernels/attention_precision.py``). A call is then:

* plain causal (no mask, no window, no dropout, the default 1/sqrt(d) scale, as many keys as
  queries) with a kernel installed: the kernel, on key/value heads repeated to the query heads;
* anything else: transformers' own ``sdpa_attention_forward``, in ``sdpa_dtype`` when set;
* with packed documents (``titan_doc_ids``, which ``TitanForward`` passes through the layers'
  ``**kwargs``): the mask also keeps each query within its document, whatever the architecture
  did with the position ids (OPT builds its mask without them).

Where the class does not take the dispatch table, ``auto`` is transformers' own ``sdpa``, or
``eager`` for an architecture without an SDPA path (Bloom, MPT, CodeGen, GPT-J; Gemma 2's soft-capped
scores): the run header's attention row says which, and why (``choice``).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
from torch import nn

from titan_hydra.errors import ConfigError

NAME = "titan"  # what config._attn_implementation holds under auto
MODES = ("auto", "sdpa", "eager")


class Attention(NamedTuple):
    """The implementation transformers runs, and the reason the header prints."""

    implementation: str  # NAME, "sdpa" or "eager"
    reason: str


def causal_lm_class(model_type: str) -> type:
    import transformers  # lazy: ~2 s import, an hf run only
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


def choice(model_type: str, mode: str) -> Attention:
    """What ``model.attn_implementation=mode`` runs for this architecture (ConfigError if it cannot)."""
    if mode not in MODES:
        raise ConfigError(f"model.attn_implementation={mode!r} is not one of {', '.join(MODES)}")
    cls = causal_lm_class(model_type)
    sdpa, dispatched = bool(getattr(cls, "_supports_sdpa", False)), bool(getattr(cls, "_supports_attention_backend", False))
    if mode == "eager":
        return Attention("eager", "set explicitly: transformers' eager attention")
    if mode == "sdpa":
        if not sdpa:
            raise ConfigError(f"model.attn_implementation=sdpa: transformers' {model_type} attention has no SDPA path; "
                              "use model.attn_implementation=auto (or eager)")
        return Attention("sdpa", "set explicitly: transformers' own SDPA call")
    if sdpa and dispatched:
        register()
        return Attention(NAME, "auto: the platform's attention through transformers' AttentionInterface")
    if sdpa:
        return Attention("sdpa", f"auto: transformers' {model_type} attention calls SDPA itself, which the "
                                 "platform's kernels cannot reach")
    return Attention("eager", f"auto: transformers' {model_type} attention has no SDPA path, so it runs eager")


# transformers' sdpa_attention_forward, bound by ``register`` (a module global: no import inside the
# attention call, which compiles into each block's fullgraph graph)
_sdpa_forward: Any = None


@functools.lru_cache(maxsize=None)
def register() -> None:
    """``NAME`` in transformers' attention and mask tables (once per process)."""
    global _sdpa_forward
    from transformers import AttentionInterface  # lazy: see causal_lm_class
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    _sdpa_forward = sdpa_attention_forward
    AttentionInterface.register(NAME, titan_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)


def expose_hooks(model: nn.Module) -> None:
    """``causal_kernel`` / ``sdpa_dtype`` / ``n_heads`` on every attention module the kernel policies
    can serve: one with a ``head_dim`` and a ``scaling`` (the query heads: its query width over it)."""
    for module in model.modules():
        head_dim, scaling = getattr(module, "head_dim", None), getattr(module, "scaling", None)
        if isinstance(head_dim, int) and isinstance(scaling, float):
            module.causal_kernel, module.sdpa_dtype = None, None
            module.n_heads = _query_heads(module, head_dim)


def _query_heads(module: nn.Module, head_dim: int) -> int:
    for name in ("num_heads", "num_attention_heads"):
        if isinstance(getattr(module, name, None), int):
            return getattr(module, name)
    config = getattr(module, "config", None)
    return int(getattr(config, "num_attention_heads", 0) or 0) or 1


def document_mask(doc_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """[B, 1, S, S] bool: causal and within the query's document, and within ``attention_mask``."""
    s = doc_ids.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=doc_ids.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    mask = mask[:, None]
    if attention_mask is not None:
        mask = mask & (attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0)
    return mask


def _plain(module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask: Any, dropout: float,
           scaling: float | None, kwargs: dict) -> bool:
    default_scale = scaling is None or abs(scaling * query.shape[-1] ** 0.5 - 1.0) < 1e-6
    extras = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "position_bias"))
    return (attention_mask is None and dropout == 0.0 and default_scale and not extras
            and query.shape[2] == key.shape[2] and getattr(module, "is_causal", True))


def titan_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    titan_doc_ids: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q [B, H, S, D], k/v [B, Hkv, T, D] -> ([B, S, H, Dv], None)."""
    if titan_doc_ids is not None and query.shape[2] == key.shape[2] == titan_doc_ids.shape[1]:
        attention_mask = document_mask(titan_doc_ids, attention_mask)
    kernel = getattr(module, "causal_kernel", None)
    if kernel is not None and _plain(module, query, key, attention_mask, dropout, scaling, kwargs):
        groups = query.shape[1] // key.shape[1]
        if groups > 1:
            key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
        return kernel(query, key, value).transpose(1, 2).contiguous(), None
    dtype = getattr(module, "sdpa_dtype", None)
    if dtype is None or dtype == query.dtype:
        return _sdpa_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    with torch.autocast(query.device.type, enabled=False):  # autocast would cast SDPA's inputs down again
        out, _ = _sdpa_forward(module, query.to(dtype), key.to(dtype), value.to(dtype), attention_mask,
                               dropout=dropout, scaling=scaling, **kwargs)
    return out.to(value.dtype), None
