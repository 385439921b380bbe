"""Mixture-of-Experts: the router's choices, the experts' maths against a per-token reference,
load balancing, the auxiliary loss's gradient, the Qwen3-MoE shapes against transformers, and a
short qwen3_moe_debug training run."""

from __future__ import annotations

import copy
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from titan_hydra.spec import spec_of
from helpers import compose_cfg, read_metrics

from titan_hydra.errors import ConfigError
from titan_hydra.kernels import grouped_mm
from titan_hydra.kernels.grouped_mm import grouped_mm_works
from titan_hydra.models.common.moe import (
    GroupedExperts, MoE, MoEArgs, TokenChoiceRouter, bucket_counts, grouped_swiglu, looped_swiglu, set_aux_grad_scale,
)
from titan_hydra.models.gpt_oss.model import GptOssExperts
from titan_hydra.models.registry import args_of
from titan_hydra.parallel.activation_checkpoint import checkpoint_block
from titan_hydra.train.moe_balance import balance_step, moe_balance_hooks

from numerics import assert_fp32_close, assert_fp32_only, assert_same_function

F32, F64 = torch.float32, torch.float64
EPS32 = torch.finfo(F32).eps
# the balancing step: elementwise operations and 8-term means on biases of at most 0.02, in fp32:
# an 8-term sum loses at most 8 u of its terms' sizes (u = eps / 2), so 8 eps of 0.02
BIAS_ATOL = 8 * EPS32 * 0.02


def make_moe(seed: int = 0, dim: int = 32, **moe) -> MoE:
    torch.manual_seed(seed)
    m = MoE(dim, MoEArgs(**{"num_experts": 8, "top_k": 2, "expert_dim": 16, **moe}))
    m.init_weights(out_std=0.1, in_std=0.3)  # large enough that outputs and gates are O(1)
    return m


# ------------------------------------------------------------------------------- router


def router_with(**moe) -> TokenChoiceRouter:
    return TokenChoiceRouter(4, MoEArgs(**{"num_experts": 8, "top_k": 2, "expert_dim": 4, **moe}))


def test_group_limited_routing_chooses_within_the_best_groups():
    # groups of 2: sums of the two best per group: g0 0.9, g1 1.0, g2 0.6, g3 0.85
    scores = torch.tensor([[0.9, 0.0, 0.55, 0.45, 0.3, 0.3, 0.8, 0.05]])
    _, free = router_with().choose(scores)
    assert sorted(free[0].tolist()) == [0, 6]  # global top-2
    limited = router_with(num_expert_groups=4, num_limited_groups=2)
    gates, chosen = limited.choose(scores)
    assert sorted(chosen[0].tolist()) == [0, 2]  # expert 6 (0.8) lives in the third-best group
    assert torch.equal(gates, scores.gather(1, chosen))
    _, all_groups = router_with(num_expert_groups=4, num_limited_groups=4).choose(scores)
    assert sorted(all_groups[0].tolist()) == [0, 6]


def test_expert_bias_changes_the_choice_not_the_gates():
    torch.manual_seed(0)
    router = router_with()
    scores = torch.rand(16, 8)
    gates, chosen = router.choose(scores)
    bias = torch.zeros(8)
    bias[5] = 10.0  # every token now takes expert 5
    b_gates, b_chosen = router.choose(scores, bias)
    assert (b_chosen == 5).any(dim=1).all() and not torch.equal(b_chosen, chosen)
    assert torch.equal(b_gates, scores.gather(1, b_chosen))  # unbiased scores of the biased choice
    # a constant bias moves nothing
    assert torch.equal(router.choose(scores, torch.full((8,), 3.0))[1], chosen)


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_scores_are_fp32_and_gates_are_normed_then_scaled(score_func):
    torch.manual_seed(0)
    router = router_with(score_func=score_func, route_norm=False)
    x = torch.randn(10, 4, dtype=torch.bfloat16)
    scores = router.scores(x)
    expected = {dtype: reference_scores(router.gate.weight.to(dtype), x.to(dtype), score_func) for dtype in (F32, F64)}
    assert scores.dtype == torch.float32
    assert_fp32_only({"scores": scores}, {"scores": expected[F32]}, {"scores": expected[F64]})
    gates, chosen, counts = router(x)
    assert torch.equal(gates, scores.topk(2, dim=-1).values) and gates.dtype == torch.float32
    assert counts.tolist() == torch.bincount(chosen.flatten(), minlength=8).tolist() and counts.sum() == 20
    normed = router_with(score_func=score_func, route_norm=True, route_scale=2.5)
    normed.load_state_dict(router.state_dict())
    n_gates, n_chosen, _ = normed(x)
    assert torch.equal(n_chosen, chosen)
    # elementwise from the same fp32 gates: a sum of two, a division, a product, each rounded by at
    # most half an ulp (2^-24 relative), in either order: within 4 ulps (4 eps) of the 2.5 they sum to
    assert torch.allclose(n_gates.sum(-1), torch.full((10,), 2.5), atol=4 * EPS32 * 2.5, rtol=0)
    assert torch.allclose(n_gates, 2.5 * gates / gates.sum(-1, keepdim=True), atol=4 * EPS32 * 2.5, rtol=0)


