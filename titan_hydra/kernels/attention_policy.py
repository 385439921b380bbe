"""Attention kernel policy: which implementation runs the plain causal attention call.

``training.attention_kernel``:

* ``auto`` (default): the hand-written small-head kernel (``titan_hydra/kernels``) on CPU where
  every attention module has 16-wide heads, context parallelism is off, AND it is faster than
  SDPA on this CPU; SDPA everywhere else. Which one is faster depends on the CPU, not on the
  model: on the AVX-512 Xeons and EPYCs the kernel was written on it is 1.3-2.3x SDPA, on an
  AVX2-only EPYC 2-5x slower. So ``auto`` times both once (forward + backward of one sequence at
  the run's heads, length and dtype; ~0.1-1 s), keeps the result in the machine's measurement
  cache (``titan_hydra.hardware``), and rank 0's answer is broadcast so every rank runs the
  same kernel. The kernel is compiled (once per machine, ~45 s) only to time it or to run it: a
  shape whose cached answer is SDPA starts without touching the extension. If the kernel cannot
  be built here (no C++ compiler), ``auto`` logs one line and uses SDPA.
* ``sdpa``: always ``F.scaled_dot_product_attention`` (torch's fused kernels).
* ``small_head``: require the kernel; a configuration it cannot serve is refused with one line
  before the model is built any further.

Why a policy and not a model option: which kernel is fastest depends on the device and the head
width, not on the architecture, so the model only exposes a hook (``Attention.causal_kernel``)
and this module fills it from outside, as ``precision.py`` does for the attention dtype. Calls
with a window, chunk, sinks, document mask or KV cache keep their SDPA path; the kernel computes
in fp32 whatever its inputs (bf16 q/k/v are widened on the way in, the output narrowed back).
Context parallel attention shards the sequence across ranks through SDPA's ring handlers, so
``cp > 1`` keeps SDPA.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from titan_hydra.errors import ConfigError
from titan_hydra.hardware import cpu_isa, cpu_model, isa_env_key, read_cache, write_cache
from titan_hydra.kernels.small_head_attention import HEAD_DIM, KernelUnavailable, causal_attention, warm_up

log = logging.getLogger("titan_hydra")

KERNEL_NAME = "small_head"
CACHE_FILE = "attention_kernel.json"  # under hardware.cache_path
PROBE_REPS = 5


class KernelChoice(NamedTuple):
    """The kernel that runs plain causal attention, and why (the run header prints both)."""

    name: str  # "sdpa" or "small_head"
    reason: str


# (heads, seq_len, dtype) -> seconds of one forward + backward per kernel name
Probe = Callable[[int, int, torch.dtype], dict]


def _attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if hasattr(m, "causal_kernel") and hasattr(m, "head_dim")]


def why_not(model: torch.nn.Module, device: torch.device, cp: int) -> str | None:
    """Why the small-head kernel cannot serve this model and layout (None: it can)."""
    modules = _attention_modules(model)
    if device.type != "cpu":
        return f"it is a CPU kernel and this run is on {device.type}"
    if cp > 1:
        return "context parallel attention (cp > 1) runs through SDPA's ring handlers"
    if not modules:
        return "the model has no attention module with a causal_kernel hook"
    widths = sorted({int(m.head_dim) for m in modules})
    if widths != [HEAD_DIM]:
        return f"it computes {HEAD_DIM}-wide heads and this model's are {widths}"
    return None


def _heads(module: torch.nn.Module) -> int:
    """Query heads of an attention module (its query projection's width over the head width)."""
    wq = getattr(module, "wq", None)
    return int(wq.out_features) // int(module.head_dim) if hasattr(wq, "out_features") else 8


def _time_kernels(heads: int, seq_len: int, dtype: torch.dtype) -> dict[str, float]:
    """Best-of seconds of one causal forward + backward of a [1, heads, seq_len, 16] call, each kernel."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq_len, HEAD_DIM, generator=g).to(dtype).requires_grad_() for _ in range(3))
    grad = torch.randn(1, heads, seq_len, HEAD_DIM, generator=g).to(dtype)
    kernels = {"sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
               KERNEL_NAME: lambda: causal_attention(q, k, v)}
    best = {name: float("inf") for name in kernels}
    for rep in range(PROBE_REPS + 1):  # alternated, so a burst of load hits both; rep 0 warms up
        for name, fn in kernels.items():
            t0 = time.perf_counter()
            torch.autograd.grad(fn(), (q, k, v), grad)
            if rep:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measured_kernel_times(heads: int, seq_len: int, dtype: torch.dtype) -> dict[str, float]:
    """``_time_kernels`` through this machine's measurement cache (measured once per shape). Only a
    shape not in the cache builds the kernel (KernelUnavailable if it cannot be built): where the
    cache says SDPA wins, a run never compiles or loads the extension at all."""
    key = (f"{cpu_model()}|{cpu_isa()}{isa_env_key()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
           f"|heads={heads}|seq={seq_len}|{dtype}")
    cached = read_cache(CACHE_FILE).get(key)
    if isinstance(cached, dict) and {"sdpa", KERNEL_NAME} <= cached.keys():
        return cached
    warm_up()
    times = _time_kernels(heads, seq_len, dtype)
    write_cache(CACHE_FILE, key, times)
    return times


def faster_kernel(heads: int, seq_len: int, dtype: torch.dtype, probe: Probe | None = None) -> KernelChoice:
    """The faster of the small-head kernel and SDPA here; rank 0 decides for every rank."""
    choice = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        choice[0] = _decide(heads, seq_len, dtype, probe or measured_kernel_times)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _decide(heads: int, seq_len: int, dtype: torch.dtype, probe: Probe) -> KernelChoice:
    try:
        times = probe(heads, seq_len, dtype)
    except KernelUnavailable as e:  # a machine that should have had it: say so once
        log.warning("attention: %s; using SDPA", e)
        return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({e})")
    sdpa, kernel = times["sdpa"], times[KERNEL_NAME]
    if kernel < sdpa:
        return KernelChoice(KERNEL_NAME, f"auto: measured {sdpa / kernel:.1f}x faster than sdpa on this CPU")
    return KernelChoice("sdpa", f"auto: measured {kernel / sdpa:.1f}x faster than the small_head kernel on this CPU")


def auto_picks_kernel(heads: int, seq_len: int, dtype: torch.dtype) -> bool:
    """Whether ``auto`` would install the small-head kernel for a model whose heads it can serve
    (the planner asks; builds the kernel and measures once, as a run would)."""
    try:
        times = measured_kernel_times(heads, seq_len, dtype)
    except KernelUnavailable:
        return False
    return times[KERNEL_NAME] < times["sdpa"]


def apply_attention_kernel(model: torch.nn.Module, choice: str, device: torch.device, cp: int = 1, *,
                           seq_len: int = 256, dtype: torch.dtype = torch.float32,
                           probe: Probe | None = None) -> KernelChoice:
    """Install the kernel chosen by ``training.attention_kernel`` (``choice``).

    ``seq_len`` and ``dtype`` are what attention will see (the dtype SDPA would run in); ``auto``
    times both kernels at that shape (``probe`` replaces the timing in tests)."""
    if choice == "sdpa":
        return KernelChoice("sdpa", "set explicitly")
    reason = why_not(model, device, cp)
    if reason is not None:
        if choice == KERNEL_NAME:
            raise ConfigError(f"training.attention_kernel=small_head cannot be used: {reason}; "
                              f"use training.attention_kernel=auto or sdpa")
        return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({reason})")
    if choice == KERNEL_NAME:
        try:
            warm_up()
        except KernelUnavailable as e:
            raise ConfigError(f"training.attention_kernel=small_head cannot be used: {e}; "
                              f"use training.attention_kernel=auto or sdpa") from e
        picked = KernelChoice(KERNEL_NAME, "set explicitly")
    else:
        heads = max(_heads(m) for m in _attention_modules(model))
        picked = faster_kernel(heads, seq_len, dtype, probe)
        if picked.name == KERNEL_NAME:
            try:
                warm_up()  # rank 0 built it (or found it built) to time it; the other ranks load it here
            except KernelUnavailable as e:  # a machine that should have had it: say so once
                log.warning("attention: %s; using SDPA", e)
                return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({e})")
    if picked.name == KERNEL_NAME:
        for module in _attention_modules(model):
            module.causal_kernel = causal_attention
            module.sdpa_dtype = None  # the kernel computes in fp32 anyway: no upcast copies
    return picked
