"""The documentation is a contract: every ``launch.py`` line that README.md, docs/*.md and the
comments of conf/ show a user (tests/doc_commands.py finds them) runs here, so a stale line fails
CI. The recipe lines run in tests/test_recipe_commands.py.

Each line runs in planning mode, in this process: its words, split as the shell splits them, are
the overrides ``python launch.py`` gets; they are composed from conf/ as Hydra composes them and
handed to ``launch`` (titan_hydra.launch.entry) with ``dry_run=true``: every rule of the
validation, then the plan. That is also the whole path of a line that needs SLURM or a GPU on
the machine that submits it. A ``-m`` line is expanded into its points as Hydra's basic sweeper
expands it (the points an experiment's ``hydra.sweeper.params`` adds included) and each point is
planned; a ``torchrun`` line is planned as its ranks see it (``WORLD_SIZE`` set); ``--cfg job``
is composed only. A few lines also run as real ``python launch.py`` processes, so that the
in-process path is known to say what the program says.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser

from doc_commands import ROOT, DocCommand, all_commands, unique
from helpers import compose_cfg, run_launch
from titan_hydra.groups import CONF_DIR
from titan_hydra.launch.entry import launch

BASIC_SWEEPER = "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"
LAUNCH_LINES = unique([c for c in all_commands() if c.program == "launch.py"])

# Lines planned only as real processes (below), with why they cannot be planned in this process.
SUBPROCESS_ONLY = {
    "PYTHONPATH=tests/byo": "a model package of its own on PYTHONPATH and a hydra.searchpath: a fresh interpreter",
}


def _subprocess_only(cmd: DocCommand) -> bool:
    return any(cmd.line.startswith(prefix) for prefix in SUBPROCESS_ONLY)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A user's directory for the data lines: corpus.jsonl, a tokenizer directory, and prepared
    corpora at prepared/corpus, prepared/web, prepared/code and prepared/mix/{python,c,docs} (the
    sources of experiment=mixture_search) in recipes/prepare_data.py's format."""
    from titan_hydra.data.dataset import resolve_files
    from titan_hydra.data.prepare import PrepareSettings, prepare, val_every_of
    from titan_hydra.data.tokenizer import BUILTIN_PATH

    work = tmp_path_factory.mktemp("user")
    with open(work / "corpus.jsonl", "w") as f:
        for i in range(40):
            f.write(json.dumps({"text": f"def f{i}(x):\n    return x * {i}\n" * 4}) + "\n")
    (work / "tokenizer").mkdir()
    (work / "tokenizer" / "tokenizer.json").write_bytes(BUILTIN_PATH.read_bytes())
    for name in ("corpus", "web", "code", "mix/python", "mix/c", "mix/docs"):  # mix/: experiment=mixture_search
        prepare(resolve_files(str(work / "corpus.jsonl"), "json"),
                PrepareSettings(source="json", text_field="text", tokenizer="builtin", val_every=val_every_of(0.05),
                                shard_tokens=1 << 20, out=str(work / "prepared" / name)))
    return work


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """The jobs of ``launch.py -m OVERRIDES``, as Hydra's basic sweeper will run them; for a
    sweeper that picks its points while it runs (optuna), the one config they all start from."""
    parser = OverridesParser.create()
    parsed = parser.parse_overrides(overrides)
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        base = compose(config_name="config", overrides=fixed, return_hydra_config=True)
    if base.hydra.sweeper._target_ != BASIC_SWEEPER:
        return [fixed]
    params = base.hydra.sweeper.params or {}
    parsed = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + overrides)
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def torchrun_world(cmd: DocCommand) -> dict[str, str]:
    """The environment torchrun gives rank 0 of this line."""
    words = cmd.argv
    nproc = next(int(w.split("=")[1] if "=" in w else words[i + 1]) for i, w in enumerate(words)
                 if w.split("=")[0] in ("--nproc-per-node", "--nproc_per_node"))
    return {"WORLD_SIZE": str(nproc), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(nproc)}


def plan_line(cmd: DocCommand) -> list[str]:
    """Plan every job of ``cmd`` in this process; returns each job's printed plan. A job that
    launch.py would refuse fails the test with launch.py's own one-line error, except in a sweep of
    dry runs, which compares layouts: there a refused one is a row of the sweep's report
    (titan_hydra/launch/dry_run.py) and only a sweep with nothing planned fails."""
    args = list(cmd.args)
    multirun = bool({"-m", "--multirun"} & set(args))
    dry_sweep = multirun and any(a in ("dry_run=true", "dry_run=simulate") for a in args)
    args = [a for a in args if a not in ("-m", "--multirun")]
    config_only = "--cfg" in args
    if config_only:
        del args[args.index("--cfg"):args.index("--cfg") + 2]
    plans = []
    for point in sweep_points(args) if multirun else [args]:
        if config_only:
            plans.append(str(compose_cfg(point)))
            continue
        # a dry_run=simulate line (or auto's simulated check) is planned like the others (validation
        # + plan); simulations of real-size layouts run in tests/test_simulate.py, sized to stay fast
        point = [o for o in point if o not in ("dry_run=simulate", "parallelism.auto_verify=simulate")]
        if not any(o.startswith("dry_run=") for o in point):
            point = [*point, "dry_run=true"]
        out, err = io.StringIO(), io.StringIO()
        exit_code = None
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                launch(compose_cfg(point))
        except SystemExit as e:  # launch.py's one-line refusal
            exit_code = e.code
        refused = any(line.startswith("error: ") for line in err.getvalue().splitlines())
        if exit_code == 2 and dry_sweep and refused:
            continue  # a refused layout: a row of the sweep's report
        if exit_code is not None:
            pytest.fail(f"{cmd.where}: `{cmd.line}` fails (job {' '.join(point)}), exit {exit_code}:\n{err.getvalue()}",
                        pytrace=False)
        plans.append(out.getvalue())
    return plans


