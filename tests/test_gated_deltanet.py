"""Gated DeltaNet (models/common/gated_deltanet.py): the same numbers as transformers' Qwen3.5 layer,
the chunked form equal to the recurrent one and to itself at another chunk size, packed documents
isolated from each other, and the kernel policy (flash-linear-attention on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import Qwen3_5TextConfig
from transformers.models.qwen3_5 import modeling_qwen3_5
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from titan_hydra.errors import ConfigError
from titan_hydra.kernels import gated_delta_policy as policy
from titan_hydra.models.common.gated_delta_rule import chunk_gated_delta_rule
from titan_hydra.models.common.gated_deltanet import GatedDeltaNet, causal_conv, l2_normalize
from titan_hydra.models.common.layers import trunc_normal_
from titan_hydra.models.qwen3_5.hf import fuse_qkv, split_qkv

from numerics import assert_rounding_only, assert_same_function

DIM, HK, HV, DK, DV = 32, 2, 4, 12, 8  # grouped heads (each q/k head serves 2 value heads), dk not a power of 2
F32, F64 = torch.float32, torch.float64


def _layer(chunk_size: int = 64, seed: int = 0, dtype: torch.dtype = F32) -> GatedDeltaNet:
    torch.manual_seed(seed)
    layer = GatedDeltaNet(DIM, HK, HV, DK, DV, chunk_size=chunk_size)
    with torch.no_grad():  # the per-head and norm parameters away from their init, so a swapped one shows
        for p in (layer.dt_bias, layer.A_log, layer.norm.weight):
            p.add_(torch.randn_like(p) * 0.3)
    return layer.to(dtype)


def _x(b: int, s: int, seed: int = 1, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(b, s, DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _grads(layer: torch.nn.Module, x: torch.Tensor, out: torch.Tensor) -> dict[str, torch.Tensor]:
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(out)
    names, params = zip(*layer.named_parameters())
    grads = torch.autograd.grad((out * weight).sum(), (x, *params))
    return dict(zip(("x", *names), grads))


def _forward_and_grads(layer: torch.nn.Module, x: torch.Tensor, **kwargs) -> dict[str, torch.Tensor]:
    """The output and the gradients of a fixed projection of it: what the comparisons check."""
    x = x.detach().requires_grad_()
    out = layer(x, **kwargs)
    return {"out": out.detach(), **_grads(layer, x, out)}


def test_matches_transformers_qwen3_5_layer_forward_and_gradients(monkeypatch):
    """transformers' layer computes in fp32 whatever its dtype, so its fp32 result is held to our fp64:
    within a few times our own fp32 rounding (tests/numerics.py)."""
    # transformers' torch forms even where flash-linear-attention is installed (which it would call)
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(modeling_qwen3_5, name)
        monkeypatch.setattr(modeling_qwen3_5, name, getattr(fn, "__wrapped__", fn))
    cfg = Qwen3_5TextConfig(hidden_size=DIM, linear_num_key_heads=HK, linear_num_value_heads=HV,
                            linear_key_head_dim=DK, linear_value_head_dim=DV, linear_conv_kernel_dim=4,
                            num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    ref = Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    ref.load_state_dict(fuse_qkv(_layer().state_dict()))  # strict: transformers' names once q | k | v are fused
    x = _x(2, 150)  # three 64-token chunks, the last one partial
    theirs = _forward_and_grads(ref, x)
    theirs = {"out": theirs.pop("out"), **split_qkv(theirs, HK * DK)}
    ours32, ours64 = _forward_and_grads(_layer(), x), _forward_and_grads(_layer(dtype=F64), x.double())
    assert len(ours32) == 15  # out, x and the thirteen parameters (q, k, v projections and convolutions apart)
    assert_rounding_only(ours32, theirs, ours64)


def test_split_and_fused_qkv_convert_both_ways_tensor_identical():
    sd = _layer().state_dict()
    fused = fuse_qkv(sd)
    assert fused["in_proj_qkv.weight"].shape == (2 * HK * DK + HV * DV, DIM)
    assert fused["conv1d.weight"].shape == (2 * HK * DK + HV * DV, 1, 4)
    assert not any(k.startswith(("in_proj_q.", "conv_q.")) for k in fused)
    back = split_qkv(fused, HK * DK)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_chunked_equals_recurrent_step_by_step_and_prefill_then_step():
    def compute(dtype):
        layer, x = _layer(chunk_size=16, dtype=dtype), _x(2, 40, dtype=dtype)
        with torch.no_grad():
            chunked = layer(x)
            state, steps = None, []
            for t in range(x.shape[1]):
                y, state = layer.step(x[:, t:t + 1], state)
                steps.append(y)
            head, state = layer.prefill(x[:, :23])  # the chunked form hands its state to decoding
            tail, final = layer.step(x[:, 23:], state)
            assert final.conv.shape == (2, 2 * HK * DK + HV * DV, 3)
            return ({"steps": torch.cat(steps, dim=1), "prefill_then_step": torch.cat([head, tail], dim=1),
                     "state": final.recurrent},
                    {"steps": chunked, "prefill_then_step": chunked, "state": layer.prefill(x)[1].recurrent})

    assert_same_function(compute)


def test_chunk_size_16_equals_64_forward_and_gradients():
    def compute(dtype):
        x = _x(1, 100, dtype=dtype)
        return (_forward_and_grads(_layer(chunk_size=16, dtype=dtype), x),
                _forward_and_grads(_layer(chunk_size=64, dtype=dtype), x))

    assert_same_function(compute)


def test_packed_documents_equal_each_alone():
    """Row 0 packs 37 + 63 tokens (the boundary inside a 16-token chunk), row 1 packs 32 + 2 + 66
    (a boundary on a chunk edge, and a document shorter than the convolution's reach of 3)."""
    lengths = [[37, 63], [32, 2, 66]]
    doc_ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])

    def compute(dtype):
        layer, x = _layer(chunk_size=16, dtype=dtype), _x(2, 100, dtype=dtype)
        with torch.no_grad():
            packed, alone = layer(x, document_ids=doc_ids), torch.empty_like(x)
            for row, sizes in enumerate(lengths):
                start = 0
                for size in sizes:
                    alone[row:row + 1, start:start + size] = layer(x[row:row + 1, start:start + size])
                    start += size
        return {"out": packed}, {"out": alone}

    assert_same_function(compute)
    # and no gradient crosses a boundary: the second document's outputs ignore the first's inputs
    # (up to rounding: the in-chunk decay sums still add the first document's g, then subtract it;
    # in fp64 that rounding is 1e-16 of the largest gradient, so anything above 1e-10 is a leak)
    layer, x = _layer(chunk_size=16, dtype=F64), _x(2, 100, dtype=F64).requires_grad_()
    (grad,) = torch.autograd.grad(layer(x, document_ids=doc_ids)[0, 37:].sum(), x)
    assert grad[0, :37].abs().max().item() < 1e-10 * grad[0, 37:].abs().max().item()


