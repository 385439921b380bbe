"""Run torchtitan 0.3.0's trainer on CPU: patch a few things at runtime, then run
``torchtitan.train`` as ``__main__``. Nothing installed is edited; every patch lives only in this
process. Launch it where torchtitan's ``torch.distributed.run`` would launch ``torchtitan.train``:

    torchrun --nproc_per_node=1 tt_cpu_shim.py --module tt_cpu_configs --config NAME [--a.b v ...]

Each patch, and why it is needed (the README of this directory lists the same items):

1. ``torch._utils._get_available_device_type`` returns "cpu": torchtitan picks its device type
   through it at import and falls back to "cuda" when it returns None (a CPU-only torch does).
2. ``torch.cpu.current_device`` returns 0: torchtitan passes it as a device index (barrier
   ``device_ids``, the memory monitor); torch's CPU module returns the string "cpu".
3. ``torch.cpu.get_device_name`` / ``get_device_properties`` (``.name``, ``.total_memory``) /
   ``reset_peak_memory_stats`` / ``empty_cache`` / ``memory_stats``: torchtitan's memory monitor
   calls them on its device module and torch's CPU module has none. Peaks are this process's
   peak RSS (``ru_maxrss``); total memory is the machine's physical memory.
4. ``torch.distributed.set_timeout`` maps to ``distributed_c10d._set_pg_timeout(timeout, group)``:
   torchtitan calls the former after the first step and torch 2.13 has only the latter.
5. ``FSDPModule.set_gradient_divide_factor`` also calls ``set_force_sum_reduction_for_comms(True)``:
   torchtitan sets a divide factor of 1.0 (it scales gradients by the global token count itself),
   which makes FSDP reduce-scatter with a PREMUL_SUM that gloo rejects; a plain SUM is the same
   reduction when the factor is 1.

On a CUDA machine (``TT_SHIM_DEVICE=cuda``, scripts/gpu_side_by_side/) only patch 4 applies (an
API the installed torch may lack) and the mixed-precision report; the device is torch's own.

Set ``TT_SHIM_VERBOSE=1`` to print which patches were installed. The shim also prints, once, the
mixed-precision policy torchtitan hands to FSDP (an observation; it changes nothing), so the
harness can report the precision torchtitan ran from its own process.
"""

from __future__ import annotations

import os
import resource
import runpy
import sys
from datetime import timedelta
from types import SimpleNamespace

import torch
import torch._utils
import torch.distributed as dist

_INSTALLED: list[str] = []


def _patch_device_type() -> None:
    torch._utils._get_available_device_type = lambda: "cpu"
    _INSTALLED.append("device type -> cpu")


def _total_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * 1024**3


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _patch_cpu_module() -> None:
    cpu = torch.cpu
    cpu.current_device = lambda: 0
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: SimpleNamespace(name="cpu", total_memory=_total_memory())
    cpu.reset_peak_memory_stats = lambda device=None: None
    cpu.empty_cache = lambda: None

    def memory_stats(device=None) -> dict:
        peak = _peak_rss_bytes()
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    cpu.memory_stats = memory_stats
    _INSTALLED.append("torch.cpu device/memory functions")


def _patch_set_timeout() -> None:
    if hasattr(dist, "set_timeout"):
        return

    def set_timeout(timeout: timedelta, group=None) -> None:
        dist.distributed_c10d._set_pg_timeout(timeout, group)

    dist.set_timeout = set_timeout
    _INSTALLED.append("torch.distributed.set_timeout")


_REPORTED: set[str] = set()


def _report_mixed_precision(module) -> None:
    """Print (once) the mixed-precision policy FSDP was given: what torchtitan really computes in."""
    try:
        groups = module._get_fsdp_state()._fsdp_param_groups
        mp = groups[0].mp_policy
        line = (f"tt_cpu_shim: FSDP mixed precision: param_dtype={str(mp.param_dtype).replace('torch.', '')} "
                f"reduce_dtype={str(mp.reduce_dtype).replace('torch.', '')}")
    except (AttributeError, IndexError):
        return
    if line not in _REPORTED:
        _REPORTED.add(line)
        print(line, file=sys.stderr, flush=True)


def _patch_fsdp_divide_factor() -> None:
    from torch.distributed.fsdp import FSDPModule

    original = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        original(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)
        _report_mixed_precision(self)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor
    _INSTALLED.append("FSDP divide factor 1.0 -> SUM reduction")


def install(cpu: bool = True) -> list[str]:
    if cpu:
        _patch_device_type()
        _patch_cpu_module()
    _patch_set_timeout()
    _patch_fsdp_divide_factor()  # on CUDA: the report only matters (NCCL takes PREMUL_SUM; factor 1 = SUM)
    return list(_INSTALLED)


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)  # --module tt_cpu_configs
    installed = install(cpu=os.environ.get("TT_SHIM_DEVICE", "cpu") == "cpu")
    if os.environ.get("TT_SHIM_VERBOSE"):
        print("tt_cpu_shim: " + "; ".join(installed), file=sys.stderr)
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
