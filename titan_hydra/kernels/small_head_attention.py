"""Causal attention for 16-wide heads on CPU: a fused C++ kernel, forward and backward.

torch's CPU flash-attention kernel (what ``F.scaled_dot_product_attention`` runs on CPU, for
torchtitan as for us) is built for wide heads: GEMM calls over blocks of 256 queries x 512
keys, then separate softmax passes over each block, and diagonal blocks computed in full and
masked. With 16-wide heads (torchtitan's debug Llama, ``llama3_debug``) each score is only 16
multiply-adds, so that overhead is most of the time. ``small_head_attention.cpp`` walks the causal
triangle exactly in blocks of 8 (AVX2: 4) queries x 16 keys with one vector per head row, in fp32 whatever the input dtype
(more accurate than bf16 SDPA, never less). Whether it beats SDPA depends on the CPU's vector
width, so the attention policy times both (``attention_policy.py``).

The extension is compiled for the machine it runs on (``-O3 -march=native``; ~20 s the first
time, then cached under torch's extension directory, ``TORCH_EXTENSIONS_DIR``). ``load()``
raises ``KernelUnavailable`` with one line when no C++ toolchain is there; the attention policy
(``titan_hydra.kernels.attention_precision``) then falls back to SDPA for ``auto`` and refuses an explicit
request before training starts.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("titan_hydra")

HEAD_DIM = 16
SOURCE = Path(__file__).with_name("small_head_attention.cpp")


class KernelUnavailable(RuntimeError):
    pass


NAME = "titan_hydra_small_head_attention"
# torch's extension loader serializes builds through a lock file in the build directory and
# waits for it forever; a build killed mid-way (kill -9, a job hitting its time limit) leaves the
# file behind and every later run of any process hangs at start. A real build ends within
# minutes, so a lock older than this is such a leftover and is removed (with a warning).
STALE_LOCK_S = 600


def _clear_stale_lock(build_dir: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove ``build_dir/lock`` if it is older than ``max_age_s``; True if one was removed."""
    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except OSError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing a stale build lock of the small-head kernel (%s, %.0f s old: a build that was "
                "killed); building again", lock, age)
    lock.unlink(missing_ok=True)
    return True


@functools.lru_cache(maxsize=2)
def load(march: str = "native"):
    """The compiled extension module (built once per machine and source version). ``march``: the
    instruction set to build for (``haswell`` builds the AVX2 path on an AVX-512 machine, for tests)."""
    from torch.utils import cpp_extension  # lazy: loads setuptools, only needed to build or load the kernel

    try:
        _clear_stale_lock(cpp_extension._get_build_directory(_name(march), verbose=False))
    except Exception:  # a torch whose private helper differs: just build as before
        pass
    # the pip-installed ninja sits next to this interpreter, which need not be on PATH (.venv/bin/python ...)
    bin_dir = os.path.dirname(sys.executable)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    try:
        # one op namespace per build (the library name), so a native and an AVX2 build can load side by side
        cpp_extension.load(name=_name(march), sources=[str(SOURCE)], is_python_module=False,
                           extra_cflags=["-O3", f"-march={march}", "-fno-math-errno", f"-DTH_OPS={_name(march)}"],
                           verbose=False)
        return getattr(torch.ops, _name(march))  # the ops the library registered (TORCH_LIBRARY in the source)
    except Exception as e:  # no compiler, no ninja, a build error: one line, the caller decides
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise KernelUnavailable(f"the small-head CPU attention kernel could not be built ({first[:200]}); "
                                f"install a C++ compiler and ninja, or set training.attention_kernel=sdpa") from None


def _name(march: str) -> str:
    return NAME if march == "native" else f"{NAME}_{march.replace('-', '_')}"


def _rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, H, S, D] (any strides) -> contiguous [B*H, S, D] in ``dtype`` (what the kernel reads)."""
    b, h, s, d = x.shape
    return x.to(dtype).reshape(b * h, s, d).contiguous()


def _kernel_dtype(x: torch.Tensor) -> torch.dtype:
    """The kernel reads fp32 and bf16 as they are (it computes in fp32); anything else as fp32."""
    return x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32


# Registered as torch custom ops (with fake implementations) so torch.compile traces through
# them without a graph break and activation checkpointing can name the forward in its save list.
@torch.library.custom_op("titan_hydra::small_head_attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, H, S, 16] in q's dtype, logsumexp [B, H, S] fp32) of causal attention."""
    b, h, s, d = q.shape
    dt = _kernel_dtype(q)
    out, lse = load().forward(_rows(q, dt), _rows(k, dt), _rows(v, dt), d**-0.5)
    return out.view(b, h, s, d).to(q.dtype), lse.view(b, h, s)


@attention_op.register_fake
def _(q, k, v):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("titan_hydra::small_head_attention_backward", mutates_args=())
def attention_backward_op(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          out: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) in the inputs' dtypes; P is rebuilt from q, k and the saved logsumexp."""
    b, h, s, d = q.shape
    dt = _kernel_dtype(q)
    grads = load().backward(*(_rows(t, dt) for t in (grad_out, q, k, v, out)), lse.reshape(b * h, s).contiguous(),
                            d**-0.5)  # rowsum(dO * O) comes from the saved output, as in the flash kernels
    return tuple(t.view(b, h, s, d).to(x.dtype) for t, x in zip(grads, (q, k, v)))


@attention_backward_op.register_fake
def _(grad_out, q, k, v, out, lse):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, *output)  # q, k, v as given (no fp32 copies kept), out, lse


def _backward(ctx, grad_out, grad_lse):
    return attention_backward_op(grad_out, *ctx.saved_tensors)


attention_op.register_autograd(_backward, setup_context=_setup_context)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(16) + causal mask) v for q/k/v [B, H, S, 16]; output in q's dtype."""
    return attention_op(q, k, v)[0]


def warm_up() -> None:
    """Build (or load) the extension now, so a missing toolchain fails before training starts."""
    if os.environ.get("TITAN_HYDRA_NO_KERNELS"):
        raise KernelUnavailable("TITAN_HYDRA_NO_KERNELS is set: hand-written kernels are disabled")
    load()
