"""Metrics: throughput math, peaks, memory, and every backend read back from disk."""

from __future__ import annotations

import json
import time
import os

import pytest
import torch

from helpers import read_metrics
from titan_hydra.metrics import throughput as tp
from titan_hydra.logger.backends import ConsoleBackend, JsonlBackend, TensorBoardBackend
from titan_hydra.logger.metric_logger import MetricLogger
from titan_hydra.metrics.memory import MemoryMonitor
from titan_hydra.logger.wandb_reader import find_wandb_files, read_offline_run

CONFIG = {"model": {"dim": 256, "layers": [1, 2, 3]}, "optimizer": {"lr": 3e-4}, "seed": 7}
ROWS = [(1, {"loss": 6.5, "lr": 1e-4}), (2, {"loss": 5.25, "lr": 2e-4}),
        (3, {"loss": 4.125, "lr": 3e-4, "val/loss": 4.5})]


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_HYDRA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tp, "_PEAK_CACHE", {})
    return tmp_path / "cache"


def test_throughput_meter_exact(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(tp.time, "perf_counter", lambda: now[0])
    m = tp.ThroughputMeter(flops_per_unit=6e9, peak_tflops=100.0, world_size=1)
    m.update(1000)
    m.update(1000)
    now[0] = 102.0
    r = m.report()
    assert r["tps"] == pytest.approx(1000.0)
    assert r["tflops"] == pytest.approx(6.0)
    assert r["mfu"] == pytest.approx(6.0)
    assert "tps_global" not in r
    # The window restarted at the report.
    m.update(500)
    now[0] = 103.0
    assert m.report()["tps"] == pytest.approx(500.0)
    # reset() restarts the window and forgets counted tokens.
    m.update(10_000)
    now[0] = 110.0
    m.reset()
    m.update(400)
    now[0] = 112.0
    assert m.report()["tps"] == pytest.approx(200.0)


def test_throughput_meter_global_and_zero_window(monkeypatch):
    monkeypatch.setattr(tp.time, "perf_counter", lambda: 5.0)
    m = tp.ThroughputMeter(flops_per_unit=1.0, peak_tflops=1.0, world_size=4)
    m.update(10)
    r = m.report()  # zero elapsed time must not divide by zero
    assert r["tps"] == 0.0 and r["mfu"] == 0.0 and r["tps_global"] == 0.0


def test_peak_override_and_cuda_lookup(monkeypatch):
    assert tp.device_peak_tflops(torch.device("cpu"), override=123.0) == 123.0
    names = {"NVIDIA H100 80GB HBM3": 989.0, "NVIDIA H100 PCIe": 756.0,
             "NVIDIA H200": 989.0, "NVIDIA A100-SXM4-80GB": 312.0}
    for name, peak in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None, n=name: n)
        assert tp.device_peak_tflops(torch.device("cuda", 0)) == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA A100-SXM4-80GB")
    # cuBLASModule proxies a C++ flag (monkeypatch cannot undo it): restore by hand.
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        assert tp.device_peak_tflops(torch.device("cuda", 0), dtype=torch.float32) == 156.0
        torch.backends.cuda.matmul.allow_tf32 = False
        assert tp.device_peak_tflops(torch.device("cuda", 0), dtype=torch.float32) == 19.5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def test_cpu_peak_measured_then_cached(cache_dir, monkeypatch):
    calls = []
    real = tp._time_matmul
    monkeypatch.setattr(tp, "_time_matmul", lambda *a, **k: calls.append(a) or real(*a, **k))
    peak = tp.measure_cpu_peak_tflops(torch.bfloat16)
    assert peak > 0 and len(calls) == 1
    assert (cache_dir / "cpu_peak.json").exists()
    assert tp.measure_cpu_peak_tflops(torch.bfloat16) == peak  # in-process cache
    tp._PEAK_CACHE.clear()  # as a fresh process would start
    assert tp.measure_cpu_peak_tflops(torch.bfloat16) == peak  # from disk
    assert len(calls) == 1
    stored = json.loads((cache_dir / "cpu_peak.json").read_text())
    (key,) = stored
    assert f"threads={torch.get_num_threads()}" in key and "bfloat16" in key


