"""``dry_run=true`` / ``dry_run=simulate``: what the run would be, printed and left in the run dir
as data, and a sweep of dry runs tabulated when it ends.

Both modes write ``plan.json``: the closed-form plan (``planner/plan.py``) with the planner's
estimated step time and tokens/s for this layout (``planner/auto.py``'s ranking figures, those
``parallelism=auto`` chooses by); ``dry_run=simulate`` adds ``simulation.json``
(``simulate/report.py``). A sweep of dry runs is tabulated from these files alone
(``analysis/layout_sweep.py``), which imports neither the planner's ranking nor the simulator.

In a sweep of dry runs a layout the launch refuses is an answer, not a failure: the job writes
its one-line error to ``refused.json`` and ends normally, so the other layouts still run and the
report has a row saying why (one dry run alone exits 2 with ``error: ...`` as ever). Such a sweep
runs on this machine whatever the cluster (nothing needs a GPU node; one dry run does the same),
and ends with its report: ``DryRunSweepReport``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from titan_hydra.analysis.layout_sweep import PLAN, REFUSED
from titan_hydra.analysis.sweep_report import report
from titan_hydra.errors import UserError
from titan_hydra.launch.sweep import in_multirun
from titan_hydra.planner.auto import estimated_step_time
from titan_hydra.planner.plan import plan
from titan_hydra.simulate.simulator import simulate
from titan_hydra.spec import RunSpec, dry_run_of

BASIC_LAUNCHER = "hydra._internal.core_plugins.basic_launcher.BasicLauncher"


def is_dry_run(cfg: DictConfig) -> bool:
    """``dry_run`` is true or simulate (a value it cannot take: not a dry run; validation says why)."""
    try:
        return dry_run_of(OmegaConf.select(cfg, "dry_run", default=False)) != "false"
    except UserError:
        return False


def write_json(run_dir: str, name: str, record: dict) -> str:
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, name)
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
    return path


def planned(spec: RunSpec) -> dict:
    """The plan's fields and the planner's estimated step time and tokens/s for this layout."""
    p = plan(spec)
    step = estimated_step_time(spec, p)
    return {**p.as_dict(), "estimated_step_time_s": step, "estimated_tokens_per_s": p.tokens_per_step / step}


def dry_run(spec: RunSpec, run_dir: str | None) -> None:
    """Print the plan, or simulate the run and print the simulation; write ``plan.json`` (and
    ``simulation.json``) into ``run_dir`` (None: nowhere). UserError when the simulator refuses."""
    simulation = simulate(spec) if spec.simulate else None  # refusals come before anything is written
    print(simulation.format() if simulation else plan(spec).format(), flush=True)
    if run_dir is None:
        return
    write_json(run_dir, PLAN, planned(spec))
    if simulation:
        print(f"wrote {simulation.write(run_dir)}", flush=True)


def refusal_is_a_result(cfg: DictConfig) -> bool:
    """This job is one layout of a sweep of dry runs: its refusal is a row of the report."""
    return in_multirun() and is_dry_run(cfg)


def record_refusal(run_dir: str, message: str) -> None:
    print(f"refused: {message}", file=sys.stderr, flush=True)
    write_json(run_dir, REFUSED, {"error": message})


def run_here(config: DictConfig) -> None:
    """A sweep of dry runs on a SLURM cluster runs its jobs on this machine, one after another
    (Hydra's basic launcher), as one dry run does: nothing is submitted."""
    if OmegaConf.select(config, "cluster.launcher") != "slurm":
        return
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.launcher = OmegaConf.create({"_target_": BASIC_LAUNCHER})


class DryRunSweepReport(Callback):
    """Hydra callback: a sweep of dry runs ends with its report in the sweep dir (report.md /
    report.csv, one row per layout; analysis/layout_sweep.py), printed. Training sweeps are left
    to ``recipes/sweep_report.py``, run when the user wants it. A job that crashed (a bug, not a
    refusal) makes Hydra end the sweep with its exception before this runs; the recipe then
    writes the same report, the crash a failed row with its status.json error."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir))
        if not is_dry_run(config) or not sweep_dir.is_dir():
            return
        report(sweep_dir)
        print((sweep_dir / "report.md").read_text(), flush=True)
