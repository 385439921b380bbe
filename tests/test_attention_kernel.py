"""The small-head CPU attention kernel (titan_hydra/kernels) and the policy that installs it.

The kernel must equal causal softmax attention (checked against fp64 SDPA, forward and all three
gradients, at lengths that are not multiples of its 8-query / 16-key blocks), behave as a proper
torch custom op (opcheck: fake tensors, autograd registration, torch.compile without a graph
break), be saved rather than recomputed by selective activation checkpointing, and train to the
same losses as SDPA. The policy picks it only where it applies and says why not otherwise.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan_hydra.errors import ConfigError
from titan_hydra.hardware import cpu_flags
from titan_hydra.kernels.scores_attention import scores_attention
from titan_hydra.kernels.small_head_attention import attention_op, causal_attention, load
from titan_hydra.models.llama3 import Llama3
from titan_hydra.models.qwen3 import Qwen3
from titan_hydra.kernels.attention_policy import apply_attention_kernel
from helpers import STEPS, assert_parity, parity_bound, reference_losses, run_single
from numerics import assert_fp32_close, assert_fp32_only


def sdpa_reference(q, k, v, grad, dtype, **kw) -> dict[str, torch.Tensor]:
    """Causal SDPA in ``dtype`` from the same fp32 inputs: output and the q, k, v gradients."""
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, **kw)
    return {"out": out.detach(), **dict(zip("qkv", torch.autograd.grad(out, (q, k, v), grad.to(dtype))))}


def assert_kernel_is_sdpa(got, got_grads, q, k, v, grad, **kw) -> None:
    """The kernels compute in fp32 only: held to SDPA's fp64 within a few times SDPA's own fp32
    rounding (tests/numerics.py), forward and the three gradients."""
    ref32, ref64 = (sdpa_reference(q, k, v, grad, dtype, **kw) for dtype in (torch.float32, torch.float64))
    ours = {"out": got, **dict(zip("qkv", got_grads))}
    if q.shape[2] == 1:  # one key: the q and k gradients are exactly 0 (dS = dP - rowsum(P dP) with P = 1),
        # so no relative bound; their rounding: dP and the rowsum, 16-term sums (16 u of |grad| |v| each,
        # u = eps / 2), times |k| or |q| and the scale (<= 1)
        eps = torch.finfo(torch.float32).eps
        bound = 16 * eps * grad.abs().max() * v.abs().max() * max(q.abs().max(), k.abs().max())
        for name in "qk":
            assert ref64[name].abs().max() <= bound * torch.finfo(torch.float64).eps / eps  # the same, in fp64
            assert ours[name].abs().max() <= bound and ref32[name].abs().max() <= bound, name
            for d in (ours, ref32, ref64):
                del d[name]
    assert_fp32_only(ours, ref32, ref64)


def qkv(b: int, h: int, s: int, dtype=torch.float32, seed: int = 0):
    """q/k/v [B, H, S, 16] as the model hands them over: transposed views of [B, S, H, 16]."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, s, h, 16, generator=g).to(dtype).transpose(1, 2).requires_grad_() for _ in range(3)]


@pytest.mark.parametrize("b,h,s", [(1, 1, 1), (2, 3, 7), (1, 2, 16), (2, 2, 37), (1, 4, 130)])
def test_kernel_equals_causal_attention_forward_and_backward(b, h, s):
    q, k, v = qkv(b, h, s, seed=s)
    grad = torch.randn(b, h, s, 16, generator=torch.Generator().manual_seed(1))
    got = causal_attention(q, k, v)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    assert got.dtype == torch.float32 and got.shape == (b, h, s, 16)
    assert_kernel_is_sdpa(got, got_grads, q, k, v, grad)


@pytest.mark.slow
@pytest.mark.skipif("avx512f" not in (cpu_flags() or ()),
                    reason="no AVX-512 here: the native build is the AVX2 path, checked against fp64 SDPA above")