def test_strong_decays_in_packed_documents_stay_finite():
    """A_log at transformers' largest init (rate 16): an 11-token document's decay sum reaches ~-100, so
    the later document's chunk-end decay measured from it would be exp(+100) = inf (then inf x 0 = nan)
    unless masked first. Output and input gradient stay finite and equal each document alone."""
    doc_ids = (torch.arange(32) >= 11).long().expand(2, 32)

    def compute(dtype):
        layer = _layer(chunk_size=16, dtype=dtype)
        with torch.no_grad():
            layer.A_log.fill_(math.log(16.0))
        x = _x(2, 32, dtype=dtype).requires_grad_()
        packed = layer(x, document_ids=doc_ids)
        (grad,) = torch.autograd.grad(packed.sum(), x)
        assert torch.isfinite(grad).all()
        with torch.no_grad():
            return {"out": packed.detach()}, {"out": torch.cat([layer(x[:, :11]), layer(x[:, 11:])], dim=1)}

    assert_same_function(compute)


def test_document_of_one_token_and_reset_at_every_token():
    def compute(dtype):
        layer, x = _layer(chunk_size=16, dtype=dtype), _x(1, 20, dtype=dtype)
        with torch.no_grad():
            packed = layer(x, document_ids=torch.arange(20).unsqueeze(0))  # every token its own document
            return {"out": packed}, {"out": torch.cat([layer(x[:, t:t + 1]) for t in range(20)], dim=1)}

    assert_same_function(compute)


