"""The config tree: every option composes, schemas reject typos and wrong types, and the
cross-field rules fail with their own one-line messages before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from helpers import CONF, compose_cfg, run_launch
from titan_hydra.errors import ConfigError, instantiate_checked
from titan_hydra.groups import compose_config
from titan_hydra.models.common.hf_decoder import HFConversionError
from titan_hydra.validate import validate

GROUPS = [p.name for p in CONF.iterdir() if p.is_dir()]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda x: str(x)
)
@pytest.mark.extended
def test_every_option_composes(group, option):
    cfg = compose_cfg([f"{group}={option}"] + (["data.path=x.jsonl"] if option in ("json", "parquet", "text") else []))
    if group != "experiment":
        node = cfg[group]
        assert node is not None
        if group == "model":
            assert node.flavor == option
        if "_target_" in node:
            assert node._target_.count(".") >= 1


def test_default_config_is_valid():
    cfg = compose_cfg()
    validate(cfg)
    assert cfg.model.flavor == "llama3_debug"
    assert cfg.training.steps == 50
    assert cfg.data.seq_len == cfg.training.seq_len  # interpolated


@pytest.mark.parametrize("overrides", [
    ["training.steps=3", "model.dim=64"],
    ["model=qwen3_debug", "optimizer=muon", "optimizer.lr=1e-3", "model.n_layers=2"],
    ["experiment=flux_debug", "data.num_images=8"],
    ["optimizer=muon", "optimizer.param_groups.0.match=[*]", "parametrization=mup"],
    ["+training.new_key=3", "parallelism=cp", "cluster.nproc_per_node=2"],
    ["training.stepz=5"],  # errors: the same exception and message
    ["~logger.wandb"],
])
def test_the_tests_fast_compose_equals_hydras(overrides):
    """helpers.compose_cfg composes group choices once and applies value overrides to a copy:
    the result must be what a full Hydra compose gives (a hydra-core upgrade could change that)."""
    def outcome(compose) -> str:
        try:
            cfg = compose(overrides)
        except Exception as e:  # noqa: BLE001 (compared, not swallowed)
            return f"{type(e).__name__}: {e}"
        assert OmegaConf.is_struct(cfg)
        return OmegaConf.to_yaml(cfg)

    assert outcome(compose_cfg) == outcome(compose_config)


@pytest.mark.parametrize(
    "override,expected",
    [
        ("training.stepz=5", "stepz"),
        ("training.steps=abc", "could not be converted to Integer"),
        ("training.mixed_precision=fp16", "fp16"),
        ("training.deterministic=maybe", "maybe"),
        ("model=llama4_huge", "llama4_huge"),
        ("parallelism.tpp=2", "tpp"),
        ("optimizer.lr=fast", "fast"),
        # choices are Enums in the schema: a bad value fails while composing, listing the valid ones
        ("parallelism.cp_rotate_method=ring", "Invalid value 'ring', expected one of [allgather, alltoall]"),
        ("compile.mode=max", "Invalid value 'max', expected one of [none, model, model_loss]"),
        ("logger.wandb.mode=cloud", "Invalid value 'cloud', expected one of [offline, online, disabled]"),
        ("activation_checkpoint.mode=some", "expected one of [none, full, selective_op, selective_layer]"),
        ("activation_checkpoint.selective_op_policy=odd_mm", "expected one of [all_mm, every_second_mm]"),
        ("checkpoint.async_mode=sometimes", "expected one of [disabled, async]"),
        ("training.attention_precision=fp8", "expected one of [auto, compute, fp32]"),
        ("parallelism.pp_schedule=Zigzag", "Invalid value 'Zigzag', expected one of [GPipe, 1F1B,"),
    ],
)
def test_schema_rejects_at_compose_time(override, expected):
    with pytest.raises((ConfigCompositionException, ConfigKeyError, ValidationError)) as err:
        compose_cfg([override])
    text = str(err.value) + str(getattr(err.value, "__cause__", ""))
    assert expected in text


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["training.steps=0"], "training.steps=0 must be > 0"),
        (["training.local_batch_size=-1"], "training.local_batch_size=-1 must be > 0"),
        (["training.seq_len=4096"], "exceeds model.max_seq_len"),
        (["training.max_norm=-1"], "training.max_norm=-1.0 must be >= 0"),
        (["training.global_batch_size=12"], "not a multiple of local_batch_size"),
        (["lr_scheduler.warmup_steps=100"], "exceeds training.steps"),
        (["lr_scheduler.decay_ratio=1.5"], "decay_ratio=1.5 must be within [0, 1]"),
        (["lr_scheduler.min_lr_factor=2"], "min_lr_factor=2.0 must be within [0, 1]"),
        (["model.n_heads=5"], "not divisible by model.n_heads=5"),
        (["model.n_kv_heads=5"], "not divisible by model.n_kv_heads=5"),
        (["model=qwen3_debug", "model.n_kv_heads=3"], "not divisible by model.n_kv_heads=3"),
        (["model=qwen3_debug", "model.head_dim=63"], "model.head_dim=63 must be even"),
        (["model=qwen3_debug", "training.seq_len=4096"], "exceeds model.max_seq_len"),
        (["parallelism.tp=3"], "!= world size 1"),
        (["parallelism.dp_shard=0"], "dp_shard=0 must be >= 1 or -1"),
        (["cluster.device=cuda"], "no CUDA device is visible"),
        (["cluster.backend=nccl"], "nccl needs CUDA"),
        (["data=json"], "data.source=json needs a file"),
        (["data=json", "data.path=/nonexistent/x.jsonl"], "data.path=/nonexistent/x.jsonl does not exist"),
        (["data.tokenizer=/nonexistent/tok.json"], "data.tokenizer=/nonexistent/tok.json does not exist"),
        (["model.vocab_size=1000"], "exceeds model.vocab_size=1000"),
        (["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
        (["cluster.nproc_per_node=0"], "cluster.nproc_per_node=0 must be > 0"),
    ],
)
def test_cross_field_rules(overrides, expected):
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_launch_prints_one_line_error_and_exits_nonzero(tmp_path: Path):
    proc = run_launch(["training.steps=0"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines[-1] == "error: training.steps=0 must be > 0"
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


@pytest.mark.slow
def test_cfg_job_prints_composed_config(tmp_path: Path):
    proc = run_launch(["--cfg", "job", "model=llama3_8b"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "flavor: llama3_8b" in proc.stdout
    assert "dim: 4096" in proc.stdout


@pytest.mark.slow
def test_dry_run_prints_plan(tmp_path: Path):
    proc = run_launch(["dry_run=true", "model=llama3_8b", "training.seq_len=2048",
                       "training.local_batch_size=1", "data.max_documents=1"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "8,030,261,248" in proc.stdout
    assert not list(tmp_path.rglob("metrics.jsonl"))


# Published Hugging Face config.json values of each flavor (the oracle; copied from the released
# configs, in their legacy rope_theta / rope_scaling spelling). The *_debug flavors have no
# published model: their HF config is derived with FAMILY.hf.hf_config(args) instead.
_LLAMA31 = {"rope_theta": 500000.0, "rope_scaling": {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192}, "max_position_embeddings": 131072, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
_LLAMA32 = {**_LLAMA31, "rope_scaling": {**_LLAMA31["rope_scaling"], "factor": 32.0}, "tie_word_embeddings": True}
_LLAMA2 = {"rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": 32000, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False}
_QWEN3 = {"vocab_size": 151936, "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
          "head_dim": 128, "num_key_value_heads": 8, "attention_bias": False, "use_sliding_window": False}
_QWEN3_MOE = {**_QWEN3, "num_key_value_heads": 4, "tie_word_embeddings": False, "num_experts": 128,
              "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}

# DeepSeek (deepseek-ai/DeepSeek-V3, DeepSeek-V2, DeepSeek-V2-Lite config.json): MLA, legacy YaRN
# rope_scaling. head_dim is what transformers derives (the rotary width). V2 and V2-Lite are
# model_type deepseek_v2 (softmax routing): HF's DeepseekV2 class counts them, and our
# deepseek_v3 family refuses to export them (HF's DeepseekV3 routes with sigmoid only).
_DEEPSEEK = {"rope_theta": 10000, "max_position_embeddings": 163840, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": False, "head_dim": 64, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
             "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_scaling": {
                 "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                 "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}}
_DEEPSEEK_V2 = {**_DEEPSEEK, "architectures": ["DeepseekV2ForCausalLM"], "vocab_size": 102400,
                "scoring_func": "softmax", "first_k_dense_replace": 1, "norm_topk_prob": False}
_DEEPSEEK_V3 = {**_DEEPSEEK, "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
                "rope_scaling": {**_DEEPSEEK["rope_scaling"], "mscale": 1.0, "mscale_all_dim": 1.0},
                "scoring_func": "sigmoid", "topk_method": "noaux_tc", "first_k_dense_replace": 3,
                "norm_topk_prob": True}

# GPT-OSS (openai/gpt-oss-20b, gpt-oss-120b config.json; experts stored MXFP4, counted unquantized)
_GPT_OSS = {"architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5, "rope_theta": 150000, "rope_scaling": {
                "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False}, "tie_word_embeddings": False, "attention_bias": True,
            "head_dim": 64, "sliding_window": 128, "num_experts_per_tok": 4, "swiglu_limit": 7.0}

# Llama 4 (meta-llama/Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E: the text_config of each,
# which transformers loads as Llama4ForCausalLM). Published contexts are 10M / 1M tokens; our
# flavors size their rotary tables for 131072 (CONTEXT_CAPPED).
_LLAMA4 = {"architectures": ["Llama4ForCausalLM"], "vocab_size": 202048, "rms_norm_eps": 1e-5, "head_dim": 128,
           "num_key_value_heads": 8, "intermediate_size_mlp": 16384, "num_experts_per_tok": 1,
           "attention_chunk_size": 8192, "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1,
           "attention_bias": False, "tie_word_embeddings": False, "rope_theta": 500000.0}

# Qwen3.5 / Qwen3-Next (text models): the defaults of transformers' Qwen3_5TextConfig (Qwen3.5-9B),
# Qwen3_5MoeTextConfig (Qwen3.5-35B-A3B) and Qwen3NextConfig (Qwen3-Next-80B-A3B), which their
# docstrings name; theta 1e7 and a 262,144-token context as released. intermediate_size of the MoE
# models builds nothing (every layer is MoE).
_QWEN35 = {"rms_norm_eps": 1e-6, "tie_word_embeddings": False, "head_dim": 256, "max_position_embeddings": 262144,
           "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
           "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
           "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
_QWEN35_MOE = {**_QWEN35, "shared_expert_intermediate_size": 512, "moe_intermediate_size": 512}


def _hf(base, hidden, inter, layers, heads, kv=None, **extra):
    cfg = {**base, "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
           "num_attention_heads": heads, **extra}
    if kv is not None:
        cfg["num_key_value_heads"] = kv
    cfg.setdefault("head_dim", hidden // heads)
    return cfg


PUBLISHED_HF = {
    "llama3_1b": ("llama", _hf(_LLAMA32, 2048, 8192, 16, 32, 8)),  # meta-llama/Llama-3.2-1B
    "llama3_3b": ("llama", _hf(_LLAMA32, 3072, 8192, 28, 24, 8)),  # meta-llama/Llama-3.2-3B
    "llama3_8b": ("llama", _hf(_LLAMA31, 4096, 14336, 32, 32, 8)),  # meta-llama/Llama-3.1-8B
    "llama3_70b": ("llama", _hf(_LLAMA31, 8192, 28672, 80, 64, 8)),  # meta-llama/Llama-3.1-70B
    "llama3_405b": ("llama", _hf(_LLAMA31, 16384, 53248, 126, 128, 8)),  # meta-llama/Llama-3.1-405B
    "llama2_7b": ("llama", _hf(_LLAMA2, 4096, 11008, 32, 32, 32)),  # meta-llama/Llama-2-7b-hf
    "llama2_13b": ("llama", _hf(_LLAMA2, 5120, 13824, 40, 40, 40)),  # meta-llama/Llama-2-13b-hf
    "llama2_70b": ("llama", _hf(_LLAMA2, 8192, 28672, 80, 64, 8)),  # meta-llama/Llama-2-70b-hf
    "qwen3_0.6b": ("qwen3", _hf(_QWEN3, 1024, 3072, 28, 16, tie_word_embeddings=True)),  # Qwen/Qwen3-0.6B
    "qwen3_1.7b": ("qwen3", _hf(_QWEN3, 2048, 6144, 28, 16, tie_word_embeddings=True)),  # Qwen/Qwen3-1.7B
    "qwen3_4b": ("qwen3", _hf(_QWEN3, 2560, 9728, 36, 32, tie_word_embeddings=True)),  # Qwen/Qwen3-4B
    "qwen3_8b": ("qwen3", _hf(_QWEN3, 4096, 12288, 36, 32, tie_word_embeddings=False)),  # Qwen/Qwen3-8B
    "qwen3_14b": ("qwen3", _hf(_QWEN3, 5120, 17408, 40, 40, tie_word_embeddings=False)),  # Qwen/Qwen3-14B
    "qwen3_32b": ("qwen3", _hf(_QWEN3, 5120, 25600, 64, 64, tie_word_embeddings=False)),  # Qwen/Qwen3-32B
    "qwen3_30b_a3b": ("qwen3_moe", _hf(_QWEN3_MOE, 2048, 6144, 48, 32, moe_intermediate_size=768)),  # Qwen/Qwen3-30B-A3B
    "qwen3_235b_a22b": ("qwen3_moe", _hf(_QWEN3_MOE, 4096, 12288, 94, 64,  # Qwen/Qwen3-235B-A22B
                                         moe_intermediate_size=1536)),
    "deepseek_v3_16b": ("deepseek_v2", _hf(_DEEPSEEK_V2, 2048, 10944, 27, 16, 16,  # deepseek-ai/DeepSeek-V2-Lite
                                           q_lora_rank=None, n_routed_experts=64, n_shared_experts=2,
                                           num_experts_per_tok=6, moe_intermediate_size=1408, n_group=1,
                                           topk_group=1, routed_scaling_factor=1.0, topk_method="greedy")),
    "deepseek_v3_236b": ("deepseek_v2", _hf(_DEEPSEEK_V2, 5120, 12288, 60, 128, 128,  # deepseek-ai/DeepSeek-V2
                                            q_lora_rank=1536, n_routed_experts=160, n_shared_experts=2,
                                            num_experts_per_tok=6, moe_intermediate_size=1536, n_group=8,
                                            topk_group=3, routed_scaling_factor=16.0,
                                            topk_method="group_limited_greedy")),
    "deepseek_v3_671b": ("deepseek_v3", _hf(_DEEPSEEK_V3, 7168, 18432, 61, 128, 128,  # deepseek-ai/DeepSeek-V3
                                            q_lora_rank=1536, n_routed_experts=256, n_shared_experts=1,
                                            num_experts_per_tok=8, moe_intermediate_size=2048, n_group=8,
                                            topk_group=4, routed_scaling_factor=2.5)),
    "gpt_oss_20b": ("gpt_oss", _hf(_GPT_OSS, 2880, 2880, 24, 64, 8, num_local_experts=32)),  # openai/gpt-oss-20b
    "gpt_oss_120b": ("gpt_oss", _hf(_GPT_OSS, 2880, 2880, 36, 64, 8, num_local_experts=128)),  # openai/gpt-oss-120b
    "llama4_scout": ("llama4_text", _hf(_LLAMA4, 5120, 8192, 48, 40, num_local_experts=16,  # Llama-4-Scout-17B-16E
                                        interleave_moe_layer_step=1, use_qk_norm=True,
                                        max_position_embeddings=10485760, rope_scaling={
                                            "rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 1.0, "original_max_position_embeddings": 8192})),
    "llama4_maverick": ("llama4_text", _hf(_LLAMA4, 5120, 8192, 48, 40, num_local_experts=128,  # -Maverick-17B-128E
                                           interleave_moe_layer_step=2, use_qk_norm=False,
                                           max_position_embeddings=1048576, rope_scaling=None)),
    "qwen3_5_9b": ("qwen3_5_text", _hf({**_QWEN35, "architectures": ["Qwen3_5ForCausalLM"]}, 4096, 12288, 32, 16, 4,
                                       vocab_size=248320)),
    "qwen3_5_35b_a3b": ("qwen3_5_moe_text", _hf({**_QWEN35_MOE, "architectures": ["Qwen3_5MoeForCausalLM"]}, 2048, 0,
                                                40, 16, 2, vocab_size=248320, num_experts=256, num_experts_per_tok=8)),
    "qwen3_next_80b_a3b": ("qwen3_next", _hf({**_QWEN35_MOE, "architectures": ["Qwen3NextForCausalLM"]}, 2048, 5632,
                                             48, 16, 2, vocab_size=151936, num_experts=512, num_experts_per_tok=10,
                                             norm_topk_prob=True)),
}
# Flavors whose max_seq_len (rotary table size, one fp32 [max_seq_len, head_dim/2] pair per rank)
# is deliberately below the published context: raise model.max_seq_len to train longer.
CONTEXT_CAPPED = {"llama4_scout": 131072, "llama4_maverick": 131072}
HF_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                 "max_position_embeddings", "rms_norm_eps")
HF_MOE_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
               "linear_conv_kernel_dim", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok", "num_local_experts", "intermediate_size_mlp",
               "attention_chunk_size", "use_qk_norm", "floor_scale", "attn_scale", "attn_temperature_tuning", "moe_intermediate_size", "norm_topk_prob", "mlp_only_layers",
               "n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group",
               "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
               "v_head_dim")


# Model options of our own (no published checkpoint to compare with): the debug flavors and the
# ~100M shape that the CPU benchmarks and optimizer comparisons train.
OWN_SHAPES = {"llama3_100m"}


def test_published_table_covers_every_model_option():
    own = {o for o in LANGUAGE_MODELS if o.endswith("_debug")} | OWN_SHAPES
    assert set(PUBLISHED_HF) | own == set(LANGUAGE_MODELS)


# flux_* has no transformers counterpart: tests/test_flux_training.py checks it against diffusers.
# hf, hf_* are transformers' own class: tests/test_hf_family.py checks it against AutoModelForCausalLM.
LANGUAGE_MODELS = [o for o in options("model") if not o.startswith(("flux", "hf"))]


@pytest.mark.parametrize("flavor", LANGUAGE_MODELS)
def test_model_option_builds_and_matches_published_hf_config(flavor):
    """Every conf/model option: the built model's args are the yaml node, and its parameter count
    equals the family's shape() and transformers' count of the published HF config (meta device)."""
    import dataclasses

    import torch
    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from titan_hydra.models.common.hf_decoder import rope_theta_of
    from titan_hydra.models.registry import LABELS, args_of, build_model

    transformers = pytest.importorskip("transformers")
    cfg = compose_cfg([f"model={flavor}"])
    node = OmegaConf.to_container(cfg.model, resolve=True)
    assert node["flavor"] == flavor
    with torch.device("meta"):
        family, model = build_model(cfg.model)
    assert type(model) is get_class(node["_target_"])
    assert family.name == node["family"] and args_of(cfg.model) == (family, model.args)
    fields = {f.name for f in dataclasses.fields(model.args)}
    assert fields == set(node) - set(LABELS), flavor  # the schema names every field of the args
    plain = family.args_fields(model.args)  # nested args (model.moe) as dicts, like the node
    for key in fields:
        assert plain[key] == node[key], (flavor, key)
    ours = sum(p.numel() for p in model.parameters())
    assert ours == family.shape(model.args).params

    if flavor in PUBLISHED_HF and PUBLISHED_HF[flavor][0] != family.hf.model_type:
        # another HF architecture's shape (DeepSeek-V2 softmax routing): export refused in one line
        with pytest.raises(HFConversionError) as err:
            family.hf.hf_config(model.args)
        assert "\n" not in str(err.value)
        ours_hf = {**PUBLISHED_HF[flavor][1], "model_type": PUBLISHED_HF[flavor][0]}
    else:
        ours_hf = family.hf.hf_config(model.args)
    if flavor in PUBLISHED_HF:
        model_type, published = PUBLISHED_HF[flavor]
        assert ours_hf["model_type"] == model_type
        for key in HF_SHAPE_KEYS + tuple(k for k in HF_MOE_KEYS if k in published):
            if key == "max_position_embeddings" and flavor in CONTEXT_CAPPED:
                assert ours_hf[key] == CONTEXT_CAPPED[flavor] < published[key]
                continue
            assert ours_hf[key] == published[key], (flavor, key)
        (theta, scaling), (our_theta, our_scaling) = rope_theta_of(published), rope_theta_of(ours_hf)
        assert our_theta == theta
        rope_type = lambda sc: sc.get("rope_type") or sc.get("type") or "default"  # noqa: E731 (legacy: "type")
        assert rope_type(our_scaling) == rope_type(scaling)
        for key in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                    "beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
            assert our_scaling.get(key) == scaling.get(key), (flavor, key)
        for key in ("attention_bias", "use_sliding_window"):
            if key in published:
                assert ours_hf[key] == published[key]
        hf_cfg = {**published}
    else:  # *_debug: nothing published; HF's model of our own export config
        model_type, hf_cfg = ours_hf["model_type"], {k: v for k, v in ours_hf.items() if k != "model_type"}
    hf_cls = getattr(transformers, (hf_cfg.get("architectures") or ours_hf["architectures"])[0])  # LlamaForCausalLM, Qwen3MoeForCausalLM, ...
    # Building even 405B on the meta device takes ~1 s (measured), so HF's count is its own
    # model's, not a formula.
    with torch.device("meta"):
        hf_model = hf_cls(hf_cls.config_class(**hf_cfg))
    unique = {id(p): p.numel() for _, p in hf_model.named_parameters(remove_duplicate=False)}
    assert sum(unique.values()) == ours, (flavor, sum(unique.values()), ours)
    tied = hf_model.lm_head.weight is hf_model.model.embed_tokens.weight
    assert tied == model.args.tie_word_embeddings == (model.tok_embeddings.weight is model.output.weight)


def test_default_warmup_fits_any_run_length():
    """The default schedules warm up for a fraction of the run: a 5-step run is valid (1 warmup
    step), the default 50-step run keeps 10; an explicit warmup longer than the run is refused."""
    import torch

    from titan_hydra.errors import ConfigError
    from titan_hydra.schedules import lr_multiplier
    from titan_hydra.validate import validate

    for steps, warmup in ((5, 1), (50, 10), (1000, 200)):
        cfg = compose_cfg([f"training.steps={steps}"])
        validate(cfg)
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        sched = instantiate_checked(cfg.lr_scheduler)(opt, steps)
        expected = lr_multiplier(0, total_steps=steps, warmup_steps=warmup, decay_ratio=None,
                                 decay_type="cosine", min_lr_factor=0.1)
        assert sched.get_last_lr()[0] == pytest.approx(expected) == pytest.approx(1 / (warmup + 1))
    with pytest.raises(ConfigError, match="lr_scheduler.warmup_steps=20 exceeds training.steps=5"):
        validate(compose_cfg(["training.steps=5", "lr_scheduler.warmup_steps=20"]))
