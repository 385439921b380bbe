"""Metric sinks: console, metrics.jsonl, TensorBoard, W&B.

Each backend is built by Hydra `instantiate(cfg, run_dir=...)` and has
`log(metrics, step)`, `log_config(config)` and `close()`; TensorBoard and W&B also take pictures
(`log_images(key, images, step, captions)`, uint8 [N, H, W, 3]). Backends receive plain
Python floats (MetricLogger converts tensors) and only ever run on rank 0.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from titan_hydra.logger.wandb_reader import read_offline_run

# key -> (label, formatter). Order here is the console column order.
_FMT: dict[str, tuple[str, Callable[[float], str]]] = {
    "loss": ("loss", lambda v: f"{v:.4f}"),
    "grad_norm": ("grad_norm", lambda v: f"{v:.3g}"),
    "lr": ("lr", lambda v: f"{v:.1e}"),
    "tps": ("tps", lambda v: f"{v:,.0f}"),  # tokens/s per device
    "ips": ("img/s", lambda v: f"{v:,.2f}"),  # images/s per device (an image objective's unit)
    "tflops": ("tflops", lambda v: f"{v:.3g}"),
    "mfu": ("mfu", lambda v: f"{v:.1f}%"),
    "memory_peak_gib": ("mem", lambda v: f"{v:.2f}GiB"),
    "data_time": ("data", lambda v: f"{1e3 * v:.1f}ms"),  # seconds in, ms shown
    "moe/max_over_mean": ("moe_load", lambda v: f"{v:.2f}"),  # worst layer's busiest expert / mean
    "moe/idle_frac": ("idle_experts", lambda v: f"{100 * v:.0f}%"),
}
_DEFAULT = lambda v: f"{v:.4g}" if isinstance(v, float) else str(v)  # noqa: E731
# Logged to the other sinks, too detailed for the one-line console view.
_CONSOLE_HIDDEN = {"memory", "memory_peak_pct", "memory_current_gib", "memory_reserved_gib",
                   "memory_alloc_retries", "tps_global", "ips_global", "time"}

log = logging.getLogger("titan_hydra")


def _per_layer(key: str) -> bool:
    """Per-layer breakdowns (``moe/layer<i>/...``), health counters (``health/*``: the health
    monitor prints its own one-line events) and the goodput ledger's ``goodput/*`` (the end summary
    prints it): logged to files, TB and W&B, not the console line."""
    return key.startswith(("moe/layer", "health/", "goodput/"))


def _fmt_items(metrics: dict[str, Any], fields: Iterable[str] | None) -> str:
    if fields is None:
        keys = [k for k in _FMT if k in metrics]
        keys += [k for k in metrics if k not in _FMT and k not in _CONSOLE_HIDDEN and not _per_layer(k)]
    else:
        keys = [k for k in fields if k in metrics]
    parts = []
    for k in keys:
        label, fmt = _FMT.get(k, (k, _DEFAULT))
        try:
            parts.append(f"{label} {fmt(metrics[k])}")
        except (TypeError, ValueError):
            parts.append(f"{label} {metrics[k]}")
    return " | ".join(parts)


class ConsoleBackend:
    """One compact line per logged step; `val/*` keys get their own line.

    print(flush=True) rather than `logging`: torch elastic forwards each rank's
    stdout, while logging's handlers depend on whoever configured them (Hydra).
    """

    def __init__(self, run_dir: str | os.PathLike | None = None, fields: list[str] | None = None):
        self.fields = list(fields) if fields is not None else None

    def log(self, metrics: dict[str, Any], step: int) -> None:
        train = {k: v for k, v in metrics.items() if not k.startswith("val/")}
        val = {k[4:]: v for k, v in metrics.items() if k.startswith("val/")}
        body = _fmt_items(train, self.fields) if train else ""
        if train and (body or not all(_per_layer(k) for k in train)):  # nothing but file-only keys: no line
            print(f"step {step:>5}" + (f" | {body}" if body else ""), file=sys.stdout, flush=True)
        if val:
            print(f"val  {step:>5} | {_fmt_items(val, None)}", file=sys.stdout, flush=True)

    def log_config(self, config: dict) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlBackend:
    """Appends `{"step", "time", **metrics}` per call; a line is flushed as a whole,
    so a crash leaves only complete lines (readers may skip a torn last line)."""

    def __init__(self, run_dir: str | os.PathLike, filename: str = "metrics.jsonl"):
        self.path = Path(run_dir) / filename
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._f is None:
            return
        row = {"step": int(step), "time": time.time(), **metrics}
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def log_config(self, config: dict) -> None:
        pass

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class TensorBoardBackend:
    """Scalars under the keys as given ("loss", "val/loss": "/" makes TB sections)."""

    def __init__(self, run_dir: str | os.PathLike, subdir: str = "tb"):
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(run_dir) / subdir
        self._w = SummaryWriter(log_dir=str(self.log_dir))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._w is None:
            return
        for k, v in metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._w.add_scalar(k, v, global_step=step)
        self._w.flush()  # logging is every N steps; flushing keeps TB live and crash-safe

    def log_images(self, key: str, images, step: int, captions: list[str] | None = None) -> None:
        if self._w is None:
            return
        self._w.add_images(key, images, global_step=step, dataformats="NHWC")
        self._w.flush()

    def log_config(self, config: dict) -> None:
        if self._w is None:
            return
        text = json.dumps(config, indent=2, default=str)
        # Indented block = preformatted in TB's markdown renderer.
        self._w.add_text("config", "\n".join("    " + line for line in text.splitlines()), 0)
        self._w.flush()

    def close(self) -> None:
        if self._w is not None:
            self._w.close()
            self._w = None


WANDB_MODES = ("offline", "online", "disabled")  # wandb.init's modes (the schema checks logger.wandb.mode)


class WandbBackend:
    """A W&B run under `run_dir/wandb`, offline by default.

    The config goes in at `wandb.init` (a later config update is a separate record
    and shows up late in the UI). `reinit="finish_previous"` because under Hydra's
    in-process multirun a second init would otherwise return the previous job's run.
    `id` + `resume="allow"` lets a requeued SLURM job continue the same run.
    """

    def __init__(self, run_dir: str | os.PathLike, config: dict | None = None,
                 project: str = "titan_hydra", entity: str | None = None,
                 group: str | None = None, name: str | None = None,
                 tags: Iterable[str] = (), mode: str = "offline", job_type: str = "train",
                 notes: str | None = None, id: str | None = None, resume: str | None = None):
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._config_given = config is not None
        self._run = wandb.init(
            dir=str(self.run_dir), project=project, entity=entity, group=group, name=name,
            tags=list(tags or ()), mode=mode, job_type=job_type, notes=notes,
            config=dict(config) if config is not None else None, id=id, resume=resume,
            reinit="finish_previous",
            settings=wandb.Settings(console="off", silent=True, save_code=False),
        )

    @property
    def run(self):
        return self._run

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self._run is not None:
            self._run.log(dict(metrics), step=int(step))

    def log_images(self, key: str, images, step: int, captions: list[str] | None = None) -> None:
        if self._run is None:
            return
        import wandb

        captions = list(captions) if captions is not None else [None] * len(images)
        self._run.log({key: [wandb.Image(image, caption=c) for image, c in zip(images, captions)]}, step=int(step))

    def log_config(self, config: dict) -> None:
        if self._run is not None and not self._config_given:
            self._run.config.update(dict(config), allow_val_change=True)
            self._config_given = True

    def close(self, exit_code: int | None = None) -> None:
        run, self._run = self._run, None
        if run is not None:
            log_file = Path(run.dir).parent / f"run-{run.id}.wandb"  # run.dir is <run>/files
            logging_to_file = log_file.exists()  # not in mode=disabled
            run.finish(exit_code=exit_code)
            if logging_to_file:
                _wait_for_exit_record(log_file)


def _wait_for_exit_record(log_file: Path, timeout_s: float = 10.0) -> None:
    """Return once the run's transaction log holds its exit record (or after timeout_s).

    wandb 0.31's ``finish()`` can return before wandb-core's writer has flushed the log (seen:
    a 7-byte file right after finish, 1.7 kB a moment later, ~1 run in 15), so whoever reads the
    run dir next (tests, sweep reports, ``wandb sync``) could see an empty run.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if read_offline_run(log_file)["exit_code"] is not None:
                return
        except (OSError, ValueError):
            pass  # not created yet, or a record still being written
        time.sleep(0.05)
    log.warning("W&B log %s has no exit record after %.0f s; it may be incomplete", log_file, timeout_s)
