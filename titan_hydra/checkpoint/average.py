"""The uniform average of a run's last N checkpoints, written as a model-only checkpoint.

The newest N complete checkpoints (those with a completion marker) are read as global tensors, so
they may come from any layout, and every ``model.*`` entry (and ``ema.*`` where all N hold one) is
averaged; non-float entries (none in today's models) are the newest's. Checkpoints of different
models or shapes are refused in one line. The optimizer state is left out: an average of weights
has none of its own (Adam's moments belong to the points of the trajectory that were averaged).

The average itself is ``torch.optim.swa_utils.get_swa_multi_avg_fn`` (the running mean
``avg += (w - avg) / (n + 1)`` that ``AveragedModel`` uses), applied one checkpoint at a time to
fp64 accumulators: memory holds the average and one checkpoint, not N, and the fp64 running mean
is within a few fp64 units of the exact mean, so the stored fp32 value is the mean rounded once.
``recipes/average_checkpoints.py`` is the command line.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from torch.optim.swa_utils import get_swa_multi_avg_fn

from titan_hydra.checkpoint.state import signature_diff
from titan_hydra.checkpoint.storage import (
    CheckpointError, StepDir, list_steps, load_plain, read_marker, read_metadata, save_plain, tensor_entries,
)


def newest_complete(path: str | Path, n: int) -> list[StepDir]:
    """The newest ``n`` complete checkpoints that ``path`` (run dir, checkpoint folder, step dir) names."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist; give a run dir, its checkpoint folder or a step dir")
    upto = None
    if read_marker(path) is not None or (path / ".metadata").is_file():
        upto, path = int(path.name.split("-")[-1]) if path.name.startswith("step-") else None, path.parent
    folder = path / "checkpoint" if (path / "checkpoint").is_dir() else path
    complete = [s for s in list_steps(folder) if s.complete and (upto is None or s.step <= upto)]
    if n < 1 or len(complete) < n:
        found = ", ".join(str(s.step) for s in complete) or "none"
        raise CheckpointError(f"averaging the last {n} checkpoints needs {n} complete ones under {folder}; "
                              f"found {len(complete)} (steps: {found}); lower --last or train longer")
    return complete[-n:]


def _model_shapes(entries: dict) -> dict[str, tuple]:
    return {k: tuple(v.size) for k, v in entries.items() if k.startswith("model.")}


def averaged_keys(steps: list[StepDir]) -> tuple[list[str], dict]:
    """The entries to average (``model.*``; ``ema.*`` where every checkpoint has it), refusing
    checkpoints of other models or shapes. Returns (keys, the newest's marker)."""
    markers = [read_marker(s.path) for s in steps]
    layouts = [tensor_entries(read_metadata(s.path)) for s in steps]
    newest, want = steps[-1].path, _model_shapes(layouts[-1])
    for s, marker, entries in zip(steps, markers, layouts):
        diffs = signature_diff(marker.get("model", {}).get("signature", {}),
                               markers[-1].get("model", {}).get("signature", {}))
        if diffs:
            raise CheckpointError(f"checkpoint {s.path} is of another model than {newest} ({', '.join(diffs)}); "
                                  "average checkpoints of one run")
        mine = _model_shapes(entries)
        odd = [k for k in sorted(set(mine) | set(want)) if mine.get(k) != want.get(k)]
        if odd:
            raise CheckpointError(f"checkpoint {s.path}: {odd[0]} is {list(mine.get(odd[0], ())) or 'absent'}, in "
                                  f"{newest} {list(want.get(odd[0], ())) or 'absent'}; average checkpoints of one run")
    keys = list(want)
    keys += [k for k in layouts[-1] if k.startswith("ema.") and all(k in e for e in layouts)]
    return keys, markers[-1]


def average(steps: list[StepDir]) -> tuple[dict[str, torch.Tensor], dict]:
    """(the uniform average of the checkpoints' entries, the newest's marker)."""
    keys, marker = averaged_keys(steps)
    update = get_swa_multi_avg_fn()
    avg: dict[str, torch.Tensor] = {}
    for n, s in enumerate(steps):
        sd = load_plain(s.path, keys)
        if n == 0:
            avg = {k: v.double() if v.is_floating_point() else v for k, v in sd.items()}
            continue
        floats = [k for k in keys if avg[k].is_floating_point()]
        update([avg[k] for k in floats], [sd[k].double() for k in floats], n)
        avg.update({k: sd[k] for k in keys if not avg[k].is_floating_point()})  # the newest's
    dtypes = {k: v.properties.dtype for k, v in tensor_entries(read_metadata(steps[-1].path)).items()}
    return {k: v.to(dtypes[k]) for k, v in avg.items()}, marker


def average_checkpoints(path: str | Path, last: int, out: str | Path | None = None) -> Path:
    """Average the newest ``last`` checkpoints under ``path`` into ``out`` (default: <folder>/average-<steps>)."""
    steps = newest_complete(path, last)
    state, marker = average(steps)
    out = Path(out) if out else steps[-1].path.parent / f"average-{steps[0].step}-{steps[-1].step}"
    info = {**{k: v for k, v in marker.items() if k not in ("files", "time")},
            "kind": "model_only", "world_size": 1, "layout": {}, "time": time.time(),
            "averaged": [{"step": s.step, "path": str(s.path)} for s in steps]}
    save_plain(out, state, info)
    return out