def test_avx2_build_equals_the_native_one():
    """The AVX2 path (each row in two 8-float registers, 4-query blocks; built here with
    -march=haswell) gives the AVX-512 path's attention and gradients to fp32 rounding."""
    native, avx2 = load(), load("haswell")
    g = torch.Generator().manual_seed(3)
    q, k, v, grad = (torch.randn(3, 150, 16, generator=g) for _ in range(4))
    outs = [ext.forward(q, k, v, 0.25) for ext in (native, avx2)]
    grads = [ext.backward(grad, q, k, v, *out, 0.25) for ext, out in zip((native, avx2), outs)]
    for out, g in zip(outs, grads):  # each build held to SDPA's fp64
        assert_kernel_is_sdpa(out[0], g, q, k, v, grad, scale=0.25)
    # the saved log-sum-exp (no SDPA counterpart): 16-term dot products and a 150-term sum, rounded
    # in another order: fp32 unit roundoff times those terms, within numerics.FP32_REL
    assert_fp32_close({"lse": outs[0][1]}, {"lse": outs[1][1]})


def test_kernel_takes_bf16_and_computes_in_fp32():
    """bf16 q/k/v: the result is fp32 attention of those bf16 values, rounded once to bf16
    (more accurate than bf16 SDPA, which rounds its probabilities too)."""
    q, k, v = qkv(2, 4, 100, torch.bfloat16)
    got = causal_attention(q, k, v)
    exact = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.double(), exact, atol=0, rtol=2**-8)  # one bf16 rounding of the exact value
    sdpa_bf16 = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert (got.double() - exact).abs().max() <= (sdpa_bf16.double() - exact).abs().max()
    got.float().square().sum().backward()
    assert all(t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))


def test_custom_op_passes_opcheck_and_compiles_without_graph_break():
    q, k, v = qkv(1, 2, 24)
    torch.library.opcheck(attention_op, (q, k, v))
    compiled = torch.compile(causal_attention, fullgraph=True, backend="aot_eager")  # fullgraph: no break allowed
    eager, got = causal_attention(q, k, v), compiled(q, k, v)
    assert torch.equal(eager, got)
    ge = torch.autograd.grad(eager.sum(), (q, k, v))
    gc = torch.autograd.grad(compiled(q, k, v).sum(), (q, k, v))
    assert all(torch.equal(a, c) for a, c in zip(ge, gc))


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func is attention_op._opoverload
        return func(*args, **(kwargs or {}))


def tiny_llama(n_layers: int = 2) -> Llama3:
    torch.manual_seed(0)
    model = Llama3(dim=64, n_layers=n_layers, n_heads=4, vocab_size=128, max_seq_len=32)  # heads of 16
    model.init_weights()
    return model


@pytest.mark.parametrize("mode,calls_per_block", [("none", 1), ("selective_op", 1), ("full", 2)])
def test_activation_checkpointing_saves_the_kernel_output(mode, calls_per_block):
    from titan_hydra.parallel.activation_checkpoint import checkpoint_block

    model = tiny_llama()
    assert apply_attention_kernel(model, "small_head", torch.device("cpu")).name == "small_head"
    if mode != "none":
        for block in model.layers.values():
            checkpoint_block(block, selective_op=mode == "selective_op")
    tokens = torch.randint(0, 128, (2, 32))
    with OpCounter() as counter:
        F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    assert counter.calls == calls_per_block * 2  # selective_op keeps it like a matmul; full reruns it


def kernel_faster(shape, names):
    """A probe that times the small-head kernel 2x faster than SDPA (as on an AVX-512 CPU)."""
    return {"sdpa": 2.0, "small_head": 1.0, "scores": 4.0}


def sdpa_faster(shape, names):
    """A probe that times SDPA 3x faster than the small-head kernel (as on an AVX2-only CPU)."""
    return {"sdpa": 1.0, "small_head": 3.0, "scores": 5.0}


