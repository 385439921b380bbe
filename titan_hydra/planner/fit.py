"""Refuse, before anything is built, a run whose planned memory cannot fit the machine it runs on.

Without it ``model=llama3_8b training.steps=2`` on a 24 GiB CPU host prints nothing for minutes while
it initializes 8B parameters and ends in the kernel's OOM killer. The plan (``planner/plan.py``)
already sizes every rank's peak from the config alone; here it meets the machine: on CPU every
local rank's peak lives in this host's RAM (``/proc/meminfo``'s MemTotal), on GPU each rank's in its
device (``torch.cuda`` where one is visible, else the plan's device table), both less
``cluster.memory_headroom`` (the estimator's measured error). The one line names the planned peak and
the first thing to change (the largest category's knob); ``cluster.memory_check=false`` goes on.
"""

from __future__ import annotations

import os

from titan_hydra.errors import ConfigError
from titan_hydra.planner.plan import Plan, plan
from titan_hydra.spec import RunSpec

GIB = 1024**3


def host_memory_gib() -> float | None:
    """This host's RAM in GiB (None where the OS does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return None


def visible_device_gib() -> float | None:
    import torch  # (already imported by every caller; kept local to the GPU branch)

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / GIB


def first_fix(p: Plan) -> str:
    """The knob of the largest planned category."""
    states = p.mem_params_gib + p.mem_grads_gib + p.mem_optimizer_gib
    if p.mem_activations_gib + p.mem_transient_gib > states:
        fix = "lower training.local_batch_size or training.seq_len"
        return fix + (", or set activation_checkpoint=full" if p.ac_mode == "none" else "")
    return "train a smaller model, or shard it over more devices (parallelism=fsdp, more cluster.nnodes)"


def check_memory_fits(spec: RunSpec) -> None:
    """ConfigError (one line) when the planned peak exceeds this machine's memory."""
    if not spec.cluster.memory_check:
        return
    p = plan(spec)
    headroom = float(spec.cluster.memory_headroom)
    if str(spec.cluster.device) == "cuda":
        device = visible_device_gib() or p.device_memory_gib
        if device is None or p.mem_total_gib <= device * (1 - headroom):
            return
        where = f"each GPU's {device:.1f} GiB less the {headroom:.0%} headroom"
        planned = f"{p.mem_total_gib:.1f} GiB per rank"
    else:
        ram, local = host_memory_gib(), int(spec.cluster.nproc_per_node)
        if ram is None or p.mem_total_gib * local <= ram * (1 - headroom):
            return
        where = f"this host's {ram:.1f} GiB of RAM less the {headroom:.0%} headroom"
        planned = f"{p.mem_total_gib:.1f} GiB per rank x {local} rank(s) on this host"
    raise ConfigError(f"the planned peak, {planned}, cannot fit {where}; {first_fix(p)} "
                      "(or cluster.memory_check=false to go on anyway)")
