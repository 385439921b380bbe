"""``model=hf`` MoE architectures: the router's auxiliary loss and the ``moe/*`` load metrics.

The aux loss is transformers' own switch (``+model.fields.output_router_logits=true``, weight
``router_aux_loss_coef``): the loss plus the aux term, and every parameter's gradient, are those of
transformers' model given labels, bit for bit (same weights, same batch, fp32). Under ep(2) and
fsdp(2) the run equals one process: the aux loss sums the ranks' top-k choices (models/hf/router.py),
so each step's value (``moe/aux_loss``) and gradient are the global batch's. The load metrics count
what the experts modules were called with, which for mixtral is the top-k of transformers' router
logits, and the counts summed over the data-parallel ranks equal one process's. The same parity
holds for qwen2_moe, granitemoe, phimoe, jetmoe and jamba from tiny fields.
"""

from __future__ import annotations

import pytest
import torch

from titan_hydra.errors import ConfigError
from titan_hydra.models.objective import cross_entropy_loss
from titan_hydra.spec import spec_of
from titan_hydra.train.moe_balance import balance_step
from titan_hydra.validate import validate
from helpers import base_for, compose_cfg, machine_bound, run_layout, run_single, series

SMALL = ["model.fields.hidden_size=64", "model.fields.intermediate_size=128", "model.fields.num_hidden_layers=4",
         "model.fields.num_attention_heads=4", "model.fields.num_key_value_heads=2"]
COEF = 0.02  # mixtral's default (0.001) moves the loss by ~1e-3 of the cross entropy; 0.02 makes the term plain
AUX = ["+model.fields.output_router_logits=true", f"+model.fields.router_aux_loss_coef={COEF}"]
METRICS = ("loss", "moe/aux_loss", "moe/max_over_mean", "moe/idle_frac", *(f"moe/layer{i}/max_over_mean" for i in range(4)))


def overrides(arch: str, *extra: str) -> list[str]:
    return [f"model=hf_{arch}_debug", *SMALL, *extra]


def built(arch: str, *extra: str):
    spec = spec_of(compose_cfg(base_for(["model=hf_"]) + overrides(arch, *extra)))
    model = spec.family.build(spec.model_args)
    torch.manual_seed(0)
    model.init_weights()
    return spec, model.train()


def batch(vocab_size: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab_size, (2, 25), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "olmoe"])
def test_aux_loss_is_transformers_own(arch):
    """Our cross entropy + coef x ``moe/aux_loss`` is transformers' loss with output_router_logits=True
    and labels, and the gradient our backward of the cross entropy alone leaves (the aux term rides
    on the logits) is the gradient of transformers' loss: the same operations in the same order, so
    equal bit for bit. Without the aux loss the gradients differ (the check can fail)."""
    spec, ours = built(arch, *AUX)
    grads = assert_transformers_own(ours, spec.model_args.hf_config, spec.model_args.vocab_size)
    _, plain = built(arch)
    x, y = batch(spec.model_args.vocab_size)
    cross_entropy_loss(plain(x), y).backward()
    router = next(n for n, _ in plain.named_parameters() if ".gate." in n or ".router." in n)
    assert not torch.equal(dict(plain.named_parameters())[router].grad, grads[router].grad)


# Architectures without a debug flavor, from tiny fields (transformers' names for each: JetMoE calls
# its coefficient aux_loss_coef and routes attention heads as well as the MLP; Jamba mixes Mamba layers in).
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "num_experts_per_tok": 2, "output_router_logits": True}
OWN = {"qwen2_moe": {"num_experts": 4, "moe_intermediate_size": 64, "shared_expert_intermediate_size": 64},
       "granitemoe": {"num_local_experts": 4}, "phimoe": {"num_local_experts": 4},
       "jetmoe": {"num_local_experts": 4, "head_dim": 16, "aux_loss_coef": COEF},
       "jamba": {"num_experts": 4, "mamba_d_state": 8, "mamba_d_conv": 4}}


