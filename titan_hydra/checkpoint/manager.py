"""CheckpointManager: the recipe's one handle on checkpointing, composed of the package's parts.

The ``checkpoint`` config group instantiates it as a partial; the recipe adds what it built
(model, optimizer, schedule, loader, train state). It turns the group's settings into
decisions (when to save, what to resume from) and leaves each job to its module:

* ``state``      what a checkpoint holds (``RunParts``: this rank's state dicts and marker)
* ``save``       sync/async saves, the completion marker, keep-latest-k
* ``resume``     which checkpoint a run starts from; seed checkpoints
* ``load``       verify a DCP checkpoint, then apply it (all or nothing)
* ``hf_import``  weights from a Hugging Face directory
* ``rng``        random number generator states
* ``storage``    the on-disk layout, and reading it without trusting it
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from titan_hydra.checkpoint import resume
from titan_hydra.checkpoint.hf_import import load_hf
from titan_hydra.checkpoint.load import load as load_checkpoint
from titan_hydra.checkpoint.save import Saver
from titan_hydra.checkpoint.state import RunParts
from titan_hydra.errors import check_writable_dir

ASYNC_MODES = ("disabled", "async")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class CheckpointSettings:
    """The ``checkpoint`` group's settings and their defaults (its schema is derived from them)."""

    enable: bool = False
    folder: str = "checkpoint"  # relative to the run dir
    interval: int = 500  # save every N steps; 0 = only at the end of the run (and on preemption)
    keep_latest_k: int = 3  # newest complete checkpoints kept; 0 = keep all
    async_mode: str = "disabled"  # one of ASYNC_MODES
    load_step: int = -1  # resume from this step; -1 = the newest complete one
    initial_load_path: Optional[str] = None
    initial_load_model_only: bool = True
    exclude_from_loading: List[str] = field(default_factory=list)
    last_save_model_only: bool = False
    export_dtype: str = "float32"  # one of EXPORT_DTYPES: the last model-only save's dtype
    create_seed_checkpoint: bool = False  # one process: save the initialized model as step-0, train nothing


def _run_field(name: str) -> property:
    """``manager.<name>`` reads and writes ``manager.run.<name>`` (what the recipe passed in)."""
    return property(lambda self: getattr(self.run, name), lambda self, value: setattr(self.run, name, value))


