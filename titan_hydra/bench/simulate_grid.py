"""The ``simulate_grid`` suite: the closed-form planner against ``dry_run=simulate`` on a grid of
layouts, families, activation-checkpoint modes and world sizes (8 to 2,048 H100 ranks).

Each point is a real-size flavor (its widths, heads, FFN, experts and vocabulary) with its depth
cut by ``model.n_layers`` (2 blocks per pipeline stage, 2-4 without PP), so that a point costs
seconds of CPU: the planner is computed for the same cut config, so like is compared with like
(a full-depth run multiplies the per-block terms, not the kind of error). Per point: the
simulated peak of the tightest rank, the planner's peak before the CUDA allocator's reserve (the
simulator counts the bytes tensors hold, not what the allocator reserves around them), their
difference, and both splits by category (params, grads, optimizer, activations, transient; the
two tools define the last two differently: see ``CATEGORY_NOTE``).

Points run one after another, each simulated rank a spawned process (``simulate``), the ranks
of a pipeline one at a time: the CPU seconds per point are those of all its processes, their
imports included. ``--simulated FILE`` reuses a previous run's simulated figures and recomputes
only the planner's (seconds; points the file lacks are simulated): how a change of the closed form
is measured against the same grid.
"""

from __future__ import annotations

import json
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path

from titan_hydra.groups import compose_config
from titan_hydra.hardware import cpu_isa, cpu_model
from titan_hydra.planner.plan import plan
from titan_hydra.simulate.report import GIB
from titan_hydra.simulate.simulator import simulate
from titan_hydra.validate import validate

CATEGORIES = ("params", "grads", "optimizer", "activations", "transient")
CATEGORY_NOTE = (
    "categories: params, grads and optimizer are the rank's fp32 shards in both; simulated activations = the "
    "most forward's allocations held at once (FSDP's kept unsharded weights included), simulated transient = "
    "the peak less params, optimizer and forward's share at that moment (the gradients made so far included); "
    "planner activations = its dynamic peak less the unsharded weights, planner transient = those weights")
WITHIN = 0.10  # the bound on |planner - simulated| / simulated


@dataclass(frozen=True)
class Point:
    name: str
    family: str
    layout: str  # the mesh dimensions in words (1-D .. 4-D)
    ac: str  # activation_checkpoint group
    nodes: int  # cluster.nnodes (8 H100 per node)
    overrides: tuple[str, ...]  # model, depth, parallelism

    @property
    def world(self) -> int:
        return 8 * self.nodes

    def config(self) -> list[str]:
        return ["cluster=slurm_h100", f"cluster.nnodes={self.nodes}", f"activation_checkpoint={self.ac}",
                "training.seq_len=4096", "training.local_batch_size=2", *self.overrides]


def _p(name, family, layout, ac, nodes, *overrides) -> Point:
    return Point(name, family, layout, ac, nodes, tuple(overrides))


def _pp(pp: int, schedule: str = "1F1B", mb: int = 8) -> tuple[str, ...]:
    """A pipeline of ``pp`` ranks fed ``mb`` micro-batches of one 4096-token sample each."""
    return (f"parallelism.pp={pp}", f"parallelism.pp_schedule={schedule}", f"parallelism.pp_microbatches={mb}",
            f"training.local_batch_size={mb}")


