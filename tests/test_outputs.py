"""A run through launch.py leaves the contract's run dir: .hydra/, metrics.jsonl, tb/ with the
loss scalars, and an offline W&B run holding the resolved config and the same losses."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from helpers import TINY, by_step, read_metrics, run_launch


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("outputs")
    rd = tmp / "run"
    proc = run_launch(
        TINY + ["training.steps=6", "training.val_freq=3", "training.val_steps=2", "eval=fast", "eval.freq=6",
                "run_name=outputs-test", "tags=[unit]", f"hydra.run.dir={rd}"],
        cwd=tmp,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "step     6 | loss" in proc.stdout
    (rd / "console.txt").write_text(proc.stdout)
    (rd / "console_stderr.txt").write_text(proc.stderr)
    return rd


def test_header_and_footer_say_what_ran_and_where_it_went(run_dir):
    """Before step 1: model, parameters, layout, precision, data, batch, run dir; after the last
    step: the final losses as logged and a `wandb sync` command for a W&B run that exists."""
    from helpers import compose_cfg
    from titan_hydra.hardware import resolve_precision
    from titan_hydra.models.registry import args_of

    out = (run_dir / "console.txt").read_text().splitlines()
    first_step = next(i for i, l in enumerate(out) if l.startswith("step "))
    header = "\n".join(out[:first_step])
    family, args = args_of(compose_cfg(TINY).model)
    assert f"llama3_debug (llama3): {family.shape(args).params:,} parameters" in header
    precision = resolve_precision("auto", "cpu")  # the default, training.mixed_precision=auto
    assert "1 rank(s): one process" in header and f"precision  {precision.value} ({precision.reason}):" in header
    assert re.search(r"attention  (sdpa|small_head) kernel \(auto: measured \d+\.\dx faster than", header), header
    assert "global 4 sequences = 256 tokens per step (local 4 x data parallel 1 x accumulation 1); 6 steps" in header
    assert f"run dir    {run_dir}" in header
    rows = read_metrics(run_dir)
    loss = [r["loss"] for r in rows if "loss" in r][-1]
    val = [r["val/loss"] for r in rows if "val/loss" in r][-1]
    done = next(l for l in out if l.startswith("done: 6 steps in "))
    assert f"final loss {loss:.4f} | val loss {val:.4f}" in done
    # the in-loop harness (eval=fast at step 6) draws no progress bars on either stream
    for stream in ("console.txt", "console_stderr.txt"):
        assert not re.search(r"it/s\]|\d+%\|", (run_dir / stream).read_text()), stream
    sync = next(l for l in out if "wandb sync " in l).split("wandb sync ")[1].strip()
    assert Path(sync).is_dir() and Path(sync).parent == run_dir / "wandb" and list(Path(sync).glob("run-*.wandb"))


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
    scored = [r for r in data if "eval/builtin_ppl_1024/ppl" in r]
    assert [r["step"] for r in scored] == [6] and math.isfinite(scored[0]["eval/builtin_ppl_1024/ppl"])
    assert 0 <= scored[0]["eval/jsonl_mc_tiny_mc/acc"] <= 1


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
    from titan_hydra.hardware import resolve_precision
    from titan_hydra.logger.wandb_reader import read_offline_run

    assert list((run_dir / "wandb").glob("offline-run-*"))
    run = read_offline_run(run_dir)
    cfg = run["config"]
    assert cfg["model"]["dim"] == 64 and cfg["training"]["steps"] == 6
    assert cfg["data"]["seq_len"] == 64  # resolved interpolation, not "${training.seq_len}"
    assert cfg["training"]["mixed_precision"] == "auto"
    assert cfg["resolved"]["mixed_precision"] == resolve_precision("auto", "cpu").value  # what auto chose
    assert run["run"]["name"] == "outputs-test"
    assert "unit" in list(run["run"]["tags"])
    hist = [h for h in run["history"] if "loss" in h]
    losses = by_step(run_dir, "loss")
    assert [h["_step"] for h in hist] == sorted(losses)
    for h in hist:
        assert h["loss"] == pytest.approx(losses[h["_step"]], rel=1e-6)


@pytest.mark.slow
@pytest.mark.extended
def test_fsdp_float8_run_prints_no_warning_a_user_cannot_act_on(tmp_path):
    """2-rank FSDP with torchao float8: stderr stays empty (no DTensor CPU-random warning per
    rank, no torchao library-load failures, no pytree deprecation notes); stdout is the header,
    the step lines and the footer."""
    proc = run_launch(TINY + ["training.steps=2", "training.val_freq=0", "parallelism=fsdp",
                              "cluster.nproc_per_node=2", "training.local_batch_size=2",
                              "float8=tensorwise", "float8.emulate=true", "float8.auto_filter_small_kn=false",
                              f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # training.mixed_precision=auto picks bf16 only where the CPU computes it natively, so not
    # even the emulated-bf16 warning may appear.
    assert [l for l in proc.stderr.splitlines() if l.strip()] == [], proc.stderr[-3000:]
    other = [l for l in proc.stdout.splitlines()
             if l.strip() and not l.startswith(("titan_hydra run", "  ", "step ", "done: "))]
    assert other == [], other
