"""The rules a layout (``spec.dims``) must keep for the run's model, data and groups.

Beside the spec rather than in ``validate``: ``parallelism=auto`` (the planner, which runs before
validation) asks the same of every candidate layout, and validation asks it of the chosen one.
"""

from __future__ import annotations

from titan_hydra.errors import ConfigError
from titan_hydra.models.protocol import SizesSamples
from titan_hydra.parallel import activation_checkpoint
from titan_hydra.parallel import compile as compile_rules
from titan_hydra.parallel import cp, ep, fsdp, pp, tp
from titan_hydra.spec import RunSpec


def check_layout(spec: RunSpec) -> None:
    """The family's own rules (tp vs heads, pp vs tied embeddings, cp vs image tokens) and each
    parallelism module's, as one-line ConfigErrors."""
    dims, seq_len = spec.dims, spec.batch.seq_len
    spec.family.check(spec.model_args, dims, seq_len)
    if isinstance(spec.family, SizesSamples):
        spec.family.check_data(spec.model_args, dims, spec.data)
    if spec.token_data and dims.cp > 1 and seq_len % (2 * dims.cp) != 0:
        raise ConfigError(
            f"training.seq_len={seq_len} must be divisible by 2*parallelism.cp={2 * dims.cp} "
            "(causal load balancing splits each sequence into 2*cp chunks); change training.seq_len or parallelism.cp"
        )
    spec.batch.schedule.check_layout(dims, spec.data)
    check_parallel_modules(spec)


def check_parallel_modules(spec: RunSpec) -> None:
    """Each parallelism module's own rules, called with the values they need: a parallel module
    receives objects and numbers, never the spec (this function reads across groups for them)."""
    dims, shape, cluster = spec.dims, spec.shape, spec.cluster
    ac, compiler = spec.activation_checkpoint, spec.compiler
    fsdp.check_layout(dims)
    tp.check_layout(dims, device=str(cluster.device), backend=str(cluster.backend),
                    compiled=compiler.enabled, seq_len=spec.batch.seq_len)
    pp.check_layout(dims, int(shape.n_layers), spec.batch.local)
    cp.check_layout(dims, str(cluster.device))
    ep.check_layout(dims, int(getattr(shape, "n_experts", 0) or 0))
    activation_checkpoint.check_settings(ac.mode, ac.freq)
    compile_rules.check_settings(compiler.mode, str(compiler.backend), dims, ac.mode)
