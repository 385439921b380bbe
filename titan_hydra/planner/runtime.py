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
    ``pp_reduces_each_stage``: FSDP reduce-scatters (and frees) a stage's accumulated unsharded
    gradients once that stage's last microbatch's backward is done, so a rank with several stages
    never holds all of theirs at once: what titan_hydra does on torch 2.13 (the simulator's
    first pipeline rank of llama3_405b, 2 stages of 8 blocks: one stage's fp32 gradients at its
    peak). torchtitan's December 2024 interleaved row is met only when every stage's are held to
    the end (0.81 of its published peak otherwise); its code of then is not checked on this.
    """

    name: str
    pp_split: str = "front"
    pp_keeps_outputs: bool = False
    pp_reduces_each_stage: bool = True


TITAN_HYDRA = Runtime("titan_hydra")
TORCHTITAN_2024_12 = Runtime("torchtitan@9dec370", pp_split="middle", pp_keeps_outputs=True,
                             pp_reduces_each_stage=False)
