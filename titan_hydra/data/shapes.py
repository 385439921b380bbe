"""A built-in image-caption set, drawn procedurally: coloured shapes on coloured backgrounds.

It exists so that an image model trains on any machine with no download, on data whose captions
really describe the pictures (a shape, its colour, where it sits, the background), so that a
text-conditioned model has something to learn and its samples can be checked by eye. Image ``i``
of a seed is the same on every machine (numpy's PCG64 stream, Pillow's rasterizer).
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (235, 210, 40),
    "purple": (140, 60, 190), "orange": (240, 140, 30), "white": (245, 245, 245), "black": (20, 20, 20),
}
SHAPES = ("circle", "square", "triangle")
# (name, centre as a fraction of the image side): where a shape sits, said in the caption
PLACES: tuple[tuple[str, tuple[float, float]], ...] = (
    ("in the centre", (0.5, 0.5)), ("at the top left", (0.3, 0.3)), ("at the top right", (0.7, 0.3)),
    ("at the bottom left", (0.3, 0.7)), ("at the bottom right", (0.7, 0.7)),
)


def draw_shape(size: int, shape: str, colour: str, background: str, place: tuple[float, float],
               scale: float) -> np.ndarray:
    """One [size, size, 3] uint8 RGB image."""
    image = Image.new("RGB", (size, size), COLOURS[background])
    pen = ImageDraw.Draw(image)
    cx, cy = place[0] * size, place[1] * size
    r = scale * size / 2
    box = (cx - r, cy - r, cx + r, cy + r)
    if shape == "circle":
        pen.ellipse(box, fill=COLOURS[colour])
    elif shape == "square":
        pen.rectangle(box, fill=COLOURS[colour])
    else:
        pen.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=COLOURS[colour])
    return np.asarray(image, dtype=np.uint8)


HOLDOUT_SEED = 1234  # which captions are held out: fixed, whatever the data seed


def caption_of(colour: str, shape: str, place_name: str, background: str) -> str:
    return f"a {colour} {shape} {place_name} on a {background} background"


def all_captions() -> list[str]:
    """Every caption of the grammar (8 colours x 3 shapes x 5 places x 7 other backgrounds = 840)."""
    return [caption_of(c, s, p, b) for c in COLOURS for s in SHAPES for p, _ in PLACES for b in COLOURS if b != c]


def heldout_captions(fraction: float) -> list[str]:
    """A fixed ``fraction`` of the grammar's captions, in a fixed order: a set drawn with
    ``holdout=fraction`` never shows them, so a model is scored on combinations it never saw."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"holdout={fraction} must be in [0, 1)")
    captions = all_captions()
    order = np.random.default_rng(HOLDOUT_SEED).permutation(len(captions))
    return [captions[i] for i in order[: int(round(fraction * len(captions)))]]


def shapes_dataset(count: int, size: int, seed: int = 0, holdout: float = 0.0) -> tuple[np.ndarray, list[str]]:
    """``count`` images [count, size, size, 3] uint8 and their captions, e.g. "a red circle at the
    top left on a blue background"; none of them one of ``heldout_captions(holdout)`` (those are
    drawn again; with holdout 0 the stream is the one every earlier version drew)."""
    if count < 1 or size < 8:
        raise ValueError(f"the shapes set needs count >= 1 and image size >= 8 (got {count}, {size})")
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    excluded = set(heldout_captions(holdout))
    images = np.empty((count, size, size, 3), dtype=np.uint8)
    captions = []
    for i in range(count):
        caption = None
        while caption is None or caption in excluded:
            shape = SHAPES[rng.integers(len(SHAPES))]
            colour = names[rng.integers(len(names))]
            background = names[rng.integers(len(names))]
            while background == colour:
                background = names[rng.integers(len(names))]
            place_name, place = PLACES[rng.integers(len(PLACES))]
            caption = caption_of(colour, shape, place_name, background)
        scale = float(rng.uniform(0.3, 0.5))
        images[i] = draw_shape(size, shape, colour, background, place, scale)
        captions.append(caption)
    return images, captions
