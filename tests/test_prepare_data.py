"""Corpus preparation (recipes/prepare_data.py, titan_hydra/data/prepare.py) and training from
its shards: the shards hold exactly the documents in file order, whatever the number of
workers; a killed preparation resumes without redoing finished files; a damaged or mismatched
corpus is refused in one line; the loader over the shards serves the batches of the packed path
over the same tokens.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import REPO, TINY, compose_cfg
from titan_hydra.data.dataset import TokenDataset
from titan_hydra.data.documents import hub_shards
from titan_hydra.data.loader import BatchLoader
from titan_hydra.data.prepare import PrepareSettings, prepare
from titan_hydra.data.shards import ShardedTokens
from titan_hydra.data.tokenizer import Tokenizer
from titan_hydra.errors import DataError

WORDS = "the quick brown fox jumps over a lazy dog while data models train on token shards".split()
VAL_EVERY = 5


def make_corpus(root: Path) -> list[Path]:
    """Three jsonl files and a text file; one empty document (skipped), unicode included."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(3):
        path = root / f"part{f}.jsonl"
        with path.open("w") as fh:
            for i in range(40 + 10 * f):
                text = "" if (f, i) == (1, 3) else " ".join(rng.choice(WORDS, size=rng.integers(3, 40))) + " — ü"
                fh.write(json.dumps({"text": text}) + "\n")
        files.append(path)
    return files


def expected_tokens(files: list[Path]) -> dict[str, np.ndarray]:
    """What the shards must hold: [bos] + ids + [eos] per non-empty document, every VAL_EVERY-th
    document of each file in val, files in order."""
    tok = Tokenizer("builtin")
    out: dict[str, list[int]] = {"train": [], "val": []}
    for path in files:
        docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
        docs = [d for d in docs if d.strip()]
        for n, ids in enumerate(tok.encode_batch(docs), 1):
            out["val" if n % VAL_EVERY == 0 else "train"] += [tok.bos_id, *ids, tok.eos_id]
    return {k: np.asarray(v, dtype=np.int32) for k, v in out.items()}


def settings(out: Path, shard_tokens: int = 700) -> PrepareSettings:
    return PrepareSettings(source="json", text_field="text", tokenizer="builtin", val_every=VAL_EVERY,
                           shard_tokens=shard_tokens, out=str(out))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    files = make_corpus(root / "raw")
    out = root / "prepared"
    manifest = prepare([str(f) for f in files], settings(out), workers=1)
    return files, out, manifest


def test_shards_hold_the_documents_in_file_order(corpus):
    files, out, manifest = corpus
    want = expected_tokens(files)
    tok = Tokenizer("builtin")
    assert manifest["dtype"] == "uint16"  # the built-in vocab (2,048) fits
    for split in ("train", "val"):
        tokens = ShardedTokens(out, split)
        assert len(tokens) == len(want[split]) == manifest["splits"][split]["tokens"]
        assert np.array_equal(tokens[:], want[split]), split
        assert tokens.documents == int((want[split] == tok.bos_id).sum())
    shards = manifest["splits"]["train"]["shards"]
    assert len(shards) > len(files)  # 700-token shards: several per file
    # each shard's document offsets point at its documents' first (bos) tokens
    for shard in shards:
        data = np.fromfile(out / shard["file"], dtype=np.uint16)
        starts = np.load(out / shard["file"].replace(".bin", ".docs.npy"))
        assert len(starts) == shard["documents"] and (data[starts] == tok.bos_id).all()
    # random access across shard boundaries: a loader's [B, seq_len + 1] index block
    tokens = ShardedTokens(out, "train")
    idx = np.arange(len(tokens) - 64).reshape(-1, 1)[::97] + np.arange(65)[None, :]
    assert np.array_equal(tokens[idx], want["train"][idx])


def test_a_streamed_hf_dataset_is_prepared_shard_by_shard_like_its_files(corpus, tmp_path):
    """data.source=hf: the dataset's data files are its shards and the units of work; a local dataset
    directory streams through HF datasets as a hub one would, so the shards equal data=json's."""
    files, out, _ = corpus
    shards = hub_shards(str(files[0].parent), None, "train")
    assert [(s.index, s.count) for s in shards] == [(i, 3) for i in range(3)]
    hub = tmp_path / "hub"
    prepare(shards, dataclasses.replace(settings(hub), source="hf"), workers=2)
    for split in ("train", "val"):
        assert np.array_equal(ShardedTokens(hub, split)[:], ShardedTokens(out, split)[:])
    with pytest.raises(DataError, match=r"^could not stream dataset .*no_such_dataset"):
        hub_shards(str(tmp_path / "no_such_dataset"))


def test_workers_do_not_change_the_result(corpus, tmp_path):
    files, out, _ = corpus
    prepare([str(f) for f in files], settings(tmp_path / "two"), workers=2)
    for split in ("train", "val"):
        assert np.array_equal(ShardedTokens(tmp_path / "two", split)[:], ShardedTokens(out, split)[:])


