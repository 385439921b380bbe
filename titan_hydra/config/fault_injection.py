"""The ``fault_injection`` group's object: faults made on purpose to drill the ``health`` group.

Its Hydra schema is derived from this dataclass (``titan_hydra.groups``); ``train/health/inject.py`` makes
the faults it describes (this class sits below the ``RunSpec`` that carries it).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from titan_hydra.errors import ConfigError

# where an injected bit flip strikes: a weight after the step (replica comparison), a gradient in the
# re-run of a rechecked step (transient), or a different bit in every run of that step (persistent)
BITFLIP_TARGETS = ("weight", "grad", "grad_every_run")
# the fault_injection keys that name a rank: each must be below the run's world size
RANK_KEYS = ("fault_rank", "slow_rank", "hang_rank", "bitflip_rank")


@dataclass
class FaultInjection:
    """The ``fault_injection`` group: faults made on purpose to drill the ``health`` group.
    Off unless a step or rank is set; the run header says so loudly when on. Steps count from 1."""

    nan_at_step: Optional[int] = None  # this step's loss and gradients become NaN on fault_rank
    nan_attempts: int = 1  # tries of that step that see the NaN (a skipped step is tried again on new data)
    spike_at_step: Optional[int] = None  # this step's logits x spike_scale on fault_rank
    fault_rank: int = 0
    spike_scale: float = 1000.0
    slow_rank: Optional[int] = None  # this rank computes delay_s longer every step
    delay_s: float = 0.5
    hang_rank: Optional[int] = None  # this rank stops making progress at hang_at_step
    hang_at_step: int = 1
    bitflip_rank: Optional[int] = None  # this rank flips one bit at step at_step, where bitflip_target says
    at_step: int = 1
    bitflip_target: str = "weight"  # one of BITFLIP_TARGETS
    # fault_rank's process ends as step kill_at_step begins, as SIGKILL ends it (no cleanup, no final
    # checkpoint); once per run dir, so the rerun that resumes it runs through
    kill_at_step: Optional[int] = None

    def __post_init__(self) -> None:
        if str(self.bitflip_target) not in BITFLIP_TARGETS:
            raise ConfigError(f"fault_injection.bitflip_target={self.bitflip_target!r} is not one of "
                              f"{', '.join(BITFLIP_TARGETS)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ConfigError(f"fault_injection.{f.name}={value} must be >= 0")
        if self.kill_at_step == 0:
            raise ConfigError("fault_injection.kill_at_step=0 never strikes (steps count from 1): use a step >= 1")

    def check_ranks(self, world_size: int) -> None:
        """A fault aimed at a rank the run does not have would never strike, and the drill would pass
        with no fault at all: refused before any rank starts (``validate`` knows the world size)."""
        for key in RANK_KEYS:
            rank = getattr(self, key)
            if rank is not None and rank >= world_size:
                raise ConfigError(f"fault_injection.{key}={rank} is not a rank of this run (world size {world_size}); "
                                  f"use a rank below {world_size} or launch more ranks (cluster.nproc_per_node)")

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.nan_at_step, self.spike_at_step, self.slow_rank, self.hang_rank,
                                           self.bitflip_rank, self.kill_at_step))

    def describe(self) -> str:
        """The header's loud line: every fault this run will make on purpose."""
        faults = []
        if self.nan_at_step is not None:
            faults.append(f"NaN at step {self.nan_at_step} on rank {self.fault_rank}"
                          + (f" ({self.nan_attempts} tries)" if self.nan_attempts > 1 else ""))
        if self.spike_at_step is not None:
            faults.append(f"spike (logits x {self.spike_scale:g}) at step {self.spike_at_step} on rank {self.fault_rank}")
        if self.slow_rank is not None:
            faults.append(f"rank {self.slow_rank} {self.delay_s:g} s slower every step")
        if self.hang_rank is not None:
            faults.append(f"rank {self.hang_rank} hangs at step {self.hang_at_step}")
        if self.bitflip_rank is not None:
            where = {"weight": "a weight bit after step", "grad": "a gradient bit in the recheck of step",
                     "grad_every_run": "a different gradient bit in every run of step"}[self.bitflip_target]
            faults.append(f"rank {self.bitflip_rank} flips {where} {self.at_step}")
        if self.kill_at_step is not None:
            faults.append(f"rank {self.fault_rank} killed (SIGKILL) as step {self.kill_at_step} begins, once")
        return "!!! FAULT INJECTION ON (a drill, not a real run): " + "; ".join(faults)
