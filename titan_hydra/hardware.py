"""What this machine computes fast, and the precision ``auto`` settles on.

One rule for every place that picks a reduced dtype (training precision, Muon's Newton-Schulz
iterations, evaluation, generation, benchmarks): bf16 where the device multiplies bf16 natively,
fp32 elsewhere. A CPU without native bf16 (an AVX2-only x86 core) emulates bf16 matmuls through
fp32 at a small fraction of fp32's speed (the figures: docs/design.md), so "bf16 because GPUs
like it" makes such a machine many times slower for nothing.

Native bf16, by device:
* CUDA: ``torch.cuda.is_bf16_supported()`` (Ampere and later). With no GPU visible (planning a
  GPU run from a login node) bf16 is assumed: it is what every GPU this tool plans for has.
* x86 CPU: the ``avx512_bf16`` or ``amx_bf16`` flag in /proc/cpuinfo.
* Arm CPU: the ``bf16`` feature (BFMMLA, e.g. Graviton 3 and later).
* Unless oneDNN (which runs torch's CPU matmuls) is capped below its bf16 ISA by
  ``ONEDNN_MAX_CPU_ISA`` (e.g. ``AVX2``): then bf16 is emulated whatever the flags say, which is
  also how an AVX512-BF16 machine reproduces an AVX2-only one.

This module sits below everything else in the package (it imports only torch).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import re
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

log = logging.getLogger("titan_hydra")

# x86 feature flags of native bf16 matmuls (AVX512-BF16 dot products, AMX tiles); Arm's feature name.
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
ARM_BF16_FEATURE = "bf16"
PRECISIONS = ("auto", "bf16", "fp32")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA / its older name DNNL_MAX_CPU_ISA) that leave out bf16 dot products.
ONEDNN_CAPS_WITHOUT_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                                      "AVX512_CORE_VNNI"})


def cpuinfo_field(name: str, cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The first ``name : value`` line's value in /proc/cpuinfo (None where there is none)."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith(name) and ":" in line and line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str] | None:
    """The CPU's feature flags (x86 ``flags``, Arm ``Features``), or None where /proc/cpuinfo names none."""
    value = cpuinfo_field("flags", cpuinfo)
    if value is None:
        value = cpuinfo_field("Features", cpuinfo)
    return None if value is None else frozenset(value.split())


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    return cpuinfo_field("model name", cpuinfo) or platform.processor() or platform.machine() or "unknown-cpu"