@pytest.mark.parametrize("arch", sorted(OWN))
def test_aux_loss_is_transformers_own_from_tiny_fields(arch):
    """The same for the other MoE architectures transformers ships with a router aux loss (PhiMoE
    samples its routes in training: both forwards start from one seed)."""
    from titan_hydra.models.hf.model import causal_lm

    fields = {**TINY, **OWN[arch], **({} if arch == "jetmoe" else {"router_aux_loss_coef": COEF})}
    ours = causal_lm(model_type=arch, fields=fields)
    torch.manual_seed(0)
    ours.init_weights()
    assert_transformers_own(ours.train(), ours.config, 512)


def assert_transformers_own(ours, config, vocab_size: int) -> dict:
    """Loss and every gradient of ``ours`` (training forward, aux loss on) equal transformers' own
    model's with labels, on the same weights and batch; returns transformers' parameters."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_config(config).train()
    ref.load_state_dict(ours.state_dict())
    x, y = batch(vocab_size)
    torch.manual_seed(5)
    ce = cross_entropy_loss(ours(x), y)
    ce.backward()
    aux = balance_and_aux(ours)["moe/aux_loss"]
    torch.manual_seed(5)
    out = ref(input_ids=x, labels=y, shift_labels=y)
    out.loss.backward()
    assert aux == out.aux_loss.item() and aux > 1.0  # E * sum f P >= 1 (even routing)
    assert (ce + COEF * torch.tensor(aux)).item() == out.loss.item()
    grads = dict(ref.named_parameters())
    for name, p in ours.named_parameters():
        assert torch.equal(p.grad, grads[name].grad), name
    return grads


def test_aux_loss_weighs_like_the_microbatch_loss():
    """Under accumulation the runner scales each microbatch's loss by 1 / N (``set_loss_scale``): the
    aux term takes the same weight, so N microbatches of the same batch leave one batch's gradient
    and ``moe/aux_loss`` (the mean over the step's microbatches; sums in another order: fp32 close)."""
    spec, once = built("mixtral", *AUX)
    _, twice = built("mixtral", *AUX)
    x, y = batch(spec.model_args.vocab_size)
    cross_entropy_loss(once(x), y).backward()
    spec.family.set_loss_scale([twice], 0.5)
    for _ in range(2):
        (cross_entropy_loss(twice(x), y) * 0.5).backward()
    assert balance_and_aux(twice)["moe/aux_loss"] == pytest.approx(balance_and_aux(once)["moe/aux_loss"], rel=1e-6)
    grads = dict(once.named_parameters())
    for name, p in twice.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-5, atol=1e-7)
    spec.family.set_loss_scale([twice], 1.0)
    twice.zero_grad()
    for _ in range(2):  # the aux term left unweighted counts twice: the check above can fail
        (cross_entropy_loss(twice(x), y) * 0.5).backward()
    router = "model.layers.0.mlp.gate.weight"
    assert not torch.allclose(dict(twice.named_parameters())[router].grad, grads[router].grad, rtol=1e-3)


def balance_and_aux(model) -> dict[str, float]:
    from titan_hydra.models.hf import router

    return {**balance_step([model]), **router.aux_step([model])}


def test_load_metrics_count_transformers_routing():
    """The per-expert counts are the top-k of transformers' own router logits on the same batch
    (mixtral routes by softmax top-k), and ``balance_step`` turns them into the native MoE's metrics;
    an eval forward counts nothing."""
    from transformers import AutoModelForCausalLM

    spec, ours = built("mixtral")
    ref = AutoModelForCausalLM.from_config(spec.model_args.hf_config).train()
    ref.load_state_dict(ours.state_dict())
    x, _ = batch(spec.model_args.vocab_size)
    with torch.no_grad():
        ours.eval()(x)
        assert all(int(b.sum()) == 0 for n, b in ours.named_buffers() if n.endswith("tokens_per_expert"))
        ours.train()(x)
        logits = ref(input_ids=x, output_router_logits=True).router_logits
    counts = [torch.bincount(torch.topk(lg.softmax(-1), 2).indices.reshape(-1), minlength=8).float() for lg in logits]
    ours_counts = [b.float() for n, b in ours.named_buffers() if n.endswith("tokens_per_expert")]
    assert len(ours_counts) == 4 and all(torch.equal(a, b) for a, b in zip(ours_counts, counts))
    metrics = balance_step([ours])
    ratios = [(c.max() / c.mean()).item() for c in counts]
    assert metrics == pytest.approx({"moe/max_over_mean": max(ratios),
                                     "moe/idle_frac": sum(int((c == 0).sum()) for c in counts) / 32,
                                     **{f"moe/layer{i}/max_over_mean": r for i, r in enumerate(ratios)}}, rel=1e-6)
    assert max(ratios) > 1.0
    assert all(int(b.sum()) == 0 for n, b in ours.named_buffers() if n.endswith("tokens_per_expert"))  # reset