def test_cpu_peak_refined_by_the_first_runs_then_trusted(cache_dir, monkeypatch):
    """A run re-measures (refine=True) until TRUSTED_AFTER_RUNS runs have; the cache keeps the best
    value (a loaded first measurement is outvoted), and later runs do not time anything."""
    timings = iter([0.05, 0.09, 0.07, 0.01])
    calls = []
    monkeypatch.setattr(tp, "_time_matmul", lambda *a, **k: calls.append(a) or next(timings))
    got = []
    for _ in range(tp.TRUSTED_AFTER_RUNS + 2):
        tp._PEAK_CACHE.clear()  # each pass is a new run
        got.append(tp.measure_cpu_peak_tflops(torch.float32, refine=True))
    assert len(calls) == tp.TRUSTED_AFTER_RUNS == 3
    assert got == [0.05, 0.09, 0.09, 0.09, 0.09]
    (entry,) = json.loads((cache_dir / "cpu_peak.json").read_text()).values()
    assert entry == {"tflops": 0.09, "runs": 3}


def test_cpu_bf16_peak_never_below_fp32(cache_dir, monkeypatch):
    """A CPU without bf16 instructions: the MFU denominator is its (faster) fp32 peak."""
    fake = {torch.bfloat16: 0.001, torch.float32: 0.15}
    monkeypatch.setattr(tp, "_time_matmul", lambda device, dtype, *a, **k: fake[dtype])
    assert tp.device_peak_tflops(torch.device("cpu"), torch.bfloat16) == 0.15
    assert tp.device_peak_tflops(torch.device("cpu"), torch.float32) == 0.15
    tp._PEAK_CACHE.clear()
    fake[torch.bfloat16] = 0.9  # AMX / AVX512-BF16: bf16 is the peak
    assert tp.device_peak_tflops(torch.device("cpu"), torch.bfloat16, fresh=True) == 0.9


def test_memory_monitor_cpu():
    mon = MemoryMonitor(torch.device("cpu"))
    before = mon.report()
    assert before["memory_current_gib"] > 0 and 0 < before["memory_peak_pct"] < 100
    x = torch.ones(50 * 1024 * 1024, dtype=torch.float32)  # 200 MiB, written (touched)
    after = mon.report()
    assert after["memory_peak_gib"] - before["memory_peak_gib"] >= 0.15
    del x
    if not mon.peak_reset_supported:
        pytest.skip("/proc/self/clear_refs not writable here: peak cannot be reset")
    mon.reset_peak()
    reset = mon.report()
    assert reset["memory_peak_gib"] < after["memory_peak_gib"] - 0.1


def test_jsonl_backend(tmp_path):
    b = JsonlBackend(tmp_path)
    for step, m in ROWS:
        b.log(m, step)
    b.close()
    b.close()
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r, (_, m) in zip(rows, ROWS):
        assert {k: r[k] for k in m} == m and r["time"] > 1e9


