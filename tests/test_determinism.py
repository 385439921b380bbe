"""Run comparison (recipes/compare_runs.py) and determinism: two launches of one config with
``training.deterministic=true`` log the same metrics and end on the same weights, bit for bit, in
one process and under fsdp(2); the comparison finds the first step and the size of a difference.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from helpers import BASE, FSDP2, GLOBAL_BATCH, REPO, STEPS, assert_same_checkpoint, launch_here

from titan_hydra.analysis.compare import compare

sys.path.insert(0, str(REPO / "recipes"))
import compare_runs  # noqa: E402  (the command line: its directory is not a package)


def _write(run: Path, rows: list[dict]) -> Path:
    run.mkdir(parents=True, exist_ok=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def _rows(loss: list[float], **more) -> list[dict]:
    return [{"step": s + 1, "loss": v, "tps": 1000.0 + s, **{k: vs[s] for k, vs in more.items()}}
            for s, v in enumerate(loss)]


def test_compare_finds_the_first_differing_step_and_the_largest_difference(tmp_path, capsys):
    losses = [8.0, 7.5, 7.25, 7.0, 6.75]
    one_ulp = [*losses[:2], losses[2] + math.ulp(losses[2]), *losses[3:]]
    far = [*losses[:3], 7.01, 6.9]
    a = _write(tmp_path / "a", _rows(losses, grad_norm=[1.0] * 5))
    b = _write(tmp_path / "b", _rows(one_ulp, grad_norm=[1.0] * 5))
    c = _write(tmp_path / "c", _rows(far, grad_norm=[1.0] * 5) + [{"step": 5, "val/loss": 7.0}])
    exact = {d.key: d for d in compare(a, b, exact=True)}
    assert sorted(exact) == ["grad_norm", "loss"]  # tps (a timing) is never compared
    assert exact["loss"].first_step == 3 and exact["loss"].max_abs == math.ulp(7.25)
    assert exact["grad_norm"].first_step is None
    assert compare(a, b)[1].first_step is None  # one ulp is within the default rtol
    loose = {d.key: d for d in compare(a, c)}
    assert loose["loss"].first_step == 4
    assert (loose["loss"].max_abs, loose["loss"].max_abs_step) == (pytest.approx(0.15), 5)
    assert loose["loss"].max_rel == pytest.approx(0.15 / 6.9)
    assert compare_runs.main([str(a), str(b)]) == 0
    assert compare_runs.main([str(a), str(b), "--exact", "--plot", str(tmp_path / "d.png")]) == 1
    assert (tmp_path / "d.png").stat().st_size > 0
    assert compare_runs.main([str(a), str(c), "--rtol", "0.03"]) == 0
    capsys.readouterr()
    assert compare_runs.main([str(tmp_path / "nothing"), str(a)]) == 2
    assert compare_runs.main([str(tmp_path), str(a)]) == 2
    assert compare_runs.main([str(a), str(c), "--keys", "val/loss"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"error: {tmp_path / 'nothing'} is not a directory (give a run dir or a multirun job dir)",
                   f"error: {tmp_path} has no metrics.jsonl (give a run dir or a multirun job dir)",
                   "error: metric(s) ['val/loss'] not logged by both runs; they share ['grad_norm', 'loss', 'tps']"]


DETERMINISTIC = [*BASE, "training.deterministic=true", "training.val_freq=5", "training.val_steps=2",
                 "checkpoint=default", "checkpoint.interval=0"]  # the last step's full state, saved


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    pytest.param(["cluster.nproc_per_node=1", "parallelism=single", f"training.local_batch_size={GLOBAL_BATCH}"],
                 id="single"),
    pytest.param(FSDP2, id="fsdp2"),
])
def test_two_deterministic_launches_are_bitwise_equal(tmp_path, layout):
    """Same config, two launches: every logged metric (loss, grad norm, LR, validation) equal bit for
    bit at every step, and the last checkpoints' every tensor (model, optimizer, schedule, loader
    position, RNG) too."""
    runs = [tmp_path / name for name in ("a", "b")]
    for run in runs:
        launch_here([*DETERMINISTIC, *layout], run)
    diffs = compare(*runs, exact=True)
    assert {d.key for d in diffs} >= {"loss", "grad_norm", "lr", "val/loss"}
    assert [(d.key, d.first_step) for d in diffs if d.first_step is not None] == []
    assert next(d for d in diffs if d.key == "loss").steps == STEPS
    assert assert_same_checkpoint(runs[0], runs[1], STEPS) > 0