def test_bad_moe_args_are_one_line_config_errors():
    base = ["model=qwen3_moe_debug"]
    for override, msg in [("model.moe.top_k=9", "top_k=9 must be between 1 and model.moe.num_experts=8"),
                          ("model.moe.num_expert_groups=3", "num_expert_groups=3 must divide"),
                          ("model.moe.score_func=relu", "score_func='relu' must be one of softmax, sigmoid")]:
        with pytest.raises(ConfigError, match=msg) as err:
            args_of(compose_cfg(base + [override]).model)
        assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------- experts


def reference_scores(gate: torch.Tensor, x: torch.Tensor, score_func: str = "softmax") -> torch.Tensor:
    """The router's scores written out, in x's dtype (the router's own are fp32 whatever the dtype)."""
    logits = x @ gate.T
    return logits.softmax(-1) if score_func == "softmax" else logits.sigmoid()


def dense_reference(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax (or sigmoid) of the gate, top-k, sum of gate x SwiGLU expert, + shared.
    Plain operations only, so it has an fp64 form (the MoE layer scores and combines in fp32)."""
    out = torch.zeros_like(x)
    w1, w2, w3 = m.experts.w1, m.experts.w2, m.experts.w3
    for t in range(x.shape[0]):
        probs = reference_scores(m.router.gate.weight, x[t], m.args.score_func)
        top = probs.topk(m.args.top_k)
        gates = top.values / top.values.sum() if m.args.route_norm else top.values
        for g, e in zip(gates, top.indices):
            out[t] += g * (w2[e] @ (F.silu(w1[e] @ x[t]) * (w3[e] @ x[t])))
        if m.shared_experts is not None:
            out[t] += m.shared_experts(x[t])
    return out


def reference_grads(m: MoE, x: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
                    aux_coeff: float = 0.0) -> dict[str, torch.Tensor]:
    """The per-token reference on a ``dtype`` copy of m (plus aux_coeff x the explicit aux loss):
    its output and the gradients of (out * g).sum() [+ aux] for x and m's parameters, by name."""
    ref = copy.deepcopy(m).to(dtype)
    xi = x.to(dtype).requires_grad_()
    b, s, d = x.shape
    out = dense_reference(ref, xi.view(-1, d)).view(b, s, d)
    loss = (out * g.to(dtype)).sum()
    if aux_coeff:
        scores = reference_scores(ref.router.gate.weight, xi.view(-1, d), ref.args.score_func)
        chosen = scores.topk(ref.args.top_k, dim=-1).indices
        loss = loss + aux_coeff * explicit_aux_loss(scores.view(b, s, -1), chosen.view(b, s, -1), ref.args.num_experts)
    names, params = zip(*ref.named_parameters())
    grads = torch.autograd.grad(loss, (xi, *params))
    return {"out": out.detach(), **dict(zip(("x", *names), grads))}


def module_grads(m: MoE, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    xi = x.clone().requires_grad_()
    y = m(xi)
    names, params = zip(*m.named_parameters())
    grads = torch.autograd.grad((y * g).sum(), (xi, *params))
    return {"out": y.detach(), **dict(zip(("x", *names), grads))}


def test_grouped_mm_probe_is_not_fooled_by_no_grad_or_autocast(monkeypatch):
    """The probe runs once, often from init_weights under no_grad (a backward there would fail
    and silently route every run through the loop): it must give the eager answer anyway."""
    monkeypatch.setattr(grouped_mm, "_GROUPED_MM_WORKS", {})
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), torch.device("meta"):
        inside = grouped_mm_works(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(grouped_mm, "_GROUPED_MM_WORKS", {})
    assert inside is True and grouped_mm_works(torch.device("cpu"), torch.float32) is True


def test_grouped_mm_equals_loop_equals_per_token_reference():
    grouped = make_moe(num_shared_experts=1, route_norm=True)
    looped = make_moe(num_shared_experts=1, route_norm=True, use_grouped_mm=False)
    looped.load_state_dict(grouped.state_dict())
    assert grouped_mm_works(torch.device("cpu"), torch.float32)  # the path under test really is grouped
    x = torch.randn(3, 7, 32)
    g = torch.randn(3, 7, 32)
    ours = [module_grads(m, x, g) for m in (grouped, looped)]
    ref32, ref64 = (reference_grads(grouped, x, g, dtype) for dtype in (F32, F64))
    assert ref64["out"].abs().mean() > 1e-2 and len(ref64) == 9  # out, x, gate, routed and shared w1 w2 w3
    for got in ours:  # the layer scores and combines in fp32: held to the reference's fp64
        assert got.keys() == ref64.keys()
        assert_fp32_only(got, ref32, ref64)
    assert ours[0]["experts.w1"].abs().sum() > 0 and ours[0]["router.gate.weight"].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_kernel_equals_loop_with_empty_experts(dtype):
    torch.manual_seed(0)
    experts = GroupedExperts(16, 8, 4)
    experts.init_weights(0.3, 0.3)
    w = [p.detach().to(dtype) for p in (experts.w1, experts.w2, experts.w3)]
    counts = torch.tensor([3, 0, 6, 1])  # one expert gets nothing
    x = torch.randn(10, 16, dtype=dtype)
    a, b = grouped_swiglu(x, *w, counts), looped_swiglu(x, *w, counts)
    assert a.dtype == dtype
    if dtype == torch.float32:  # grouped_mm has no fp64 form on CPU: held to the loop's
        assert_fp32_only({"out": a}, {"out": b}, {"out": looped_swiglu(x.double(), *(t.double() for t in w), counts)})
    else:  # each rounds the two projections, the SiLU, their product and the output to bf16 (2^-8
        # relative each, through gains of O(1)): five bf16 roundings of the largest value
        assert (a.float() - b.float()).abs().max() <= 5 * 2**-8 * b.float().abs().max()


def test_bucket_counts_bound_the_shapes_and_the_padding():
    counts = torch.arange(0, 20000)
    padded = bucket_counts(counts)
    assert padded[0] == 0 and bool((padded >= counts).all()) and bool((padded % 32 == 0).all())
    big = counts >= 256
    assert float(((padded - counts)[big] / counts[big]).max()) <= 0.125
    assert len(set(padded.tolist())) <= 8 * math.ceil(math.log2(20000 / 256)) + 256 // 32 + 1


@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
@pytest.mark.parametrize("grouped", [True, False])
def test_bucketed_rows_give_the_unpadded_outputs_and_gradients(kind, grouped):
    """On CPU in bf16 the experts pad each expert's rows to a bucketed count (memory stays flat);
    forced on in fp32 here, outputs and every gradient must equal the unpadded run's."""
    torch.manual_seed(0)
    make = GroupedExperts if kind == "swiglu" else GptOssExperts
    experts = make(16, 8, 4, use_grouped_mm=grouped)
    experts.init_weights(0.3, 0.3)
    if kind == "gpt_oss":
        for b in (experts.w1_bias, experts.w3_bias, experts.w2_bias):
            torch.nn.init.normal_(b, std=0.3)  # nonzero biases: padded rows give nonzero outputs
    counts = torch.tensor([3, 0, 70, 1])  # an empty expert and one past the first bucket
    x, g = torch.randn(74, 16), torch.randn(74, 16)

    def compute(dtype):  # fp64: the loop (grouped_mm has no fp64 form on CPU), the same function
        results = []
        model = copy.deepcopy(experts).to(dtype)
        for pads in (True, False):
            model.bucket_rows = pads
            xi = x.to(dtype).requires_grad_()
            y = model(xi, counts)
            names, params = zip(*model.named_parameters())
            grads = torch.autograd.grad((y * g.to(dtype)).sum(), (xi, *params))
            results.append({"out": y.detach(), **dict(zip(("x", *names), grads))})
        return results

    padded, plain = compute(F32)
    assert padded.keys() == plain.keys() and all(padded[k].shape == plain[k].shape for k in plain)
    assert_same_function(compute)
    assert plain["out"].abs().mean() > 1e-2


# ------------------------------------------------------------------------------- balancing


def test_counts_only_in_training_and_balance_step():
    m = make_moe(load_balance_coeff=0.01)
    x = torch.randn(2, 5, 32)
    m.eval()
    m(x)
    assert m.tokens_per_expert.sum() == 0
    m.train()
    m(x)
    m(x)
    assert m.tokens_per_expert.sum() == 2 * 10 * 2
    # two layers with set loads: layer 0 with one overloaded expert, layer 1 with two idle ones
    parts = [torch.nn.ModuleDict({"layers": torch.nn.ModuleDict({"0": make_moe(load_balance_coeff=0.01),
                                                                  "1": make_moe(load_balance_coeff=0.0)})})]
    layer0, layer1 = parts[0]["layers"]["0"], parts[0]["layers"]["1"]
    layer0.tokens_per_expert.copy_(torch.tensor([10.0, 2, 2, 2, 2, 2, 2, 2]))  # mean 3
    layer1.tokens_per_expert.copy_(torch.tensor([0.0, 0, 4, 4, 4, 4, 4, 4]))  # mean 3
    metrics = balance_step(parts)
    # each an fp32 quotient of exact small counts: one rounding, half an ulp
    assert metrics["moe/layer0/max_over_mean"] == pytest.approx(10 / 3, rel=EPS32)
    assert metrics["moe/layer1/max_over_mean"] == pytest.approx(4 / 3, rel=EPS32)
    assert metrics["moe/max_over_mean"] == pytest.approx(10 / 3, rel=EPS32) and metrics["moe/idle_frac"] == 2 / 16
    # expert 0 (above the mean) pushed down by the coefficient, the rest up, then recentred to mean 0
    expected = 0.01 * torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, 1])
    expected -= expected.mean()
    assert torch.allclose(layer0.expert_bias, expected, rtol=0, atol=BIAS_ATOL)
    assert layer0.expert_bias.sum().abs() <= 8 * EPS32 * 8 * 0.01  # 8 centred values: 8 eps of their sizes (0.08)
    assert torch.equal(layer1.expert_bias, torch.zeros(8))  # coefficient 0: bias stays
    assert layer0.tokens_per_expert.sum() == 0 and layer1.tokens_per_expert.sum() == 0
    # scale-invariant: a load scaled by a constant reports and moves the same
    layer0.tokens_per_expert.copy_(torch.tensor([20.0, 4, 4, 4, 4, 4, 4, 4]))
    layer1.tokens_per_expert.copy_(torch.tensor([0.0, 0, 8, 8, 8, 8, 8, 8]))
    assert balance_step(parts) == metrics
    assert torch.allclose(layer0.expert_bias, 2 * expected, rtol=0, atol=BIAS_ATOL)
    assert balance_step(parts) == {}  # no tokens counted: nothing to report


