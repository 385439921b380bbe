"""``dry_run=simulate``: the run, at its configured world size, built and stepped on one CPU.

One process simulates the ranks that differ: one per pipeline stage (pipeline rank ``p`` is the
rank whose other mesh coordinates are 0; the first holds the embedding, the last the head and
loss). Data-parallel, tensor-parallel and expert-parallel peers hold shards of one size (FSDP2
pads uneven shards to the largest), so coordinate 0 stands for all of them. Each simulated rank
runs under torch's fake process group and fake tensors (``rank.py``); the report compares every
figure with the closed-form plan (``report.py``).
"""

from __future__ import annotations

import gc
import multiprocessing
import resource
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from titan_hydra.errors import ConfigError
from titan_hydra.models.protocol import LimitsSimulation, ShapesBatches
from titan_hydra.planner.devices import usable_memory_of
from titan_hydra.planner.plan import layout_label, plan
from titan_hydra.simulate import gpu_attention
from titan_hydra.simulate.fake_world import fake_world
from titan_hydra.simulate.rank import RankResult, simulate_rank
from titan_hydra.simulate.report import GIB, GPU_NOTES, Simulation
from titan_hydra.spec import RunSpec


PARALLEL_RANKS = 2  # rank processes at once (each well under 1 GiB; 2 cores here)


def representative_ranks(dims) -> list[int]:
    """Global rank of each pipeline rank's first member (pp is the outermost mesh dimension)."""
    per_stage = dims.world_size // dims.pp
    return [p * per_stage for p in range(dims.pp)]


def rank_processes() -> multiprocessing.context.BaseContext:
    """Where simulated ranks run: fresh processes forked from a server that imported this module
    once (torch, the models, the parallel code): a rank starts in milliseconds instead of the
    seconds a spawned interpreter spends importing, and inherits no state of this process (the
    server runs no tensor op, so DTensor's caches start empty in every rank)."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def rank_in_world(spec: RunSpec, rank: int, steps: int, stage_input=None) -> RankResult:
    """One simulated rank in a process of its own (run by a fresh worker: DTensor's caches compare
    meshes of different worlds as equal, so one process cannot host two worlds one after the other)."""
    gc.enable()  # a fork server started by a launch pauses collection (launch/gc_paused.py); storages must be freed
    with fake_world(spec.world_size, rank):
        return simulate_rank(spec, rank, int(steps), torch.device(spec.cluster.device), stage_input)


def check_simulable(spec: RunSpec) -> None:
    """One-line refusals for what the simulator cannot represent, before anything is built."""
    if spec.training.simulate_steps < 1:
        raise ConfigError(f"training.simulate_steps={spec.training.simulate_steps} must be >= 1")
    if spec.compiler.enabled:
        raise ConfigError("dry_run=simulate runs eagerly: torch.compile does not trace fake-tensor steps here; "
                          "simulate with compile=none (compile changes activation memory, not the layout)")
    if spec.fault_tolerant:
        raise ConfigError("dry_run=simulate simulates one replica group: set fault_tolerance=none to simulate it")
    if isinstance(spec.family, LimitsSimulation):
        refusal = spec.family.simulation_refusal(spec.model_args, str(spec.cluster.device), spec.mixed_precision)
        if refusal:
            raise ConfigError(refusal)
    if not spec.token_data and not isinstance(spec.family, ShapesBatches):
        raise ConfigError(f"dry_run=simulate makes token batches, and model family {spec.family.name!r} names no "
                          "other batch shapes (ShapesBatches in titan_hydra/models/protocol.py): not simulated")


def simulate(spec: RunSpec, parallel_ranks: int = PARALLEL_RANKS) -> Simulation:
    """Simulate ``training.simulate_steps`` steps of every distinct rank of ``spec``, the ranks after
    the first ``parallel_ranks`` processes at a time."""
    check_simulable(spec)
    started, cpu0 = time.perf_counter(), time.process_time()
    # (each rank runs in a fresh process: one process cannot host two fake worlds in turn)
    steps = int(spec.training.simulate_steps)
    first, *others = representative_ranks(spec.dims)
    fresh = rank_processes()
    with ProcessPoolExecutor(1, mp_context=fresh, max_tasks_per_child=1) as pool:
        head = pool.submit(rank_in_world, spec, first, steps).result()
    results = [head]
    if others:  # the first stage's output shape is what the later stages receive
        with ProcessPoolExecutor(min(parallel_ranks, len(others)), mp_context=fresh, max_tasks_per_child=1) as pool:
            results += list(pool.map(rank_in_world, *zip(*[(spec, r, steps, head.stage_output) for r in others])))
    usable = usable_memory_of(spec.cluster)
    wall = time.perf_counter() - started
    cpu = time.process_time() - cpu0 + sum(r.cpu_s for r in results)
    on_gpu = [gpu_attention.NOTE] if spec.cluster.device == "cuda" else []
    notes = list(GPU_NOTES) + on_gpu + [f"cpu time {cpu:.1f} s over {len(results)} rank process(es); the wall time "
                               "includes their start (imports) and any wait for a shared CPU"]
    return Simulation(
        world_size=spec.world_size, layout=layout_label(spec.dims, spec.dims.ep), flavor=spec.flavor,
        ranks=results, plan=plan(spec).as_dict(), usable_bytes=None if usable is None else usable * GIB,
        wall_s=wall, process_peak_bytes=1024 * max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                                                   resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss),
        steps=steps, notes=notes,
    )
