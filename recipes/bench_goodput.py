"""What the goodput ledger costs: its calls per step alone, and its own time inside the default run.
Prints a markdown table and writes JSON.

    python recipes/bench_goodput.py                              # the default run (llama3_debug), 20 steps
    python recipes/bench_goodput.py --steps 30 --calls 20000 --out bench_out/goodput.json

``alone``: the calls the trainer makes per step (data wait, straggler wait, the checkpoint span,
``goodput/*`` for the loggers, the step record written and flushed), ``--calls`` times into a
temporary ledger; the least of three passes (a pass on a loaded machine is sometimes descheduled).
``in the run``: the default run (``python launch.py`` with ``training.steps=--steps``, console only)
in this process; the ledger times itself (``own_s``: reading the ledger at the start, writing the
records) and its share is of the run's wall time as the ledger counts it. A step's time is its
tokens over the logged throughput, the median of steps 3 onward.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from titan_hydra.groups import compose_config
from titan_hydra.metrics.goodput_ledger import GoodputLedger
from titan_hydra.spec import spec_of
from titan_hydra.train.pretrain import run


def ledger_alone(calls: int) -> float:
    """Seconds per step of the trainer's ledger calls, the least of three passes."""
    best = float("inf")
    for _ in range(3):
        with tempfile.TemporaryDirectory() as tmp:
            ledger = GoodputLedger(tmp, rank=0)
            ledger.begin(0)
            t0 = time.perf_counter()
            for step in range(1, calls + 1):
                ledger.add("data_wait", 1e-4)
                ledger.add("straggler_wait", 0.0)
                with ledger.span("checkpoint"):
                    pass
                ledger.metrics()
                ledger.step(step)
            best = min(best, (time.perf_counter() - t0) / calls)
            ledger.close()
    return best


def default_run(steps: int, run_dir: str) -> tuple[float, dict]:
    """(median step seconds, the ledger's summary) of the default run, ``steps`` steps."""
    cfg = compose_config([f"training.steps={steps}", "training.log_freq=1", "logger=minimal"])
    spec = spec_of(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # the table is this script's output, not the run's log
        summary = run(spec, run_dir)
    tokens = spec.batch.global_ * spec.batch.seq_len
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    step_s = statistics.median(tokens / r["tps"] for r in rows if r.get("tps") and r["step"] >= 3)
    return step_s, summary["goodput"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--out", default="bench_out/goodput.json")
    args = p.parse_args()
    alone = ledger_alone(args.calls)
    with tempfile.TemporaryDirectory() as tmp:
        step_s, goodput = default_run(args.steps, tmp)
    # the run's own attempt: the ledger's total counts this process's start (the imports) too
    own, total = goodput["own_s"], goodput["total_s"]
    rows = [
        ("ledger alone: the trainer's calls per step", f"{alone * 1e6:.1f} us", f"{100 * alone / step_s:.4f}% of a step"),
        ("ledger in the default run: its own time", f"{own * 1e3:.2f} ms over {args.steps} steps",
         f"{100 * own / total:.4f}% of the run's {total:.1f} s"),
        ("default run (llama3_debug) step", f"{step_s * 1e3:.1f} ms", ""),
        ("default run goodput", f"{100 * goodput['goodput']:.1f}%",
         ", ".join(f"{c} {s:.1f} s" for c, s in goodput["categories"].items() if s > 0.05)),
    ]
    print("| what | time | share |\n|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    result = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "args": vars(args), "alone_s_per_step": alone, "step_s": step_s, "alone_share_of_step": alone / step_s,
              "run_own_s": own, "run_total_s": total, "run_own_share": own / total, "run_goodput": goodput}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
