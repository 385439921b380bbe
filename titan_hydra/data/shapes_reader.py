"""Reading pictures back against the shapes grammar: does a picture show what its caption says?

A caption of the built-in set (``shapes.py``) names four things: the shape's colour, its kind,
its place and the background colour. This module reads each of them from a picture by the
shapes' own geometry, so that a text-to-image model's samples are scored without another model:

* background: the median colour of the picture's outer ring (2 px; no shape reaches within 5% of
  the border), nearest of the 8 named colours;
* colour at the named place: the mean colour of a small box (an eighth of the side) centred on
  the place the caption names, nearest named colour; every shape of the set covers that box;
* place and kind: the picture's soft shape mask (how much nearer each pixel is to the shape's
  colour than to the background's) against templates of every kind, place and a grid of sizes
  drawn by the generator itself; the nearest template (mean absolute difference) names both.

On the dataset's own pictures every reading is right (``tests/test_flux_fidelity.py``). Chance,
for a picture that ignores its caption, is ``CHANCE``: 1/8 per colour, 1/5 for the place, 1/3
for the kind, and 1/64 for both colours at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from titan_hydra.data.shapes import COLOURS, PLACES, SHAPES, draw_shape

NAMES = list(COLOURS)
PALETTE = np.array([COLOURS[n] for n in NAMES], dtype=np.float32)  # [8, 3]
PLACE_CENTRES = dict(PLACES)
SCALES = tuple(0.3 + 0.0125 * i for i in range(17))  # template sizes across the generator's range (0.3-0.5)
CAPTION = re.compile(r"^a (?P<colour>\w+) (?P<shape>\w+) (?P<place>in the centre|at the (?:top|bottom) (?:left|right)) "
                     r"on a (?P<background>\w+) background$")
METRICS = ("background", "colour", "place", "shape", "background_and_colour")
CHANCE = {"background": 1 / 8, "colour": 1 / 8, "place": 1 / 5, "shape": 1 / 3, "background_and_colour": 1 / 64}


@dataclass(frozen=True)
class Reading:
    """What a caption says, or what a picture shows, in the grammar's words."""

    colour: str
    shape: str
    place: str
    background: str


def parse_caption(caption: str) -> Reading:
    """The four words of a caption of the grammar; ValueError for any other text."""
    m = CAPTION.match(caption.strip())
    if m is None or m["colour"] not in COLOURS or m["background"] not in COLOURS or m["shape"] not in SHAPES:
        raise ValueError(f"{caption!r} is not a caption of the shapes grammar "
                         "('a <colour> <shape> <place> on a <colour> background')")
    return Reading(m["colour"], m["shape"], m["place"], m["background"])


def nearest_colour(rgb: np.ndarray) -> str:
    return NAMES[int(np.argmin(((PALETTE - np.asarray(rgb, dtype=np.float32)) ** 2).sum(-1)))]


def _box(size: int, place: str) -> tuple[slice, slice]:
    cx, cy = PLACE_CENTRES[place]
    half = max(1, size // 16)
    x, y = int(round(cx * size)), int(round(cy * size))
    return slice(y - half, y + half), slice(x - half, x + half)


@lru_cache(maxsize=4)
def _templates(size: int) -> tuple[np.ndarray, list[tuple[str, str]]]:
    """Binary masks [T, size, size] of every (kind, place, scale), and the (kind, place) of each."""
    masks, labels = [], []
    for shape in SHAPES:
        for place, centre in PLACES:
            for scale in SCALES:
                drawn = draw_shape(size, shape, "white", "black", centre, scale)
                masks.append(drawn[..., 0] > 127)
                labels.append((shape, place))
    return np.stack(masks).astype(np.float32), labels


def read_picture(image: np.ndarray, place: str) -> Reading:
    """What uint8 picture ``image`` [H, W, 3] shows; its colour is read at ``place`` (a place name)."""
    pixels = np.asarray(image, dtype=np.float32)
    size = pixels.shape[0]
    ring = np.concatenate([pixels[:2].reshape(-1, 3), pixels[-2:].reshape(-1, 3),
                           pixels[:, :2].reshape(-1, 3), pixels[:, -2:].reshape(-1, 3)])
    background = nearest_colour(np.median(ring, axis=0))
    rows, cols = _box(size, place)
    colour = nearest_colour(pixels[rows, cols].reshape(-1, 3).mean(0))
    # The shape's mask against the read colours (the one at the named place unless it is the background's).
    bg, fg = PALETTE[NAMES.index(background)], PALETTE[NAMES.index(colour)]
    if colour == background:
        far = np.linalg.norm(pixels - bg, axis=-1)
        fg = pixels.reshape(-1, 3)[int(np.argmax(far))]
    d_bg = np.linalg.norm(pixels - bg, axis=-1)
    d_fg = np.linalg.norm(pixels - fg, axis=-1)
    mask = d_bg / np.maximum(d_bg + d_fg, 1e-6)
    templates, labels = _templates(size)
    # sum |T - m| over pixels, for binary T and m in [0, 1]: sum T + sum m - 2 T.m (one matrix product)
    distance = templates.sum(axis=(1, 2)) + mask.sum() - 2 * templates.reshape(len(labels), -1) @ mask.reshape(-1)
    shape, found = labels[int(np.argmin(distance))]
    return Reading(colour, shape, found, background)


def score_pictures(images: np.ndarray, captions: list[str]) -> dict[str, float]:
    """Fractions of ``captions`` whose picture (uint8 [N, H, W, 3]) shows each named thing right
    (``METRICS``; ``background_and_colour``: both colours right at once)."""
    if len(images) != len(captions) or not captions:
        raise ValueError(f"{len(images)} pictures for {len(captions)} captions")
    hits = dict.fromkeys(METRICS, 0)
    for image, caption in zip(images, captions):
        said = parse_caption(caption)
        seen = read_picture(np.asarray(image), said.place)
        right = {"background": seen.background == said.background, "colour": seen.colour == said.colour,
                 "place": seen.place == said.place, "shape": seen.shape == said.shape}
        right["background_and_colour"] = right["background"] and right["colour"]
        for key, ok in right.items():
            hits[key] += int(ok)
    return {key: hits[key] / len(captions) for key in METRICS}
