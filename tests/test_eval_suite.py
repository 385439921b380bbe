"""Named task sets for in-loop evaluation (``eval.suite=fast|full|[...]``, conf/eval_suites.yaml):
a suite scored during a short training run equals the same checkpoint scored with the suite's tasks
listed explicitly (``recipes/eval.py``); every task logs ``eval/<task>/acc`` or ``eval/<task>/ppl``;
``recipes/compare_runs.py`` and the sweep report show each run's last scores; an unknown suite, a
task file that does not parse, and a task outside the suite beside it are one line each, before
anything is built."""

from __future__ import annotations

import csv
import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from helpers import STEPS, compose_cfg, read_metrics, run_single  # noqa: E402
from titan_hydra.config.eval_suites import SUITES_FILE, load_suites  # noqa: E402
from titan_hydra.errors import ConfigError  # noqa: E402
from titan_hydra.validate import validate  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "recipes"))
import compare_runs  # noqa: E402
import eval as eval_recipe  # noqa: E402

SEQ, FREQ = 64, 5
FAST = ["builtin_ppl:1024", "jsonl_mc:recipes/eval_tasks/tiny_mc.jsonl"]  # conf/eval_suites.yaml's fast set
LOGGED = {"builtin_ppl_1024": "ppl", "jsonl_mc_tiny_mc": "acc"}  # the summary metric each of them logs


def absolute(tasks: list[str]) -> list[str]:
    """A suite's local files as the suite holds them: from the repository."""
    return [t.replace("jsonl_mc:", f"jsonl_mc:{REPO}/") for t in tasks]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """The parity tests' tiny model trained 10 steps with ``eval=fast`` every 5 steps, saved at the end."""
    path = tmp_path_factory.mktemp("suite")
    run_single(path, ["eval=fast", f"eval.freq={FREQ}", "eval.batch_size=16", "checkpoint=default",
                      "checkpoint.interval=0"])
    return path / "run"


def evals(run_dir: Path) -> dict[int, dict[str, float]]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in read_metrics(run_dir)
            if any(k.startswith("eval/") for k in r)}


def test_the_suite_in_training_scores_as_its_tasks_listed_on_the_checkpoint(run, capsys):
    logged = evals(run)
    assert sorted(logged) == [FREQ, STEPS]
    for task, metric in LOGGED.items():
        assert f"eval/{task}/{metric}" in logged[STEPS], sorted(logged[STEPS])
    # the byte perplexity under its one name, and the model improved on it between the two scores
    assert logged[STEPS]["eval/builtin_ppl_1024/ppl"] == logged[STEPS]["eval/builtin_ppl_1024/byte_perplexity"]
    assert logged[STEPS]["eval/builtin_ppl_1024/ppl"] < logged[FREQ]["eval/builtin_ppl_1024/ppl"]
    # the same weights, window and batches: bit for bit, every metric of every task
    scores = eval_recipe.evaluate(run / "checkpoint" / f"step-{STEPS}", absolute(FAST), max_seq_len=SEQ,
                                  batch_size=16)
    assert sorted(scores) == sorted(LOGGED)
    explicit = {f"eval/{task}/{m}": v for task, metrics in scores.items() for m, v in metrics.items()
                if m != "sample_len"}
    assert explicit == logged[STEPS]
    # the recipe's --suite: the same set, printed with 4 decimals
    assert eval_recipe.main([str(run / "checkpoint" / f"step-{STEPS}"), "--suite", "fast", "--max-seq-len", str(SEQ),
                             "--batch-size", "16"]) == 0
    printed = {tuple(line.split()[:2]): line.split()[2] for line in capsys.readouterr().out.splitlines()
               if line.split()[:1] in ([t] for t in LOGGED) and line.split()[1] != "sample_len"}
    assert printed == {(task, m): f"{v:.4f}" for key, v in logged[STEPS].items()
                       for task, m in [key[len("eval/"):].split("/")]}


