"""torchao Float8 training conversion (the `float8` group's object).

``convert`` swaps selected ``nn.Linear`` layers of the meta-device model for torchao's
``Float8Linear`` before any parallelism is applied (TP and FSDP then shard the Float8Linear
weights like any Linear). Recipes: ``tensorwise`` (one dynamic scale per tensor; allows FSDP to
all-gather weights already cast to float8, halving all-gather bytes, and to compute all scales
in one fused op after the optimizer step) and ``rowwise`` (a scale per row: more accurate,
no float8 all-gather).

Which layers: never those whose FQN contains an entry of ``filter_fqns`` (the output layer by
default: its logits feed a softmax over the vocabulary and are the most precision-sensitive),
never dims not divisible by 16 (hardware rule of float8 matmuls), and with
``auto_filter_small_kn`` not the layers whose K/N are too small for the cast overhead to pay off
(torchao's H100-measured thresholds per recipe; they exclude every layer of the debug model,
so CPU tests turn it off).

Hardware: float8 matmuls need CUDA compute capability >= 8.9 (Ada/Hopper). On older GPUs the
conversion is refused. On CPU torchao's path runs as well (``torch._scaled_mm`` exists for
e4m3/e5m2 on CPU; ``emulate=true`` uses a high-precision matmul on float8-rounded inputs) so
the same code is exercised without a GPU; it is not faster there.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from titan_hydra.errors import UserError
from titan_hydra.quiet import import_quietly

def import_torchao_quietly() -> None:
    """Import ``torchao.float8`` once with its import-time warnings silenced (titan_hydra.quiet);
    one line when torchao is not installed (it is a pinned dependency: a broken install)."""
    try:
        import_quietly("torchao.float8")
    except ModuleNotFoundError as e:
        raise UserError(f"float8 needs torchao, which cannot be imported here ({e}); "
                        "pip install torchao==0.18.0, or float8=none") from None

log = logging.getLogger("titan_hydra")

MIN_CAPABILITY = (8, 9)


def refuse_unsupported_gpu(emulate: bool) -> None:
    """Raise when the visible CUDA device cannot run float8 matmuls (and we are not emulating)."""
    if emulate or not torch.cuda.is_available():
        return
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        name = torch.cuda.get_device_name()
        raise UserError(
            f"float8 needs a GPU with compute capability >= 8.9 (Ada/Hopper); {name} has "
            f"{cap[0]}.{cap[1]}. Use float8=none (or float8.emulate=true for a numerics check)"
        )


class Float8Converter:
    """Swaps nn.Linear layers for torchao Float8Linear according to the recipe.

    ``recipe: none`` leaves the model as it is.
    """

    RECIPES = ("none", "tensorwise", "rowwise")

    def __init__(
        self,
        recipe: str = "none",
        enable_fsdp_float8_all_gather: bool = False,
        precompute_float8_dynamic_scale_for_fsdp: bool = False,
        filter_fqns: Sequence[str] = ("output",),  # the output projection stays in high precision
        auto_filter_small_kn: bool = True,
        emulate: bool = False,
    ) -> None:
        if recipe not in self.RECIPES:
            raise ValueError(f"float8.recipe={recipe!r} unknown; use one of {self.RECIPES}")
        if recipe == "rowwise" and enable_fsdp_float8_all_gather:
            raise UserError(
                "float8.enable_fsdp_float8_all_gather=true needs float8=tensorwise (rowwise scales "
                "are per row of the unsharded weight); set it to false"
            )
        if precompute_float8_dynamic_scale_for_fsdp and not enable_fsdp_float8_all_gather:
            raise UserError(
                "float8.precompute_float8_dynamic_scale_for_fsdp=true needs "
                "float8.enable_fsdp_float8_all_gather=true; set one of them"
            )
        self.recipe = recipe
        self.enable_fsdp_float8_all_gather = enable_fsdp_float8_all_gather
        self.precompute_float8_dynamic_scale_for_fsdp = precompute_float8_dynamic_scale_for_fsdp
        self.filter_fqns = list(filter_fqns)
        self.auto_filter_small_kn = auto_filter_small_kn
        self.emulate = emulate
        self.converted: list[str] = []

    @property
    def enabled(self) -> bool:
        return self.recipe != "none"

    def linear_config(self):
        import_torchao_quietly()
        from torchao.float8 import Float8LinearConfig

        if self.recipe == "tensorwise":
            return Float8LinearConfig(
                enable_fsdp_float8_all_gather=self.enable_fsdp_float8_all_gather, emulate=self.emulate
            )
        import dataclasses

        return dataclasses.replace(Float8LinearConfig.from_recipe_name("rowwise"), emulate=self.emulate)

    def module_filter(self) -> Callable[[torch.nn.Module, str], bool]:
        """True for the Linear layers to convert."""
        if self.auto_filter_small_kn:
            from torchao.float8 import _auto_filter_for_recipe

            return _auto_filter_for_recipe(self.recipe, self.filter_fqns)

        def keep(module: torch.nn.Module, fqn: str) -> bool:
            if not isinstance(module, torch.nn.Linear) or any(f in fqn for f in self.filter_fqns):
                return False
            n, k = module.weight.shape
            return n % 16 == 0 and k % 16 == 0

        return keep

    def convert(self, model: torch.nn.Module) -> torch.nn.Module:
        if not self.enabled:
            return model
        refuse_unsupported_gpu(self.emulate)
        import_torchao_quietly()
        from torchao.float8 import convert_to_float8_training

        keep = self.module_filter()
        chosen: list[str] = []

        def filter_fn(module: torch.nn.Module, fqn: str) -> bool:
            ok = keep(module, fqn)
            if ok:
                chosen.append(fqn)
            return ok

        convert_to_float8_training(model, module_filter_fn=filter_fn, config=self.linear_config())
        self.converted = chosen
        log.info("float8 %s: converted %d Linear layers%s", self.recipe, len(chosen),
                 "" if chosen else " (all filtered; float8.auto_filter_small_kn=false converts small ones)")
        return model

    def post_optimizer_step(self, model_parts: list[torch.nn.Module]) -> None:
        """Compute all float8 weight scales at once (FSDP float8 all-gather, tensorwise).

        Must run right after ``optimizer.step()`` each step: the scales are then fresh for the
        next forward's all-gather. ``register(optimizer, parts)`` arranges exactly that.
        """
        if not (self.enabled and self.precompute_float8_dynamic_scale_for_fsdp):
            return
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        for part in model_parts:
            precompute_float8_dynamic_scale_for_fsdp(part)

    def register(self, optimizer: torch.optim.Optimizer, model_parts: list[torch.nn.Module]) -> None:
        """Hook ``post_optimizer_step`` onto the optimizer (no-op unless precompute is on)."""
        if self.enabled and self.precompute_float8_dynamic_scale_for_fsdp:
            optimizer.register_step_post_hook(lambda *_: self.post_optimizer_step(model_parts))
