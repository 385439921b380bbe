"""A checkpoint's model weights between formats, in one process: this project's DCP step dirs and
Hugging Face directories.

``read_model`` reads the full (global) model state dict of any step dir this project wrote,
whatever its layout; ``to_hf`` writes it through the family's HF adapter (``config.json`` +
safetensors), ``from_hf`` writes an HF directory as a model-only step dir (with its completion
marker) that ``checkpoint.initial_load_path`` loads under any layout. ``recipes/convert.py`` is the
command line; ``offline.load_model`` builds a model from either format.
"""

from __future__ import annotations

from pathlib import Path

from titan_hydra.checkpoint.state import DTYPES, FORMAT_VERSION
from titan_hydra.checkpoint.storage import CheckpointError, load_plain, read_marker, read_metadata, save_plain, tensor_entries
from titan_hydra.errors import ConfigError
from titan_hydra.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from titan_hydra.models.registry import LEGACY_FAMILY, get_family


def read_model(path: str | Path, weights: str = "model"):
    """(family, args, full model state dict) of a checkpoint step dir written by this project;
    ``weights="ema"``: the EMA of the weights (``training.ema_decay``) in place of each parameter."""
    path = Path(path)
    marker = read_marker(path)
    if marker is None or "model" not in marker:
        raise CheckpointError(f"checkpoint {path} has no COMPLETE.json with model args (incomplete or foreign)")
    info = marker["model"]
    try:
        family = get_family(info.get("family", LEGACY_FAMILY))
    except ConfigError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    args = family.make_args(info["args"])
    entries = tensor_entries(read_metadata(path))
    keys = [k for k in entries if k.startswith("model.")]
    if weights == "ema":
        if not any(k.startswith("ema.") for k in entries):
            raise CheckpointError(f"checkpoint {path} holds no EMA of the weights (its run had training.ema_decay=0); "
                                  "export its weights with --weights model")
        # the EMA covers the parameters; buffers (if any are saved) stay the model's
        keys = [f"ema.{k[len('model.'):]}" if f"ema.{k[len('model.'):]}" in entries else k for k in keys]
    sd = load_plain(path, keys)
    return family, args, {k.split(".", 1)[1]: v for k, v in sd.items()}


def to_hf(src: str | Path, dst: str | Path, dtype: str = "float32", weights: str = "model") -> None:
    family, args, sd = read_model(src, weights)
    save_hf_checkpoint(family, dst, sd, args, DTYPES[dtype])


def from_hf(src: str | Path, dst: str | Path, dtype: str = "float32") -> None:
    family, args, sd = load_hf_checkpoint(src)
    state = {f"model.{k}": v.to(DTYPES[dtype]) for k, v in sd.items()}
    marker = {
        "format": FORMAT_VERSION, "step": 0, "kind": "model_only", "dtype": dtype, "world_size": 1,
        "layout": {}, "model": {"family": family.name, "flavor": "custom", "args": family.args_fields(args),
                                "signature": family.signature(args)},
        "source": str(src),
    }
    save_plain(dst, state, marker)