def test_init_draws_q_k_v_as_one_fused_matrix():
    """A seed gives the q, k, v projections what one truncated-normal draw on transformers' fused
    [q; k; v] matrix gives (what this layer drew before the parts were split), not three other draws."""
    layer = _layer()
    torch.manual_seed(3)
    layer.init_weights(out_std=0.01)
    torch.manual_seed(3)
    fused = torch.empty(2 * HK * DK + HV * DV, DIM)
    trunc_normal_(fused, 0.02)
    assert torch.equal(torch.cat([layer.in_proj_q.weight, layer.in_proj_k.weight, layer.in_proj_v.weight]), fused)


def test_kernel_hook_convolves_q_k_v_apart_in_one_call():
    """The installed-kernel path (flash-linear-attention's on CUDA), with the torch forms standing in on
    CPU: one conv call gets the q, k and v parts with their own weights, and the layer's output is
    the torch path's, bit for bit (the same operations)."""
    calls = []

    def conv(xs, weights, starts):
        calls.append([(tuple(x.shape), tuple(w.shape)) for x, w in zip(xs, weights)])
        return [causal_conv(x, w, None, starts)[0] for x, w in zip(xs, weights)]

    def rule(q, k, v, g, beta, scale, chunk_size, starts):
        return chunk_gated_delta_rule(l2_normalize(q), l2_normalize(k), v, g, beta, scale=scale, starts=starts,
                                      chunk_size=chunk_size)[0]

    layer = _layer(chunk_size=16)
    x = _x(2, 40)
    doc_ids = (torch.arange(40) >= 17).long().expand(2, 40)
    with torch.no_grad():
        expected = layer(x, document_ids=doc_ids)
        layer.kernel = policy.DeltaKernels(conv, rule)
        got = layer(x, document_ids=doc_ids)
    key, value = HK * DK, HV * DV
    assert calls == [[((2, 40, key), (key, 4)), ((2, 40, key), (key, 4)), ((2, 40, value), (value, 4))]]
    assert torch.equal(got, expected)


def test_policy_on_cpu_picks_torch_with_the_reason_and_refuses_fla():
    layer = _layer()
    picked = policy.apply_gated_delta_kernel(torch.nn.Sequential(layer), "auto", torch.device("cpu"))
    assert picked.name == "torch" and "this run is on cpu" in picked.reason and layer.kernel is None
    with pytest.raises(ConfigError, match="gated delta kernel fla cannot be used"):
        policy.choose("fla", torch.device("cpu"))
    with pytest.raises(ConfigError, match="not one of auto, torch, fla"):
        policy.choose("triton", torch.device("cpu"))
    assert policy.apply_gated_delta_kernel(torch.nn.Linear(2, 2), "auto", torch.device("cpu")).name == "torch"


def test_cu_seqlens_cover_every_document_of_the_flattened_batch():
    starts = torch.zeros(2, 6, dtype=torch.bool)
    starts[0, 4] = True
    starts[1, 1] = starts[1, 2] = True
    assert policy.cu_seqlens(starts).tolist() == [0, 4, 6, 7, 8, 12]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash-linear-attention's kernels are CUDA-only")
def test_cuda_kernels_equal_the_torch_form():
    """Where flash-linear-attention can train, ``auto`` picks it and it equals the torch form, forward
    and gradients (fp32: within 2e-3, its Triton matmuls may run in TF32: 2^-10 relative per product). Where it cannot, ``auto``
    says why and keeps torch; an importable fla is still compared forward only."""
    device = torch.device("cuda")
    layer = _layer(chunk_size=64).to(device)
    x = _x(2, 300).to(device).requires_grad_()
    doc_ids = (torch.arange(300, device=device) >= 130).long().expand(2, 300).clone()
    expected = layer(x, document_ids=doc_ids)
    expected_g = _grads(layer, x, expected)
    picked = policy.apply_gated_delta_kernel(layer, "auto", device)
    why = policy.fla_import_error()
    assert (picked.name == "fla") == (why is None)
    if why is not None:
        assert layer.kernel is None and why in picked.reason
        if "not importable" in why:
            return
        layer.kernel = policy.FLA_KERNELS  # the forward kernels still run
        with torch.no_grad():
            torch.testing.assert_close(layer(x, document_ids=doc_ids), expected, atol=2e-3, rtol=2e-3)
        return
    out = layer(x, document_ids=doc_ids)
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
    got_g = _grads(layer, x, out)
    for name, want in expected_g.items():  # TF32 keeps 10 mantissa bits: 2^-10 ~ 1e-3 of each tensor's scale
        got = got_g[name]
        assert (got - want).abs().max() <= 2e-3 * want.abs().max().clamp_min(1e-3), name
