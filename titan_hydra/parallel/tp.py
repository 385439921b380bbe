"""Tensor parallelism (Megatron-style) with optional sequence parallel and loss parallel.

The plan itself belongs to the model family (``ModelFamily.tp_plan``; the decoder families'
plan is in ``models/common/decoder_family.py``). What the standard decoder plan does and why:

* Each block's attention and MLP are split so that one all-reduce (or, with sequence
  parallel, one all-gather + one reduce-scatter) per sub-layer suffices: wq/wk/wv/w1/w3 are
  column-wise (each rank owns whole heads / a slice of the hidden units), wo/w2 row-wise.
  The model reads its local head counts off the projected shapes, so it needs no TP knowledge.
* Sequence parallel keeps the activations *between* those sub-layers (residual stream, norms)
  sharded along the sequence, cutting their memory by ``tp``; the norms run on their shard.
* Loss parallel leaves the logits sharded along the vocabulary; the trainer computes cross
  entropy under ``loss_parallel()`` so the full [tokens, vocab] logits are never gathered.
* Async TP overlaps those collectives with the matmuls. It is an Inductor pass over NCCL
  symmetric memory, so it needs CUDA, NCCL and torch.compile; on CPU it is refused up front.

Pipeline stages are supported: modules that a stage lacks are simply not in the plan.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from titan_hydra.errors import ConfigError


def check_layout(dims, *, device: str, backend: str, compiled: bool, seq_len: int) -> None:
    """Pre-launch rules for TP that validate.py's generic rules do not cover."""
    if dims.tp <= 1:
        return
    if dims.tp_async:
        if device != "cuda" or backend != "nccl":
            raise ConfigError(
                "parallelism.tp_async=true needs CUDA + NCCL (cluster.device=cuda, cluster.backend=nccl); "
                "set parallelism.tp_async=false on CPU/gloo"
            )
        if not compiled:
            raise ConfigError(
                "parallelism.tp_async=true needs torch.compile (it is an Inductor pass); "
                "set compile=model or parallelism.tp_async=false"
            )
    # Uneven sequence shards make the reduce-scatter/all-gather sizes disagree across ranks
    # (gloo aborts the process: "Received data size doesn't match expected size").
    if dims.tp_sequence_parallel and seq_len % (dims.tp * dims.cp) != 0:
        raise ConfigError(
            f"training.seq_len={seq_len} must be divisible by parallelism.tp*cp="
            f"{dims.tp * dims.cp} for sequence parallel; change the length or set "
            "parallelism.tp_sequence_parallel=false"
        )


def apply_tp(model: nn.Module, family, dims) -> nn.Module:
    """Shard ``model`` (a whole model or one pipeline stage, on meta) over the "tp" mesh dim.

    The plan (which module is column-/row-wise, where sequence parallel starts and ends) is
    the family's (``family.tp_plan``); this function only applies it.
    """
    mesh = dims.submesh("tp")
    plan = family.tp_plan(model, dims.tp_sequence_parallel, dims.loss_parallel_enabled)
    parallelize_module(model, mesh, plan)
    family.finish_tp(model)
    if dims.tp_async:
        _enable_async_tp()
    return model


def _enable_async_tp() -> None:
    """Turn on Inductor's micro-pipelined (async) TP pass.

    In torch 2.13 symmetric memory no longer has to be enabled per process group
    (``enable_symm_mem_for_group`` is a deprecated no-op), so the Inductor flag is all
    that is left. It only acts on compiled regions; validate.py refuses it without compile.
    """
    if not torch.cuda.is_available():
        raise ConfigError("parallelism.tp_async=true needs CUDA + NCCL; set parallelism.tp_async=false")
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