def test_a_killed_preparation_resumes_without_redoing_finished_files(corpus, tmp_path):
    files, _, _ = corpus
    out = tmp_path / "p"
    prepare([str(f) for f in files], settings(out), workers=1)
    first = {p: p.stat().st_mtime_ns for p in (out / "train").glob("000000-*")}
    # as if killed while writing file 1: no manifest, no done record, partial shards on disk
    (out / "manifest.json").unlink()
    (out / "done" / "000001.json").unlink()
    (out / "train" / "000001-0000.bin").write_bytes(b"\x01\x02")
    (out / "train" / "000001-0009.bin.tmp").write_bytes(b"\x03")
    with pytest.raises(DataError, match="unfinished preparation .* run recipes/prepare_data.py again"):
        ShardedTokens(out, "train")
    prepare([str(f) for f in files], settings(out), workers=1)
    assert {p: p.stat().st_mtime_ns for p in (out / "train").glob("000000-*")} == first  # not redone
    assert not list(out.rglob("*.tmp"))
    assert np.array_equal(ShardedTokens(out, "train")[:], expected_tokens(files)["train"])
    with pytest.raises(DataError, match=r"other settings \(settings differ\); choose another out="):
        prepare([str(f) for f in files], settings(out, shard_tokens=900), workers=1)


def test_damaged_or_mismatched_corpora_are_refused_in_one_line(corpus, tmp_path):
    _, out, _ = corpus
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    shard = copy / json.loads((copy / "manifest.json").read_text())["splits"]["train"]["shards"][1]["file"]
    with open(shard, "r+b") as f:
        f.truncate(10)
    with pytest.raises(DataError, match=r"shard .*000000-0001.bin has 10 bytes, its manifest says \d+ uint16 tokens"):
        TokenDataset("prepared", path=str(copy), seq_len=32)
    other = tmp_path / "tok.json"  # the built-in tokenizer's file written out again: other bytes, another hash
    other.write_text(json.dumps(json.loads(Path(Tokenizer("builtin").path).read_text()), indent=3))
    with pytest.raises(DataError, match="was prepared with tokenizer 'builtin', which differs from data.tokenizer"):
        TokenDataset("prepared", path=str(out), seq_len=32, tokenizer=str(other))
    with pytest.raises(DataError, match="is not a prepared corpus .* recipes/prepare_data.py"):
        TokenDataset("prepared", path=str(tmp_path), seq_len=32)


def test_the_loader_serves_the_packed_paths_batches(corpus):
    """Same tokens, same sample order: the shards are a drop-in for the in-memory array (so the
    global order, resume and layout invariance of the packed path carry over)."""
    files, out, _ = corpus
    ds = TokenDataset("prepared", path=str(out), seq_len=32, seed=3)
    flat = expected_tokens(files)["train"]
    for dp_rank in range(2):
        got = ds.loader("train", 4, dp_rank=dp_rank, dp_degree=2)
        ref = BatchLoader(flat, 32, 4, dp_rank=dp_rank, dp_degree=2, shuffle=True, seed=3)
        for _ in range(5):
            (x, y), (rx, ry) = next(got), next(ref)
            assert torch.equal(x, rx) and torch.equal(y, ry)


def test_a_two_rank_position_resumes_in_one_process_at_the_same_global_batch(corpus):
    """The order depends on seed, data and global batch only: what fsdp(2) saved resumes as a single
    process (and the reverse) on exactly the samples an uninterrupted run would take next."""
    _, out, _ = corpus
    ds = TokenDataset("prepared", path=str(out), seq_len=32, seed=3)
    ranks = [ds.loader("train", 4, dp_rank=r, dp_degree=2) for r in range(2)]
    for _ in range(7):
        for r in ranks:
            next(r)
    single = ds.loader("train", 8)
    single.load_state_dict(json.loads(json.dumps(ranks[0].state_dict())))  # as a checkpoint carries it
    for _ in range(3):
        x, y = next(single)
        parts = [next(r) for r in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
    back = [ds.loader("train", 4, dp_rank=r, dp_degree=2) for r in range(2)]
    for r in back:
        r.load_state_dict(single.state_dict())
    x, _ = next(single)
    assert torch.equal(x, torch.cat([next(r)[0] for r in back]))


@pytest.mark.slow
def test_training_and_the_command_line(corpus, tmp_path):
    from titan_hydra.train.pretrain import run

    files, _, _ = corpus
    out = tmp_path / "cli"
    cmd = [sys.executable, str(REPO / "recipes" / "prepare_data.py"), "data=json", f"data.path={files[0].parent}",
           f"out={out}", "workers=1", "data.val_fraction=0.2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "prepared 3 file(s)" in proc.stdout and f"data.path={out}" in proc.stdout
    summary = run(spec_of(compose_cfg(TINY + ["data=prepared", f"data.path={out}", "training.steps=3", "training.seq_len=32",
                                      "training.val_freq=3", "training.val_steps=1", "logger=minimal"])),
                  str(tmp_path / "run"))
    assert len(summary["losses"]) == 3 and all(np.isfinite(summary["losses"])) and summary["final_val_loss"] > 0
    bad = subprocess.run([sys.executable, str(REPO / "recipes" / "prepare_data.py"), "data=builtin", f"out={out}2"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "cannot be prepared" in bad.stderr