def cpu_isa(flags: frozenset[str] | None = None) -> str:
    """The CPU's best matmul instruction set: what decides bf16 vs fp32 speed on a CPU."""
    flags = cpu_flags() if flags is None else flags
    for flag, name in (("amx_bf16", "AMX-BF16"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX-512"),
                       ("avx2", "AVX2"), (ARM_BF16_FEATURE, "Arm BF16"), ("asimd", "Arm NEON")):
        if flag in (flags or ()):
            return name
    return "unknown ISA" if not flags else "no AVX2"


def cpu_has_native_bf16(flags: frozenset[str] | None) -> bool:
    """Whether a CPU with these flags multiplies bf16 natively (x86 AVX512-BF16/AMX, Arm BF16)."""
    return bool(flags) and bool(flags & (NATIVE_BF16_FLAGS | {ARM_BF16_FEATURE}))


def onednn_isa_cap() -> str | None:
    """The ISA oneDNN is capped at by the environment, upper-cased (None where uncapped)."""
    value = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return value.strip().upper() if value else None


def bf16_capped_by_env() -> bool:
    """Whether ``ONEDNN_MAX_CPU_ISA`` leaves bf16 dot products out (bf16 is then emulated)."""
    return onednn_isa_cap() in ONEDNN_CAPS_WITHOUT_BF16


def isa_env_key() -> str:
    """The environment's ISA caps as a cache-key suffix: a capped run measures another machine."""
    caps = [f"{k}={os.environ[k]}" for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
            if os.environ.get(k)]
    return "|" + ",".join(caps) if caps else ""


def inductor_cache_for_isa() -> str | None:
    """Give inductor its own on-disk cache under an ``ATEN_CPU_CAPABILITY`` override; the new path
    (None where nothing changed).

    Why: inductor writes its generated C++ for the vector width that variable selects, but its
    FX-graph cache key does not include it, while each kernel is compiled for the width of the
    process that loads it. A graph cached by an ``ATEN_CPU_CAPABILITY=avx2`` run and loaded by an
    uncapped one on an AVX-512 machine stores 16-wide vectors where 8 were planned and writes
    past its buffers (heap corruption, seen as ``malloc(): unaligned tcache chunk`` aborts).
    A path the user set stays as it is."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    default = os.path.abspath(default_cache_dir())
    if not cap or (current is not None and os.path.abspath(current) != default):
        return None
    path = f"{default}_{re.sub(r'[^a-z0-9]+', '_', cap)}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    return path


class Resolved(NamedTuple):
    """A precision choice and the reason the run header prints beside it."""

    value: str  # "bf16" or "fp32"
    reason: str


def resolve_precision(requested: str, device_type: str, *, flags: frozenset[str] | None = None,
                      cuda_bf16: bool | None = None) -> Resolved:
    """``training.mixed_precision`` (auto | bf16 | fp32) for a run on ``device_type``.

    ``flags`` (CPU) and ``cuda_bf16`` (CUDA) default to this machine's; tests pass their own.
    """
    requested = str(requested)
    if requested not in PRECISIONS:
        raise ValueError(f"precision {requested!r} is not one of {', '.join(PRECISIONS)}")
    if requested != "auto":
        return Resolved(requested, "set explicitly")
    if device_type == "cuda":
        if cuda_bf16 is None:
            cuda_bf16 = _cuda_bf16()
        if cuda_bf16:
            return Resolved("bf16", "auto: this GPU computes bf16 natively")
        return Resolved("fp32", "auto: this GPU has no native bf16 (pre-Ampere)")
    if flags is None:
        flags = _this_cpu_flags()
        if bf16_capped_by_env() and cpu_has_native_bf16(flags):
            return Resolved("fp32", f"auto: oneDNN is capped below bf16 (ONEDNN_MAX_CPU_ISA={onednn_isa_cap()})")
    if cpu_has_native_bf16(flags):
        return Resolved("bf16", f"auto: this CPU has native bf16 matmuls ({cpu_isa(flags)})")
    return Resolved("fp32", "auto: this CPU has no native bf16 matmuls")


def precision_dtype(requested: str, device_type: str) -> torch.dtype:
    """The torch dtype ``resolve_precision`` settles on (bf16 -> torch.bfloat16, fp32 -> torch.float32)."""
    return torch.bfloat16 if resolve_precision(requested, device_type).value == "bf16" else torch.float32


@functools.lru_cache(maxsize=1)
def _this_cpu_flags() -> frozenset[str] | None:
    return cpu_flags()


def _cuda_bf16() -> bool:
    if not torch.cuda.is_available():
        return True  # planning for GPUs from a machine without one: every GPU it plans for has bf16
    return bool(torch.cuda.is_bf16_supported())


# ----------------------------------------------------------------------------- measurement cache
# Measurements of this machine (matmul peaks, kernel timings) cost seconds; they are kept in one
# JSON file per kind under ~/.cache/titan_hydra (TITAN_HYDRA_CACHE_DIR redirects it: tests,
# read-only homes), keyed by what changes the number (CPU model, threads, torch version, shape).


def cache_path(name: str) -> Path:
    root = os.environ.get("TITAN_HYDRA_CACHE_DIR") or Path.home() / ".cache" / "titan_hydra"
    return Path(root) / name


def read_cache(name: str) -> dict[str, Any]:
    try:
        cached = json.loads(cache_path(name).read_text())
    except (OSError, ValueError):
        return {}
    return cached if isinstance(cached, dict) else {}


def write_cache(name: str, key: str, value: Any) -> None:
    """Store one entry; best effort: a read-only or racing cache must never fail a run."""
    path = cache_path(name)
    try:
        cached = read_cache(name)
        cached[key] = value
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cached, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError as e:
        log.debug("could not write %s: %s", path, e)
