"""Tokens/s, achieved TFLOP/s and MFU per rank.

MFU needs a denominator: the device's dense peak. GPUs have a published number
(looked up by name); a CPU has none, so we measure one with a few large matmuls
and cache it (in-process and on disk) because it costs ~1 s and would otherwise
be paid by every run and every rank.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from titan_hydra.hardware import (bf16_capped_by_env, cpu_flags, cpu_has_native_bf16, cpu_model, isa_env_key,
                                  read_cache, write_cache)

log = logging.getLogger("titan_hydra")

# Dense (no 2:4 sparsity) bf16/fp16 tensor-core peaks in TFLOP/s, from vendor data sheets.
# Looked up by substring of torch.cuda.get_device_name(); longest key wins, so
# "H100 PCIe" beats "H100" and "H200" beats "H20".
PEAK_TFLOPS: dict[str, float] = {
    "B200": 2250.0,
    "GH200": 989.0,
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM ("NVIDIA H100 80GB HBM3")
    "H800": 989.0,
    "H20": 148.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "V100": 125.0,
}
# TF32 tensor-core peaks (used for fp32 when TF32 matmuls are allowed) and plain fp32 peaks.
PEAK_TFLOPS_TF32: dict[str, float] = {
    "B200": 1100.0, "GH200": 494.0, "H200": 494.0, "H100 PCIe": 378.0, "H100 NVL": 418.0,
    "H100": 494.0, "H800": 494.0, "A100": 156.0, "A800": 156.0, "L40S": 183.0, "L4": 60.0,
}
PEAK_TFLOPS_FP32: dict[str, float] = {
    "B200": 80.0, "GH200": 67.0, "H200": 67.0, "H100 PCIe": 51.0, "H100 NVL": 60.0,
    "H100": 67.0, "H800": 67.0, "A100": 19.5, "A800": 19.5, "L40S": 91.6, "L4": 30.3, "V100": 15.7,
}

CACHE_FILE = "cpu_peak.json"  # under hardware.cache_path
_PEAK_CACHE: dict[tuple[str, int], float] = {}  # (dtype, threads) -> TFLOP/s, this process


def _lookup(table: dict[str, float], name: str) -> float | None:
    for key in sorted(table, key=len, reverse=True):
        if key.lower() in name.lower():
            return table[key]
    return None


def device_peak_tflops(device: torch.device | str, dtype: torch.dtype = torch.bfloat16,
                       override: float | None = None, fresh: bool = False, refine: bool = False) -> float:
    """Dense peak TFLOP/s of one device for `dtype`; `override` (e.g. from config) wins."""
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        if dtype in (torch.bfloat16, torch.float16):
            table = PEAK_TFLOPS
        elif torch.backends.cuda.matmul.allow_tf32:
            table = PEAK_TFLOPS_TF32
        else:
            table = PEAK_TFLOPS_FP32
        peak = _lookup(table, name)
        if peak is not None:
            return peak
        log.warning("unknown GPU %r for MFU: measuring a matmul peak instead "
                    "(set an explicit peak to silence this)", name)
        return _time_matmul(device, dtype, 4096, 10)
    peak = measure_cpu_peak_tflops(dtype, fresh=fresh, refine=refine)
    if dtype in (torch.bfloat16, torch.float16):
        # A CPU without bf16 instructions (no AVX512-BF16/AMX) emulates bf16 matmuls ~100x
        # slower than fp32; its "bf16 peak" would make every run look >100% utilized. The
        # fastest dense matmul the machine offers is the honest denominator.
        peak = max(peak, measure_cpu_peak_tflops(torch.float32, fresh=fresh, refine=refine))
    return peak


def operands(size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two random [size, size] matrices from a generator of their own: a timing run only while
    the peak cache is young, and drawing from the global one would make a run's random streams
    (dropout, sampling) depend on the machine's cache (a resumed run's RNG state then differed)."""
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(size, size, device=device, generator=g) for _ in range(2))


def _time_matmul(device: torch.device, dtype: torch.dtype, size: int, reps: int,
                 budget_s: float = 1.0) -> float:
    """Best single-matmul TFLOP/s over up to `reps` timed runs after a warm-up.

    Best-of, not mean: shared/virtual CPUs see neighbours' load, and the best run is
    the closest to what the hardware can do. Stops early (after >= 2 timed runs)
    once `budget_s` is spent, since fp32 on a slow CPU takes ~0.1-0.3 s per matmul.
    """
    a, b = (t.to(dtype) for t in operands(size, device))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.mm(a, b)
    sync()
    best, start = float("inf"), time.perf_counter()
    for i in range(reps):
        t0 = time.perf_counter()
        torch.mm(a, b)
        sync()
        best = min(best, time.perf_counter() - t0)
        if i >= 1 and time.perf_counter() - start > budget_s:
            break
    return 2.0 * size**3 / best / 1e12


# Longest one timed matmul may take: a CPU that emulates bf16 would spend minutes on the full-size
# matmuls before the first step, so it is timed on a smaller matrix instead.
MATMUL_BUDGET_S = 1.0


