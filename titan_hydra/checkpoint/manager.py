"""CheckpointManager: save and restore everything a run needs to continue exactly.

What one checkpoint holds (flat DCP keys, all tensors, see storage.py for why):

* ``model.<fqn>``            parameters, as this rank holds them (DTensor shards under FSDP/TP,
                             only its stages under PP); DCP records global shapes, so a
                             checkpoint saved under one layout loads under any other.
* ``optim.state.<fqn>.<k>``  optimizer state keyed by parameter FQN (layout independent).
* ``extra``                  JSON: train state, LR schedule, optimizer hyper-parameters,
                             data loader position (identical on every rank, written once).
* ``rank_state.<rank>``      JSON: python / numpy / torch RNG states of that rank (and a
                             streaming loader's per-rank state). Restored only under the same
                             world size and layout: RNG streams have no meaning across layouts.

Saves go to ``step-N/`` and count once rank 0 wrote the completion marker after every rank
finished (a barrier for sync saves; for async saves rank 0's DCP future, which only resolves
after DCP gathered every rank's write results and wrote ``.metadata``). Async saves use a
dedicated gloo process group so that their background collectives never interleave with the
training step's collectives on the default group.

Loading validates first (marker, model flavor, keys, shapes, data file lengths and checksums,
the data loader's position) and reads into fresh tensors; only when every read succeeded are
model, optimizer and the rest replaced, so a bad checkpoint fails with one message and leaves
the run untouched.

A save that fails (disk full, an unwritable folder) stops the run with one line; its step dir
never gets a marker (rank 0 removes what was written), and the previous complete checkpoint is
untouched: older ones are only purged after a newer one is complete.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from titan_hydra.train.optimizers import members
from titan_hydra.checkpoint.storage import (
    CheckpointError,
    check_files,
    json_tensor,
    latest_complete,
    list_steps,
    read_marker,
    read_metadata,
    remove_dir,
    safe_reader,
    step_dir,
    tensor_entries,
    tensor_json,
    verify_files,
    write_marker,
)
from titan_hydra.errors import UserError, first_line

# DCP reports a rank's failed read or write as CheckpointException, a BaseException (not an Exception).
DCP_ERRORS = (Exception, CheckpointException)
FORMAT_VERSION = 1
CATEGORIES = ("model", "optimizer", "lr_scheduler", "dataloader", "train_state", "rng")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def signature_diff(saved: dict[str, Any], ours: dict[str, Any]) -> list[str]:
    """Fields of two model signatures (``ModelFamily.signature``) that disagree; a checkpoint written
    before a field existed is not judged on it."""
    from titan_hydra.models.registry import LEGACY_FAMILY

    saved = {"family": LEGACY_FAMILY, **saved}
    return [f"{k}={saved[k]!r} (run has {v!r})" for k, v in ours.items() if k in saved and saved[k] != v]


def _root_cause(error: BaseException) -> str:
    """One line for a failed save: DCP wraps each rank's OSError (ENOSPC...) in CheckpointException."""
    seen = error
    for _ in range(8):
        failures = getattr(seen, "failures", None)  # DCP's CheckpointException: {rank: exception}
        if isinstance(failures, dict) and failures:
            rank, inner = sorted(failures.items())[0]
            inner = inner[0] if isinstance(inner, tuple) else inner
            if isinstance(inner, BaseException):
                return f"rank {rank}: {_root_cause(inner)}"
        if seen.__cause__ is None:
            break
        seen = seen.__cause__
    return first_line(seen)


def _degrees(layout: dict | None) -> str:
    """A layout as its parallel degrees above 1 ("dp_shard=2 tp=2"), "no parallelism" when none."""
    return " ".join(f"{k}={v}" for k, v in sorted((layout or {}).items()) if v != 1) or "no parallelism"


def export_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise CheckpointError(f"checkpoint.export_dtype={name!r}; use one of float32, bfloat16, float16")
    return DTYPES[name]