def test_policy_installs_the_kernel_only_where_it_applies(monkeypatch, caplog):
    cpu = torch.device("cpu")
    model = tiny_llama()
    assert apply_attention_kernel(model, "auto", cpu, probe=kernel_faster) == (
        "small_head", "auto: measured 2.0x faster than sdpa on this CPU")
    attns = [m.attention for m in model.layers.values()]
    assert all(a.causal_kernel is causal_attention and a.sdpa_dtype is None for a in attns)
    tokens = torch.randint(0, 128, (2, 32))
    with OpCounter() as counter:
        model(tokens)
    assert counter.calls == 2

    # auto follows the measurement: where SDPA is faster the model keeps SDPA
    slow = tiny_llama()
    assert apply_attention_kernel(slow, "auto", cpu, probe=sdpa_faster) == (
        "sdpa", "auto: measured 3.0x faster than the small_head kernel on this CPU")
    assert all(m.attention.causal_kernel is None for m in slow.layers.values())
    # an explicit request is honoured whatever the measurement says
    assert apply_attention_kernel(tiny_llama(), "small_head", cpu, probe=sdpa_faster).name == "small_head"

    assert apply_attention_kernel(tiny_llama(), "sdpa", cpu) == ("sdpa", "set explicitly")
    ring = apply_attention_kernel(tiny_llama(), "auto", cpu, cp=2, probe=kernel_faster)  # ring attention needs SDPA
    assert ring.name == "sdpa" and "context parallel" in ring.reason
    wide = Qwen3(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=32, ffn_hidden_dim=96, vocab_size=128,
                 max_seq_len=32)
    assert apply_attention_kernel(wide, "auto", cpu, probe=kernel_faster).name == "sdpa"
    with pytest.raises(ConfigError, match=r"small_head cannot be used: it computes 16-wide heads and this model's are \[32\]"):
        apply_attention_kernel(wide, "small_head", cpu)
    with pytest.raises(ConfigError, match="context parallel"):
        apply_attention_kernel(tiny_llama(), "small_head", cpu, cp=2)
    with pytest.raises(ConfigError, match="CPU kernel and this run is on cuda"):
        apply_attention_kernel(tiny_llama(), "small_head", torch.device("cuda"))

    monkeypatch.setenv("TITAN_HYDRA_NO_KERNELS", "1")  # as on a machine without a compiler
    with caplog.at_level(logging.WARNING, logger="titan_hydra"):
        assert apply_attention_kernel(tiny_llama(), "auto", cpu, probe=kernel_faster).name == "sdpa"
    assert "TITAN_HYDRA_NO_KERNELS is set" in caplog.text
    with pytest.raises(ConfigError, match="TITAN_HYDRA_NO_KERNELS"):
        apply_attention_kernel(tiny_llama(), "small_head", cpu)


def test_auto_probe_times_both_kernels_once_per_shape(tmp_path, monkeypatch):
    """The real probe: both kernels timed at the run's shape, then read back from the cache."""
    from titan_hydra.kernels import attention_policy as ak

    monkeypatch.setenv("TITAN_HYDRA_CACHE_DIR", str(tmp_path))
    calls = []
    real = ak._time_kernels
    monkeypatch.setattr(ak, "_time_kernels", lambda *a: calls.append(a) or real(*a))
    names = ("sdpa", "small_head", "scores")
    first = ak.measured_kernel_times(ak.Shape(4, 64, torch.float32), names)
    assert set(first) == set(names) and all(t > 0 for t in first.values())
    assert ak.measured_kernel_times(ak.Shape(4, 64, torch.float32), names) == first and len(calls) == 1  # cached
    ak.measured_kernel_times(ak.Shape(4, 128, torch.float32), names)
    assert len(calls) == 2  # another length is another measurement
    choice = apply_attention_kernel(tiny_llama(), "auto", torch.device("cpu"), seq_len=64)
    assert choice.name == min(first, key=first.get) and len(calls) == 2  # the cached timing decided
    mla = ak.measured_kernel_times(ak.Shape(2, 32, torch.float32, qk=24, v=16), ("sdpa", "scores"))
    assert set(mla) == {"sdpa", "scores"} and len(calls) == 3  # MLA widths: another measurement