def test_tensorboard_backend(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    b = TensorBoardBackend(tmp_path)
    b.log_config(CONFIG)
    for step, m in ROWS:
        b.log(m, step)
    b.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert "val/loss" in acc.Tags()["scalars"]
    loss = [(e.step, e.value) for e in acc.Scalars("loss")]
    assert loss == [(s, pytest.approx(m["loss"])) for s, m in ROWS]
    assert [(e.step, e.value) for e in acc.Scalars("val/loss")] == [(3, 4.5)]


def test_console_backend(capsys):
    b = ConsoleBackend(None)
    b.log({"loss": 6.12344, "grad_norm": 1.234, "lr": 3e-4, "tps": 6512.3, "tflops": 0.421,
           "mfu": 12.34, "memory_peak_gib": 1.214, "data_time": 0.0003, "val/loss": 5.5}, 10)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("step    10 | loss 6.1234 | grad_norm 1.23 | lr 3.0e-04 | tps 6,512 | "
                      "tflops 0.421 | mfu 12.3% | mem 1.21GiB | data 0.3ms")
    assert out[1] == "val     10 | loss 5.5000"


def _wandb_logger(run_dir):
    spec = {"_target_": "titan_hydra.logger.backends.WandbBackend",
            "project": "test", "mode": "offline", "group": "g1", "tags": ["a", "b"]}
    return MetricLogger(run_dir, rank=0, backends={"wandb": spec, "jsonl": None},
                        config=CONFIG)


@pytest.mark.slow
def test_wandb_offline_roundtrip(tmp_path):
    with _wandb_logger(tmp_path) as ml:
        for step, m in ROWS:
            ml.log({**m, "loss": torch.tensor(m["loss"])}, step)
    assert not (tmp_path / "metrics.jsonl").exists()  # None disables a backend
    run = read_offline_run(tmp_path)
    assert run["config"] == CONFIG
    assert run["run"]["group"] == "g1" and run["run"]["tags"] == ["a", "b"]
    assert run["exit_code"] == 0
    hist = run["history"]
    assert [h["_step"] for h in hist] == [1, 2, 3]
    assert [h["loss"] for h in hist] == [m["loss"] for _, m in ROWS]
    assert hist[2]["val/loss"] == 4.5 and run["summary"]["loss"] == 4.125


@pytest.mark.slow
def test_wandb_sequential_runs_are_distinct(tmp_path):
    for i in range(2):
        ml = _wandb_logger(tmp_path)
        ml.log({"loss": float(i)}, 1)
        ml.close()
        ml.close()  # idempotent
    files = find_wandb_files(tmp_path)
    assert len(files) == 2 and files[0].parent != files[1].parent
    # wandb's service process may still be flushing the last run's file under heavy load.
    deadline = time.time() + 20
    while time.time() < deadline and not all(read_offline_run(f)["history"] for f in files):
        time.sleep(0.2)
    losses = sorted(read_offline_run(f)["history"][0]["loss"] for f in files)
    assert losses == [0, 1]


def test_pictures_reach_every_backend(tmp_path, capsys):
    """One call: a PNG row under <run>/samples/, the pictures in TensorBoard and W&B, the PNG's path
    on the console and in metrics.jsonl."""
    import numpy as np
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(3, 16, 12, 3), dtype=np.uint8)
    backends = {"console": {"_target_": "titan_hydra.logger.backends.ConsoleBackend"},
                "jsonl": {"_target_": "titan_hydra.logger.backends.JsonlBackend"},
                "tensorboard": {"_target_": "titan_hydra.logger.backends.TensorBoardBackend"},
                "wandb": {"_target_": "titan_hydra.logger.backends.WandbBackend", "project": "test", "mode": "offline"}}
    with MetricLogger(tmp_path, rank=0, backends=backends) as ml:
        path = ml.log_images("samples", images, 5, ["a", "b", "c"])
    assert path == tmp_path / "samples" / "samples-step000005.png"
    with Image.open(path) as grid:
        assert grid.size == (3 * 12, 16)
        assert np.array_equal(np.asarray(grid)[:, 12:24], images[1])  # laid out in order, exactly
    assert f"samples {path}" in capsys.readouterr().out
    (logged,) = read_metrics(tmp_path)
    assert logged["step"] == 5 and logged["samples"] == str(path)
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"images": 0})
    acc.Reload()
    (event,) = acc.Images("samples")
    assert event.step == 5 and (event.width, event.height) == (3 * 12, 16)  # TensorBoard tiles the batch
    (row,) = read_offline_run(tmp_path)["history"]
    assert row["_step"] == 5 and row["samples/_type"] == "images/separated" and row["samples/count"] == 3
    assert row["samples/captions"] == ["a", "b", "c"] and (row["samples/width"], row["samples/height"]) == (12, 16)
    with MetricLogger(tmp_path, rank=1, backends=backends) as other:  # only rank 0 logs
        assert other.log_images("samples", images, 6) is None


def test_logger_builds_from_hydra_config_and_closes_all(tmp_path):
    from omegaconf import OmegaConf

    class Broken:
        closed = False

        def log(self, metrics, step):
            raise RuntimeError("disk full")

        def close(self):
            Broken.closed = True
            raise RuntimeError("still broken")

    backends = OmegaConf.create({
        "jsonl": {"_target_": "titan_hydra.logger.backends.JsonlBackend"},
        "tensorboard": {"_target_": "titan_hydra.logger.backends.TensorBoardBackend"},
    })
    ml = MetricLogger(tmp_path, 0, {**backends, "broken": Broken()}, OmegaConf.create(CONFIG))
    ml.log({"loss": 1.5}, 1)  # the broken backend is dropped, the others keep logging
    assert "broken" not in ml.backends and Broken.closed
    ml.log({"loss": 1.25}, 2)
    ml.close()
    assert [r["loss"] for r in read_metrics(tmp_path)] == [1.5, 1.25]
    assert any((tmp_path / "tb").iterdir())


