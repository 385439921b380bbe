"""The simulation's report: ``simulation.json`` in the run dir and the table a simulate run prints,
each simulated figure beside the closed-form plan's (``planner/plan.py``) with the difference."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field

from titan_hydra.simulate.rank import RankResult

GIB = 1024**3
# What the CPU fake run counts differently from the GPU run it stands for, and how it is accounted.
GPU_NOTES = (
    "attention: torch's CPU flash SDPA (what fake tensors run) saves the output and an fp32 logsumexp per head "
    "and position, as the CUDA flash kernel does; the attention kernel and its dtype are chosen for the "
    "cluster's device (kernel_device), so no CPU-only kernel is counted",
    "loss: the same cross-entropy op runs on both; no fused-loss workspace is assumed on either",
    "allocator: bytes are what tensors occupy; the CUDA caching allocator's reserve on top of it is the "
    "planner's (cluster.memory_headroom), so fits compares the simulated peak with device memory less headroom",
)


@dataclass
class Simulation:
    world_size: int
    layout: str
    flavor: str
    ranks: list[RankResult]
    plan: dict  # the closed-form Plan's fields (GiB)
    usable_bytes: float | None  # device memory less headroom (None on CPU: no limit)
    wall_s: float
    process_peak_bytes: int
    steps: int
    notes: list[str] = field(default_factory=list)

    @property
    def tightest(self) -> RankResult:
        return max(self.ranks, key=lambda r: r.peak_bytes)

    @property
    def fits(self) -> bool:
        return self.usable_bytes is None or self.tightest.peak_bytes <= self.usable_bytes

    def estimate(self) -> dict[str, float]:
        """The planner's per-rank figures in bytes, by the report's column names. Its peak before the
        CUDA caching allocator's reserve (``mem_allocated_gib``): the simulator counts the bytes
        tensors hold, as the planner's other columns do; the reserve is what headroom covers."""
        p = self.plan
        return {"params_bytes": p["mem_params_gib"] * GIB, "grads_bytes": p["mem_grads_gib"] * GIB,
                "optimizer_bytes": p["mem_optimizer_gib"] * GIB, "activations_bytes": p["mem_activations_gib"] * GIB,
                "transient_bytes": p["mem_transient_gib"] * GIB, "peak_bytes": p["mem_allocated_gib"] * GIB}

    def as_json(self) -> dict:
        est = self.estimate()
        ranks = []
        for r in self.ranks:
            row = {k: v for k, v in asdict(r).items() if k not in ("collectives", "stage_output")}
            row["estimate_peak_bytes"] = int(est["peak_bytes"])
            row["estimate"] = {k: int(v) for k, v in est.items()}
            ranks.append(row)
        collectives = [{"rank": r.rank, "stage": r.stage, **asdict(c)} for r in self.ranks for c in r.collectives]
        return {"world_size": self.world_size, "layout": self.layout, "flavor": self.flavor, "steps": self.steps,
                "fits": self.fits, "usable_bytes": self.usable_bytes, "tightest_rank": self.tightest.rank,
                "ranks": ranks, "collectives": collectives, "wall_s": round(self.wall_s, 2),
                "process_peak_bytes": self.process_peak_bytes, "notes": list(self.notes)}

    def write(self, run_dir: str) -> str:
        path = os.path.join(run_dir, "simulation.json")
        os.makedirs(run_dir, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.as_json(), f, indent=1)
        return path

    def format(self) -> str:
        est = self.estimate()
        unit, scale = ("GiB", GIB) if self.tightest.peak_bytes >= GIB else ("MiB", 1024**2)
        cols = ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes", "peak_bytes")
        head = ["rank", "stage", *[c.removesuffix("_bytes") for c in cols]]
        rows = [head]
        for r in self.ranks:
            cells = [str(r.rank), ",".join(map(str, r.stages))]
            for c in cols:
                sim, plan = getattr(r, c), est[c]
                diff = f"{(sim - plan) / plan:+.0%}" if plan else "n/a"
                cells.append(f"{sim / scale:.2f} | {plan / scale:.2f} ({diff})")
            rows.append(cells)
        widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
        lines = [f"simulated {self.flavor} on {self.world_size} ranks ({self.layout}), {self.steps} steps; "
                 f"{unit} per rank: simulated | planner before the allocator's reserve (difference)"]
        lines += ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]
        t = self.tightest
        if self.usable_bytes is None:
            lines.append(f"tightest rank: {t.rank} at {t.peak_bytes / GIB:.2f} GiB (CPU cluster: no device limit)")
        else:
            verdict = "fits" if self.fits else "does NOT fit"
            lines.append(f"tightest rank: {t.rank} at {t.peak_bytes / GIB:.2f} GiB of {self.usable_bytes / GIB:.1f} "
                         f"GiB usable (device memory less headroom): {verdict}")
        lines.append("collectives per step (rank, mesh dim, op: count x, GiB):")
        for r in self.ranks:
            for c in r.collectives:
                lines.append(f"  rank {r.rank} {c.mesh_dim:>12} {c.op:<15} {c.count:>5} x  {c.bytes / GIB:10.3f}")
        lines += [f"note: {n}" for n in self.notes]
        lines.append(f"simulation: {self.wall_s:.1f} s wall, {self.process_peak_bytes / GIB:.2f} GiB peak process "
                     "memory (RSS)")
        return "\n".join(lines)
