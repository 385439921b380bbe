"""Anneal branches against fully scheduled runs: one stable run with a cooldown branched off it per
budget (``experiment=anneal_branches``, its two documented commands) against a warmup-cosine run
trained from scratch to each budget. Prints a markdown table (per budget: validation loss of the
branch and of the cosine run; tokens spent in all by each way) and writes JSON and the figure.

    python recipes/bench_anneal.py                               # 100/200/300-step budgets, 20% cooldowns
    python recipes/bench_anneal.py --work /tmp/anneal --json docs/bench/anneal.json --png docs/images/anneal_branches.png

The cosine runs have the base's settings (model, batch, peak LR, validation) and its warmup (12
steps, ``lr_scheduler=stable``'s 5% of the base's 240) and decay to the cooldowns' floor (0).
Every run goes through ``launch.py`` as a user would type it, one after another.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

from titan_hydra.analysis.anneal import anneal_curves, branch_tokens, plot_anneal
from titan_hydra.analysis.flags import parser
from titan_hydra.analysis.runs import tokens_of, val_curve
from titan_hydra.hardware import cpu_model

REPO = Path(__file__).resolve().parents[1]
BUDGETS = (100, 200, 300)
WARMUP = 12  # lr_scheduler=stable's warmup in the base run: round(0.05 * 240)


def launch(args: list[str], cwd: Path, run_dir: str) -> None:
    """``python launch.py ARGS`` in ``cwd`` unless ``run_dir`` there completed already (a rerun
    after an interruption); its last lines on failure."""
    status = cwd / run_dir / "status.json"
    if status.exists() and json.loads(status.read_text()).get("status") == "COMPLETED":
        return
    done = subprocess.run([sys.executable, str(REPO / "launch.py"), *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"launch.py {' '.join(args)} failed:\n{(done.stdout + done.stderr)[-3000:]}")


def run_all(work: Path) -> None:
    """The base, the branch sweep (the experiment's own commands) and the cosine runs, in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    launch(["experiment=anneal_branches", "checkpoint.initial_load_path=null", "hydra.run.dir=outputs/anneal_base"],
           work, "outputs/anneal_base")
    launch(["-m", "experiment=anneal_branches", "hydra.sweep.dir=multirun/branches"], work, "multirun/branches/2")
    for steps in BUDGETS:  # (one at a time: each its own run dir, no sweep params of the experiment's)
        launch(["experiment=anneal_branches", f"training.steps={steps}", "lr_scheduler=warmup_cosine",
                f"lr_scheduler.warmup_steps={WARMUP}", "lr_scheduler.min_lr_factor=0.0", "checkpoint=none",
                "checkpoint.initial_load_path=null", f"hydra.run.dir=outputs/cosine_{steps}"], work, f"outputs/cosine_{steps}")


def table(work: Path) -> dict:
    """Per budget: the branch's and the cosine run's final validation loss; tokens in all (each
    run's logged batches: under a batch schedule a step is not a fixed number of tokens)."""
    base = work / "outputs" / "anneal_base"
    branches = anneal_curves(work / "multirun" / "branches")
    tokens = tokens_of(base)
    spent = branch_tokens(work / "multirun" / "branches", tokens)  # each branch: the base's count, then its own
    stable = dict(val_curve(base))
    rows = []
    for steps in BUDGETS:
        branch = branches.get(steps)
        cosine = val_curve(work / "outputs" / f"cosine_{steps}")
        rows.append({"budget_steps": steps, "budget_tokens": tokens.through(steps),
                     "branch_point": branch[0][0] if branch else None, "val_loss_branch": branch[-1][1] if branch else None,
                     "val_loss_cosine": cosine[-1][1] if cosine else None,
                     "val_loss_stable": stable.get(steps)})  # the unfinished stable run there, if it got there
    base_steps = max(s for s, _ in val_curve(base))
    cosine_tokens = [tokens_of(work / "outputs" / f"cosine_{steps}").through(steps) for steps in BUDGETS]
    return {
        "rows": rows,
        "tokens_branches": tokens.through(base_steps) + sum(spent[steps].through(steps) - tokens.through(r["branch_point"])
                                                            for steps, r in zip(BUDGETS, rows)),
        "tokens_cosine": sum(cosine_tokens),
        "tokens_per_step": tokens.through(1),
        "base_steps": base_steps,
    }


def markdown(result: dict) -> str:
    lines = ["| budget (steps / tokens) | branched at | val loss: branch | val loss: cosine | branch - cosine | "
             "stable run, not cooled |", "|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        b, c, s = r["val_loss_branch"], r["val_loss_cosine"], r["val_loss_stable"]
        lines.append(f"| {r['budget_steps']} / {r['budget_tokens']:,} | {r['branch_point']} | {b:.4f} | {c:.4f} | "
                     f"{b - c:+.4f} | {'-' if s is None else f'{s:.4f}'} |")
    lines += ["", f"tokens spent in all: 1 stable run ({result['base_steps']} steps) + {len(result['rows'])} cooldowns = "
              f"{result['tokens_branches']:,}; {len(result['rows'])} cosine runs = {result['tokens_cosine']:,} "
              f"({result['tokens_branches'] / result['tokens_cosine']:.0%})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, default=Path("bench_out/anneal"), help="where the runs go")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--png", type=Path, default=None, help="write the figure here")
    p.add_argument("--reuse", action="store_true", help="report the runs already in --work, train nothing")
    args = p.parse_args(argv)
    if not args.reuse:
        run_all(args.work)
    result = table(args.work)
    result.update(cpu=cpu_model(), cores=os.cpu_count(), date=datetime.date.today().isoformat(),
                  command="python recipes/bench_anneal.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    print(markdown(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    if args.png:
        cosine = {f"cosine {s}": (val_curve(args.work / "outputs" / f"cosine_{s}"),
                                  tokens_of(args.work / "outputs" / f"cosine_{s}")) for s in BUDGETS}
        plot_anneal(args.work / "multirun" / "branches", args.png, extra=cosine)
    return 0


if __name__ == "__main__":
    sys.exit(main())
