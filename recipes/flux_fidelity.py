"""Score a Flux checkpoint's caption fidelity: does it draw what held-out captions say?

    python recipes/flux_fidelity.py outputs/<run> [--prompts 64] [--steps 20] [--guidance 3] [--seed 0]
        [--shift 1.0] [--holdout 0.1] [--json fidelity.json] [--grid grid.png --grid-prompts 4 --per-prompt 4]

One picture per held-out caption of the shapes grammar (captions a set drawn with ``data.holdout``
never shows), drawn by the run's sampler with fixed noise and read back by the shapes' own
geometry (``titan_hydra/data/shapes_reader.py``), as ``eval=fidelity`` does during training. It
prints a table (each rate beside chance) and writes the JSON; ``--grid`` also writes a PNG of the
first ``--grid-prompts`` captions, ``--per-prompt`` pictures each, every caption printed under its
row and the rates beside the grid. Sampler settings default to the run's ``eval.sample_*``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import numpy as np  # noqa: E402
from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from generate_image import load_run  # noqa: E402
from titan_hydra.data.shapes import heldout_captions  # noqa: E402
from titan_hydra.data.shapes_reader import CHANCE, METRICS, score_pictures  # noqa: E402
from titan_hydra.errors import UserError, first_line  # noqa: E402

ZOOM = 2  # 64 px pictures are small on a page
LINE = 12  # pixels per line of the default font


def labelled_grid(images: np.ndarray, captions: list[str], rates: dict[str, float], per_prompt: int) -> Image.Image:
    """Rows of ``per_prompt`` pictures, each row's caption under it; the rates in a column beside."""
    rows = len(captions)
    side = images.shape[1] * ZOOM
    font = ImageFont.load_default()
    panel = 200
    width = max(per_prompt * side, 6 * max(len(c) for c in captions) + 8) + panel
    canvas = Image.new("RGB", (width, rows * (side + LINE + 6)), (255, 255, 255))
    pen = ImageDraw.Draw(canvas)
    for r, caption in enumerate(captions):
        top = r * (side + LINE + 6)
        for c in range(per_prompt):
            picture = Image.fromarray(np.ascontiguousarray(images[r * per_prompt + c]))
            canvas.paste(picture.resize((side, side), Image.Resampling.NEAREST), (c * side, top))
        pen.text((2, top + side + 2), caption, fill=(0, 0, 0), font=font)
    x = width - panel + 8
    pen.text((x, 4), f"held-out captions: {rates['prompts']:.0f}", fill=(0, 0, 0), font=font)
    for i, key in enumerate(METRICS):
        pen.text((x, 4 + (i + 1) * LINE), f"{key}: {rates[key]:.0%} (chance {CHANCE[key]:.0%})", fill=(0, 0, 0),
                 font=font)
    return canvas


def table(rates: dict[str, float]) -> str:
    lines = ["| read back | right | chance |", "|---|---|---|"]
    lines += [f"| {key} | {rates[key]:.1%} | {CHANCE[key]:.1%} |" for key in METRICS]
    return "\n".join(lines)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="run directory or checkpoint/step-N directory")
    p.add_argument("--prompts", type=int, default=64, help="held-out captions scored (at most all of them)")
    p.add_argument("--steps", type=int, help="sampler steps (default: the run's eval.sample_steps)")
    p.add_argument("--guidance", type=float, help="guidance scale (default: the run's eval.sample_guidance)")
    p.add_argument("--seed", type=int, help="the noise (default: the run's eval.sample_seed)")
    p.add_argument("--shift", type=float, help="the sampler's timestep shift (default: the run's)")
    p.add_argument("--holdout", type=float, help="held-out fraction (default: the run's data.holdout)")
    p.add_argument("--json", help="write the rates here")
    p.add_argument("--grid", help="write a labelled PNG grid here")
    p.add_argument("--grid-prompts", type=int, default=4)
    p.add_argument("--per-prompt", type=int, default=4)
    return p.parse_args(argv)


def score(a: argparse.Namespace) -> dict:
    from titan_hydra.models.flux.sampling import sample_images

    step, cfg, model, examples = load_run(Path(a.run))
    holdout = a.holdout if a.holdout is not None else cfg["data"].get("holdout") or 0.0
    if not holdout:
        raise UserError(f"{a.run} held no captions out of training (data.holdout=0): pass --holdout 0.1 to score "
                        "captions of the grammar it may have trained on")
    ev = cfg.get("eval", {})
    sampler = {"steps": a.steps or ev.get("sample_steps", 20),
               "guidance": a.guidance if a.guidance is not None else ev.get("sample_guidance", 3.0),
               "seed": a.seed if a.seed is not None else ev.get("sample_seed", 0)}
    if a.shift is not None:
        examples.timestep_shift = a.shift
    prompts = heldout_captions(holdout)[: a.prompts]
    size = int(cfg["data"]["image_size"])
    images = sample_images(model, examples, prompts, size, **sampler).numpy()
    rates = {**score_pictures(images, prompts), "prompts": len(prompts)}
    result = {"checkpoint": str(step), "holdout": holdout, "shift": examples.timestep_shift, **sampler, **rates}
    if a.grid:
        shown = prompts[: a.grid_prompts]
        grid = sample_images(model, examples, [p for p in shown for _ in range(a.per_prompt)], size,
                             **sampler).numpy()
        Path(a.grid).parent.mkdir(parents=True, exist_ok=True)
        labelled_grid(grid, shown, rates, a.per_prompt).save(a.grid)
    return result


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        result = score(a)
    except UserError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 2
    print(f"{result['checkpoint']}: {result['prompts']} held-out captions, {result['steps']} steps, "
          f"guidance {result['guidance']}, shift {result['shift']}")
    print(table(result))
    print(json.dumps(result))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