def affordable_size(dtype: torch.dtype, size: int, budget_s: float = MATMUL_BUDGET_S) -> int:
    """The matrix size (a multiple of 64, 256..``size``) whose CPU matmul is projected to take at
    most ``budget_s``, from one timed 256^3 matmul. Fast CPUs get ``size`` itself."""
    small = 256
    if size <= small:
        return size
    a, b = (t.to(dtype) for t in operands(small, torch.device("cpu")))
    torch.mm(a, b)
    t0 = time.perf_counter()
    torch.mm(a, b)
    rate = 2.0 * small**3 / max(time.perf_counter() - t0, 1e-9)  # FLOP/s
    fit = int((budget_s * rate / 2.0) ** (1.0 / 3.0)) // 64 * 64
    return max(small, min(size, fit))


# A run re-measures the CPU peak (``refine=True``) until this many runs have measured it: the
# cache keeps the best value, so a measurement taken under load is outvoted, and later runs skip
# the timing.
TRUSTED_AFTER_RUNS = 3


def _cached_peak(entry: Any) -> tuple[float, int]:
    """(TFLOP/s, runs that measured it) of a cache entry; a bare number is one run's."""
    if isinstance(entry, dict) and isinstance(entry.get("tflops"), (int, float)):
        return float(entry["tflops"]), int(entry.get("runs", 1))
    if isinstance(entry, (int, float)):
        return float(entry), 1
    return 0.0, 0


def measure_cpu_peak_tflops(dtype: torch.dtype = torch.bfloat16, size: int = 2048,
                            reps: int = 10, fresh: bool = False, refine: bool = False) -> float:
    """Measured CPU matmul peak (TFLOP/s) with the current torch thread count.

    The disk cache keeps the best value ever measured: on a shared machine a measurement
    taken under load is too low and would inflate MFU. ``fresh=True`` measures again (and
    still returns the best known value); ``refine=True`` measures again only while fewer than
    ``TRUSTED_AFTER_RUNS`` runs have measured it.

    The number depends on the thread count (torchrun sets 1 per rank), so the key
    includes it; the disk key also includes the CPU model and torch version, which
    change the achievable peak (AMX/oneDNN paths).
    """
    threads = torch.get_num_threads()
    mem_key = (str(dtype), threads)
    if mem_key in _PEAK_CACHE and not fresh:
        return _PEAK_CACHE[mem_key]
    disk_key = f"{cpu_model()}{isa_env_key()}|threads={threads}|{dtype}|torch={torch.__version__}|size={size}"
    known, runs = _cached_peak(read_cache(CACHE_FILE).get(disk_key))
    if known > 0 and not fresh and not (refine and runs < TRUSTED_AFTER_RUNS):
        _PEAK_CACHE[mem_key] = known
        return known
    with torch.no_grad():
        peak = max(_time_matmul(torch.device("cpu"), dtype, affordable_size(dtype, size), reps), known)
    _PEAK_CACHE[mem_key] = peak
    write_cache(CACHE_FILE, disk_key, {"tflops": peak, "runs": runs + 1})
    return peak


# Emulated bf16 runs at a few percent of fp32's speed, native bf16 at about fp32's or faster: a
# ratio above this is load on shared cores, not emulation (the figures: docs/design.md).
EMULATED_BF16_RATIO = 0.25


def cpu_bf16_slower_than_fp32(cpuinfo: str = "/proc/cpuinfo") -> tuple[float, float] | None:
    """(bf16, fp32) matmul peaks if this CPU emulates bf16 matmuls, else None.

    True on CPUs without AVX512-BF16/AMX, where oneDNN emulates bf16 through fp32: bf16 training
    there is a large slowdown, not a speedup.
    A CPU whose flags name native bf16 never warns; otherwise the cached measurements decide, with
    a margin wide enough that a loaded machine's noisy timing is not mistaken for emulation.
    """
    capped = cpuinfo == "/proc/cpuinfo" and bf16_capped_by_env()  # this machine, oneDNN capped below bf16
    if cpu_has_native_bf16(cpu_flags(cpuinfo)) and not capped:
        return None
    bf16 = measure_cpu_peak_tflops(torch.bfloat16)
    fp32 = measure_cpu_peak_tflops(torch.float32)
    return (bf16, fp32) if bf16 < EMULATED_BF16_RATIO * fp32 else None


class ThroughputMeter:
    """Per-rank throughput over the window since the last report.

    Counts only what the caller says this rank processed, so numbers are per rank. The unit is
    the objective's (tokens: ``tps``; images: ``rate_key="ips"``); ``<rate_key>_global``
    (= rate * world_size) is added when world_size > 1, assuming ranks run in lock-step, which
    synchronous data-parallel training does.
    """

    def __init__(self, flops_per_unit: float, peak_tflops: float, world_size: int = 1, rate_key: str = "tps"):
        self.flops_per_unit = float(flops_per_unit)
        self.peak_tflops = float(peak_tflops)
        self.world_size = int(world_size)
        self.rate_key = rate_key
        self.reset()

    def reset(self) -> None:
        self._tokens = 0
        self._t0 = time.perf_counter()

    def update(self, tokens: int) -> None:
        self._tokens += int(tokens)

    def report(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = now - self._t0
        rate = self._tokens / elapsed if elapsed > 0 else 0.0
        tflops = rate * self.flops_per_unit / 1e12
        mfu = 100.0 * tflops / self.peak_tflops if self.peak_tflops > 0 else 0.0
        self._tokens, self._t0 = 0, now
        out = {self.rate_key: rate, "tflops": tflops, "mfu": mfu}
        if self.world_size > 1:
            out[f"{self.rate_key}_global"] = rate * self.world_size
        return out
