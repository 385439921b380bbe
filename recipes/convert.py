"""Convert between titan_hydra DCP checkpoints and Hugging Face directories (offline, one process).

    python recipes/convert.py to-hf   OUT/checkpoint/step-1000  hf_out/  [--dtype bfloat16] [--weights ema]
    python recipes/convert.py from-hf hf_model_dir/             ckpt/step-0

``to-hf`` reads the model weights of any checkpoint this project wrote (any layout: DCP stores
global tensors), and writes ``config.json`` + ``model.safetensors`` through the model family's
HF adapter (names, rotary layout, tied weights), which ``<Family>ForCausalLM.from_pretrained``
loads; ``--weights ema`` exports the EMA of the weights that a ``training.ema_decay`` run kept.
``from-hf`` picks the family from ``config.json``'s ``model_type`` and writes a model-only DCP checkpoint (with completion marker) that ``checkpoint.initial_load_path`` loads
under any layout. (``initial_load_path`` also accepts an HF directory directly.)

For FLUX.1 the "HF directory" is diffusers' layout: ``config.json`` (``_class_name``
``FluxTransformer2DModel``) + ``diffusion_pytorch_model.safetensors``, what
``FluxTransformer2DModel.from_pretrained`` loads (e.g. the ``transformer/`` folder of a FLUX.1 repo).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_hydra.checkpoint.state import DTYPES, FORMAT_VERSION  # noqa: E402
from titan_hydra.checkpoint.storage import CheckpointError, load_plain, read_marker, read_metadata, save_plain, tensor_entries  # noqa: E402
from titan_hydra.errors import ConfigError, exit_status  # noqa: E402
from titan_hydra.models.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: E402
from titan_hydra.models.registry import LEGACY_FAMILY, get_family  # noqa: E402


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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("direction", choices=("to-hf", "from-hf"))
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--weights", default="model", choices=("model", "ema"),
                   help="to-hf: the trained weights, or their EMA (a run with training.ema_decay > 0)")
    a = p.parse_args(argv)

    def convert() -> str:
        if a.direction == "to-hf":
            to_hf(a.src, a.dst, a.dtype, a.weights)
        else:
            from_hf(a.src, a.dst, a.dtype)
        return f"wrote {a.dst}"

    return exit_status(convert)


if __name__ == "__main__":
    sys.exit(main())