def test_balance_hook_only_for_models_with_moe_layers():
    """The trainer's step hook: none for a dense model (or a pipeline stage without MoE layers);
    for an MoE model one balancing step over what the forwards counted."""
    assert moe_balance_hooks([torch.nn.Linear(4, 4)], None) == []
    m = make_moe(load_balance_coeff=0.01)
    m.train()
    m(torch.randn(2, 5, 32))
    hooks = moe_balance_hooks([m], None)
    assert len(hooks) == 1
    metrics = hooks[0]()
    assert metrics["moe/max_over_mean"] >= 1.0 and m.tokens_per_expert.sum() == 0
    assert m.expert_bias.abs().sum() > 0  # the bias moved


@pytest.mark.parametrize("mode", ["full", "selective_op"])
def test_activation_checkpoint_recompute_does_not_count_tokens_again(mode):
    """A checkpointed MoE reruns its forward in the backward; the load it counts is still that of
    one forward (before: twice, which the sign-based bias update and the ratios hid)."""
    x = torch.randn(2, 5, 32)
    plain, ckpt = make_moe(), make_moe()
    checkpoint_block(ckpt, selective_op=mode == "selective_op")
    for m in (plain, ckpt):
        m.train()
        m(x).square().sum().backward()
    assert plain.tokens_per_expert.sum() == 2 * 5 * 2
    assert torch.equal(ckpt.tokens_per_expert, plain.tokens_per_expert)
    assert torch.equal(ckpt.router.gate.weight.grad, plain.router.gate.weight.grad)


