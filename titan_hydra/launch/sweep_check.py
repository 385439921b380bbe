"""Every sweep point composed and validated before the first job starts.

Hydra's basic sweeper only composes a sweep's jobs (a typo'd key fails there, with Hydra's
multi-line message), and only right before it hands them to the launcher; the project's own
rules (``validate``) ran inside each job, so ``optimizer.lr=1e-3,-1`` under submitit started
both jobs and the second died in its log. ``SweepCheckCallback`` (``hydra.callbacks`` in
conf/config.yaml) runs at ``on_multirun_start``, before the sweeper exists: it expands the
sweep the way the basic sweeper will (``BasicSweeper.split_arguments``), composes and
validates every point, and refuses the sweep with one line naming the first bad point (for a
SLURM cluster it first checks that this machine can submit). Nothing is created, nothing is
submitted.

Sweepers that choose their points as they go (optuna) cannot be expanded up front; the
project's submitit launchers check each batch they receive with the same ``point_problem``
before submitting it, skipping the points this callback already passed.

The callback also hands Hydra's stock submitit launchers (``hydra/launcher=submitit_local``,
``submitit_slurm``) to their titan_hydra subclasses, which submit the same way but report a
failed job as one line instead of submitit's ``UncompletedJobError`` traceback
(``submitit_jobs.py``). It rewrites only ``hydra.launcher._target_``; every other launcher
setting stays the user's.

A sweep of dry runs (``dry_run=true`` / ``simulate``) compares layouts, some of which the launch
refuses: its points are only composed here, each job records its own refusal as its row of the
sweep's report, and on a SLURM cluster it runs on this machine (``launch/dry_run.py``).
"""

from __future__ import annotations

import contextlib
import io
import sys
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, read_write

from titan_hydra.errors import UserError
from titan_hydra.launch.dry_run import is_dry_run, run_here
from titan_hydra.launch.slurm_check import check_slurm
from titan_hydra.launch.resolve import resolved_spec
from titan_hydra.validate import check_spec

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
_STOCK = "hydra_plugins.hydra_submitit_launcher.submitit_launcher."
_OURS = "hydra_plugins.titan_hydra_launcher.launcher."
ADOPTED_LAUNCHERS = {
    _STOCK + "LocalLauncher": _OURS + "TitanLocalLauncher",
    _STOCK + "SlurmLauncher": _OURS + "TitanSubmititSlurmLauncher",
}

# Sweep points (their override lists) that passed point_problem in this process: the
# launchers do not compose them a second time.
checked_points: set[tuple[str, ...]] = set()


def point_label(overrides: Sequence[str], swept: set[str]) -> str:
    """The overrides of one point that the sweep varies (all of them when none is known)."""
    varying = [o for o in overrides if o.split("=", 1)[0] in swept]
    return " ".join(varying or overrides)


def composition_problem(error: Exception) -> str:
    """Hydra's composition error as one line: its first line, plus the cause or the options."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first = lines[0] if lines else type(error).__name__
    starts = [i for i, line in enumerate(lines) if line.startswith("Available options")]
    if starts:  # an unknown group option: Hydra lists the valid ones, then its search path
        options = []
        for line in lines[starts[0] + 1:]:
            if line.startswith("Config search path"):
                break
            options.append(line)
        return f"{first} (options: {', '.join(options)})"
    cause = error.__cause__
    if cause is not None and str(cause).strip():
        return f"{first} ({str(cause).strip().splitlines()[0]})"
    return first


def point_problem(config_loader: Any, config: DictConfig, overrides: Sequence[str],
                  validate: bool = True) -> str | None:
    """Compose one sweep point as its job will, validate it (unless not ``validate``); the
    problem in one line, or None."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        job_cfg = config_loader.load_sweep_config(config, list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        return composition_problem(e)
    if not validate:
        return None
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # parallelism=auto prints its choice per point
            spec = resolved_spec(job_cfg)  # each group built once, as the job's launch will
            # a SLURM submit host leaves the device checks to the compute nodes
            check_spec(spec, environment=spec.cluster.launcher != "slurm")
    except UserError as e:
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    checked_points.add(tuple(overrides))
    return None


def first_problem(config_loader: Any, config: DictConfig, batch: Sequence[Sequence[str]],
                  first_num: int) -> str | None:
    """For a launcher: the first bad point of ``batch`` (numbered from ``first_num``) as one line."""
    for num, overrides in enumerate(batch, start=first_num):
        if tuple(overrides) in checked_points:
            continue
        problem = point_problem(config_loader, config, overrides)
        if problem is not None:
            return f"sweep point #{num} [{' '.join(overrides)}]: {problem}; nothing was submitted"
    return None


def sweep_points(config: DictConfig, config_loader: Any) -> tuple[list[list[str]], set[str]] | None:
    """Every point of a basic-sweeper sweep, in its job order, and the keys it varies
    (None for other sweepers, whose points are not known before they run)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if OmegaConf.select(config, "hydra.sweeper._target_") != BASIC_SWEEPER:
        return None
    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    arguments = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create(config_loader=config_loader).parse_overrides(arguments)
    swept = {o.get_key_element() for o in parsed if o.is_sweep_override()}
    points = [p for batch in BasicSweeper.split_arguments(parsed, None) for p in batch]
    return points, swept


def adopt_launcher(config: DictConfig) -> None:
    """Hydra's stock submitit launchers -> titan_hydra's subclasses (one-line job failures)."""
    target = OmegaConf.select(config, "hydra.launcher._target_")
    if target in ADOPTED_LAUNCHERS:
        with read_write(config.hydra.launcher):
            config.hydra.launcher._target_ = ADOPTED_LAUNCHERS[target]


class SweepCheckCallback(Callback):
    """Hydra callback: refuse a sweep with a bad point before anything runs (see module doc)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from hydra.core.global_hydra import GlobalHydra

        adopt_launcher(config)
        # a sweep of dry runs compares layouts: it runs here, and the layouts the launch refuses
        # are rows of its report (each job records its refusal), so only composing can fail it
        dry = is_dry_run(config)
        if dry:
            run_here(config)
        elif OmegaConf.select(config, "cluster.launcher") == "slurm":
            try:  # no sbatch, an unknown partition: said before the sweep dir exists
                check_slurm(config)
            except UserError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                sys.exit(2)
        if not GlobalHydra.instance().is_initialized():
            return
        config_loader = GlobalHydra.instance().hydra.config_loader
        try:
            expanded = sweep_points(config, config_loader)
        except Exception:  # noqa: BLE001  (a malformed sweep: the sweeper reports it in its own words)
            return
        if expanded is None:
            return
        points, swept = expanded
        bad = []
        for num, overrides in enumerate(points):
            problem = point_problem(config_loader, config, overrides, validate=not dry)
            if problem is not None:
                bad.append((num, overrides, problem))
        if bad:
            num, overrides, problem = bad[0]
            more = f" ({len(bad) - 1} more of the {len(points)} points fail too)" if len(bad) > 1 else ""
            print(f"error: sweep point #{num} [{point_label(overrides, swept)}]: {problem}{more}; "
                  "nothing was launched", file=sys.stderr, flush=True)
            sys.exit(2)
