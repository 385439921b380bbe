"""A run through launch.py leaves the contract's run dir: .hydra/, metrics.jsonl, tb/ with the
loss scalars, and an offline W&B run holding the resolved config and the same losses."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from helpers import TINY, by_step, read_metrics, run_launch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("outputs")
    rd = tmp / "run"
    proc = run_launch(
        TINY + ["training.steps=6", "training.val_freq=3", "training.val_steps=2",
                "run_name=outputs-test", "tags=[unit]", f"hydra.run.dir={rd}"],
        cwd=tmp,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step     6 | loss" in proc.stdout
    return rd


def test_hydra_dir(run_dir):
    assert (run_dir / ".hydra" / "config.yaml").exists()
    assert "training.steps=6" in (run_dir / ".hydra" / "overrides.yaml").read_text()


def test_metrics_jsonl(run_dir):
    data = read_metrics(run_dir)
    train = [r for r in data if "loss" in r]
    val = [r for r in data if "val/loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in val] == [3, 6]
    for r in train:
        for key in ("loss", "grad_norm", "lr", "tps", "tflops", "mfu", "memory", "data_time"):
            assert key in r and math.isfinite(r[key]), (key, r)
        assert r["tps"] > 0 and 0 < r["mfu"] < 100 and r["memory"] > 0
        assert abs(r["loss"] - math.log(2048)) < 1.5
    # warmup_steps=2: the LR rises over the first steps, then decays
    assert train[0]["lr"] < train[1]["lr"] and train[-1]["lr"] < train[2]["lr"]
    assert val[0]["val/ppl"] == pytest.approx(math.exp(val[0]["val/loss"]), rel=1e-6)


def test_tensorboard_holds_the_losses(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    events = acc.Scalars("loss")
    losses = by_step(run_dir, "loss")
    assert [e.step for e in events] == sorted(losses)
    for e in events:
        assert e.value == pytest.approx(losses[e.step], rel=1e-6)
    assert len(acc.Scalars("val/loss")) == 2


def test_wandb_offline_run_holds_config_and_history(run_dir):
    from titan_hydra.metrics.wandb_reader import read_offline_run

    assert list((run_dir / "wandb").glob("offline-run-*"))
    run = read_offline_run(run_dir)
    cfg = run["config"]
    assert cfg["model"]["dim"] == 64 and cfg["training"]["steps"] == 6
    assert cfg["data"]["seq_len"] == 64  # resolved interpolation, not "${training.seq_len}"
    assert cfg["training"]["mixed_precision"] == "bf16"
    assert run["run"]["name"] == "outputs-test"
    assert "unit" in list(run["run"]["tags"])
    hist = [h for h in run["history"] if "loss" in h]
    losses = by_step(run_dir, "loss")
    assert [h["_step"] for h in hist] == sorted(losses)
    for h in hist:
        assert h["loss"] == pytest.approx(losses[h["_step"]], rel=1e-6)