def test_logger_nonzero_rank_creates_nothing(tmp_path):
    backends = {"jsonl": {"_target_": "titan_hydra.logger.backends.JsonlBackend"},
                "wandb": {"_target_": "titan_hydra.logger.backends.WandbBackend"},
                "tensorboard": {"_target_": "titan_hydra.logger.backends.TensorBoardBackend"}}
    with MetricLogger(tmp_path / "run", rank=1, backends=backends, config=CONFIG) as ml:
        ml.log({"loss": 1.0}, 1)
    assert not (tmp_path / "run").exists() and os.listdir(tmp_path) == []


def test_cpu_bf16_slower_than_fp32_detects_emulated_bf16(cache_dir, monkeypatch, tmp_path):
    avx2 = tmp_path / "cpuinfo_avx2"
    avx2.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\n")
    fake = {torch.bfloat16: 0.001, torch.float32: 0.14}  # an AVX2-only CPU, as measured on one
    monkeypatch.setattr(tp, "_time_matmul", lambda device, dtype, *a, **k: fake[dtype])
    assert tp.cpu_bf16_slower_than_fp32(str(avx2)) == (0.001, 0.14)
    tp._PEAK_CACHE.clear()
    fake[torch.bfloat16] = 0.9
    assert tp.measure_cpu_peak_tflops(torch.bfloat16, fresh=True) == 0.9
    assert tp.cpu_bf16_slower_than_fp32(str(avx2)) is None


def test_cpu_bf16_warning_is_not_fooled_by_load(cache_dir, monkeypatch, tmp_path):
    """Seen once in CI: an AVX512-BF16 EPYC under load timed bf16 at half of fp32 (0.083 vs 0.166)
    and warned that bf16 is emulated. Native flags settle it; without flags only a wide gap warns."""
    native = tmp_path / "cpuinfo_bf16"
    native.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n")
    fake = {torch.bfloat16: 0.001, torch.float32: 0.14}
    monkeypatch.setattr(tp, "_time_matmul", lambda device, dtype, *a, **k: fake[dtype])
    assert tp.cpu_bf16_slower_than_fp32(str(native)) is None  # flags win over any timing
    assert tp.cpu_flags(str(tmp_path / "missing")) is None
    tp._PEAK_CACHE.clear()
    fake[torch.bfloat16] = 0.083
    fake[torch.float32] = 0.166
    assert tp.cpu_bf16_slower_than_fp32(str(tmp_path / "missing")) is None  # 0.5x: load, not emulation


def test_peak_is_timed_on_a_matrix_the_cpu_can_afford():
    """A CPU that emulates bf16 spent ~1 minute per 2048^3 matmul, three times at every bf16 run's
    start; the timed size shrinks to what one second buys and stays 2048 where it is cheap."""
    assert tp.affordable_size(torch.float32, 2048, budget_s=1e9) == 2048
    assert tp.affordable_size(torch.float32, 2048, budget_s=1e-9) == 256
    mid = tp.affordable_size(torch.float32, 4096, budget_s=0.01)
    assert 256 <= mid < 4096 and mid % 64 == 0
    assert tp.affordable_size(torch.float32, 128) == 128


def test_peak_measurement_leaves_the_global_rng_alone():
    """The peak is timed only while the cache is young: drawing its matrices from the global
    generator made a run's random streams depend on the machine's cache (a requeued run's RNG
    state at step 10 differed from a clean run's)."""
    torch.manual_seed(3)
    before = torch.get_rng_state()
    tp._time_matmul(torch.device("cpu"), torch.float32, 64, 2)
    assert tp.affordable_size(torch.float32, 512, budget_s=1e-9) == 256
    assert torch.equal(torch.get_rng_state(), before)
