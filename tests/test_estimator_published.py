"""The estimator against torchtitan's published Llama 3.1 runs on 96 GB H100s (2024-12).

Rows: tests/data/torchtitan_h100_202412.yaml (source, commits and implicit settings in its header).
Each row is composed as the titan_hydra config of the same setup (recipes/estimate_published.py)
and sized analytically (meta-free: ``estimate.plan`` allocates nothing) with the behaviours of
the code that ran it (``estimate.TORCHTITAN_2024_12``). Estimated peak must be within +-15% of
the published max reserved memory. Rows the model does not reach are strict xfails with the
reason (they pass the day the model explains them, and the xfail then fails, asking for removal).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import pytest

from titan_hydra.config.schemas import ClusterConfig
from titan_hydra.errors import ConfigError
from titan_hydra.launch.resolve import resolved_spec
from titan_hydra.planner.plan import plan
from titan_hydra.spec import spec_of
from helpers import compose_cfg

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("estimate_published", REPO / "recipes" / "estimate_published.py")
ep = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ep)

ROWS = ep.load_rows()


@functools.lru_cache(maxsize=None)
def evaluated(row_id: str) -> dict:
    """``evaluate_row`` once per row for the whole module (each takes ~0.5 s of CPU)."""
    return ep.evaluate_row(next(r for r in ROWS if r["id"] == row_id))

TOLERANCE = 0.15
DEVICE_GIB = 96.0

# 16% under (t6_fsdp1_cp8; 16-23% on four rows before the first pipeline stage's accumulated
# embedding gradient was counted): the 405B 1F1B rows hold more than the modeled terms (FSDP/TP/PP state, block
# inputs under full AC, one block's recompute, the loss-parallel backward, pipeline in-flight
# microbatches with torch.distributed.pipelining's per-microbatch send/recv buffers, the last
# stage's outputs the schedule keeps, unsharded fp32 grads). Two published runs that the model
# cannot tell apart (t5_1f1b and t6_fsdp8_cp1: same degrees, schedule, AC, compile, float8 and
# 32768 tokens per microbatch, as 4 x 8192 or 1 x 32768) differ by 7.2 GiB (82.5 vs 75.3), so
# part of the gap is not a function of the tensors the step holds; the leading candidate is
# caching-allocator fragmentation across the FSDP, TP and PP streams, which only a CUDA memory
# snapshot of such a run can show (a CPU-only machine cannot), so no constant is fitted to it.
UNDER_PP = "estimate 16% below the published peak: PP x TP x float8 terms not modeled (see module comment)"
XFAIL = {"t6_fsdp1_cp8": UNDER_PP}


def _param(row):
    marks = [pytest.mark.xfail(strict=True, reason=XFAIL[row["id"]])] if row["id"] in XFAIL else []
    return pytest.param(row, id=row["id"], marks=marks)


def test_data_file_covers_all_six_tables():
    assert sorted({r["table"] for r in ROWS}) == [1, 2, 3, 4, 5, 6]
    assert len(ROWS) == 18
    for r in ROWS:
        assert r["dp_shard"] * r["tp"] * r["pp"] * r["cp"] == r["gpus"], r["id"]


@pytest.mark.parametrize("row", [_param(r) for r in ROWS])
def test_estimated_peak_within_15_percent_of_published(row):
    got = evaluated(row["id"])
    ratio = got["estimated_gib"] / row["memory_gib"]
    assert abs(ratio - 1) <= TOLERANCE, (
        f"{row['id']}: estimated {got['estimated_gib']:.1f} GiB, published {row['memory_gib']} GiB ({ratio:.2f}x)")


def test_default_memory_headroom_is_the_largest_underestimate():
    """cluster.memory_headroom's default is recomputed from the rows: when the estimator changes,
    this fails until the default (config/schemas.py) is re-derived."""
    results = [evaluated(r["id"]) for r in ROWS]
    headroom, worst = ep.headroom_covering(results)
    assert ClusterConfig.memory_headroom == headroom == 0.17, (headroom, worst["id"])
    for r in results:  # what fits the default's usable memory fits the device by the published peak
        assert r["estimated_gib"] / (1 - headroom) >= r["published_gib"], r["id"]


def test_tokens_per_second_is_reported_for_every_row():
    """No accuracy target (see recipes/estimate_published.py); the ratio must exist and be sane."""
    for row in ROWS:
        got = evaluated(row["id"])
        assert 0.2 < got["tps_ratio"] < 5, (row["id"], got)


def test_compile_and_scale_effects_have_the_published_sign():
    """Compile holds less than eager (published 77.0 vs 82.4 GiB); 128 ranks less than 8."""
    est = {r["id"]: evaluated(r["id"])["estimated_gib"] for r in ROWS}
    assert est["t1_fsdp_compile"] < est["t1_fsdp"] and est["t3_fsdp_compile"] < est["t3_fsdp"]
    assert est["t3_fsdp"] < est["t1_fsdp"]  # 16x more ranks shard the state 16x finer


def test_schedule_effect_has_the_published_sign():
    """Interleaved 1F1B holds less than 1F1B (published 72.7 vs 82.5 GiB)."""
    est = {r["id"]: evaluated(r["id"])["estimated_gib"] for r in ROWS}
    assert est["t5_interleaved_1f1b"] < est["t5_1f1b"]


def test_first_pipeline_rank_holds_less_under_interleaved_1f1b():
    """Where the schedules differ, on the first rank (all its microbatches in flight before the
    first backward), interleaving halves the layers whose inputs wait on it after that backward."""
    from titan_hydra.planner.cuda_memory import cuda_dynamic_peak
    from titan_hydra.planner.runtime import TORCHTITAN_2024_12

    peaks = {}
    for rid in ("t5_1f1b", "t5_interleaved_1f1b"):
        cfg = compose_cfg(ep.overrides(next(r for r in ROWS if r["id"] == rid)))
        peaks[rid] = cuda_dynamic_peak(spec_of(cfg), TORCHTITAN_2024_12, pp_rank=0)[0]
    assert peaks["t5_interleaved_1f1b"] < 0.95 * peaks["t5_1f1b"], peaks


# parallelism=auto on the published models, cluster sizes and batch settings (titan_hydra's own
# runtime, with the published runs' selective_op policy, every_second_mm).
# The published runs show that a layout with tp*pp*cp no larger than theirs fits 96 GB; auto must
# pick a layout it estimates to fit, and need no more model parallelism than the published one.
# titan_hydra refuses compile with full AC under TP (parallel/auto.py's launch rules), so the TP
# groups are sized with compile=none. This checks the ranking on the estimate itself
# (cluster.memory_headroom=0); the default headroom's choices are the next test's.
def _groups():
    seen, out = set(), []
    for r in ROWS:
        key = (r["model"], r["gpus"], r["local_batch"], r["seq_len"], r["ac"])
        if key not in seen and r["table"] in (1, 2, 3, 4, 5):
            seen.add(key)
            out.append(r)
    return out


AUTO_XFAIL: dict[str, str] = {}


@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"], marks=[pytest.mark.xfail(strict=True, reason=AUTO_XFAIL[r["id"]])]
                                              if r["id"] in AUTO_XFAIL else []) for r in _groups()])
def test_auto_picks_a_fitting_layout_no_more_parallel_than_published(row):
    from titan_hydra.planner import auto

    cfg = compose_cfg(_auto_overrides(row) + ["cluster.memory_headroom=0"])
    cands = auto.candidates(spec_of(cfg))
    chosen = auto.choose(cands)
    assert chosen is not None, f"{row['id']}: no layout fits\n{auto.table(cands, DEVICE_GIB)}"
    assert chosen.mem_gib <= DEVICE_GIB
    assert chosen.tp * chosen.pp * chosen.cp <= row["tp"] * row["pp"] * row["cp"], chosen.describe()


def _auto_overrides(row) -> list[str]:
    ov = [o for o in ep.overrides(row) if not o.startswith("parallelism")] + ["parallelism=auto"]
    if row["tp"] > 1:
        ov = [o for o in ov if not o.startswith("compile=")] + ["compile=none"]
    return ov


# At the default headroom (73.0 of 96 GiB usable), the layout auto picks for each published group,
# None where nothing fits (the 8B at 32k and 256k tokens on 8 GPUs: estimated 73.4 GiB with FSDP,
# published 83.9 and 84.5): the 8B groups give up speed or refuse for safety, the 405B one lands on
# the published layout where, trusting the estimate, it picked pp=4 at an estimated 88.2 GiB.
DEFAULT_HEADROOM_CHOICE = {
    "t1_fsdp": "dp_shard=8", "t2_fsdp8_cp1": "dp_shard=8", "t2_fsdp4_cp2": "dp_shard=4 cp=2",
    "t2_fsdp2_cp4": "dp_shard=2 cp=4", "t2_fsdp1_cp8": "dp_shard=1 cp=8", "t3_fsdp": "dp_shard=128",
    "t4_2d": "dp_shard=32 tp=4 pp=2", "t5_1f1b": "dp_shard=8 tp=8 pp=8",
}


def test_every_published_group_has_a_default_headroom_choice():
    assert [r["id"] for r in _groups()] == list(DEFAULT_HEADROOM_CHOICE)


@pytest.mark.parametrize("row", [pytest.param(r, id=r["id"]) for r in _groups()])
def test_auto_with_the_default_headroom_on_the_published_groups(row):
    from titan_hydra.planner import auto

    cfg = compose_cfg(_auto_overrides(row))
    expected = DEFAULT_HEADROOM_CHOICE[row["id"]]
    if expected is None:
        with pytest.raises(ConfigError, match=r"of which 79\.7 GiB usable \(cluster\.memory_headroom=0\.17\)"):
            resolved_spec(cfg)
        return
    resolved_spec(cfg)
    assert cfg.parallelism.name == "auto:" + expected.replace(" ", ",")
    assert plan(spec_of(cfg)).mem_total_gib <= DEVICE_GIB * (1 - ClusterConfig.memory_headroom)
