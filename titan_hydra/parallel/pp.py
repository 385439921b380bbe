"""Pipeline parallelism: cut the model into stages and drive them with a torch schedule.

Why it is built this way:

* Stages are cut by the model family (``ModelFamily.cut_stage``; decoders deep-copy the
  meta-device model and delete what a stage does not own: other layers, the embedding outside
  the first stage, norm/output outside the last). Every parameter keeps its FQN, so checkpoints, the full-init broadcast
  (``set_model_state_dict(strict=False)``) and HF conversion need no PP special case.
* Stage placement follows torch's schedules: loop style (stage ``s`` on pp rank ``s % pp``)
  except for the V-shaped ZBVZeroBubble / DualPipeV, where rank ``r`` holds stages ``r`` and
  ``2*pp-1-r`` — so pp rank 0 holds both the first and the last stage there.
* Gradient scaling: torch's ``scale_grads=True`` divides the *accumulated* ``.grad`` by the
  number of microbatches at the end of every ``step()``, which is wrong as soon as the trainer
  accumulates over several steps. We pass ``scale_grads=False`` and scale the loss itself by
  ``1 / (microbatches * grad_accum_steps)``, which makes the summed gradients exactly those of
  the single-process run (mean over the global batch). The unscaled per-microbatch losses are
  recorded on the side and are what the trainer reports.
* Default microbatch count = total number of stages (``pp`` for GPipe/1F1B, ``2*pp`` for the
  multi-stage schedules): the smallest count that fills the pipeline and meets the
  ``microbatches >= stages`` rule of 1F1B/DualPipeV. Raise ``parallelism.pp_microbatches`` to
  shrink the bubble; it must divide ``training.local_batch_size``.
* Validation walks the stages in order with blocking P2P of activations (one whole batch, no
  microbatches), not ``schedule.eval()``, which fails for the V-shaped runtimes; the last
  stage's loss is shared over the pipeline group (the trainer averages it over data parallel).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any, Callable

import torch
import torch.distributed as dist

from titan_hydra.errors import ConfigError
from titan_hydra.parallel.runner import BatchKwargs, ParallelModel, full_logits, no_batch_kwargs

SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
# Schedules whose torch implementation refuses fewer microbatches than stages.
NEEDS_MB_GE_STAGES = ("1F1B", "DualPipeV")
# Schedules that run in "rounds" of pp microbatches (torch requires mb % rounds == 0).
ROUND_SCHEDULES = ("Interleaved1F1B", "InterleavedZeroBubble")
SPLIT_POINT = re.compile(r"^layers\.(\d+)$")


# --------------------------------------------------------------------------- the plan


def default_stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE_STAGE_SCHEDULES else 2


def _parse_split_points(points: list[str], n_layers: int) -> list[int]:
    """Layer indices where a new stage begins; raises ConfigError on a bad FQN."""
    starts = []
    for fqn in points:
        m = SPLIT_POINT.match(str(fqn))
        if m is None or not 0 < int(m.group(1)) < n_layers:
            raise ConfigError(
                f"parallelism.pp_split_points: {fqn!r} is not a layer that can start a stage "
                f"(use 'layers.1' .. 'layers.{n_layers - 1}')"
            )
        starts.append(int(m.group(1)))
    if starts != sorted(set(starts)):
        raise ConfigError(f"parallelism.pp_split_points={list(points)} must be strictly increasing")
    return starts


def stage_layer_ranges(dims, n_layers: int) -> list[range]:
    """The layer indices of each stage, in stage order (all stages, not just this rank's)."""
    if dims.pp_split_points and dims.pp_layers_per_stage:
        raise ConfigError(f"parallelism.pp_split_points={list(dims.pp_split_points)} and parallelism.pp_layers_per_stage="
                          f"{dims.pp_layers_per_stage} both split the stages: set only one of them")
    if dims.pp_split_points:
        bounds = [0, *_parse_split_points(list(dims.pp_split_points), n_layers), n_layers]
        return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]
    if dims.pp_layers_per_stage:
        lps = int(dims.pp_layers_per_stage)
        if lps < 1 or n_layers % lps:
            raise ConfigError(
                f"parallelism.pp_layers_per_stage={lps} must be >= 1 and divide model.n_layers={n_layers}"
            )
        return [range(a, a + lps) for a in range(0, n_layers, lps)]
    n_stages = dims.pp * default_stages_per_rank(dims.pp_schedule)
    if n_stages > n_layers:
        raise ConfigError(
            f"model.n_layers={n_layers} is fewer than the {n_stages} pipeline stages that "
            f"pp={dims.pp} x pp_schedule={dims.pp_schedule} needs; lower parallelism.pp or add layers"
        )
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [range(a, a + n) for a, n in zip(starts, sizes)]


