"""Tolerances derived from fp64, so no comparison depends on which CPU ran it.

Two fp32 computations of one function (another chunk size, another summation order, another
library's layer) differ by rounding, and how much depends on the CPU's kernels (AMX, AVX-512,
AVX2 sum in other orders): a fixed bound tuned on one CPU fails on another. So each side runs
in fp64 as well, and it is asserted that:

* the fp64 sides agree to fp64 rounding (``FP64_REL`` of the largest value): the two are the
  same function; a real bug (a dropped term, a swapped weight) is off by far more;
* the fp32 sides differ by no more than their own distances from fp64 allow, and each lies
  within ``FP32_REL`` of fp64: the fp32 path is that function, rounded.

A reference that cannot run in fp64 (transformers' Gated DeltaNet casts to fp32 inside) is
held to our fp64 instead: its fp32 result may be ``FOREIGN`` times as far from it as ours is.
The same holds a computation of ours that has no fp64 form (the MoE layer scores and combines
in fp32 whatever its dtype; the rotary and RMS norms compute in fp32 too) to a plain form that
has one (``assert_fp32_only``). Where neither side has one (whole models against each other or
against transformers), the bound is from first principles: fp32 unit roundoff times the terms
the caller counts, of the largest value (``assert_fp32_close``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch

# fp64's unit roundoff (1.1e-16) times the longest sums of these tests (< 1e5 terms), with room
FP64_REL = 1e-10
# fp32's unit roundoff
U32 = 2.0**-24
# fp32's unit roundoff (6e-8) times 1e4 terms: what recursive summation may lose, at worst
FP32_REL = 1e-3
# another library's fp32 form of the same operations rounds by the same order as ours; its own
# blocking, fusions and upcasts may make it a few times worse (or better) on a given CPU
FOREIGN = 8.0
# a few fp32 ulps of the largest value: the floor where both fp32 sides happen to round alike
ULPS = 8 * torch.finfo(torch.float32).eps

Tensors = Mapping[str, torch.Tensor]


def distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def assert_rounding_only(ours32: Tensors, ref32: Tensors, ours64: Tensors, ref64: Optional[Tensors] = None,
                         fp64_rel: float = FP64_REL, *, labels: tuple[str, str] = ("ours", "the reference")
                         ) -> dict[str, float]:
    """``ours32`` / ``ref32``: the two computations in fp32; ``ours64`` / ``ref64``: the same in
    fp64 from the same inputs (``ref64=None``: the reference has no fp64 form). ``labels``: the
    two sides' names in messages. Returns each name's fp32 gap (for a report)."""
    assert ours32.keys() == ref32.keys() == ours64.keys(), (ours32.keys(), ref32.keys(), ours64.keys())
    gaps = {}
    for name, truth in (ref64 or ours64).items():
        scale = max(truth.abs().max().item(), 1e-30) if truth.numel() else 1.0
        gap, ours_off = distance(ours32[name], ref32[name]), distance(ours32[name], ours64[name])
        if ref64 is not None:
            math_gap = distance(ours64[name], truth)
            assert math_gap <= fp64_rel * scale, (
                f"{name}: the fp64 sides differ by {math_gap:.2e} (max |value| {scale:.2e}): not the same function")
            own = ours_off + distance(ref32[name], truth)
            assert gap <= own + math_gap + ULPS * scale, (
                f"{name}: fp32 sides differ by {gap:.2e}, more than their distances from fp64 ({own:.2e})")
        else:
            own = distance(ref32[name], truth)
            assert own <= FOREIGN * ours_off + ULPS * scale, (
                f"{name}: {labels[1]} (fp32) is {own:.2e} from fp64, {labels[0]} (fp32) {ours_off:.2e} "
                f"(max |value| {scale:.2e})")
        assert own <= 2 * FP32_REL * scale, f"{name}: fp32 is {own:.2e} from fp64 (max |value| {scale:.2e})"
        gaps[name] = gap
    return gaps


def assert_same_function(compute: Callable[[torch.dtype], tuple[Tensors, Tensors]],
                         fp64_rel: float = FP64_REL) -> dict[str, float]:
    """``compute(dtype)`` -> (ours, reference): dicts of tensors (outputs, gradients) of the two
    computations, with modules and inputs cast to ``dtype``. Both sides have an fp64 form."""
    ours32, ref32 = compute(torch.float32)
    ours64, ref64 = compute(torch.float64)
    return assert_rounding_only(ours32, ref32, ours64, ref64, fp64_rel)


def assert_fp32_only(fp32_only: Tensors, plain32: Tensors, plain64: Tensors) -> dict[str, float]:
    """``fp32_only``: a computation that casts to fp32 inside, so it has no fp64 form; held to a
    plain form of the same function (``plain32`` / ``plain64``, from the same inputs): within
    ``FOREIGN`` times the plain form's own fp32 distance from its fp64."""
    return assert_rounding_only(plain32, fp32_only, plain64, labels=("the plain form", "the fp32-only one"))


def assert_fp32_close(got: Tensors, want: Tensors, rel: float = FP32_REL) -> dict[str, float]:
    """Neither side has an fp64 form (whole models: their norms and rotary compute in fp32 whatever
    the dtype; transformers' too): bounded from first principles, ``rel`` of the largest value:
    ``FP32_REL`` (fp32 unit roundoff times 1e4 terms), or ``terms * U32`` where the caller counts
    its terms. A real difference (a swapped, transposed or dropped weight) is off by O(1) of it.
    Returns each name's gap."""
    assert got.keys() == want.keys(), (got.keys(), want.keys())
    gaps = {}
    for name, ref in want.items():
        scale = max(ref.abs().max().item(), 1e-30) if ref.numel() else 1.0
        gaps[name] = distance(got[name], ref)
        assert gaps[name] <= rel * scale, f"{name}: fp32 sides differ by {gaps[name]:.2e} (max |value| {scale:.2e})"
    return gaps


def outputs_and_grads(out_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor], module: torch.nn.Module,
                      x: torch.Tensor, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{"out", "x", parameter names}``: ``out_of(module, x)`` and the gradients of
    ``(out * weight).sum()`` for x and every parameter, in the module's dtype (x, weight cast to it)."""
    dtype = next(module.parameters()).dtype
    x = x.detach().to(dtype).requires_grad_()
    out = out_of(module, x)
    names, params = zip(*module.named_parameters())
    grads = torch.autograd.grad((out * weight.to(out.dtype)).sum(), (x, *params))
    return {"out": out.detach(), **dict(zip(("x", *names), grads))}