def test_balance_step_sums_counts_over_the_group(monkeypatch):
    """Counts are summed over the data-parallel group before the bias moves: this rank's
    [6, 0, ...] plus a peer's [0, 2, 2, ...] (all_reduce stood in for by the peer's addition)."""
    m = make_moe(load_balance_coeff=0.01)
    m.tokens_per_expert.copy_(torch.tensor([6.0, 0, 0, 0, 0, 0, 0, 0]))
    peer = torch.tensor([0.0, 2, 2, 2, 2, 2, 2, 2])
    seen = []

    def all_reduce(t, group=None):
        seen.append(group)
        t += peer

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    metrics = balance_step([m], SimpleNamespace(get_group=lambda: "dp_cp group"))  # a DeviceMesh-like
    assert seen == ["dp_cp group"]
    # summed load [6, 2 x 7]: mean 2.5, so only expert 0 is over the mean
    expected = 0.01 * torch.tensor([-1.0, 1, 1, 1, 1, 1, 1, 1])
    expected -= expected.mean()
    assert torch.allclose(m.expert_bias, expected, rtol=0, atol=BIAS_ATOL)
    assert metrics["moe/max_over_mean"] == pytest.approx(6 / 2.5, rel=EPS32) and metrics["moe/idle_frac"] == 0.0


