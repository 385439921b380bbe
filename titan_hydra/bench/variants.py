"""The training suites of the benchmark: named variants of one training config, each a real run.

A ``Variant`` is the overrides of one ``launch.py`` run (or, as the yardstick, of
``recipes/plain_loop.py``: a plain fp32 eager loop of the same model), its ranks and threads, and
the group whose first variant it is compared with. ``training.py`` runs a suite and tabulates it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variant:
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    plain: bool = False  # the plain fp32 eager loop (recipes/plain_loop.py), not launch.py
    group: str = ""  # "vs baseline" compares with the first variant of the same group
    threads: int | None = None  # torch threads per process; None = --threads


DEBUG_FP32 = ("training.mixed_precision=fp32",)
M100 = ("experiment=llama_100m",)
FLUX = ("experiment=flux_debug", "checkpoint.enable=false", "eval.sample_every=0")  # 64 px: 16 image + 64 text tokens, batch 16

HF_LLAMA = ("model=hf_llama_debug", "model.fields.hidden_size=256", "model.fields.num_hidden_layers=6",
            "model.fields.num_attention_heads=16", "model.fields.num_key_value_heads=16",
            "model.fields.intermediate_size=768")
SUITES: dict[str, dict[str, Variant]] = {
    "precision": {
        "fp32 eager": Variant(("training.mixed_precision=fp32",)),
        "bf16 autocast": Variant(("training.mixed_precision=bf16",)),
    },
    "layouts": {
        "single (1 rank)": Variant(("parallelism=single",)),
        "fsdp (2 ranks)": Variant(("parallelism=fsdp",), 2),
        "ddp (2 ranks)": Variant(("parallelism=ddp",), 2),
        "hsdp (2x1 ranks)": Variant(("parallelism=hsdp", "parallelism.dp_replicate=2"), 2),
        "tp (2 ranks)": Variant(("parallelism=tp",), 2),
        "pp 1F1B (2 ranks)": Variant(("parallelism=pp", "parallelism.pp_schedule=1F1B"), 2),
        "cp (2 ranks)": Variant(("parallelism=cp",), 2),
    },
    # The issue-5 targets: each model against a plain fp32 eager loop of itself, same run.
    "targets": {
        "debug: plain fp32 eager loop": Variant(DEBUG_FP32, plain=True, group="debug"),
        "debug: fp32 eager": Variant(DEBUG_FP32, group="debug"),
        "debug: bf16": Variant(("training.mixed_precision=bf16",), group="debug"),
        "debug: compile + bf16": Variant(("training.mixed_precision=bf16", "compile=model_loss"), group="debug"),
        # The same 2 cores as 2 data-parallel ranks of 1 thread, same global batch (2 x 4).
        "debug: ddp 2x1 thread, compile + bf16": Variant(
            ("training.mixed_precision=bf16", "compile=model_loss", "parallelism=ddp",
             "training.local_batch_size=4"), nproc=2, group="debug", threads=1),
        "100M: plain fp32 eager loop": Variant(M100 + ("training.mixed_precision=fp32",), plain=True, group="100M"),
        "100M: auto precision": Variant(M100, group="100M"),
        "100M: compile, auto precision": Variant(M100 + ("compile=model_loss",), group="100M"),
    },
    # Performance features on the debug model, one process. float8 turns off torchao's H100 size
    # filter (it would skip every layer this small) and emulates the float8 matmul (real
    # _scaled_mm is a slow reference kernel on CPU), so the float8 path runs at a measurable speed.
    "perf": {
        "fp32 eager": Variant(DEBUG_FP32),
        "bf16": Variant(("training.mixed_precision=bf16",)),
        "bf16, bf16 attention": Variant(("training.mixed_precision=bf16", "training.attention_precision=compute")),
        "compile": Variant(DEBUG_FP32 + ("compile=model_loss",)),
        "compile + bf16": Variant(("training.mixed_precision=bf16", "compile=model_loss")),
        "float8 tensorwise": Variant(("float8=tensorwise", "float8.auto_filter_small_kn=false", "float8.emulate=true")),
        "float8 rowwise": Variant(("float8=rowwise", "float8.auto_filter_small_kn=false", "float8.emulate=true")),
        "ac full": Variant(("training.mixed_precision=bf16", "activation_checkpoint=full")),
        "ac selective_op": Variant(("training.mixed_precision=bf16", "activation_checkpoint=selective_op")),
        "ac selective_layer": Variant(("training.mixed_precision=bf16", "activation_checkpoint=selective_layer")),
    },
    # Variants that name no precision run training.mixed_precision=auto (bf16 where this CPU
    # multiplies bf16 natively, fp32 elsewhere); the table's precision column says which it was.
    # Each model family at its debug shape (same data, batch and sequence): eager, compiled,
    # and tp on 2 ranks (where tied embeddings and QK-norm change the plan). "vs baseline"
    # compares within a family.
    "families": {
        "llama3_debug: eager": Variant(("model=llama3_debug",), group="llama3"),
        "llama3_debug: compile": Variant(("model=llama3_debug", "compile=model_loss"), group="llama3"),
        "llama3_debug: tp 2 ranks": Variant(("model=llama3_debug", "parallelism=tp"), 2, group="llama3", threads=1),
        "qwen3_debug: eager": Variant(("model=qwen3_debug",), group="qwen3"),
        "qwen3_debug: compile": Variant(("model=qwen3_debug", "compile=model_loss"), group="qwen3"),
        "qwen3_debug: tp 2 ranks": Variant(("model=qwen3_debug", "parallelism=tp"), 2, group="qwen3", threads=1),
    },
    # model=hf against the native port of the same architecture: transformers' LlamaForCausalLM at
    # llama3_debug's exact shape (6,163,712 parameters, same FLOPs per token), eager, compiled, tp 2.
    "hf": {
        f"{name}: {label}": Variant((*model, *ov), nproc, group=label, threads=th)
        for label, ov, nproc, th in (("eager", (), 1, None), ("compile", ("compile=model_loss",), 1, None),
                                     ("tp 2 ranks", ("parallelism=tp",), 2, 1))
        for name, model in (("native llama3_debug", ("model=llama3_debug",)), ("hf llama (same shape)", HF_LLAMA))
    },
    # Mixture-of-Experts debug models: grouped GEMM vs the per-expert loop, auto vs bf16, one
    # process vs expert parallel on 2 ranks of 1 thread (same global batch). MFU counts active
    # parameters; "load max/mean" is the worst layer's busiest expert over the mean.
    "moe": {
        **{f"{m}: {label}": Variant((f"model={m}", *ov), nproc, group=m, threads=th)
           for m in ("qwen3_moe_debug", "deepseek_v3_debug", "gpt_oss_debug", "llama4_debug")
           for label, ov, nproc, th in (
               ("grouped mm", (), 1, None),
               ("per-expert loop", ("model.moe.use_grouped_mm=false",), 1, None),
               ("bf16, grouped mm", ("training.mixed_precision=bf16",), 1, None),
               ("ep 2 ranks", ("parallelism=ep", "training.local_batch_size=4"), 2, 1),
           )},
    },
    # FLUX.1 debug (images/s; MFU from FLOPs per image): fp32 and auto precision, regional
    # compile, and fsdp / tp / cp on 2 ranks of 1 thread with the same global batch.
    "flux": {
        "flux_debug: fp32 eager": Variant(FLUX + DEBUG_FP32, group="flux"),
        "flux_debug: auto precision": Variant(FLUX, group="flux"),
        "flux_debug: compile, fp32": Variant(FLUX + DEBUG_FP32 + ("compile=model",), group="flux"),
        "flux_debug: fsdp 2 ranks, fp32": Variant(FLUX + DEBUG_FP32 + ("parallelism=fsdp", "training.local_batch_size=8"),
                                                  2, group="flux", threads=1),
        "flux_debug: tp 2 ranks, fp32": Variant(FLUX + DEBUG_FP32 + ("parallelism=tp", "parallelism.tp_sequence_parallel=false"),
                                                2, group="flux", threads=1),
        "flux_debug: cp 2 ranks, fp32": Variant(FLUX + DEBUG_FP32 + ("parallelism=cp",), 2, group="flux", threads=1),
    },
}
