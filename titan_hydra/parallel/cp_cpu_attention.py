"""Ring attention for CPU SDPA: the one place that touches torch's private CP internals.

Why this file exists: torch's context parallelism (``torch.distributed.tensor.experimental.
context_parallel``) turns q/k/v into DTensors sharded on the sequence dim and relies on custom
DTensor op handlers that run ring attention. In torch 2.13 those handlers cover only the CUDA
kernels (flash / efficient / cudnn). On CPU, SDPA dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``), which has neither a
handler nor a sequence-sharding strategy, so CP fails with "does not have a sharding strategy
registered". The ring algorithm itself (``_templated_ring_attention[_backward]``) is kernel
agnostic: it only needs a kernel returning (out, logsumexp) and one returning (dq, dk, dv).
The CPU flash kernel has exactly that contract (logsumexp [B, H, S], same as CUDA), so we
add two handlers that feed it to torch's ring code, and torch's own enable/disable of the CP
dispatcher switches them on and off together with its CUDA ones.

Private torch internals used here, and only here (checked by ``_private()``):
  * ``torch.distributed.tensor.experimental._context_parallel._attention``:
    ``custom_ops`` (dict merged into DTensor's handlers while CP is active),
    ``_templated_ring_attention``, ``_templated_ring_attention_backward``,
    ``_cp_options.enable_load_balance``, ``set_rotate_method``;
  * ``DTensor._local_tensor``, ``DTensor._spec``, the ``DTensor(local, spec, requires_grad=)``
    constructor, ``torch.distributed.tensor._dtensor_spec.{DTensorSpec, TensorMeta}`` and
    ``torch.distributed.tensor._utils.compute_global_tensor_info``.
Registration is idempotent. A torch older than 2.13 or one where any of these moved raises
CPShimUnavailable with the name of what is missing.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

MIN_TORCH = (2, 13)
SEQ_DIM = 2  # q/k/v are [batch, heads, seq, head_dim] inside SDPA

_aten = torch.ops.aten
_FWD = _aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class CPShimUnavailable(RuntimeError):
    """The private torch API this shim relies on is missing (torch version changed)."""


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def _private() -> SimpleNamespace:
    """Import every private name we use; fail with one line naming what moved."""
    if torch_version() < MIN_TORCH:
        raise CPShimUnavailable(
            f"context parallel on CPU needs torch>={'.'.join(map(str, MIN_TORCH))}, found {torch.__version__}"
        )
    try:
        from torch.distributed.tensor import DTensor, Shard
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_global_tensor_info
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attn
    except ImportError as e:
        raise CPShimUnavailable(f"torch {torch.__version__} moved a private CP module: {e}") from e
    needed = ("custom_ops", "_templated_ring_attention", "_templated_ring_attention_backward",
              "_cp_options", "set_rotate_method")
    missing = [n for n in needed if not hasattr(cp_attn, n)]
    if missing:
        raise CPShimUnavailable(
            f"torch {torch.__version__}: {cp_attn.__name__} lacks {', '.join(missing)}; "
            "titan_hydra/parallel/cp_cpu_attention.py must be updated for this torch"
        )
    return SimpleNamespace(DTensor=DTensor, Shard=Shard, DTensorSpec=DTensorSpec, TensorMeta=TensorMeta,
                           global_info=compute_global_tensor_info, cp_attn=cp_attn)


# ----------------------------------------------------------------------------- DTensor glue


def _unwrap(api: SimpleNamespace, values):
    """Local tensors of sequence-sharded DTensors, and their (1-D) mesh."""
    mesh, out = None, []
    for v in values:
        if isinstance(v, api.DTensor):
            if tuple(v._spec.placements) != (api.Shard(SEQ_DIM),):
                raise NotImplementedError(
                    f"CPU ring attention expects q/k/v sharded as (Shard({SEQ_DIM}),), got {v._spec.placements}"
                )
            mesh = v.device_mesh
            v = v._local_tensor
        out.append(v)
    return mesh, out


def _wrap(api: SimpleNamespace, local: torch.Tensor, mesh) -> torch.Tensor:
    placements = (api.Shard(SEQ_DIM),)
    shape, stride = api.global_info(local, mesh, placements)
    meta = api.TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    spec = api.DTensorSpec(mesh, placements, tensor_meta=meta)
    return api.DTensor(local, spec, requires_grad=local.requires_grad)


def _dense(op):
    """``op`` called with contiguous tensors. torch's ring code hands the kernel half-sequence views
    (``chunk`` along the sequence dim of [B, H, S, D]: strided, not dense) of q, k, v, out and
    grad_out under causal load balancing; CUDA's kernels take any strides, and the CPU flash
    kernels' results were right with them too, but a CI run aborted once with heap corruption
    ("malloc(): unaligned tcache chunk detected") in the exchange right after this backward
    under fsdp x cp. Dense copies of half-sequence blocks cost little and rule out the kernels'
    stride handling as the cause."""

    def call(*args, **kwargs):
        args = tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: v.contiguous() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return op(*args, **kwargs)

    return call


def _reject_unsupported(dropout_p: float, attn_mask) -> None:
    if attn_mask is not None:
        raise NotImplementedError("CPU ring attention supports is_causal=True/False only, not attn_mask")
    if dropout_p:
        raise NotImplementedError("CPU ring attention does not support attention dropout")


# ----------------------------------------------------------------------------- handlers


def _flash_cpu_forward(op_call, args, kwargs):
    """(q, k, v, dropout_p=0, is_causal=False, *, attn_mask, scale) -> (out, logsumexp)."""
    api = _private()
    mesh, (q, k, v, *rest) = _unwrap(api, args)
    dropout_p = rest[0] if len(rest) > 0 else kwargs.get("dropout_p", 0.0)
    is_causal = rest[1] if len(rest) > 1 else kwargs.get("is_causal", False)
    _reject_unsupported(dropout_p, kwargs.get("attn_mask"))
    out, lse = api.cp_attn._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, _dense(_FWD), query=q, key=k, value=v,
        is_causal=is_causal, dropout_p=dropout_p, scale=kwargs.get("scale"),
    )
    return _wrap(api, out, mesh), _wrap(api, lse, mesh)


def _flash_cpu_backward(op_call, args, kwargs):
    """(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask, scale) -> (dq, dk, dv)."""
    api = _private()
    mesh, (grad_out, q, k, v, out, lse, dropout_p, is_causal) = _unwrap(api, args)
    _reject_unsupported(dropout_p, kwargs.get("attn_mask"))
    grads = api.cp_attn._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, _dense(_BWD), grad_out=grad_out, grad_out_name="grad_out",
        query=q, key=k, value=v, out=out, logsumexp=lse, is_causal=is_causal,
        dropout_p=dropout_p, scale=kwargs.get("scale"),
    )
    return tuple(_wrap(api, g, mesh) for g in grads[:3])


# ----------------------------------------------------------------------------- public


def check_available() -> None:
    """Raise CPShimUnavailable if this torch lacks what the shim needs (used before launch)."""
    _private()


def register_cpu_sdpa_handlers() -> None:
    """Add the CPU flash-attention ring handlers to torch's CP op table (idempotent).

    They join the table that ``context_parallel`` merges into DTensor's dispatcher on entry
    and removes on exit, so outside a CP context nothing changes.
    """
    table = _private().cp_attn.custom_ops
    table[_FWD] = _flash_cpu_forward
    table[_BWD] = _flash_cpu_backward


def configure_ring_attention(rotate_method: str, device_type: str, load_balance: bool = True) -> None:
    """Rotate method (allgather | alltoall), causal load balancing (on for causal attention; torch
    refuses it for non-causal), CPU handlers if on CPU."""
    api = _private()
    api.cp_attn.set_rotate_method(rotate_method)
    api.cp_attn._cp_options.enable_load_balance = bool(load_balance)
    if device_type == "cpu":
        register_cpu_sdpa_handlers()
