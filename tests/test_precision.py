"""Attention precision policy: which dtype SDPA runs in, and that the model honours it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from titan_hydra.models.common.attention import Attention
from titan_hydra.models.llama3 import Llama3
from titan_hydra.models.qwen3 import Qwen3
from titan_hydra.kernels.attention_precision import apply_attention_precision, attention_dtype
from helpers import compose_cfg


@pytest.mark.parametrize("mode,mp,device,head_dim,seq_len,expected", [
    ("auto", "bf16", "cpu", 16, 256, torch.float32),   # CPU flash kernel: fp32 faster at small heads, short seqs
    ("auto", "bf16", "cpu", 16, 2048, None),           # ... but bf16 is faster from 1024 tokens on
    ("auto", "bf16", "cpu", 16, None, torch.float32),  # unknown length: the short-sequence rule
    ("auto", "bf16", "cpu", 64, 256, None),            # bf16 as fast or faster: leave it
    ("auto", "bf16", "cuda", 16, 256, None),           # GPUs: attention in the compute dtype
    ("auto", "fp32", "cpu", 16, 256, None),            # already fp32
    ("compute", "bf16", "cpu", 16, 256, None),
    ("fp32", "bf16", "cuda", 128, 8192, torch.float32),
])
def test_attention_dtype_rules(mode, mp, device, head_dim, seq_len, expected):
    assert attention_dtype(mode, mp, device, head_dim, seq_len) == expected


class KernelDtypes(TorchDispatchMode):
    """The dtypes the attention kernel really gets: recorded below autocast (which casts SDPA's
    inputs itself), so a policy that autocast silently overrides would show here."""

    def __init__(self):
        super().__init__()
        self.seen: list[torch.dtype] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.overloadpacket.__name__:
            assert args[0].dtype == args[1].dtype == args[2].dtype, func
            self.seen.append(args[0].dtype)
        return func(*args, **(kwargs or {}))


def tiny(kind: str, head_dim: int):
    if kind == "llama":  # head_dim = dim / n_heads
        return Llama3(dim=4 * head_dim, n_layers=2, n_heads=4, vocab_size=128, max_seq_len=32)
    # Qwen3: head_dim is its own field; the rule must read it, not dim / n_heads (= 16 here)
    return Qwen3(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=head_dim, ffn_hidden_dim=96,
                 vocab_size=128, max_seq_len=32)


@pytest.mark.parametrize("kind,head_dim,mode,expected", [
    ("llama", 16, "auto", torch.float32), ("llama", 16, "compute", torch.bfloat16),
    ("qwen3", 16, "auto", torch.float32), ("qwen3", 16, "compute", torch.bfloat16),
    ("qwen3", 64, "auto", torch.bfloat16),  # 64-wide heads on a 64-wide model: bf16 is fine
])
def test_model_runs_sdpa_in_chosen_dtype_under_autocast(kind, head_dim, mode, expected):
    cfg = compose_cfg(["model.dim=64", "model.n_layers=2", "model.n_heads=4",
                       "training.mixed_precision=bf16", f"training.attention_precision={mode}"])
    torch.manual_seed(0)
    model = tiny(kind, head_dim)
    model.init_weights()
    chosen = apply_attention_precision(model, str(cfg.training.attention_precision), "bf16", torch.device("cpu"),
                                       int(cfg.training.seq_len))
    assert chosen == (None if expected == torch.bfloat16 else expected)
    tokens = torch.randint(0, 128, (2, 32))
    with torch.autocast("cpu", dtype=torch.bfloat16), KernelDtypes() as kernels:
        logits = model(tokens)
    assert kernels.seen == [expected, expected]  # one call per block, in the chosen dtype
    assert logits.dtype == torch.bfloat16  # the rest of the block stays in the compute dtype
    F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten()).backward()
    wq = model.layers["0"].attention.wq.weight.grad
    assert wq is not None and wq.dtype == torch.float32 and wq.abs().sum() > 0


def test_fp32_attention_is_fp32_sdpa_of_the_bf16_inputs():
    """Upcast attention equals fp32 SDPA of the same bf16 q/k/v, cast back to bf16 (bit-exact)."""
    torch.manual_seed(0)
    attn = Attention(64, 4, 4, 16)
    q, k, v = (torch.randn(2, 4, 16, 16).to(torch.bfloat16) for _ in range(3))
    attn.sdpa_dtype = torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn._sdpa(q, k, v)
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    # q/k already fp32 but autocast still on (fp32-weighted QK-norm would do that): still fp32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = attn._sdpa(q.float(), k.float(), v)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    attn.sdpa_dtype = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = attn._sdpa(q, k, v)
    assert not torch.equal(plain, want)  # bf16 attention rounds differently: the knob matters


def test_bad_attention_precision_rejected_while_composing():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="attention_precision=fp16"):
        compose_cfg(["training.attention_precision=fp16"])