def check_stage_count(dims, n_stages: int, n_layers: int) -> None:
    if n_stages > n_layers:
        raise ConfigError(f"the split gives {n_stages} pipeline stages but model.n_layers={n_layers}; "
                          "fix parallelism.pp_layers_per_stage / pp_split_points or add layers")
    schedule, pp = dims.pp_schedule, dims.pp
    if schedule in SINGLE_STAGE_SCHEDULES and n_stages != pp:
        raise ConfigError(
            f"pp_schedule={schedule} runs one stage per rank: the split gives {n_stages} stages for pp={pp}; "
            "fix parallelism.pp_layers_per_stage / pp_split_points"
        )
    if schedule in V_SCHEDULES and n_stages != 2 * pp:
        raise ConfigError(
            f"pp_schedule={schedule} needs exactly 2*pp={2 * pp} stages, the split gives {n_stages}; "
            "fix parallelism.pp_layers_per_stage / pp_split_points"
        )
    if n_stages % pp:
        raise ConfigError(
            f"the split gives {n_stages} pipeline stages, which do not divide evenly over parallelism.pp={pp} ranks; "
            "fix parallelism.pp_layers_per_stage / pp_split_points"
        )


def num_microbatches(dims, n_stages: int) -> int:
    return int(dims.pp_microbatches) if dims.pp_microbatches else n_stages


