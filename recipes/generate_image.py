"""Sample a PNG grid from a trained FLUX.1 run (offline, one process, CPU).

    python recipes/generate_image.py outputs/<run> --prompt "a red circle in the centre on a blue background" \\
        [--prompt ...] [--per-prompt 4] [--steps 20] [--guidance 3.0] [--seed 0] [--out grid.png]

``<run>`` is the run directory (its ``.hydra/config.yaml`` names the model and the encoders) or one
of its ``checkpoint/step-N`` directories; a run directory uses its newest complete checkpoint. The
grid has a row per prompt and ``--per-prompt`` samples (different noise) per row. Errors (no run,
no checkpoint, not a Flux run) are one line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from titan_hydra.analysis.flags import add_out, parser
from titan_hydra.checkpoint.offline import load_flux_run
from titan_hydra.errors import exit_status
from titan_hydra.logger.images import save_grid
from titan_hydra.models.flux.sampling import sample_images


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("run", help="run directory or checkpoint/step-N directory")
    p.add_argument("--prompt", action="append", required=True, help="repeat for several rows")
    p.add_argument("--per-prompt", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--guidance", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    add_out(p, "the PNG grid", default="grid.png")
    a = p.parse_args(argv)

    def draw() -> str:
        step, cfg, model, examples = load_flux_run(Path(a.run))
        prompts = [prompt for prompt in a.prompt for _ in range(a.per_prompt)]
        images = sample_images(model, examples, prompts, int(cfg["data"]["image_size"]), steps=a.steps,
                               guidance=a.guidance, seed=a.seed)
        save_grid(images.numpy(), a.out, rows=len(a.prompt))
        return f"wrote {a.out}: {len(a.prompt)} prompt(s) x {a.per_prompt} from {step}"

    return exit_status(draw)


if __name__ == "__main__":
    sys.exit(main())
