"""Every ``python recipes/<name>.py`` line that README.md, docs/*.md and the comments of conf/ show
a user runs here, as a real process against small fixtures of the right kind (a one-step Llama
checkpoint from the README's sweep line, a one-step Flux run, its diffusers export, a tiny corpus,
a tokenizer directory), so a stale line fails CI; and each prints only its own lines: nothing on
stderr (no third-party warning, progress bar or library log a user cannot act on), as the
launch's clean-output test (tests/test_outputs.py) asks of a run.

Placeholders the docs write for a user's own things (``outputs/<date>/<time>``, ``<run dir>``,
``multirun/<date>/<time>``, ...; tests/doc_commands.py) become the fixtures' paths. The launch.py
lines run in tests/test_readme_commands.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from doc_commands import PLACEHOLDERS, ROOT, DocCommand, all_commands, tiered, unique
from helpers import TINY, run_launch
from titan_hydra.data.tokenizer import BUILTIN_PATH

FIXTURES = sorted({key for _, key in PLACEHOLDERS})
# Lines that cannot run here, and why; each is still checked to be in the docs (asserted small).
NOT_RUN = {
    "data=c4 data.hf_name=HuggingFaceFW/fineweb-edu": "streams a corpus from the HF Hub, and CI has no network; "
                                                       "the local-file line beside it runs",
    "_law": "scaling_law.py and mixture_law.py fit many runs (model sizes x token budgets; mixtures drawn by "
            "experiment=mixture_search), which the one-size fixture sweep is not; tests/test_scaling_law.py runs "
            "scaling_law.py and estimate.py --law on a ladder's multirun dir, tests/test_mixture_law.py "
            "mixture_law.py on a 2-job mixture search",
}
# Recipes whose lines run minutes of training: their arguments are parsed (argparse refuses a
# suite or a flag that no longer exists) and --help stops them before anything runs.
# tests/test_benchmark.py runs the default suite end to end.
ARGUMENTS_ONLY = {"recipes/benchmark.py", "recipes/bench_health.py", "recipes/bench_flux_fidelity.py",
                  "recipes/bench_anneal.py",
                  "recipes/bench_averaging.py",
                  # the fixtures' runs hold one checkpoint each, and averaging needs several (and an EMA):
                  # tests/test_weight_averaging.py runs it end to end on a run that saved five
                  "recipes/average_checkpoints.py"}
# Benchmark lines that run as printed plus these arguments: the whole path (every implementation
# timed, the table, the JSON) on one short shape, not ~20 CPU-s of timing the docs' three lengths.
SHORTER = {"recipes/bench_gdn.py": ["--seqs", "256", "--reps", "1"],
           "recipes/hf_sweep.py": ["gpt2", "--steps", "2"]}  # one architecture of the 58, two steps
# Third-party noise that must not reach stdout either.
NOISE = re.compile(r"Warning:|warnings\.warn|it/s\]|^fatal: |\[Task: |^\s*\d+%\|", re.M)


def _templated(cmd: DocCommand) -> DocCommand:
    """The line with each placeholder as ``@fixture@`` (filled in when the fixtures exist)."""
    return cmd.concrete({key: f"@{key}@" for key in FIXTURES})


def _expanded(cmd: DocCommand) -> list[DocCommand]:
    """A ``{a,b,c}`` choice list, as the docs write a suite name, becomes one line per choice."""
    match = re.search(r"\{([\w,]+)\}", cmd.line)
    if not match:
        return [cmd]
    return [DocCommand(cmd.where, cmd.line.replace(match.group(0), choice)) for choice in match.group(1).split(",")]


def _not_run(cmd: DocCommand) -> bool:
    return any(key in cmd.line for key in NOT_RUN)


RECIPE_LINES = unique([e for c in all_commands() if c.program.startswith("recipes/") for e in _expanded(_templated(c))])
RUN = [c for c in RECIPE_LINES if not _not_run(c) and c.program not in ARGUMENTS_ONLY]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A user's directory after the README's first steps, and the fixture paths by name."""
    work = tmp_path_factory.mktemp("user")
    (work / "corpus").mkdir()
    with open(work / "corpus" / "code.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n")
    (work / "tokenizer").mkdir()
    (work / "tokenizer" / "tokenizer.json").write_bytes(BUILTIN_PATH.read_bytes())

    # The README's sweep line, one step per job: a Llama checkpoint per job, a multirun dir.
    sweep = work / "multirun" / "sweep"
    readme_sweep = next(c for c in all_commands() if c.line.startswith("python launch.py -m optimizer.lr="))
    proc = run_launch([*readme_sweep.args, *TINY, "training.steps=1", "training.val_freq=0",
                       "lr_scheduler.warmup_steps=1", "training.attention_kernel=sdpa", "checkpoint=default",
                       "logger=minimal", f"hydra.sweep.dir={sweep}"], cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-3000:]  # one process saving a checkpoint: no DCP warning
    # `python launch.py experiment=flux_debug`, one step on small images.
    flux = work / "outputs" / "flux"
    proc = run_launch(["experiment=flux_debug", "data.num_images=16", "data.image_size=32", "training.steps=1",
                       "training.local_batch_size=4", "training.val_freq=0", "lr_scheduler.warmup_steps=1",
                       "eval.sample_every=0", "eval.fidelity_every=0", "logger=minimal", f"hydra.run.dir={flux}"],
                      cwd=work, timeout=600)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-3000:]
    paths = {"sweep": str(sweep), "llm_step": str(sweep / "0" / "checkpoint" / "step-1"),
             "flux_run": str(flux), "flux_step": str(flux / "checkpoint" / "step-1"),
             "tokenizer": str(work / "tokenizer")}
    assert set(paths) == set(FIXTURES)
    # A FLUX.1 repo's transformer/ folder, as convert.py's from-hf line reads it.
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "convert.py"), "to-hf", paths["flux_step"],
                           str(work / "FLUX.1-dev" / "transformer")], cwd=work, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return work, paths