def test_compare_runs_shows_each_runs_last_scores(run, tmp_path, capsys):
    """Run B: the same run stopped after its first evaluation (its metrics cut at step 5)."""
    other = tmp_path / "b"
    other.mkdir()
    rows = [r for r in read_metrics(run) if r["step"] <= FREQ]
    (other / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert compare_runs.main([str(run), str(other)]) == 0  # the steps both logged agree
    out = capsys.readouterr().out
    logged = evals(run)
    for task, metric in LOGGED.items():
        a, b = logged[STEPS][f"eval/{task}/{metric}"], logged[FREQ][f"eval/{task}/{metric}"]
        line = next(l for l in out.splitlines() if l.startswith(f"| {task}/{metric} |"))
        assert line == f"| {task}/{metric} | {a:.4f} (step {STEPS}) | {b:.4f} (step {FREQ}) | {b - a:+.4f} |", out


def test_the_sweep_report_has_a_column_per_task(run, tmp_path):
    from titan_hydra.analysis.sweep_report import report

    sweep = tmp_path / "sweep"
    for job, (lr, last) in enumerate((("1e-3", STEPS), ("2e-3", FREQ))):
        shutil.copytree(run, sweep / str(job), ignore=shutil.ignore_patterns("checkpoint", "tb", "wandb"))
        (sweep / str(job) / ".hydra").mkdir(exist_ok=True)
        (sweep / str(job) / ".hydra" / "overrides.yaml").write_text(f"- optimizer.lr={lr}\n")
        rows = [r for r in read_metrics(run) if r["step"] <= last]
        (sweep / str(job) / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report(sweep)
    table = list(csv.DictReader(open(sweep / "report.csv")))
    logged = evals(run)
    for job, last in enumerate((STEPS, FREQ)):
        for task, metric in LOGGED.items():
            assert float(table[job][f"eval/{task}/{metric}"]) == logged[last][f"eval/{task}/{metric}"]
    md = (sweep / "report.md").read_text()
    assert "| builtin_ppl_1024/ppl | jsonl_mc_tiny_mc/acc |" in md and (sweep / "eval_curves.png").stat().st_size


# ------------------------------------------------------------------- the sets and bad input


def test_every_named_suite_is_offline_and_fast_is_the_documented_set():
    from titan_hydra.evaluation import check_tasks

    suites = load_suites()
    assert set(suites) == {"fast", "full"}
    assert list(suites["fast"]) == absolute(FAST)
    for tasks in suites.values():  # local tasks only: no registry, no download
        check_tasks(list(tasks))
        assert all(t.startswith(("builtin_ppl", "jsonl_mc:")) for t in tasks)


@pytest.mark.parametrize("overrides,tasks", [
    (["eval=fast"], FAST),
    (["eval=builtin_ppl", "eval.suite=full"], None),  # its [builtin_ppl] is within the full set
    (["eval.freq=3", "eval.suite=[builtin_ppl:512]"], ["builtin_ppl:512"]),
])
def test_a_suite_names_the_tasks(overrides, tasks):
    spec = validate(compose_cfg(overrides))
    assert list(spec.eval.tasks) == (list(load_suites()["full"]) if tasks is None else absolute(tasks))


@pytest.mark.parametrize("overrides,line", [
    (["eval.freq=5", "eval.suite=fastest"],
     "eval.suite=fastest is not a task set: known ones are fast, full (eval_suites.yaml under conf/), or give a list, "
     "eval.suite=[builtin_ppl,...]"),
    (["eval=builtin_ppl", "eval.suite=fast"],
     "eval.suite=fast and eval.tasks=[builtin_ppl] both name the tasks, and the suite lacks ['builtin_ppl']; set "
     "eval.tasks=[] to run the suite alone, or name every task in one of the two"),
    (["eval.suite=fast"], "eval.suite=fast runs with the harness every eval.freq steps, and eval.freq=0 (never); "
                          "set eval.freq=N"),
    (["eval.freq=5", "eval.suite=[builtin_ppl:0]"], "task builtin_ppl:0: the characters of each held-out file to score "
                                                    "must be a positive integer"),
])
def test_bad_suites_are_one_line(overrides, line):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(overrides))
    assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_a_task_file_that_does_not_parse_is_named_with_its_line(tmp_path):
    good = '{"query": "1 + 1 =", "choices": [" 2", " 3"], "gold": 0}'
    for bad, problem in [('{"query": "x", "choices": [" a", " b"], "gold": 2', "is not JSON (Expecting ',' delimiter"),
                         ('{"query": "x", "choices": [" a", " b"], "gold": 2}', "has gold 2, not the index of one of "
                                                                              "its 2 choices"),
                         ('{"query": "x", "choices": " a"}', "lacks gold")]:
        path = tmp_path / "mc.jsonl"
        path.write_text(f"{good}\n\n{bad}\n")
        with pytest.raises(ConfigError) as e:
            validate(compose_cfg(["eval.freq=5", f"eval.suite=[jsonl_mc:{path}]"]))
        assert str(e.value).startswith(f"task file {path} line 3 {problem}") and "\n" not in str(e.value)
    broken = tmp_path / "suites.yaml"
    broken.write_text("fast:\n  - builtin_ppl\n full: [builtin_ppl\n")
    with pytest.raises(ConfigError, match=rf"^eval suites file {broken} line 3 does not parse: "):
        load_suites(broken)
    assert SUITES_FILE.parent.name == "conf"


def test_launch_prints_the_unknown_suite_as_one_line(capsys, tmp_path):
    from titan_hydra.launch.entry import launch

    with pytest.raises(SystemExit) as e:
        launch(compose_cfg(["eval.freq=5", "eval.suite=fastest"]), str(tmp_path))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: eval.suite=fastest is not a task set: known ones are fast, full") and "\n" not in err
    assert not any(tmp_path.iterdir())  # refused before the run wrote anything
