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


def shapes_dataset(count: int, size: int, seed: int = 0) -> tuple[np.ndarray, list[str]]:
    """``count`` images [count, size, size, 3] uint8 and their captions, e.g. "a red circle at the
    top left on a blue background"."""
    if count < 1 or size < 8:
        raise ValueError(f"the shapes set needs count >= 1 and image size >= 8 (got {count}, {size})")
    rng = np.random.default_rng(seed)
    names = list(COLOURS)
    images = np.empty((count, size, size, 3), dtype=np.uint8)
    captions = []
    for i in range(count):
        shape = SHAPES[rng.integers(len(SHAPES))]
        colour = names[rng.integers(len(names))]
        background = names[rng.integers(len(names))]
        while background == colour:
            background = names[rng.integers(len(names))]
        place_name, place = PLACES[rng.integers(len(PLACES))]
        scale = float(rng.uniform(0.3, 0.5))
        images[i] = draw_shape(size, shape, colour, background, place, scale)
        captions.append(f"a {colour} {shape} {place_name} on a {background} background")
    return images, captions
