"""Context parallelism on CPU/gloo: the ring-attention shim, cp_context on a real model, and
end-to-end loss parity of cp / fsdp x cp with the single-process run.

Why the in-process test besides the end-to-end ones: per-step loss parity alone cannot tell
"sequence sharded + ring attention" from "every CP rank silently ran the full sequence" (both
give the same mean loss and gradients). The spawned test checks the local shard really is the
head-tail load-balanced slice and that logits/gradients still equal the full-sequence ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import GLOBAL_BATCH, assert_parity, floor_bound, run_layout, run_single, series, spawn_gloo

CP = 2
# The shim's attention (32 tokens, head dim 16) against full SDPA, fp32: every output and gradient
# entry is a sum of at most 32 x 16 products of values below 2 in size, whose rounding error is
# below n * u * sum|terms| = 512 * 6e-8 * ~0.3 (softmax-weighted) ~ 1e-5 (the classical bound;
# the attention's online softmax merge adds one rescale per ring step).
ATOL = 1e-5
VAL = ("training.val_freq=5",)


# ----------------------------------------------------------------------------- helpers


def _head_tail(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """What head-tail load balancing gives rank ``rank``: chunks rank and 2*world-1-rank of 2*world."""
    chunks = t.chunk(2 * world, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * world - 1 - rank]], dim=dim)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).abs().max())


def _attention_diffs(method: str, rank: int, mesh) -> dict[str, float]:
    """Sharded causal SDPA (ring, CPU flash kernel) vs plain SDPA on the full sequence."""
    import torch.nn.functional as F
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attn

    from titan_hydra.parallel.cp_cpu_attention import configure_ring_attention

    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(2, 4, 32, 8, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True).backward(dout)
    ref_out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = [_head_tail(t, 2, rank, CP) for t in (ref_out, ref[0].grad, ref[1].grad, ref[2].grad)]

    configure_ring_attention(method, "cpu")
    shards = [t.clone() for t in (q, k, v, dout)]
    with context_parallel(mesh, buffers=shards, buffer_seq_dims=[2] * 4, no_restore_buffers=set(shards)):
        ql, kl, vl = (t.detach().clone().requires_grad_() for t in shards[:3])
        out = F.scaled_dot_product_attention(ql, kl, vl, is_causal=True)
        out.backward(shards[3])
    got = [out, ql.grad, kl.grad, vl.grad]
    diffs = {f"attn_{method}_{n}": _max_diff(a, b) for n, a, b in zip(("out", "dq", "dk", "dv"), got, expected)}
    diffs[f"attn_{method}_shard_is_head_tail"] = _max_diff(shards[0], _head_tail(q, 2, rank, CP))
    options = cp_attn._cp_options  # what torch's ring attention reads
    diffs[f"attn_{method}_load_balance_on"] = 0.0 if options.enable_load_balance else 1.0
    rotate = {"ALL_GATHER": "allgather", "ALL_TO_ALL": "alltoall"}[options.rotate_method.name]
    diffs[f"attn_{method}_rotate_method_set"] = 0.0 if rotate == method else 1.0
    return diffs


def _model_diffs(method: str, rank: int) -> dict[str, float]:
    """cp_context around a real Llama3 forward+backward vs the same model on the full sequence."""
    import copy

    import torch.distributed as dist

    from titan_hydra.models.llama3 import FAMILY, Llama3
    from titan_hydra.parallel.cp import cp_context
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.models.objective import cross_entropy_loss

    torch.manual_seed(0)
    model = Llama3(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64)
    model.init_weights()
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    ref_logits = model(inputs)
    cross_entropy_loss(ref_logits, labels).backward()

    cp_model = copy.deepcopy(model)
    cp_model.zero_grad(set_to_none=True)
    dims = ParallelDims(world_size=CP, dp_shard=1, cp=CP, cp_rotate_method=method)
    dims.build_mesh("cpu")
    x, y = inputs.clone(), labels.clone()
    with cp_context([cp_model], FAMILY.rope_buffers, dims, [(x, 1), (y, 1)]):
        local_rows = cp_model.rope_cos.shape[0]
        logits = cp_model(x)
        loss = cross_entropy_loss(logits, y)
        loss.backward()
    diffs = {
        f"model_{method}_local_seq": float(x.shape[1]),
        f"model_{method}_rope_rows_inside": float(local_rows),
        f"model_{method}_rope_rows_after": float(cp_model.rope_cos.shape[0]),
        f"model_{method}_rope_restored": _max_diff(cp_model.rope_cos, model.rope_cos[:32]),
        f"model_{method}_inputs_head_tail": _max_diff(x, _head_tail(inputs, 1, rank, CP)),
        f"model_{method}_logits": _max_diff(logits, _head_tail(ref_logits, 1, rank, CP)),
        f"model_{method}_loss": abs(dims.global_mean(loss) - cross_entropy_loss(ref_logits, labels).item()),
    }
    grad_diff = 0.0
    for (name, p), p_ref in zip(cp_model.named_parameters(), model.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g)  # what FSDP does over the cp ranks: average the per-shard mean-loss grads
        grad_diff = max(grad_diff, _max_diff(g / CP, p_ref.grad))
    diffs[f"model_{method}_grads"] = grad_diff
    return diffs


def _worker(rank: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (CP,), mesh_dim_names=("cp",))
    diffs: dict[str, float] = {}
    for method in ("allgather", "alltoall"):
        diffs.update(_attention_diffs(method, rank, mesh))
        diffs.update(_model_diffs(method, rank))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(diffs))


@pytest.fixture(scope="module")
def spawned_diffs(tmp_path_factory) -> list[dict[str, float]]:
    out = tmp_path_factory.mktemp("cp_shim")
    spawn_gloo(_worker, CP, str(out))
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(CP)]


# ----------------------------------------------------------------------------- shim + cp_context


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
@pytest.mark.slow
def test_ring_attention_on_cpu_matches_full_sdpa(spawned_diffs, method):
    for diffs in spawned_diffs:
        for name in ("out", "dq", "dk", "dv"):
            assert diffs[f"attn_{method}_{name}"] <= ATOL, (name, diffs)
        assert diffs[f"attn_{method}_shard_is_head_tail"] == 0.0
        assert diffs[f"attn_{method}_load_balance_on"] == 0.0
        assert diffs[f"attn_{method}_rotate_method_set"] == 0.0


@pytest.mark.parametrize("method", ["allgather", "alltoall"])
@pytest.mark.slow
def test_cp_context_shards_model_and_matches_full_sequence(spawned_diffs, method):
    for diffs in spawned_diffs:
        d = {k.removeprefix(f"model_{method}_"): v for k, v in diffs.items() if k.startswith(f"model_{method}_")}
        assert d["local_seq"] == 32 / CP and d["rope_rows_inside"] == 32 / CP, d
        assert d["rope_rows_after"] == 32 and d["rope_restored"] == 0.0, d
        assert d["inputs_head_tail"] == 0.0, d
        assert d["logits"] <= ATOL and d["loss"] <= ATOL and d["grads"] <= ATOL, d


def test_fit_rope_buffers_truncates_and_grows_back():
    from titan_hydra.models.llama3 import Llama3
    from titan_hydra.parallel.cp import fit_rope_buffers

    model = Llama3(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=64)
    full = model.rope_sin.clone()
    assert [t.shape[0] for t in fit_rope_buffers(model, 16)] == [16, 16]
    assert torch.equal(model.rope_sin, full[:16])
    fit_rope_buffers(model, 48)
    assert torch.equal(model.rope_sin, full[:48])
    with pytest.raises(ValueError, match="fewer than the sequence length"):
        fit_rope_buffers(model, 65)


def test_cp_check_rejects_cp_on_cpu_without_the_shim(compose_config, monkeypatch):
    from titan_hydra.errors import ConfigError
    from titan_hydra.parallel import cp, cp_cpu_attention

    cfg = compose_config(["parallelism=cp", "cluster.nproc_per_node=2"])
    cp.check_layout(spec_of(cfg).dims, "cpu")  # available on this torch

    def moved():
        raise cp_cpu_attention.CPShimUnavailable("torch 9.9: _attention lacks custom_ops")

    monkeypatch.setattr(cp_cpu_attention, "check_available", moved)
    with pytest.raises(ConfigError, match=r"parallelism.cp=2 on CPU .* set parallelism.cp=1"):
        cp.check_layout(spec_of(cfg).dims, "cpu")


# ----------------------------------------------------------------------------- end to end


def _layout(tmp_path: Path, overrides: list[str], nproc: int, dp: int, family: str = "llama3"
            ) -> tuple[list[float], list[float]]:
    losses = run_layout(tmp_path, [*overrides, *VAL], nproc=nproc, dp=dp, family=family)
    return losses, series(tmp_path / "run", "val/loss")


def single_of(run_cache, family: str, extra: tuple[str, ...] = ()) -> tuple[list[float], list[float]]:
    """Single-process training and validation losses of ``family`` (validation every 5 steps)."""
    return run_cache.once(("cp_single", family, *extra), lambda path: (
        run_single(path, [*VAL, *extra], family=family), series(path / "run", "val/loss")))


def bounds_of(run_cache, family: str) -> tuple[float, float]:
    """(train, val) parity bounds: what rounding alone moves each series by here, from the single run
    accumulated as 2 x 4 (``helpers.floor_bound``)."""
    ref = single_of(run_cache, family)
    accumulated = single_of(run_cache, family, (f"training.local_batch_size={GLOBAL_BATCH // 2}",))
    return tuple(floor_bound(max(abs(a - b) for a, b in zip(acc, r)), r) for acc, r in zip(accumulated, ref))


@pytest.fixture
def single(run_cache) -> tuple[list[float], list[float]]:
    return single_of(run_cache, "llama3")


def _assert_layout_matches(layout, single, bounds: tuple[float, float], label: str, record) -> None:
    (losses, val), (ref, ref_val) = layout, single
    assert_parity(losses, ref, atol=bounds[0], label=f"{label} train", record=record)
    assert len(val) == len(ref_val) == 2, (val, ref_val)
    assert_parity(val, ref_val, atol=bounds[1], label=f"{label} val", record=record)


# Llama 3 with both rotate methods; Qwen3 (tied, head_dim 32 != dim / n_heads: its rope tables are
# head_dim wide, QK-norm runs before rotary on the local sequence shard) with one.
CP_RUNS = [("llama3", "allgather"), ("llama3", "alltoall"), ("qwen3", "allgather")]


@pytest.mark.parametrize("family,method", CP_RUNS, ids=[f"{f}-{m}" for f, m in CP_RUNS])
@pytest.mark.slow
@pytest.mark.gate("llama3-allgather")
def test_cp_matches_single(tmp_path, run_cache, record_property, family, method):
    layout = _layout(tmp_path, ["parallelism=cp", f"parallelism.cp_rotate_method={method}"], nproc=CP, dp=1,
                     family=family)
    _assert_layout_matches(layout, single_of(run_cache, family), bounds_of(run_cache, family), f"{family} cp {method}",
                           record_property)


@pytest.mark.slow
def test_fsdp_cp_matches_single(tmp_path, single, run_cache, record_property):
    layout = _layout(tmp_path, ["parallelism=fsdp_cp"], nproc=4, dp=2)
    _assert_layout_matches(layout, single, bounds_of(run_cache, "llama3"), "llama3 fsdp_cp", record_property)
