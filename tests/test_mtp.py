"""Multi-token prediction for DeepSeek-V3 (``model.mtp_layers``): off changes nothing; the loss
equals a from-scratch computation of the report's formula; the MTP layer converts to and from the
names deepseek-ai's release uses, and transformers' own ``MtpModel`` reading our export computes
our depth-1 logits; the estimator counts its FLOPs; a short run logs ``mtp/loss`` and learns."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import compose_cfg, floor_bound, launch_here, norm_bound, read_metrics, rounding_floor, series

from titan_hydra.models.common.mtp import future_valid, shift_left
from titan_hydra.models.deepseek_v3 import FAMILY
from titan_hydra.models.hf_io import load_hf_checkpoint, save_hf_checkpoint
from titan_hydra.models.common.mtp_loss import MultiTokenLoss
from titan_hydra.models.registry import args_of
from titan_hydra.train.mtp_metrics import mtp_loss_hooks

from numerics import U32, assert_fp32_close

# The tiny model has no fp64 form (its norms, rotary and router compute in fp32 whatever the
# dtype), so its comparisons are bounded from first principles: fp32 unit roundoff times 1e3
# terms (its sums have <= 64 terms, through ~12 matmuls, norms and softmaxes) of the largest value
TINY_REL = 1e3 * U32

# 2 layers (dense, MoE), 4 experts top-2 in 1 of 2 groups, a shared expert; MLA with a query LoRA
TINY = ["model.dim=32", "model.n_layers=2", "model.n_heads=2", "model.vocab_size=64", "model.max_seq_len=32",
        "model.kv_lora_rank=8", "model.q_lora_rank=12", "model.qk_rope_head_dim=4", "model.qk_nope_head_dim=8",
        "model.v_head_dim=8", "model.ffn_hidden_dim=48", "model.moe.num_experts=4", "model.moe.expert_dim=16",
        "model.rope_original_max_seq_len=8"]


def tiny_args(mtp_layers: int):
    return args_of(compose_cfg(["model=deepseek_v3_debug", *TINY, f"model.mtp_layers={mtp_layers}"]).model)[1]


def tiny_model(mtp_layers: int, randomize_norms: bool = True):
    with torch.device("meta"):  # as training builds it: only init_weights draws random numbers
        model = FAMILY.build(tiny_args(mtp_layers))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    if not randomize_norms:
        return model
    with torch.no_grad():  # norms start at 1: make them count, so a swapped norm cannot pass
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
    return model


def test_off_builds_nothing_and_on_leaves_the_main_model_alone():
    """mtp_layers=0: no MTP parameter, and the same initial weights and logits with or without MTP."""
    off, on = tiny_model(0, randomize_norms=False), tiny_model(1, randomize_norms=False)
    extra = set(on.state_dict()) - set(off.state_dict())
    assert off.mtp_layers is None and extra and all(k.startswith("mtp_layers.0.") for k in extra)
    assert all(torch.equal(v, on.state_dict()[k]) for k, v in off.state_dict().items())
    tokens = torch.randint(0, 64, (2, 12))
    off.train()
    with torch.no_grad():
        plain = off(tokens)
        assert isinstance(plain, torch.Tensor)
        assert torch.equal(plain, on.eval()(tokens))


def reference_loss(model, tokens: torch.Tensor, labels: torch.Tensor, weight: float) -> torch.Tensor:
    """The report's eq. 21-25 on truncated sequences: depth k sees positions 0..S-k-1, the
    embeddings of t(i+k) and the previous depth's states, and predicts labels[i + k]."""
    s = tokens.shape[1]
    emb = model.tok_embeddings(tokens)
    prev = model.norm(model.run_layers(emb))
    main = F.cross_entropy(model.output(prev).flatten(0, 1), labels.flatten())
    depth_losses = []
    for k, layer in enumerate(model.mtp_layers, start=1):
        n = s - k
        x = layer.eh_proj(torch.cat([layer.enorm(emb[:, k:]), layer.hnorm(prev[:, :n])], dim=-1))
        prev = layer.norm(layer.block(x, model.rope_cos[:n], model.rope_sin[:n]))
        depth_losses.append(F.cross_entropy(model.output(prev).flatten(0, 1), labels[:, k:].flatten()))
    return main + weight * sum(depth_losses) / len(depth_losses)


