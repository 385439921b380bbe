"""Silent data corruption in the computation: the same micro-batches, run again, must give the same
gradients bit for bit.

Every ``health.recheck_every`` steps, after the step's forward/backward and before any gradient
leaves the rank for the optimizer, each rank keeps its gradients (its local shards), runs the
step's micro-batches forward and backward once more from the same RNG state and compares the new
gradients with the kept ones (``torch.equal``). A device that computed wrong numbers once shows up
as a mismatch; since the compute is deterministic (on GPU: ``training.deterministic=true``), a
correct device never does. A mismatch anywhere (one MAX all-reduce, only on recheck steps) makes
every rank run a third time, which classifies each rank:

* third == first: the re-run was wrong once (**transient**); the first gradients are kept;
* third == second: the step's own run was wrong once (**transient**); the agreeing ones are kept;
* all three differ: the rank cannot reproduce its own result (**persistent**: a broken device).

Every rank's class is gathered, so all name the same ranks and take the same decision: per
``health.recheck_action`` the run stops (``SilentCorruption``: restart without the bad device, from
the last checkpoint) or goes on with the agreeing gradients (the first ones when none agree). When
nothing differs the first gradients are restored, so the step is bit-identical to an unchecked one.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_hydra.train.health.sdc import SilentCorruption

CLASSES = ("agree", "transient", "persistent")


def _local(g: torch.Tensor | None) -> torch.Tensor | None:
    return None if g is None else (g.to_local() if isinstance(g, DTensor) else g).detach()


def _equal(a: list, b: list) -> bool:
    return all((x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))
               for x, y in zip(a, b))


def _rng_state() -> tuple:
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def _set_rng_state(state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state_all(state[1])


class GradRecheck:
    """One rank's recheck: ``begin_step`` keeps the RNG state of a due step, ``check`` re-runs it.
    ``corrupt(step, run, grads)`` is the fault injector's hook (a no-op unless a bit flip is set)."""

    def __init__(self, every: int, action: str, device: torch.device,
                 corrupt: Callable[[int, int, list], None] = lambda step, run, grads: None) -> None:
        self.every, self.action, self.device, self.corrupt = every, action, device, corrupt
        self.rng: tuple | None = None
        self.mismatches = 0  # recheck steps with a mismatch on some rank
        self.seconds = 0.0  # time spent re-running: the check's cost

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def begin_step(self, step: int) -> None:
        self.rng = _rng_state() if self.due(step) else None

    def _run(self, step: int, run: int, params: list, rerun: Callable[[], None]) -> list:
        for p in params:
            p.grad = None
        after = _rng_state()
        _set_rng_state(self.rng)  # dropout and friends draw what the step's own run drew
        rerun()
        _set_rng_state(after)
        grads = [_local(p.grad) for p in params]
        self.corrupt(step, run, [g for g in grads if g is not None])
        return [None if g is None else g.clone() for g in grads]

    def _any(self, flag: int) -> int:
        t = torch.tensor([flag], device=self.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _gather(self, code: int) -> list[int]:
        t = torch.tensor([code], device=self.device)
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return [code]
        every = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(every, t)
        return [int(x.item()) for x in every]

    @torch.no_grad()
    def _restore(self, params: list, grads: list) -> None:
        for p, g in zip(params, grads):
            if g is not None and p.grad is not None:
                _local(p.grad).copy_(g)

    @torch.no_grad()
    def _restore_buffers(self, buffers: list, kept: list) -> None:
        for b, k in zip(buffers, kept):
            b.copy_(k)

    def check(self, step: int, params: list, rerun: Callable[[], None],
              buffers: list[torch.Tensor] = ()) -> tuple[dict[str, float], str | None]:
        """Re-run the step (``rerun``: its micro-batches' forward/backward) and compare; (metrics, line).
        ``buffers`` (state a forward updates, e.g. MoE expert load counters) are put back as the step's
        own run left them, so the re-runs are not counted twice."""
        t0 = time.perf_counter()
        kept_buffers = [b.detach().clone() for b in buffers]
        self.corrupt(step, 0, [g for g in (_local(p.grad) for p in params) if g is not None])
        first = [None if p.grad is None else _local(p.grad).clone() for p in params]
        second = self._run(step, 1, params, rerun)
        keep, codes, differs = first, [0], not _equal(first, second)
        if self._any(int(differs)):  # every rank runs the third time: its backward may hold collectives
            third = self._run(step, 2, params, rerun)
            if not differs:
                code = int(not _equal(third, first))  # 0, or this rank erred in the third run only
            elif _equal(third, first):
                code = 1  # the re-run erred
            elif _equal(third, second):
                keep, code = second, 1  # the step's own run erred
            else:
                code = 2
            codes = self._gather(code)
        self._restore(params, keep)
        self._restore_buffers(buffers, kept_buffers)
        self.seconds += time.perf_counter() - t0
        bad = {r: CLASSES[c] for r, c in enumerate(codes) if c}
        if not bad:
            return {"health/recheck_mismatch": 0.0}, None
        self.mismatches += 1
        ranks = ", ".join(f"rank {r} ({what})" for r, what in bad.items())
        line = f"step {step} recheck: the same batch gave other gradients on {ranks}"
        if self.action == "stop":
            raise SilentCorruption(line + "; stopping: restart without that device, from the last checkpoint "
                                          "(health.recheck_action=continue goes on)")
        return {"health/recheck_mismatch": float(len(bad))}, line + "; continuing with the agreeing gradients"
