"""The config tree: every option composes, schemas reject typos and wrong types, and the
cross-field rules fail with their own one-line messages before anything is built."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from conftest import CONF, compose_cfg, run_launch
from titan_hydra.errors import ConfigError
from titan_hydra.validate import validate

GROUPS = [p.name for p in CONF.iterdir() if p.is_dir()]


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.mark.parametrize(
    "group,option", [(g, o) for g in GROUPS for o in options(g)], ids=lambda x: str(x)
)
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
        (["parallelism.tp=3"], "!= world size 1"),
        (["parallelism.dp_shard=0"], "dp_shard=0 must be >= 1 or -1"),
        (["parallelism.pp_schedule=Zigzag"], "pp_schedule='Zigzag' unknown"),
        (["parallelism.cp_rotate_method=ring"], "cp_rotate_method='ring'"),
        (["cluster.device=cuda"], "no CUDA device is visible"),
        (["cluster.backend=nccl"], "nccl needs CUDA"),
        (["compile.mode=max"], "compile.mode='max' is not one of"),
        (["data=json"], "data=json needs a file"),
        (["data=json", "data.path=/nonexistent/x.jsonl"], "data.path=/nonexistent/x.jsonl does not exist"),
        (["data.tokenizer=/nonexistent/tok.json"], "data.tokenizer=/nonexistent/tok.json does not exist"),
        (["model.vocab_size=1000"], "exceeds model.vocab_size=1000"),
        (["optimizer.lr=0"], "optimizer.lr=0.0 must be > 0"),
        (["logger.wandb.mode=cloud"], "logger.wandb.mode='cloud'"),
        (["cluster.nproc_per_node=0"], "cluster.nproc_per_node=0 must be > 0"),
    ],
)
def test_cross_field_rules(overrides, expected):
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert expected in str(err.value)
    assert "\n" not in str(err.value)


def test_launch_prints_one_line_error_and_exits_nonzero(tmp_path: Path):
    proc = run_launch(["training.steps=0"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines[-1] == "error: training.steps=0 must be > 0"
    assert not (tmp_path / "outputs").exists() or not list((tmp_path / "outputs").rglob("metrics.jsonl"))


def test_cfg_job_prints_composed_config(tmp_path: Path):
    proc = run_launch(["--cfg", "job", "model=llama3_8b"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "flavor: llama3_8b" in proc.stdout
    assert "dim: 4096" in proc.stdout


def test_dry_run_prints_plan(tmp_path: Path):
    proc = run_launch(["dry_run=true", "model=llama3_8b", "training.seq_len=2048",
                       "training.local_batch_size=1", "data.max_documents=1"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "8,030,261,248" in proc.stdout
    assert not list(tmp_path.rglob("metrics.jsonl"))


@pytest.mark.parametrize("flavor", options("model"))
def test_model_yaml_matches_published_flavor_table(flavor):
    """conf/model/*.yaml and titan_hydra.models.flavors must describe the same shapes."""
    from titan_hydra.models.flavors import flavor_args

    cfg = compose_cfg([f"model={flavor}"])
    published = flavor_args(flavor)
    for key in ("dim", "n_layers", "n_heads", "vocab_size", "multiple_of", "ffn_dim_multiplier",
                "rope_theta", "rope_scaling"):
        assert cfg.model[key] == getattr(published, key), (flavor, key)
    assert (cfg.model.n_kv_heads or cfg.model.n_heads) == published.kv_heads
