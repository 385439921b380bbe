"""Expert parallelism applied to a model: every routed-experts module the family names is sharded
over the ep mesh with its expert-parallel style (``models/common/expert_parallel.py``: the
token all-to-alls and ``ExpertParallel``, the default; a family with experts of another call
signature gives its own, ``ParallelizesExperts``), and the pre-launch rules of EP.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.expert_parallel import ExpertParallel
from titan_hydra.models.protocol import ParallelizesExperts


def apply_ep(model: nn.Module, family, dims) -> list[tuple[str, nn.Module]]:
    """Shard every routed-experts module of ``model`` (a model or one pipeline stage, on meta)
    over the ep mesh; returns them (FSDP shards them next, on the efsdp mesh)."""
    mesh = dims.submesh("ep")
    experts = family.expert_modules(model)  # ModelFamily.expert_modules: the model opts in, EP-agnostic
    for _, module in experts:
        style = family.expert_parallel_style(module) if isinstance(family, ParallelizesExperts) else ExpertParallel()
        parallelize_module(module, mesh, style)
    return experts


# --------------------------------------------------------------------------- pre-launch rules


def check_layout(dims, n_experts: int) -> None:
    """EP against the model, before any process starts (validate.py calls this): the model must
    have routed experts, and ep must divide their number. (ep | dp_shard*cp and tp=1 are
    ParallelDims' own rules.) Compile and every activation-checkpointing mode work under EP:
    compile leaves the experts module eager (parallel/compile.py) and selective-op AC lets
    FSDP's profiler ranges through (parallel/activation_checkpoint.py)."""
    if dims.ep <= 1:
        return
    if n_experts == 0:
        raise ConfigError(
            f"parallelism.ep={dims.ep} needs a mixture-of-experts model; this model has no routed experts "
            "(set parallelism.ep=1)"
        )
    if n_experts % dims.ep:
        raise ConfigError(
            f"parallelism.ep={dims.ep} must divide the model's {n_experts} routed experts; "
            "change parallelism.ep or model.moe.num_experts"
        )
