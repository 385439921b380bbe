"""One simulated rank: the training run's own model build, optimizer and step, on fake tensors.

The model, its layout and the optimizer come from the functions a training rank calls
(``build_parallel_model``, ``optimization_of``); only the weights' materialization is swapped
for fake storage (``to_empty`` under FakeTensorMode: sizes, no data, no init drawn). The step is
the trainer's: ``Trainer.accumulate`` (every micro-batch's forward + backward through the
layout's runner), the gradient clipping and the optimizer and LR-scheduler steps; what the loop
does only with real values (logging, the loss's ``.item()``, health judgments) is left out.
Pipeline ranks replay their schedule's actions instead (``pipeline_replay.py``).
"""

from __future__ import annotations

import contextlib
import time
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_hydra.models.protocol import ShapesBatches
from titan_hydra.simulate.balanced_routing import balanced_routing
from titan_hydra.simulate.collectives import Collective, CollectiveCounter
from titan_hydra.simulate.gpu_attention import efficient_masked_attention
from titan_hydra.simulate.live_memory import LiveMemory
from titan_hydra.simulate.pipeline_replay import PipelineReplay
from titan_hydra.spec import RunSpec
from titan_hydra.train.built import DataPlan, Placement, Services
from titan_hydra.train.grad_clip import clip_grad_norm_
from titan_hydra.train.model_build import build_parallel_model, optimization_of
from titan_hydra.train.nulls import NoEval, NoFaultTolerance, NoHealth, NoPreemption
from titan_hydra.train.pretrain import schedule_of
from titan_hydra.train.trainer import Trainer, TrainState

CPU = torch.device("cpu")


@dataclass(frozen=True)
class RankResult:
    """What one simulated rank held (bytes) and sent."""

    rank: int
    stage: int  # its pipeline rank (0 without PP)
    stages: list[int]  # the pipeline stages it holds
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # the most that forward's allocations held at once: what backward starts with
    transient_bytes: int  # the peak less params, optimizer state and forward's share at that moment
    peak_bytes: int
    collectives: list[Collective]
    stage_output: Any = None  # (shape, dtype) of the last stage's output: the next rank's input
    cpu_s: float = 0.0  # CPU seconds this rank's simulation took


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor counts its local shard)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        local = t._local_tensor if hasattr(t, "_local_tensor") else t  # noqa: SLF001
        st = local.untyped_storage()
        if id(st) in seen:
            continue
        seen.add(id(st))
        total += st.nbytes()
    return total


def optimizer_state(optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]


class FakeBatches:
    """The data loader of a simulated rank: fake batches of the run's shape, made inside fake mode
    (token batches, or the family's own batch shapes: ``ShapesBatches``, e.g. Flux's)."""

    def __init__(self, spec: RunSpec, fake: FakeTensorMode, seq_len: int | None = None) -> None:
        self.fake = fake
        self.spec = spec
        self.shape = (spec.batch.local, seq_len or spec.batch.seq_len)
        self.vocab = int(spec.shape.vocab_size) if spec.token_data else 0

    def __iter__(self):
        return self

    def __next__(self) -> tuple[Any, torch.Tensor]:
        with self.fake:
            if not self.spec.token_data:
                return self.spec.family.batch_like(self.spec.model_args, self.spec.data, self.spec.batch.local)
            tokens = torch.randint(0, self.vocab, self.shape, dtype=torch.long)
        return tokens, tokens


def fake_materializer(fake: FakeTensorMode):
    def materialize(parts: list[torch.nn.Module], device: torch.device) -> None:
        with fake:
            for part in parts:
                part.to_empty(device=device)
    return materialize


def dataset_stand_in(spec: RunSpec) -> types.SimpleNamespace:
    """What the model build and the loop read of the built dataset, from the settings (no data is read)."""
    sizes = spec.family.dataset_sizes(spec.data) if isinstance(spec.family, ShapesBatches) else {}
    return types.SimpleNamespace(seq_len=spec.batch.seq_len, document_eos_id=None, **sizes)


