"""The ``eval`` group's settings: what to evaluate during training, and how often.

Its Hydra schema is derived from this dataclass (``titan_hydra.groups``). The settings sit below
the ``RunSpec`` that carries them, so validation reads them typed; the evaluator that runs them
on a rank's model (``train/eval.PeriodicEval``) is built from them there.

``suite`` names the tasks as a set (a name of ``conf/eval_suites.yaml``, or a list); ``tasks``
may stay beside it only where it holds nothing outside the suite (``eval=builtin_ppl``'s
``[builtin_ppl]`` beside ``eval.suite=full``), and ``tasks`` then becomes the suite's list, so
every reader after this one sees one list. A task outside the suite is refused in one line rather
than added or dropped: runs of one suite log the same tasks, column for column, and ``fast`` stays
fast (``eval=builtin_ppl eval.suite=fast`` would otherwise score the whole held-out split too).
"""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from titan_hydra.config.eval_suites import same_task, suite_tasks
from titan_hydra.errors import ConfigError
from titan_hydra.models.protocol import DrawsSamples


@dataclass(frozen=True)
class EvalSettings:
    """lm-eval harness tasks every ``freq`` steps (0 = never); sample pictures every
    ``sample_every`` steps (families that draw them: Flux); fidelity scores every
    ``fidelity_every`` steps. The ``eval`` group's target: its defaults are the group's schema."""

    freq: int = 0
    suite: Any = None  # a task set by name (fast, full: conf/eval_suites.yaml) or a list of task names
    tasks: Sequence[str] = ()  # builtin_ppl[:N], jsonl_mc:<file>, harness names; within the suite's if both
    limit: Optional[int] = None  # documents per task
    batch_size: int = 8
    max_seq_len: Optional[int] = None  # scoring window (the schema links it to training.seq_len)
    sample_every: int = 0  # steps between sample pictures (and at the end); 0 = none
    sample_prompts: Sequence[str] = ()  # one picture each, in one row
    sample_steps: int = 20  # sampler steps per picture
    sample_guidance: float = 3.0  # guidance scale (classifier-free, or flux_dev's embedded one)
    sample_seed: int = 0  # the pictures' noise: the same at every step, so rows compare
    fidelity_every: int = 0  # steps between fidelity scores (and at the end); 0 = none
    fidelity_prompts: int = 64  # held-out captions scored, one picture each
    sharded: bool = False  # harness requests scored across the dp ranks by the training model (no full copy)

    def __post_init__(self) -> None:
        if self.freq < 0:
            raise ConfigError(f"eval.freq={self.freq} must be >= 0 (0 = no evaluation during training)")
        if self.sample_every < 0:
            raise ConfigError(f"eval.sample_every={self.sample_every} must be >= 0 (0 = no sample pictures)")
        if self.fidelity_every < 0:
            raise ConfigError(f"eval.fidelity_every={self.fidelity_every} must be >= 0 (0 = no fidelity scores)")
        if self.fidelity_prompts <= 0:
            raise ConfigError(f"eval.fidelity_prompts={self.fidelity_prompts} must be > 0 (held-out captions "
                              "scored each time)")
        if self.sample_steps <= 0:
            raise ConfigError(f"eval.sample_steps={self.sample_steps} must be positive (sampler steps per picture)")
        suite, tasks = self.suite, tuple(str(t) for t in self.tasks)
        if isinstance(suite, collections.abc.Sequence) and not isinstance(suite, str):
            suite = tuple(str(t) for t in suite)
        if suite is not None:
            tasks = self._suite_tasks(suite, tasks)
        typed: dict[str, Any] = {"suite": suite, "tasks": tasks,
                                 "sample_prompts": tuple(str(p) for p in self.sample_prompts)}
        for key in ("freq", "batch_size", "sample_every", "sample_steps", "sample_seed", "fidelity_every",
                    "fidelity_prompts"):
            typed[key] = int(getattr(self, key))
        typed["sample_guidance"] = float(self.sample_guidance)
        typed["sharded"] = bool(self.sharded)
        for key, value in typed.items():
            object.__setattr__(self, key, value)

    def _suite_tasks(self, suite: Any, given: tuple[str, ...]) -> tuple[str, ...]:
        """The suite's tasks, or one line: no harness to run them (``freq`` 0), or ``tasks`` naming
        one outside the suite."""
        shown = f"[{','.join(suite)}]" if isinstance(suite, tuple) else str(suite)
        if int(self.freq) == 0:
            raise ConfigError(f"eval.suite={shown} runs with the harness every eval.freq steps, and eval.freq=0 "
                              "(never); set eval.freq=N")
        named = suite_tasks(suite)
        outside = [t for t in given if same_task(t) not in {same_task(n) for n in named}]
        if outside:
            raise ConfigError(f"eval.suite={shown} and eval.tasks=[{','.join(given)}] both name the tasks, and the "
                              f"suite lacks {outside}; set eval.tasks=[] to run the suite alone, or name every task "
                              "in one of the two")
        return named

    @property
    def enabled(self) -> bool:
        return self.freq > 0 or self.sample_every > 0 or self.fidelity_every > 0

    def check(self, family: Any) -> None:
        """Before training (one line each): a family that builds the evaluation copy; one that draws
        pictures, and prompts to draw, for sample pictures and fidelity; a language family for the
        harness (whether lm-eval is installed and knows the tasks is ``validate``'s question)."""
        if self.enabled and not family.builds_models():
            raise ConfigError(f"eval: model family {family.name!r} has no build(args) to make the evaluation copy "
                              "from; define ModelFamily.build in it, or set eval.freq=0 eval.sample_every=0")
        if self.fidelity_every > 0 and not isinstance(family, DrawsSamples):
            raise ConfigError(f"eval.fidelity_every={self.fidelity_every}: model family {family.name!r} draws no "
                              "pictures to score; set eval.fidelity_every=0")
        if self.sample_every > 0:
            if not isinstance(family, DrawsSamples):
                raise ConfigError(f"eval.sample_every={self.sample_every}: model family {family.name!r} draws no "
                                  "sample pictures; set eval.sample_every=0")
            if not self.sample_prompts:
                raise ConfigError(f"eval.sample_every={self.sample_every} needs prompts: set "
                                  "eval.sample_prompts=['a red circle', ...]")
        if self.freq > 0 and family.objective.unit != "token":
            raise ConfigError(f"eval.freq={self.freq}: the lm-eval harness scores language models, not model family "
                              f"{family.name!r}; set eval.freq=0")

    def check_data(self, dataset: Any) -> None:
        """Fidelity needs held-out captions and a reader of pictures from the data (one line if not)."""
        if self.fidelity_every > 0:
            if not hasattr(dataset, "heldout_prompts"):
                raise ConfigError(f"eval.fidelity_every={self.fidelity_every}: this data holds no captions out to "
                                  "score pictures against; set eval.fidelity_every=0")
            dataset.heldout_prompts(self.fidelity_prompts)