def _filled(cmd: DocCommand, paths: dict[str, str]) -> list[str]:
    """The line's argv with this interpreter, the recipe's path and each fixture's path (and the
    recipe's ``SHORTER`` arguments)."""
    args = []
    for word in cmd.args:
        for key, path in paths.items():
            word = word.replace(f"@{key}@", path)
        args.append(word)
    return [sys.executable, str(ROOT / cmd.program), *args, *SHORTER.get(cmd.program, [])]


def test_the_docs_show_the_recipe_lines_this_module_runs():
    recipes = {c.program for c in RECIPE_LINES}
    assert {"recipes/convert.py", "recipes/generate.py", "recipes/generate_image.py", "recipes/eval.py",
            "recipes/prepare_data.py", "recipes/estimate.py", "recipes/sweep_report.py"} <= recipes, recipes
    assert len(NOT_RUN) <= 2
    for key in NOT_RUN:
        assert any(key in c.line for c in RECIPE_LINES), f"{key}: no such line any more"
    assert sum(c.program in ARGUMENTS_ONLY for c in RECIPE_LINES) >= 10  # one per benchmark suite


@pytest.mark.slow
@pytest.mark.parametrize("cmd", tiered(RUN, lambda c: c.where.split(",")[0] + ":" + c.program.split("/")[-1]))
def test_recipe_line_runs_and_prints_only_its_own_lines(cmd, user):
    work, paths = user
    proc = subprocess.run(_filled(cmd, paths), cwd=work, env=_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd.where}: `{cmd.line}`\n{proc.stderr[-3000:]}"
    assert proc.stderr == "", f"{cmd.where}: `{cmd.line}` printed on stderr:\n{proc.stderr[-3000:]}"
    assert proc.stdout.strip(), f"{cmd.where}: `{cmd.line}` printed nothing"
    assert not NOISE.search(proc.stdout), f"{cmd.where}: third-party output on stdout:\n{proc.stdout[-3000:]}"
    if cmd.args[:1] in (["to-hf"], ["from-hf"]):  # it wrote what it says
        assert proc.stdout.startswith("wrote ") and (work / cmd.args[2] / "config.json").is_file() == (cmd.args[0] == "to-hf")


@pytest.mark.slow
@pytest.mark.parametrize("cmd", tiered([c for c in RECIPE_LINES if c.program in ARGUMENTS_ONLY],
                                       lambda c: c.where.split(",")[0] + ":" + " ".join(c.args)))
def test_recipe_line_arguments_parse(cmd, tmp_path):
    argv = _filled(cmd, {})
    proc = subprocess.run([*argv, "--help"], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd.where}: `{cmd.line}`\n{proc.stderr[-2000:]}"
    assert proc.stdout.startswith("usage:") and proc.stderr == ""

