"""The estimator's per-rank peak memory agrees with measured tensor-level peaks (+-15%).

Measured = peak bytes of live tensors during a real second training step (forward, backward,
AdamW step; optimizer state exists), tracked by torch's dispatch-level MemTracker: the CPU
analogue of torch.cuda.max_memory_allocated: single-process shapes and precisions in-process,
and per rank under FSDP, TP and PP through real 2-process runs with ``profiling=memory``.
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from titan_hydra.spec import spec_of
from helpers import compose_cfg, launch_here
from hydra.utils import instantiate

from titan_hydra.config import mixed_precision_of
from titan_hydra.planner.plan import plan
from titan_hydra.models.registry import build_model
from titan_hydra.models.objective import cross_entropy_loss
from titan_hydra.kernels.attention_policy import apply_attention_kernel
from titan_hydra.kernels.attention_precision import apply_attention_precision

GIB = 1024**3


def measured_peak_gib(cfg) -> float:
    torch.manual_seed(0)
    family, m = build_model(cfg.model)
    m.init_weights()
    mp = mixed_precision_of(cfg)
    cpu = torch.device("cpu")  # as the trainer does: the precision rule, then the kernel policy
    apply_attention_precision(m, str(cfg.training.attention_precision), mp, cpu, int(cfg.training.seq_len))
    apply_attention_kernel(m, str(cfg.training.attention_kernel), cpu, seq_len=int(cfg.training.seq_len))
    instantiate(cfg.activation_checkpoint).apply(family.blocks(m))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    t = cfg.training
    x = torch.randint(0, cfg.model.vocab_size, (t.local_batch_size, t.seq_len))

    def loss_of():
        logits = m(x)
        return cross_entropy_loss(logits, x)  # the logits die here, as the runner drops them before backward

    return second_step_peak_gib(m, opt, loss_of, bf16=mp == "bf16")


def second_step_peak_gib(m, opt, loss_of, bf16: bool) -> float:
    """Peak live-tensor GiB of the second of two training steps (optimizer state exists by then)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.bfloat16) if bf16 else contextlib.nullcontext():
            loss_of().backward()
        opt.step()

    step()
    tracker = MemTracker()
    tracker.track_external(m, opt)
    with tracker:
        step()
    return sum(d["Total"] for d in tracker.get_tracker_snapshot("peak").values()) / GIB


# Two blocks, not the debug flavor's six: activations and parameters shrink together (the
# activation share of the peak stays 40-60%, estimate/measured within 0.02 of the 6-block
# values), and bf16 cases cost a third where bf16 is emulated (AVX2-only CPUs).
DEBUG = ["training.local_batch_size=2", "training.seq_len=256", "model.n_layers=2"]
LLAMA_100M = ["model.flavor=custom", "model.dim=768", "model.n_layers=12", "model.n_heads=12",
              "model.vocab_size=2048", "training.local_batch_size=1", "training.seq_len=128"]