@pytest.mark.parametrize("depths", [1, 2])
def test_loss_equals_a_hand_computation(depths):
    model = tiny_model(depths).train()
    data = torch.randint(0, 64, (2, 13))
    tokens, labels = data[:, :-1], data[:, 1:]
    loss_fn = MultiTokenLoss(0.3)
    got = loss_fn(model(tokens), labels)
    grads = torch.autograd.grad(got, [model.tok_embeddings.weight, model.mtp_layers[0].eh_proj.weight])
    ref = reference_loss(model, tokens, labels, 0.3)
    ref_grads = torch.autograd.grad(ref, [model.tok_embeddings.weight, model.mtp_layers[0].eh_proj.weight])
    assert_fp32_close({"loss": got, "emb": grads[0], "eh_proj": grads[1]},
                      {"loss": ref, "emb": ref_grads[0], "eh_proj": ref_grads[1]}, rel=TINY_REL)
    main = F.cross_entropy(model.eval()(tokens).flatten(0, 1), labels.flatten())
    recorded = loss_fn.take(1)  # the MTP term, for mtp/loss
    assert_fp32_close({"loss": got}, {"loss": main + 0.3 * recorded}, rel=TINY_REL)
    # an eval-mode forward gives logits only: the loss is the plain next-token one, and records nothing;
    # the same logits through a cross entropy: a 64-term logsumexp and a 24-term mean, 128 u of it
    assert_fp32_close({"loss": loss_fn(model(tokens), labels)}, {"loss": main}, rel=128 * U32)
    assert loss_fn.take(1) is None


def test_future_positions_stay_in_their_document():
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2]])
    assert future_valid(1, 6, 1, doc_ids, "cpu").tolist() == [[True, True, False, True, False, False]]
    assert future_valid(1, 6, 2, None, "cpu").tolist() == [[True, True, True, True, False, False]]
    assert shift_left(torch.arange(6)[None], 2).tolist() == [[2, 3, 4, 5, 0, 0]]


def test_packed_documents_predict_as_each_alone():
    """With document ids, a depth's valid outputs for two packed documents equal each document's
    own, and the document's last positions are marked invalid (no input from the next one)."""
    model = tiny_model(1).train()
    a, b = torch.randint(0, 64, (1, 7)), torch.randint(0, 64, (1, 5))
    doc_ids = torch.tensor([[0] * 7 + [1] * 5])
    with torch.no_grad():
        _, valid, packed = model(torch.cat([a, b], dim=1), doc_ids=doc_ids)
        alone = [model(x)[2] for x in (a, b)]
    assert valid[0].tolist() == [[True] * 6 + [False] + [True] * 4 + [False]]
    assert_fp32_close({"first": packed[:, :6], "second": packed[:, 7:11]},
                      {"first": alone[0][:, :6], "second": alone[1][:, :4]}, rel=TINY_REL)


def test_mtp_loss_hook_averages_the_step_and_skips_other_losses():
    class Dims:  # one process: no pipeline, no data parallel
        broadcast_pp_loss = staticmethod(lambda x: x)
        global_mean = staticmethod(lambda x: float(x))

    loss_fn = MultiTokenLoss(0.1)
    loss_fn.recorded = [torch.tensor(9.0), torch.tensor(2.0), torch.tensor(4.0)]  # a probe call, then 2 microbatches
    (hook,) = mtp_loss_hooks(loss_fn, Dims(), 0.5, torch.device("cpu"))
    assert hook() == {"mtp/loss": 3.0} and hook() == {"mtp/loss": 0.0}
    assert mtp_loss_hooks(lambda out, labels: out, Dims(), 1.0, torch.device("cpu")) == []


def test_estimator_counts_the_mtp_layer():
    """Per depth: the MTP layer's active weights (its MoE uses top_k of num_experts), one more pass
    through the shared output head, and one more attention term."""
    off, on = tiny_args(0), tiny_args(1)
    with torch.device("meta"):
        layer = FAMILY.build(on).mtp_layers[0]
    experts = sum(p.numel() for p in layer.block.feed_forward.experts.parameters())
    e, k = on.moe.num_experts, on.moe.top_k
    active = sum(p.numel() for p in layer.parameters()) - experts * (e - k) // e
    seq = 16
    expected = 6 * (active + on.vocab_size * on.dim) + 6 * on.n_heads * (on.head_dim + on.v_head_dim) * seq
    assert FAMILY.flops_per_token(on, seq) - FAMILY.flops_per_token(off, seq) == expected
    assert FAMILY.shape(on).params - FAMILY.shape(off).params == sum(p.numel() for p in layer.parameters())


# the names deepseek-ai's DeepSeek-V3 release stores its MTP layer under (beyond the block's usual ones)
RELEASE_MTP_NAMES = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                     "embed_tokens.weight", "shared_head.head.weight")


