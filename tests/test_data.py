"""Data pipeline: tokenizer, built-in corpus, local sources, packing, loaders, cache."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_hydra.data import corpus
from titan_hydra.data.dataset import TokenDataset
from titan_hydra.data.loader import BatchLoader
from titan_hydra.data.prepare import PrepareSettings, prepare
from titan_hydra.data.tokenizer import Tokenizer

# torchtitan's test tokenizer (tests/assets of pytorch/torchtitan, BSD-3-Clause): a real HF
# tokenizer.json whose special tokens sit at ids 2002/2003, kept with the tests.
THIRD_PARTY_TOKENIZER = Path(__file__).parent / "data" / "torchtitan_test_tokenizer"


# -- helpers -----------------------------------------------------------------------------
def _docs(n: int) -> list[str]:
    return [f"Document {i}: " + " ".join(f"word{(i * 7 + j) % 13}" for j in range(5 + i % 11)) for i in range(n)]


def _write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def builtin_ds(tmp_path_factory) -> TokenDataset:
    return TokenDataset("builtin", seq_len=32, max_documents=40, cache_dir=str(tmp_path_factory.mktemp("cache")))


def _arange_loader(n_samples=50, seq_len=4, **kw) -> BatchLoader:
    # token value = position, so a window's first input identifies its sample index
    return BatchLoader(np.arange(n_samples * seq_len + 1, dtype=np.int32), seq_len, **kw)


def _rows(x: torch.Tensor, seq_len=4) -> list[int]:
    return (x[:, 0] // seq_len).tolist()


# -- tokenizer ---------------------------------------------------------------------------
def test_builtin_tokenizer_round_trip():
    tok = Tokenizer("builtin")
    assert tok.vocab_size == 2048
    assert (tok.bos_id, tok.eos_id) != (None, None) and tok.bos_id != tok.eos_id
    text = "def greet(name):\n    return f'héllo, {name}!'  # ünïcode ✓\n"
    ids = tok.encode(text)
    assert tok.bos_id not in ids and tok.eos_id not in ids
    assert max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "x = 1"]) == [ids, tok.encode("x = 1")]


def test_third_party_tokenizer_special_ids_from_config():
    tok = Tokenizer(str(THIRD_PARTY_TOKENIZER))
    cfg = json.loads((THIRD_PARTY_TOKENIZER / "tokenizer_config.json").read_text())
    by_name = {v["content"]: int(k) for k, v in cfg["added_tokens_decoder"].items()}
    assert tok.bos_id == by_name[cfg["bos_token"]] == 2002
    assert tok.eos_id == by_name[cfg["eos_token"]] == 2003
    assert tok.vocab_size >= 2020
    assert tok.decode(tok.encode("hello")).replace(" ", "") == "hello"
    # the file path form finds the neighbouring config too
    assert Tokenizer(str(THIRD_PARTY_TOKENIZER / "tokenizer.json")).bos_id == 2002


def test_tokenizer_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="tokenizer not found: .*nope"):
        Tokenizer(str(tmp_path / "nope"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="invalid tokenizer file") as e:
        Tokenizer(str(tmp_path))
    assert "\n" not in str(e.value)


# -- built-in corpus ---------------------------------------------------------------------
def test_builtin_corpus_deterministic_and_disjoint():
    train, val = corpus.builtin_files("train"), corpus.builtin_files("val")
    assert len(train) > 100 and len(val) > 5
    assert not set(train) & set(val)
    assert set(train) | set(val) == set(corpus.builtin_files())
    assert list(train) == sorted(train, key=lambda p: p.relative_to(corpus.stdlib_root()).as_posix())
    assert not any(
        part in corpus.EXCLUDED_DIRS for p in corpus.builtin_files() for part in p.relative_to(corpus.stdlib_root()).parts
    )
    docs = corpus.builtin_documents("val", max_documents=3)
    assert docs == corpus.builtin_documents("val", max_documents=3) and all(isinstance(d, str) for d in docs)


# -- packing -----------------------------------------------------------------------------
def test_packing_windows(builtin_ds):
    ds, tok = builtin_ds, builtin_ds.tokenizer
    assert ds.vocab_size == 2048
    for split in ("train", "val"):
        flat = ds.tokens(split)
        assert flat.dtype == np.int32 and len(flat) == ds.stats["tokens"][split]
        assert ds.num_samples(split) == (len(flat) - 1) // ds.seq_len > 0
        assert flat[0] == tok.bos_id and flat[-1] == tok.eos_id
        # documents are framed: every eos (but the last) is followed by a bos
        eos_at = np.flatnonzero(flat == tok.eos_id)
        assert len(eos_at) == ds.stats["documents"][split]
        assert (flat[eos_at[:-1] + 1] == tok.bos_id).all()
    x, y = ds.sample("train", 3)
    assert np.array_equal(x[1:], y[:-1]) and len(x) == ds.seq_len
    assert np.array_equal(x, ds.tokens("train")[3 * ds.seq_len : 4 * ds.seq_len])
    # the first document's text survives packing
    first = corpus.builtin_documents("train", max_documents=3)
    first = next(d for d in first if d.strip())
    flat = ds.tokens("train")
    end = int(np.flatnonzero(flat == tok.eos_id)[0])
    assert tok.decode(flat[1:end]) == first


def test_loader_batches_are_windows(builtin_ds):
    loader = builtin_ds.loader("train", local_batch_size=4)
    x, y = loader.next_batch()
    assert x.shape == y.shape == (4, builtin_ds.seq_len) and x.dtype == y.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    flat = builtin_ds.tokens("train")
    for row, i in enumerate(loader.sample_indices(0, 4)):  # the shuffled sample order
        window = np.concatenate([x[row].numpy(), y[row, -1:].numpy()])
        assert np.array_equal(window, flat[i * 32 : i * 32 + 33])


# -- local sources -----------------------------------------------------------------------
def test_json_source_packs_and_counts_empty(tmp_path):
    docs = _docs(30)
    recs = [{"text": d, "id": i} for i, d in enumerate(docs)] + [{"text": ""}, {"text": "   \n"}, {"text": None}]
    _write_jsonl(tmp_path / "a.jsonl", recs[:20])
    _write_jsonl(tmp_path / "b.jsonl", recs[20:])
    ds = TokenDataset("json", path=str(tmp_path), seq_len=8, val_fraction=0.1, cache_dir=str(tmp_path / "c"))
    assert ds.stats["empty_skipped"] == 3
    # last 10% of the 33 records (3) are val: the three empty ones, so val is empty here
    assert ds.stats["documents"] == {"train": 30, "val": 0}
    tok = ds.tokenizer
    expected = [t for d in docs for t in (tok.bos_id, *tok.encode(d), tok.eos_id)]
    assert ds.tokens("train").tolist() == expected
    # a glob and a separate val file work too
    _write_jsonl(tmp_path / "val.jsonl", [{"body": d} for d in _docs(4)])
    _write_jsonl(tmp_path / "tr.jsonl", [{"body": d} for d in docs])
    ds2 = TokenDataset(
        "json", path=str(tmp_path / "tr*.jsonl"), val_path=str(tmp_path / "val.jsonl"), text_field="body",
        seq_len=8, cache_dir=str(tmp_path / "c"),
    )
    assert ds2.stats["documents"] == {"train": 30, "val": 4}
    assert ds2.tokens("train").tolist() == expected


def test_parquet_and_text_sources(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(20)
    pq.write_table(pa.table({"content": docs + [""]}), tmp_path / "d.parquet")
    ds = TokenDataset(
        "parquet", path=str(tmp_path / "d.parquet"), text_field="content", seq_len=8, val_fraction=0.2,
        cache_dir=str(tmp_path / "c"),
    )
    # 21 rows -> last round(4.2)=4 are val (3 docs + the empty one)
    assert ds.stats["documents"] == {"train": 17, "val": 3} and ds.stats["empty_skipped"] == 1
    with pytest.raises(ValueError, match="missing text field 'text'.*data.text_field"):
        TokenDataset("parquet", path=str(tmp_path / "d.parquet"), cache_dir=str(tmp_path / "c"))

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "a.txt").write_text("first doc line one\nline two\n\nsecond doc\n\n\n\nthird doc\n")
    ds = TokenDataset("text", path=str(tmp_path / "t"), seq_len=4, val_fraction=0.0, cache_dir=str(tmp_path / "c"))
    assert ds.stats["documents"]["train"] == 3
    tok = ds.tokenizer
    flat = ds.tokens("train")
    end = int(np.flatnonzero(flat == tok.eos_id)[0])
    assert tok.decode(flat[1:end]).strip() == "first doc line one\nline two"


def test_every_reader_packs_the_same_documents_to_one_stream(tmp_path):
    """The readers differ only in where documents come from: the same documents as json, parquet,
    text, a dataset directory (hf) or a prepared corpus give one token stream, each document framed
    as bos ... eos in order; the streaming loader serves consecutive windows of that same stream."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(24)
    tok = Tokenizer("builtin")
    expected = [t for d in docs for t in (tok.bos_id, *tok.encode(d), tok.eos_id)]
    _write_jsonl(tmp_path / "d.jsonl", [{"text": d} for d in docs])
    pq.write_table(pa.table({"text": docs}), tmp_path / "d.parquet")
    (tmp_path / "d.txt").write_text("\n\n".join(docs))  # no newline after the last paragraph, which keeps it
    (tmp_path / "hub").mkdir()
    _write_jsonl(tmp_path / "hub" / "train.jsonl", [{"text": d} for d in docs])
    prepare([str(tmp_path / "d.jsonl")], PrepareSettings(source="json", text_field="text", tokenizer="builtin",
                                                         val_every=0, shard_tokens=100, out=str(tmp_path / "p")))
    sources = {"json": {"path": str(tmp_path / "d.jsonl")}, "parquet": {"path": str(tmp_path / "d.parquet")},
               "text": {"path": str(tmp_path / "d.txt")}, "hf": {"hf_name": str(tmp_path / "hub")}}
    common = {"seq_len": 8, "val_fraction": 0.0, "cache_dir": str(tmp_path / "c")}
    for source, where in {**sources, "prepared": {"path": str(tmp_path / "p")}}.items():
        ds = TokenDataset(source, **where, **common)
        assert np.asarray(ds.tokens("train")[:]).tolist() == expected, source
        assert ds.stats["documents"] == {"train": 24, "val": 0}, source
    for source, where in sources.items():
        streamed = TokenDataset(source, **where, **common, streaming=True)
        x, y = streamed.loader("train", 3).next_batch()
        assert x.flatten().tolist() == expected[:24] and y.flatten().tolist() == [
            t for r in range(3) for t in expected[r * 8 + 1: r * 8 + 9]], source


