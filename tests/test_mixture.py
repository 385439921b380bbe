"""Weighted mixtures of prepared corpora (titan_hydra/data/mixture.py): the measured share of each
source follows its weight, the order is the same under every data-parallel layout and resumes
across layouts, a run logs every source's own validation loss, and bad weights are refused in
one line before anything is built.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import TINY, compose_cfg, read_metrics
from titan_hydra.data.mixture import BLOCK, MixtureLoader, block_counts
from titan_hydra.data.prepare import PrepareSettings, prepare
from titan_hydra.errors import ConfigError, DataError
from titan_hydra.validate import validate

SEQ = 8
MODEL = [o for o in TINY if not o.startswith("data.")]  # the tiny model; the data is the mixture


def sources() -> dict[str, np.ndarray]:
    """Three token sequences told apart by their values (source s holds 100*s + small ids)."""
    rng = np.random.default_rng(0)
    return {name: (100 * (i + 1) + rng.integers(0, 50, size=n)).astype(np.int32)
            for i, (name, n) in enumerate((("web", 4001), ("code", 801), ("math", 1601)))}


def source_of(batch: torch.Tensor) -> np.ndarray:
    return (batch[:, 0].numpy() // 100) - 1


def test_block_counts_are_the_weights_rounded_by_largest_remainder():
    assert block_counts([0.5, 0.3, 0.2]).tolist() == [256, 154, 102]  # 153.6 and 102.4 -> 154, 102
    assert block_counts([1, 1, 1]).sum() == BLOCK and sorted(block_counts([1, 1, 1]).tolist()) == [170, 171, 171]


def test_each_source_gets_its_share_in_every_layout_and_resumes_across_them():
    data, weights = sources(), {"web": 0.6, "code": 0.1, "math": 0.3}
    one = MixtureLoader(data, weights, SEQ, 16, seed=5)
    seen = np.concatenate([source_of(next(one)[0]) for _ in range(64)])  # 1,024 samples: two blocks
    share = np.bincount(seen, minlength=3) / len(seen)
    assert np.abs(share - [0.6, 0.1, 0.3]).max() < 0.01, share
    first = [source_of(next(MixtureLoader(data, weights, SEQ, 16, seed=5))[0])]
    assert len(set(first[0].tolist())) == 3  # sources are interleaved, not in runs: one batch holds all three
    # two data-parallel ranks see the single process's global batches, row for row
    ref = MixtureLoader(data, weights, SEQ, 16, seed=5)
    ranks = [MixtureLoader(data, weights, SEQ, 8, dp_rank=r, dp_degree=2, seed=5) for r in range(2)]
    for _ in range(10):
        x, y = next(ref)
        parts = [next(r) for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
    # a state saved by rank 0 of the 2-rank layout resumes in one process at the same global batch
    resumed = MixtureLoader(data, weights, SEQ, 16, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))
    assert torch.equal(next(resumed)[0], next(ref)[0])
    # another weight is another order: a state cannot be loaded into it
    other = MixtureLoader(data, {**weights, "code": 0.2}, SEQ, 16, seed=5)
    with pytest.raises(DataError, match="weights was"):
        other.load_state_dict(ranks[0].state_dict())


def test_a_source_cycles_through_its_own_windows_in_a_fresh_order_each_epoch():
    data = sources()
    loader = MixtureLoader(data, {"web": 0.0, "code": 1.0, "math": 0.0}, SEQ, 10, seed=1)
    windows = (len(data["code"]) - 1) // SEQ  # 100
    firsts = np.concatenate([next(loader)[0][:, 0].numpy() for _ in range(20)])  # 200 samples: two epochs
    starts = {int(data["code"][i * SEQ]) for i in range(windows)}
    assert set(firsts[:windows].tolist()) == starts == set(firsts[windows:].tolist())
    assert not np.array_equal(firsts[:windows], firsts[windows:])


def prepared(root: Path, name: str, words: list[str], docs: int) -> Path:
    rng = np.random.default_rng(len(name))
    raw = root / f"{name}.jsonl"
    raw.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, size=30))}) + "\n" for _ in range(docs)))
    out = root / name
    prepare([str(raw)], PrepareSettings(source="json", text_field="text", tokenizer="builtin", val_every=5,
                                        shard_tokens=4096, out=str(out)))
    return out


MIX = ["data=mixture", "training.seq_len=32", "training.steps=4", "training.val_freq=4", "training.val_steps=1",
       "logger=minimal"]


def test_a_mixture_trains_and_logs_every_sources_validation_loss(tmp_path):
    from titan_hydra.train.pretrain import run

    web = prepared(tmp_path, "web", "the of and to in is for that with as on by this be are".split(), 200)
    code = prepared(tmp_path, "code", "def return class import self value list dict for in if else".split(), 200)
    spec = f"+data.sources={{web: {{path: '{web}', weight: 0.7}}, code: {{path: '{code}', weight: 0.3}}}}"
    cfg = compose_cfg(MODEL + MIX + [spec])
    validate(cfg)
    summary = run(spec_of(cfg), str(tmp_path / "run"))
    assert len(summary["losses"]) == 4 and all(np.isfinite(summary["losses"]))
    (val,) = [r for r in read_metrics(tmp_path / "run") if "val/loss" in r]
    assert {"val/web/loss", "val/code/loss"} <= val.keys()
    assert val["val/web/loss"] != val["val/code/loss"]  # two different held-out sets
    # a sweep over one weight composes (Hydra multirun overrides it per job)
    assert compose_cfg(MODEL + MIX + [spec, "data.sources.code.weight=0.5"]).data.sources.code.weight == 0.5


@pytest.mark.parametrize("sources_spec,match", [
    ("{web: {path: PATH, weight: -1}}", r"data.sources.web.weight=-1 must be a number >= 0"),
    ("{web: {path: PATH, weight: 0}, code: {path: PATH, weight: 0}}", r"weights sum to 0"),
    ("{web: {weight: 1}}", r"data.sources.web needs a path"),
    ("{web: {path: /nowhere/at/all, weight: 1}}", r"data.sources.web.path=/nowhere/at/all does not exist"),
], ids=["negative", "zero_sum", "no_path", "missing_dir"])
def test_bad_mixtures_are_refused_in_one_line(tmp_path, sources_spec, match):
    spec = "+data.sources=" + sources_spec.replace("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match=match) as err:
        validate(compose_cfg(MODEL + MIX + [spec]))
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="data=mixture needs data.sources"):
        validate(compose_cfg(MODEL + MIX))
