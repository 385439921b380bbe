"""Null services: what the loop talks to when a service is off, so the loop never asks.

Each has the methods the loop and the orchestration call on the real one, doing nothing (and
answering "apply", "commit", "not due", "do not stop").
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator


class NoEval:
    """No periodic evaluation (``eval.freq``, ``sample_every`` and ``fidelity_every`` all 0)."""

    def due(self, step: int, last: bool) -> bool:
        return False

    def run(self, step: int, last: bool) -> tuple[dict, dict]:
        return {}, {}


class NoFaultTolerance:
    """A run of one replica group: gradients and losses stay this group's, every step commits."""

    enabled = False

    def start(self, *args: Any, **kwargs: Any) -> None:
        pass

    def begin_step(self) -> None:
        pass

    def reduce_gradients(self, params: list) -> None:
        pass

    def mean(self, value: Any) -> Any:
        return value

    def commit(self) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


class _NeverDue:
    def due(self, step: int) -> bool:
        return False


class NoHealth:
    """health=off and no fault injected: every step applies, a non-finite loss stops the run."""

    recheck = _NeverDue()

    def start(self) -> None:
        pass

    def begin_step(self, step: int) -> None:
        pass

    def recheck_step(self, step: int, params: list, rerun: Any) -> None:
        pass

    def judge(self, loss: float, grad_norm: float) -> bool:
        return True

    def end_step(self, step: int) -> None:
        pass

    def take_straggler_wait(self) -> float:
        return 0.0

    def close(self) -> None:
        pass

    def summary(self) -> None:
        return None


class NoEMA:
    """training.ema_decay=0: no EMA of the weights is kept, none validated or checkpointed."""

    enabled = False

    def start(self, step: int) -> None:
        pass

    def update(self) -> None:
        pass

    def validate(self, validate: Any) -> dict[str, float]:
        return {}


class NoPreemption:
    """Outside a SLURM job: nothing signals a stop."""

    signalled = False

    def should_stop(self) -> bool:
        return False

    def save_and_requeue(self, checkpointer: Any, step: int) -> None:
        pass


class NoProfiler:
    """profiling.enable=false: no traces, no memory snapshots."""

    def step(self) -> None:
        pass

    def close(self) -> None:
        pass


class NoGoodput:
    """No goodput ledger (a loop built without the recipe's services: tests, plain loops)."""

    def begin(self, resumed_step: int) -> None:
        pass

    def add(self, category: str, seconds: float) -> None:
        pass

    @contextmanager
    def span(self, category: str) -> Iterator[None]:
        yield

    def unkept(self, category: str = "health") -> None:
        pass

    def step(self, step: int) -> None:
        pass

    def metrics(self) -> dict[str, float]:
        return {}

    def summary(self) -> None:
        return None

    def close(self) -> None:
        pass