def explicit_aux_loss(scores: torch.Tensor, chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss, written out per sequence and expert."""
    total = 0.0
    b, s, k = chosen.shape
    for i in range(b):
        norm = scores[i] / scores[i].sum(-1, keepdim=True)
        for e in range(n_experts):
            f = n_experts / (k * s) * (chosen[i] == e).sum()
            total = total + f * norm[:, e].mean()
    return total / b


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_aux_loss_gradient_equals_autograd_of_the_explicit_loss(score_func):
    coeff = 0.5
    injected = make_moe(aux_loss_coeff=coeff, score_func=score_func, load_balance_coeff=0.0)
    plain = make_moe(aux_loss_coeff=0.0, score_func=score_func, load_balance_coeff=0.0)
    plain.load_state_dict(injected.state_dict())
    x, g = torch.randn(3, 6, 32), torch.randn(3, 6, 32)
    (injected(x) * g).sum().backward()
    (plain(x) * g).sum().backward()
    without_aux = plain.router.gate.weight.grad.clone()
    plain.zero_grad()
    scores = plain.router.scores(x.view(-1, 32))
    chosen = plain.router.choose(scores, plain.expert_bias)[1]
    aux = explicit_aux_loss(scores.view(3, 6, 8), chosen.view(3, 6, 2), 8)
    ((plain(x) * g).sum() + coeff * aux).backward()
    got, want = injected.router.gate.weight.grad, plain.router.gate.weight.grad
    # both held to the per-token reference with the explicit loss, which has an fp64 form
    ref32, ref64 = ({"gate": reference_grads(plain, x, g, dtype, aux_coeff=coeff)["router.gate.weight"]}
                    for dtype in (F32, F64))
    assert_fp32_only({"gate": got}, ref32, ref64)
    assert_fp32_only({"gate": want}, ref32, ref64)
    assert (want - without_aux).abs().max() > 1e-3  # the aux term is really there
    assert torch.equal(injected.experts.w1.grad, plain.experts.w1.grad)  # experts do not see it
    # eval forwards and no-grad forwards add nothing
    injected.eval()
    assert torch.equal(injected(x), plain.eval()(x))


def test_aux_grad_scale_makes_accumulation_equal_one_batch():
    """Two accumulated microbatches (loss / 2, aux_grad_scale 1/2) give the gradient of one batch."""
    one, two = make_moe(aux_loss_coeff=0.5), make_moe(aux_loss_coeff=0.5)
    two.load_state_dict(one.state_dict())
    set_aux_grad_scale([two], 0.5)
    x, g = torch.randn(4, 6, 32), torch.randn(4, 6, 32)
    (one(x) * g).sum().backward()
    for half in (slice(0, 2), slice(2, 4)):
        (two(x[half]) * g[half]).sum().backward()  # sum over tokens: no 1/2 on the main term
    # both held to the whole batch's per-token reference with the explicit loss (an fp64 form)
    ref32, ref64 = ({"gate": reference_grads(one, x, g, dtype, aux_coeff=0.5)["router.gate.weight"]}
                    for dtype in (F32, F64))
    assert_fp32_only({"gate": one.router.gate.weight.grad}, ref32, ref64)
    assert_fp32_only({"gate": two.router.gate.weight.grad}, ref32, ref64)
    set_aux_grad_scale([two], 1.0)
    two.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        (two(x[half]) * g[half]).sum().backward()
    assert (one.router.gate.weight.grad - two.router.gate.weight.grad).abs().max() > 1e-3


# ------------------------------------------------------------------------------- Qwen3-MoE shapes

# Published config.json values (Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B) and our counts.
PUBLISHED = {
    "qwen3_30b_a3b": (dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                           intermediate_size=6144, moe_intermediate_size=768), 30_532_122_624, 3_353_032_704),
    "qwen3_235b_a22b": (dict(hidden_size=4096, num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4,
                             intermediate_size=12288, moe_intermediate_size=1536), 235_093_634_560, 22_190_763_520),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_equal_transformers(name):
    transformers = pytest.importorskip("transformers")  # here: spawned ranks import this module
    hf_fields, total, active = PUBLISHED[name]
    cfg = transformers.Qwen3MoeConfig(vocab_size=151936, head_dim=128, num_experts=128, num_experts_per_tok=8,
                                      norm_topk_prob=True, max_position_embeddings=40960, rope_parameters={
                                          "rope_type": "default", "rope_theta": 1e6}, **hf_fields)
    with torch.device("meta"):
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    hf_total = sum(p.numel() for p in hf.parameters())
    hf_experts = sum(p.numel() for n, p in hf.named_parameters() if ".mlp.experts." in n)
    family, args = args_of(compose_cfg([f"model={name}"]).model)
    s = family.shape(args)
    assert s.params == hf_total == total
    assert s.expert_params == hf_experts and s.active_params == hf_total - hf_experts * 120 // 128 == active
    assert (s.n_experts, s.top_k, s.moe_layers, s.ffn_dim) == (128, 8, hf_fields["num_hidden_layers"],
                                                               8 * hf_fields["moe_intermediate_size"])
    # FLOPs use the active parameters (the embedding lookup is no matmul)
    attention = 12 * s.n_layers * s.n_heads * s.head_dim * 4096
    assert family.flops_per_token(args, 4096) == 6 * (active - s.embedding_params) + attention
    assert family.hf.args_from_hf_config(family.hf.hf_config(args)) == args


def test_family_rules_signature_and_dense_layers():
    family, args = args_of(compose_cfg(["model=qwen3_moe_debug"]).model)
    with pytest.raises(ConfigError, match="tp=2 is not supported for Mixture-of-Experts") as err:
        family.check(args, SimpleNamespace(tp=2, pp=1), 128)
    assert "\n" not in str(err.value)
    family.check(args, SimpleNamespace(tp=1, pp=4), 128)
    sig = family.signature(args)
    assert family.signature(dataclasses.replace(args, max_seq_len=64)) == sig
    assert family.signature(dataclasses.replace(args, moe=dataclasses.replace(args.moe, aux_loss_coeff=0.1))) == sig
    for moe_change in ({"num_experts": 4}, {"top_k": 1}, {"expert_dim": 64}, {"num_shared_experts": 1},
                       {"score_func": "sigmoid"}):
        assert family.signature(dataclasses.replace(args, moe=dataclasses.replace(args.moe, **moe_change))) != sig
    assert family.signature(dataclasses.replace(args, n_dense_layers=1)) != sig
    # first-k dense: a SwiGLU of ffn_hidden_dim instead of the experts in layer 0
    _, dense1 = args_of(compose_cfg(["model=qwen3_moe_debug", "model.n_dense_layers=1"]).model)
    s0, s1 = family.shape(args), family.shape(dense1)
    assert (s0.moe_layers, s1.moe_layers) == (4, 3) and s0.ffn_dim == 256 and s1.ffn_dim == 768
    expert_layer = 3 * 8 * 128 * 256 + 8 * 256  # experts + router
    assert s1.params - s0.params == 3 * 256 * 768 - expert_layer
    assert s0.expert_params == 4 * 3 * 8 * 128 * 256 and s0.active_params == s0.params - s0.expert_params * 3 // 4
    assert family.make_args(family.args_fields(dense1)) == dense1


# ------------------------------------------------------------------------------- training


def test_qwen3_moe_debug_trains_with_balance_metrics(tmp_path):
    """20 steps of the debug flavor with both balancing mechanisms on: the loss falls, the step
    hook logs the load metrics, the bias moved and stayed centred. Measured (4 layers, seq 128,
    batch 4): 8.07 -> 7.14 (first/last 3-step means 8.07 / 7.15)."""
    from titan_hydra.train.pretrain import run

    cfg = compose_cfg(["model=qwen3_moe_debug", "model.moe.load_balance_coeff=0.001", "logger=minimal",
                       "training.val_freq=0", "cluster.threads_per_proc=1", "training.steps=20",
                       "training.seq_len=128", "training.local_batch_size=4", "data.max_documents=200",
                       "lr_scheduler.warmup_steps=2"])
    out = run(spec_of(cfg), str(tmp_path / "run"), return_state=True)
    losses = out["losses"]
    assert len(losses) == 20 and all(math.isfinite(v) for v in losses)
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert math.log(2048) - 0.2 < losses[0] < math.log(2048) + 1.0 and last < first - 0.5, (first, last)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    for r in rows:
        assert r["moe/max_over_mean"] >= 1.0 and 0.0 <= r["moe/idle_frac"] < 1.0, r
        assert r["moe/max_over_mean"] == max(r[f"moe/layer{i}/max_over_mean"] for i in range(4))
    for i in range(4):
        bias = out["full_state"][f"layers.{i}.feed_forward.expert_bias"]
        assert bias.abs().max() > 0 and bias.sum().abs() < 1e-5, bias


# ------------------------------------------------------------------------------- HF layout corner cases


def tiny_qwen3_moe(**moe):
    from titan_hydra.models.qwen3_moe import FAMILY, Qwen3Moe

    torch.manual_seed(0)
    model = Qwen3Moe(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_hidden_dim=64, vocab_size=64,
                     max_seq_len=32, moe={"num_experts": 4, "top_k": 2, "expert_dim": 16, "route_norm": True, **moe})
    model.init_weights()
    return FAMILY, model


def test_hf_export_refuses_routing_hf_cannot_express():
    from titan_hydra.models.common.hf_decoder import HFConversionError

    family, model = tiny_qwen3_moe(load_balance_coeff=0.01)
    assert [n for n, _ in family.expert_modules(model)] == ["layers.0.feed_forward.experts",
                                                           "layers.1.feed_forward.experts"]
    sd = model.state_dict()
    assert sum(k.endswith(".mlp.experts.3.down_proj.weight") for k in family.hf.to_hf_state(sd, model.args)) == 2
    sd["layers.1.feed_forward.expert_bias"] = torch.tensor([0.01, -0.01, 0.0, 0.0])
    with pytest.raises(HFConversionError, match="expert_bias is non-zero .* export needs load_balance_coeff=0") as err:
        family.hf.to_hf_state(sd, model.args)
    assert "\n" not in str(err.value)
    sig = dataclasses.replace(model.args, moe=dataclasses.replace(model.args.moe, score_func="sigmoid"))
    with pytest.raises(HFConversionError, match="softmax top-k only; this model has score_func=sigmoid"):
        family.hf.hf_config(sig)


def test_hf_fused_in_memory_layout_imports_too():
    """transformers keeps experts fused in memory (gate_up_proj [E, 2h, d], down_proj); a state
    dict in that layout loads to the same logits as HF's."""
    transformers = pytest.importorskip("transformers")
    from titan_hydra.models.qwen3_moe import FAMILY

    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
                                      max_position_embeddings=32, initializer_range=0.2)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    sd = hf.state_dict()
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    args = FAMILY.hf.args_from_hf_config(cfg.to_dict())
    ours = FAMILY.build(args).eval()
    ours.load_state_dict(FAMILY.hf.from_hf_state(sd, args))
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_fp32_close({"logits": ours(tokens)}, {"logits": hf(tokens).logits})  # no fp64 forms
