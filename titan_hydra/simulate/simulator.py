"""``dry_run=simulate``: the run, at its configured world size, built and stepped on one CPU.

One process simulates the ranks that differ: one per pipeline stage (pipeline rank ``p`` is the
rank whose other mesh coordinates are 0; the first holds the embedding, the last the head and
loss). Data-parallel, tensor-parallel and expert-parallel peers hold shards of one size (FSDP2
pads uneven shards to the largest), so coordinate 0 stands for all of them. Each simulated rank
runs under torch's fake process group and fake tensors (``rank.py``); the report compares every
figure with the closed-form plan (``report.py``).
"""

from __future__ import annotations

import resource
import time

import torch

from titan_hydra.errors import ConfigError
from titan_hydra.planner.devices import usable_memory_of
from titan_hydra.planner.plan import layout_label, plan
from titan_hydra.simulate.fake_world import fake_world
from titan_hydra.simulate.rank import simulate_rank
from titan_hydra.simulate.report import GIB, GPU_NOTES, Simulation
from titan_hydra.spec import RunSpec


def representative_ranks(dims) -> list[int]:
    """Global rank of each pipeline rank's first member (pp is the outermost mesh dimension)."""
    per_stage = dims.world_size // dims.pp
    return [p * per_stage for p in range(dims.pp)]


def check_simulable(spec: RunSpec) -> None:
    """One-line refusals for what the simulator cannot represent, before anything is built."""
    if spec.training.simulate_steps < 1:
        raise ConfigError(f"training.simulate_steps={spec.training.simulate_steps} must be >= 1")
    if spec.compiler.enabled:
        raise ConfigError("dry_run=simulate runs eagerly: torch.compile does not trace fake-tensor steps here; "
                          "simulate with compile=none (compile changes activation memory, not the layout)")
    if spec.fault_tolerant:
        raise ConfigError("dry_run=simulate simulates one replica group: set fault_tolerance=none to simulate it")
    if not spec.token_data:
        raise ConfigError(f"dry_run=simulate makes token batches; {spec.flavor} reads other data: not simulated yet")


def simulate(spec: RunSpec) -> Simulation:
    """Simulate ``training.simulate_steps`` steps of every distinct rank of ``spec``."""
    check_simulable(spec)
    started, cpu0 = time.perf_counter(), time.process_time()
    kernel_device = torch.device(spec.cluster.device)
    steps = int(spec.training.simulate_steps)
    results, stage_input = [], None
    for rank in representative_ranks(spec.dims):
        with fake_world(spec.world_size, rank):
            result = simulate_rank(spec, rank, steps, kernel_device, stage_input)
        stage_input = stage_input or result.stage_output
        results.append(result)
    usable = usable_memory_of(spec.cluster)
    wall, cpu = time.perf_counter() - started, time.process_time() - cpu0
    notes = list(GPU_NOTES) + [f"cpu time {cpu:.1f} s (the wall time includes waiting for a shared CPU)"]
    return Simulation(
        world_size=spec.world_size, layout=layout_label(spec.dims, spec.dims.ep), flavor=spec.flavor,
        ranks=results, plan=plan(spec).as_dict(), usable_bytes=None if usable is None else usable * GIB,
        wall_s=wall, process_peak_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        steps=steps, notes=notes,
    )