def test_bad_json_records_name_file_and_line(tmp_path):
    f = _write_jsonl(tmp_path / "x.jsonl", [{"text": "a"}, {"text": "b"}, "", '{"text": "c",', {"text": "d"}])
    with pytest.raises(ValueError, match=r"bad record in .*x\.jsonl line 4: invalid JSON"):
        TokenDataset("json", path=str(f), cache_dir=str(tmp_path / "c"))
    f = _write_jsonl(tmp_path / "y.jsonl", [{"text": "a"}] * 6 + [{"txt": "b"}])
    with pytest.raises(ValueError, match=r"bad record in .*y\.jsonl line 7: missing text field 'text' \(set data\.text_field"):
        TokenDataset("json", path=str(f), cache_dir=str(tmp_path / "c"))
    f = _write_jsonl(tmp_path / "z.jsonl", [{"text": 5}])
    with pytest.raises(ValueError, match=r"z\.jsonl line 1: text field 'text' is int"):
        TokenDataset("json", path=str(f), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="no json files found"):
        TokenDataset("json", path=str(tmp_path / "missing*.jsonl"), cache_dir=str(tmp_path / "c"))
    with pytest.raises(ValueError, match="unknown data.source"):
        TokenDataset("csv", path=str(f))


# -- cache -------------------------------------------------------------------------------
def test_cache_hit_and_invalidation(tmp_path):
    f = _write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in _docs(12)])
    kw = dict(path=str(f), seq_len=8, cache_dir=str(tmp_path / "c"))
    first = TokenDataset("json", **kw)
    second = TokenDataset("json", **kw)
    assert not first.cache_hit and second.cache_hit
    assert second.stats == first.stats
    for s in ("train", "val"):
        assert np.array_equal(first.tokens(s), second.tokens(s))
    assert not list((tmp_path / "c").glob("*.tmp"))
    assert TokenDataset("json", **{**kw, "seq_len": 16}).cache_hit  # packing is independent of seq_len
    _write_jsonl(f, [{"text": d} for d in _docs(13)])  # the file changed: rebuild
    assert not TokenDataset("json", **kw).cache_hit
    assert not TokenDataset("json", **{**kw, "max_documents": 5}).cache_hit


