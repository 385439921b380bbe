"""Sharded in-loop evaluation (``eval.sharded=true``): the harness's requests scored across the
data-parallel ranks by the training model itself (titan_hydra/evaluation.py ``ShardedLM``), no full
copy on rank 0. One process: bit for bit the one-copy path's scores. fsdp(2): the one-copy path's
scores within the run's fp32 parity bound (the two layouts' weights differ by rounding only), and
its evaluation time (the goodput ledger's ``eval`` seconds) recorded against the one-copy path's,
not asserted. pp(2): the one-copy path's scores, through the pipeline's own stages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
from helpers import machine_bound, read_metrics, run_layout, run_single  # noqa: E402

EVAL = ["eval=builtin_ppl", "eval.freq=10", "eval.limit=3", "eval.batch_size=16"]
KEY = "eval/builtin_ppl/bits_per_byte"


def scores(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r[KEY] for r in read_metrics(run_dir) if KEY in r}


def eval_seconds(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "goodput.jsonl").read_text().splitlines()]
    return sum(r["s"].get("eval", 0.0) for r in rows)


def test_one_process_scores_bit_for_bit_as_the_full_copy(tmp_path):
    got = {}
    for sharded in ("false", "true"):
        run_single(tmp_path / sharded, [*EVAL, f"eval.sharded={sharded}"])
        got[sharded] = scores(tmp_path / sharded / "run")
    assert sorted(got["false"]) == [10] and got["true"] == got["false"]


@pytest.mark.slow
def test_fsdp_scores_as_the_full_copy_in_its_share_of_the_time(tmp_path, run_cache, record_property):
    got, seconds = {}, {}
    for sharded in ("false", "true"):
        (tmp_path / sharded).mkdir()
        run_layout(tmp_path / sharded, [*EVAL, "parallelism=fsdp", f"eval.sharded={sharded}"], nproc=2, dp=2)
        got[sharded] = scores(tmp_path / sharded / "run")
        seconds[sharded] = eval_seconds(tmp_path / sharded / "run")
    record_property("eval seconds, one copy on rank 0 / sharded over fsdp(2)", (seconds["false"], seconds["true"]))
    bound = machine_bound(run_cache, got["false"].values())
    assert sorted(got["true"]) == [10] and abs(got["true"][10] - got["false"][10]) <= bound, (got, bound)


@pytest.mark.slow
def test_a_pipeline_scores_as_the_full_copy(tmp_path, run_cache):
    """pp(2): the stages walked in order by their own ranks, the last stage's logits sent to the
    other pipeline rank, every rank's harness given the same scores as the one-copy path."""
    got = {}
    for sharded in ("false", "true"):
        (tmp_path / sharded).mkdir()
        run_layout(tmp_path / sharded, [*EVAL, "parallelism=pp", f"eval.sharded={sharded}"], nproc=2, dp=1)
        got[sharded] = scores(tmp_path / sharded / "run")
    bound = machine_bound(run_cache, got["false"].values())
    assert sorted(got["true"]) == [10] and abs(got["true"][10] - got["false"][10]) <= bound, (got, bound)
