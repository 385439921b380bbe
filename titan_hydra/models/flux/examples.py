"""FLUX.1 training examples: encoded images and captions in, ``(inputs, velocity target)`` out.

The data layer (``data/image_caption.py``) sources pictures and orders samples; this module is
the family's part of the pipeline, built by Hydra from ``data.examples``:

* ``encode`` runs the frozen encoders once per image (T5 context, CLIP pooled vector, autoencoder
  latents), plus the empty caption's encodings (caption dropout replaces a caption by it, which
  is what classifier-free guidance needs at sampling time);
* ``make_batch`` makes the rectified-flow examples: ``x_t = (1 - t) x0 + t noise`` with the
  velocity ``noise - x0`` as the target. Noise, ``t`` and caption dropout are drawn from a
  generator keyed by the sample's global stream position, so every data-parallel layout (and a
  resumed run) trains on the same examples. Training ``t`` follows FLUX's shifted logit-normal
  (``sigmoid(N(0, 1))``, then ``shift t / (1 + (shift - 1) t)``); validation uses fixed, evenly
  spaced ``t`` and fixed noise, so ``val/loss`` compares across steps and runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from titan_hydra.models.flux.encoders import VAE_DOWNSAMPLE, FluxEncoders
from titan_hydra.models.flux.model import image_ids, patchify, text_ids

VAL_TIMESTEPS = 8  # validation t = (k + 0.5) / 8, k = position mod 8


def image_tokens_of(image_size: int) -> int:
    """Image tokens of one picture: 8x downsampled by the autoencoder, then 2x2 latent patches."""
    side = int(image_size) // VAE_DOWNSAMPLE // 2
    return side * side


class FluxExamples:
    """``data.examples`` for FLUX.1 (see the module docstring)."""

    def __init__(self, context_dim: int, pooled_dim: int, pretrained: str | None = None, max_text_len: int = 32,
                 caption_dropout: float = 0.1, timestep_shift: float = 1.0, guidance: float | None = None,
                 encoder_seed: int = 0, autoencoder: str = "dct", tokenizer: str = "bytes"):
        if not 0.0 <= caption_dropout < 1.0:
            raise ValueError(f"data.examples.caption_dropout={caption_dropout} must be in [0, 1)")
        if timestep_shift <= 0:
            raise ValueError(f"data.examples.timestep_shift={timestep_shift} must be > 0")
        self.context_dim, self.pooled_dim = int(context_dim), int(pooled_dim)
        self.pretrained, self.max_text_len = pretrained, int(max_text_len)
        self.caption_dropout, self.timestep_shift = float(caption_dropout), float(timestep_shift)
        self.guidance = None if guidance is None else float(guidance)
        self.encoder_seed = int(encoder_seed)
        self.autoencoder = str(autoencoder)  # tiny encoders only: dct or kl (encoders.FluxEncoders.tiny)
        self.tokenizer = str(tokenizer)  # tiny encoders only: bytes or words (encoders.TOKENIZERS)
        self._encoders: FluxEncoders | None = None

    @property
    def encoders(self) -> FluxEncoders:
        """Built on first use: a run whose encodings are cached never loads them."""
        if self._encoders is None:
            self._encoders = (FluxEncoders.pretrained(self.pretrained) if self.pretrained
                              else FluxEncoders.tiny(self.context_dim, self.pooled_dim, self.encoder_seed,
                                                     self.autoencoder, self.tokenizer))
        return self._encoders

    # -- geometry --------------------------------------------------------------------------------
    def image_tokens(self, image_size: int) -> int:
        return image_tokens_of(image_size)

    @property
    def text_tokens(self) -> int:
        return self.max_text_len

    def cache_key(self) -> str:
        return (f"flux:{self.pretrained or 'tiny'}:{self.context_dim}:{self.pooled_dim}:{self.max_text_len}:"
                f"{self.encoder_seed}:{self.autoencoder}" + ("" if self.tokenizer == "bytes" else f":{self.tokenizer}"))

    # -- encoding ---------------------------------------------------------------------------------
    def encode(self, images: np.ndarray, captions: list[str], chunk: int = 32) -> dict[str, Any]:
        """{"samples": {latents, context, pooled} [N, ...], "constants": the empty caption's encodings}."""
        enc = self.encoders
        latents, contexts, pooled = [], [], []
        for i in range(0, len(captions), chunk):
            latents.append(enc.encode_images(torch.from_numpy(images[i:i + chunk])))
            c, p = enc.encode_text(captions[i:i + chunk], self.max_text_len)
            contexts.append(c)
            pooled.append(p)
        null_context, null_pooled = enc.encode_text([""], self.max_text_len)
        return {"samples": {"latents": torch.cat(latents), "context": torch.cat(contexts), "pooled": torch.cat(pooled)},
                "constants": {"null_context": null_context[0], "null_pooled": null_pooled[0]}}

    # -- examples ---------------------------------------------------------------------------------
    def _sample_t(self, rng: np.random.Generator, position: int, train: bool) -> float:
        if not train:
            return (position % VAL_TIMESTEPS + 0.5) / VAL_TIMESTEPS
        t = 1.0 / (1.0 + np.exp(-rng.standard_normal()))
        s = self.timestep_shift
        return float(s * t / (1.0 + (s - 1.0) * t))

    def make_batch(self, samples: dict[str, torch.Tensor], constants: dict[str, torch.Tensor],
                   positions: np.ndarray, seed: int, train: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        x0 = samples["latents"]
        b, _, h, w = x0.shape
        noise = torch.empty_like(x0)
        t = torch.empty(b)
        context, pooled = samples["context"].clone(), samples["pooled"].clone()
        for i, pos in enumerate(np.asarray(positions).tolist()):
            rng = np.random.default_rng([int(seed), int(pos), int(train)])
            noise[i] = torch.from_numpy(rng.standard_normal(x0.shape[1:], dtype=np.float32))
            t[i] = self._sample_t(rng, int(pos), train)
            if train and rng.random() < self.caption_dropout:
                context[i], pooled[i] = constants["null_context"], constants["null_pooled"]
        tt = t.view(b, 1, 1, 1)
        x_t = (1.0 - tt) * x0 + tt * noise
        inputs = {
            "img": patchify(x_t),
            # Own storage per sample (not expanded views): context parallel splits every batch tensor in place.
            "img_ids": image_ids(h // 2, w // 2, batch=b).contiguous(),
            "txt": context,
            "txt_ids": text_ids(context.shape[1], batch=b).contiguous(),
            "timesteps": t,
            "y": pooled,
        }
        if self.guidance is not None:
            inputs["guidance"] = torch.full((b,), self.guidance)
        return inputs, patchify(noise - x0)
