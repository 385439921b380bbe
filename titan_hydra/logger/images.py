"""Picture grids: sample images laid out as one PNG (rows x columns, in order).

Used by the metric logger for the sample images a family draws during training
(``eval.sample_every``) and by ``recipes/generate_image.py``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image


def image_grid(images: np.ndarray, rows: int = 1) -> Image.Image:
    """uint8 images [N, H, W, 3] as one picture of ``rows`` rows of N/rows images (row-major)."""
    n, h, w, _ = images.shape
    if rows <= 0 or n % rows:
        raise ValueError(f"{n} images do not fill {rows} rows")
    cols = n // rows
    canvas = Image.new("RGB", (cols * w, rows * h), (255, 255, 255))
    for i, image in enumerate(images):
        canvas.paste(Image.fromarray(np.ascontiguousarray(image)), ((i % cols) * w, (i // cols) * h))
    return canvas


def save_grid(images: np.ndarray, path: str | Path, rows: int = 1) -> Path:
    """Write ``image_grid(images, rows)`` as a PNG at ``path`` (folders made); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image_grid(images, rows).save(path)
    return path
