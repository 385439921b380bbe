"""What a run says about itself before its first step and after its last (rank 0, console).

A newcomer should not have to read the config dump to know what is training: the header names
the model (family, flavor, parameters total/active), the layout and mesh, the precision and
performance features, the data and the batch; the footer gives the final losses, the time, and
where the metrics went, with the command that uploads an offline W&B run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch

from titan_hydra.metrics.goodput import footer_line


def _fmt_tokens(stats: Mapping[str, Any]) -> str:
    tokens = (stats or {}).get("tokens") or {}
    parts = [f"{int(n):,} {split}" for split, n in tokens.items()]
    return (", ".join(parts) + " tokens") if parts else "streamed (size unknown)"


def run_header(*, flavor: str, family: str, shape, dims, world_size: int, precision: tuple[str, str],
               attention_dtype: torch.dtype | None, ac: str, compile: str, float8: str, data_name: str,
               data_stats: Mapping[str, Any], seq_len: int, local_batch: int, global_batch: int,
               grad_accum: int, steps: int, run_dir: str,
               attention_kernel: tuple[str, str] = ("sdpa", "set explicitly"),
               data_summary: str | None = None, fault_tolerance: str | None = None,
               threads: tuple[int, str] | None = None, health: str | None = None,
               fault_injection: str | None = None, delta_kernel: tuple[str, str] | None = None,
               schedule: str | None = None) -> str:
    """``precision`` and ``attention_kernel``: (what was chosen, why), e.g. ("fp32", "auto: this
    CPU has no native bf16 matmuls"); the header prints both, so an ``auto`` choice is never silent.
    ``data_summary``: a dataset that is not token sequences describes itself (its samples are then
    counted as images, not as tokens of ``seq_len``). ``threads``: (CPU threads of each process,
    why that many), e.g. (1, "2 cores / 2 processes on this host"). ``delta_kernel``: (what runs the
    Gated DeltaNet layers, why); None for a model without them. ``schedule``: a batch / seq-len
    schedule's stages and LR rule (the batch row then gives the largest step)."""
    active = "" if shape.active_params == shape.params else f", {shape.active_params:,} active per token"
    tied = ", tied embeddings" if shape.tied_embeddings else ""
    degrees = [(n, getattr(dims, n)) for n in ("dp_replicate", "dp_shard", "cp", "tp", "pp")]
    mesh = " x ".join(f"{n} {d}" for n, d in degrees if d > 1) or "one process"
    if getattr(dims, "ep", 1) > 1:  # EP adds no ranks: it splits the experts over dp_shard x cp
        mesh += f"; routed experts split over ep {dims.ep} of the dp_shard x cp ranks"
    if getattr(dims, "replica_groups", 1) > 1:  # torchft: this mesh is one of several groups
        mesh += f"; torchft replica group {dims.replica_group} of {dims.replica_groups}"
    mixed_precision, precision_reason = precision
    params = "bf16 params (FSDP), fp32 reduce" if mixed_precision == "bf16" and dims.fsdp_enabled else (
        "bf16 autocast, fp32 params" if mixed_precision == "bf16" else "fp32 params and compute")
    attention = "compute dtype" if attention_dtype is None else str(attention_dtype).replace("torch.", "")
    kernel, kernel_reason = attention_kernel
    rows = [
        ("model", f"{flavor} ({family}): {shape.params:,} parameters{active}{tied}"),
        ("layout", f"{world_size} rank(s): {mesh}"),
        ("precision", f"{mixed_precision} ({precision_reason}): {params}"),
        ("attention", f"{kernel} kernel ({kernel_reason}), in {attention}"),
        *([("linear attn", f"gated delta rule: {delta_kernel[0]} ({delta_kernel[1]})")] if delta_kernel else []),
        ("features", f"activation checkpointing {ac}, compile {compile}, float8 {float8}"),
        ("data", f"{data_name}: {_fmt_tokens(data_stats)}; seq_len {seq_len}" if data_summary is None
                 else f"{data_name}: {data_summary}"),
        ("batch", (f"global {global_batch} sequences = {global_batch * seq_len:,} tokens per step " if data_summary is None
                   else f"global {global_batch} images per step ")
                  + f"(local {local_batch} x data parallel {dims.data_degree} x accumulation {grad_accum}); {steps} steps"),
        *([("schedule", f"{schedule} (batch row: the largest step)")] if schedule else []),
        *([("threads", f"{threads[0]} per process ({threads[1]})")] if threads else []),
        *([("torchft", fault_tolerance)] if fault_tolerance else []),
        *([("health", health)] if health else []),
        *([("FAULTS", fault_injection)] if fault_injection else []),
        ("run dir", str(run_dir)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["titan_hydra run"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def run_footer(summary: Mapping[str, Any], *, seconds: float, run_dir: str, outputs: Mapping[str, str]) -> str:
    """``outputs``: name -> path of what the loggers wrote (see ``MetricLogger.outputs``)."""
    loss = summary.get("final_loss")
    val = summary.get("final_val_loss")
    head = f"done: {summary.get('steps', 0)} steps in {seconds:.1f} s"
    if loss is not None:
        head += f" | final loss {loss:.4f}"
    if val is not None:
        head += f" | val loss {val:.4f}"
    rows = []
    health = summary.get("health")
    if health:
        rows.append(("health", f"{health['skipped']} step(s) skipped, {health['spikes']} spike(s), "
                               f"{health['rollbacks']} rollback(s); checks took {health['cost_s']:.3f} s "
                               f"({100 * health['cost_s'] / max(seconds, 1e-9):.2f}% of the run)"))
    goodput = summary.get("goodput")
    if goodput:
        rows.append(("goodput", footer_line(goodput)))
    if "jsonl" in outputs:
        rows.append(("metrics", outputs["jsonl"]))
    if "tensorboard" in outputs:
        rows.append(("tensorboard", f"tensorboard --logdir {outputs['tensorboard']}"))
    if "wandb" in outputs:
        rows.append(("W&B", f"offline run {outputs['wandb']}; upload: wandb sync {outputs['wandb']}"
                     if "offline" in Path(outputs["wandb"]).name else f"run {outputs['wandb']}"))
    if not rows:
        rows.append(("run dir", str(run_dir)))
    width = max(len(k) for k, _ in rows)
    return "\n".join([head] + [f"  {k:<{width}}  {v}" for k, v in rows])
