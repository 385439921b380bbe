"""Image-caption data for a family that learns from pictures and their captions.

``ImageCaptionDataset`` sources images and captions (the procedural shapes set, a folder of
images with ``.txt`` captions, or a JSONL file of ``{"image": path, "text": caption}``), has the
family's example builder (``data.examples``, built by Hydra: for FLUX.1,
``models/flux/examples.FluxExamples``) encode them once, caches the encodings on disk, and
serves training examples through the same global sample stream as token data
(``loader.SampleStream``): every data-parallel layout sees the same global batches, a
checkpoint resumes under another layout, and the per-visit randomness the builder draws (noise,
timesteps, caption dropout) is keyed by the stream position, so it is the same in every layout.

The example builder is duck-typed (no family is named here): ``cache_key()``, ``encode(images
uint8 [N, H, W, 3], captions) -> {"samples": {name: tensor [N, ...]}, "constants": {name:
tensor}}``, ``make_batch(samples, constants, positions, seed, train) -> (inputs, target)``, and
``image_tokens(image_size)`` / ``text_tokens`` for the FLOP count.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from titan_hydra.data.dataset import default_cache_dir
from titan_hydra.data.loader import SampleStream
from titan_hydra.data.shapes import heldout_captions, shapes_dataset
from titan_hydra.data.shapes_reader import score_pictures
from titan_hydra.errors import DataError

SOURCES = ("shapes", "folder", "jsonl")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp")


def _square(image: Image.Image, size: int) -> np.ndarray:
    """Centre-crop to a square, resize to ``size``, RGB uint8."""
    image = image.convert("RGB")
    side = min(image.size)
    left, top = (image.width - side) // 2, (image.height - side) // 2
    image = image.crop((left, top, left + side, top + side)).resize((size, size), Image.Resampling.BICUBIC)
    return np.asarray(image, dtype=np.uint8)


def _open(path: Path, size: int) -> np.ndarray:
    try:
        with Image.open(path) as image:
            return _square(image, size)
    except OSError as e:
        raise DataError(f"cannot read image {path}: {e}") from None


def folder_dataset(path: str, size: int, limit: int | None) -> tuple[np.ndarray, list[str]]:
    """Every image of a folder (sorted) whose ``<stem>.txt`` holds its caption."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise DataError(f"data.path={path} is not a directory of images with .txt captions")
    files = sorted(p for p in root.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)[:limit]
    if not files:
        raise DataError(f"data.path={path} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    captions = []
    for f in files:
        caption = f.with_suffix(".txt")
        if not caption.exists():
            raise DataError(f"image {f} has no caption file {caption.name}; add one (one line of text)")
        captions.append(caption.read_text().strip())
    return np.stack([_open(f, size) for f in files]), captions


def jsonl_dataset(path: str, size: int, limit: int | None) -> tuple[np.ndarray, list[str]]:
    """``{"image": path relative to the file, "text": caption}`` per line."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise DataError(f"data.path={path} is not a JSONL file of {{\"image\": ..., \"text\": ...}} lines")
    images, captions = [], []
    for n, line in enumerate(file.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            image, text = record["image"], record["text"]
        except (ValueError, KeyError, TypeError):
            raise DataError(f"{file}:{n} is not a JSON object with \"image\" and \"text\"") from None
        images.append(_open(file.parent / image, size))
        captions.append(str(text))
        if limit is not None and len(images) >= limit:
            break
    if not images:
        raise DataError(f"data.path={path} has no records")
    return np.stack(images), captions


class ImageCaptionDataset:
    """Encoded image-caption pairs, split into ``train`` and ``val``, plus loaders over them."""

    def __init__(self, source: str = "shapes", path: str | None = None, num_images: int = 256,
                 image_size: int = 64, val_fraction: float = 0.125, shuffle: bool = True, seed: int = 0,
                 cache_dir: str | None = None, examples: Any = None,
                 holdout: float = 0.0):  # shapes only: the grammar's captions never drawn (scored by fidelity)
        if source not in SOURCES:
            raise DataError(f"unknown data.source={source!r} for image data; choose one of {', '.join(SOURCES)}")
        if source != "shapes" and not path:
            raise DataError(f"data.source={source} needs data.path")
        if image_size < 16 or image_size % 16:
            raise DataError(f"data.image_size={image_size} must be a positive multiple of 16 "
                            "(8x autoencoder downsampling, then 2x2 patches)")
        if not 0.0 < val_fraction < 1.0:
            raise DataError(f"data.val_fraction={val_fraction} must be in (0, 1)")
        if holdout and (source != "shapes" or not 0.0 < holdout < 1.0):
            raise DataError(f"data.holdout={holdout} holds captions of the shapes grammar out of training: it "
                            "needs data.source=shapes and a fraction in (0, 1) (or 0 for none)")
        if examples is None:
            raise DataError("image data needs data.examples: the model family's example builder (_target_)")
        self.source, self.path, self.num_images, self.image_size = source, path, int(num_images), int(image_size)
        self.val_fraction, self.shuffle, self.seed = float(val_fraction), bool(shuffle), int(seed)
        self.examples, self.holdout = examples, float(holdout)
        self.cache_dir = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
        self.document_eos_id = None  # token-data notion; never set for images
        self._encoded = self._load_or_encode()
        n = len(next(iter(self._encoded["samples"].values())))
        n_val = max(1, int(round(n * self.val_fraction)))
        if n - n_val < 1:
            raise DataError(f"{n} images cannot be split into train and val; add images or lower data.val_fraction")
        self._splits = {"train": range(0, n - n_val), "val": range(n - n_val, n)}
        self.stats = {"images": {s: len(r) for s, r in self._splits.items()}, "image_size": self.image_size}

    # -- the examples' geometry (FLOP count) ---------------------------------------------
    @property
    def image_tokens(self) -> int:
        return int(self.examples.image_tokens(self.image_size))

    @property
    def text_tokens(self) -> int:
        return int(self.examples.text_tokens)

    # -- sourcing and caching --------------------------------------------------------------
    def _raw(self) -> tuple[np.ndarray, list[str]]:
        if self.source == "shapes":
            return shapes_dataset(self.num_images, self.image_size, self.seed, self.holdout)
        if self.source == "folder":
            return folder_dataset(str(self.path), self.image_size, self.num_images)
        return jsonl_dataset(str(self.path), self.image_size, self.num_images)

    def cache_key(self) -> str:
        what = [self.source, str(self.path), self.num_images, self.image_size, self.seed, self.examples.cache_key()]
        what = json.dumps(what + [self.holdout] if self.holdout else what)  # keys of sets without holdout unchanged
        return hashlib.sha256(what.encode()).hexdigest()[:24]

    def _load_or_encode(self) -> dict[str, dict[str, torch.Tensor]]:
        """The encoded set from the cache, or encoded now and cached (complete or absent: written
        to a temporary file and renamed). A cache hit reads no image: the key already names the
        source, its size and the encoders."""
        file = self.cache_dir / f"images-{self.source}-{self.cache_key()}.pt"
        if file.exists():
            try:
                return torch.load(file, weights_only=True)
            except (OSError, RuntimeError, EOFError):
                pass  # unreadable: encode again and overwrite
        images, captions = self._raw()
        with torch.no_grad():
            encoded = self.examples.encode(images, captions)
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            tmp = file.with_suffix(f".{os.getpid()}.tmp")
            torch.save(encoded, tmp)
            os.replace(tmp, file)
        except OSError:
            pass  # a read-only cache costs time, never the run
        return encoded

    # -- fidelity: captions the training set never shows, and a reader of pictures drawn from them --
    def heldout_prompts(self, count: int) -> list[str]:
        """The first ``count`` held-out captions (all of them if fewer); DataError when this set
        holds none out or has no grammar to read pictures against."""
        if self.source != "shapes" or not self.holdout:
            raise DataError("fidelity needs captions held out of a set whose pictures can be read back: "
                            "data.source=shapes with data.holdout > 0 (e.g. data=flux_shapes data.holdout=0.1)")
        return heldout_captions(self.holdout)[:count]

    @staticmethod
    def score_pictures(images: np.ndarray, prompts: list[str]) -> dict[str, float]:
        """{what: fraction right} of pictures drawn from ``heldout_prompts`` (``shapes_reader``)."""
        return score_pictures(images, prompts)

    # -- loaders -----------------------------------------------------------------------------
    def loader(self, split: str, local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1,
               infinite: bool = True) -> "ExampleLoader":
        if split not in self._splits:
            raise DataError(f"unknown split {split!r}; use train or val")
        rows = self._splits[split]
        samples = {k: v[rows.start:rows.stop] for k, v in self._encoded["samples"].items()}
        return ExampleLoader(samples, self._encoded["constants"], self.examples, local_batch_size, dp_rank, dp_degree,
                             shuffle=self.shuffle and split == "train", seed=self.seed, infinite=infinite,
                             split=split)

    def summary(self) -> str:
        """The run header's data line."""
        return (f"{self.stats['images']['train']:,} train, {self.stats['images']['val']:,} val images of "
                f"{self.image_size} px; {self.image_tokens} image + {self.text_tokens} text tokens each")

    def __repr__(self) -> str:
        return (f"ImageCaptionDataset(source={self.source!r}, images={sum(self.stats['images'].values())}, "
                f"image_size={self.image_size})")


class ExampleLoader(SampleStream):
    """Batches ``(inputs, target)`` of encoded samples, made into examples by the family's builder."""

    kind = "examples"

    def __init__(self, samples: dict[str, torch.Tensor], constants: dict[str, torch.Tensor], examples: Any,
                 local_batch_size: int, dp_rank: int = 0, dp_degree: int = 1, shuffle: bool = False, seed: int = 0,
                 infinite: bool = True, split: str = "train"):
        self.samples, self.constants, self.examples = samples, constants, examples
        super().__init__(len(next(iter(samples.values()))), local_batch_size, dp_rank, dp_degree, shuffle, seed,
                         infinite, split)

    def fetch(self, indices: np.ndarray, positions: np.ndarray):
        rows = torch.from_numpy(np.asarray(indices, dtype=np.int64))
        batch = {k: v.index_select(0, rows) for k, v in self.samples.items()}
        return self.examples.make_batch(batch, self.constants, positions, seed=self.seed, train=self.split == "train")
