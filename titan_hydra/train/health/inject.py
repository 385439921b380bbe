"""Faults made on purpose (the ``fault_injection`` group), at the points a real one would strike.

* NaN / spike: a forward hook on this rank's last model part multiplies its output (the logits) by
  NaN (for ``nan_attempts`` tries of the step) or by ``spike_scale`` (once), so the loss and every gradient after it are poisoned the
  way a bad batch or a broken kernel poisons them, before any gradient reduction.
* slow rank: computes ``delay_s`` of CPU time more before each step's forward (a slow device burns
  time, it does not sleep), so the other ranks wait for it in the step's collectives.
* hang: the rank stops before its forward at ``hang_at_step`` and never comes back (its peers then
  block in the step's first collective), which is what the watchdog must catch. Only the first
  attempt hangs: a restart finds the watchdog's reports in ``<run>/hang/`` and runs through.
* bit flip: after the optimizer step of ``at_step`` one mantissa bit of this rank's first parameter
  flips (fp32 weights), so this replica silently disagrees with the others (``bitflip_target=weight``);
  or one bit of its first gradient flips in the recheck's re-run of ``at_step`` (``grad``: a transient
  fault), or a different bit in every run of that step (``grad_every_run``: a persistent one).
* kill: ``fault_rank``'s process sends itself SIGKILL as ``kill_at_step`` begins (steps before it ran,
  their records and checkpoints are on disk; nothing else is flushed or saved). It leaves
  ``<run>/faults/killed_at_step_N`` first, so the rerun that resumes the run is not killed again.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from titan_hydra.config.fault_injection import FaultInjection

KILLED_DIR = "faults"  # <run>/faults/killed_at_step_N: the kill happened; a rerun runs through


def _scaled(output: Any, factor: float) -> Any:
    if isinstance(output, torch.Tensor):
        return output * factor
    if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
        return (output[0] * factor, *output[1:])
    return output


def busy_wait(seconds: float) -> None:
    """``seconds`` of this thread's CPU time: extra work, the same on a loaded machine as on an idle one."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


@torch.no_grad()
def _flip(t: torch.Tensor, bit: int) -> None:
    """Flip ``bit`` of the first element of this rank's (local) fp32 tensor, in place."""
    flat = (t.to_local() if isinstance(t, DTensor) else t).detach().view(-1)
    if flat.element_size() == 4 and flat.numel():
        flat[:1].view(torch.int32).bitwise_xor_(1 << bit)


class Injector:
    """This rank's share of the configured faults; ``begin_step`` / ``end_step`` around each step."""

    def __init__(self, faults: FaultInjection, rank: int, hang_dir: Path | None = None,
                 run_dir: Path | None = None) -> None:
        self.faults, self.rank = faults, rank
        # a restarted run (the watchdog's reports exist) does not hang again: it resumes and finishes
        self.hang = faults.hang_rank == rank and not (hang_dir is not None and hang_dir.exists())
        self.kill_marker = None
        if faults.kill_at_step is not None and faults.fault_rank == rank and run_dir is not None:
            marker = run_dir / KILLED_DIR / f"killed_at_step_{faults.kill_at_step}"
            self.kill_marker = None if marker.exists() else marker
        self._hooks: list = []
        self.nan_left = faults.nan_attempts if faults.fault_rank == rank else 0
        self.spike_left = 1 if faults.fault_rank == rank else 0

    def begin_step(self, step: int, parts: list[torch.nn.Module]) -> None:
        f = self.faults
        if f.slow_rank == self.rank:
            busy_wait(f.delay_s)
        if self.kill_marker is not None and step == f.kill_at_step:
            self.kill_marker.parent.mkdir(parents=True, exist_ok=True)
            self.kill_marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)  # never returns
        if self.hang and step == f.hang_at_step:
            while True:  # never returns: the watchdog ends the process
                time.sleep(1.0)
        factor = None
        if step == f.nan_at_step and self.nan_left > 0:  # a skipped step is tried again: count the tries
            self.nan_left -= 1
            factor = float("nan")
        elif step == f.spike_at_step and self.spike_left > 0:
            self.spike_left -= 1
            factor = float(f.spike_scale)
        if factor is not None and parts:
            self._hooks.append(parts[-1].register_forward_hook(lambda _m, _i, out: _scaled(out, factor)))

    @torch.no_grad()
    def after_step(self, step: int, parts: list[torch.nn.Module]) -> None:
        """After the optimizer step: the bit flip (a corrupted weight on one replica)."""
        if self.faults.bitflip_target != "weight" or self.faults.bitflip_rank != self.rank:
            return
        if step == self.faults.at_step and parts:
            _flip(next(parts[0].parameters()), 20)  # a mantissa bit: a small, silent error

    @torch.no_grad()
    def corrupt_grads(self, step: int, run: int, grads: list[torch.Tensor]) -> None:
        """After run ``run`` (0: the step's own) of a rechecked step's backward: the gradient bit flip."""
        f = self.faults
        if f.bitflip_rank != self.rank or step != f.at_step or not grads:
            return
        if f.bitflip_target == "grad" and run == 1:
            _flip(grads[0], 20)
        elif f.bitflip_target == "grad_every_run":
            _flip(grads[0], 18 + run)  # another bit each run: no two runs agree

    def end_step(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
