"""An exponential moving average of the weights (``training.ema_decay``), kept like the parameters.

The EMA holds one tensor per parameter with the parameter's own placement: under FSDP / TP a
DTensor with the same shards, under PP only this rank's stages. The update, the swap into the
model for validation and the checkpoint entries all work on each rank's local tensors, so the
EMA costs one parameter-sized copy per rank and no communication.

Semantics (torch's ``swa_utils`` EMA convention, started from the weights the run starts from):
``ema_0 = w_0`` (the initialized, or loaded, weights) and after every committed optimizer step
``ema_k = d * ema_{k-1} + (1 - d) * w_k``, i.e. ``ema_k = d^k w_0 + (1 - d) sum_i d^(k-i) w_i``.
Steps that torchft drops or the health monitor skips do not move it.

Why ``swa_utils.get_ema_multi_avg_fn`` and not ``AveragedModel``: the multi-tensor function is
the update itself (``torch._foreach_lerp_``) over lists we hand it, which here are local shards.
``AveragedModel`` deep-copies the module to hold its average: a copy of an FSDP-wrapped module
duplicates FSDP's hooks and communication state, a copy of a pipeline stage is not one the
schedule runs, and its state-dict keys (``module.*``, ``n_averaged``) are not the model's FQNs
that checkpoints, layouts and ``recipes/convert.py`` address. The EMA is instead swapped into
the model itself (``swapped``), so validation runs the exact same code path as ``val/loss``.

Checkpoints hold it as ``ema.<fqn>`` entries beside ``model.<fqn>`` (checkpoint/state.py), so it
reshards across layouts like the model. A run with EMA resuming a checkpoint without one (a run
that had it off, a model-only checkpoint, ``checkpoint.exclude_from_loading=[ema]``) starts the
EMA from the loaded weights and says so; a checkpoint with one loads into a run without EMA.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.optim.swa_utils import get_ema_multi_avg_fn

from titan_hydra.train.nulls import NoEMA
from titan_hydra.train.optimizers import clean_name


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (its shard for a DTensor), sharing storage with it."""
    return t.to_local() if isinstance(t, DTensor) else t


class WeightEMA:
    """The EMA of this rank's parameters of ``parts``: ``start`` after the restore, ``update``
    after each committed optimizer step, ``validate`` at validation steps."""

    enabled = True

    def __init__(self, parts: list[torch.nn.Module], decay: float, rank: int = 0) -> None:
        self.parts, self.decay, self.rank = parts, float(decay), rank
        self._update = get_ema_multi_avg_fn(self.decay)
        with torch.no_grad():
            self.shadow = [p.detach().clone() for p in self._params()]  # same placement as each parameter
        self.restored = False  # set by a checkpoint load that held an EMA

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for m in self.parts for p in m.parameters()]

    def entries(self) -> dict[str, torch.Tensor]:
        """{parameter FQN: its EMA}, the names a model state dict uses (a tied weight under each)."""
        index = {id(p): s for p, s in zip(self._params(), self.shadow)}
        return {clean_name(n): index[id(p)] for m in self.parts for n, p in m.named_parameters(remove_duplicate=False)}

    @torch.no_grad()
    def load(self, saved: dict[str, torch.Tensor]) -> None:
        """A checkpoint's EMA (same FQNs and placements as ``entries``) into this one."""
        mine = self.entries()
        for name, value in saved.items():
            local(mine[name]).copy_(local(value))
        self.restored = True

    @torch.no_grad()
    def start(self, step: int) -> None:
        """After the restore: a restored EMA continues, else it starts from the weights the run has."""
        if not self.restored:
            torch._foreach_copy_([local(s) for s in self.shadow], [local(p) for p in self._params()])
        if self.rank == 0:
            origin = "the checkpoint's EMA" if self.restored else f"the weights at step {step}"
            print(f"[ema] decay {self.decay}: continues from {origin}", flush=True)

    def update(self) -> None:
        """One EMA step towards the weights the optimizer just wrote."""
        self._update([local(s) for s in self.shadow], [local(p) for p in self._params()], None)

    def _reshard(self) -> None:
        """FSDP modules back to their shards. A forward without backward (validation) leaves the
        modules FSDP does not reshard after forward (the root) holding gathered copies: those would
        hide the shards from ``parameters()`` and, after a swap, keep serving the swapped weights."""
        for m in (m for part in self.parts for m in part.modules()):
            if isinstance(m, FSDPModule):
                m.reshard()

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        """The EMA in the model's parameters for the block; the training weights restored bit for
        bit after it (copied in place: FSDP's shard storage and optimizer references stay valid)."""
        self._reshard()
        live = [local(p) for p in self._params()]
        with torch.no_grad():
            kept = [t.clone() for t in live]
            torch._foreach_copy_(live, [local(s) for s in self.shadow])
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, kept)
            self._reshard()  # no gathered copy of the EMA outlives the block

    def validate(self, validate: Callable[[], dict[str, float]]) -> dict[str, float]:
        """``validate()``'s metrics on the EMA weights, as ``val/ema/...`` (``val/ema/loss``)."""
        with self.swapped():
            metrics = validate()
        return {k.replace("val/", "val/ema/", 1): v for k, v in metrics.items()}


def weight_ema_of(parts: list[torch.nn.Module], decay: float, rank: int):
    """A WeightEMA for ``decay`` > 0, else the null one (no memory, no work)."""
    return WeightEMA(parts, decay, rank) if decay > 0 else NoEMA()