class PartsView(nn.Module):
    """One module whose FQNs are those of several pipeline parts of the same model.

    torch's state-dict helpers take one module; a rank holding two stages (interleaved or
    V schedules) has two. Stages are cuts of one model: a ModuleDict of blocks (whatever the
    family calls it) holds disjoint keys in each stage, every other child lives in one stage.
    So children re-register under one parent, ModuleDicts merged by key, without renaming.
    """

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        for part in parts:
            for name, child in part.named_children():
                if child is None:
                    continue
                mine = self._modules.get(name)
                if isinstance(child, nn.ModuleDict):
                    if mine is None:
                        mine = nn.ModuleDict()
                        self.add_module(name, mine)
                    for key, block in child.items():
                        if key in mine:
                            raise ValueError(f"pipeline parts share {name}.{key}")
                        mine[key] = block
                elif mine is not None:
                    raise ValueError(f"pipeline parts share submodule {name!r}")
                else:
                    self.add_module(name, child)


def _state_module(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else PartsView(parts)


def _jsonable(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str, list, tuple, dict))


def get_rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


class CheckpointManager:
    """Periodic (a)synchronous saves, keep-latest-k, automatic resume, initial loads."""

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
        **settings: Any,
    ) -> None:
        """``settings`` are the ``checkpoint`` group's fields (the group instantiates this class as a
        partial); the rest is what the recipe built. ``train_state`` is the trainer's progress
        (step, tokens, losses), saved and restored with everything else."""
        defaults = {"enable": False, "folder": "checkpoint", "interval": 500, "keep_latest_k": 3,
                    "async_mode": "disabled", "load_step": -1, "initial_load_path": None,
                    "initial_load_model_only": True, "exclude_from_loading": [], "last_save_model_only": False,
                    "export_dtype": "float32", "create_seed_checkpoint": False}
        unknown = set(settings) - set(defaults)
        if unknown:
            raise TypeError(f"unknown checkpoint settings {sorted(unknown)}")
        ckpt = SimpleNamespace(**{**defaults, **settings})
        self.cfg = ckpt
        self.enabled = bool(ckpt.enable)
        folder = Path(ckpt.folder)
        self.folder = folder if folder.is_absolute() else Path(run_dir) / folder
        if self.enabled:
            from titan_hydra.validate import check_writable_dir

            check_writable_dir(self.folder, "checkpoint.folder")  # fail now, not at the first save
        self.model_parts = model_parts
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.train_loader = train_loader
        self.train_state = train_state
        self.seed_only = False  # set by restore() under create_seed_checkpoint: train nothing
        self.dims = dims
        self.family = family  # titan_hydra.models.protocol.ModelFamily
        self.model_args = model_args
        self.flavor = flavor
        self.rank, self.world_size = rank, world_size
        self.async_mode = ckpt.async_mode == "async"
        self.interval = int(ckpt.interval)
        self.keep_latest_k = int(ckpt.keep_latest_k)
        self._pending: tuple | None = None
        self._stager = None
        self._pg = None
        if self.enabled and self.async_mode and world_size > 1:
            self._pg = dist.new_group(backend="gloo")  # background saves never share the training group
        self.loaded_from: str | None = None

    # ------------------------------------------------------------------ helpers
    def log(self, message: str) -> None:
        if self.rank == 0:
            print(f"[checkpoint] {message}", flush=True)

    def _barrier(self) -> None:
        if dist.is_initialized() and self.world_size > 1:
            dist.barrier()

    @property
    def _module(self) -> nn.Module:
        return _state_module(self.model_parts)

    def layout(self) -> dict[str, int]:
        d = self.dims
        out = {"pp": d.pp, "dp_replicate": d.dp_replicate, "dp_shard": d.dp_shard, "cp": d.cp, "tp": d.tp}
        if getattr(d, "ep", 1) > 1:  # only when on, so markers of dense layouts read as before
            out["ep"] = d.ep
        return out

    def _marker_info(self, step: int, kind: str, dtype: str) -> dict[str, Any]:
        return {
            "format": FORMAT_VERSION,
            "step": step,
            "kind": kind,
            "dtype": dtype,
            "world_size": self.world_size,
            "layout": self.layout(),
            "model": {"family": self.family.name, "flavor": self.flavor,
                      "args": self.family.args_fields(self.model_args),
                      "signature": self.family.signature(self.model_args)},
            "time": time.time(),
        }

    # ------------------------------------------------------------------ state
    def _model_state(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        sd = get_model_state_dict(self._module)
        return {f"model.{k}": (v.to(dtype) if dtype is not None and v.is_floating_point() else v) for k, v in sd.items()}

    def _optim_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return get_optimizer_state_dict(self._module, members(self.optimizer), options=options)

    def _loader_state(self) -> tuple[dict | None, dict | None]:
        """(rank-independent loader state, per-rank loader state)."""
        sd = self.train_loader.state_dict() if hasattr(self.train_loader, "state_dict") else None
        if sd is None:
            return None, None
        return (sd, None) if sd.get("kind") == "packed" else (None, sd)

    def _extra_state(self) -> dict[str, Any]:
        groups = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params" and _jsonable(v)}
            for g in self.optimizer.param_groups
        ]
        sched = {k: v for k, v in self.lr_scheduler.state_dict().items() if _jsonable(v)}
        shared_loader, _ = self._loader_state()
        return {
            "train_state": self.train_state.state_dict(),
            "lr_scheduler": sched,
            "optimizer_groups": groups,
            "dataloader": shared_loader,
        }

    def _rank_state(self) -> dict[str, Any]:
        _, own_loader = self._loader_state()
        return {"rng": get_rng_state(), "dataloader": own_loader}

    def state_to_save(self, model_only: bool = False, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        sd = self._model_state(dtype)
        if model_only:
            return sd
        for k, v in self._optim_state().items():
            if isinstance(v, torch.Tensor):
                sd[f"optim.{k}"] = v
        sd["extra"] = json_tensor(self._extra_state())
        sd[f"rank_state.{self.rank}"] = json_tensor(self._rank_state())
        return sd

    # ------------------------------------------------------------------ saving
    def maybe_save(self, step: int, last: bool = False) -> None:
        self._poll()
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
        import torch.distributed.checkpoint as dcp

        self.wait()
        path = step_dir(self.folder, step)
        if self.rank == 0:
            if path.exists():  # a save of this step that never completed (killed run)
                remove_dir(path)
            path.mkdir(parents=True, exist_ok=True)
        self._barrier()
        t0 = time.perf_counter()
        torch_dtype = export_dtype(dtype) if model_only else None
        state = self.state_to_save(model_only=model_only, dtype=torch_dtype)
        info = self._marker_info(step, "model_only" if model_only else "full", dtype)
        if self.async_mode and not wait:
            fut = dcp.async_save(state, checkpoint_id=str(path), process_group=self._pg,
                                 async_stager=self._get_stager())
            fut = getattr(fut, "upload_completion", fut)
            self._pending = (fut, step, path, info, t0)
            self.log(f"step {step}: async save started ({time.perf_counter() - t0:.2f}s blocking)")
            return path
        try:
            dcp.save(state, checkpoint_id=str(path))
        except DCP_ERRORS as e:
            self._failed(step, path, e)
        self._barrier()
        self._complete(step, path, info, t0)
        return path

    def _failed(self, step: int, path: Path, error: BaseException) -> None:
        """A save that did not finish: remove it (rank 0) and stop the run with one line."""
        if self.rank == 0:
            remove_dir(path)
        best, _ = latest_complete(self.folder)
        kept = f"the newest complete checkpoint {best.path} is intact" if best else "no earlier checkpoint exists"
        reason = _root_cause(error)
        raise CheckpointError(f"saving checkpoint step {step} to {path} failed ({reason}); {kept}") from error

    def _get_stager(self):
        """Reusable staging buffers; pinned memory and async copies only where CUDA exists."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = torch.cuda.is_available()
            self._stager = DefaultStager(StagingOptions(cuda, False, cuda, cuda))
        return self._stager

    def _complete(self, step: int, path: Path, info: dict[str, Any], t0: float) -> None:
        if self.rank == 0:
            try:
                write_marker(path, info)
            except DCP_ERRORS as e:
                self._failed(step, path, e)
            self.log(f"step {step}: saved {path} ({info['kind']}, {time.perf_counter() - t0:.2f}s)")
            self._purge()

    def _poll(self) -> None:
        """Finish a background save whose data is all on disk (non-blocking)."""
        if self._pending is not None and self._pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Block until a pending async save is complete and marked."""
        if self._pending is None:
            return
        fut, step, path, info, t0 = self._pending
        self._pending = None
        try:
            fut.result()
        except DCP_ERRORS as e:
            self._failed(step, path, e)
        self._complete(step, path, info, t0)

    def _purge(self) -> None:
        """Keep the newest ``keep_latest_k`` complete checkpoints; drop stale incomplete ones."""
        steps = list_steps(self.folder)
        complete = [s for s in steps if s.complete]
        doomed = complete[:-self.keep_latest_k] if self.keep_latest_k > 0 else []
        newest = complete[-1].step if complete else -1
        doomed += [s for s in steps if not s.complete and s.step < newest]
        for s in doomed:
            remove_dir(s.path)

    def close(self) -> None:
        self.wait()
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    # ------------------------------------------------------------------ restoring
    def restore(self) -> int:
        """Resume from this run's checkpoints, else apply ``initial_load_path``. Returns the step."""
        cfg = self.cfg
        if getattr(cfg, "create_seed_checkpoint", False):
            return self._create_seed()
        if not self.enabled and not cfg.initial_load_path:
            return 0
        exclude = list(cfg.exclude_from_loading or [])
        if self.enabled:
            target = self._resume_target()
            if target is not None:
                marker = read_marker(target)
                model_only = bool(marker and marker.get("kind") == "model_only")
                self.load(target, model_only=model_only, exclude=exclude)
                return self.train_state.step
        if cfg.initial_load_path:
            self.load_initial(cfg.initial_load_path, model_only=bool(cfg.initial_load_model_only), exclude=exclude)
            return self.train_state.step
        return 0

    def _resume_target(self) -> Path | None:
        if int(self.cfg.load_step) >= 0:
            path = step_dir(self.folder, int(self.cfg.load_step))
            if read_marker(path) is None:
                raise CheckpointError(
                    f"checkpoint.load_step={self.cfg.load_step}: {path} is missing or incomplete (no {path.name}/"
                    "COMPLETE.json); pick a step with a complete checkpoint"
                )
            return path
        best, skipped = latest_complete(self.folder)
        for s in skipped:
            self.log(f"ignoring incomplete checkpoint {s.path} (no completion marker: the save was interrupted)")
        return best.path if best else None

    def load_initial(self, path: str | Path, model_only: bool = True, exclude: list[str] | None = None) -> None:
        """``initial_load_path``: a step dir, a checkpoint folder (its latest), or an HF directory."""
        path = Path(path).expanduser()
        if not path.exists():
            raise CheckpointError(f"checkpoint.initial_load_path={path} does not exist")
        from titan_hydra.models.hf_io import is_hf_dir

        if is_hf_dir(path):
            self.load_hf(path)
            return
        if not (path / ".metadata").exists():
            best, _ = latest_complete(path)
            if best is None:
                raise CheckpointError(f"checkpoint.initial_load_path={path} holds no complete checkpoint")
            path = best.path
        marker = read_marker(path)
        if marker is not None and marker.get("kind") == "model_only":
            model_only = True
        self.load(path, model_only=model_only, exclude=exclude, require_marker=False)
        if model_only:
            self.train_state.step = 0

    def _check_signature(self, path: Path, marker: dict | None) -> None:
        if not marker or "model" not in marker:
            return
        diffs = signature_diff(marker["model"].get("signature", {}), self.family.signature(self.model_args))
        if diffs:
            raise CheckpointError(
                f"checkpoint {path} was saved from a different model (flavor {marker['model'].get('flavor')!r}, "
                f"this run: {self.flavor!r}): " + ", ".join(diffs)
            )

    def load(self, path: str | Path, model_only: bool = False, exclude: list[str] | None = None,
             require_marker: bool = True) -> None:
        """Validate, read everything into fresh tensors, then apply. All or nothing."""
        import torch.distributed.checkpoint as dcp

        path = Path(path)
        exclude = set(exclude or [])
        unknown = exclude - set(CATEGORIES)
        if unknown:
            raise CheckpointError(f"checkpoint.exclude_from_loading has unknown entries {sorted(unknown)}; "
                                  f"use {', '.join(CATEGORIES)}")
        marker = read_marker(path)
        if marker is None and require_marker:
            raise CheckpointError(f"checkpoint {path} is incomplete (no COMPLETE.json marker)")
        self._check_signature(path, marker)
        if not model_only and marker and marker.get("kind") == "model_only":
            raise CheckpointError(
                f"checkpoint {path} is a model-only export (no optimizer or training state); load it with "
                "checkpoint.initial_load_model_only=true"
            )
        entries = tensor_entries(read_metadata(path))  # the restricted unpickler: safe on any bytes
        verify_files(path, marker, set())  # .metadata as saved, before its entries are trusted
        want: dict[str, torch.Tensor] = {}
        model_sd = {} if "model" in exclude else self._model_state()
        self._add_wanted(path, want, entries, model_sd, "model")
        optim_sd: dict[str, Any] = {}
        if not model_only and "optimizer" not in exclude:
            optim_sd = self._optim_state()
            tensors = {f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
            self._add_wanted(path, want, entries, tensors, "optimizer")
        need_extra = not model_only and bool({"lr_scheduler", "dataloader", "train_state", "optimizer"} - exclude)
        if need_extra:
            self._add_json(path, want, entries, "extra")
        rank_key = f"rank_state.{self.rank}"
        same_layout = bool(marker) and marker.get("world_size") == self.world_size and \
            marker.get("layout") == self.layout()
        load_rank = not model_only and same_layout and rank_key in entries
        if load_rank:
            self._add_json(path, want, entries, rank_key)
        elif not model_only and "dataloader" not in exclude and self._loader_state()[1] is not None:
            saved = f"{marker.get('world_size')} rank(s) ({_degrees(marker.get('layout'))})" if marker else "another layout"
            raise CheckpointError(
                f"checkpoint {path} was saved by {saved}, this run has {self.world_size} ({_degrees(self.layout())}): "
                "a streaming data position cannot be resharded; resume with the saved layout or set "
                "checkpoint.exclude_from_loading=[dataloader]"
            )
        self._verify(path, marker, check_files(path, read_metadata(path), set(want)))
        try:
            dcp.load(want, storage_reader=safe_reader(path))
        except DCP_ERRORS as e:
            raise CheckpointError(f"checkpoint {path}: reading failed ({str(e).strip().splitlines()[-1][:300]})") from e
        self._apply(path, want, model_sd, optim_sd, exclude, model_only, load_rank, rank_key)
        self.loaded_from = str(path)
        what = "model only" if model_only else "full state"
        skipped = f", excluded {sorted(exclude)}" if exclude else ""
        rng = "" if model_only or load_rank else ", RNG not restored (different layout)"
        self.log(f"loaded {path} ({what}{skipped}{rng}); resuming at step {self.train_state.step}")

    def _verify(self, path: Path, marker: dict | None, names: set[str]) -> None:
        """Checksums of the files this load reads, shared out over the ranks so that each file is
        read once in all (not once per rank); every rank raises the same one-line error."""
        spread = dist.is_initialized() and self.world_size > 1
        if spread:
            wanted: list = [None] * self.world_size
            dist.all_gather_object(wanted, sorted(names))  # pipeline stages read different files
            names = set(sorted(set().union(*wanted))[self.rank::self.world_size])
        problem = None
        try:
            verify_files(path, marker, names)
        except CheckpointError as e:
            problem = str(e)
        if spread:
            found: list = [None] * self.world_size
            dist.all_gather_object(found, problem)
            problem = next((p for p in found if p), None)
        if problem:
            raise CheckpointError(problem)

    def _add_wanted(self, path: Path, want: dict, entries: dict, template: dict, what: str) -> None:
        missing = [k for k in template if k not in entries]
        if missing:
            shown = ", ".join(k.split(".", 1)[1] for k in missing[:4])
            raise CheckpointError(
                f"checkpoint {path} lacks {len(missing)} {what} entr{'y' if len(missing) == 1 else 'ies'} "
                f"this run needs ({shown}{', ...' if len(missing) > 4 else ''})"
            )
        for k, v in template.items():
            saved = tuple(entries[k].size)
            if tuple(v.shape) != saved:
                raise CheckpointError(
                    f"checkpoint {path}: {what} entry {k.split('.', 1)[1]} has shape {list(saved)}, "
                    f"this run's model needs {list(v.shape)}"
                )
            want[k] = torch.empty_like(v)

    def _add_json(self, path: Path, want: dict, entries: dict, key: str) -> None:
        if key not in entries:
            raise CheckpointError(f"checkpoint {path} lacks {key!r} (a model-only checkpoint? "
                                  "use checkpoint.initial_load_model_only=true)")
        want[key] = torch.empty(tuple(entries[key].size), dtype=torch.uint8)

    def _apply(self, path: Path, got: dict, model_sd: dict, optim_sd: dict, exclude: set, model_only: bool,
               load_rank: bool, rank_key: str) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        extra = tensor_json(got["extra"]) if "extra" in got and not model_only else {}
        own = tensor_json(got[rank_key]) if load_rank else {}
        if not model_only and "dataloader" not in exclude:
            # First: the only part that can still refuse (other data, seq_len, seed), before anything changed.
            loader_sd = extra.get("dataloader") or own.get("dataloader")
            if loader_sd is not None:
                try:
                    self.train_loader.load_state_dict(loader_sd)
                except UserError as e:
                    raise CheckpointError(f"checkpoint {path}: {first_line(e)}") from None
        if model_sd:
            set_model_state_dict(self._module, {k[len("model."):]: got[k] for k in model_sd})
        if model_only:
            return
        if optim_sd:
            new = {k: (got[f"optim.{k}"] if isinstance(v, torch.Tensor) else v) for k, v in optim_sd.items()}
            options = StateDictOptions(flatten_optimizer_state_dict=True)
            set_optimizer_state_dict(self._module, members(self.optimizer), new, options=options)
            self._apply_groups(extra.get("optimizer_groups", []))
        if "lr_scheduler" not in exclude and "lr_scheduler" in extra:
            self._restore_schedule(extra["lr_scheduler"])
        if "train_state" not in exclude and "train_state" in extra:
            self.train_state.load_state_dict(extra["train_state"])
        if "rng" not in exclude and own.get("rng"):
            set_rng_state(own["rng"])

    def _restore_schedule(self, saved: dict) -> None:
        """Continue the saved step count on *this* run's schedule.

        A run resumed with other settings (``training.steps=20`` after a 10-step run, another
        ``optimizer.lr``) must take its learning rates from its own schedule: the saved position
        (``last_epoch``) is kept, the peak LRs and the schedule function are the current ones,
        and each group's LR is recomputed from them (the optimizer state holds the old value).
        """
        sched = self.lr_scheduler
        peaks = list(getattr(sched, "base_lrs", []))
        sched.load_state_dict(saved)
        if not hasattr(sched, "lr_lambdas"):  # not a LambdaLR: keep its own restored values
            lrs = sched.get_last_lr()
        else:
            sched.base_lrs = peaks
            lrs = [peak * fn(sched.last_epoch) for peak, fn in zip(peaks, sched.lr_lambdas)]
            sched._last_lr = list(lrs)
        for group, peak, lr in zip(self.optimizer.param_groups, peaks or [None] * len(lrs), lrs):
            group["lr"] = lr
            if peak is not None:
                group["initial_lr"] = peak

    def _apply_groups(self, groups: list[dict]) -> None:
        for i, group in enumerate(self.optimizer.param_groups):
            saved = groups[i] if i < len(groups) else (groups[0] if groups else {})
            for k, v in saved.items():
                if k in group and not isinstance(group[k], torch.Tensor):
                    group[k] = tuple(v) if isinstance(group[k], tuple) else v

    # ------------------------------------------------------------------ HF and seed
    def load_hf(self, path: Path) -> None:
        """Model weights from a Hugging Face directory of this run's family (safetensors + config.json)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        from titan_hydra.models.hf_io import load_hf_checkpoint

        _, args, full = load_hf_checkpoint(path, self.family)
        diffs = signature_diff(self.family.signature(args), self.family.signature(self.model_args))
        if diffs:
            raise CheckpointError(f"HF checkpoint {path} does not match this run's model: " + ", ".join(diffs))
        ours = self._model_state()
        template = {k[len("model."):]: v for k, v in ours.items()}
        missing = [k for k in template if k not in full]
        if missing:
            raise CheckpointError(f"HF checkpoint {path} lacks {missing[:4]}")
        for k, v in template.items():
            if tuple(full[k].shape) != tuple(v.shape):
                raise CheckpointError(
                    f"HF checkpoint {path}: {k} has shape {list(full[k].shape)}, this run needs {list(v.shape)}"
                )
        sd = {k: full[k].to(v.dtype) for k, v in template.items()}
        set_model_state_dict(self._module, sd, options=StateDictOptions(full_state_dict=True))
        self.loaded_from = str(path)
        self.log(f"loaded HF weights from {path}")

    def _create_seed(self) -> int:
        """Save the freshly initialized model (step 0, model only) and train nothing."""
        if self.world_size != 1:
            raise CheckpointError(
                "checkpoint.create_seed_checkpoint=true runs in one process: set cluster.nproc_per_node=1 "
                "and parallelism=single"
            )
        self.save(0, model_only=True, dtype="float32", wait=True)
        self.seed_only = True
        return 0
