"""Which training code a plan sizes: titan_hydra's (``TITAN_HYDRA``) or another's.

A module of its own because both the pipeline simulator (stage split) and the CUDA memory model
(outputs kept by the schedule) read them, and because the published-run checks size torchtitan's
code of December 2024 (``TORCHTITAN_2024_12``) with the same model as titan_hydra's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Runtime:
    """Behaviours of the training code that decide memory but are not config keys.

    (What ``activation_checkpoint=selective_op`` saves is a config key,
    ``activation_checkpoint.selective_op_policy``; torchtitan's December 2024 runs saved every
    second matmul, which titan_hydra offers as ``every_second_mm``. Both drop the bf16 logits
    before backward.)
    ``pp_split``: which stages get the extra layers when n_layers % stages != 0: ``front``
    (titan_hydra's parallel/pp.py) or ``middle`` (torchtitan's generate_split_points: the first and
    last stages get one fewer).
    ``pp_keeps_outputs``: torch's pipeline schedule keeps the last stage's output of every
    microbatch (the logits) until the step ends unless ``step(return_outputs=False)``;
    torchtitan's December 2024 train loop kept them, titan_hydra's runner drops them.
    """

    name: str
    pp_split: str = "front"
    pp_keeps_outputs: bool = False


TITAN_HYDRA = Runtime("titan_hydra")
TORCHTITAN_2024_12 = Runtime("torchtitan@9dec370", pp_split="middle", pp_keeps_outputs=True)
