"""Tensor parallelism (+ sequence parallel, + loss parallel) on CPU/gloo: parity with one process.

Tolerances come from the rounding floor measured on the machine that runs them
(``helpers.parity_bound``: one process with its batch accumulated as 2 x 4): TP only changes the
order of the matmul reductions. bf16 compares tp(2) with single-process bf16 autocast: the
row-wise layers sum two bf16 partial products across ranks where one process sums once, so the
curves differ by bf16 rounding, bounded by bf16's own distance from fp32 (``bf16_bound``).
"""

from __future__ import annotations

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import (BASE, assert_parity, bf16_bound, compose_cfg, param_floor_bound, parity_bound, reference_losses,
                     run_layout, spawn_gloo)
from titan_hydra.errors import ConfigError
from titan_hydra.validate import validate



# --------------------------------------------------------------------------- loss parity
@pytest.fixture(scope="module")
def tp_trained(tmp_path_factory):
    """tp(2) with sequence + loss parallel (the preset) and a single process, both through
    run_local with gathered trained parameters."""
    from titan_hydra.launch.local import run_local

    out = {}
    for name, overrides, nproc, local in (("tp", ["parallelism=tp"], 2, 8), ("single", ["parallelism=single"], 1, 8),
                                          ("accumulated", ["parallelism=single"], 1, 4)):  # 2 x 4: the floor
        cfg = compose_cfg(BASE + [f"cluster.nproc_per_node={nproc}", f"training.local_batch_size={local}", *overrides])
        out[name] = run_local(spec_of(cfg), str(tmp_path_factory.mktemp(name)), return_state=True)
    return out


@pytest.mark.slow
def test_tp_sp_loss_parallel_fp32_parity(tp_trained, run_cache, record_property):
    losses = tp_trained["tp"]["losses"]
    assert_parity(losses, reference_losses(run_cache), atol=parity_bound(run_cache), label="llama3 tp_sp_lp",
                  record=record_property)


@pytest.mark.slow
def test_tp_trained_params_match_single(tp_trained, record_property):
    tp, single = tp_trained["tp"]["full_state"], tp_trained["single"]["full_state"]
    assert tp.keys() == single.keys()
    for k, v in single.items():
        assert tp[k].shape == v.shape, k
    diffs = {k: (tp[k] - v).abs().max().item() for k, v in single.items()}
    worst = max(diffs, key=diffs.get)
    record_property(f"max |param - single| ({worst})", diffs[worst])
    bound = param_floor_bound(single, tp_trained["accumulated"]["full_state"])
    assert diffs[worst] <= bound, f"{worst}: max |tp - single| = {diffs[worst]:.3g} > {bound:.3g}"


# (family, name, overrides, nproc, dp). Qwen3 runs tied (qwen3_debug), so the TP plan's re-tie of
# the vocab-sharded embedding/output and its head-local QK-norm are both exercised.
FP32_LAYOUTS = [
    ("llama3", "tp_plain",
     ["parallelism=tp", "parallelism.tp_sequence_parallel=false", "parallelism.tp_loss_parallel=false"], 2, 1),
    ("llama3", "fsdp_2_x_tp_2", ["parallelism=fsdp_tp"], 4, 2),
    ("qwen3", "tp_sp_lp", ["parallelism=tp"], 2, 1),  # the preset: sequence + loss parallel on
    ("qwen3", "fsdp_2_x_tp_2", ["parallelism=fsdp_tp"], 4, 2),
]


@pytest.mark.parametrize("family, name, overrides, nproc, dp", FP32_LAYOUTS,
                         ids=[f"{f}-{n}" for f, n, *_ in FP32_LAYOUTS])
@pytest.mark.slow
@pytest.mark.gate("llama3-tp_plain")
def test_fp32_loss_parity(tmp_path, run_cache, record_property, family, name, overrides, nproc, dp):
    losses = run_layout(tmp_path, overrides, nproc=nproc, dp=dp, family=family)
    ref = reference_losses(run_cache, family=family)
    assert_parity(losses, ref, atol=parity_bound(run_cache, family=family), label=f"{family} {name}",
                  record=record_property)


@pytest.mark.slow
@pytest.mark.extended
def test_bf16_loss_parity(tmp_path, run_cache, record_property):
    bf16 = ("training.mixed_precision=bf16",)
    losses = run_layout(tmp_path, ["parallelism=tp", *bf16], nproc=2, dp=1)
    ref = reference_losses(run_cache, bf16)
    assert_parity(losses, ref, atol=bf16_bound(run_cache), label="bf16 tp_2", record=record_property)


