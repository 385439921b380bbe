"""The torchtitan side-by-side harness (scripts/torchtitan_side_by_side/run.py) without torchtitan:
both systems get the same sequence length, batch and steps, and titan_hydra's overrides compose
into torchtitan's debug shapes (dim, layers, experts, top-k, expert width, parameter count)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO, compose_cfg

from titan_hydra.models.registry import args_of, build_model
from titan_hydra.validate import validate

TOKENIZER = REPO / "tests" / "data" / "torchtitan_test_tokenizer" / "tokenizer.json"


def _load_harness():
    spec = importlib.util.spec_from_file_location("tt_side_by_side_run", REPO / "scripts" / "torchtitan_side_by_side" / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


harness = _load_harness()


def _flag(argv: list[str], name: str) -> str:
    for i, a in enumerate(argv):
        if a == name:
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    raise AssertionError(f"{name} not in {argv}")


def _override(argv: list[str], key: str, default: str | None = None) -> str:
    values = [a.split("=", 1)[1] for a in argv if a.startswith(key + "=")]
    if not values:
        assert default is not None, f"{key} not in {argv}"
        return default
    return values[-1]


@pytest.mark.parametrize("name", list(harness.COMPARISONS))
def test_both_sides_get_the_same_sequence_batch_and_steps(name, tmp_path):
    c = harness.COMPARISONS[name]
    cmds = harness.commands(c, steps=7, seq_len=384, threads=2, tt_venv=tmp_path / "venv", work=tmp_path)
    tt, tt_env, _ = cmds["torchtitan"]
    th, th_env, cwd = cmds["titan_hydra"]
    seq = "2048" if c.family == "llama3" else "384"
    assert _flag(tt, "--training.seq_len") == _override(th, "training.seq_len") == seq
    assert _flag(tt, "--training.steps") == _override(th, "training.steps") == "7"
    assert _flag(tt, "--training.local_batch_size") == _override(th, "training.local_batch_size") == str(c.batch)
    nproc = 2 if "ep2" in name else 1
    assert _flag(tt, "--nproc_per_node") == _override(th, "cluster.nproc_per_node", "1") == str(nproc)
    assert _override(th, "training.global_batch_size") == str(c.batch * nproc)
    threads = "1" if nproc == 2 else "2"
    assert tt_env["OMP_NUM_THREADS"] == th_env["OMP_NUM_THREADS"] == _override(th, "cluster.threads_per_proc") == threads
    assert _flag(tt, "--config") == c.tt_config and cwd == REPO
    assert ("compile=model_loss" in th) == c.compiled == ("compile" in c.tt_config.split("_"))
    assert ("training.mixed_precision=fp32" in th) == ("fp32" in c.tt_config.split("_"))
    selective = {"activation_checkpoint=selective_op", "activation_checkpoint.selective_op_policy=every_second_mm"}
    if c.family == "llama3":  # both defaults, as in the earlier dense measurement
        assert not any(a.startswith("activation_checkpoint") for a in th)
    elif name == "qwen3_moe_ep2_compile":  # torchtitan's AC fails compiled under EP: off on both sides
        assert "activation_checkpoint=none" in th and not selective & set(th)
    else:  # torchtitan's SelectiveAC, under titan_hydra's name
        assert selective <= set(th)


# torchtitan 0.3.0's debug shapes (models/qwen3 "debugmodel_moe", models/deepseek_v3 "debugmodel") and
# the parameter counts torchtitan logs for them.
TT_SHAPES = {
    "qwen3_moe_ep2_eager": dict(dim=256, n_layers=8, n_heads=16, num_experts=64, top_k=8, expert_dim=768,
                                shared=0, params=315_758_848),
    "deepseek_v3_ep2_eager": dict(dim=256, n_layers=6, n_heads=16, num_experts=8, top_k=3, expert_dim=256,
                                  shared=2, params=33_014_016),
}


@pytest.mark.parametrize("name", list(TT_SHAPES))
def test_titan_hydra_overrides_compose_into_torchtitans_debug_shapes(name, tmp_path):
    c, want = harness.COMPARISONS[name], TT_SHAPES[name]
    data = tmp_path / "data.json"
    data.write_text('{"text": "a few words"}\n')
    argv, _ = harness.th_command(c, steps=5, seq_len=512, threads=2, data_path=data, tokenizer=TOKENIZER,
                                 run_dir=tmp_path / "run")
    overrides = [a for a in argv[2:] if not a.startswith("hydra.")]
    cfg = compose_cfg(overrides)
    validate(cfg)  # the 2-rank EP layout, batch plan, data and tokenizer as launch.py would check them
    _, args = args_of(cfg.model)
    assert (args.dim, args.n_layers, args.n_heads) == (want["dim"], want["n_layers"], want["n_heads"])
    assert (args.moe.num_experts, args.moe.top_k, args.moe.expert_dim) == (want["num_experts"], want["top_k"],
                                                                          want["expert_dim"])
    assert args.moe.num_shared_experts == want["shared"] and args.moe.load_balance_coeff == 1e-3
    assert args.moe.aux_loss_coeff == 0.0 and not args.tie_word_embeddings
    assert (cfg.parallelism.name, cfg.parallelism.ep, cfg.cluster.nproc_per_node) == ("ep", -1, 2)
    with torch.device("meta"):
        _, model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == want["params"]


def test_llama3_overrides_give_torchtitans_dense_debug_model():
    argv, _ = harness.th_command(harness.COMPARISONS["llama3_eager_bf16"], steps=5, seq_len=512, threads=2,
                                 data_path=Path("unused.json"), tokenizer=TOKENIZER, run_dir=Path("unused"))
    cfg = compose_cfg([a for a in argv[2:] if a.startswith("model")])
    _, args = args_of(cfg.model)
    assert (args.dim, args.n_layers, args.n_heads, args.vocab_size) == (256, 6, 16, 2048)
    assert args.rope_scaling and args.rope_scaling_factor == 8.0 and args.rope_theta == 500000.0
    with torch.device("meta"):
        _, model = build_model(cfg.model)
    assert sum(p.numel() for p in model.parameters()) == 6_163_712


def test_isa_cap_reaches_both_sides_with_a_cache_of_its_own(tmp_path):
    c = harness.COMPARISONS["llama3_compile_fp32"]
    capped = harness.commands(c, steps=5, seq_len=512, threads=2, tt_venv=tmp_path / "venv", work=tmp_path,
                              isa_cap="avx2")
    plain = harness.commands(c, steps=5, seq_len=512, threads=2, tt_venv=tmp_path / "venv", work=tmp_path)
    for system in ("torchtitan", "titan_hydra"):
        env = capped[system][1]
        assert env["ATEN_CPU_CAPABILITY"] == "avx2" and env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
        assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor_avx2")
        assert "ATEN_CPU_CAPABILITY" not in plain[system][1] and "TORCHINDUCTOR_CACHE_DIR" not in plain[system][1]
