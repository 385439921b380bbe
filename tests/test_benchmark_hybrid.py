"""recipes/benchmark.py --suite hybrid on a tiny Qwen3.5 (in-process, a few seconds): the two
implementations compute the same function, the JSON holds what the tables print, and the
layer-pattern sweep covers the three patterns at nearly equal parameters."""

from __future__ import annotations

import json
import sys

import pytest

from helpers import REPO

TINY_QWEN35 = ["model.dim=64", "model.n_layers=4", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=32",
               "model.ffn_hidden_dim=128", "model.vocab_size=256", "model.linear_num_key_heads=2",
               "model.linear_num_value_heads=4", "model.linear_key_head_dim=16", "model.linear_value_head_dim=16",
               "model.linear_chunk_size=16"]


@pytest.fixture
def benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "recipes"))
    import benchmark

    return benchmark


def test_hybrid_suite_tiny_writes_json_and_tables(benchmark, monkeypatch, tmp_path, capsys):
    out = tmp_path / "hybrid.json"
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--suite", "hybrid", "--seqs", "32", "64", "--timed-steps", "1",
                                      "--steps", "0", "--batch", "1", "--seq-len", "32", f"--out={out}", *TINY_QWEN35])
    benchmark.main()
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    a, b = result["vs_transformers"], result["seq_sweep"]
    ours, theirs = a["tokens_per_s"]["titan_hydra"], a["tokens_per_s"]["transformers (torch fallback)"]
    assert a["speedup"] == pytest.approx(ours / theirs)
    # same config, weights and batch: the first losses agree (the twin is the same model)
    assert a["first_loss"]["titan_hydra"] == pytest.approx(a["first_loss"]["transformers (torch fallback)"], abs=1e-5)
    assert [r["seq"] for r in b["rows"]] == [32, 64]
    params = list(b["params"].values())
    assert len(params) == 3 and max(params) / min(params) < 1.05  # the pattern changes only the mixers
    assert result["loss"] == [] and "(c)" not in printed
    assert printed.startswith("suite `hybrid`")
    assert f"| {ours:,.0f} | {theirs:,.0f} | {a['speedup']:.2f}x |" in printed
    ratio = b["rows"][1]["tokens_per_s"]
    assert f"| 64 | {' | '.join(f'{v:,.0f}' for v in ratio.values())} |" in printed


def test_hybrid_loss_table_lists_each_pattern_and_a_failed_run():
    from titan_hydra.bench import hybrid as bench_hybrid

    result = {"vs_transformers": {"model": "m", "batch": 1, "seq": 8, "speedup": 2.0, "tokens_per_s": {"x": 2.0, "y": 1.0},
                                  "first_loss": {"x": 5.0, "y": 5.0}},
              "seq_sweep": {"model": "m", "params": {"full": 10, "linear": 11}, "rows": [
                  {"seq": 8, "tokens_per_s": {"full": 100.0, "linear": 150.0}}]},
              "loss_steps": 40, "loss": [
                  {"variant": "full", "val_loss": {20: 6.5, 40: 6.0}, "train_next_token_ce_last10": 5.9, "tokens_per_s": 900},
                  {"variant": "linear", "failed": "RuntimeError: boom"}]}
    lines = bench_hybrid.tables(result, "heading")
    assert "| 8 | 100 | 150 | 1.50x |" in lines
    assert "| pattern | val loss @20 | val loss @40 | train CE (last 10) | tok/s |" in lines
    assert "| full | 6.5000 | 6.0000 | 5.9000 | 900 |" in lines
    assert "| linear | failed: RuntimeError: boom |" in lines
