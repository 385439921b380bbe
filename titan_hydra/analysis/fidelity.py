"""Caption fidelity of a FLUX.1 run: does it draw what held-out captions say?

One picture per held-out caption of the shapes grammar (captions a set drawn with ``data.holdout``
never shows), drawn by the run's sampler with fixed noise and read back by the shapes' own geometry
(``titan_hydra/data/shapes_reader.py``), as ``eval=fidelity`` does during training; the rates
beside chance, a labelled grid of pictures with their captions, and the rates a run logged
(``val/fidelity/*``). ``recipes/flux_fidelity.py`` and ``recipes/bench_flux_fidelity.py`` are the
command lines.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from titan_hydra.checkpoint.offline import load_flux_run
from titan_hydra.data.shapes import heldout_captions
from titan_hydra.data.shapes_reader import CHANCE, METRICS, score_pictures
from titan_hydra.errors import UserError
from titan_hydra.models.flux.sampling import sample_images

ZOOM = 2  # 64 px pictures are small on a page
LINE = 12  # pixels per line of the default font

TARGET = 0.8  # the bar: background right and the shape's colour at its named place


def last_fidelity(metrics: list[dict]) -> tuple[int, dict[str, float]]:
    """(step, {what: fraction}) of the last row that logged ``val/fidelity/*``."""
    rows = [r for r in metrics if any(k.startswith("val/fidelity/") for k in r)]
    if not rows:
        raise RuntimeError("the run logged no val/fidelity/* (eval=fidelity and data.holdout > 0 are needed)")
    last = rows[-1]
    return int(last["step"]), {k.split("/", 2)[2]: float(v) for k, v in last.items() if k.startswith("val/fidelity/")}


def row_table(result: dict) -> str:
    f = result["fidelity"]
    head = "| CPU | threads | steps | wall (s) | " + " | ".join(METRICS) + " | >= 80% |"
    rule = "|---|---:|---:|---:|" + "---:|" * len(METRICS) + "---|"
    cells = " | ".join(f"{f[k]:.0%}" for k in METRICS)
    chance = " | ".join(f"{CHANCE[k]:.0%}" for k in METRICS)
    ok = "yes" if f["background_and_colour"] >= TARGET else "no"
    return "\n".join([head, rule, f"| {result['cpu']} | {result['threads']} | {result['steps']} | "
                      f"{result['wall_s']:.0f} | {cells} | {ok} |", f"| chance | | | | {chance} | |"])


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


def score(run: Path, prompts: int = 64, steps: int | None = None, guidance: float | None = None,
          seed: int | None = None, shift: float | None = None, holdout: float | None = None, grid: str | None = None,
          grid_prompts: int = 4, per_prompt: int = 4) -> dict:
    """The rates (and sampler settings) of a Flux run's checkpoint on the held-out captions; sampler
    settings default to the run's ``eval.sample_*``, ``holdout`` to its ``data.holdout``. ``grid``:
    also write the labelled PNG of the first ``grid_prompts`` captions, ``per_prompt`` each."""
    step, cfg, model, examples = load_flux_run(Path(run))
    holdout = holdout if holdout is not None else cfg["data"].get("holdout") or 0.0
    if not holdout:
        raise UserError(f"{run} held no captions out of training (data.holdout=0): pass --holdout 0.1 to score "
                        "captions of the grammar it may have trained on")
    ev = cfg.get("eval", {})
    sampler = {"steps": steps or ev.get("sample_steps", 20),
               "guidance": guidance if guidance is not None else ev.get("sample_guidance", 3.0),
               "seed": seed if seed is not None else ev.get("sample_seed", 0)}
    if shift is not None:
        examples.timestep_shift = shift
    captions = heldout_captions(holdout)[:prompts]
    size = int(cfg["data"]["image_size"])
    images = sample_images(model, examples, captions, size, **sampler).numpy()
    rates = {**score_pictures(images, captions), "prompts": len(captions)}
    result = {"checkpoint": str(step), "holdout": holdout, "shift": examples.timestep_shift, **sampler, **rates}
    if grid:
        shown = captions[:grid_prompts]
        drawn = sample_images(model, examples, [p for p in shown for _ in range(per_prompt)], size,
                              **sampler).numpy()
        Path(grid).parent.mkdir(parents=True, exist_ok=True)
        labelled_grid(drawn, shown, rates, per_prompt).save(grid)
    return result


def summary(result: dict) -> str:
    """What ``recipes/flux_fidelity.py`` prints: the sampler settings, the table, the JSON."""
    return (f"{result['checkpoint']}: {result['prompts']} held-out captions, {result['steps']} steps, "
            f"guidance {result['guidance']}, shift {result['shift']}\n{table(result)}\n{json.dumps(result)}")
