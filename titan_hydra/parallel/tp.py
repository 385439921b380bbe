"""Tensor parallelism (Megatron-style) with optional sequence parallel and loss parallel.

Why this plan:

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

Pipeline stages are supported: modules that a stage lacks (``tok_embeddings``, ``norm``,
``output``, deleted layers) are simply not in the plan.
"""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from titan_hydra.errors import ConfigError


def check_config(cfg: DictConfig, dims) -> None:
    """Pre-launch rules for TP that validate.py's generic rules do not cover."""
    if dims.tp <= 1:
        return
    if dims.tp_async:
        if cfg.cluster.device != "cuda" or cfg.cluster.backend != "nccl":
            raise ConfigError(
                "parallelism.tp_async=true needs CUDA + NCCL (cluster.device=cuda, cluster.backend=nccl); "
                "set parallelism.tp_async=false on CPU/gloo"
            )
        if cfg.compile.mode == "none":
            raise ConfigError(
                "parallelism.tp_async=true needs torch.compile (it is an Inductor pass); "
                "set compile=model or parallelism.tp_async=false"
            )
    # Uneven sequence shards make the reduce-scatter/all-gather sizes disagree across ranks
    # (gloo aborts the process: "Received data size doesn't match expected size").
    if dims.tp_sequence_parallel and cfg.training.seq_len % (dims.tp * dims.cp) != 0:
        raise ConfigError(
            f"training.seq_len={cfg.training.seq_len} must be divisible by parallelism.tp*cp="
            f"{dims.tp * dims.cp} for sequence parallel; change the length or set "
            "parallelism.tp_sequence_parallel=false"
        )


def apply_tp(model: nn.Module, dims, cfg: DictConfig) -> nn.Module:
    """Shard ``model`` (a whole Llama3 or one pipeline stage, on meta) over the "tp" mesh dim."""
    mesh = dims.submesh("tp")
    sp, lp = dims.tp_sequence_parallel, dims.loss_parallel_enabled
    parallelize_module(model, mesh, _top_level_plan(model, sp, lp))
    for block in model.layers.values():
        parallelize_module(block, mesh, _block_plan(sp))
    if dims.tp_async:
        _enable_async_tp()
    return model


def _top_level_plan(model: nn.Module, sp: bool, lp: bool) -> dict:
    """Embedding, final norm and output projection (whichever this stage has)."""
    seq = Shard(1) if sp else Replicate()
    plan = {}
    if model.tok_embeddings is not None:
        # Row-wise over the vocab: each rank looks up its rows, then reduce(-scatter) the sum.
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        plan["norm"] = SequenceParallel() if sp else ReplicateParallel()
    if model.output is not None:
        plan["output"] = ColwiseParallel(
            input_layouts=seq,
            output_layouts=Shard(-1) if lp else Replicate(),
            use_local_output=not lp,  # loss_parallel() needs the vocab-sharded DTensor
        )
    return plan


def _block_plan(sp: bool) -> dict:
    """One TransformerBlock: column-wise in, row-wise out; norms sequence-parallel with SP."""
    seq = Shard(1) if sp else Replicate()
    plan = {
        # forward(x, cos, sin): x is gathered to full sequence; cos/sin are already-replicated
        # plain tensors, so their layout is None (left untouched).
        "attention": PrepareModuleInput(
            input_layouts=(seq, None, None),
            desired_input_layouts=(Replicate(), None, None),
            use_local_output=True,
        ),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=seq),
        "feed_forward": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=seq),
    }
    norm_style = SequenceParallel() if sp else ReplicateParallel()
    plan["attention_norm"] = norm_style
    plan["ffn_norm"] = norm_style
    return plan


class ReplicateParallel(ParallelStyle):
    """Keep a module unsharded but make its parameters Replicate DTensors on the TP mesh.

    Without sequence parallel the norms compute on the full (replicated) activations. Their
    weights must still become DTensors on the same mesh as every other parameter: gradient
    clipping's foreach norm and FSDP's 2-D sharding refuse a mix of plain tensors and DTensors.
    Inputs arrive as plain replicated tensors and leave as plain tensors.
    """

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            partition_fn=_replicate_params,
            input_fn=_inputs_to_replicate,
            output_fn=lambda _mod, out, _mesh: out.to_local() if isinstance(out, DTensor) else out,
        )


def _replicate_params(_name: str, module: nn.Module, mesh) -> None:
    for name, param in list(module.named_parameters(recurse=False)):
        dt = DTensor.from_local(param, mesh, [Replicate()], run_check=False)
        module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))


def _inputs_to_replicate(_mod: nn.Module, inputs: tuple, mesh) -> tuple:
    return tuple(
        DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        if isinstance(x, torch.Tensor) and not isinstance(x, DTensor)
        else x
        for x in inputs
    )


def _enable_async_tp() -> None:
    """Turn on Inductor's micro-pipelined (async) TP pass.

    In torch 2.13 symmetric memory no longer has to be enabled per process group
    (``enable_symm_mem_for_group`` is a deprecated no-op), so the Inductor flag is all
    that is left. It only acts on compiled regions; check_config insists on compile.
    """
    if not torch.cuda.is_available():
        raise ConfigError("parallelism.tp_async=true needs CUDA + NCCL; set parallelism.tp_async=false")
    import torch._inductor.config as inductor_config

    inductor_config._micro_pipeline_tp = True