def check_microbatches(dims, n_stages: int, local_bs: int) -> None:
    n_mb = num_microbatches(dims, n_stages)
    if n_mb < 1:
        raise ConfigError(f"parallelism.pp_microbatches={n_mb} must be >= 1")
    if local_bs % n_mb:
        raise ConfigError(
            f"training.local_batch_size={local_bs} is not divisible by {n_mb} pipeline microbatches; "
            "set parallelism.pp_microbatches to a divisor"
        )
    if dims.pp_schedule in NEEDS_MB_GE_STAGES and n_mb < n_stages:
        raise ConfigError(
            f"parallelism.pp_microbatches={n_mb}: pp_schedule={dims.pp_schedule} needs parallelism.pp_microbatches "
            f">= {n_stages} stages; raise it"
        )
    rounds = max(1, n_mb // dims.pp)
    if dims.pp_schedule in ROUND_SCHEDULES and n_mb % rounds:
        raise ConfigError(
            f"pp_schedule={dims.pp_schedule} needs parallelism.pp_microbatches={n_mb} to be a multiple of "
            f"its rounds ({rounds} = microbatches // pp); use a multiple of pp={dims.pp}"
        )


def check_layout(dims, n_layers: int, local_batch_size: int) -> None:
    """Pre-launch rules for pipeline parallelism over a model of ``n_layers`` blocks (validate.py
    calls this)."""
    if not dims.pp_enabled:
        return
    ranges = stage_layer_ranges(dims, n_layers)
    check_stage_count(dims, len(ranges), n_layers)
    check_microbatches(dims, len(ranges), int(local_batch_size))


def stage_ids_for_rank(pp_rank: int, pp: int, n_stages: int, schedule: str) -> list[int]:
    """This rank's stage indices: loop style, or V style for ZBV/DualPipeV."""
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return list(range(pp_rank, n_stages, pp))


# --------------------------------------------------------------------------- stages


class PipelineRunner:
    """This rank's pipeline stages behind the runner interface (``parallel/runner.py``).

    ``forward_backward`` runs one torch schedule step over the microbatch and returns the mean
    of the *unscaled* per-microbatch losses, shared over the pipeline group (only the rank with
    the last stage computes them), while the schedule itself backpropagates
    ``loss / (microbatches * grad_accum_steps)``. ``eval_loss`` walks the stages forward-only.
    """

    def __init__(self, parts: dict[int, torch.nn.Module], stage_owner: list[int], make_schedule: Callable,
                 n_microbatches: int, grad_accum: int, loss_fn: Callable, dims, step_context, *,
                 pp_rank: int, group, device: torch.device, batch_kwargs: BatchKwargs = no_batch_kwargs) -> None:
        """``parts``: this rank's stage modules by stage index; ``stage_owner``: the pp rank of
        every stage, in stage order; ``make_schedule(loss_fn)``: the torch schedule over this
        rank's stages, given the loss function it must call (this runner's ``loss_fn``)."""
        self.parts = parts
        self.stage_owner = stage_owner
        self.has_first_stage, self.has_last_stage = 0 in parts, len(stage_owner) - 1 in parts
        self.pp_rank, self.group, self.device = pp_rank, group, device
        self.n_microbatches = n_microbatches
        self.scale = 1.0 / (n_microbatches * grad_accum)
        self.base_loss_fn = loss_fn
        self.dims = dims
        self.step_context = step_context
        self.batch_kwargs = batch_kwargs  # extra model inputs of a batch (document ids), to every stage
        self._recorded: list[torch.Tensor] = []
        self._probed = False  # the first step's shape-inference forward has been undone
        self.schedule = make_schedule(self.loss_fn)

    @property
    def loss_scale(self) -> float:
        """The weight each microbatch's loss gets in the step's gradient."""
        return self.scale

    def set_grad_accum(self, grad_accum: int) -> None:
        """This step's accumulation count (a batch schedule changes it between steps)."""
        self.scale = 1.0 / (self.n_microbatches * int(grad_accum))

    def loss_fn(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = self.base_loss_fn(output, target)
        self._recorded.append(loss.detach().float().clone())
        return loss * self.scale

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self._recorded = []
        target = labels if self.has_last_stage else None
        probe = contextlib.nullcontext() if self._probed else _undo_probe_forward(list(self.parts.values()))
        self._probed = True
        extra = self.batch_kwargs(inputs)  # split into microbatches along dim 0, like the tokens
        # return_outputs=False: torch's schedule otherwise keeps every microbatch's last-stage
        # output (the logits) until the step ends, to merge them for a caller that never reads them.
        with probe, self.step_context(inputs, labels):
            if self.has_first_stage:
                self.schedule.step(inputs, target=target, return_outputs=False, **extra)
            else:
                self.schedule.step(target=target, return_outputs=False, **extra)
        # The first step's shape inference also calls the loss on a probe batch: keep only the
        # last n_microbatches calls, which are the real ones.
        losses = self._recorded[-self.n_microbatches:]
        self._recorded = []
        if self.has_last_stage:
            loss = torch.mean(torch.stack(losses))
        else:
            loss = torch.zeros((), device=self.device)
        return self.dims.broadcast_pp_loss(loss)

    @torch.no_grad()
    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The whole batch's loss on every pipeline rank."""
        with self.step_context(inputs, labels):
            loss = self.forward_loss(inputs, labels)
        if loss is None:
            loss = torch.zeros((), device=self.device)
        return self.dims.broadcast_pp_loss(loss)

    @torch.no_grad()
    def forward_loss(self, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        """Forward-only pass of one whole batch through all stages; the loss on the last stage's rank.

        Not ``schedule.eval()``: the V-shaped runtimes (ZBV, DualPipeV) still execute their
        backward-split actions there and fail ("can't steal_bwd_input ..."). Walking the stages
        in order with blocking P2P between their owners works for every placement, and one
        unsplit batch gives exactly the single-process mean loss.
        """
        out = self._through_stages(inputs, self.batch_kwargs(inputs))
        return None if out is None else self.base_loss_fn(out, labels).detach().float()

    @torch.no_grad()
    def eval_logits(self, inputs: torch.Tensor) -> torch.Tensor:
        """The whole model's output for ``inputs`` (one document each, as ``SingleStageRunner``'s)
        on every pipeline rank: the stages walked in order, then the last stage's owner sends
        its logits (full: TP's vocabulary shards gathered) to the other pipeline ranks."""
        out = self._through_stages(inputs.to(self.device), {})
        last = self.stage_owner[-1]
        if last != self.pp_rank:
            return _recv_tensor(last, self.group, self.device)
        out = full_logits(out)
        for rank in sorted(set(self.stage_owner) - {last}):
            _send_tensor(out, rank, self.group, self.device)
        return out

    def _through_stages(self, inputs: torch.Tensor, extra: dict[str, Any]) -> torch.Tensor | None:
        """The last stage's output on its owner (None on the other pipeline ranks)."""
        h = None
        n = len(self.stage_owner)
        for sid in range(n):
            owner, prev = self.stage_owner[sid], self.stage_owner[sid - 1] if sid else None
            if owner == self.pp_rank:
                if sid == 0:
                    x = inputs
                else:
                    x = h if prev == self.pp_rank else _recv_tensor(prev, self.group, self.device)
                h = self.parts[sid](x, **extra)
            elif prev == self.pp_rank:
                _send_tensor(h, owner, self.group, self.device)
        return h if self.stage_owner[-1] == self.pp_rank else None


@contextlib.contextmanager
def _undo_probe_forward(parts: list[torch.nn.Module]):
    """Make the first step's shape inference leave no trace in module buffers.

    Without static stage shapes, torch's PipelineStage infers them on the first step: it runs
    each stage once on a probe (the first microbatch on stage 0, uninitialised tensors of the
    received shapes on the others), then a backward through that probe for the gradients'
    shapes, before the real microbatches. Stateful buffers (MoE load counts) would count the
    probe, and under activation checkpointing that backward reruns the probe's blocks after its
    forward has returned. So each stage's buffers are put back to what they held before the step
    when its second forward (the first real microbatch) starts, after the probe's forward and
    backward both ran.
    """
    handles = []
    for part in parts:
        saved = {name: buf.detach().clone() for name, buf in part.named_buffers()}
        if not saved:
            continue

        def restore(module, args, saved=saved, calls=[0]):
            calls[0] += 1
            if calls[0] != 2:
                return
            with torch.no_grad():
                for name, buf in module.named_buffers():
                    # only what the probe changed: rewriting an unchanged buffer in place
                    # (rotary tables) would invalidate tensors autograd saved from it
                    if name in saved and buf.shape == saved[name].shape and not torch.equal(buf, saved[name]):
                        buf.copy_(saved[name])

        handles.append(part.register_forward_pre_hook(restore))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_MAX_DIMS = 6


def _send_tensor(t: torch.Tensor, dst: int, group, device: torch.device) -> None:
    """Blocking send of a tensor preceded by a small header (dtype, rank, shape)."""
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    header[0], header[1] = _DTYPES.index(t.dtype), t.dim()
    header[2 : 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(header, group=group, group_dst=dst)
    dist.send(t.contiguous(), group=group, group_dst=dst)


def _recv_tensor(src: int, group, device: torch.device) -> torch.Tensor:
    header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, group=group, group_src=src)
    dtype, ndim = _DTYPES[int(header[0])], int(header[1])
    out = torch.empty([int(d) for d in header[2 : 2 + ndim]], dtype=dtype, device=device)
    dist.recv(out, group=group, group_src=src)
    return out


def build_pipeline(model, family, dims, device: torch.device, parallelize_part, make_step_context, *,
                   grad_accum: int, loss_fn: Callable, batch_kwargs: BatchKwargs = no_batch_kwargs) -> ParallelModel:
    """Split ``model`` into this rank's stages (``family.cut_stage``), parallelize each, build the schedule.

    ``parallelize_part(part)`` applies the per-stage techniques (TP, AC, compile, FSDP);
    ``make_step_context(parts)`` gives the per-microbatch context.
    """
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    ranges = stage_layer_ranges(dims, len(family.blocks(model)))
    check_stage_count(dims, len(ranges), len(family.blocks(model)))
    n_stages = len(ranges)
    pp_mesh = dims.submesh("pp")
    pp_rank, group = pp_mesh.get_local_rank(), pp_mesh.get_group()
    ids = stage_ids_for_rank(pp_rank, dims.pp, n_stages, dims.pp_schedule)
    parts: dict[int, torch.nn.Module] = {}
    stages = []
    for sid in ids:
        part = family.cut_stage(model, ranges[sid], is_first=sid == 0, is_last=sid == n_stages - 1)
        parts[sid] = parallelize_part(part)
        stages.append(PipelineStage(parts[sid], sid, n_stages, device, group=group))
    n_mb = num_microbatches(dims, n_stages)
    cls = get_schedule_class(dims.pp_schedule)

    def make_schedule(runner_loss_fn: Callable):
        if issubclass(cls, PipelineScheduleSingle):
            return cls(stages[0], n_microbatches=n_mb, loss_fn=runner_loss_fn, scale_grads=False)
        return cls(stages, n_microbatches=n_mb, loss_fn=runner_loss_fn, scale_grads=False)

    stage_owner = [r for sid in range(n_stages) for r in range(dims.pp)
                   if sid in stage_ids_for_rank(r, dims.pp, n_stages, dims.pp_schedule)]
    runner = PipelineRunner(parts, stage_owner, make_schedule, n_mb, grad_accum, loss_fn, dims,
                            make_step_context(list(parts.values())), pp_rank=pp_rank, group=group, device=device,
                            batch_kwargs=batch_kwargs)
    return ParallelModel(model_parts=list(parts.values()), runner=runner)


# --------------------------------------------------------------------------- validation


def describe(dims, n_layers: int) -> dict[str, Any]:
    """The stage plan as plain data (dry runs / estimates)."""
    ranges = stage_layer_ranges(dims, n_layers)
    return {
        "schedule": dims.pp_schedule,
        "stages": [list(r) for r in ranges],
        "microbatches": num_microbatches(dims, len(ranges)),
        "rank_stages": {r: stage_ids_for_rank(r, dims.pp, len(ranges), dims.pp_schedule) for r in range(dims.pp)},
    }
