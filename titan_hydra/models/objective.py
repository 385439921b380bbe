"""What a model learns from a batch: its loss, and what throughput counts.

A family declares its objective (``ModelFamily.objective``). The engine (runner, pipeline,
trainer, metrics) only calls the methods below, so a family whose batch is not tokens and whose
loss is not cross-entropy plugs in without the engine naming it:

* a batch is ``(inputs, target)``; ``inputs`` is a tensor (the model's one positional input:
  token ids for language models) or a dict of tensors (keyword inputs: latents, text
  embeddings, timesteps...), ``target`` what the loss compares the output with;
* ``loss(output, target)`` is the training and validation loss (a scalar);
* ``units(inputs)`` is what one batch counts for throughput (tokens, images), and ``rate_key``
  the metric it is logged under (``tps``: tokens/s; ``ips``: images/s); MFU divides the family's
  ``flops_per_unit`` by the same unit;
* ``val_metrics(loss)`` what validation logs besides the loss (perplexity only means something
  for tokens);
* ``sequence_buffers(inputs, target)`` the tensors context parallelism splits along their
  sequence dim, with that dim (every tensor whose length is the sequence's: tokens and labels;
  image and text tokens, their position ids and the target).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor


class Objective:
    """Base of every objective; ``NEXT_TOKEN`` is the language families' one."""

    unit: str = "token"
    rate_key: str = "tps"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def units(self, inputs: Any) -> int:
        raise NotImplementedError

    def val_metrics(self, loss: float) -> dict[str, float]:
        return {"val/loss": loss}

    def sequence_buffers(self, inputs: Any, target: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        raise NotImplementedError


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy; logits upcast to fp32 so bf16 runs stay stable.

    Under tensor-parallel loss parallel the logits are a vocab-sharded DTensor and the loss a
    replicated DTensor scalar; it is returned as a plain tensor (differentiably) so that
    accumulation, cross-rank averaging and validation treat every layout alike.
    """
    loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1))
    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class NextTokenPrediction(Objective):
    """Token ids in, logits out, mean cross entropy against the next tokens; counts tokens."""

    unit = "token"
    rate_key = "tps"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy_loss(output, target)

    def units(self, inputs: torch.Tensor) -> int:
        return int(inputs.numel())

    def val_metrics(self, loss: float) -> dict[str, float]:
        return {"val/loss": loss, "val/ppl": math.exp(min(loss, 50.0))}

    def sequence_buffers(self, inputs: torch.Tensor, target: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        return [(inputs, 1), (target, 1)]


NEXT_TOKEN = NextTokenPrediction()
