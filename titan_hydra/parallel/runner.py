"""How one microbatch runs on this rank: the one interface the trainer drives for every layout.

``forward_backward(inputs, labels)`` runs forward + backward of a microbatch and returns its
loss (detached, the same on every rank of a pipeline); ``eval_loss(inputs, labels)`` is the
forward-only loss for validation. ``SingleStageRunner`` is the whole model (or a data/tensor/
context-parallel copy of it); ``pp.PipelineRunner`` drives this rank's pipeline stages. The
trainer therefore has no pipeline branches, and the step context (autocast, loss parallel,
context-parallel sharding) is entered here, around exactly the code it concerns.

Gradient scaling: every runner backpropagates ``loss / grad_accum_steps`` (the pipeline also
divides by its microbatch count), so the accumulated gradients equal those of one big batch;
``set_grad_accum`` sets the step's count (the trainer calls it every step: a batch schedule
changes it).

A batch's ``inputs`` are one tensor (token ids: ``model(inputs)``) or a dict of tensors
(``model(**inputs)``: a family whose model takes several inputs, e.g. latents, text embeddings
and timesteps); the family's objective (``models/objective.py``) gives the loss. Model inputs
beyond the tokens come from ``batch_kwargs(inputs)``: with document masking it returns
``{"doc_ids": ...}`` (derived from the EOS tokens of the batch), passed as keyword arguments to
the model, or to every pipeline stage, split into microbatches like the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import torch
from torch.distributed.tensor import DTensor

from titan_hydra.models.common.masking import document_ids

BatchKwargs = Callable[[torch.Tensor], dict[str, Any]]


@dataclass
class ParallelModel:
    """What the trainer needs from the layout: this rank's parts and the runner that drives them."""

    model_parts: list[torch.nn.Module]
    runner: Any  # SingleStageRunner | pp.PipelineRunner: forward_backward / eval_loss


def no_batch_kwargs(inputs: torch.Tensor) -> dict[str, Any]:
    return {}


def call_model(model: torch.nn.Module, inputs: Any, extra: dict[str, Any]) -> Any:
    """``model(inputs, **extra)`` for a tensor batch, ``model(**inputs, **extra)`` for a dict batch."""
    return model(**inputs, **extra) if isinstance(inputs, dict) else model(inputs, **extra)


def batch_kwargs_for(document_eos_id: int | None) -> BatchKwargs:
    """The model's extra inputs for a batch: document ids when documents are masked."""
    if document_eos_id is None:
        return no_batch_kwargs
    eos = int(document_eos_id)
    return lambda inputs: {"doc_ids": document_ids(inputs, eos)}


class SingleStageRunner:
    def __init__(self, model: torch.nn.Module, loss_fn: Callable, grad_accum_steps: int,
                 step_context: Callable[[torch.Tensor, torch.Tensor], ContextManager],
                 batch_kwargs: BatchKwargs = no_batch_kwargs) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.grad_accum_steps = grad_accum_steps
        self.step_context = step_context
        self.batch_kwargs = batch_kwargs

    @property
    def loss_scale(self) -> float:
        """The weight each microbatch's loss gets in the step's gradient."""
        return 1.0 / self.grad_accum_steps

    def set_grad_accum(self, grad_accum_steps: int) -> None:
        """This step's micro-batch count (a batch schedule changes it between steps)."""
        self.grad_accum_steps = int(grad_accum_steps)

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.step_context(inputs, labels):
            logits = call_model(self.model, inputs, self.batch_kwargs(inputs))
            loss = self.loss_fn(logits, labels)
            # Autograd keeps what the loss needs (its fp32 log-softmax); dropping this reference
            # before backward frees the bf16 logits (2 bytes x vocab per token) for the backward peak.
            del logits
            (loss / self.grad_accum_steps).backward()
        return loss.detach()

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with self.step_context(inputs, labels):
            return self.loss_fn(call_model(self.model, inputs, self.batch_kwargs(inputs)), labels).detach().float()

    @torch.no_grad()
    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output for ``inputs`` as one sequence each (no document mask: a harness
        request is one document), full on every rank (TP's vocab-sharded logits gathered); the
        inputs moved to the model's device (a harness makes them on the host)."""
        return full_logits(self.model(inputs.to(next(self.model.parameters()).device)))


def full_logits(logits: Any) -> torch.Tensor:
    """Loss parallel's vocabulary-sharded logits (a DTensor) as one tensor; a tensor as it is."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits
