"""The GPU side by side (scripts/gpu_side_by_side/) without a GPU or torchtitan: both sides get the
same shapes, sequence, batch and steps; titan_hydra's overrides compose into torchtitan's "1B"
and fit an 80 GB H100 by the planner; the wheel steps are network-free where they must be; the
logs parse into the numbers of the table; the time budget cuts whole pairs."""

from __future__ import annotations

import ast
import importlib.util
import json
import shutil
import sys
from types import SimpleNamespace

import pytest
from helpers import REPO, compose_cfg

from titan_hydra.planner.plan import plan
from titan_hydra.spec import spec_of
from titan_hydra.validate import validate

HERE = REPO / "scripts" / "gpu_side_by_side"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_side_by_side_run", HERE / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


sbs = _load()
GPU = sbs.Settings()


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def _override(argv, key):
    return [a.split("=", 1)[1] for a in argv if a.startswith(key + "=")][-1]


def _tt_config_functions() -> set[str]:
    tree = ast.parse((HERE / "tt_gpu_configs.py").read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}


@pytest.mark.parametrize("case", sbs.GPU_CASES + sbs.CPU_CASES, ids=lambda c: c.name)
def test_both_sides_get_the_same_shapes_sequence_batch_and_steps(case, tmp_path):
    s = GPU if case in sbs.GPU_CASES else sbs.settings_of(SimpleNamespace(cpu=True, **dict.fromkeys(
        ("seq_len", "batch", "steps", "skip", "rounds", "budget_s", "timeout_s"))))
    cmds = sbs.commands(case, s, tmp_path, "r1", "th-python", "tt-python", tmp_path / "site")
    tt, tt_env, tt_cwd, _ = cmds["torchtitan"]
    th, th_env, th_cwd, th_dir = cmds["titan_hydra"]
    assert _flag(tt, "--training.seq_len") == _override(th, "training.seq_len") == str(s.seq_len)
    assert _flag(tt, "--training.local_batch_size") == _override(th, "training.local_batch_size") == str(s.batch)
    assert _flag(tt, "--training.steps") == _override(th, "training.steps") == str(s.steps)
    assert "--nproc_per_node=1" in tt and "cluster.nproc_per_node=2" not in th
    assert _flag(tt, "--config") == case.tt_config and case.tt_config in _tt_config_functions()
    assert tt[:3] == ["tt-python", "-m", "torch.distributed.run"] and th[0] == "th-python"
    assert tt_env["TT_SHIM_DEVICE"] == ("cuda" if s.gpu else "cpu")
    assert tt_env["PYTHONPATH"].split(":")[0] == str(tmp_path / "site" / "torchtitan")
    assert th_env["PYTHONPATH"].split(":")[0] == str(tmp_path / "site" / "titan_hydra")
    assert tt_cwd == tmp_path / "run" and th_cwd == REPO and _override(th, "hydra.run.dir") == str(th_dir)
    assert _override(th, "optimizer.lr") == "0.0008" and "compile=model_loss" in th
    assert ("float8=rowwise" in th) == ("float8" in case.tt_config)
    if s.gpu:
        assert (s.seq_len, s.batch) == (2048, 4) and "cluster=local_gpu" in th and "model=llama3_1b" in th


@pytest.mark.parametrize("case", sbs.GPU_CASES, ids=lambda c: c.name)
def test_titan_hydra_side_is_torchtitans_1b_and_fits_an_h100(case, tmp_path):
    """torchtitan 0.3.0's "1B": dim 2048, 16 layers, 32 / 8 heads, FFN 8192, vocab 128,256, tied,
    RoPE scaling factor 8; valid for a dry run and inside the planner's usable 80 GB."""
    (tmp_path / "c4_test").mkdir()
    (tmp_path / "c4_test" / "data.json").write_text(json.dumps({"text": "a side by side"}) + "\n")
    shutil.copytree(REPO / "tests" / "data" / "torchtitan_test_tokenizer", tmp_path / "tokenizer")
    argv, _ = sbs.th_command(case, GPU, "python", None, tmp_path, tmp_path / "run")
    overrides = [a for a in argv[2:] if not a.startswith("hydra.")]
    cfg = compose_cfg([*overrides, "cluster.gpu_mem_gib=80", "dry_run=true"])
    m = cfg.model
    assert (m.dim, m.n_layers, m.n_heads, m.n_kv_heads, m.vocab_size) == (2048, 16, 32, 8, 128256)
    assert m.tie_word_embeddings and m.rope_scaling and m.rope_scaling_factor == 8.0
    spec = validate(cfg, environment=False)
    p = plan(spec_of(cfg))
    assert p.params == 1_235_814_400 and spec.shape.ffn_dim == 8192
    assert p.fits and p.mem_total_gib < p.usable_memory_gib < 80.0


def test_pins_are_exact_and_the_wheel_steps_are_network_free_where_they_must_be(tmp_path):
    pins = {side: sbs.read_pins(path) for side, path in sbs.PINS.items()}
    assert "torchtitan==0.3.0" in pins["torchtitan"] and "hydra-core==1.3.8" in pins["titan_hydra"]
    assert all("==" in p for side in pins.values() for p in side)
    assert "datasets==4.7.0" in pins["torchtitan"]  # torchtitan 0.3.0: datasets<4.8 (titan_hydra pins 5.2.0)
    download = sbs.download_commands(tmp_path / "w", "3.12")
    assert download[0][3:6] == ["download", "--no-deps", "--only-binary=:all:"]
    assert _flag(download[0], "--python-version") == "3.12" and "antlr4-python3-runtime==4.9.3" not in download[0]
    assert download[1][3:] == ["wheel", "--no-deps", "-w", str(tmp_path / "w"), "antlr4-python3-runtime==4.9.3"]
    every = {p for side in pins.values() for p in side}
    assert set(download[0][download[0].index(str(tmp_path / "w")) + 1:]) | {"antlr4-python3-runtime==4.9.3"} == every
    for side, cmd in sbs.install_commands("py", tmp_path / "w", tmp_path / "site").items():
        assert {"--no-index", "--no-deps"} <= set(cmd) and _flag(cmd, "--target") == str(tmp_path / "site" / side)
        assert _flag(cmd, "-r") == str(sbs.PINS[side])


def _tt_log(steps: int, tps, mfu="38.42%") -> str:
    esc = "\x1b[3{}m"
    lines = ["[rank0]:[titan] 2026-11-27 - root - INFO - Model llama3 1B size: 1,235,814,400 total parameters",
             "[rank0]:tt_cpu_shim: FSDP mixed precision: param_dtype=bfloat16 reduce_dtype=float32",
             "[rank0]:[titan] 2026-11-27 - root - INFO - Compiling each TransformerBlock with torch.compile"]
    for k in range(1, steps + 1):
        lines.append(f"[rank0]:[titan] 2026-11-27 - root - INFO - {esc.format(1)}step: {k:2}  {esc.format(2)}loss: "
                     f"{8 - k / 10:8.5f}  grad_norm:  1.3375  {esc.format(6)}memory: {30 + k / 10:5.2f}GiB(37.50%)  "
                     f"{esc.format(4)}tps: {tps(k):,}  {esc.format(6)}tflops: {tps(k) * 8.2e9 / 1e12:,.2f}  "
                     f"{esc.format(5)}mfu: {mfu}\x1b[39m")
    return "\n".join(lines) + "\n"


