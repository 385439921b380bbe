"""torch.compile, regionally: each transformer block is compiled on its own.

Why per block and not the whole model: all blocks have the same code and shapes, so dynamo
compiles the first one and every other block reuses that code (cold start ~one block, not
n_layers); the FSDP all-gather/reduce-scatter hooks sit between blocks, outside the graphs;
pipeline stages hold any subset of blocks. ``Module.compile()`` compiles in place, so parameter
FQNs (and checkpoints) are the same as in eager runs.

A block that holds routed experts (``ModelFamily.expert_modules``) is compiled in pieces: every
child without experts as one fullgraph graph (attention, norms, shared experts), the MoE layer
descended into, and the experts module itself left eager. Its token dispatch has data-dependent
sizes (a whole-block graph recompiles as the per-expert counts change), and under expert
parallel its hooks run all-to-alls with host-side split sizes and it is an FSDP unit of its own:
none of that can sit inside a fullgraph. A selective checkpoint of such a block moves into its
pieces (``ac.push_checkpoint_down``): around a compiled graph it would save nothing.
``compiled_graphs()`` counts what dynamo compiled, so a run can show that its steps stopped
compiling after the first ones.

``model_loss`` also compiles the loss (logits upcast + cross entropy fuse; the fp32 copy of
the logits is never materialized), which the recipe passes to the Trainer as ``loss_fn``.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor

from titan_hydra.errors import ConfigError
from titan_hydra.hardware import inductor_cache_for_isa
from titan_hydra.parallel.activation_checkpoint import push_checkpoint_down

MODES = ("none", "model", "model_loss")


class Compiler:
    """The ``compile`` group's object (``_target_``): compiles blocks, and the loss under model_loss."""

    def __init__(self, mode: str = "none", backend: str = "inductor") -> None:
        mode = str(getattr(mode, "value", mode))
        if mode not in MODES:
            raise ConfigError(f"compile.mode={mode!r} is not one of {', '.join(MODES)}")
        self.mode, self.backend = mode, backend

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def apply(self, part: torch.nn.Module, layers: torch.nn.ModuleDict,
              experts: list[torch.nn.Module] = ()) -> int:
        return apply_compile(part, layers, self, experts)

    def compile_loss(self, loss_fn: Callable) -> Callable:
        """The loss the trainer uses: compiled under ``model_loss``, else unchanged."""
        return build_loss_fn(self, loss_fn)


def apply_compile(part: torch.nn.Module, layers: torch.nn.ModuleDict, compile_cfg,
                  experts: list[torch.nn.Module] = ()) -> int:
    """Compile each block of ``layers`` (``family.blocks(part)``) in place; returns how many.
    ``experts``: the routed-experts modules (``family.expert_modules``), left eager."""
    if compile_cfg.mode == "none":
        return 0
    inductor_cache_for_isa()
    # Blocks differ only in layer_id; let dynamo reuse one graph for all of them.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    eager = {id(m) for m in experts}
    for block in layers.values():
        _compile_around(block, eager, compile_cfg.backend)
    for child in part.children():  # the eager modules around the blocks (embedding, head)
        if child is not layers:
            child.register_forward_hook(_resolve_async_output)
    return len(layers)


def _compile_around(module: torch.nn.Module, eager: set[int], backend: str) -> None:
    """``module`` as one fullgraph graph, or, if it holds a module of ``eager``, each child that
    does not (descending into those that do), leaving the ``eager`` ones and the code of the
    modules that hold them uncompiled."""
    if id(module) in eager:
        return
    if not any(id(m) in eager for m in module.modules()):
        module.compile(backend=backend, fullgraph=True)
        return
    push_checkpoint_down(module)  # a selective checkpoint must sit inside the compiled graphs
    for child in module.children():
        _compile_around(child, eager, backend)


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (a recompile adds one)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def _resolve_async_output(_module: torch.nn.Module, _inputs, output):
    """Hand compiled blocks a plain tensor, not an ``AsyncCollectiveTensor``.

    Under TP the embedding's output is redistributed with ``async_op=True`` and ``to_local()``
    returns an AsyncCollectiveTensor (ACT). torch 2.13's AOTAutograd resolves ACT graph inputs
    with ``trigger_wait()`` outside autograd, and the gradient it then returns for that input
    reaches the embedding's ``Redistribute.backward`` as a plain tensor instead of a DTensor:
    "'Tensor' object has no attribute '_local_tensor'" (any backend that runs AOTAutograd;
    dynamo's ``eager`` backend is fine). ``clone()`` is a non-view op, so the ACT waits for its
    collective and returns an ordinary autograd-tracked tensor: one [B, S/tp, dim] copy per step.
    """
    return output.clone() if isinstance(output, AsyncCollectiveTensor) else output


def build_loss_fn(compile_cfg, base: Callable) -> Callable:
    """``base`` compiled under ``model_loss``, else ``base`` itself."""
    if compile_cfg.mode != "model_loss":
        return base
    inductor_cache_for_isa()
    return torch.compile(base, backend=compile_cfg.backend)


def check_settings(mode: str, backend: str, dims, ac_mode: str) -> None:
    """Compile settings that cannot work (an unknown backend; a combination torch 2.13 fails)."""
    if mode != "none" and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(f"compile.backend={backend!r} is not a torch.compile backend; use inductor")
    if mode != "none" and backend != "eager" and dims.tp > 1 and ac_mode in ("full", "selective_layer"):
        # torch 2.13: AOTAutograd's compiled forward of a fully checkpointed TP block saves the
        # DeviceMesh among its tensors and asserts ("expected all tensors_saved_with_vc_check to
        # be Tensors"); selective_op (a selective-checkpoint policy) compiles and matches eager.
        raise ConfigError(
            f"activation_checkpoint={ac_mode} with compile={mode} under tp fails in torch 2.13; "
            "use activation_checkpoint=selective_op (or compile=none)"
        )