# -- loader ------------------------------------------------------------------------------
def test_loader_state_round_trip_across_epochs():
    ref = _arange_loader(n_samples=10, local_batch_size=4, shuffle=True, seed=3)
    for calls in (1, 2, 3, 7):  # 3*4 = 12 > 10 samples: call 3 straddles epochs 0 and 1
        a = _arange_loader(n_samples=10, local_batch_size=4, shuffle=True, seed=3)
        for _ in range(calls):
            a.next_batch()
        sd = json.loads(json.dumps(a.state_dict()))  # plain, serialisable
        expected = [a.next_batch()[0] for _ in range(4)]
        b = _arange_loader(n_samples=10, local_batch_size=4, shuffle=True, seed=3)
        b.load_state_dict(sd)
        assert all(torch.equal(e, b.next_batch()[0]) for e in expected)
    # each epoch is a permutation of all samples
    seen = [r for _ in range(5) for r in _rows(ref.next_batch()[0])]
    assert sorted(seen[:10]) == list(range(10)) and sorted(seen[10:20]) == list(range(10))
    assert seen[:10] != seen[10:20]


def test_dp_sharding_union_equals_single_rank():
    single = _arange_loader(local_batch_size=4, shuffle=True, seed=1)
    ranks = [_arange_loader(local_batch_size=2, dp_rank=r, dp_degree=2, shuffle=True, seed=1) for r in range(2)]
    for _ in range(30):  # 30*4 = 120 > 50: several epochs
        x, y = single.next_batch()
        parts = [rk.next_batch() for rk in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts]))
        assert torch.equal(y, torch.cat([p[1] for p in parts]))