def _th_run(run_dir, steps: int, tps) -> str:
    run_dir.mkdir(parents=True)
    rows = [{"step": k, "loss": 8 - k / 10, "tps": tps(k), "tflops": tps(k) * 8.4e9 / 1e12, "mfu": tps(k) * 8.4e9 / 989e10,
             "memory": 20.0, "memory_peak_gib": 20.0 + k / 100, "memory_reserved_gib": 24.0 + k / 100} for k in range(1, steps + 1)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return ("  model      llama3_1b (llama3): 1,235,814,400 parameters\n  precision  bf16 (given): bf16 autocast, fp32 "
            "params\n  attention  sdpa\n  features   activation checkpointing none, compile model_loss, float8 none\n")


def test_logs_parse_into_the_numbers_of_the_table(tmp_path):
    """12 steps, the first 10 left out: medians of steps 11-12, memory the largest of any step."""
    tt = sbs.run_summary("torchtitan", _tt_log(12, lambda k: 40_000 + k), tmp_path / "tt", skip=10)
    assert [r["step"] for r in tt["steps"]] == list(range(1, 13))
    assert tt["tps"] == 40_011.5 and tt["mfu"] == 38.42 and tt["memory_gib"] == 31.2
    assert tt["tflops"] == pytest.approx(328.09, abs=0.01)
    assert tt["settings"]["params"] == 1_235_814_400 and tt["settings"]["compile"] == "blocks"
    assert tt["settings"]["precision"].startswith("params/compute bfloat16, grad reduce float32")
    text = _th_run(tmp_path / "th", 12, lambda k: 50_000 + 2 * k)
    th = sbs.run_summary("titan_hydra", text, tmp_path / "th", skip=10)
    assert th["tps"] == 50_023 and th["memory_gib"] == pytest.approx(24.12)  # the reserved peak, as torchtitan's
    assert th["settings"] == {"params": 1_235_814_400, "precision": "bf16 (given): bf16 autocast, fp32 params",
                              "features": "activation checkpointing none, compile model_loss, float8 none",
                              "attention": "sdpa"}
    f8 = sbs.run_summary("torchtitan", _tt_log(12, lambda k: 50_000, mfu="N/A"), tmp_path / "f8", skip=10)
    assert f8["mfu"] is None and f8["tps"] == 50_000  # torchtitan skips MFU under float8


def test_rounds_become_one_row_with_the_ratio_and_one_peak(tmp_path):
    def pair(k, tt_tps, th_tps):
        return {"round": k,
                "torchtitan": {**sbs.run_summary("torchtitan", _tt_log(12, lambda _: tt_tps), tmp_path / "x", 10), "ok": True},
                "titan_hydra": {**sbs.run_summary("titan_hydra", _th_run(tmp_path / f"th{k}", 12, lambda _: th_tps),
                                                  tmp_path / f"th{k}", 10), "ok": True}}

    failed = pair(3, 40_000, 1)
    failed["titan_hydra"] = {**failed["titan_hydra"], "ok": False, "error": "exit 1: CUDA out of memory"}
    row = sbs.row_summary("c", "C", [pair(1, 40_000, 48_000), pair(2, 40_000, 52_000), failed])
    assert row["rounds"] == 3 and row["rounds_ok"] == 2
    assert row["ratio"] == 1.25 and row["ratio_range"] == [1.2, 1.3]
    assert row["torchtitan"]["tps"] == 40_000 and row["titan_hydra"]["tps"] == 50_000
    assert row["bf16_peak_tflops"] == 989.0  # titan_hydra's TFLOP/s over its MFU
    assert row["titan_hydra"]["mfu_at_bf16_peak"] == pytest.approx(100 * 50_000 * 8.4e9 / 989e12, abs=0.01)
    assert row["torchtitan"]["mfu_at_bf16_peak"] == pytest.approx(100 * 40_000 * 8.2e9 / 989e12, abs=0.01)
    assert row["errors"] == ["round 3 titan_hydra: exit 1: CUDA out of memory"]
    table = sbs.table([row])
    assert "| C | 40,000 | 50,000 | **1.25** (1.20-1.30) | 38.4 / 42.5 | 33.2 / 42.5 | 31.20 / 24.12 | 2/3 |" in table


def test_the_budget_cuts_whole_pairs_and_the_order_flips(monkeypatch, tmp_path):
    """Three 100 s pairs fit 420 s after a 150 s first guess; the fourth would end past it."""
    clock = {"t": 0.0}

    def fake_run(system, argv, env, cwd, run_dir, timeout, skip):
        clock["t"] += 50
        return {"ok": True, "tps": 1.0, "wall_s": 50, "log": str(run_dir) + ".log", "timeout": timeout}

    monkeypatch.setattr(sbs, "run_one", fake_run)
    monkeypatch.setattr(sbs, "time", SimpleNamespace(time=lambda: clock["t"]))
    results, skipped = sbs.run_pairs(sbs.GPU_CASES, GPU, tmp_path, "py", "py", None, start=0.0)
    bf16, f8 = (results[c.name] for c in sbs.GPU_CASES)
    assert [p["round"] for p in bf16] == [1, 2] and [p["round"] for p in f8] == [1]
    assert [p["order"][0] for p in (bf16[0], f8[0], bf16[1])] == ["torchtitan", "titan_hydra", "torchtitan"]
    assert skipped == ["llama3_1b_float8_compile round 2: 300 s + 150 s > budget 420 s"]
    assert bf16[0]["torchtitan"]["timeout"] == GPU.timeout_s  # never past budget + 60 s