CASES = {
    "debug fp32": DEBUG + ["training.mixed_precision=fp32"],
    "debug bf16": DEBUG + ["training.mixed_precision=bf16"],
    "debug fp32 ac=full": DEBUG + ["training.mixed_precision=fp32", "activation_checkpoint=full"],
    "debug bf16 ac=selective_op": DEBUG + ["training.mixed_precision=bf16", "activation_checkpoint=selective_op"],
    "debug bf16 ac=selective_op every_second_mm": DEBUG + [
        "training.mixed_precision=bf16", "activation_checkpoint=selective_op",
        "activation_checkpoint.selective_op_policy=every_second_mm"],
    "debug fp32 ac=selective_op every_second_mm": DEBUG + [
        "training.mixed_precision=fp32", "activation_checkpoint=selective_op",
        "activation_checkpoint.selective_op_policy=every_second_mm"],
    "debug bf16 bf16-attention": DEBUG + ["training.mixed_precision=bf16", "training.attention_precision=compute"],
    # 6 of the 100M shape's 12 layers (same widths, the same check; estimate/measured 0.983 vs
    # 0.991 with 12, 2026-11-27), half the cost.
    "100M-wide fp32, 6 layers": LLAMA_100M + ["training.mixed_precision=fp32", "model.n_layers=6"],
    # Qwen3 (QK-norm; q 512 wide on a 256-wide model; tied). estimate/measured, 2026-11-23:
    # fp32 0.997, bf16 1.074, bf16 selective_op 1.092, fp32 head_dim 32 0.998 (before the
    # estimator counted q-wide attention and QK-norm activations: fp32 0.837).
    "qwen3 debug bf16": ["model=qwen3_debug"] + DEBUG + ["training.mixed_precision=bf16"],
    "qwen3 debug fp32": ["model=qwen3_debug"] + DEBUG + ["training.mixed_precision=fp32"],
    "qwen3 debug bf16 ac=selective_op": ["model=qwen3_debug"] + DEBUG + ["training.mixed_precision=bf16",
                                                                         "activation_checkpoint=selective_op"],
    "qwen3 debug fp32 head_dim 32": ["model=qwen3_debug", "model.head_dim=32"] + DEBUG
    + ["training.mixed_precision=fp32"],
    # MoE: routed token copies and router scores on top of the active FFN width.
    "qwen3_moe debug fp32": ["model=qwen3_moe_debug"] + DEBUG + ["training.mixed_precision=fp32"],
    "qwen3_moe debug bf16 ac=selective_op": ["model=qwen3_moe_debug"] + DEBUG
    + ["training.mixed_precision=bf16", "activation_checkpoint=selective_op"],
    "deepseek_v3 debug bf16": ["model=deepseek_v3_debug"] + DEBUG + ["training.mixed_precision=bf16"],
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.gate("debug bf16", "debug fp32 ac=full", "debug bf16 ac=selective_op every_second_mm", "qwen3 debug fp32 head_dim 32", "qwen3_moe debug bf16 ac=selective_op", "deepseek_v3 debug bf16")
def test_estimate_within_15_percent_of_measured_peak(name):
    torch.set_num_threads(1)
    cfg = compose_cfg(CASES[name])
    est = plan(spec_of(cfg)).mem_total_gib
    got = measured_peak_gib(cfg)
    assert abs(est - got) / got < 0.15, f"{name}: estimated {est:.4f} GiB, measured {got:.4f} GiB"


def measured_flux_peak_gib(cfg) -> float:
    """As ``measured_peak_gib``, for FLUX.1: random latents and text states of the shapes the
    data config gives (image and text tokens), the flow-matching MSE loss."""
    from titan_hydra.models.flux.examples import image_tokens_of
    from titan_hydra.models.flux.model import image_ids, text_ids

    torch.manual_seed(0)
    family, m = build_model(cfg.model)
    m.init_weights()
    instantiate(cfg.activation_checkpoint).apply(family.blocks(m))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    a, b = m.args, int(cfg.training.local_batch_size)
    side, n_txt = int(image_tokens_of(cfg.data.image_size) ** 0.5), int(cfg.data.examples.max_text_len)
    x = {"img": torch.randn(b, side * side, a.in_channels), "img_ids": image_ids(side, side),
         "txt": torch.randn(b, n_txt, a.context_dim), "txt_ids": text_ids(n_txt), "timesteps": torch.rand(b),
         "y": torch.randn(b, a.pooled_dim)}
    return second_step_peak_gib(m, opt, lambda: family.objective.loss(m(**x), x["img"]),
                                bf16=mixed_precision_of(cfg) == "bf16")


# 256 image + 32 text tokens per image, 2 images: activations are 10-50% of the peak.
# estimate/measured (2026-11-25): fp32 0.96, bf16 1.10, full AC 0.92, selective_op 0.94 (at 4
# images: 0.95, 1.17, 0.82, 0.92). The language families' coefficients with FLUX.1's plain GELU MLP
# (half SwiGLU's FFN-wide tensors, ModelShape.gated_mlp); the two-stream and fused single-stream
# blocks are not modeled apart, hence 20%, not 15%.
FLUX = ["model=flux_debug", "data=flux_shapes", "model.dim=256", "model.n_heads=8", "model.n_double_blocks=2",
        "model.n_single_blocks=4", "data.image_size=256", "data.examples.max_text_len=32", "training.local_batch_size=2"]
FLUX_CASES = {"fp32": ["training.mixed_precision=fp32"], "bf16": ["training.mixed_precision=bf16"],
              "fp32 ac=full": ["training.mixed_precision=fp32", "activation_checkpoint=full"],
              "fp32 ac=selective_op": ["training.mixed_precision=fp32", "activation_checkpoint=selective_op"]}


@pytest.mark.parametrize("name", list(FLUX_CASES))
@pytest.mark.gate("fp32")
def test_flux_estimate_within_20_percent_of_measured_peak(name):
    torch.set_num_threads(1)
    cfg = compose_cfg(FLUX + FLUX_CASES[name])
    p = plan(spec_of(cfg))
    assert p.unit == "image" and p.tokens_per_sample == 256 + 32 and p.units_per_step == p.tokens_per_step // 288
    got = measured_flux_peak_gib(cfg)
    assert abs(p.mem_total_gib - got) / got < 0.20, f"flux {name}: estimated {p.mem_total_gib:.4f}, measured {got:.4f} GiB"


def test_flux_plan_counts_images_and_their_flops():
    """flux_dev at 256/512/1024 px: FLOPs per image from the family's per-image count, images and
    joint-sequence tokens per step, and activations growing with the image tokens."""
    from titan_hydra.models.flux import FAMILY

    plans = {}
    for px in (256, 512, 1024):
        cfg = compose_cfg(["model=flux_dev", "data=flux_shapes", f"data.image_size={px}", "data.examples.max_text_len=512",
                           "data.examples.guidance=3.5",
                           "cluster=slurm_h100", "cluster.nnodes=2", "parallelism=fsdp", "training.local_batch_size=1",
                           "training.global_batch_size=16", "activation_checkpoint=full", "dry_run=true"])
        p = plans[px] = plan(spec_of(cfg))
        image_tokens = (px // 16) ** 2
        assert p.params == 11_901_408_320 and p.unit == "image" and p.units_per_step == 16
        assert p.tokens_per_sample == image_tokens + 512 and p.tokens_per_step == 16 * (image_tokens + 512)
        assert p.flops_per_unit == FAMILY.flops_per_image(FAMILY.make_args({k: v for k, v in cfg.model.items()
                                                                            if k not in ("_target_", "family", "flavor")}),
                                                          image_tokens, 512)
        assert p.flops_per_step == pytest.approx(16 * p.flops_per_unit)
        assert "FLOPs per image" in p.format() and "FLOPs per token" not in p.format()
    assert plans[256].flops_per_unit < plans[512].flops_per_unit < plans[1024].flops_per_unit
    act = [plans[px].mem_activations_gib for px in (256, 512, 1024)]
    assert act[0] < act[1] < act[2] and act[2] > 2 * act[0]


def test_published_flavors_and_layouts():
    """Parameter counts of the published shapes; sharding divides per-rank state as it should."""
    from titan_hydra.models.registry import args_of

    # Qwen3 0.6B and 32B: published 0.6B (0.44B non-embedding, tied) and 32.8B. (Qwen's 31.2B
    # non-embedding for 32B also leaves out lm_head; ours leaves out the input table only.)
    counts = {"llama3_8b": 8_030_261_248, "llama3_70b": 70_553_706_496, "llama3_405b": 405_853_388_800,
              "qwen3_0.6b": 596_049_920, "qwen3_32b": 32_762_123_264}
    non_embedding = {"qwen3_0.6b": 440_467_456, "qwen3_32b": 32_762_123_264 - 151936 * 5120}
    for flavor, n in counts.items():
        cfg = compose_cfg([f"model={flavor}", "cluster=slurm_h100", "cluster.nnodes=4",
                           "parallelism=fsdp", "training.seq_len=8192", "training.local_batch_size=1",
                           "activation_checkpoint=full"])
        p = plan(spec_of(cfg))
        assert p.params == n
        assert p.world_size == 32
        assert p.mem_params_gib == pytest.approx(n * 4 / 32 / GIB, rel=0.02)
        _, args = args_of(cfg.model)
        if flavor in non_embedding:
            assert p.non_embedding_params == non_embedding[flavor]
        # matmul weights: all but the lookup table; a tied table is the output matmul too
        matmul = p.params if args.tie_word_embeddings else p.non_embedding_params
        attention = 12 * 8192 * args.n_layers * args.n_heads * args.head_dim  # Qwen3 32B: 8192-wide q, dim 5120
        assert p.flops_per_token == pytest.approx(6 * matmul + attention, rel=1e-9)
    def plan_of(overrides):
        cfg = compose_cfg(["model=llama3_8b", "cluster=slurm_h100", "parallelism=fsdp",
                           "training.local_batch_size=1", "training.seq_len=8192", *overrides])
        return plan(spec_of(cfg))

    none, full, sel = plan_of([]), plan_of(["activation_checkpoint=full"]), plan_of(["activation_checkpoint=selective_op"])
    assert full.mem_activations_gib < sel.mem_activations_gib < none.mem_activations_gib
    assert full.mem_total_gib < 80.0 < none.mem_total_gib  # 8B at 8k tokens on 32 H100s needs AC
    assert none.device_memory_gib == 80.0


# Measured per-rank peaks (fp32; estimate vs measured; 6 blocks): debug fsdp(2) 0.1264 vs 0.1183 GiB
# (+6.9%; dropped from the cases: 100M fsdp(2) covers FSDP), debug tp(2) 0.0760 vs 0.0806 GiB (-5.7%), 100M fsdp(2) 0.7355 vs 0.7442 GiB (-1.2%; it was -11.4%
# before the estimator counted the end-of-backward peak: sharded grads + a group being reduce-scattered);
# the case runs 6 of the 12 layers since 2026-11-26 (CI time; same widths, the same check).
# debug pp(2), 1F1B with 8 microbatches: rank 0 0.954, rank 1 (last stage) 1.088 (2026-11-25; the
# last stage measured 0.917 while torch's schedule still kept every microbatch's logits).
LAYOUT_CASES = {
    "debug tp2": DEBUG + ["parallelism=tp"],
    "100M-wide fsdp2, 6 layers": LLAMA_100M + ["parallelism=fsdp", "model.n_layers=6"],
    "debug pp2 8 microbatches": ["training.local_batch_size=8", "training.seq_len=256", "parallelism=pp",
                                 "parallelism.pp_microbatches=8"],
}


@pytest.mark.parametrize("name", list(LAYOUT_CASES))
@pytest.mark.slow
@pytest.mark.gate("debug tp2")
def test_estimate_within_15_percent_per_rank_under_layouts(tmp_path, name):
    import json

    overrides = LAYOUT_CASES[name] + [
        "training.mixed_precision=fp32", "training.steps=2", "lr_scheduler.warmup_steps=1",
        "training.val_freq=0", "logger=minimal", "data.max_documents=60", "cluster.threads_per_proc=1",
        "cluster.nproc_per_node=2", "profiling=memory",
    ]
    run_dir = tmp_path / "run"
    launch_here(overrides, run_dir)
    cfg = compose_cfg(overrides)
    est = plan(spec_of(cfg)).mem_total_gib
    for rank in (0, 1):
        record = json.loads((run_dir / "memory_snapshot" / "iteration_2" / f"rank{rank}_memory.json").read_text())
        got = record["peak_bytes"]["total"] / GIB
        assert abs(est - got) / got < 0.15, f"{name} rank {rank}: estimated {est:.4f} GiB, measured {got:.4f} GiB"


def _loss_bytes_worker(rank: int, out: str) -> None:
    """Peak tensor bytes of a bf16-logits cross entropy's forward+backward per local logit, plain
    and under TP loss parallel (vocab sharded over the 2 ranks), as the runner runs it."""
    import torch.nn.functional as F
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.parallel import loss_parallel

    mesh = init_device_mesh("cpu", (2,))
    tokens, vocab = 2048, 4096
    torch.manual_seed(0)
    weights = torch.randn(tokens, vocab, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (tokens,))
    got = {}
    for parallel in (False, True):
        leaf = weights.clone().requires_grad_(True)
        source = distribute_tensor(leaf, mesh, [Shard(1)]) if parallel else leaf
        tracker = MemTracker()
        with tracker, (loss_parallel() if parallel else contextlib.nullcontext()):
            logits = source * 1  # a non-leaf, like the output projection's result
            loss = F.cross_entropy(logits.float(), labels)
            del logits
            loss.backward()
        peak = sum(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
        got["parallel" if parallel else "plain"] = peak / (tokens * vocab / (2 if parallel else 1))
    if rank == 0:
        with open(out, "w") as f:
            json.dump(got, f)


@pytest.mark.slow
def test_loss_backward_bytes_per_logit_match_measured(tmp_path):
    """The two loss constants the CUDA estimate uses, measured on the ops that run: 12 B per logit
    for the plain loss, 16 B per local logit under loss parallel (DTensor's fused nll+log-softmax
    backward keeps three fp32 temporaries beside the saved log-probs)."""
    from helpers import spawn_gloo

    from titan_hydra.planner.activations import LOSS_BACKWARD_BYTES_PER_LOGIT, LOSS_PARALLEL_BACKWARD_BYTES_PER_LOGIT

    out = tmp_path / "loss_bytes.json"
    spawn_gloo(_loss_bytes_worker, 2, str(out))
    got = json.loads(out.read_text())
    assert got["plain"] == pytest.approx(LOSS_BACKWARD_BYTES_PER_LOGIT, rel=0.05), got
    assert got["parallel"] == pytest.approx(LOSS_PARALLEL_BACKWARD_BYTES_PER_LOGIT, rel=0.05), got
