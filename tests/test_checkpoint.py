"""Checkpointing in one process: exact resume, atomicity, async, keep-k, seed/initial loads, bad checkpoints.

The runs train in this process (pretrain.run) to keep the suite fast; multi-process layouts and
crash recovery are in test_checkpoint_layouts.py.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import compose_cfg
from titan_hydra.checkpoint import CheckpointError, CheckpointManager, list_steps, read_marker
from titan_hydra.checkpoint.storage import load_plain, read_metadata, save_plain, tensor_entries, tensor_json
from titan_hydra.train.pretrain import run

STEPS = 8
BASE = [
    "model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.vocab_size=2048",
    "training.seq_len=32", "training.local_batch_size=2", f"training.steps={STEPS}",
    "training.mixed_precision=fp32", "training.deterministic=true", "training.val_freq=0",
    "lr_scheduler.warmup_steps=2", "data.max_documents=40", "logger=minimal", "cluster.threads_per_proc=1",
    "checkpoint=default", "checkpoint.interval=2", "checkpoint.keep_latest_k=2",
]


# Model family -> overrides after BASE (Qwen3: tied embeddings as in qwen3_debug, head_dim 16 so
# q is 64 wide on the 32-wide model, QK-norm weights in the state).
FAMILIES = {
    "llama3": [],
    "qwen3": ["model=qwen3_debug", "model.head_dim=16", "model.ffn_hidden_dim=96"],
    # Qwen3-MoE with the aux-loss-free bias on: expert_bias (a buffer the optimizer never sees)
    # must come back from the checkpoint for the resumed run to route exactly as the reference.
    "qwen3_moe": ["model=qwen3_moe_debug", "model.head_dim=16", "model.moe.num_experts=4", "model.moe.expert_dim=32",
                  "model.moe.load_balance_coeff=0.01"],
}


def train(run_dir: Path, *extra: str, family: str = "llama3") -> dict:
    return run(spec_of(compose_cfg(BASE + FAMILIES[family] + list(extra))), str(run_dir), return_state=True)


def reference_of(run_cache, family: str) -> tuple[Path, dict]:
    """8 uninterrupted steps of ``family``, checkpoints every 2 (kept: the latest 2); once per family."""
    return run_cache.once(("checkpoint_reference", family), lambda run_dir: (run_dir, train(run_dir, family=family)))


@pytest.fixture
def reference(run_cache):
    return reference_of(run_cache, "llama3")


def assert_same_params(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k}: max diff {(a[k] - b[k]).abs().max().item()}"


def ckpt(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoint" / f"step-{step}"


def test_keep_latest_k_and_markers(reference):
    run_dir, _ = reference
    steps = list_steps(run_dir / "checkpoint")
    assert [(s.step, s.complete) for s in steps] == [(6, True), (8, True)]
    marker = read_marker(ckpt(run_dir, 8))
    assert marker["step"] == 8 and marker["kind"] == "full" and marker["model"]["signature"]["dim"] == 32


def test_state_contents(reference):
    """Everything of part 1 is in the checkpoint with the values the run had."""
    run_dir, summary = reference
    path = ckpt(run_dir, 8)
    entries = tensor_entries(read_metadata(path))
    extra = tensor_json(load_plain(path, ["extra"])["extra"])
    assert extra["train_state"]["step"] == 8 and extra["train_state"]["losses"] == summary["losses"]
    assert extra["lr_scheduler"]["last_epoch"] == 8
    assert extra["dataloader"]["consumed"] == 8 * 2
    rank = tensor_json(load_plain(path, ["rank_state.0"])["rank_state.0"])
    assert set(rank["rng"]) >= {"python", "numpy", "torch"}
    assert any(k.startswith("optim.state.layers.0.attention.wq.weight.exp_avg") for k in entries)
    model = load_plain(path, [k for k in entries if k.startswith("model.")])
    assert_same_params({k[6:]: v for k, v in model.items()}, summary["full_state"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_exact_resume(run_cache, tmp_path, capsys, family):
    """6 steps + resume + 2 steps == 8 steps, bit for bit (losses and parameters).

    Qwen3 is tied: a load that broke the tie (two matrices with equal values) would still give
    step 7's loss but not step 8's, after two separate updates."""
    run_dir, ref = reference_of(run_cache, family)
    model = read_marker(ckpt(run_dir, 8))["model"]
    assert model["family"] == family and model["signature"]["tie_word_embeddings"] == (family == "qwen3"), model
    shutil.copytree(run_dir / "checkpoint", tmp_path / "checkpoint")
    shutil.rmtree(ckpt(tmp_path, 8))
    capsys.readouterr()
    resumed = train(tmp_path, family=family)
    assert f"loaded {ckpt(tmp_path, 6)}" in capsys.readouterr().out
    assert resumed["losses"] == ref["losses"]
    assert_same_params(resumed["full_state"], ref["full_state"])
    # The re-saved step-8 checkpoint carries the same RNG, loader and schedule state.
    for key in ("extra", "rank_state.0"):
        a = tensor_json(load_plain(ckpt(run_dir, 8), [key])[key])
        b = tensor_json(load_plain(ckpt(tmp_path, 8), [key])[key])
        assert a == b, key


def test_incomplete_checkpoint_ignored(reference, tmp_path, capsys):
    """A save killed before its marker (here: marker gone, data truncated) is reported and skipped."""
    run_dir, ref = reference
    shutil.copytree(run_dir / "checkpoint", tmp_path / "checkpoint")
    bad = ckpt(tmp_path, 8)
    (bad / "COMPLETE.json").unlink()
    data = sorted(bad.glob("*.distcp"))[0]
    data.write_bytes(data.read_bytes()[:100])
    resumed = train(tmp_path)
    out = capsys.readouterr().out
    assert f"ignoring incomplete checkpoint {bad}" in out
    assert f"loaded {ckpt(tmp_path, 6)}" in out
    assert resumed["losses"] == ref["losses"]
    assert_same_params(resumed["full_state"], ref["full_state"])
    assert read_marker(bad) is not None  # step 8 was saved again, completely


def test_async_save_matches_sync(reference, tmp_path):
    run_dir, ref = reference
    out = train(tmp_path, "checkpoint=async", "checkpoint.interval=2", "checkpoint.keep_latest_k=2")
    assert out["losses"] == ref["losses"]
    keys = list(tensor_entries(read_metadata(ckpt(run_dir, 6))))
    a, b = load_plain(ckpt(run_dir, 6), keys), load_plain(ckpt(tmp_path, 6), keys)
    assert all(torch.equal(a[k], b[k]) for k in keys)
    assert [s.step for s in list_steps(tmp_path / "checkpoint") if s.complete] == [6, 8]


def test_load_step_exclude_and_model_only_export(reference, tmp_path, capsys):
    """load_step picks an older step; exclude_from_loading leaves the excluded state fresh."""
    run_dir, ref = reference
    shutil.copytree(run_dir / "checkpoint", tmp_path / "checkpoint")
    out = train(tmp_path, "checkpoint.load_step=6", "checkpoint.exclude_from_loading=[dataloader]",
                "checkpoint.last_save_model_only=true", "checkpoint.export_dtype=bfloat16", "checkpoint.keep_latest_k=0")
    assert f"loaded {ckpt(tmp_path, 6)}" in capsys.readouterr().out
    assert out["losses"][:6] == ref["losses"][:6]  # train state restored from step 6
    assert out["losses"][6:] != ref["losses"][6:]  # data restarted from the first batch
    export = ckpt(tmp_path, 8)
    marker = read_marker(export)
    assert marker["kind"] == "model_only" and marker["dtype"] == "bfloat16"
    entries = tensor_entries(read_metadata(export))
    assert all(k.startswith("model.") for k in entries)
    weights = load_plain(export, list(entries))
    assert all(v.dtype == torch.bfloat16 for v in weights.values())
    for k, v in out["full_state"].items():
        assert torch.equal(weights[f"model.{k}"], v.to(torch.bfloat16))


def test_seed_checkpoint_and_initial_load(tmp_path):
    seed_dir = tmp_path / "seed"
    summary = train(seed_dir, "checkpoint.create_seed_checkpoint=true")
    assert summary["steps"] == 0
    marker = read_marker(ckpt(seed_dir, 0))
    assert marker["kind"] == "model_only"
    # A run with another init seed (same data order) that loads the seed checkpoint starts from the same weights.
    other = train(tmp_path / "other", "training.seed=7", "data.seed=42", "training.steps=1",
                  f"checkpoint.initial_load_path={ckpt(seed_dir, 0)}", "checkpoint.enable=false")
    base = train(tmp_path / "base", "training.steps=1", "checkpoint.enable=false")
    assert other["losses"] == base["losses"]


# ---------------------------------------------------------------------------- bad checkpoints


def _manager(tmp_path: Path, dim: int = 32, n_layers: int = 2) -> CheckpointManager:
    from titan_hydra.models.llama3 import FAMILY, Llama3
    from titan_hydra.train.trainer import TrainState
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.schedules import WarmupDecay

    torch.manual_seed(0)
    model = Llama3(dim=dim, n_layers=n_layers, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return CheckpointManager(run_dir=tmp_path, model_parts=[model], optimizer=opt,
                             lr_scheduler=WarmupDecay()(opt, 10), train_loader=object(), train_state=TrainState(),
                             dims=ParallelDims(), family=FAMILY, model_args=model.args, flavor="custom",
                             enable=True, interval=1)


def _snapshot(m: CheckpointManager) -> dict:
    return {k: v.clone() for k, v in m.model_parts[0].state_dict().items()}


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A model-only checkpoint of the small model used by the bad-checkpoint tests."""
    path = tmp_path_factory.mktemp("good") / "step-0"
    m = _manager(path.parent)
    save_plain(path, m.state_to_save(model_only=True), m.run.marker_info(0, "model_only", "float32"))
    return path


