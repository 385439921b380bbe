"""What the ``health`` group costs: the straggler gather, the monitor's per-step work, the
debug model's step time with ``health=default`` against ``health=off``, and one gradient recheck
(``health.recheck_every``). Prints a markdown table and writes JSON.

    python recipes/bench_health.py                       # 2 gloo ranks for the gather, debug model
    python recipes/bench_health.py --steps 30 --reps 3 --out bench_out/health.json

The gather is timed in 2 spawned gloo processes (best and median of ``--gathers`` calls after one
warm-up, which also gathers the hostnames once). The step times come from one process training
the debug model (llama3_debug, the default run) ``--steps`` steps per run, the two settings
alternated ``--reps`` times so load on a shared machine hits both alike; a step's time is its
tokens over the logged throughput, the median of steps 3 onward. A recheck's time is the monitor's
re-run time in a run that rechecks every step (``--recheck-steps``), its share stated at
``--recheck-every``.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from titan_hydra.analysis.flags import add_out, parser
from titan_hydra.groups import compose_config
from titan_hydra.runtime.rendezvous import free_port
from titan_hydra.spec import spec_of
from titan_hydra.train.health.monitor import HealthMonitor
from titan_hydra.config.fault_injection import FaultInjection
from titan_hydra.config.health import Health
from titan_hydra.train.health.stragglers import StragglerCheck
from titan_hydra.train.pretrain import run


def _gather_rank(rank: int, port: int, gathers: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    check = StragglerCheck(every=1, ratio=1.5, rank=rank, world_size=2, device=torch.device("cpu"))
    check.add(0.0, 0.0)  # the warm-up step is not counted
    check.gather(1)  # first call: hostnames too
    times = []
    for step in range(gathers):
        check.add(0.01 * (rank + 1), 0.0)
        t0 = time.perf_counter()
        check.gather(step + 2)
        times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.barrier()
    dist.destroy_process_group()


def gather_seconds(gathers: int) -> list[float]:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "gather.json")
        mp.spawn(_gather_rank, args=(free_port(), gathers, out), nprocs=2)
        return json.loads(Path(out).read_text())


def _debug(overrides: list[str], steps: int, run_dir: str):
    """(spec, summary) of one quiet debug-model run."""
    cfg = compose_config([*overrides, f"training.steps={steps}", "training.log_freq=1", "training.val_freq=0",
                          "logger=minimal"])
    spec = spec_of(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # the table is this script's output, not the runs' logs
        return spec, run(spec, run_dir)


def debug_run(health: str, steps: int, run_dir: str) -> tuple[float, float]:
    """(median step seconds, the monitor's own seconds per step) of one debug-model run."""
    spec, summary = _debug([f"health={health}"], steps, run_dir)
    tokens = spec.batch.global_ * spec.batch.seq_len
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(tokens / r["tps"] for r in rows if r.get("tps") and r["step"] >= 3)
    own = summary.get("health", {}).get("cost_s", 0.0) / steps
    return step_s, own


def recheck_seconds(steps: int, run_dir: str) -> float:
    """Seconds of one gradient recheck (a re-run of the step's forward/backward and the comparison),
    from a debug-model run that rechecks every step."""
    _, summary = _debug(["health=default", "health.recheck_every=1"], steps, run_dir)
    return summary["health"]["recheck_s"] / steps


def monitor_alone(steps: int) -> float:
    """Seconds per step of the monitor's calls with no model (a full spike window, default settings)."""
    class State:
        step = 0

    class NoLog:
        def log(self, metrics, step):
            pass

    with tempfile.TemporaryDirectory() as tmp:
        monitor = HealthMonitor(Health(hang_timeout_s=0), FaultInjection(), run_dir=tmp, rank=0, world_size=1,
                                device=torch.device("cpu"), parts=[], checkpointer=None, loader=None,
                                state=State(), metric_logger=NoLog())
        t0 = time.perf_counter()
        for step in range(1, steps + 1):
            monitor.begin_step(step)
            monitor.judge(3.0 + 0.01 * (step % 7), 1.0 + 0.01 * (step % 5))
            State.step = step
            monitor.end_step(step)
        return (time.perf_counter() - t0) / steps


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--gathers", type=int, default=200)
    p.add_argument("--every", type=int, default=100, help="health.straggler_every to state the gather's share at")
    p.add_argument("--recheck-steps", type=int, default=4, help="steps of the run that rechecks every step")
    p.add_argument("--recheck-every", type=int, default=100, help="health.recheck_every to state the recheck's share at")
    add_out(p, "JSON path", default="bench_out/health.json")
    args = p.parse_args()

    gathers = gather_seconds(args.gathers)
    runs: dict[str, list[tuple[float, float]]] = {"off": [], "default": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for health in ("off", "default"):
                runs[health].append(debug_run(health, args.steps, f"{tmp}/{health}{rep}"))
        recheck = recheck_seconds(args.recheck_steps, f"{tmp}/recheck")
    step_off = statistics.median(s for s, _ in runs["off"])
    step_on = statistics.median(s for s, _ in runs["default"])
    # a section of Python on a loaded machine is sometimes descheduled mid-way: the least is its cost
    own = min(o for _, o in runs["default"])
    isolated = monitor_alone(1000)
    gather = statistics.median(gathers)
    rows = [
        ("straggler gather, 2 gloo ranks (median / best)", f"{gather * 1e3:.3f} / {min(gathers) * 1e3:.3f} ms",
         f"{100 * gather / (args.every * step_off):.4f}% at every {args.every} steps"),
        ("monitor's own work per step in the run (least of runs)", f"{own * 1e6:.1f} us", f"{100 * own / step_off:.4f}%"),
        ("monitor alone, 1000 steps (begin, judge, end)", f"{isolated * 1e6:.1f} us", f"{100 * isolated / step_off:.4f}%"),
        ("gradient recheck (re-run + compare), once", f"{recheck * 1e3:.1f} ms",
         f"{100 * recheck / (args.recheck_every * step_off):.2f}% at every {args.recheck_every} steps"),
        ("debug model step, health=off", f"{step_off * 1e3:.1f} ms", ""),
        ("debug model step, health=default", f"{step_on * 1e3:.1f} ms", f"{100 * (step_on / step_off - 1):+.2f}% (noise-bound)"),
    ]
    print("| what | time | share of a debug-model step |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "args": vars(args),
              "gather_s": gathers, "runs": runs, "step_s_off": step_off, "step_s_default": step_on,
              "monitor_s_per_step": own, "monitor_alone_s_per_step": isolated, "recheck_s": recheck,
              "recheck_share_at_every": recheck / (args.recheck_every * step_off), "gather_share_at_every": gather / (args.every * step_off)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
