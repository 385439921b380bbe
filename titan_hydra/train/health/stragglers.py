"""Stragglers: every rank's compute and wait time, gathered every ``straggler_every`` steps.

Each rank times its own steps: ``compute`` is the main thread's CPU time in the step (data loading,
forward, backward, the optimizer: work this rank does), ``wait`` the rest of the step's wall time
(blocked in collectives, mostly waiting for the slowest rank). A rank whose compute is well above
the median's is the one the others wait for. The sums since the last gather travel in one
all-gather of 2 numbers per rank, so the check costs nothing on the steps in between; on a GPU the CPU
time counts the host's share only (data, Python, kernel launches), not kernels.
"""

from __future__ import annotations

import socket
import statistics
import time

import torch
import torch.distributed as dist


class StepClock:
    """One step's wall and main-thread CPU time."""

    def __init__(self) -> None:
        self.wall0 = self.cpu0 = 0.0

    def start(self) -> None:
        self.wall0, self.cpu0 = time.perf_counter(), time.thread_time()

    def stop(self) -> tuple[float, float]:
        """(compute, wait) seconds since ``start``."""
        wall = time.perf_counter() - self.wall0
        compute = min(time.thread_time() - self.cpu0, wall)
        return compute, wall - compute


class StragglerCheck:
    """Sums this rank's step times and, when due, gathers everyone's (a collective: all ranks call it)."""

    def __init__(self, every: int, ratio: float, rank: int, world_size: int, device: torch.device) -> None:
        self.every, self.ratio = every, ratio
        self.rank, self.world_size, self.device = rank, world_size, device
        self.sums = [0.0, 0.0]
        self.steps = 0
        self.hosts: list[str] | None = None
        self.gather_s = 0.0  # time spent gathering: the check's own cost
        # the fastest rank's wait on the slowest since the last take (the goodput ledger's straggler_wait)
        self.waited_s = 0.0
        self.warm = False

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.world_size > 1 and dist.is_initialized()

    def add(self, compute: float, wait: float) -> None:
        if not self.warm:  # the first step of a process (lazy init, allocations) says nothing about speed
            self.warm = True
            return
        self.sums[0] += compute
        self.sums[1] += wait
        self.steps += 1

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    def gather(self, step: int) -> tuple[dict[str, float], str | None]:
        """(metrics, console line or None): everyone's mean compute / wait per step since the last gather."""
        t0 = time.perf_counter()
        if self.hosts is None:  # once: which host each rank runs on
            self.hosts = [""] * self.world_size
            dist.all_gather_object(self.hosts, socket.gethostname())
        mine = torch.tensor([s / max(self.steps, 1) for s in self.sums], dtype=torch.float64, device=self.device)
        every = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine)
        compute, wait = [float(t[0]) for t in every], [float(t[1]) for t in every]
        self.waited_s += (max(compute) - min(compute)) * self.steps
        self.sums, self.steps = [0.0, 0.0], 0
        slowest = max(range(self.world_size), key=lambda r: compute[r])
        ratio = compute[slowest] / max(statistics.median(compute), 1e-9)
        metrics = {"health/slowest_rank": float(slowest), "health/straggler_ratio": ratio,
                   "health/compute_s_max": compute[slowest], "health/wait_s_max": max(wait)}
        line = None
        if ratio >= self.ratio:
            others = max(w for r, w in enumerate(wait) if r != slowest)
            line = (f"straggler: rank {slowest} ({self.hosts[slowest]}) computes {ratio:.2f}x the median "
                    f"({compute[slowest]:.3f} s vs {statistics.median(compute):.3f} s per step; the others wait "
                    f"up to {others:.3f} s per step) over steps {step - self.every + 1}-{step}")
        self.gather_s += time.perf_counter() - t0
        return metrics, line
