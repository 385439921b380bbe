"""Loading a DCP checkpoint into a run: verify everything, read into fresh tensors, then apply.

Loading validates first (marker, model signature, keys, shapes, data file lengths and checksums,
the data loader's position) and reads into fresh tensors; only when every read succeeded are
model, optimizer and the rest replaced, so a bad checkpoint fails with one message and leaves
the run untouched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

from titan_hydra.checkpoint.rng import set_rng_state
from titan_hydra.checkpoint.state import CATEGORIES, RunParts, members, signature_diff
from titan_hydra.checkpoint.versions import upgraded
from titan_hydra.checkpoint.storage import (
    DCP_ERRORS,
    CheckpointError,
    check_files,
    read_marker,
    read_metadata,
    safe_reader,
    tensor_entries,
    tensor_json,
    verify_files,
)
from titan_hydra.errors import UserError, first_line
from titan_hydra.quiet import DCP_SINGLE_PROCESS, ignoring


def _degrees(layout: dict | None) -> str:
    """A layout as its parallel degrees above 1 ("dp_shard=2 tp=2"), "no parallelism" when none."""
    return " ".join(f"{k}={v}" for k, v in sorted((layout or {}).items()) if v != 1) or "no parallelism"


def load(run: RunParts, path: str | Path, model_only: bool = False, exclude: list[str] | None = None,
         require_marker: bool = True) -> None:
    """Validate, read everything into fresh tensors, then apply. All or nothing."""
    path = Path(path)
    exclude = set(exclude or [])
    unknown = exclude - set(CATEGORIES)
    if unknown:
        raise CheckpointError(f"checkpoint.exclude_from_loading has unknown entries {sorted(unknown)}; "
                              f"use {', '.join(CATEGORIES)}")
    marker = upgraded(read_marker(path), path)  # a newer format refused, an older one migrated
    if marker is None and require_marker:
        raise CheckpointError(f"checkpoint {path} is incomplete (no COMPLETE.json marker)")
    _check_signature(run, path, marker)
    if not model_only and marker and marker.get("kind") == "model_only":
        raise CheckpointError(
            f"checkpoint {path} is a model-only export (no optimizer or training state); load it with "
            "checkpoint.initial_load_model_only=true"
        )
    entries = tensor_entries(read_metadata(path))  # the restricted unpickler: safe on any bytes
    verify_files(path, marker, set())  # .metadata as saved, before its entries are trusted
    want: dict[str, torch.Tensor] = {}
    model_sd = {} if "model" in exclude else run.model_state()
    _add_wanted(path, want, entries, model_sd, "model")
    optim_sd: dict[str, Any] = {}
    if not model_only and "optimizer" not in exclude:
        optim_sd = run.optim_state()
        tensors = {f"optim.{k}": v for k, v in optim_sd.items() if isinstance(v, torch.Tensor)}
        _add_wanted(path, want, entries, tensors, "optimizer")
    ema_sd = _ema_wanted(run, path, want, entries, model_only, exclude)
    need_extra = not model_only and bool({"lr_scheduler", "dataloader", "train_state", "optimizer"} - exclude)
    if need_extra:
        _add_json(path, want, entries, "extra")
    rank_key = f"rank_state.{run.rank}"
    same_layout = bool(marker) and marker.get("world_size") == run.world_size and \
        marker.get("layout") == run.layout()
    load_rank = not model_only and same_layout and rank_key in entries
    if load_rank:
        _add_json(path, want, entries, rank_key)
    elif not model_only and "dataloader" not in exclude and run.loader_state()[1] is not None:
        saved = f"{marker.get('world_size')} rank(s) ({_degrees(marker.get('layout'))})" if marker else "another layout"
        raise CheckpointError(
            f"checkpoint {path} was saved by {saved}, this run has {run.world_size} ({_degrees(run.layout())}): "
            "a streaming data position cannot be resharded; resume with the saved layout or set "
            "checkpoint.exclude_from_loading=[dataloader]"
        )
    _verify(run, path, marker, check_files(path, read_metadata(path), set(want)))
    try:
        with ignoring(DCP_SINGLE_PROCESS):  # loading in one process (a recipe, a 1-rank run) is the intent
            dcp.load(want, storage_reader=safe_reader(path))
    except DCP_ERRORS as e:
        raise CheckpointError(f"checkpoint {path}: reading failed ({str(e).strip().splitlines()[-1][:300]})") from e
    _apply(run, path, want, model_sd, optim_sd, exclude, model_only, load_rank, rank_key)
    if ema_sd:
        run.ema.load({k[len("ema."):]: want[k] for k in ema_sd})
    what = "model only" if model_only else "full state"
    skipped = f", excluded {sorted(exclude)}" if exclude else ""
    rng = "" if model_only or load_rank else ", RNG not restored (different layout)"
    run.log(f"loaded {path} ({what}{skipped}{rng}); resuming at step {run.train_state.step}")


# --------------------------------------------------------------------------- verify


def _check_signature(run: RunParts, path: Path, marker: dict | None) -> None:
    if not marker or "model" not in marker:
        return
    diffs = signature_diff(marker["model"].get("signature", {}), run.family.signature(run.model_args))
    if diffs:
        raise CheckpointError(
            f"checkpoint {path} was saved from a different model (flavor {marker['model'].get('flavor')!r}, "
            f"this run: {run.flavor!r}): " + ", ".join(diffs)
        )


def _verify(run: RunParts, path: Path, marker: dict | None, names: set[str]) -> None:
    """Checksums of the files this load reads, shared out over the ranks so that each file is
    read once in all (not once per rank); every rank raises the same one-line error."""
    spread = dist.is_initialized() and run.world_size > 1
    if spread:
        wanted: list = [None] * run.world_size
        dist.all_gather_object(wanted, sorted(names))  # pipeline stages read different files
        names = set(sorted(set().union(*wanted))[run.rank::run.world_size])
    problem = None
    try:
        verify_files(path, marker, names)
    except CheckpointError as e:
        problem = str(e)
    if spread:
        found: list = [None] * run.world_size
        dist.all_gather_object(found, problem)
        problem = next((p for p in found if p), None)
    if problem:
        raise CheckpointError(problem)


def _add_wanted(path: Path, want: dict, entries: dict, template: dict, what: str) -> None:
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


def _ema_wanted(run: RunParts, path: Path, want: dict, entries: dict, model_only: bool, exclude: set) -> dict:
    """The EMA entries this load reads into ``want`` ({} when the run keeps no EMA, loads the model
    only or excludes it, or the checkpoint holds none: the EMA then starts from the loaded weights)."""
    if run.ema is None or model_only or "ema" in exclude:
        return {}
    templates = run.ema_state()
    if not any(k in entries for k in templates):
        run.log(f"{path} holds no EMA of the weights: the EMA starts from the loaded weights")
        return {}
    _add_wanted(path, want, entries, templates, "EMA")
    return templates


def _add_json(path: Path, want: dict, entries: dict, key: str) -> None:
    if key not in entries:
        raise CheckpointError(f"checkpoint {path} lacks {key!r} (a model-only checkpoint? "
                              "use checkpoint.initial_load_model_only=true)")
    want[key] = torch.empty(tuple(entries[key].size), dtype=torch.uint8)


# --------------------------------------------------------------------------- apply


def _apply(run: RunParts, path: Path, got: dict, model_sd: dict, optim_sd: dict, exclude: set, model_only: bool,
           load_rank: bool, rank_key: str) -> None:
    extra = tensor_json(got["extra"]) if "extra" in got and not model_only else {}
    own = tensor_json(got[rank_key]) if load_rank else {}
    model = {k[len("model."):]: got[k] for k in model_sd}
    optim = {k: (got[f"optim.{k}"] if isinstance(v, torch.Tensor) else v) for k, v in optim_sd.items()}
    apply_state(run, model, optim, extra, own, exclude=exclude, model_only=model_only, source=f"checkpoint {path}")


def apply_state(run: RunParts, model: dict, optim: dict, extra: dict, own: dict, *, exclude: set = frozenset(),
                model_only: bool = False, source: str = "the state") -> None:
    """Put a run's state (model entries by FQN, the flattened optimizer state, the shared JSON
    ``extra`` and this rank's ``own`` JSON) into ``run``: a checkpoint load, or a replica group
    recovering from a live peer (``checkpoint/live.py``)."""
    if not model_only and "dataloader" not in exclude:
        # First: the only part that can still refuse (other data, seq_len, seed), before anything changed.
        loader_sd = extra.get("dataloader") or own.get("dataloader")
        if loader_sd is not None:
            try:
                run.train_loader.load_state_dict(loader_sd)
            except UserError as e:
                raise CheckpointError(f"{source}: {first_line(e)}") from None
    if model:
        set_model_state_dict(run.module, model)
    if model_only:
        return
    if optim:
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        set_optimizer_state_dict(run.module, members(run.optimizer), optim, options=options)
        _apply_groups(run.optimizer, extra.get("optimizer_groups", []))
    if "lr_scheduler" not in exclude and "lr_scheduler" in extra:
        _restore_schedule(run, extra["lr_scheduler"])
    if "train_state" not in exclude and "train_state" in extra:
        run.train_state.load_state_dict(extra["train_state"])
    if "rng" not in exclude and own.get("rng"):
        set_rng_state(own["rng"])


def _restore_schedule(run: RunParts, saved: dict) -> None:
    """Continue the saved step count on *this* run's schedule.

    A run resumed with other settings (``training.steps=20`` after a 10-step run, another
    ``optimizer.lr``) must take its learning rates from its own schedule: the saved position
    (``last_epoch``) is kept, the peak LRs and the schedule function are the current ones,
    and each group's LR is recomputed from them (the optimizer state holds the old value).
    """
    sched = run.lr_scheduler
    peaks = list(getattr(sched, "base_lrs", []))
    sched.load_state_dict(saved)
    if not hasattr(sched, "lr_lambdas"):  # not a LambdaLR: keep its own restored values
        lrs = sched.get_last_lr()
    else:
        sched.base_lrs = peaks
        lrs = [peak * fn(sched.last_epoch) for peak, fn in zip(peaks, sched.lr_lambdas)]
        sched._last_lr = list(lrs)
    for group, peak, lr in zip(run.optimizer.param_groups, peaks or [None] * len(lrs), lrs):
        group["lr"] = lr
        if peak is not None:
            group["initial_lr"] = peak


def _apply_groups(optimizer: torch.optim.Optimizer, groups: list[dict]) -> None:
    """The saved optimizer hyper-parameters (betas, weight decay...) back into the param groups."""
    for i, group in enumerate(optimizer.param_groups):
        saved = groups[i] if i < len(groups) else (groups[0] if groups else {})
        for k, v in saved.items():
            if k in group and not isinstance(group[k], torch.Tensor):
                group[k] = tuple(v) if isinstance(group[k], tuple) else v
