"""Sample a PNG grid from a trained FLUX.1 run (offline, one process, CPU).

    python recipes/generate_image.py outputs/<run> --prompt "a red circle in the centre on a blue background" \\
        [--prompt ...] [--per-prompt 4] [--steps 20] [--guidance 3.0] [--seed 0] [--out grid.png]

``<run>`` is the run directory (its ``.hydra/config.yaml`` names the model and the encoders) or one
of its ``checkpoint/step-N`` directories; a run directory uses its newest complete checkpoint. The
grid has a row per prompt and ``--per-prompt`` samples (different noise) per row. Errors (no run,
no checkpoint, not a Flux run) are one line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_hydra.errors import UserError, exit_status  # noqa: E402
from titan_hydra.logger.images import save_grid  # noqa: E402


def locate(path: Path) -> tuple[Path, Path]:
    """(run dir, checkpoint step dir) for a run dir or a step dir."""
    from titan_hydra.checkpoint.storage import CheckpointError, latest_complete

    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if path.name.startswith("step-"):
        return path.parent.parent, path
    best, _ = latest_complete(path / "checkpoint")
    if best is None:
        raise CheckpointError(f"{path} has no complete checkpoint under checkpoint/ (train with checkpoint=default)")
    return path, best.path


def load_run(path: Path):
    """(checkpoint step dir, the run's resolved config, the model in eval mode, its example builder)
    of a Flux run directory or step directory; UserError (one line) for anything else."""
    import torch
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from convert import read_model

    run_dir, step = locate(path)
    config = run_dir / ".hydra" / "config.yaml"
    if not config.exists():
        raise UserError(f"{run_dir} has no .hydra/config.yaml (a run directory launch.py wrote)")
    cfg = OmegaConf.to_container(OmegaConf.load(config), resolve=True)
    if cfg.get("model", {}).get("family") != "flux" or "examples" not in cfg.get("data", {}):
        raise UserError(f"{run_dir} is not a Flux run (model.family={cfg.get('model', {}).get('family')!r})")
    family, args, sd = read_model(step)
    with torch.device("meta"):
        model = family.build(args)
    model.to_empty(device="cpu")
    model.load_state_dict(sd)
    return step, cfg, model.eval(), instantiate(cfg["data"]["examples"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="run directory or checkpoint/step-N directory")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several rows")
    p.add_argument("--per-prompt", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="grid.png")
    a = p.parse_args(argv)

    def draw() -> str:
        from titan_hydra.models.flux.sampling import sample_images

        step, cfg, model, examples = load_run(Path(a.run))
        prompts = [prompt for prompt in a.prompt for _ in range(a.per_prompt)]
        images = sample_images(model, examples, prompts, int(cfg["data"]["image_size"]), steps=a.steps,
                               guidance=a.guidance, seed=a.seed)
        save_grid(images.numpy(), a.out, rows=len(a.prompt))
        return f"wrote {a.out}: {len(a.prompt)} prompt(s) x {a.per_prompt} from {step}"

    return exit_status(draw)


if __name__ == "__main__":
    sys.exit(main())
