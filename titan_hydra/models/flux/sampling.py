"""Images from a FLUX.1 model: Euler steps along the learned velocity, from noise (t = 1) to
the data (t = 0), with guidance.

The model learned ``v = noise - x0`` at ``x_t = (1 - t) x0 + t noise``, so one Euler step is
``x <- x + (t_next - t) v``. The timesteps follow the training schedule's shift
(``shift t / (1 + (shift - 1) t)`` of an even grid), so sampling spends its steps where
training put its timesteps. Guidance: a flavor with a guidance embedding (dev) takes the scale as
an input; one without (schnell, debug) uses classifier-free guidance against the empty caption,
which caption dropout taught it: ``v = v_empty + g (v_caption - v_empty)``.
"""

from __future__ import annotations

import torch

from titan_hydra.models.flux.encoders import LATENT_CHANNELS, VAE_DOWNSAMPLE
from titan_hydra.models.flux.model import Flux, image_ids, patchify, text_ids, unpatchify


def timesteps(steps: int, shift: float) -> list[float]:
    """``steps + 1`` decreasing values from 1 to 0 under the training shift."""
    grid = [1.0 - i / steps for i in range(steps + 1)]
    return [shift * t / (1.0 + (shift - 1.0) * t) for t in grid]


@torch.no_grad()
def sample_images(model: Flux, examples, prompts: list[str], image_size: int, steps: int = 20,
                  guidance: float = 3.0, seed: int = 0) -> torch.Tensor:
    """uint8 images [len(prompts), image_size, image_size, 3], one per prompt."""
    enc = examples.encoders
    context, pooled = enc.encode_text(prompts, examples.max_text_len)
    b, side = len(prompts), image_size // VAE_DOWNSAMPLE
    generator = torch.Generator().manual_seed(seed)
    x = patchify(torch.randn(b, LATENT_CHANNELS, side, side, generator=generator))
    img_ids, txt_ids = image_ids(side // 2, side // 2), text_ids(context.shape[1])
    embedded = model.args.guidance_embed
    if not embedded:
        null_context, null_pooled = enc.encode_text([""] * b, examples.max_text_len)

    def velocity(x: torch.Tensor, t: float) -> torch.Tensor:
        tt = torch.full((b,), t)
        if embedded:
            return model(x, img_ids, context, txt_ids, tt, pooled, guidance=torch.full((b,), guidance))
        cond = model(x, img_ids, context, txt_ids, tt, pooled)
        if guidance == 1.0:
            return cond
        empty = model(x, img_ids, null_context, txt_ids, tt, null_pooled)
        return empty + guidance * (cond - empty)

    schedule = timesteps(steps, examples.timestep_shift)
    for t, t_next in zip(schedule[:-1], schedule[1:]):
        x = x + (t_next - t) * velocity(x, t)
    return enc.decode_latents(unpatchify(x, side, side))
