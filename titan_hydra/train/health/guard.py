"""Non-finite and spiking steps: apply the step, or skip it (optimizer and schedule untouched).

The guard sees only reduced values (the loss averaged over the data-parallel ranks, the global
gradient norm), which every rank holds bit-identically; its window of past values is fed the same
numbers on every rank, so every rank takes the same decision without a collective of its own.

A spike is a value above ``median + k * MAD`` of the last ``window`` applied steps (the median
absolute deviation: robust to the spikes themselves, unlike a mean and standard deviation), judged
once ``min_history`` values are in. Only applied steps enter the window, so a run of spikes cannot
raise its own threshold.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

# a window of identical values has MAD 0: the threshold then sits this fraction above the median
MAD_FLOOR = 1e-3


@dataclass(frozen=True)
class Verdict:
    apply: bool
    reason: str = ""  # "" (a healthy step), "non-finite", "spike"
    detail: str = ""  # what was out of range ("loss is nan", "grad_norm is 31.2 (over 4.1)")


class SpikeWindow:
    """The last ``size`` values and the robust threshold over them."""

    def __init__(self, size: int, min_history: int, k: float) -> None:
        self.values: deque[float] = deque(maxlen=max(size, 1))
        self.min_history, self.k = max(min_history, 1), k

    def threshold(self) -> float:
        """median + k * MAD, or +inf while fewer than ``min_history`` values are in."""
        if len(self.values) < self.min_history:
            return math.inf
        ordered = sorted(self.values)
        median = _median(ordered)
        mad = _median(sorted(abs(v - median) for v in ordered))
        return median + self.k * max(mad, MAD_FLOOR * abs(median))

    def add(self, value: float) -> None:
        self.values.append(value)

    def state_dict(self) -> list[float]:
        return list(self.values)


def _median(ordered: list[float]) -> float:
    n = len(ordered)
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


class StepGuard:
    """Judges each step from its reduced loss and gradient norm; counts skips (in a row and in all)."""

    def __init__(self, *, skip_nonfinite: bool, spike_window: int, spike_min_history: int, spike_k: float,
                 spike_action: str) -> None:
        self.skip_nonfinite, self.spike_action = skip_nonfinite, str(spike_action)
        self.windows = {name: SpikeWindow(spike_window, spike_min_history, spike_k) for name in ("loss", "grad_norm")}
        self.skipped = 0  # steps not applied, over the run
        self.in_a_row = 0  # skipped steps since the last applied one
        self.spikes = 0  # spikes seen (skipped or only logged)

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        values = {"loss": loss, "grad_norm": grad_norm}
        bad = [f"{k} is {v}" for k, v in values.items() if not math.isfinite(v)]
        if bad:
            verdict = Verdict(not self.skip_nonfinite, "non-finite", ", ".join(bad))
        else:
            limits = {k: self.windows[k].threshold() for k in values}
            over = [f"{k} is {v:.4g} (over {limits[k]:.4g})" for k, v in values.items() if v > limits[k]]
            verdict = Verdict(not over or self.spike_action != "skip", "spike" if over else "", ", ".join(over))
            self.spikes += bool(over)
        if verdict.apply:
            self.in_a_row = 0
            if verdict.reason == "":
                for k, v in values.items():
                    self.windows[k].add(v)
        else:
            self.skipped += 1
            self.in_a_row += 1
        return verdict

    def reset_in_a_row(self) -> None:
        self.in_a_row = 0
