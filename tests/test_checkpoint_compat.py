"""Checkpoints that survive upgrades: a checkpoint written by an earlier commit resumes with today's code.

``tests/data/compat/<name>/`` holds a checkpoint written mid-run (AdamW state, data position, an
EMA, a batch schedule that has ramped) and, in ``fixture.json``, the losses of the steps that
followed it, the overrides of that run, the CPU that wrote it and the versions (tests/compat_fixture.py
wrote it). Resumed by today's code, the run must give those losses bit for bit on the CPU kind that
wrote them (same model name and flags, same torch), and elsewhere within this machine's measured fp32
rounding floor (helpers.machine_bound). A checkpoint of a newer format is refused in one line naming
both versions; an older format is migrated, or refused saying what changed (titan_hydra/checkpoint/versions.py).
A prepared corpus (``shards_format<N>``) must read as the same tokens and serve the same batches
everywhere (integers), and one of a newer format is refused in one line naming both versions.

When a change must break the checkpoint format:
1. raise ``FORMAT_VERSION`` in titan_hydra/checkpoint/versions.py by one;
2. add ``MIGRATIONS[<old>] = Migration("<what the new format changed>", marker=<fn>)``: ``fn`` rewrites an
   old marker for the new format when the old checkpoint's meaning carries over (convert entries it
   renamed or re-laid out where ``checkpoint/load.py`` reads them, keyed on the old format); leave
   ``marker`` out when it cannot, and the load is refused in one line saying what changed;
3. keep the old fixture (this test then resumes it through the migration) and write one of the new
   format: ``python tests/compat_fixture.py tests/data/compat/llama3_format<new>``. Every directory
   under tests/data/compat/ is tested.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from compat_fixture import cpu_kind, shard_digest
from helpers import compose_cfg, machine_bound
from titan_hydra.checkpoint import versions
from titan_hydra.checkpoint.storage import CheckpointError
from titan_hydra.data.shards import FORMAT_VERSION as SHARDS_FORMAT
from titan_hydra.data.shards import read_manifest
from titan_hydra.errors import DataError
from titan_hydra.version import project_version
from titan_hydra.spec import spec_of
from titan_hydra.train.pretrain import run

COMPAT = Path(__file__).resolve().parent / "data" / "compat"
FIXTURES = sorted(p.name for p in COMPAT.iterdir() if (p / "checkpoint").is_dir())
SHARD_FIXTURES = sorted(p.name for p in COMPAT.iterdir() if (p / "manifest.json").is_file())


def fixture_of(name: str) -> dict:
    return json.loads((COMPAT / name / "fixture.json").read_text())


def resumed_losses(name: str, run_dir: Path, marker_edit=None) -> list[float]:
    """The losses of the steps after the fixture's checkpoint, resumed by today's code in ``run_dir``."""
    fixture = fixture_of(name)
    shutil.copytree(COMPAT / name / "checkpoint", run_dir / "checkpoint")
    if marker_edit is not None:
        path = run_dir / "checkpoint" / f"step-{fixture['step']}" / "COMPLETE.json"
        path.write_text(json.dumps(marker_edit(json.loads(path.read_text()))))
    summary = run(spec_of(compose_cfg(fixture["overrides"])), str(run_dir))
    return summary["losses"][fixture["step"]:]


def same_kind(fixture: dict) -> bool:
    import torch

    here = cpu_kind()
    return (fixture["cpu"]["model"], fixture["cpu"]["flags"], fixture["torch"]) == (
        here["model"], here["flags"], torch.__version__)


@pytest.mark.parametrize("name", FIXTURES)
def test_committed_checkpoint_resumes_bit_for_bit(name, tmp_path, run_cache):
    fixture = fixture_of(name)
    losses = resumed_losses(name, tmp_path / "run")
    assert len(losses) == len(fixture["losses_after"])
    if same_kind(fixture):
        assert losses == fixture["losses_after"], "bit for bit on the CPU kind that wrote the fixture"
    else:  # another CPU's kernels round differently: within this machine's fp32 floor
        bound = machine_bound(run_cache, fixture["losses_after"])
        assert max(abs(a - b) for a, b in zip(losses, fixture["losses_after"])) <= bound


@pytest.mark.parametrize("name", FIXTURES[-1:])
def test_a_marker_from_before_versions_is_migrated_and_resumes_alike(name, tmp_path):
    def unversioned(marker):
        return {k: v for k, v in marker.items() if k not in ("format", "titan_hydra")}

    fixture = fixture_of(name)
    losses = resumed_losses(name, tmp_path / "run", unversioned)
    if same_kind(fixture):
        assert losses == fixture["losses_after"]
    assert losses == resumed_losses(name, tmp_path / "again")  # the migration changes nothing it loads


@pytest.mark.parametrize("name", FIXTURES[-1:])
def test_a_newer_format_is_refused_in_one_line_naming_both_versions(name, tmp_path):
    def newer(marker):
        return {**marker, "format": versions.FORMAT_VERSION + 1, "titan_hydra": "9.0.0"}

    with pytest.raises(CheckpointError) as e:
        resumed_losses(name, tmp_path / "run", newer)
    line = str(e.value)
    assert "\n" not in line
    assert f"has format {versions.FORMAT_VERSION + 1} (written by titan_hydra 9.0.0)" in line
    assert f"this titan_hydra {project_version()} reads formats up to {versions.FORMAT_VERSION}" in line


def test_an_older_format_whose_meaning_changed_is_refused_saying_what_changed(monkeypatch):
    """How a breaking change reads to a user: format 2 here stores something format 1 meant otherwise."""
    monkeypatch.setattr(versions, "FORMAT_VERSION", 2)
    monkeypatch.setitem(versions.MIGRATIONS, 1, versions.Migration("format 2 keeps the EMA in bf16"))
    with pytest.raises(CheckpointError, match=r"^checkpoint ck has format 1 \(written by titan_hydra 0\.1\.0\) and this "
                                              r"titan_hydra .* reads format 2: format 2 keeps the EMA in bf16; it "
                                              r"cannot be converted, load it with titan_hydra 0\.1\.0$"):
        versions.upgraded({"format": 1, "titan_hydra": "0.1.0"}, "ck")
    # a migration that keeps the meaning converts the marker, one format at a time
    monkeypatch.setitem(versions.MIGRATIONS, 1, versions.Migration("format 2 renames nothing", lambda m: {**m, "format": 2}))
    assert versions.upgraded({"step": 3}, "ck") == {"step": 3, "format": 2}


@pytest.mark.parametrize("name", SHARD_FIXTURES)
def test_committed_prepared_corpus_reads_the_same_tokens_and_batches(name):
    fixture = json.loads((COMPAT / name / "fixture.json").read_text())
    assert shard_digest(COMPAT / name) == fixture["reads"]


@pytest.mark.parametrize("name", SHARD_FIXTURES[-1:])
def test_a_prepared_corpus_of_a_newer_format_is_refused_in_one_line_naming_both_versions(name, tmp_path):
    copy = tmp_path / name
    shutil.copytree(COMPAT / name, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "version": SHARDS_FORMAT + 1, "titan_hydra": "9.0.0"}))
    with pytest.raises(DataError) as e:
        read_manifest(copy)
    line = str(e.value)
    assert "\n" not in line and f"has format version {SHARDS_FORMAT + 1} (written by titan_hydra 9.0.0)" in line
    assert f"this titan_hydra {project_version()} reads format {SHARDS_FORMAT}: read it with titan_hydra 9.0.0" in line
