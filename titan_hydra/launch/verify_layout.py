"""``parallelism.auto_verify=simulate``: the planner's ranking, checked by the simulator.

The planner ranks layouts by a closed-form memory and speed estimate; the simulator builds and
steps the real code of a layout on fake tensors (``titan_hydra/simulate``) and measures its peak.
The two differ by tens of percent on some layouts (docs/scaling.md), so near the device's limit
the closed form can take a layout that would not fit, or pass over one that would. Here the
fastest candidates are simulated in the planner's order, and the first whose simulated peak fits
the device is taken. A candidate whose closed-form peak exceeds the usable memory by more than
``PLAN_MARGIN`` is not simulated (no gap the simulator measured is that large).

It runs in the launching process only: the tasks of a SLURM job receive the chosen degrees in
their config (``launch/resolve.py``), and a simulation per rank under torchrun would repeat the
same minutes on every rank, so that case is refused.
"""

from __future__ import annotations

import os

from titan_hydra.errors import ConfigError
from titan_hydra.planner.auto import Candidate, candidate_spec, ranked
from titan_hydra.planner.devices import usable_memory_of
from titan_hydra.simulate.report import GIB
from titan_hydra.simulate.simulator import simulate
from titan_hydra.spec import RunSpec

PLAN_MARGIN = 1.5  # simulate candidates whose planned peak is up to 1.5x the usable memory


def worth_simulating(spec: RunSpec, cands: list[Candidate]) -> list[Candidate]:
    """Valid candidates, the planner's best first, whose closed-form peak is within ``PLAN_MARGIN``
    of the usable memory; at most ``parallelism.auto_verify_max`` of them."""
    usable = usable_memory_of(spec.cluster)
    near = [c for c in ranked(cands) if usable is None or c.mem_gib <= PLAN_MARGIN * usable]
    return near[: spec.dims.auto_verify_max]


def verified_layout(spec: RunSpec, cands: list[Candidate]) -> Candidate:
    """The first of ``worth_simulating`` whose simulated peak fits; ConfigError when none does."""
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        raise ConfigError("parallelism.auto_verify=simulate runs in the launching process: start the run with "
                          "`python launch.py ...` (it starts torchrun itself), or set parallelism.auto_verify=none")
    tried = []
    for c in worth_simulating(spec, cands):
        sim = simulate(candidate_spec(spec, c))
        peak = sim.tightest.peak_bytes / GIB
        verdict = "fits" if sim.fits else "does not fit"
        print(f"parallelism.auto_verify=simulate: {c.describe()} simulated peak {peak:.3g} GiB/rank "
              f"(planned {c.mem_gib:.3g}): {verdict}", flush=True)
        if sim.fits:
            print(f"parallelism=auto took {c.describe()}: the fastest candidate whose simulated peak fits", flush=True)
            return c
        tried.append(f"{c.describe()} {peak:.3g} GiB")
    usable = usable_memory_of(spec.cluster)
    raise ConfigError(f"parallelism.auto_verify=simulate: none of the {len(tried)} fastest candidates fits "
                      f"{usable:.1f} GiB usable when simulated ({'; '.join(tried) or 'none near the limit'}); "
                      "add nodes, set activation_checkpoint=full, lower training.local_batch_size, or raise "
                      "parallelism.auto_verify_max")
