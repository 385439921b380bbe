"""Reading one finished (or stopped) run directory: its metrics, its saved config, its tokens.

A run dir is what ``launch.py`` wrote: ``metrics.jsonl`` (one JSON row per logged step),
``.hydra/config.yaml`` (the composed config), ``.hydra/overrides.yaml`` and, for a sweep job,
``status.json``. Every report, fit and comparison reads runs through here, so a partial last line
or a schedule's per-step batch is handled in one place. Reading rows needs no torch: the config
and the spec (which import it) are imported only by the functions that resolve a saved config, so
a sweep's tables and a run comparison start in a second.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def read_yaml(path: Path) -> Any:
    """A YAML file as plain containers (interpolations left as written), or None if absent."""
    return OmegaConf.to_container(OmegaConf.load(path)) if path.exists() else None


def read_metrics(path: Path) -> list[dict]:
    """The rows of a ``metrics.jsonl``; [] if absent. A job killed mid-write leaves a partial last
    line: it is skipped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def job_config(run_dir: Path) -> DictConfig:
    """A run's composed config (``.hydra/config.yaml``), its ``${th_...:}`` interpolations resolvable."""
    from titan_hydra.config import register_resolvers  # (imports torch: only where a saved config is resolved)

    register_resolvers()
    return OmegaConf.load(run_dir / ".hydra" / "config.yaml")


def val_curve(run_dir: Path) -> list[tuple[int, float]]:
    """[(step, val/loss)] of a run."""
    return [(int(r["step"]), float(r["val/loss"])) for r in read_metrics(run_dir / "metrics.jsonl") if "val/loss" in r]


def metric_curves(metrics: list[dict], prefix: str) -> dict[str, list[tuple[int, float]]]:
    """{name: [(step, value)]} of every logged key ``<prefix><name>``."""
    curves: dict[str, list[tuple[int, float]]] = {}
    for r in metrics:
        for key, value in r.items():
            if key.startswith(prefix) and isinstance(value, (int, float)):
                curves.setdefault(key[len(prefix):], []).append((int(r["step"]), float(value)))
    return curves


# In-loop evaluation's summary metrics, the two every task logs under one name (``eval/<task>/acc``,
# ``eval/<task>/ppl``: titan_hydra/evaluation.py ``with_ppl``): what reports show per task.
EVAL, EVAL_SUMMARY = "eval/", ("acc", "ppl")


def eval_curves(metrics: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """{``<task>/acc`` or ``<task>/ppl``: [(step, value)]} of a run's in-loop evaluation."""
    return {name: curve for name, curve in metric_curves(metrics, EVAL).items()
            if name.rsplit("/", 1)[-1] in EVAL_SUMMARY}


def final_evals(metrics: list[dict]) -> dict[str, tuple[int, float]]:
    """{``<task>/acc`` or ``<task>/ppl``: (step, value)} of the last evaluation that logged it."""
    return {name: curve[-1] for name, curve in sorted(eval_curves(metrics).items())}


@dataclass(frozen=True)
class Tokens:
    """The tokens a run's optimizer steps consumed, as it logged them.

    Under a batch (or sequence-length) schedule every training row carries that step's
    ``batch_size`` (and ``seq_len``), so tokens per step differ from step to step; without one the
    config's global batch x sequence length is every step's. A step with no row of its own
    (``training.log_freq`` > 1) counts as the next logged step: a schedule changes by stages.
    """

    logged: dict[int, int]  # step -> tokens that step consumed, for every logged training step
    default: int  # the config's global batch x seq_len: steps after the last logged one

    @cached_property
    def _cumulative(self) -> list[int]:
        """[tokens of steps 1..s for s = 0 .. the last logged step]."""
        steps, out, i = sorted(self.logged), [0], 0
        for s in range(1, (steps[-1] if steps else 0) + 1):
            i += steps[i] < s
            out.append(out[-1] + self.logged[steps[i]])
        return out

    def through(self, step: int) -> int:
        """Tokens of steps 1..``step``."""
        done = self._cumulative
        if step < len(done):
            return done[step]
        return done[-1] + (step - len(done) + 1) * self.default

    def continued_by(self, branch: "Tokens", at: int) -> "Tokens":
        """A run branched off this one after step ``at`` (a cooldown): this run's steps up to
        ``at``, the branch's after."""
        return Tokens({**{s: t for s, t in self.logged.items() if s <= at},
                       **{s: t for s, t in branch.logged.items() if s > at}}, branch.default)


def tokens_of(run_dir: Path, config_dir: Path | None = None) -> Tokens:
    """The tokens per step of a run dir, from its metrics rows and its saved config (or that of
    ``config_dir``, a run of the same batch settings: a branch for the run it left)."""
    from titan_hydra.spec import spec_of  # (imports torch: a sweep report reads no config unless it must)

    batch = spec_of(job_config(config_dir or run_dir)).batch
    logged = {int(r["step"]): int(r.get("batch_size", batch.global_)) * int(r.get("seq_len", batch.seq_len))
              for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}
    return Tokens(logged, batch.global_ * batch.seq_len)
