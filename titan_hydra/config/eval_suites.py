"""Named evaluation task sets (``eval.suite=fast|full``), read from ``conf/eval_suites.yaml``.

A suite is a value of one setting of the ``eval`` group (which tasks its harness runs), not an
object a ``_target_`` builds, so the sets are a data file beside the config groups rather than a
group of their own: ``eval.suite=fast`` stays one key of the one ``eval`` node (a nested group
would be ``eval/suite=fast`` and add options that build nothing). A local task file a suite names
(``jsonl_mc:recipes/...``) is relative to the repository, so a suite means the same files from any
working directory; an explicit list (``eval.suite=[...]``) is taken as written, like ``eval.tasks``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from titan_hydra.errors import ConfigError

SUITES_FILE = Path(__file__).resolve().parents[2] / "conf" / "eval_suites.yaml"
LOCAL_FILE = "jsonl_mc:"  # the task prefix whose file a suite names relative to the repository


def load_suites(path: Path = SUITES_FILE) -> dict[str, tuple[str, ...]]:
    """{suite name: its task names} of a suites file (a mapping of names to lists of task names);
    one-line ConfigError naming the file (and the line) where it does not parse."""
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"eval suites file {path} cannot be read ({e.strerror}); it ships with the repository "
                          "under conf/") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or type(e).__name__
        raise ConfigError(f"eval suites file {path}{where} does not parse: {problem}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, list) and v and all(isinstance(t, str) for t in v)
                                            for v in raw.values()):
        raise ConfigError(f"eval suites file {path} must map each suite name to a non-empty list of task names "
                          "(fast: [builtin_ppl, ...])")
    root = path.resolve().parents[1]
    return {str(name): tuple(_from_repo(t, root) for t in tasks) for name, tasks in raw.items()}


def _from_repo(task: str, root: Path) -> str:
    if task.startswith(LOCAL_FILE):
        file = Path(task[len(LOCAL_FILE):]).expanduser()
        return LOCAL_FILE + str(file if file.is_absolute() else root / file)
    return task


def suite_tasks(suite: Any, path: Path = SUITES_FILE) -> tuple[str, ...]:
    """The tasks of ``eval.suite``: a suite's name (its list in the suites file) or a tuple of task
    names (as given). An unknown name is one line listing the known ones."""
    if isinstance(suite, str):
        suites = load_suites(path)
        if suite not in suites:
            raise ConfigError(f"eval.suite={suite} is not a task set: known ones are {', '.join(sorted(suites))} "
                              f"({path.name} under conf/), or give a list, eval.suite=[builtin_ppl,...]")
        return suites[suite]
    if isinstance(suite, tuple) and suite:
        return suite
    raise ConfigError(f"eval.suite={suite!r} must be a task set's name (fast, full, ...) or a non-empty list of "
                      "task names")


def same_task(task: str) -> str:
    """``task`` as compared with a suite's: a local file by its absolute path (a suite's are)."""
    if task.startswith(LOCAL_FILE):
        return LOCAL_FILE + str(Path(task[len(LOCAL_FILE):]).expanduser().resolve())
    return task
