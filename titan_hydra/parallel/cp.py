"""Context parallelism: each CP rank holds a slice of every sequence; attention runs as a ring.

Why it looks like this: torch's ``context_parallel`` context shards the given buffers along
their sequence dim (in place) and swaps SDPA for ring attention while it is active, so the
model stays parallelism-free. With causal load balancing (head-tail), CP rank r of c holds
sequence chunks r and 2c-1-r of 2c, so every rank does the same attention work.

What must be sharded together: tokens, labels and the rotary tables. The model slices its
rope tables ``[:S]`` with S the (local) sequence length, so the tables are first cut to the
global ``training.seq_len`` (kept lazily here, once per length, full tables remembered), then
sharded with the same permutation as the tokens; each rank thus rotates its tokens by their
true global positions. The context restores the tables on exit; tokens/labels stay sharded.

Gradients: FSDP shards over the flattened ``dp_shard_cp`` mesh and averages gradients over
it; each CP rank's loss is the mean over an equal-size slice, so that average (and the
trainer's ``global_mean`` over ``dp_cp``) equals the single-process mean exactly.

The private-API shim that makes ring attention run on CPU lives in ``cp_cpu_attention.py``.
"""

from __future__ import annotations

import weakref
from typing import ContextManager

import torch

from titan_hydra.errors import ConfigError
from titan_hydra.parallel import cp_cpu_attention  # its functions through the module: tests replace them
from titan_hydra.parallel.parallelism import ParallelDims

# part -> its full-length rope tables, so that a later, longer sequence can be served again.
_FULL_ROPE: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[torch.Tensor, ...]]" = weakref.WeakKeyDictionary()


def fit_rope_buffers(part: torch.nn.Module, seq_len: int, names: tuple[str, ...] = ("rope_cos", "rope_sin")
                     ) -> list[torch.Tensor]:
    """Make ``part``'s rope tables (buffers ``names``, row = position) exactly ``seq_len`` rows
    long; return them (or [] if the part has none)."""
    if not names or not all(isinstance(getattr(part, n, None), torch.Tensor) for n in names):
        return []
    rows = getattr(part, names[0]).shape[0]
    if rows > seq_len:
        _FULL_ROPE[part] = tuple(getattr(part, n) for n in names)
    if rows != seq_len:
        full = _FULL_ROPE.get(part)
        if full is None or full[0].shape[0] < seq_len:
            raise ValueError(f"rope tables have {rows} rows, fewer than the sequence length {seq_len}")
        for name, table in zip(names, full):
            setattr(part, name, table[:seq_len].clone())
    return [getattr(part, n) for n in names]


def cp_context(parts: list[torch.nn.Module], rope_buffers: tuple[str, ...], dims: ParallelDims,
               batch: list[tuple[torch.Tensor, int]]) -> ContextManager:
    """Shard this microbatch's tensors (``(tensor, sequence dim)``, as the family's objective
    lists them: tokens and labels first) and the parts' rope tables over the cp mesh, in place;
    ring attention inside."""
    from torch.distributed.tensor.experimental import context_parallel

    mesh = dims.submesh("cp")
    # Several sequence lengths: streams joined in one non-causal attention (e.g. image and text
    # tokens). torch's load balancer permutes one length only and serves causal attention only;
    # a non-causal ring needs none, so each tensor is cut into cp contiguous chunks here and the
    # context shards only the rope tables (if any).
    joined = len({t.shape[d] for t, d in batch}) > 1
    cp_cpu_attention.configure_ring_attention(dims.cp_rotate_method, mesh.device_type, load_balance=not joined)
    first, first_dim = batch[0]
    seq_len = first.shape[first_dim]
    for tensor, dim in batch:
        if tensor.shape[dim] % (2 * dims.cp):
            raise ValueError(f"a batch tensor of shape {tuple(tensor.shape)} cannot be split along dim {dim} "
                             f"into 2*cp={2 * dims.cp} equal chunks")
    if joined:
        _keep_own_chunk(batch, mesh.get_local_rank(), dims.cp)
        # context_parallel wants one buffer at least (it reads the device off the first): a
        # scratch one, sharded on entry and restored on exit, that nothing reads.
        buffers, seq_dims, batch_tensors = [torch.zeros(2 * dims.cp, device=first.device)], [0], set()
    else:
        buffers, seq_dims = [t for t, _ in batch], [d for _, d in batch]
        batch_tensors = set(buffers)  # sharded for good: the batch is not restored on exit
    for part in parts:
        tables = fit_rope_buffers(part, seq_len, rope_buffers)
        buffers += tables
        seq_dims += [0] * len(tables)
    return context_parallel(mesh, buffers=buffers, buffer_seq_dims=seq_dims, no_restore_buffers=batch_tensors)


def _keep_own_chunk(batch: list[tuple[torch.Tensor, int]], rank: int, cp: int) -> None:
    """Cut each tensor (in place) to chunk ``rank`` of ``cp`` equal chunks along its sequence dim."""
    for tensor, dim in batch:
        chunk = tensor.chunk(cp, dim=dim)[rank].clone()
        tensor.resize_(chunk.shape)
        tensor.copy_(chunk)


def check_layout(dims: ParallelDims, device: str) -> None:
    """Context-parallel settings that cannot work on ``device``, each as a one-line ConfigError."""
    if not dims.cp_enabled:
        return
    if device == "cpu":
        try:
            cp_cpu_attention.check_available()
        except cp_cpu_attention.CPShimUnavailable as e:
            raise ConfigError(f"parallelism.cp={dims.cp} on CPU is unavailable: {e}; set parallelism.cp=1") from e