def test_hf_round_trip_and_transformers_mtp_model(tmp_path):
    """Export writes the MTP layer as decoder layer n_layers; import reads it back tensor-identical;
    transformers' MtpModel, loading it from our files, computes our depth-1 logits."""
    from safetensors.torch import load_file

    transformers = pytest.importorskip("transformers")
    from transformers.modeling_layers import MtpModel

    model = tiny_model(1)
    with torch.no_grad():  # a moved routing bias must travel too
        model.mtp_layers[0].block.feed_forward.expert_bias.copy_(0.05 * torch.randn(4))
    sd = model.state_dict()
    save_hf_checkpoint(FAMILY, tmp_path / "hf", sd, model.args)
    files = load_file(str(tmp_path / "hf" / "model.safetensors"))
    layer = "model.layers.2."  # n_layers = 2
    assert all(layer + name in files for name in RELEASE_MTP_NAMES)
    assert files[layer + "eh_proj.weight"].shape == (32, 64)
    assert torch.equal(files[layer + "mlp.experts.3.down_proj.weight"], sd["mtp_layers.0.block.feed_forward.experts.w2"][3])
    assert torch.equal(files[layer + "shared_head.head.weight"], sd["output.weight"])
    family, args, back = load_hf_checkpoint(tmp_path / "hf")
    assert args.mtp_layers == 1 and back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)

    transformers.logging.set_verbosity_error()  # the main class reports the MTP tensors as unexpected
    hf_main = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    hf_main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.2\..*"]  # its class names layer 61 (V3's)
    hf_mtp = MtpModel.from_pretrained(hf_main).eval()
    tokens = torch.randint(0, 64, (2, 12))
    with torch.no_grad():
        hidden = hf_main.model(tokens).last_hidden_state[:, :-1]
        positions = torch.arange(1, 12).expand(2, -1)  # HF numbers the MTP rows by their input token's position
        ref = hf_mtp._project_to_logits(hf_mtp.forward_layer(0, hidden, positions, None, input_ids=tokens[:, 1:]))
        ours = model.train()(tokens)[2][:, :-1]
    assert_fp32_close({"logits": ours}, {"logits": ref}, rel=TINY_REL)  # measured 1.2e-7 of 4.0


def test_import_reads_only_the_depths_the_files_hold(tmp_path):
    """transformers saves DeepSeek-V3 without MTP weights but keeps num_nextn_predict_layers=1: such
    a directory imports as a model without MTP; an export without MTP declares none."""
    model = tiny_model(0)
    save_hf_checkpoint(FAMILY, tmp_path / "hf", model.state_dict(), model.args)
    config = (tmp_path / "hf" / "config.json")
    assert '"num_nextn_predict_layers": 0' in config.read_text()
    config.write_text(config.read_text().replace('"num_nextn_predict_layers": 0', '"num_nextn_predict_layers": 1'))
    _, args, sd = load_hf_checkpoint(tmp_path / "hf")
    assert args.mtp_layers == 0 and sd.keys() == model.state_dict().keys()


@pytest.mark.slow  # ~15 s: 20 steps of the debug flavor
@pytest.mark.extended
def test_debug_flavor_with_mtp_trains_and_logs_mtp_loss(tmp_path):
    from titan_hydra.spec import spec_of
    from titan_hydra.train.pretrain import run

    steps = 20
    cfg = compose_cfg(["model=deepseek_v3_debug", "model.mtp_layers=1", "logger=minimal", "training.val_freq=0",
                       "cluster.threads_per_proc=1", f"training.steps={steps}", "training.seq_len=128",
                       "training.local_batch_size=4", "data.max_documents=200"])
    losses = run(spec_of(cfg), str(tmp_path / "run"))["losses"]
    rows = read_metrics(tmp_path / "run")
    mtp = series(rows, "mtp/loss")
    assert len(losses) == len(mtp) == steps and all(math.isfinite(x) for x in losses + mtp)
    # loss = next-token CE + 0.3 x MTP CE, both near ln(2048) = 7.6 at the start
    assert 1.3 * math.log(2048) - 0.3 < losses[0] < 1.3 * math.log(2048) + 1.3, losses[0]
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.7, losses
    assert sum(mtp[-3:]) / 3 < sum(mtp[:3]) / 3 - 0.3, mtp
    assert "moe/mtp_layer0/max_over_mean" in rows[-1]  # the MTP layer's experts are balanced too


# A 4-layer debug model with one MTP depth, fp32, from one full init; clipped every step.
LAYOUT = ["model=deepseek_v3_debug", "model.mtp_layers=1", "model.dim=64", "model.n_heads=4", "training.seq_len=64",
          "training.steps=4", "training.global_batch_size=8", "training.val_local_batch_size=8",
          "training.mixed_precision=fp32", "training.init_mode=full", "training.val_freq=2", "training.val_steps=1",
          "training.max_norm=0.3", "data.max_documents=60", "logger=minimal", "cluster.threads_per_proc=1"]
COMPARED = ("loss", "mtp/loss", "grad_norm", "val/loss")


