"""Where two runs part: per logged metric, the first step where they differ, and by how much.

For every metric both runs logged (not the timing and memory ones, which no two runs share) over
the steps both logged (a resumed run's re-run steps: the last value wins): the first step where
``|a - b| > atol + rtol * |b|`` (numpy.isclose's rule; ``exact``: any difference at all, bit for
bit, NaN equal to NaN), the largest absolute and relative differences and their steps. The
default tolerance, rtol 1e-5, is about 100 fp32 ulps: what reordering the reductions of a small
fp32 run moves a loss by (a layout change), far below any change of data, schedule or model.
Beside it, ``eval_table``: each run's last in-loop evaluation score per task (``eval/<task>/acc``
and ``eval/<task>/ppl``), the numbers a comparison of two trainings is usually about.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from titan_hydra.analysis import figures
from titan_hydra.analysis.runs import final_evals, read_metrics
from titan_hydra.errors import UserError

RTOL, ATOL = 1e-5, 0.0
# Per-step timings, throughput and memory (by the name after the last "/"): differ between any two
# runs, so never compared unless asked for by --keys.
UNSHARED = ("time", "data_time", "tps", "tps_global", "tflops", "mfu", "goodput", "lost_steps", "restarts")
TIMING = re.compile(r"^memory|_s(_max)?$")  # memory_peak_gib, health/compute_s_max, recheck_s


class CompareError(UserError):
    """Bad input: one line, what is wrong."""


@dataclass
class KeyDiff:
    key: str
    steps: int  # compared (logged by both)
    first_step: int | None  # the first step beyond the tolerance; None: within it throughout
    max_abs: float
    max_abs_step: int | None
    max_rel: float
    max_rel_step: int | None
    only_a: int  # steps logged by one run only (not compared)
    only_b: int


def series_of(run: Path) -> dict[str, dict[int, float]]:
    """{metric: {step: value}} of a run's metrics.jsonl (the last value of a step wins)."""
    run = Path(run)
    if not run.is_dir():
        raise CompareError(f"{run} is not a directory (give a run dir or a multirun job dir)")
    if not (run / "metrics.jsonl").is_file():
        raise CompareError(f"{run} has no metrics.jsonl (give a run dir or a multirun job dir)")
    out: dict[str, dict[int, float]] = {}
    for row in read_metrics(run / "metrics.jsonl"):
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(key, {})[int(row["step"])] = float(value)
    if not out:
        raise CompareError(f"{run}/metrics.jsonl holds no metrics")
    return out


def _shared(key: str) -> bool:
    name = key.rsplit("/", 1)[-1]
    return name not in UNSHARED and not TIMING.search(name)


def _differs(a: float, b: float, rtol: float, atol: float, exact: bool) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) != math.isnan(b)
    if exact:
        return a != b
    return abs(a - b) > atol + rtol * abs(b)


def compare_key(key: str, a: dict[int, float], b: dict[int, float], rtol: float, atol: float,
                exact: bool) -> KeyDiff:
    steps = sorted(set(a) & set(b))
    diff = KeyDiff(key, len(steps), None, 0.0, None, 0.0, None, len(set(a) - set(b)), len(set(b) - set(a)))
    for step in steps:
        x, y = a[step], b[step]
        if diff.first_step is None and _differs(x, y, rtol, atol, exact):
            diff.first_step = step
        gap = abs(x - y)
        if gap > diff.max_abs:  # (NaN never is)
            diff.max_abs, diff.max_abs_step = gap, step
        rel = gap / abs(y) if y else (math.inf if gap else 0.0)
        if rel > diff.max_rel:
            diff.max_rel, diff.max_rel_step = rel, step
    return diff


def compare(run_a: Path, run_b: Path, rtol: float = RTOL, atol: float = ATOL, exact: bool = False,
            keys: list[str] | None = None) -> list[KeyDiff]:
    """Every shared metric of two runs (or ``keys``), compared over the steps both logged."""
    a, b = series_of(run_a), series_of(run_b)
    wanted = keys or sorted(k for k in set(a) & set(b) if _shared(k))
    missing = [k for k in wanted if k not in a or k not in b]
    if missing:
        raise CompareError(f"metric(s) {missing} not logged by both runs; they share {sorted(set(a) & set(b))}")
    if not wanted:
        raise CompareError(f"{run_a} and {run_b} log no metric in common")
    return [compare_key(k, a[k], b[k], rtol, atol, exact) for k in wanted]


def _at(value: float, step: int | None) -> str:
    return f"{value:.3g}" + (f" (step {step})" if step is not None else "")


def table(diffs: list[KeyDiff]) -> str:
    lines = ["| metric | steps | first step beyond tolerance | max abs diff | max rel diff |",
             "|---|---:|---:|---:|---:|"]
    for d in diffs:
        extra = f" (+{d.only_a} only in A, {d.only_b} only in B)" if d.only_a or d.only_b else ""
        first = "-" if d.first_step is None else str(d.first_step)
        lines.append(f"| {d.key} | {d.steps}{extra} | {first} | {_at(d.max_abs, d.max_abs_step)} | "
                     f"{_at(d.max_rel, d.max_rel_step)} |")
    return "\n".join(lines)


def eval_table(run_a: Path, run_b: Path) -> str:
    """Markdown: one row per task and summary metric either run logged, each run's last value (and
    its step) and B - A; "" when neither run evaluated during training."""
    a, b = (final_evals(read_metrics(Path(run) / "metrics.jsonl")) for run in (run_a, run_b))
    if not a and not b:
        return ""
    lines = ["| eval (last logged) | A | B | B - A |", "|---|---:|---:|---:|"]
    for name in sorted(set(a) | set(b)):
        cells = [f"{a[name][1]:.4f} (step {a[name][0]})" if name in a else "-",
                 f"{b[name][1]:.4f} (step {b[name][0]})" if name in b else "-"]
        delta = f"{b[name][1] - a[name][1]:+.4f}" if name in a and name in b else "-"
        lines.append(f"| {name} | {cells[0]} | {cells[1]} | {delta} |")
    return "\n".join(lines)


def plot(run_a: Path, run_b: Path, diffs: list[KeyDiff], path: Path) -> None:
    """One row per metric: both runs' values, and |A - B| per step (log scale)."""
    a, b = series_of(run_a), series_of(run_b)
    fig, axes = figures.subplots(len(diffs), 2, figsize=(10, 2.6 * len(diffs)), squeeze=False)
    for (left, right), d in zip(axes, diffs):
        for series, name, style in ((a[d.key], "A", "-"), (b[d.key], "B", "--")):
            left.plot(*zip(*sorted(series.items())), style, label=name, lw=1)
        left.set_title(d.key, fontsize=9)
        left.legend(fontsize=7)
        steps = sorted(set(a[d.key]) & set(b[d.key]))
        gaps = [abs(a[d.key][s] - b[d.key][s]) for s in steps]
        right.semilogy(steps, [g if g > 0 else float("nan") for g in gaps], ".", ms=3)
        if d.first_step is not None:
            right.axvline(d.first_step, color="C3", lw=0.8)
        right.set_title(f"|A - B| of {d.key}" + ("" if any(gaps) else ": equal at every step"), fontsize=9)
    figures.save(fig, path)
