"""The ``health`` and ``fault_injection`` groups' objects: every knob and its default, written once.

Their Hydra schemas are derived from these dataclasses (``titan_hydra.groups``); the option files
under ``conf/health/`` and ``conf/fault_injection/`` state only what differs. The runtime parts
(``monitor.HealthMonitor``) read these settings; they hold nothing of the run themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from titan_hydra.errors import ConfigError

SPIKE_ACTIONS = ("log", "skip")  # a spiking step is logged only, or logged and not applied
CHECKSUM_ACTIONS = ("stop", "log")  # replicas whose weights differ: stop the run, or only report it
RECHECK_ACTIONS = ("stop", "continue")  # a gradient that differs on a re-run: stop, or go on with the agreeing one
# where an injected bit flip strikes: a weight after the step (replica comparison), a gradient in the
# re-run of a rechecked step (transient), or a different bit in every run of that step (persistent)
BITFLIP_TARGETS = ("weight", "grad", "grad_every_run")
# the fault_injection keys that name a rank: each must be below the run's world size
RANK_KEYS = ("fault_rank", "slow_rank", "hang_rank", "bitflip_rank")


@dataclass
class Health:
    """The ``health`` group: ``default`` (on for every run), ``strict``, ``off`` (enable=false)."""

    enable: bool = True
    # a step whose reduced loss or gradient norm is NaN/inf is not applied; false: the run stops at once
    skip_nonfinite: bool = True
    # spike: loss or grad norm above median + spike_k * MAD of the last spike_window applied steps,
    # judged once spike_min_history values are in the window
    spike_window: int = 100
    spike_min_history: int = 20
    spike_k: float = 10.0
    spike_action: str = "log"  # one of SPIKE_ACTIONS
    # this many skipped steps in a row -> roll back to the last checkpoint and skip the data window
    max_skips_in_a_row: int = 5
    max_rollbacks: int = 2  # more than this -> the run stops with one line
    # gather each rank's compute / wait time every N steps (0: never); a console line names the
    # slowest rank when its time over the median passes straggler_ratio
    straggler_every: int = 100
    straggler_ratio: float = 1.5
    # no step progress for this long -> every rank's stacks to <run>/hang/ and a non-zero exit (0: off)
    hang_timeout_s: float = 1800.0
    # every N steps the data-parallel replicas' weights are compared bitwise (0: never; a no-op
    # without dp_replicate); a mismatch stops the run or is only logged (checksum_action)
    checksum_every: int = 100
    checksum_action: str = "stop"  # one of CHECKSUM_ACTIONS
    # every N steps each rank runs the step's micro-batches forward and backward again and compares
    # its gradients bitwise (0: never; needs training.deterministic=true on GPU); on a mismatch a
    # third run tells transient from persistent, then recheck_action
    recheck_every: int = 0
    recheck_action: str = "stop"  # one of RECHECK_ACTIONS

    def __post_init__(self) -> None:
        """Refuses a bad value however it was built: the schema checks the actions while Hydra
        composes, but tests, recipes and the monitor also build Health directly."""
        self._check_actions()
        self._check_ranges()

    def _check_actions(self) -> None:
        if str(self.spike_action) not in SPIKE_ACTIONS:
            raise ConfigError(f"health.spike_action={self.spike_action!r} is not one of {', '.join(SPIKE_ACTIONS)}")
        if str(self.checksum_action) not in CHECKSUM_ACTIONS:
            raise ConfigError(f"health.checksum_action={self.checksum_action!r} is not one of "
                              f"{', '.join(CHECKSUM_ACTIONS)}")
        if str(self.recheck_action) not in RECHECK_ACTIONS:
            raise ConfigError(f"health.recheck_action={self.recheck_action!r} is not one of "
                              f"{', '.join(RECHECK_ACTIONS)}")

    def _check_ranges(self) -> None:
        for key in ("spike_window", "spike_min_history", "max_skips_in_a_row", "max_rollbacks", "straggler_every",
                    "checksum_every", "recheck_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"health.{key}={getattr(self, key)} must be >= 0")
        if self.spike_min_history > self.spike_window:
            raise ConfigError(f"health.spike_min_history={self.spike_min_history} exceeds health.spike_window="
                              f"{self.spike_window}; lower it or widen the window")
        if self.hang_timeout_s < 0:
            raise ConfigError(f"health.hang_timeout_s={self.hang_timeout_s} must be >= 0 (0 turns the hang watchdog off)")
        if self.spike_k <= 0:
            raise ConfigError(f"health.spike_k={self.spike_k} must be > 0: a spike is a value above median + "
                              "spike_k * MAD (10 by default, strict: 6)")
        if self.straggler_ratio < 1:
            raise ConfigError(f"health.straggler_ratio={self.straggler_ratio} must be >= 1: the slowest rank's time "
                              "over the median (1.5 by default)")

    def describe(self) -> str:
        """The run header's line: what is watched, and what it costs per step."""
        if not self.enable:
            return "off (a non-finite loss stops the run)"
        nonfinite = "non-finite steps skipped" if self.skip_nonfinite else "non-finite loss stops the run"
        spike = (f"spikes > median + {self.spike_k:g} MAD of {self.spike_window} steps "
                 f"{'skipped' if self.spike_action == 'skip' else 'logged'}")
        rollback = f"{self.max_skips_in_a_row} skips in a row -> rollback (max {self.max_rollbacks})"
        straggler = f"stragglers every {self.straggler_every} steps" if self.straggler_every else "no straggler check"
        hang = f"hang watchdog {self.hang_timeout_s:g} s" if self.hang_timeout_s else "no hang watchdog"
        checksum = (f"replica weights compared every {self.checksum_every} steps (under dp_replicate)"
                    if self.checksum_every else "no replica comparison")
        recheck = (f"gradients recomputed and compared every {self.recheck_every} steps (one extra forward/backward "
                   f"per {self.recheck_every} steps)" if self.recheck_every else "no gradient recheck")
        cost = ("cost: no extra collective per step (decided from the reduced loss and grad norm), "
                + (f"one small all-gather every {self.straggler_every} steps" if self.straggler_every else "no gather"))
        return f"{nonfinite}; {spike}; {rollback}; {straggler}; {hang}; {checksum}; {recheck}; {cost}"


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

    def __post_init__(self) -> None:
        if str(self.bitflip_target) not in BITFLIP_TARGETS:
            raise ConfigError(f"fault_injection.bitflip_target={self.bitflip_target!r} is not one of "
                              f"{', '.join(BITFLIP_TARGETS)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, (int, float)) and value < 0:
                raise ConfigError(f"fault_injection.{f.name}={value} must be >= 0")

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
                                           self.bitflip_rank))

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
        return "!!! FAULT INJECTION ON (a drill, not a real run): " + "; ".join(faults)