@pytest.mark.slow  # two launched ranks (~40 s) and the in-process reference (~10 s)
def test_pipeline_with_mtp_equals_one_process(tmp_path, run_cache):
    """ZBVZeroBubble over 2 ranks: 4 stages, the V placement puts the first and the last (with the
    MTP layer) on rank 0, so the embedding output crosses to the middle stages and back; local
    batch 4 accumulates 2 steps of 2 microbatches each."""
    from titan_hydra.spec import spec_of
    from titan_hydra.train.pretrain import run

    run(spec_of(compose_cfg(LAYOUT + ["parallelism=single", "training.local_batch_size=8"])), str(tmp_path / "one"))
    launch_here(LAYOUT + ["parallelism=pp", "parallelism.pp_schedule=ZBVZeroBubble", "cluster.nproc_per_node=2",
                          "training.local_batch_size=4"], tmp_path / "pp")
    one, pp = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "pp")
    floor = rounding_floor(run_cache)  # the machine's floor (helpers.machine_bound); norms add their reduction's
    n_params = int(spec_of(compose_cfg(LAYOUT)).shape.params)
    for key in COMPARED:
        a, b = series(one, key), series(pp, key)
        bound = norm_bound(floor, a, n_params) if key == "grad_norm" else floor_bound(floor, a)
        assert len(a) == len(b) > 1 and max(abs(x - y) for x, y in zip(a, b)) <= bound, (key, a, b)


RESUME = ["model=deepseek_v3_debug", "model.mtp_layers=1", *[o for o in TINY if "vocab" not in o and "max_seq" not in o],
          "training.seq_len=32", "training.local_batch_size=2", "training.steps=6", "training.mixed_precision=fp32",
          "training.deterministic=true", "training.val_freq=0", "lr_scheduler.warmup_steps=2",
          "data.max_documents=40", "logger=minimal", "cluster.threads_per_proc=1", "checkpoint=default",
          "checkpoint.interval=2", "checkpoint.keep_latest_k=2"]


def test_exact_resume_with_mtp(tmp_path):
    """6 steps == 4 steps + resume + 2 steps, bit for bit: losses, mtp/loss and every parameter
    (the MTP layer's weights, optimizer state and routing bias come back from the checkpoint)."""
    import shutil

    from titan_hydra.spec import spec_of
    from titan_hydra.train.pretrain import run

    spec = spec_of(compose_cfg(RESUME))
    ref = run(spec, str(tmp_path / "ref"), return_state=True)
    shutil.copytree(tmp_path / "ref" / "checkpoint", tmp_path / "resumed" / "checkpoint")
    shutil.rmtree(tmp_path / "resumed" / "checkpoint" / "step-6")
    resumed = run(spec, str(tmp_path / "resumed"), return_state=True)
    assert resumed["losses"] == ref["losses"] and len(ref["losses"]) == 6
    mtp_ref, mtp_resumed = (series(read_metrics(tmp_path / d), "mtp/loss") for d in ("ref", "resumed"))
    assert mtp_resumed[-2:] == mtp_ref[-2:]
    assert any(k.startswith("mtp_layers.0.") for k in ref["full_state"])
    assert all(torch.equal(resumed["full_state"][k], v) for k, v in ref["full_state"].items())


def test_plan_counts_the_mtp_layer_memory():
    """The dry-run plan of the debug flavor with one depth: its parameters, and activations of one
    more never-checkpointed block, MoE layer and loss head for the step's tokens."""
    from titan_hydra.planner.activations import block_activation_bytes, moe_activation_bytes
    from titan_hydra.planner.plan import GIB, plan
    from titan_hydra.spec import spec_of

    base = ["model=deepseek_v3_debug", "training.seq_len=128", "training.local_batch_size=4",
            "training.mixed_precision=fp32"]
    off, on = (spec_of(compose_cfg(base + [f"model.mtp_layers={d}"])) for d in (0, 1))
    with torch.device("meta"):
        layer_params = sum(p.numel() for p in FAMILY.build(on.model_args).mtp_layers.parameters())
    p_off, p_on = plan(off), plan(on)
    assert p_on.params - p_off.params == layer_params
    shape, tokens = on.shape, 4 * 128
    assert (shape.mtp_layers, shape.moe_layers) == (1, off.shape.moe_layers + 1)
    expected = (tokens * (12 * shape.dim + 12 * shape.vocab_size) + block_activation_bytes(shape, "fp32", "none", tokens)
                + moe_activation_bytes(shape, "fp32", "none", tokens))
    got = (p_on.mem_activations_gib - p_off.mem_activations_gib) * GIB
    assert abs(got - expected) < 1e-3 * expected, (got, expected)
    assert p_on.flops_per_token - p_off.flops_per_token == FAMILY.flops_per_token(on.model_args, 128) - \
        FAMILY.flops_per_token(off.model_args, 128)
