"""Weight averaging against the last weights at a constant LR: the validation loss of the last
checkpoint, of the run's EMA (``training.ema_decay``) and of the average of its last N
checkpoints (``recipes/average_checkpoints.py``). Prints a markdown table and writes JSON.

    python recipes/bench_averaging.py                              # debug Llama, 200 steps, one process
    python recipes/bench_averaging.py --steps 200 --decay 0.95 --every 20 --last 3,5 --out bench_out/avg.json

One run of the debug model (llama3_debug, the default run, at 4 sequences of 128 tokens per step to
keep it a few CPU-minutes) with ``lr_scheduler=constant`` saves a checkpoint every ``--every`` steps; every candidate is then scored by the same function, in
fp32 and one process: the mean next-token loss of the first ``--val-batches`` batches of the
held-out split (what ``val/loss`` averages, at the run's ``training.val_steps``). The run's own
logged ``val/loss`` and ``val/ema/loss`` (its precision, bf16 on a bf16 CPU) are shown beside.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
from pathlib import Path

import torch

from titan_hydra.analysis.flags import add_out, parser
from titan_hydra.checkpoint.average import average_checkpoints
from titan_hydra.checkpoint.offline import load_model
from titan_hydra.groups import compose_config
from titan_hydra.hardware import cpu_model
from titan_hydra.models.objective import cross_entropy_loss
from titan_hydra.spec import spec_of
from titan_hydra.train.pretrain import run
from titan_hydra.train.services import build_dataset


@torch.no_grad()
def val_loss(path: Path, spec, batches: int, weights: str = "model") -> float:
    """Mean fp32 loss of a checkpoint's weights (or EMA) on the first ``batches`` held-out batches."""
    _, _, model = load_model(path, weights=weights)
    loader = build_dataset(spec.data).loader("val", spec.batch.local, infinite=False)
    losses = []
    for inputs, labels in loader:
        if len(losses) == batches:
            break
        losses.append(cross_entropy_loss(model(inputs), labels).item())
    return sum(losses) / len(losses)


def bench(a: argparse.Namespace, work: Path) -> dict:
    overrides = [f"training.steps={a.steps}", "training.local_batch_size=4", "training.seq_len=128",
                 "lr_scheduler=constant", f"training.ema_decay={a.decay}", f"training.val_freq={a.steps}",
                 f"training.val_steps={a.val_batches}", "checkpoint=default", f"checkpoint.interval={a.every}",
                 "checkpoint.keep_latest_k=0", "logger=minimal", *a.overrides]
    spec = spec_of(compose_config(overrides))
    run(spec, str(work))
    logged = [json.loads(line) for line in (work / "metrics.jsonl").read_text().splitlines()]
    last_val = [r for r in logged if "val/loss" in r][-1]
    final = work / "checkpoint" / f"step-{a.steps}"
    rows = [{"weights": f"last (step {a.steps})", "val_loss": val_loss(final, spec, a.val_batches),
             "logged": last_val["val/loss"]},
            {"weights": f"EMA, decay {a.decay}", "val_loss": val_loss(final, spec, a.val_batches, "ema"),
             "logged": last_val["val/ema/loss"]}]
    for n in a.last:
        out = average_checkpoints(work, n, work / f"average-{n}")
        steps = [s["step"] for s in json.loads((out / "COMPLETE.json").read_text())["averaged"]]
        rows.append({"weights": f"average of last {n} (steps {steps[0]}..{steps[-1]})",
                     "val_loss": val_loss(out, spec, a.val_batches), "logged": None})
    return {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "model": spec.flavor, "steps": a.steps, "every": a.every, "lr_scheduler": "constant",
            "overrides": overrides, "rows": rows}


def table(result: dict) -> str:
    lines = ["| weights | val loss (fp32, same batches) | logged by the run |", "|---|---:|---:|"]
    base = result["rows"][0]["val_loss"]
    for r in result["rows"]:
        logged = "" if r["logged"] is None else f"{r['logged']:.4f}"
        delta = "" if r is result["rows"][0] else f" ({r['val_loss'] - base:+.4f})"
        lines.append(f"| {r['weights']} | {r['val_loss']:.4f}{delta} | {logged} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--decay", type=float, default=0.95, help="training.ema_decay")
    p.add_argument("--every", type=int, default=20, help="checkpoint.interval")
    p.add_argument("--last", type=lambda s: [int(x) for x in s.split(",")], default=[3, 5],
                   help="comma-separated: average the last N checkpoints for each N")
    p.add_argument("--val-batches", type=int, default=16, help="held-out batches scored (training.val_steps)")
    add_out(p, "JSON file (default: none)")
    p.add_argument("overrides", nargs="*", help="more launch.py overrides (model.dim=..., optimizer.lr=...)")
    a = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        result = bench(a, Path(work))
    print(f"{result['model']}, {a.steps} steps at a constant LR; {result['cpu']}, {result['threads']} threads")
    print(table(result))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