def _expect_error(m: CheckpointManager, path: Path, pattern: str) -> None:
    before = _snapshot(m)
    with pytest.raises(CheckpointError, match=pattern) as info:
        m.load(path, model_only=True, require_marker=False)
    assert str(path) in str(info.value)
    after = _snapshot(m)
    assert all(torch.equal(before[k], after[k]) for k in before), "partial load"


def test_bad_shapes(good, tmp_path):
    big = _manager(tmp_path, dim=64)
    path = tmp_path / "wide"
    save_plain(path, big.state_to_save(model_only=True), {"step": 0})  # no model signature
    _expect_error(_manager(tmp_path), path, r"tok_embeddings.weight has shape \[64, 64\], this run's model needs \[64, 32\]")


def test_missing_keys(good, tmp_path):
    m = _manager(tmp_path)
    state = {k: v for k, v in m.state_to_save(model_only=True).items() if ".1." not in k}
    save_plain(tmp_path / "short", state, {"step": 0})
    _expect_error(m, tmp_path / "short", r"lacks 9 model entries this run needs \(layers\.1\.")


def test_other_flavor(good, tmp_path):
    deeper = _manager(tmp_path, n_layers=3)
    _expect_error(deeper, good, r"saved from a different model .*n_layers=2 \(run has 3\)")