# --------------------------------------------------------------------------- shard shapes
KW = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=2048, max_seq_len=64, multiple_of=256)
# dim 64, 4 heads of 16, 2 kv heads, SwiGLU hidden 256, vocab 2048; halves on each of 2 ranks.
BLOCK_LOCAL = {
    "attention.wq.weight": (32, 64),
    "attention.wk.weight": (16, 64),
    "attention.wv.weight": (16, 64),
    "attention.wo.weight": (64, 32),
    "feed_forward.w1.weight": (128, 64),
    "feed_forward.w2.weight": (64, 128),
    "feed_forward.w3.weight": (128, 64),
    "attention_norm.weight": (64,),
    "ffn_norm.weight": (64,),
}
EXPECTED_LOCAL = {
    "tok_embeddings.weight": (1024, 64),
    **{f"layers.{i}.{k}": v for i in (0, 1) for k, v in BLOCK_LOCAL.items()},
    "norm.weight": (64,),
    "output.weight": (1024, 64),
}


def _shape_worker(rank: int, out: dict) -> None:
    """One of 2 ranks: TP'd full models (SP on/off) and a pipeline-like stage; record shapes
    and the max |logits - single-process logits| of one forward."""
    from torch.distributed.tensor import DTensor

    from titan_hydra.models.llama3 import FAMILY, Llama3
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.parallel.tp import apply_tp

    torch.manual_seed(0)
    ref = Llama3(**KW)
    ref.init_weights()
    tokens = torch.randint(0, KW["vocab_size"], (2, 64))
    ref_logits = ref(tokens)
    for sp in (True, False):
        dims = ParallelDims(world_size=2, dp_shard=1, tp=2, tp_sequence_parallel=sp, tp_loss_parallel=False)
        dims.build_mesh("cpu")
        with torch.device("meta"):
            model = Llama3(**KW)
        apply_tp(model, FAMILY, dims)
        out[(rank, sp, "local")] = {
            k: tuple(p.to_local().shape) if isinstance(p, DTensor) else None
            for k, p in model.named_parameters()
        }
        out[(rank, sp, "placements")] = {
            k: str(p.placements) for k, p in model.named_parameters() if isinstance(p, DTensor)
        }
        model.to_empty(device="cpu")
        model.init_weights(buffer_device="cpu")
        with torch.no_grad():
            for k, p in model.named_parameters():
                p.copy_(torch.distributed.tensor.distribute_tensor(ref.state_dict()[k], p.device_mesh, p.placements))
            out[(rank, sp, "logits_diff")] = (model(tokens) - ref_logits).abs().max().item()
    # A middle pipeline stage: no embeddings, no norm/output, only layer "1".
    with torch.device("meta"):
        stage = Llama3(**KW)
    stage.tok_embeddings = stage.norm = stage.output = None
    del stage.layers["0"]
    apply_tp(stage, FAMILY, dims)
    out[(rank, "stage")] = {k: tuple(p.to_local().shape) for k, p in stage.named_parameters()}


@pytest.mark.slow
def test_tp_local_shard_shapes_and_forward():
    """Each rank holds half of every sharded weight; norms are replicated DTensors on the TP
    mesh (with and without sequence parallel); one forward matches the unsharded model."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        spawn_gloo(_shape_worker, 2, out)
        out = dict(out)
    for rank in (0, 1):
        for sp in (True, False):
            assert out[(rank, sp, "local")] == EXPECTED_LOCAL
            placements = out[(rank, sp, "placements")]
            assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
            assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=1),)"
            assert placements["layers.0.ffn_norm.weight"] == "(Replicate(),)"
            assert out[(rank, sp, "logits_diff")] <= 1e-5, out[(rank, sp, "logits_diff")]
        assert out[(rank, "stage")] == {f"layers.1.{k}": v for k, v in BLOCK_LOCAL.items()}


# --------------------------------------------------------------------------- config errors
def _check(overrides: list[str]) -> str:
    cfg = compose_cfg(["cluster.nproc_per_node=2", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_async_tp_refused_on_cpu():
    message = _check(["parallelism=tp", "parallelism.tp_async=true"])
    assert "parallelism.tp_async" in message and "CUDA" in message and "NCCL" in message


def test_sequence_parallel_needs_divisible_seq_len():
    message = _check(["parallelism=tp", "training.seq_len=63"])
    assert "training.seq_len=63" in message and "tp_sequence_parallel" in message


def test_tp_preset_pins_world_size():
    """parallelism=tp is pure TP (dp_shard 1): 4 processes is a one-line error, fsdp_tp fits."""
    message = _check(["parallelism=tp", "cluster.nproc_per_node=4"])
    assert "world size 4" in message
    validate(compose_cfg(["parallelism=fsdp_tp", "cluster.nproc_per_node=4"]))