class CheckpointManager:
    """Periodic (a)synchronous saves, keep-latest-k, automatic resume, initial loads."""

    model_parts = _run_field("model_parts")
    optimizer = _run_field("optimizer")
    lr_scheduler = _run_field("lr_scheduler")
    train_loader = _run_field("train_loader")
    train_state = _run_field("train_state")
    dims = _run_field("dims")
    family = _run_field("family")  # titan_hydra.models.protocol.ModelFamily
    model_args = _run_field("model_args")
    flavor = _run_field("flavor")
    rank = _run_field("rank")
    world_size = _run_field("world_size")

    def __init__(
        self,
        *,
        run_dir: str | Path,
        model_parts: list[nn.Module],
        optimizer: torch.optim.Optimizer,
        lr_scheduler,
        train_loader,
        train_state,
        dims,
        family,
        model_args,
        flavor: str,
        rank: int = 0,
        world_size: int = 1,
        ema: Any = None,
        **settings: Any,
    ) -> None:
        """``settings`` are the ``checkpoint`` group's fields (the group instantiates this class as a
        partial); the rest is what the recipe built. ``train_state`` is the trainer's progress
        (step, tokens, losses), saved and restored with everything else; ``ema`` the EMA of the
        weights (train/ema.py), None without one."""
        ckpt = CheckpointSettings(**settings)
        self.cfg = ckpt
        self.enabled = bool(ckpt.enable)
        folder = Path(ckpt.folder)
        self.folder = folder if folder.is_absolute() else Path(run_dir) / folder
        if self.enabled:
            check_writable_dir(self.folder, "checkpoint.folder")  # fail now, not at the first save
        self.run = RunParts(model_parts=model_parts, optimizer=optimizer, lr_scheduler=lr_scheduler,
                            train_loader=train_loader, train_state=train_state, dims=dims, family=family,
                            model_args=model_args, flavor=flavor, rank=rank, world_size=world_size, ema=ema)
        self.seed_only = False  # set by restore() under create_seed_checkpoint: train nothing
        self.async_mode = ckpt.async_mode == "async"
        self.interval = int(ckpt.interval)
        pg = None
        if self.enabled and self.async_mode and world_size > 1:
            pg = dist.new_group(backend="gloo")  # background saves never share the training group
        self.saver = Saver(self.run, self.folder, async_mode=self.async_mode,
                           keep_latest_k=int(ckpt.keep_latest_k), process_group=pg)
        self.loaded_from: str | None = None

    def log(self, message: str) -> None:
        self.run.log(message)

    def layout(self) -> dict[str, int]:
        return self.run.layout()

    def state_to_save(self, model_only: bool = False, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        return self.run.state_to_save(model_only=model_only, dtype=dtype)

    # ------------------------------------------------------------------ saving
    def maybe_save(self, step: int, last: bool = False) -> None:
        """The trainer's call after every step: the interval's saves, and the last step's."""
        self.saver.poll()
        if not self.enabled:
            return
        if last:
            model_only = bool(self.cfg.last_save_model_only)
            dtype = self.cfg.export_dtype if model_only else "float32"
            self.save(step, model_only=model_only, dtype=dtype, wait=True)
        elif self.interval > 0 and step % self.interval == 0:
            self.save(step)

    def save(self, step: int, model_only: bool = False, dtype: str = "float32", wait: bool = False) -> Path:
        """Save step ``step``; async unless ``wait`` or async is off. Returns the step dir."""
        return self.saver.save(step, model_only=model_only, dtype=dtype, wait=wait)

    def wait(self) -> None:
        """Block until a pending async save is complete and marked."""
        self.saver.wait()

    def close(self) -> None:
        self.saver.close()

    # ------------------------------------------------------------------ restoring
    def restore(self) -> int:
        """Resume from this run's checkpoints, else apply ``initial_load_path``. Returns the step."""
        cfg = self.cfg
        if getattr(cfg, "create_seed_checkpoint", False):
            step = resume.create_seed(self.saver)
            self.seed_only = True
            return step
        if not self.enabled and not cfg.initial_load_path:
            return 0
        exclude = list(cfg.exclude_from_loading or [])
        if self.enabled:
            target = resume.resume_target(self.folder, int(cfg.load_step), self.log)
            if target is not None:
                self.load(target, model_only=resume.saved_model_only(target), exclude=exclude)
                return self.train_state.step
        if cfg.initial_load_path:
            self.load_initial(cfg.initial_load_path, model_only=bool(cfg.initial_load_model_only), exclude=exclude)
            return self.train_state.step
        return 0

    def load_initial(self, path: str | Path, model_only: bool = True, exclude: list[str] | None = None) -> None:
        """``initial_load_path``: a step dir, a checkpoint folder (its latest), or an HF directory."""
        path, is_hf = resume.initial_target(path)
        if is_hf:
            self.load_hf(path)
            return
        model_only = model_only or resume.saved_model_only(path)
        self.load(path, model_only=model_only, exclude=exclude, require_marker=False)
        if model_only:
            self.train_state.step = 0

    def load(self, path: str | Path, model_only: bool = False, exclude: list[str] | None = None,
             require_marker: bool = True) -> None:
        """Validate, read everything into fresh tensors, then apply. All or nothing."""
        load_checkpoint(self.run, path, model_only=model_only, exclude=exclude, require_marker=require_marker)
        self.loaded_from = str(Path(path))

    def load_hf(self, path: Path) -> None:
        """Model weights from a Hugging Face directory of this run's family (safetensors + config.json)."""
        load_hf(self.run, path)
        self.loaded_from = str(path)