def test_reload_under_other_dp_layout(builtin_ds):
    single = builtin_ds.loader("train", local_batch_size=4)
    for _ in range(5):
        single.next_batch()
    sd = single.state_dict()
    expected = [single.next_batch() for _ in range(3)]
    ranks = [builtin_ds.loader("train", local_batch_size=1, dp_rank=r, dp_degree=4) for r in range(4)]
    for rk in ranks:
        rk.load_state_dict(sd)
    for x, y in expected:
        parts = [rk.next_batch() for rk in ranks]
        assert torch.equal(x, torch.cat([p[0] for p in parts])) and torch.equal(y, torch.cat([p[1] for p in parts]))
    # state is rank-independent, and back to one rank continues at the same global position
    assert ranks[0].state_dict() == ranks[3].state_dict()
    back = builtin_ds.loader("train", local_batch_size=4)
    back.load_state_dict(ranks[1].state_dict())
    assert torch.equal(back.next_batch()[0], single.next_batch()[0])


def test_incompatible_state_rejected():
    a = _arange_loader(local_batch_size=2, shuffle=True, seed=0)
    a.next_batch()
    for other in (
        _arange_loader(local_batch_size=2, shuffle=True, seed=1),
        _arange_loader(n_samples=51, local_batch_size=2, shuffle=True, seed=0),
        _arange_loader(local_batch_size=2, shuffle=False, seed=0),
    ):
        with pytest.raises(ValueError, match="does not match"):
            other.load_state_dict(a.state_dict())
    with pytest.raises(ValueError, match="not a packed loader state"):
        a.load_state_dict({"step": 3})
    with pytest.raises(ValueError, match="dp_rank"):
        _arange_loader(local_batch_size=2, dp_rank=2, dp_degree=2)