SEL = "selective_op"
GRID = [
    # llama3: dense, 1-D to 4-D
    _p("llama3_8b fsdp", "llama3", "fsdp 8", "none", 1, "model=llama3_8b", "model.n_layers=2", "parallelism=fsdp"),
    _p("llama3_8b fsdp sel", "llama3", "fsdp 64", SEL, 8, "model=llama3_8b", "model.n_layers=2", "parallelism=fsdp"),
    _p("llama3_8b fsdp full", "llama3", "fsdp 256", "full", 32, "model=llama3_8b", "model.n_layers=2",
       "parallelism=fsdp"),
    _p("llama3_8b hsdp", "llama3", "hsdp 2 x 32", "none", 8, "model=llama3_8b", "model.n_layers=2", "parallelism=hsdp"),
    _p("llama3_8b tp", "llama3", "tp 8", "none", 1, "model=llama3_8b", "model.n_layers=2", "parallelism=tp",
       "parallelism.tp=8"),
    _p("llama3_8b ddp", "llama3", "ddp 8", SEL, 1, "model=llama3_8b", "model.n_layers=2", "parallelism=ddp",
       "parallelism.dp_replicate=8"),
    _p("llama3_70b fsdp_tp", "llama3", "fsdp 8 x tp 8", "none", 8, "model=llama3_70b", "model.n_layers=2",
       "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("llama3_70b fsdp_tp sel", "llama3", "fsdp 8 x tp 8", SEL, 8, "model=llama3_70b", "model.n_layers=2",
       "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("llama3_70b fsdp_tp full", "llama3", "fsdp 16 x tp 8", "full", 16, "model=llama3_70b", "model.n_layers=2",
       "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("llama3_70b fsdp_tp 2048", "llama3", "fsdp 256 x tp 8", "none", 256, "model=llama3_70b", "model.n_layers=2",
       "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("llama3_70b 3d", "llama3", "fsdp 16 x tp 8 x pp 4", "none", 64, "model=llama3_70b", "model.n_layers=8",
       "parallelism=3d", "parallelism.tp=8", *_pp(4)),
    _p("llama3_405b fsdp_tp", "llama3", "fsdp 64 x tp 8", "none", 64, "model=llama3_405b", "model.n_layers=2",
       "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("llama3_405b fsdp_tp sel 2048", "llama3", "fsdp 256 x tp 8", SEL, 256, "model=llama3_405b",
       "model.n_layers=2", "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("llama3_405b 3d interleaved full", "llama3", "fsdp 16 x tp 8 x pp 4", "full", 64, "model=llama3_405b",
       "model.n_layers=16", "parallelism=3d", "parallelism.tp=8", *_pp(4, "Interleaved1F1B")),
    _p("llama3_405b 4d sel", "llama3", "hsdp 2 x 16 x tp 8 x pp 4", SEL, 128, "model=llama3_405b",
       "model.n_layers=8", "parallelism=4d", "parallelism.tp=8", *_pp(4)),
    # qwen3: dense, wide attention and QK-norm
    _p("qwen3_0.6b fsdp", "qwen3", "fsdp 8", "none", 1, "model=qwen3_0.6b", "model.n_layers=2", "parallelism=fsdp"),
    _p("qwen3_8b fsdp", "qwen3", "fsdp 16", "none", 2, "model=qwen3_8b", "model.n_layers=2", "parallelism=fsdp"),
    _p("qwen3_14b hsdp full", "qwen3", "hsdp 2 x 32", "full", 8, "model=qwen3_14b", "model.n_layers=2",
       "parallelism=hsdp"),
    _p("qwen3_32b fsdp_tp sel", "qwen3", "fsdp 8 x tp 8", SEL, 8, "model=qwen3_32b", "model.n_layers=2",
       "parallelism=fsdp_tp", "parallelism.tp=8"),
    _p("qwen3_32b 3d full", "qwen3", "fsdp 16 x tp 4 x pp 2", "full", 16, "model=qwen3_32b", "model.n_layers=4",
       "parallelism=3d", "parallelism.tp=4", *_pp(2)),
    _p("qwen3_32b 4d", "qwen3", "hsdp 2 x 8 x tp 8 x pp 2", "none", 32, "model=qwen3_32b", "model.n_layers=4",
       "parallelism=4d", "parallelism.tp=8", *_pp(2)),
    # qwen3_moe
    _p("qwen3_30b_a3b fsdp_ep", "qwen3_moe", "fsdp 64 (ep 8)", "none", 8, "model=qwen3_30b_a3b", "model.n_layers=2",
       "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("qwen3_30b_a3b ep sel", "qwen3_moe", "fsdp 8 (ep 8)", SEL, 1, "model=qwen3_30b_a3b", "model.n_layers=2",
       "parallelism=ep"),
    _p("qwen3_235b fsdp_ep full", "qwen3_moe", "fsdp 256 (ep 8)", "full", 32, "model=qwen3_235b_a22b",
       "model.n_layers=2", "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("qwen3_235b ep pp", "qwen3_moe", "fsdp 128 (ep 8) x pp 4", "none", 64, "model=qwen3_235b_a22b",
       "model.n_layers=8", "parallelism=fsdp_ep", "parallelism.ep=8", *_pp(4)),
    # deepseek_v3: MLA, dense first layer(s), shared experts
    _p("deepseek_v3_16b fsdp sel", "deepseek_v3", "fsdp 8", SEL, 1, "model=deepseek_v3_16b", "model.n_layers=4",
       "parallelism=fsdp"),
    _p("deepseek_v3_16b fsdp_ep", "deepseek_v3", "fsdp 64 (ep 8)", "none", 8, "model=deepseek_v3_16b",
       "model.n_layers=4", "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("deepseek_v3_671b fsdp_ep full", "deepseek_v3", "fsdp 256 (ep 8)", "full", 32, "model=deepseek_v3_671b",
       "model.n_layers=4", "model.n_dense_layers=1", "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("deepseek_v3_671b ep32 2048", "deepseek_v3", "fsdp 2048 (ep 32)", "none", 256, "model=deepseek_v3_671b",
       "model.n_layers=4", "model.n_dense_layers=1", "parallelism=fsdp_ep", "parallelism.ep=32"),
    _p("deepseek_v3_671b ep pp sel", "deepseek_v3", "fsdp 128 (ep 8) x pp 4", SEL, 64, "model=deepseek_v3_671b",
       "model.n_layers=8", "model.n_dense_layers=1", "parallelism=fsdp_ep", "parallelism.ep=8", *_pp(4)),
    # gpt_oss: sliding window, biases, sinks
    _p("gpt_oss_20b fsdp_ep", "gpt_oss", "fsdp 8 (ep 8)", "none", 1, "model=gpt_oss_20b", "model.n_layers=2",
       "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("gpt_oss_120b fsdp_ep sel", "gpt_oss", "fsdp 64 (ep 8)", SEL, 8, "model=gpt_oss_120b", "model.n_layers=2",
       "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("gpt_oss_120b fsdp_ep full", "gpt_oss", "fsdp 128 (ep 16)", "full", 16, "model=gpt_oss_120b",
       "model.n_layers=2", "parallelism=fsdp_ep", "parallelism.ep=16"),
    _p("gpt_oss_120b ep pp", "gpt_oss", "fsdp 64 (ep 8) x pp 2", "none", 16, "model=gpt_oss_120b",
       "model.n_layers=4", "parallelism=fsdp_ep", "parallelism.ep=8", *_pp(2)),
    # hybrids: Gated DeltaNet 3:1
    _p("qwen3_5_9b fsdp", "qwen3_5", "fsdp 8", "none", 1, "model=qwen3_5_9b", "model.n_layers=4", "parallelism=fsdp"),
    _p("qwen3_5_9b fsdp_tp sel", "qwen3_5", "fsdp 16 x tp 4", SEL, 8, "model=qwen3_5_9b", "model.n_layers=4",
       "parallelism=fsdp_tp", "parallelism.tp=4"),
    _p("qwen3_5_9b 3d full", "qwen3_5", "fsdp 8 x tp 4 x pp 2", "full", 8, "model=qwen3_5_9b", "model.n_layers=8",
       "parallelism=3d", "parallelism.tp=4", *_pp(2)),
    _p("qwen3_5_35b_a3b fsdp_ep sel", "qwen3_5", "fsdp 64 (ep 8)", SEL, 8, "model=qwen3_5_35b_a3b",
       "model.n_layers=4", "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("qwen3_next fsdp_ep", "qwen3_next", "fsdp 64 (ep 8)", "none", 8, "model=qwen3_next_80b_a3b",
       "model.n_layers=4", "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("qwen3_next fsdp_ep full", "qwen3_next", "fsdp 128 (ep 8)", "full", 16, "model=qwen3_next_80b_a3b",
       "model.n_layers=4", "parallelism=fsdp_ep", "parallelism.ep=8"),
    # llama4: chunked attention, top-1 experts + shared
    _p("llama4_scout fsdp_ep", "llama4", "fsdp 64 (ep 8)", "none", 8, "model=llama4_scout", "model.n_layers=2",
       "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("llama4_scout fsdp_ep sel", "llama4", "fsdp 128 (ep 16)", SEL, 16, "model=llama4_scout", "model.n_layers=2",
       "parallelism=fsdp_ep", "parallelism.ep=16"),
    _p("llama4_maverick fsdp_ep full", "llama4", "fsdp 128 (ep 8)", "full", 16, "model=llama4_maverick",
       "model.n_layers=2", "parallelism=fsdp_ep", "parallelism.ep=8"),
    _p("llama4_scout ep pp", "llama4", "fsdp 64 (ep 8) x pp 2", "none", 16, "model=llama4_scout", "model.n_layers=4",
       "parallelism=fsdp_ep", "parallelism.ep=8", *_pp(2)),
]


