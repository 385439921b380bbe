"""Activation checkpointing (the `activation_checkpoint` group): trade recompute for memory.

Modes:
* ``full``: every transformer block keeps only its input; backward reruns the whole block.
* ``selective_layer``: the same, but only every ``selective_layer_freq``-th block (1st, (1+f)-th, ...
  counted from the first block of this model part).

Which modules are "blocks" is the model family's answer (``ModelFamily.blocks``).
* ``selective_op``: every block is checkpointed with a per-op policy: outputs of matmuls and
  attention kernels (the expensive ops) are saved, everything else (norms, rope, SiLU, products,
  casts) is recomputed. Uses ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.
  ``selective_op_policy`` picks which matmuls: ``all_mm`` (every one) or ``every_second_mm``
  (the 1st, 3rd, 5th, ... of a block in call order; in a Llama block wq, wv, w1 and w2 are kept,
  wk, wo and w3 recomputed: torchtitan's trade, about a third less saved for one extra
  matmul-third of recompute). Attention outputs are saved under both.

Why the block's ``forward`` is replaced in place instead of wrapping the block in
``checkpoint_wrapper``: a wrapper inserts ``_checkpoint_wrapped_module`` into every parameter
FQN, and FQNs are what TP plans, float8 filters, checkpoints and HF conversion address. Patching
the instance's ``forward`` keeps the module tree (and ``state_dict`` keys) identical to no-AC, so
FSDP/compile applied afterwards see the same blocks, and checkpoints move freely between AC modes.
The checkpoint runs inside the block's ``__call__``, i.e. inside FSDP's unshard/reshard hooks,
so the recompute in backward happens while the block's parameters are gathered.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from titan_hydra.errors import ConfigError
from titan_hydra.kernels.small_head_attention import attention_op  # a custom op (its import registers it)

MODES = ("none", "full", "selective_op", "selective_layer")


def _save_ops() -> set:
    """Ops whose outputs selective_op saves: matmuls and fused attention (forward)."""
    aten = torch.ops.aten
    names = [
        "mm", "addmm", "bmm", "baddbmm", "_scaled_mm",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    ]
    return {getattr(aten, n).default for n in names if hasattr(aten, n)} | {attention_op._opoverload}


SAVE_OPS = _save_ops()

# Selective-op AC replays a block's recompute against the op sequence of its forward, op by op.
# A block holding an FSDP unit of its own (the routed experts under expert parallel) runs FSDP's
# hooks inside the checkpointed region, and they open profiler ranges (record_function) a
# different number of times in the forward and in the recompute (the recompute skips the
# unshard): SAC then refuses the backward. A profiler range computes nothing, so it is one of the
# ops SAC lets through without bookkeeping, like size and stride queries.
SAC_IGNORED_OPS.update({torch.ops.profiler._record_function_enter_new.default,
                        torch.ops.profiler._record_function_enter.default,
                        torch.ops.profiler._record_function_exit.default,
                        torch.ops.profiler._record_function_exit._RecordFunction})
# The projections a block's Linear layers dispatch to (what every_second_mm counts).
MM_OPS = {getattr(torch.ops.aten, n).default for n in ("mm", "addmm", "_scaled_mm") if hasattr(torch.ops.aten, n)}
SAC_POLICIES = ("all_mm", "every_second_mm")  # the first is the default


def selective_op_policy(name: str) -> Callable:
    """A fresh policy function for one checkpointed call.

    ``every_second_mm`` numbers the matmuls of the call and recomputes the even ones. Forward and
    recompute count separately, so the recompute makes the same choices as the forward did."""
    selective_op_policy_check(name)
    seen = {False: 0, True: 0}  # matmuls so far, keyed by ctx.is_recompute

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op not in SAVE_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if name == "every_second_mm" and op in MM_OPS:
            seen[ctx.is_recompute] += 1
            if seen[ctx.is_recompute] % 2 == 0:
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE

    return policy


def selective_op_context(policy: str):
    """Fresh (forward, recompute) context pair for one checkpointed call."""
    return create_selective_checkpoint_contexts(selective_op_policy(policy))


def checkpoint_block(block: torch.nn.Module, selective_op: bool = False, policy: str = SAC_POLICIES[0]) -> None:
    """Make ``block`` recompute its forward in backward (in place; FQNs unchanged)."""
    if getattr(block, "_th_ac_mode", None) is not None:
        return  # already checkpointed
    inner = block.forward
    extra: dict[str, Any] = {"context_fn": functools.partial(selective_op_context, policy)} if selective_op else {}

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **extra, **kwargs)

    block.forward = forward
    block._th_ac_mode = "selective_op" if selective_op else "full"
    block._th_ac_policy, block._th_ac_inner = policy, inner


def push_checkpoint_down(block: torch.nn.Module) -> None:
    """A selective-op checkpointed ``block`` that is compiled child by child (compile.py: blocks
    holding routed experts) checkpoints each child instead, with the same policy.

    Why: around a compiled graph an eager selective checkpoint sees only inductor's ``out=``
    kernels (``aten.mm.out`` into its own buffers); the policy names ``aten.mm.default`` and
    saving an ``out=`` result would not refill the buffer, so nothing is saved and every compiled
    piece runs again in the backward (a compiled DeepSeek-V3 step with selective_op cost what
    full AC did). A checkpoint inside a compiled child is traced by dynamo, which applies the
    policy to the graph's own ops, as for dense blocks compiled whole. The block's own glue (the
    residual adds) then keeps its few activations. Full AC is left as it is (everything is
    recomputed either way)."""
    if getattr(block, "_th_ac_mode", None) != "selective_op":
        return
    block.forward = block._th_ac_inner
    block._th_ac_mode = None
    for child in block.children():  # the routed experts too: an eager child keeps the policy
        checkpoint_block(child, selective_op=True, policy=block._th_ac_policy)


def checkpointed_layer_ids(layer_names: list[str], mode: str, freq: int) -> list[str]:
    """Which blocks (by ModuleDict key) a mode checkpoints."""
    if mode == "none":
        return []
    if mode == "selective_layer":
        return [name for i, name in enumerate(layer_names) if i % freq == 0]
    return list(layer_names)


class ActivationCheckpointing:
    """The ``activation_checkpoint`` group's object (``_target_``): applies one mode to blocks."""

    def __init__(self, mode: str = "none",  # one of MODES
                 selective_layer_freq: int = 2,  # selective_layer: every freq-th block recomputed
                 selective_op_policy: str = SAC_POLICIES[0]) -> None:  # which matmul outputs selective_op saves
        mode = str(getattr(mode, "value", mode))
        if mode not in MODES:
            raise ConfigError(f"activation_checkpoint.mode={mode!r} is not one of {', '.join(MODES)}")
        selective_op_policy_check(selective_op_policy)
        self.mode, self.freq, self.policy = mode, int(selective_layer_freq), str(selective_op_policy)

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def apply(self, layers: torch.nn.ModuleDict) -> list[str]:
        """Checkpoint these blocks (``family.blocks(part)``) per the mode; returns the ids done."""
        chosen = checkpointed_layer_ids(list(layers.keys()), self.mode, self.freq)
        for name in chosen:
            checkpoint_block(layers[name], selective_op=self.mode == "selective_op", policy=self.policy)
        return chosen


def selective_op_policy_check(name: str) -> None:
    if str(name) not in SAC_POLICIES:
        raise ConfigError(f"activation_checkpoint.selective_op_policy={name!r} is not one of "
                          f"{', '.join(SAC_POLICIES)}")


def check_settings(mode: str, selective_layer_freq: int) -> None:
    """The activation_checkpoint group's cross-field rules, as one-line ConfigErrors. ``validate``
    calls it on a composed config, whose mode and policy the schema's Choice enums already refused
    while composing; a direct build checks them in ``ActivationCheckpointing``."""
    if mode == "selective_layer" and int(selective_layer_freq) < 1:
        raise ConfigError(f"activation_checkpoint.selective_layer_freq={selective_layer_freq} must be >= 1")