def test_training_with_the_kernel_tracks_sdpa(tmp_path, run_cache, capsys, caplog):
    """Same model, data and init in fp32: the kernel's losses equal SDPA's to float rounding."""
    sdpa = reference_losses(run_cache, ("training.attention_kernel=sdpa",))
    capsys.readouterr()
    with caplog.at_level(logging.INFO):
        kernel = run_single(tmp_path, ["training.attention_kernel=small_head"])
    assert "attention  small_head kernel (set explicitly), in float32" in caplog.text + capsys.readouterr().out
    assert len(kernel) == STEPS
    assert_parity(kernel, sdpa, atol=parity_bound(run_cache, ("training.attention_kernel=sdpa",)),
                  label="small_head kernel vs sdpa")


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path, caplog):
    """A build killed mid-way leaves torch's lock file, on which every later build waits forever."""
    import os
    import time

    from titan_hydra.kernels.small_head_attention import STALE_LOCK_S, _clear_stale_lock

    lock = tmp_path / "lock"
    lock.touch()
    assert not _clear_stale_lock(str(tmp_path)) and lock.exists()  # a build in progress: wait for it
    old = time.time() - STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="titan_hydra"):
        assert _clear_stale_lock(str(tmp_path)) and not lock.exists()
    assert "stale build lock" in caplog.text
    assert not _clear_stale_lock(str(tmp_path))  # nothing there: nothing to do


@pytest.mark.parametrize("qk, v, scale", [(16, 16, None), (24, 16, 0.3), (32, 48, None)])
def test_scores_kernel_equals_causal_attention(qk, v, scale):
    """The score-matrix kernel against fp64 SDPA, forward and gradients, unequal widths (MLA)."""
    g = torch.Generator().manual_seed(qk + v)
    q, k = (torch.randn(2, 3, 37, qk, generator=g).requires_grad_() for _ in range(2))
    val = torch.randn(2, 3, 37, v, generator=g).requires_grad_()
    grad = torch.randn(2, 3, 37, v, generator=g)
    scale_ = qk ** -0.5 if scale is None else scale
    got = scores_attention(q, k, val, scale=scale)
    got_grads = torch.autograd.grad(got, (q, k, val), grad)
    assert got.shape == (2, 3, 37, v)
    assert_kernel_is_sdpa(got, got_grads, q, k, val, grad, scale=scale_)


@pytest.mark.parametrize("seq, blocks", [(64, 2), (128, 4), (96, 3)])
def test_block_causal_scores_kernel(seq, blocks):
    """The lower-block-triangle kernel (forward and its own backward) against fp64 SDPA in fp32,
    MLA widths, and in bf16 against the whole-matrix kernel (the same roundings; the products
    differ only in how many zero terms they sum)."""
    g = torch.Generator().manual_seed(seq)
    q, k = (torch.randn(2, 3, seq, 24, generator=g).requires_grad_() for _ in range(2))
    val = torch.randn(2, 3, seq, 16, generator=g).requires_grad_()
    grad = torch.randn(2, 3, seq, 16, generator=g)
    got = scores_attention(q, k, val, scale=0.3, blocks=blocks)
    got_grads = torch.autograd.grad(got, (q, k, val), grad)
    assert_kernel_is_sdpa(got, got_grads, q, k, val, grad, scale=0.3)
    bf = [t.detach().bfloat16().requires_grad_() for t in (q, k, val)]
    whole = scores_attention(*bf, scale=0.3, blocks=1)
    whole_grads = torch.autograd.grad(whole, bf, grad.bfloat16())
    got = scores_attention(*bf, scale=0.3, blocks=blocks)
    got_grads = torch.autograd.grad(got, bf, grad.bfloat16())
    assert got.dtype == torch.bfloat16 and torch.equal(got, whole)
    # the same fp32 sums in another order (fewer zero terms), rounded to bf16: within one bf16 ulp
    # (2^-7 relative) of the largest gradient
    for name, a, b in zip("qkv", got_grads, whole_grads):
        assert a.dtype == torch.bfloat16, name
        assert (a.float() - b.float()).abs().max().item() <= 2**-7 * b.abs().max().item(), name


