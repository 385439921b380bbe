"""Attention kernel policy: which implementation runs the plain causal attention call.

``training.attention_kernel``:

* ``auto`` (default): the hand-written small-head kernel (``titan_hydra/kernels``) on CPU where
  every attention module has 16-wide heads, context parallelism is off, AND it is faster than
  SDPA on this CPU; SDPA everywhere else. Which one is faster depends on the CPU, not on the
  model: with AVX-512 the kernel beats SDPA, on an AVX2-only CPU it loses to it
  (docs/bench/notes_models.md). So ``auto`` times both once (forward + backward of one sequence at
  the run's heads, length and dtype; ~0.1-1 s), keeps the result in the machine's measurement
  cache (``titan_hydra.hardware``), and rank 0's answer is broadcast so every rank runs the
  same kernel. The kernel is compiled (once per machine, ~45 s) only to time it or to run it: a
  shape whose cached answer is SDPA starts without touching the extension. If the kernel cannot
  be built here (no C++ compiler), ``auto`` logs one line and uses SDPA.
* ``auto`` also times the score-matrix kernel (``scores_attention.py``: two batched matmuls
  around an fp32 softmax) on CPU for sequences up to 512, for every head width, MLA's unequal
  q/k and v widths included: at short lengths it can beat the flash kernel (DeepSeek-V3's MLA
  among them; docs/bench/notes_models.md).
* ``sdpa``: always ``F.scaled_dot_product_attention`` (torch's fused kernels).
* ``scores``: always the score-matrix kernel (any device; not with context parallel).
* ``small_head``: require the kernel; a configuration it cannot serve is refused with one line
  before the model is built any further.

A model whose attention calls are out of the policy's reach (a transformers architecture that calls
SDPA or its eager attention itself, ``models/hf/attention.py``) carries ``fixed_attention``: (what
runs, why), which the policy reports instead of choosing.

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
from titan_hydra.kernels.scores_attention import MAX_SEQ, scores_attention
from titan_hydra.kernels.small_head_attention import HEAD_DIM, KernelUnavailable, causal_attention, warm_up

log = logging.getLogger("titan_hydra")

KERNEL_NAME = "small_head"
SCORES = "scores"
SCORES_VERSION = 3  # part of the cache key: a changed kernel is timed again
SMALL_HEAD_VERSION = 2  # likewise
CACHE_FILE = "attention_kernel.json"  # under hardware.cache_path
PROBE_REPS = 5


class KernelChoice(NamedTuple):
    """The kernel that runs plain causal attention, and why (the run header prints both)."""

    name: str  # "sdpa", "small_head" or "scores"
    reason: str


class Shape(NamedTuple):
    """What attention sees in a run: query heads, length, dtype, q/k and v head widths."""

    heads: int
    seq_len: int
    dtype: torch.dtype
    qk: int = HEAD_DIM
    v: int = HEAD_DIM


# (shape, kernel names) -> seconds of one forward + backward per kernel name
Probe = Callable[[Shape, tuple[str, ...]], dict]


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
    if isinstance(getattr(module, "n_heads", None), int):
        return module.n_heads
    wq = getattr(module, "wq", None)
    return int(wq.out_features) // int(module.head_dim) if hasattr(wq, "out_features") else 8


def _widths(module: torch.nn.Module) -> tuple[int, int]:
    """(q/k, v) head widths: equal except in MLA."""
    return int(module.head_dim), int(getattr(module, "v_head_dim", module.head_dim))


def _time_kernels(shape: Shape, names: tuple[str, ...]) -> dict[str, float]:
    """Best-of seconds of one causal forward + backward of a [1, heads, seq_len, width] call, per
    kernel of ``names``; SDPA runs as the models call it (the narrower of q/k and v zero-padded)."""
    g = torch.Generator().manual_seed(0)
    heads, seq, dtype = shape.heads, shape.seq_len, shape.dtype
    q, k = (torch.randn(1, heads, seq, shape.qk, generator=g).to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(1, heads, seq, shape.v, generator=g).to(dtype).requires_grad_()
    grad = torch.randn(1, heads, seq, shape.v, generator=g).to(dtype)
    width = max(shape.qk, shape.v)

    def sdpa():
        a, b, c = (F.pad(t, (0, width - t.shape[-1])) for t in (q, k, v))
        return F.scaled_dot_product_attention(a, b, c, is_causal=True)[..., : shape.v]

    kernels = {"sdpa": sdpa, KERNEL_NAME: lambda: causal_attention(q, k, v), SCORES: lambda: scores_attention(q, k, v)}
    best = {name: float("inf") for name in names}
    for rep in range(PROBE_REPS + 1):  # alternated, so a burst of load hits all; rep 0 warms up
        for name in names:
            t0 = time.perf_counter()
            torch.autograd.grad(kernels[name](), (q, k, v), grad)
            if rep:
                best[name] = min(best[name], time.perf_counter() - t0)
    return best


def measured_kernel_times(shape: Shape, names: tuple[str, ...] = ("sdpa", KERNEL_NAME)) -> dict[str, float]:
    """``_time_kernels`` through this machine's measurement cache (measured once per shape). Only a
    shape not in the cache builds the kernel (KernelUnavailable if it cannot be built): where the
    cache says SDPA wins, a run never compiles or loads the extension at all."""
    widths = "" if (shape.qk, shape.v) == (HEAD_DIM, HEAD_DIM) else f"|qk={shape.qk}|v={shape.v}"
    widths += f"|scores_v{SCORES_VERSION}" if SCORES in names else ""
    widths += f"|small_head_v{SMALL_HEAD_VERSION}" if KERNEL_NAME in names else ""
    key = (f"{cpu_model()}|{cpu_isa()}{isa_env_key()}|threads={torch.get_num_threads()}|torch={torch.__version__}"
           f"|heads={shape.heads}|seq={shape.seq_len}|{shape.dtype}{widths}")
    cached = read_cache(CACHE_FILE).get(key)
    if isinstance(cached, dict) and set(names) <= cached.keys():
        return {name: cached[name] for name in names}
    if KERNEL_NAME in names:
        warm_up()
    times = _time_kernels(shape, names)
    write_cache(CACHE_FILE, key, {**(cached if isinstance(cached, dict) else {}), **times})
    return times


def faster_kernel(shape: Shape, names: tuple[str, ...], probe: Probe | None = None) -> KernelChoice:
    """The fastest of ``names`` here; rank 0 decides for every rank. Under torch's fake backend
    (``dry_run=simulate``) a broadcast moves nothing, so the simulated rank decides for itself."""
    choice = [None]
    shared = dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"
    if not shared or dist.get_rank() == 0:
        choice[0] = _decide(shape, names, probe or measured_kernel_times)
    if shared:
        dist.broadcast_object_list(choice, src=0)
    return choice[0]


def _label(name: str) -> str:
    return name if name == "sdpa" else f"the {name} kernel"


def _decide(shape: Shape, names: tuple[str, ...], probe: Probe) -> KernelChoice:
    try:
        times = probe(shape, names)
    except KernelUnavailable as e:  # a machine that should have had it: say so once
        log.warning("attention: %s; using SDPA", e)
        if names == ("sdpa", KERNEL_NAME):
            return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({e})")
        names = tuple(n for n in names if n != KERNEL_NAME)
        times = probe(shape, names)
    ranked = sorted((n for n in names if n in times), key=times.get)
    best, second = ranked[0], ranked[1]
    return KernelChoice(best, f"auto: measured {times[second] / times[best]:.1f}x faster than {_label(second)} on this CPU")


def auto_picks_kernel(heads: int, seq_len: int, dtype: torch.dtype) -> bool:
    """Whether ``auto`` would install the small-head kernel for a model whose heads it can serve
    (the planner asks; builds the kernel and measures once, as a run would)."""
    names = auto_candidates(seq_len, small_head=True)
    try:
        times = measured_kernel_times(Shape(heads, seq_len, dtype), names)
    except KernelUnavailable:
        return False
    return min(names, key=times.get) == KERNEL_NAME


def auto_candidates(seq_len: int, small_head: bool) -> tuple[str, ...]:
    """The kernels ``auto`` times on CPU without context parallel."""
    return ("sdpa", *([KERNEL_NAME] if small_head else []), *([SCORES] if seq_len <= MAX_SEQ else []))


def apply_attention_kernel(model: torch.nn.Module, choice: str, device: torch.device, cp: int = 1, *,
                           seq_len: int = 256, dtype: torch.dtype = torch.float32,
                           probe: Probe | None = None) -> KernelChoice:
    """Install the kernel chosen by ``training.attention_kernel`` (``choice``).

    ``seq_len`` and ``dtype`` are what attention will see (the dtype SDPA would run in); ``auto``
    times the candidate kernels at that shape (``probe`` replaces the timing in tests)."""
    fixed = getattr(model, "fixed_attention", None)  # a model whose attention no policy reaches says what runs
    if fixed is not None:
        if choice in (KERNEL_NAME, SCORES):
            raise ConfigError(f"training.attention_kernel={choice} cannot be used: {fixed[1]}; "
                              "use training.attention_kernel=auto or sdpa")
        return KernelChoice(*fixed)
    if choice == "sdpa":
        return KernelChoice("sdpa", "set explicitly")
    modules = _attention_modules(model)
    if choice == SCORES:
        if cp > 1:
            raise ConfigError("training.attention_kernel=scores cannot be used: context parallel attention (cp > 1) "
                              "runs through SDPA's ring handlers; use training.attention_kernel=auto or sdpa")
        return _install(modules, KernelChoice(SCORES, "set explicitly"))
    reason = why_not(model, device, cp)
    if choice == KERNEL_NAME:
        if reason is not None:
            raise ConfigError(f"training.attention_kernel=small_head cannot be used: {reason}; "
                              f"use training.attention_kernel=auto or sdpa")
        try:
            warm_up()
        except KernelUnavailable as e:
            raise ConfigError(f"training.attention_kernel=small_head cannot be used: {e}; "
                              f"use training.attention_kernel=auto or sdpa") from e
        return _install(modules, KernelChoice(KERNEL_NAME, "set explicitly"))
    if device.type != "cpu" or cp > 1 or not modules:
        return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({reason})")
    names = auto_candidates(seq_len, small_head=reason is None)
    if names == ("sdpa",):
        return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({reason})")
    qk, v = max(_widths(m) for m in modules)
    picked = faster_kernel(Shape(max(_heads(m) for m in modules), seq_len, dtype, qk, v), names, probe)
    if picked.name == KERNEL_NAME:
        try:
            warm_up()  # rank 0 built it (or found it built) to time it; the other ranks load it here
        except KernelUnavailable as e:  # a machine that should have had it: say so once
            log.warning("attention: %s; using SDPA", e)
            return KernelChoice("sdpa", f"auto: the small_head kernel does not apply ({e})")
    return _install(modules, picked)


def _install(modules: list[torch.nn.Module], picked: KernelChoice) -> KernelChoice:
    if picked.name == KERNEL_NAME:
        for module in modules:
            module.causal_kernel = causal_attention
            module.sdpa_dtype = None  # the kernel computes in fp32 anyway: no upcast copies
    elif picked.name == SCORES:
        for module in modules:
            module.causal_kernel = scores_attention
    return picked