def test_truncated_file(good, tmp_path):
    path = tmp_path / "trunc"
    shutil.copytree(good, path)
    data = sorted(path.glob("*.distcp"))[0]
    size = data.stat().st_size
    data.write_bytes(data.read_bytes()[: size // 2])
    _expect_error(_manager(tmp_path), path, rf"data file {data.name} is truncated \({size // 2} bytes")


def test_foreign_metadata_is_never_unpickled(good, tmp_path):
    path = tmp_path / "evil"
    shutil.copytree(good, path)
    flag = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (Path.touch, (flag,))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    _expect_error(_manager(tmp_path), path, r"\.metadata is unreadable or not DCP metadata \(refusing to load pathlib")
    assert not flag.exists()
    (path / ".metadata").write_bytes(b"not a pickle at all")
    _expect_error(_manager(tmp_path), path, r"\.metadata is unreadable")


def test_extended_run_takes_its_learning_rates_from_the_new_schedule(tmp_path):
    """Train 4 steps (checkpoint at 4), start again in the same run dir with 8 steps and a new
    peak LR: from step 5 on every LR is the 8-step schedule's (the optimizer state restored from
    the checkpoint holds the 4-step schedule's value, which must not leak into step 5)."""
    import json

    from titan_hydra.schedules import lr_multiplier

    def lrs(run_dir):
        rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
        return {r["step"]: r["lr"] for r in rows if "lr" in r}

    run_dir = tmp_path / "run"
    train(run_dir, "training.steps=4", "checkpoint.interval=4")
    train(run_dir, "training.steps=8", "checkpoint.interval=4", "optimizer.lr=5e-4")
    got = lrs(run_dir)
    schedule = dict(total_steps=8, warmup_steps=2, decay_ratio=None, decay_type="cosine", min_lr_factor=0.1)
    for step in range(5, 9):
        assert got[step] == pytest.approx(5e-4 * lr_multiplier(step - 1, **schedule), rel=1e-9), (step, got)


@pytest.mark.parametrize("override,message", [
    ("checkpoint.interval=-1", "checkpoint.interval=-1 must be >= 0"),
    ("checkpoint.keep_latest_k=-2", "checkpoint.keep_latest_k=-2 must be >= 0"),
])
def test_negative_checkpoint_settings_refused(override, message):
    from titan_hydra.errors import ConfigError
    from titan_hydra.validate import validate

    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(BASE + [override]))


def test_interval_zero_saves_only_at_the_end_and_keep_zero_keeps_all(tmp_path):
    train(tmp_path / "end", "checkpoint.interval=0")
    assert [s.step for s in list_steps(tmp_path / "end" / "checkpoint")] == [STEPS]
    train(tmp_path / "all", "checkpoint.interval=2", "checkpoint.keep_latest_k=0")
    assert [s.step for s in list_steps(tmp_path / "all" / "checkpoint")] == [2, 4, 6, 8]