def spec_of(point: Point):
    return validate(compose_config(point.config()), environment=False)


def planner_figures(spec) -> dict:
    """The planner's per-rank figures (bytes) for ``spec``: the categories, the peak before the
    allocator's reserve (``peak``) and with it (``reserved_peak``)."""
    p = plan(spec)
    return {"params": p.mem_params_gib * GIB, "grads": p.mem_grads_gib * GIB, "optimizer": p.mem_optimizer_gib * GIB,
            "activations": p.mem_activations_gib * GIB, "transient": p.mem_transient_gib * GIB,
            "peak": p.mem_allocated_gib * GIB, "reserved_peak": p.mem_total_gib * GIB}


def simulated_figures(sim) -> dict:
    """The tightest rank's figures (bytes) and every simulated rank's peak."""
    t = sim.tightest
    return {"rank": t.rank, "stages": t.stages, **{c: getattr(t, f"{c}_bytes") for c in CATEGORIES},
            "peak": t.peak_bytes, "rank_peaks": {str(r.rank): r.peak_bytes for r in sim.ranks},
            "sim_cpu_s": sum(r.cpu_s for r in sim.ranks)}


def cpu_seconds() -> float:
    """User + system CPU of this process and its reaped children (the rank processes)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def error(planner: float, simulated: float) -> float:
    """(planner - simulated) / simulated."""
    return (planner - simulated) / simulated


def row_of(point: Point, simulated: dict | None = None) -> dict:
    """One grid point: simulated (unless given), planned, compared."""
    row = {"name": point.name, "family": point.family, "layout": point.layout, "ac": point.ac, "world": point.world,
           "overrides": point.config()}
    t0, c0 = time.time(), cpu_seconds()
    try:
        spec = spec_of(point)
        if simulated is None:
            simulated = simulated_figures(simulate(spec, parallel_ranks=1))
            row.update(wall_s=round(time.time() - t0, 1), cpu_s=round(cpu_seconds() - c0, 1))
        row.update(simulated=simulated, planner=planner_figures(spec))
    except Exception as e:  # a point the build refuses (UserError) or trips on is a row saying so
        row["failed"] = (str(e).strip().splitlines() or [type(e).__name__])[-1][:200]
        return row
    row["error"] = error(row["planner"]["peak"], simulated["peak"])
    return row


def summary(rows: list[dict]) -> dict:
    ok = [r for r in rows if "error" in r]
    within = [r for r in ok if abs(r["error"]) <= WITHIN]
    by_category = {}
    for c in ("activations", "transient", "peak"):
        errs = [error(r["planner"][c], r["simulated"][c]) for r in ok if r["simulated"][c]]
        by_category[c] = {"median": sorted(errs)[len(errs) // 2] if errs else None,
                          "min": min(errs, default=None), "max": max(errs, default=None)}
    return {"points": len(rows), "simulated": len(ok), "within_10pct": len(within),
            "failed": [r["name"] for r in rows if "failed" in r], "error_by_category": by_category}


def format_rows(rows: list[dict], title: str) -> list[str]:
    cols = ["point", "world", "layout", "AC", "sim peak (rank)", "plan peak", "err", "plan reserved",
            *(f"{c} sim/plan" for c in CATEGORIES), "CPU s"]
    lines = [title, "", "| " + " | ".join(cols) + " |", "|---|" + "---|" * (len(cols) - 1)]
    for r in rows:
        if "failed" in r:
            lines.append(f"| {r['name']} | {r['world']} | {r['layout']} | {r['ac']} | failed: {r['failed']} |")
            continue
        s, p = r["simulated"], r["planner"]
        cells = [r["name"], str(r["world"]), r["layout"], r["ac"], f"{s['peak'] / GIB:.2f} ({s['rank']})",
                 f"{p['peak'] / GIB:.2f}", f"{r['error']:+.0%}", f"{p['reserved_peak'] / GIB:.2f}",
                 *(f"{s[c] / GIB:.2f} / {p[c] / GIB:.2f}" for c in CATEGORIES), str(r.get("cpu_s", "-"))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def simulate_grid_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """Every grid point (or those whose name contains ``--variant``) simulated and planned; with
    ``--simulated FILE`` the simulated figures of the points that file has are reused (only the
    planner runs for them) and the others (new, or failed there) are simulated."""
    reuse = {}
    if args.simulated:
        reuse = {r["name"]: r for r in json.loads(Path(args.simulated).read_text())["rows"] if "simulated" in r}
    points = [p for p in GRID if not args.variant or args.variant in p.name]
    out = Path(args.out or "bench_out/simulate_grid.json")
    rows: list[dict] = []
    result = {}
    for point in points:
        old = reuse.get(point.name)
        row = row_of(point, old["simulated"] if old else None)
        if old:
            row.update({k: old[k] for k in ("wall_s", "cpu_s") if k in old})
        rows.append(row)
        print(format_rows([row], "")[-1], flush=True)
        result = {"suite": "simulate_grid", "cpu": f"{cpu_model()} ({cpu_isa()})", "cores": os.cpu_count(),
                  "date": time.strftime("%Y-%m-%d"), "notes": [NOTE, CATEGORY_NOTE], "rows": rows,
                  "summary": summary(rows)}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))  # after every point: a long grid keeps what it has
    s = summary(rows)
    title = (f"suite `simulate_grid` — {time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_isa()}), {os.cpu_count()} cores; "
             f"GiB per rank; {s['within_10pct']} of {s['simulated']} simulated points within 10% "
             f"({len(s['failed'])} failed)" + (f"; simulated figures from {args.simulated}" if args.simulated else ""))
    lines = format_rows(rows, title) + ["", f"note: {NOTE}", f"note: {CATEGORY_NOTE}"]
    return lines, result


NOTE = ("depth cut by model.n_layers (real widths); the planner is computed for the same cut config, so like is "
        "compared with like; plan peak = before the CUDA allocator's reserve (the simulator counts tensor bytes), "
        "plan reserved = with it; err = (plan peak - simulated peak) / simulated peak")