def trainer_of(spec: RunSpec, built, optim, rank: int, loader) -> Trainer:
    """The training loop's object with its services off: the simulator calls its step parts."""
    dataset = dataset_stand_in(spec)
    data = DataPlan(dataset=dataset, train_loader=loader, val_loader_factory=lambda: iter(()))
    services = Services(monitors=None, checkpointer=None, periodic_eval=NoEval(),
                        fault_tolerance=NoFaultTolerance(), health=NoHealth(), preemption=NoPreemption())
    return Trainer(model=built, optim=optim, data=data, schedule=schedule_of(spec), services=services,
                   state=TrainState(), where=Placement(rank, CPU, spec.dims))


def simulate_rank(spec: RunSpec, rank: int, steps: int, kernel_device: torch.device,
                  stage_input: Any = None, *, fake_tensors: bool = True) -> RankResult:
    """Build this rank's part of the run and step it ``steps`` times in the process group already
    initialized as ``rank`` (the fake one). ``fake_tensors=False`` measures a real CPU run the
    same way (real weights, initialized as training does, and real batches): the simulator's
    ground truth."""
    cpu0 = time.process_time()
    dims = spec.dims
    dims.build_mesh("cpu")
    fake = FakeTensorMode(allow_non_fake_inputs=True) if fake_tensors else contextlib.nullcontext()
    dataset = dataset_stand_in(spec)
    built = build_parallel_model(spec, CPU, rank, dataset, materialize=fake_materializer(fake) if fake_tensors else None,
                                 kernel_device=kernel_device)
    optim = optimization_of(spec, built)
    loader = FakeBatches(spec, fake)
    trainer = trainer_of(spec, built, optim, rank, loader)
    params = [p for part in built.parts for p in part.parameters()]
    memory, comms = LiveMemory(), CollectiveCounter(dims)
    replay = (PipelineReplay(spec, built, fake, stage_input, p2p=lambda op, n: comms.add("pp", op, n))
              if dims.pp_enabled else None)
    routing = balanced_routing(kernel_device.type == "cuda") if fake_tensors else contextlib.nullcontext()
    on_gpu = fake_tensors and kernel_device.type == "cuda"
    attention = efficient_masked_attention() if on_gpu else contextlib.nullcontext()
    with fake, routing, attention:
        memory.adopt([*params, *(b for part in built.parts for b in part.buffers())])
        with memory, comms:
            for step in range(steps):
                if step == steps - 1:
                    memory.reset_peak()  # the last step is the steady state: optimizer state exists
                memory.phase = "forward"
                trainer.optimizer.zero_grad(set_to_none=True)
                plan = trainer.begin_plan()
                if replay is None:
                    trainer.accumulate(plan.grad_accum)
                else:
                    replay.step(plan.grad_accum, loader)
                grads = storage_bytes(p.grad for p in params)
                memory.phase = "optimizer"
                clip_grad_norm_(params, trainer.schedule.max_norm, pp_group=dims.pp_group())
                trainer.optimizer.step()
                trainer.lr_scheduler.step()
                memory.settle()
    peak = memory.peak
    pbytes, obytes = storage_bytes(params), storage_bytes(optimizer_state(trainer.optimizer))
    stage_ids = sorted(built.runner.parts) if replay is not None else [0]
    pp_rank = dims.submesh("pp").get_local_rank() if dims.pp_enabled else 0
    return RankResult(
        rank=rank, stage=pp_rank, stages=stage_ids, params_bytes=pbytes, grads_bytes=grads, optimizer_bytes=obytes,
        activations_bytes=memory.phase_peaks["forward"],
        transient_bytes=peak.total - peak.by_phase["forward"] - pbytes - obytes,
        peak_bytes=peak.total, collectives=comms.per_step(steps),
        stage_output=replay.stage_output if replay is not None else None, cpu_s=time.process_time() - cpu0,
    )
