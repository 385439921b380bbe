"""MetricLogger: fan one metrics dict out to the configured backends, on rank 0 only.

Building a backend fails loudly (a misconfigured logger should stop a run before it
spends hours). A backend that fails while logging is reported once and dropped,
because a full disk under TensorBoard should not kill a training run.
"""

from __future__ import annotations

import atexit
import inspect
import logging
import os
from pathlib import Path
from collections.abc import Mapping
from typing import Any

import numpy as np

from titan_hydra.logger.images import save_grid

log = logging.getLogger("titan_hydra")


def _plain(config: Any) -> dict | None:
    """DictConfig -> resolved plain dict (W&B and json need plain containers)."""
    if config is None:
        return None
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(config, DictConfig):
            return OmegaConf.to_container(config, resolve=True, enum_to_str=True)
    except ImportError:
        pass
    return dict(config)


def _accepts(target: Any, name: str) -> bool:
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _to_number(v: Any) -> Any:
    """Tensors / numpy scalars -> Python numbers; anything else unchanged."""
    if hasattr(v, "item") and callable(v.item):
        try:
            return v.item()
        except (ValueError, RuntimeError):
            return v
    return v


def build_backend(spec: Any, run_dir: str, config: dict | None) -> Any:
    """A backend from an object (used as is), a `_target_` mapping, or a callable."""
    if hasattr(spec, "log"):
        return spec
    if isinstance(spec, Mapping) or type(spec).__name__ == "DictConfig":
        from hydra.utils import get_object, instantiate

        # Build a partial, then add `config` by hand: passed through instantiate it would
        # clash with instantiate's own `config` parameter, and its `_target_` entries
        # (model, optimizer, ...) would be instantiated recursively.
        factory = instantiate(spec, run_dir=run_dir, _partial_=True)
        kwargs: dict[str, Any] = {}
        if config is not None and "config" not in spec and _accepts(get_object(spec["_target_"]), "config"):
            kwargs["config"] = config
        obj = factory(**kwargs)
    elif callable(spec):
        kwargs = {"run_dir": run_dir}
        if config is not None and _accepts(spec, "config"):
            kwargs["config"] = config
        obj = spec(**kwargs)
    else:
        raise TypeError(f"cannot build a metrics backend from {spec!r}")
    if not hasattr(obj, "log") and callable(obj):  # `_partial_: true` configs
        obj = obj()
    return obj


class MetricLogger:
    def __init__(self, run_dir: str | os.PathLike, rank: int,
                 backends: Mapping[str, Any] | None, config: Any = None):
        self.run_dir = str(run_dir)
        self.rank = rank
        self.backends: dict[str, Any] = {}
        self._closed = False
        if rank != 0 or not backends:
            return
        cfg = _plain(config)
        try:
            for name, spec in backends.items():
                if spec is None:
                    continue
                self.backends[name] = build_backend(spec, self.run_dir, cfg)
                if cfg is not None and hasattr(self.backends[name], "log_config"):
                    self.backends[name].log_config(cfg)
        except BaseException:
            self.close(exit_code=1)
            raise
        atexit.register(self.close)

    def outputs(self) -> dict[str, str]:
        """Where each open backend writes (read it before ``close``): jsonl file, TensorBoard dir,
        W&B run dir (the one ``wandb sync`` takes)."""
        out: dict[str, str] = {}
        for name, backend in self.backends.items():
            if getattr(backend, "path", None) is not None:
                out["jsonl"] = str(backend.path)
            elif getattr(backend, "log_dir", None) is not None:
                out["tensorboard"] = str(backend.log_dir)
            elif getattr(backend, "run", None) is not None and getattr(backend.run, "dir", None):
                out["wandb"] = str(Path(backend.run.dir).parent)  # run.dir is <run>/files
        return out

    def log(self, metrics: Mapping[str, Any], step: int) -> None:
        if not self.backends:
            return
        # None means "not measured this step"; NaN/inf are kept: a NaN loss must be seen.
        clean = {k: _to_number(v) for k, v in metrics.items() if v is not None}
        for name in list(self.backends):
            try:
                self.backends[name].log(clean, step)
            except Exception as e:  # noqa: BLE001 - see module docstring
                log.error("metrics backend %r failed (%s: %s); disabling it",
                          name, type(e).__name__, e)
                self._close_one(name, None)

    def log_images(self, key: str, images: np.ndarray, step: int, captions: list[str] | None = None) -> Path | None:
        """Pictures (uint8 [N, H, W, 3]) at ``step``: one PNG row under ``<run>/samples/``, the
        pictures themselves to the backends that show them (TensorBoard, W&B), the PNG's path to
        the others (console, metrics.jsonl). Returns the PNG's path (None off rank 0)."""
        if not self.backends:
            return None
        images = np.asarray(images)
        path = save_grid(images, Path(self.run_dir) / "samples" / f"{key.replace('/', '_')}-step{step:06d}.png")
        for name in list(self.backends):
            backend = self.backends[name]
            try:
                if hasattr(backend, "log_images"):
                    backend.log_images(key, images, step, captions)
                else:
                    backend.log({key: str(path)}, step)
            except Exception as e:  # noqa: BLE001 - see module docstring
                log.error("metrics backend %r failed (%s: %s); disabling it", name, type(e).__name__, e)
                self._close_one(name, None)
        return path

    def _close_one(self, name: str, exit_code: int | None) -> None:
        backend = self.backends.pop(name)
        try:
            if exit_code is not None and _accepts(backend.close, "exit_code"):
                backend.close(exit_code=exit_code)
            else:
                backend.close()
        except Exception as e:  # noqa: BLE001 - one failing close must not skip the others
            log.error("closing metrics backend %r failed: %s", name, e)

    def close(self, exit_code: int | None = None) -> None:
        """Close every backend (each even if another raises); safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for name in list(self.backends):
            self._close_one(name, exit_code)
        atexit.unregister(self.close)

    def __enter__(self) -> "MetricLogger":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(exit_code=1 if exc_type is not None else None)
