"""A pipeline rank's step replayed action by action on its stage modules.

torch's schedules do not run under the fake process group (their P2P warm-up reads a received
tensor's value, and stage shape inference exchanges Python objects), but what a rank holds is
decided by the order of its actions: which micro-batch's forward runs before which backward.
The schedule object the real run builds (``PipelineRunner.schedule``) lists that order for every
rank of a multi-stage schedule (``pipeline_order``: forward / backward per stage and micro-batch);
GPipe's and 1F1B's are written out here from their definitions. This replays this rank's list on the same stage modules the real
split built, with the runner's own loss function (scaled like the real schedule's) and step
context. A received activation is a fresh fake tensor of the previous stage's output shape; a
received gradient is one of the output's shape. FSDP is told, as torch's ``PipelineStage`` does,
to skip the gradient reduce-scatter until each stage's last micro-batch. Zero-bubble schedules'
split backward (input ``I``, then weight ``W``) is replayed as a full backward at ``I`` (a
slight overstatement of the input-gradient phase's memory: the weight gradients come earlier).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_hydra.parallel.runner import call_model
from titan_hydra.simulate.collectives import nbytes
from titan_hydra.spec import RunSpec

FORWARD, FULL_BACKWARD, BACKWARD_INPUT = "F", "B", "I"


def sent_spec(out: torch.Tensor) -> tuple[tuple[int, ...], torch.dtype]:
    """(shape, dtype) of what a stage sends: a DTensor output travels as its local shard."""
    local = out.to_local() if isinstance(out, DTensor) else out
    return tuple(local.shape), local.dtype


def single_stage_order(schedule: str, pp_rank: int, pp: int, n_mb: int) -> list[tuple[int, str, int]]:
    """(stage, F|B, micro-batch) of GPipe (all forwards, then all backwards) and 1F1B (``pp - rank - 1``
    warm-up forwards, then one forward / one backward, then the remaining backwards)."""
    if schedule == "GPipe":
        return [(pp_rank, FORWARD, m) for m in range(n_mb)] + [(pp_rank, FULL_BACKWARD, m) for m in range(n_mb)]
    warmup = min(n_mb, pp - pp_rank - 1)
    order = [(pp_rank, FORWARD, m) for m in range(warmup)]
    for m in range(warmup, n_mb):
        order += [(pp_rank, FORWARD, m), (pp_rank, FULL_BACKWARD, m - warmup)]
    return order + [(pp_rank, FULL_BACKWARD, m) for m in range(n_mb - warmup, n_mb)]


def actions_of(schedule_obj, schedule: str, pp_rank: int, pp: int, n_mb: int) -> list[tuple[int, str, int]]:
    """This rank's compute actions in order. Single-stage schedules by their definition (torch
    2.13's ``Schedule1F1B.pipeline_order`` numbers a later rank's micro-batches from 1, which its
    own runtime does not follow); multi-stage ones from the schedule's ``pipeline_order``."""
    if schedule in ("GPipe", "1F1B"):
        return single_stage_order(schedule, pp_rank, pp, n_mb)
    return [(a.stage_index, a.computation_type.value, a.microbatch_index)
            for a in schedule_obj.pipeline_order[pp_rank]
            if a is not None and a.computation_type.value in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT)]


class PipelineReplay:
    def __init__(self, spec: RunSpec, built, fake: FakeTensorMode, stage_input: Any = None,
                 p2p: Callable[[str, int], None] = lambda op, n: None) -> None:
        """``p2p(op, bytes)`` is told of every send / recv the real schedule would make here."""
        runner = built.runner
        self.runner, self.fake = runner, fake
        self.parts: dict[int, torch.nn.Module] = runner.parts
        self.last_stage = len(runner.stage_owner) - 1
        self.n_mb = runner.n_microbatches
        self.actions = actions_of(runner.schedule, spec.dims.pp_schedule, runner.pp_rank, spec.dims.pp, self.n_mb)
        self.stage_input = stage_input  # (shape, dtype) of what a stage > 0 receives
        self.stage_output = None
        self.p2p = p2p
        # stages whose neighbour lives on this same rank exchange tensors without P2P
        self.owner = runner.stage_owner

    def _received(self) -> torch.Tensor:
        if self.stage_input is None:
            raise RuntimeError("no stage input shape yet: simulate pipeline rank 0 (stage 0) first")
        shape, dtype = self.stage_input
        return torch.empty(shape, dtype=dtype).requires_grad_(True)

    def _boundary_bytes(self) -> int:
        shape, dtype = self.stage_input
        return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()

    def step(self, grad_accum: int, loader) -> None:
        """One optimizer step's micro-batches (``grad_accum`` schedule steps) on this rank."""
        for _ in range(grad_accum):
            inputs, labels = next(loader)
            with self.runner.step_context(inputs, labels):  # (fake mode is on: rank.py)
                self._replay(inputs.tensor_split(self.n_mb), labels.tensor_split(self.n_mb))

    def _sync_grads(self, part: torch.nn.Module, last: bool) -> None:
        if isinstance(part, FSDPModule):
            part.set_requires_gradient_sync(last)
            part.set_reshard_after_backward(last)

    def _replay(self, inputs: list[torch.Tensor], labels: list[torch.Tensor]) -> None:
        alive: dict[tuple[int, int], torch.Tensor] = {}
        done_backward = dict.fromkeys(self.parts, 0)
        for sid, kind, mb in self.actions:
            part = self.parts[sid]
            if kind == FORWARD:
                x = inputs[mb] if sid == 0 else self._received()
                if sid > 0 and self.owner[sid - 1] != self.owner[sid]:
                    self.p2p("recv", nbytes(x))
                out = call_model(part, x, self.runner.batch_kwargs(x) if sid == 0 else {})
                if sid == 0 and self.stage_input is None and sid != self.last_stage:
                    self.stage_input = sent_spec(out)
                if sid == self.last_stage:
                    out = self.runner.loss_fn(out, labels[mb])
                elif self.stage_output is None:
                    self.stage_output = sent_spec(out)
                alive[(sid, mb)] = out
                if sid < self.last_stage and self.owner[sid + 1] != self.owner[sid]:
                    self.p2p("send", nbytes(out))
            else:
                out = alive.pop((sid, mb))
                done_backward[sid] += 1
                self._sync_grads(part, done_backward[sid] == self.n_mb)
                if sid == self.last_stage:
                    out.backward()
                else:
                    if self.owner[sid + 1] != self.owner[sid]:
                        self.p2p("recv", nbytes(out))
                    out.backward(torch.empty_like(out))
                if sid > 0 and self.owner[sid - 1] != self.owner[sid]:
                    self.p2p("send", nbytes(out) if sid != self.last_stage else self._boundary_bytes())