def test_the_docs_show_the_commands_this_suite_runs():
    """The extraction finds the lines a user reads first, whole (continuations joined, comments
    dropped), and the lines planned only as processes are few and each still in the docs."""
    lines = {c.line.split("  #")[0].strip() for c in all_commands()}
    assert len(LAUNCH_LINES) >= 35, len(LAUNCH_LINES)  # distinct lines
    assert "python launch.py --cfg job" in lines
    flux_dev = next(c for c in LAUNCH_LINES if "model=flux_dev" in c.line and c.where.startswith("docs/families.md"))
    assert "cluster=slurm_h100 cluster.nnodes=2" in flux_dev.line and flux_dev.args[-1] == "dry_run=true"
    assert any(c.where.startswith("conf/") for c in LAUNCH_LINES) and any(c.where.startswith("docs/") for c in LAUNCH_LINES)
    assert len(SUBPROCESS_ONLY) <= 2
    for prefix in SUBPROCESS_ONLY:
        assert any(c.line.startswith(prefix) for c in LAUNCH_LINES), f"{prefix}: no such line any more"


@pytest.mark.parametrize("cmd", [c for c in LAUNCH_LINES if not _subprocess_only(c)], ids=lambda c: c.where.split(",")[0])
def test_launch_line_plans(cmd, workdir, monkeypatch):
    monkeypatch.chdir(workdir)
    cmd = cmd.concrete({"tokenizer": str(workdir / "tokenizer")})
    if cmd.argv[0] == "torchrun":
        for key, value in torchrun_world(cmd).items():
            monkeypatch.setenv(key, value)
    plans = plan_line(cmd)
    assert plans and all(plan.strip() for plan in plans), f"{cmd.where}: nothing planned"


def test_sweep_points_are_hydras():
    """A -m line's jobs, in Hydra's order: the command's sweep crossed with an experiment's."""
    assert sweep_points(["optimizer.lr=0.1,0.3", "training.steps=2"]) == [
        ["optimizer.lr=0.1", "training.steps=2"], ["optimizer.lr=0.3", "training.steps=2"]]
    points = sweep_points(["experiment=muon_vs_adamw"])  # optimizer: adamw,muon x optimizer.lr: 5e-4,1e-3,2e-3
    assert len(points) == 6 and points[-1] == ["optimizer=muon", "optimizer.lr=0.002", "experiment=muon_vs_adamw"]
    assert sweep_points(["experiment=optuna_lr"]) == [["experiment=optuna_lr"]]  # optuna picks its points later


# ----------------------------------------------------------------------------- as real processes


def _readme_line(fragment: str, doc: str = "README.md") -> DocCommand:
    return next(c for c in LAUNCH_LINES if fragment in c.line and c.where.startswith(doc))


@pytest.mark.slow
def test_flux_dev_line_runs_as_printed(tmp_path):
    """The docs' FLUX.1 [dev] planning line, as a user pastes it: the plan of 16 H100s."""
    cmd = _readme_line("model=flux_dev", "docs/families.md")
    proc = run_launch(cmd.args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"{cmd.where}: `{cmd.line}`\n{proc.stderr[-2000:]}"
    assert proc.stderr.strip() == ""
    assert "flux_dev" in proc.stdout and "11,901,408,320" in proc.stdout


@pytest.mark.slow
def test_flux_dev_needs_both_settings_named_at_once(tmp_path):
    """model=flux_dev alone lacks image data and its guidance scale: one line names both, with a
    command that works, so a user meets them at once rather than one per attempt."""
    proc = run_launch(["model=flux_dev", "dry_run=true"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert "data=flux_shapes" in lines[0] and "data.examples.guidance=3.5" in lines[0]
    example = lines[0].split("e.g. ", 1)[1]
    assert example.startswith("python launch.py ")
    fixed = run_launch(shlex.split(example)[2:], cwd=tmp_path, timeout=300)
    assert fixed.returncode == 0, fixed.stderr[-2000:]


@pytest.mark.slow
def test_cfg_job_and_a_multirun_line_run_as_printed(workdir):
    """``--cfg job`` prints the composed config; the README's mixture sweep, with dry_run=true,
    runs Hydra's multirun (the sweep check, the basic launcher): one plan per weight."""
    proc = run_launch(_readme_line("--cfg job").args, cwd=workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model:" in proc.stdout and "training:" in proc.stdout
    cmd = _readme_line("-m data=mixture")
    proc = run_launch([*cmd.args, "dry_run=true", f"hydra.sweep.dir={workdir / 'multirun'}"], cwd=workdir, timeout=300)
    assert proc.returncode == 0, f"{cmd.where}: `{cmd.line}`\n{proc.stderr[-2000:]}"
    assert proc.stdout.count("parameters") >= 2, proc.stdout[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("cmd", [c for c in LAUNCH_LINES if _subprocess_only(c)], ids=lambda c: c.where.split(",")[0])
def test_subprocess_only_line_plans(cmd):
    """As the docs print it, run by a shell from the repository root (its ``$PWD`` and
    ``PYTHONPATH``), in planning mode."""
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_SILENT="true")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), str(ROOT)) if p)
    line = cmd.line.replace("PYTHONPATH=tests/byo ", "PYTHONPATH=tests/byo:$PYTHONPATH ")
    line = line.replace("python launch.py", f"{shlex.quote(sys.executable)} launch.py", 1)
    proc = subprocess.run(["bash", "-c", f"{line} dry_run=true"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"{cmd.where}: `{cmd.line}`\n{proc.stderr[-2000:]}"
    assert "parameters" in proc.stdout
