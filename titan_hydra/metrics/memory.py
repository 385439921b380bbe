"""Peak/current memory per rank, on CUDA (caching allocator) and on CPU (process RSS).

On CPU there is no allocator counter, so we read the kernel's view of this process:
VmRSS (now) and VmHWM (high-water mark). Linux resets VmHWM to the current RSS when
"5" is written to /proc/self/clear_refs, which gives a per-window peak like
torch.cuda.reset_peak_memory_stats does on GPU.
"""

from __future__ import annotations

import logging

import torch

log = logging.getLogger("titan_hydra")
GIB = 1024**3


def _proc_kb(path: str, field: str) -> int | None:
    """Value of `field:` (in kB) from a /proc file, in bytes; None if unavailable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryMonitor:
    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        # Whether reset_peak() can really reset on CPU; False until a reset succeeds.
        self.peak_reset_supported = self.is_cuda
        if self.is_cuda:
            self.total = torch.cuda.get_device_properties(self.device).total_memory
        else:
            self.total = _proc_kb("/proc/meminfo", "MemTotal") or 0
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.peak_reset_supported = True
        except OSError:  # not Linux, or not permitted (some sandboxes): peak is since process start
            self.peak_reset_supported = False

    def _cpu_bytes(self) -> tuple[int, int]:
        rss = _proc_kb("/proc/self/status", "VmRSS")
        hwm = _proc_kb("/proc/self/status", "VmHWM")
        if rss is None or hwm is None:  # non-Linux fallback: ru_maxrss only (kB on Linux, B on macOS)
            import resource
            import sys
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak *= 1 if sys.platform == "darwin" else 1024
            return peak, peak
        return rss, max(hwm, rss)

    def report(self) -> dict[str, float]:
        if self.is_cuda:
            peak = torch.cuda.max_memory_allocated(self.device)
            reserved = torch.cuda.max_memory_reserved(self.device)
            stats = torch.cuda.memory_stats(self.device)
            return {
                "memory_peak_gib": peak / GIB,
                # Reserved is what the allocator holds from the driver: that is what OOMs.
                "memory_peak_pct": 100.0 * reserved / self.total if self.total else 0.0,
                "memory_current_gib": torch.cuda.memory_allocated(self.device) / GIB,
                "memory_reserved_gib": reserved / GIB,
                "memory_alloc_retries": float(stats.get("num_alloc_retries", 0)),
            }
        current, peak = self._cpu_bytes()
        return {
            "memory_peak_gib": peak / GIB,
            "memory_peak_pct": 100.0 * peak / self.total if self.total else 0.0,
            "memory_current_gib": current / GIB,
        }


def state_memory_gib(model_parts, optimizer) -> dict[str, float]:
    """This rank's bytes of parameters and optimizer state (local shards of DTensors).

    The process-level peak includes the interpreter and activations; this isolates what
    FSDP shards, so a benchmark can show fsdp(2) holding half of a single process's state.
    """
    from torch.distributed.tensor import DTensor

    def local_bytes(t) -> int:
        if isinstance(t, DTensor):
            t = t.to_local()
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0

    params = sum(local_bytes(p) for m in model_parts for p in m.parameters())
    optim = sum(local_bytes(v) for st in optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0)
    gib = float(1024**3)
    return {"memory_params_gib": params / gib, "memory_optimizer_gib": optim / gib}
