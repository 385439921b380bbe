"""Hugging Face checkpoint directories (config.json + *.safetensors) in and out, for any family.

transformers names the architecture in ``config.json``'s ``model_type``, diffusers in its
``_class_name`` (FLUX.1: ``FluxTransformer2DModel``, weights in ``diffusion_pytorch_model.safetensors``);
both are read the same way.

The family's ``HFAdapter`` maps names, layouts and config fields; this module only reads and
writes files. Loading uses ``safetensors`` only (nothing is unpickled). Reading picks the family
from ``config.json``'s ``model_type`` unless the caller's run already fixes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from titan_hydra.errors import CheckpointError
from titan_hydra.models.common.hf_decoder import HFConversionError
from titan_hydra.models.protocol import ModelFamily
from titan_hydra.models.registry import family_for_hf_type


def is_hf_dir(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def architecture_of(cfg: dict[str, Any]) -> str | None:
    """What a config.json says the model is: transformers' ``model_type`` or diffusers' ``_class_name``."""
    return cfg.get("model_type") or cfg.get("_class_name")


def load_hf_checkpoint(path: str | Path, family: ModelFamily | None = None
                       ) -> tuple[ModelFamily, Any, dict[str, torch.Tensor]]:
    """(family, our args, our full state dict) from an HF directory."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
        model_type = architecture_of(cfg)
        if family is None:
            family = family_for_hf_type(model_type)
        if family.hf is None:
            raise HFConversionError(f"model family {family.name!r} has no Hugging Face adapter")
        if not family.hf.reads(model_type):
            raise HFConversionError(f"config.json model_type={model_type!r}, but this run's model family "
                                    f"{family.name!r} reads {family.hf.model_type!r}")
        args = family.hf.args_from_hf_config(cfg)
        hf: dict[str, torch.Tensor] = {}
        for f in sorted(path.glob("*.safetensors")):
            hf.update(load_file(str(f)))
        args = family.hf.args_for_weights(args, hf.keys())
        return family, args, family.hf.from_hf_state(hf, args)
    except (HFConversionError, KeyError, ValueError, OSError) as e:
        raise CheckpointError(f"HF checkpoint {path}: {e}") from None


def hf_index(path: str | Path, family: ModelFamily) -> tuple[Any, dict[str, Path]]:
    """(our args, {tensor name: the safetensors file holding it}) from an HF directory, no tensor read."""
    path = Path(path)
    try:
        cfg = json.loads((path / "config.json").read_text())
        model_type = architecture_of(cfg)
        if family.hf is None or not family.hf.reads(model_type):
            raise HFConversionError(f"config.json model_type={model_type!r} is not what model family {family.name!r} reads")
        index: dict[str, Path] = {}
        for f in sorted(path.glob("*.safetensors")):
            with safe_open(str(f), framework="pt") as handle:
                index.update({name: f for name in handle.keys()})
        args = family.hf.args_for_weights(family.hf.args_from_hf_config(cfg), index.keys())
        return args, index
    except (HFConversionError, KeyError, ValueError, OSError) as e:
        raise CheckpointError(f"HF checkpoint {path}: {e}") from None


def save_hf_checkpoint(family: ModelFamily, path: str | Path, sd: dict[str, torch.Tensor], args: Any,
                       dtype: torch.dtype = torch.float32) -> None:
    """Write config.json and model.safetensors (HF names and layout) plus our args."""
    if family.hf is None:
        raise CheckpointError(f"model family {family.name!r} has no Hugging Face adapter; cannot export")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    hf = {k: v.to(dtype) if v.is_floating_point() else v for k, v in family.hf.to_hf_state(sd, args).items()}
    save_file(hf, str(path / family.hf.weights_file), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(family.hf.hf_config(args, dtype), indent=2, sort_keys=True))
    (path / "titan_hydra_args.json").write_text(
        json.dumps({"family": family.name, **family.args_fields(args)}, indent=2, sort_keys=True))
