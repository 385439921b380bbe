"""The local launcher: torchrun and the built-in elastic spawn give the same run; a worker's
bad-input error reaches the user as one ``error:`` line with a non-zero exit."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO, compose_cfg, run_launch, series
from titan_hydra.spec import spec_of

# A short fsdp(2) run: 4 steps of a 2-layer model, one thread per rank.
ARGS = [
    "parallelism=fsdp",
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "training.seq_len=64",
    "training.steps=4",
    "training.local_batch_size=2",
    "training.mixed_precision=fp32",
    "training.val_freq=0",
    "lr_scheduler.warmup_steps=1",
    "data.max_documents=40",
    "logger=minimal",
    "cluster.threads_per_proc=1",
]


def _torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO / "launch.py"), *args]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "WANDB_SILENT": "true"})


def _launched_losses(tmp_path, method: str) -> list[float]:
    run_dir = tmp_path / method
    proc = run_launch(ARGS + ["cluster.nproc_per_node=2", f"cluster.start_method={method}",
                              f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "TOKENIZERS_PARALLELISM" not in proc.stderr + proc.stdout  # no fork warning from tokenizers
    return series(run_dir, "loss")


@pytest.mark.slow
def test_torchrun_matches_our_launcher(tmp_path):
    """Ranks started by torchrun and by our launcher (forking its workers) train bit-identically.
    Fork-serving is not launched here: the rest of the suite fork-serves (conftest sets
    TITAN_HYDRA_START_METHOD) and compares its losses with single-rank runs."""
    forked = _launched_losses(tmp_path, "fork")
    proc = _torchrun(ARGS, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # Both ranks composed their own config yet share one run dir (outputs/torchrun/<run id>).
    run_dirs = list((tmp_path / "outputs" / "torchrun").iterdir())
    assert len(run_dirs) == 1, run_dirs
    assert len(forked) == 4
    assert series(run_dirs[0], "loss") == forked  # same config, same ranks, same reduction order: bit-identical


@pytest.mark.slow
@pytest.mark.extended
def test_spawned_workers_match_forked_ones(tmp_path):
    """cluster.start_method=spawn (fresh interpreters) trains as fork does, bit for bit."""
    assert _launched_losses(tmp_path, "spawn") == _launched_losses(tmp_path, "fork")


def bad_data_program(spec, run_dir: str, return_state: bool = False):
    """A rank program that finds bad data only inside the worker (the parent's data was fine)."""
    from titan_hydra.data.settings import DataSettings
    from titan_hydra.train.services import build_dataset

    bad = Path(run_dir) / "bad.jsonl"
    bad.write_text(json.dumps({"txt": "no text field"}) + "\n")
    build_dataset(DataSettings.of({**spec.data.dataset_node, "name": "json", "source": "json", "path": str(bad)}))


def gc_state_program(spec, run_dir: str, return_state: bool = False):
    """A rank program that reports its garbage collector's state."""
    return {"enabled": gc.isenabled(), "frozen": gc.get_freeze_count() > 0}


@pytest.mark.slow
def test_forked_workers_collect_garbage(tmp_path):
    """The fork server imports with collection paused (titan_hydra/launch/gc_paused.py); a worker
    forked from it freezes what it inherited and collects its own garbage again."""
    from titan_hydra.launch import local

    spec = spec_of(compose_cfg(ARGS + ["cluster.nproc_per_node=2", "cluster.start_method=forkserver"]))
    assert local.run_local(spec, str(tmp_path), program=f"{__name__}:gc_state_program") == {
        "enabled": True, "frozen": True}


def test_worker_user_error_is_one_line(tmp_path, monkeypatch, capsys):
    from titan_hydra.launch import entry, local

    monkeypatch.setattr(local, "DEFAULT_PROGRAM", f"{__name__}:bad_data_program")
    monkeypatch.chdir(tmp_path)  # launch() uses the cwd as run dir outside Hydra
    cfg = compose_cfg(ARGS + ["cluster.nproc_per_node=2"])
    with pytest.raises(SystemExit) as exit_info:
        entry.launch(cfg)
    assert exit_info.value.code == 2
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error:")]
    assert lines == [
        f"error: bad record in {tmp_path / 'bad.jsonl'} line 1: missing text field 'text' (set data.text_field=...)"
    ]