def test_scores_kernel_picks_query_blocks():
    from titan_hydra.kernels.scores_attention import query_blocks

    assert [query_blocks(s) for s in (256, 2048, 64, 96, 37, 32)] == [4, 4, 2, 2, 1, 1]


def scores_faster(shape, names):
    """A probe that times the score-matrix kernel fastest (short sequences on CPU)."""
    return {"sdpa": 3.0, "small_head": 6.0, "scores": 1.5}


def tiny_deepseek():
    from titan_hydra.models.deepseek_v3 import DeepSeekV3
    from helpers import compose_cfg
    from titan_hydra.models.registry import build_model

    cfg = compose_cfg(["model=deepseek_v3_debug", "model.n_layers=2"])
    _, model = build_model(cfg.model)
    model.init_weights("cpu")
    assert isinstance(model, DeepSeekV3)
    return model


def test_policy_times_the_scores_kernel_for_short_sequences_and_mla():
    cpu = torch.device("cpu")
    seen = []
    model = tiny_deepseek()
    picked = apply_attention_kernel(model, "auto", cpu, seq_len=256,
                                    probe=lambda shape, names: seen.append((shape, names)) or scores_faster(shape, names))
    assert picked == ("scores", "auto: measured 2.0x faster than sdpa on this CPU")
    shape, names = seen[-1]
    mla = [m for m in model.modules() if hasattr(m, "v_head_dim")]
    assert names == ("sdpa", "scores") and (shape.qk, shape.v) == (mla[0].head_dim, mla[0].v_head_dim)
    assert all(m.causal_kernel is scores_attention for m in mla)
    # past MAX_SEQ it is not a candidate; the small-head model times all three below it
    assert apply_attention_kernel(tiny_deepseek(), "auto", cpu, seq_len=1024, probe=scores_faster).name == "sdpa"
    assert apply_attention_kernel(tiny_llama(), "auto", cpu, seq_len=2048, probe=scores_faster).name == "sdpa"
    assert apply_attention_kernel(tiny_llama(), "auto", cpu, seq_len=64, probe=scores_faster).name == "scores"
    assert apply_attention_kernel(tiny_deepseek(), "auto", torch.device("cuda"), probe=scores_faster).name == "sdpa"
    assert apply_attention_kernel(tiny_deepseek(), "scores", cpu) == ("scores", "set explicitly")
    with pytest.raises(ConfigError, match="attention_kernel=scores cannot be used: context parallel"):
        apply_attention_kernel(tiny_deepseek(), "scores", cpu, cp=2)


def test_mla_with_the_scores_kernel_matches_padded_sdpa():
    """MLA hands the kernel unpadded q/k (192-wide in DeepSeek-V3) and v: same output as SDPA."""
    torch.manual_seed(0)
    a, b = tiny_deepseek(), tiny_deepseek()
    b.load_state_dict(a.state_dict())
    apply_attention_kernel(b, "scores", torch.device("cpu"))
    tokens = torch.randint(0, 128, (2, 40))
    out_a, out_b = a(tokens), b(tokens)
    # whole models have no fp64 form (norms, rotary, router in fp32): numerics.FP32_REL, fp32 unit
    # roundoff times the ~1e4 terms of two debug layers' sums
    assert_fp32_close({"logits": out_b}, {"logits": out_a})
    out_a.square().mean().backward()
    out_b.square().mean().backward()
    grads_a, grads_b = ({name: p.grad for name, p in m.named_parameters()} for m in (a, b))
    assert_fp32_close(grads_b, grads_a)
