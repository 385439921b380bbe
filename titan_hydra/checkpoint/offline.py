"""A trained model in one process, outside a run: what sampling, evaluation and the benchmarks of
a finished run load.

``load_model`` builds the model of a step dir this project wrote (any layout, any family; its
weights or their EMA) or of a Hugging Face directory, in eval mode; ``load_flux_run`` does the
same for a FLUX.1 run dir (its newest complete checkpoint) and rebuilds the run's example builder
(encoders, sampler settings) from its saved config. Here, in the checkpoint package, because
reading and verifying checkpoints is this package's job; the recipes that use them
(generate, eval, generate_image, flux_fidelity) only parse their flags.
"""

from __future__ import annotations

from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import OmegaConf

from titan_hydra.checkpoint.convert import read_model
from titan_hydra.checkpoint.storage import CheckpointError, latest_complete
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import UserError
from titan_hydra.models.hf_io import is_hf_dir, load_hf_checkpoint


def load_model(path: str | Path, device: str = "cpu", weights: str = "model"):
    """(family, args, model in eval mode with the checkpoint's weights) of a step dir or HF dir;
    ``weights="ema"``: a step dir's EMA of the weights (``training.ema_decay``)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    family, args, sd = load_hf_checkpoint(path) if is_hf_dir(path) else read_model(path, weights)
    with torch.device("meta"):
        model = family.build(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)  # non-persistent buffers (rotary tables)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "output.weight" or not args.tie_word_embeddings]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit its own model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    return family, args, model.eval()


def locate(path: Path) -> tuple[Path, Path]:
    """(run dir, checkpoint step dir) for a run dir (its newest complete checkpoint) or a step dir."""
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.name.startswith("step-"):
        return path.parent.parent, path
    best, _ = latest_complete(path / "checkpoint")
    if best is None:
        raise CheckpointError(f"{path} has no complete checkpoint under checkpoint/ (train with checkpoint=default)")
    return path, best.path


def load_flux_run(path: Path):
    """(checkpoint step dir, the run's resolved config, the model in eval mode, its example builder)
    of a Flux run directory or step directory; UserError (one line) for anything else."""
    run_dir, step = locate(path)
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        raise UserError(f"{run_dir} has no .hydra/config.yaml (a run directory launch.py wrote)")
    cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
    if "examples" not in cfg.get("data", {}):  # image data with the family's example builder (Flux)
        raise UserError(f"{run_dir} is not a text-to-image (Flux) run: its data has no example builder "
                        f"(model.family={cfg.get('model', {}).get('family')!r})")
    family, args, sd = read_model(step)
    with torch.device("meta"):
        model = family.build(args)
    model.to_empty(device="cpu")
    model.load_state_dict(sd)
    return step, cfg, model.eval(), instantiate(cfg["data"]["examples"])


def tokenizer_for(checkpoint: str | Path, name: str | None = None) -> Tokenizer:
    """The tokenizer ``name`` (builtin, a dir or a tokenizer.json), else an HF directory's own
    ``tokenizer.json``, else the built-in one."""
    own = Path(checkpoint) / "tokenizer.json"
    return Tokenizer(name or (str(checkpoint) if is_hf_dir(checkpoint) and own.is_file() else "builtin"))
