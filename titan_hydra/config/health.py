"""The ``health`` group's object: every knob and its default, written once.

Its Hydra schema is derived from this dataclass (``titan_hydra.groups``); the option files under
``conf/health/`` state only what differs. The runtime parts
(``train/health/``: ``HealthMonitor``) read these settings; they hold nothing of the run
themselves, so they sit below the ``RunSpec`` that carries them.
"""

from __future__ import annotations

from dataclasses import dataclass

from titan_hydra.errors import ConfigError

SPIKE_ACTIONS = ("log", "skip")  # a spiking step is logged only, or logged and not applied
CHECKSUM_ACTIONS = ("stop", "log")  # replicas whose weights differ: stop the run, or only report it
RECHECK_ACTIONS = ("stop", "continue")  # a gradient that differs on a re-run: stop, or go on with the agreeing one


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
