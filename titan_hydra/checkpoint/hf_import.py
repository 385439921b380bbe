"""Model weights from a Hugging Face directory (safetensors + config.json) of this run's family.

``initial_load_path`` may name an HF directory instead of a DCP checkpoint: fine-tuning starts
from published weights. The directory's config must describe the same model as the run (its
signature), and every parameter must be present with this run's shape, before anything changes.
A family whose state dict is the checkpoint's (``model=hf``) reads each rank's own slices only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from titan_hydra.checkpoint.state import RunParts, signature_diff
from titan_hydra.checkpoint.storage import CheckpointError
from titan_hydra.models.hf_io import hf_index, load_hf_checkpoint


def load_hf(run: RunParts, path: Path) -> None:
    """Load the HF weights at ``path`` into ``run``'s model (all parameters, or nothing)."""
    hf = run.family.hf
    if hf is not None and hf.same_layout:
        load_hf_slices(run, path)
        return
    _, args, full = load_hf_checkpoint(path, run.family)
    diffs = signature_diff(run.family.signature(args), run.family.signature(run.model_args))
    if diffs:
        raise CheckpointError(f"HF checkpoint {path} does not match this run's model: " + ", ".join(diffs))
    ours = run.model_state()
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
    set_model_state_dict(run.module, sd, options=StateDictOptions(full_state_dict=True))
    run.log(f"loaded HF weights from {path}")


def load_hf_slices(run: RunParts, path: Path) -> None:
    """``load_hf`` for a family whose state dict is the checkpoint's (``HFAdapter.same_layout``): each
    rank opens the safetensors files lazily and reads, per parameter it holds, only its own slice (a
    DTensor's local shard under FSDP / TP / EP, a whole tensor otherwise), so no rank ever holds the
    whole model. Every name and global shape is checked before anything is set."""
    args, index = hf_index(path, run.family)
    diffs = signature_diff(run.family.signature(args), run.family.signature(run.model_args))
    if diffs:
        raise CheckpointError(f"HF checkpoint {path} does not match this run's model: " + ", ".join(diffs))
    template = {k[len("model."):]: v for k, v in run.model_state().items()}
    sources = {k: run.family.hf.source_name(k, args) for k in template}
    missing = [k for k, src in sources.items() if src not in index]
    if missing:
        raise CheckpointError(f"HF checkpoint {path} lacks {missing[:4]}")
    handles: dict[Path, Any] = {}
    try:
        slices = {}
        for k, v in template.items():
            f = index[sources[k]]
            handle = handles.get(f) or handles.setdefault(f, safe_open(str(f), framework="pt"))
            slices[k] = handle.get_slice(sources[k])
            if tuple(slices[k].get_shape()) != tuple(v.shape):
                raise CheckpointError(f"HF checkpoint {path}: {sources[k]} has shape {list(slices[k].get_shape())}, "
                                      f"this run needs {list(v.shape)}")
        sd = {k: _local_part(slices[k], v) for k, v in template.items()}
    finally:
        handles.clear()
    set_model_state_dict(run.module, sd, options=StateDictOptions(strict=True))
    run.log(f"loaded HF weights from {path} (each rank its own slices)")


def _local_part(file_slice: Any, like: torch.Tensor) -> torch.Tensor:
    """The part of a file tensor ``like`` holds on this rank, in its dtype and placement."""
    if not isinstance(like, DTensor):
        return file_slice[:].to(like.dtype)
    shape, offset = compute_local_shape_and_global_offset(like.shape, like.device_mesh, like.placements)
    local = file_slice[tuple(slice(o, o + n) for o, n in zip(offset, shape))] if shape else file_slice[:]
    return DTensor.from_local(local.to(like.dtype).contiguous(), like.device_mesh, like.placements,
                              run_check=False, shape=like.shape, stride=like.stride())