@pytest.mark.parametrize("extra,message", [
    (["parallelism=pp", "cluster.nproc_per_node=2", "+model.fields.tie_word_embeddings=false"],
     "parallelism.pp=2 with model.fields.output_router_logits=true: the router's auxiliary loss"),
])
def test_aux_refusals_are_one_line(extra, message):
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(overrides("qwen3_moe", *AUX, *extra)))
    assert str(e.value).startswith(message) and "\n" not in str(e.value), str(e.value)


def reference(run_cache) -> dict[str, list[float]]:
    """One process, mixtral with the aux loss: the series every layout is compared with."""
    def compute(path):
        run_single(path, overrides("mixtral", *AUX))
        return {key: series(path / "run", key) for key in METRICS}
    return run_cache.once(("hf_moe_aux_single",), compute)


def assert_moe_run_equals(run_dir, single: dict[str, list[float]], run_cache, label: str, record_property) -> None:
    """Every series within the machine's rounding floor of one process's, except that a router
    near-tie flipped by rounding may move one step (never the last; test_hf_family.FLIP_FACTOR's
    argument: a flip is one step's event, a bug persists)."""
    for key, ref in single.items():
        got = series(run_dir, key)
        assert len(got) == len(ref) == 10, (key, got)
        bound = machine_bound(run_cache, ref)
        diffs = [abs(a - b) for a, b in zip(got, ref)]
        record_property(f"{label} {key} max diff", max(diffs))
        over = [i for i, d in enumerate(diffs) if d > bound]
        assert len(over) <= 1 and len(diffs) - 1 not in over, (label, key, diffs, bound)
    assert 1.0 < min(single["moe/max_over_mean"]) and max(single["moe/max_over_mean"]) < 8.0
    assert all(0.0 <= v < 1.0 for v in single["moe/idle_frac"]) and min(single["moe/aux_loss"]) > 1.0
    for step in range(10):  # the worst layer is the headline
        assert single["moe/max_over_mean"][step] == max(single[f"moe/layer{i}/max_over_mean"][step] for i in range(4))


@pytest.mark.slow
@pytest.mark.parametrize("layout,nproc", [("ep", 2), ("fsdp", 2)])
@pytest.mark.gate("ep-2")
def test_aux_loss_layouts_equal_one_process(tmp_path, run_cache, layout, nproc, record_property):
    single = reference(run_cache)
    assert single["loss"][-1] < single["loss"][0] - 0.05, single["loss"]
    run_layout(tmp_path, overrides("mixtral", *AUX, f"parallelism={layout}"), nproc=nproc, dp=nproc)
    assert_moe_run_equals(tmp_path / "run", single, run_cache, f"mixtral aux {layout}", record_property)


@pytest.mark.slow
@pytest.mark.extended
def test_aux_loss_compiled_with_full_ac_equals_eager(tmp_path, run_cache, record_property):
    """Per-block compile (the routers inside fullgraph graphs, the experts eager) with full AC: the
    routers' logits still reach the aux loss, a recompute neither counts tokens again nor adds its
    logits to the next step's loss (measured: loss and aux within 1 ulp, the load metrics equal)."""
    single = reference(run_cache)
    run_single(tmp_path, overrides("mixtral", *AUX, "compile=model", "activation_checkpoint=full"))
    assert_moe_run_equals(tmp_path / "run", single, run_cache, "mixtral aux compile+full ac", record_property)
