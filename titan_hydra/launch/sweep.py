"""What a multirun job knows about its sweep: W&B identity and a per-job status file.

A sweep is only useful if its jobs can be found and compared afterwards. Each job of
``python launch.py -m ...`` therefore:
- logs to W&B in the group of its sweep (the sweep dir, e.g. ``sweep-2025-01-31_12-00-00``)
  under a run name made of its own overrides (``optimizer.lr=0.001,parallelism=fsdp``), tagged
  ``sweep``; values the user set in ``logger.wandb`` win. This is decided in the process that
  Hydra runs the job in (``launch.py``), and written into the config, because the workers
  that the local launcher spawns do not see Hydra's state.
- leaves ``status.json`` in its run dir (``JobStatusCallback``, rank 0 only): COMPLETED with its
  return value, or FAILED with the error, which ``recipes/sweep_report.py`` reads.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict


def _hydra_config():
    from hydra.core.hydra_config import HydraConfig

    try:
        return HydraConfig.get()
    except ValueError:  # not under Hydra
        return None


def sweep_group(sweep_dir: str) -> str:
    """W&B group of a sweep: its dir's last two parts (date/time by default), made safe."""
    parts = Path(os.path.normpath(sweep_dir)).parts[-2:]
    return "sweep-" + re.sub(r"[^A-Za-z0-9_.=-]+", "_", "_".join(parts))


def job_name(override_dirname: str, job_num: Any) -> str:
    return override_dirname or f"job{job_num}"


def in_multirun() -> bool:
    """This process runs a job of a Hydra multirun (``-m``)."""
    from hydra.types import RunMode

    hc = _hydra_config()
    return hc is not None and hc.mode == RunMode.MULTIRUN


def apply_sweep_identity(cfg: DictConfig) -> None:
    """A multirun job's identity (no-op otherwise): its sweep's W&B group, ``run_name`` from its
    overrides and the ``sweep`` tag, where the user set none. The W&B backend's name and tags
    then follow from ``run_name`` and ``tags`` the way every run's do (``logger_backends``)."""
    if not in_multirun():
        return
    hc = _hydra_config()
    with open_dict(cfg):
        wandb = cfg.logger.wandb
        if wandb is not None and not wandb.group:
            wandb.group = sweep_group(hc.sweep.dir)
        if not cfg.run_name:
            cfg.run_name = job_name(hc.job.override_dirname, hc.job.num)
        if "sweep" not in cfg.tags:
            cfg.tags = list(cfg.tags) + ["sweep"]


def _is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


class JobStatusCallback(Callback):
    """Hydra callback: write ``status.json`` in the job's output dir when the job ends."""

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        from hydra.core.utils import JobStatus

        if not _is_rank0():
            return
        out = Path(str(config.hydra.runtime.output_dir))
        record: dict[str, Any] = {"status": job_return.status.name}
        if job_return.status == JobStatus.COMPLETED:
            value = job_return.return_value
            record["return_value"] = float(value) if isinstance(value, (int, float)) else None
        else:
            error = job_return._return_value
            lines = str(error).strip().splitlines()
            record["error"] = f"{type(error).__name__}: {lines[-1] if lines else ''}"[:2000]
        record["job_id"] = str(OmegaConf.select(config, "hydra.job.id", default=None))
        record["overrides"] = list(OmegaConf.select(config, "hydra.overrides.task", default=[]) or [])
        out.mkdir(parents=True, exist_ok=True)
        (out / "status.json").write_text(json.dumps(record, indent=1))
