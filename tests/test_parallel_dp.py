"""Data parallelism (FSDP2, HSDP, DDP) on CPU/gloo: loss and parameter parity with one process.

Tolerances come from the rounding floor measured on the machine that runs them
(``helpers.parity_bound``: one process with its batch accumulated as 2 x 4). bf16 compares FSDP's
bf16 parameters (MixedPrecisionPolicy) with single-process bf16 autocast: both compute matmuls in
bf16 but round different tensors (FSDP computes with bf16 copies of the parameters everywhere,
autocast casts inputs per op and keeps its fp32-listed ops in fp32), so that bound is bf16's own
distance from fp32 (``bf16_bound``).
"""

from __future__ import annotations

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import (BASE, assert_parity, bf16_bound, compose_cfg, fsdp2_reference, param_floor_bound, parity_bound,
                     reference_losses, run_layout, spawn_gloo)


# --------------------------------------------------------------------------- gloo reductions
def _grad_worker(rank: int, divide_factor: float | None, out: dict) -> None:
    """One rank: a Linear under fully_shard + our gloo sum-reduction setting; rank r sees x = r+1."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from titan_hydra.parallel.fsdp import use_sum_reductions

    model = torch.nn.Linear(4, 4, bias=False)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    if divide_factor is not None:
        model.set_gradient_divide_factor(divide_factor)
    use_sum_reductions(model)
    model(torch.full((1, 4), float(rank + 1))).sum().backward()
    out[rank] = model.weight.grad.full_tensor().clone()


@pytest.mark.parametrize("divide_factor, expected", [(None, 1.5), (4.0, 0.75)])
@pytest.mark.slow
def test_gloo_sum_reduction_keeps_mean(divide_factor, expected):
    """Forced SUM collectives (gloo has no PREMUL_SUM) still give sum(grads)/factor:
    per-rank grads are 1 and 2, so the dp mean is 1.5 and a custom factor 4 gives 0.75."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        spawn_gloo(_grad_worker, 2, divide_factor, out)
        grads = dict(out)
    for rank in (0, 1):
        torch.testing.assert_close(grads[rank], torch.full((4, 4), expected), rtol=0, atol=1e-7)


# --------------------------------------------------------------------------- loss parity
# (family, name, overrides, nproc, dp). Llama 3 runs every data-parallel layout; Qwen3 (tied
# embeddings: FSDP keeps embedding, norm and output in one unit) runs plain fsdp(2), measured
# max |loss - single| 9.5e-7.
FP32_LAYOUTS = [
    ("llama3", "hsdp_2x2", ["parallelism=hsdp"], 4, 4),
    ("llama3", "ddp_2", ["parallelism=ddp"], 2, 2),
    # dp=4 makes run_layout pick local_batch_size 8/4=2 on 2 ranks: 8 / (2*2) = 2 accumulation steps.
    ("llama3", "fsdp_2_accum_2", ["parallelism=fsdp"], 2, 4),
    ("qwen3", "fsdp_2", ["parallelism=fsdp"], 2, 2),
]


@pytest.mark.parametrize("family, name, overrides, nproc, dp", FP32_LAYOUTS,
                         ids=[f"{f}-{n}" for f, n, *_ in FP32_LAYOUTS])
@pytest.mark.slow
@pytest.mark.gate("llama3-hsdp_2x2", "llama3-fsdp_2_accum_2")
def test_fp32_loss_parity(tmp_path, run_cache, record_property, family, name, overrides, nproc, dp):
    losses = run_layout(tmp_path, overrides, nproc=nproc, dp=dp, family=family)
    assert_parity(losses, reference_losses(run_cache, family=family), atol=parity_bound(run_cache, family=family),
                  label=f"{family} {name}",
                  record=record_property)


@pytest.mark.slow
@pytest.mark.extended
def test_bf16_loss_parity(tmp_path, run_cache, record_property):
    bf16 = ("training.mixed_precision=bf16",)
    losses = run_layout(tmp_path, ["parallelism=fsdp", *bf16], nproc=2, dp=2)
    assert_parity(losses, reference_losses(run_cache, bf16), atol=bf16_bound(run_cache), label="bf16 fsdp_2",
                  record=record_property)


# --------------------------------------------------------------------------- parameter parity
def _train_with_state(tmp_path, overrides: list[str], nproc: int, dp: int) -> dict:
    from titan_hydra.launch.local import run_local

    cfg = compose_cfg(
        BASE + [f"cluster.nproc_per_node={nproc}", f"training.local_batch_size={8 // dp}", *overrides]
    )
    return run_local(spec_of(cfg), str(tmp_path), return_state=True)


def test_fsdp_losses_and_trained_params_match_single(tmp_path, run_cache, record_property):
    """fsdp(2) through run_local (the session's shared clean run): per-step losses and the
    gathered trained parameters."""
    _, fsdp = fsdp2_reference(run_cache)
    single = _train_with_state(tmp_path / "single", ["parallelism=single"], nproc=1, dp=1)
    accumulated = _train_with_state(tmp_path / "accumulated", ["parallelism=single"], nproc=1, dp=2)  # 2 x 4
    assert_parity(fsdp["losses"], reference_losses(run_cache), atol=parity_bound(run_cache), label="fsdp_2 run_local",
                  record=record_property)
    assert fsdp["full_state"].keys() == single["full_state"].keys()
    diffs = {k: (fsdp["full_state"][k] - v).abs().max().item() for k, v in single["full_state"].items()}
    worst = max(diffs, key=diffs.get)
    record_property(f"max |param - single| ({worst})", diffs[worst])
    bound = param_floor_bound(single["full_state"], accumulated["full_state"])
    assert diffs[worst] <= bound, f"{worst}: max |fsdp - single| = {diffs[worst]:.3g} > {bound:.3g}"
