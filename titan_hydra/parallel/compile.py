"""torch.compile, regionally: each transformer block is compiled on its own.

Why per block and not the whole model: all blocks have the same code and shapes, so dynamo
compiles the first one and every other block reuses that code (cold start ~one block, not
n_layers); the FSDP all-gather/reduce-scatter hooks sit between blocks, outside the graphs;
pipeline stages hold any subset of blocks. ``Module.compile()`` compiles in place, so parameter
FQNs (and checkpoints) are the same as in eager runs.

``model_loss`` also compiles the loss (logits upcast + cross entropy fuse; the fp32 copy of
the logits is never materialized), which the recipe passes to the Trainer as ``loss_fn``.
"""

from __future__ import annotations

from typing import Callable

import torch
from omegaconf import DictConfig

from titan_hydra.errors import ConfigError
from titan_hydra.train.loss import cross_entropy_loss

MODES = ("none", "model", "model_loss")


def apply_compile(model_part: torch.nn.Module, compile_cfg: DictConfig) -> int:
    """Compile every transformer block of this part in place; returns how many."""
    if compile_cfg.mode == "none":
        return 0
    layers = getattr(model_part, "layers", None)
    if layers is None:
        return 0
    # Blocks differ only in layer_id; let dynamo reuse one graph for all of them.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    for block in layers.values():
        block.compile(backend=compile_cfg.backend, fullgraph=True)
    return len(layers)


def build_loss_fn(compile_cfg: DictConfig, base: Callable = cross_entropy_loss) -> Callable:
    """The loss the Trainer uses: compiled under ``model_loss``, else the eager one."""
    if compile_cfg.mode != "model_loss":
        return base
    return torch.compile(base, backend=compile_cfg.backend)


def check_config(cfg: DictConfig, dims) -> None:
    c = cfg.compile
    if c.mode != "none" and c.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(f"compile.backend={c.backend!r} is not a torch.compile backend; use inductor")