def test_shuffle_deterministic_by_seed():
    def order(seed, shuffle=True):
        ld = _arange_loader(local_batch_size=5, shuffle=shuffle, seed=seed)
        return [r for _ in range(10) for r in _rows(ld.next_batch()[0])]

    assert order(0) == order(0)
    assert order(0) != order(1)
    assert order(0, shuffle=False) == list(range(50))
    assert sorted(order(7)) == list(range(50))


def test_validation_loader_finite_unshuffled(builtin_ds):
    n = builtin_ds.num_samples("val")
    val = builtin_ds.loader("val", local_batch_size=2, infinite=False)
    rows = [r for x, _ in val for r in x.tolist()]
    assert len(rows) == (n // 2) * 2 == len(val) * 2
    flat = builtin_ds.tokens("val")
    assert rows == [flat[i * 32 : i * 32 + 32].tolist() for i in range(len(rows))]
    with pytest.raises(StopIteration):
        val.next_batch()
    val.reset()
    assert val.next_batch()[0][0].tolist() == rows[0]
    # two dp ranks make the same number of calls and together cover the same rows
    r0, r1 = (builtin_ds.loader("val", 1, dp_rank=r, dp_degree=2, infinite=False) for r in range(2))
    b0, b1 = list(r0), list(r1)
    assert len(b0) == len(b1) == n // 2
    assert [row for a, b in zip(b0, b1) for row in (a[0][0].tolist(), b[0][0].tolist())] == rows[: 2 * len(b0)]


# -- streaming ---------------------------------------------------------------------------
def test_streaming_local_json_resume(tmp_path):
    f = _write_jsonl(tmp_path / "s.jsonl", [{"text": d} for d in _docs(60)] + [{"text": ""}])
    ds = TokenDataset(
        "json", path=str(f), val_path=str(f), seq_len=8, streaming=True, cache_dir=str(tmp_path / "c")
    )
    assert ds.vocab_size == 2048
    with pytest.raises(ValueError, match="streaming"):
        ds.num_samples("train")
    loaders = [ds.loader("train", 2, dp_rank=r, dp_degree=2) for r in range(2)]
    tok = ds.tokenizer
    for rank, ld in enumerate(loaders):
        for _ in range(3):
            x, y = ld.next_batch()
            assert x.shape == (2, 8) and torch.equal(x[:, 1:], y[:, :-1])
        sd = ld.state_dict()
        expected = [ld.next_batch() for _ in range(120)]  # 120*16 tokens: past the end of this rank's shard
        assert ld.epoch >= 1
        again = ds.loader("train", 2, dp_rank=rank, dp_degree=2)
        again.load_state_dict(sd)
        for x, y in expected:
            x2, y2 = again.next_batch()
            assert torch.equal(x, x2) and torch.equal(y, y2)
        sd = ld.state_dict()  # saved inside a later epoch
        expected = [ld.next_batch()[0] for _ in range(5)]
        again = ds.loader("train", 2, dp_rank=rank, dp_degree=2)
        again.load_state_dict(sd)
        assert all(torch.equal(e, again.next_batch()[0]) for e in expected)
    # each rank sees a different half of the documents (rank 0 starts with document 0)
    first = [ds.loader("train", 1, dp_rank=r, dp_degree=2).next_batch()[0][0] for r in range(2)]
    assert first[0][0] == tok.bos_id and tok.decode(first[0][1:]).startswith("Document 0")
    assert tok.decode(first[1][1:]).startswith("Document 1")
    with pytest.raises(ValueError, match="same data-parallel layout"):
        ds.loader("train", 2, dp_rank=0, dp_degree=1).load_state_dict(sd)
    # validation is finite
    assert sum(1 for _ in ds.loader("val", 4, infinite=False)) > 0
