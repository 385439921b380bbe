"""Writes the fixtures that tests/test_checkpoint_compat.py keeps reading with later code.

    python tests/compat_fixture.py tests/data/compat/llama3_format1           # once per checkpoint format
    python tests/compat_fixture.py --model hf_llama tests/data/compat/hf_llama_format1   # a model=hf one
    python tests/compat_fixture.py --shards tests/data/compat/shards_format1  # once per prepared-corpus format

A Llama 3 debug model shrunk to ~35k parameters (tied embeddings: the 2048-token vocabulary is most
of it) trains 6 steps in one process with everything a checkpoint holds mid-run: AdamW state, the
data position, an EMA of the weights and a batch schedule that has ramped (2 -> 4 sequences after
128 tokens, so steps 3 on accumulate 2 micro-batches). The step-3 checkpoint is kept with the
losses of steps 4-6 and what they depend on: the overrides (every default that changes the run
is pinned by one), this CPU's model and flags, and the versions that wrote it (``fixture.json``).

The shard fixture is a prepared corpus (``recipes/prepare_data.py``'s format: manifest, token
shards, document offsets) of a small generated text, with the first batches its loader serves and
a digest of every split's tokens: integers, so equal on every machine.
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

import numpy as np

# the model of each checkpoint fixture: a tiny one, most of it the 2048-token (tied) embedding
MODELS = {
    "llama3": ["model.dim=16", "model.n_layers=1", "model.n_heads=2", "model.multiple_of=16",
               "model.tie_word_embeddings=true"],
    "hf_llama": ["model=hf_llama_debug", "model.fields.hidden_size=16", "model.fields.intermediate_size=32",
                 "model.fields.num_hidden_layers=1", "model.fields.num_attention_heads=2",
                 "model.fields.num_key_value_heads=2", "+model.fields.tie_word_embeddings=true"],
}
RUN = [
    "training.seq_len=32", "training.local_batch_size=2", "training.global_batch_size=2",
    "training.batch_schedule=[[0,2],[128,4]]", "training.ema_decay=0.9", "training.steps=6",
    "training.val_freq=0", "training.mixed_precision=fp32", "training.init_mode=full", "training.seed=0",
    "optimizer=adamw", "optimizer.lr=0.003", "lr_scheduler=warmup_cosine", "lr_scheduler.warmup_steps=2",
    "data=builtin", "data.max_documents=60", "parallelism=single", "cluster.nproc_per_node=1",
    "cluster.threads_per_proc=1", "checkpoint=default", "checkpoint.interval=3", "checkpoint.keep_latest_k=0",
    "logger=minimal", "health=off",
]
STEP = 3  # the checkpoint kept; the losses of the steps after it are the test's reference


def cpu_kind() -> dict:
    """The CPU's model and flags: bit-equal losses are expected only on the same kind."""
    info = {"machine": platform.machine(), "model": "", "flags": []}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not info["model"]:
                info["model"] = value.strip()
            if key.strip() == "flags" and not info["flags"]:
                info["flags"] = sorted(value.split())
    except OSError:
        pass
    return info


def write(out: Path, model: str = "llama3") -> dict:
    import torch

    from titan_hydra.checkpoint.versions import FORMAT_VERSION, project_version
    from titan_hydra.groups import compose_config
    from titan_hydra.spec import spec_of
    from titan_hydra.train.pretrain import run

    out = Path(out)
    work = out.parent / (out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    overrides = MODELS[model] + RUN
    summary = run(spec_of(compose_config(overrides)), str(work))
    shutil.rmtree(out, ignore_errors=True)
    (out / "checkpoint").mkdir(parents=True)
    shutil.copytree(work / "checkpoint" / f"step-{STEP}", out / "checkpoint" / f"step-{STEP}")
    shutil.rmtree(work)
    fixture = {"overrides": overrides, "step": STEP, "losses_after": summary["losses"][STEP:],
               "losses_before": summary["losses"][:STEP], "format": FORMAT_VERSION,
               "titan_hydra": project_version(), "torch": torch.__version__, "cpu": cpu_kind()}
    (out / "fixture.json").write_text(json.dumps(fixture, indent=1) + "\n")
    return fixture


WORDS = "the quick brown fox jumps over a lazy dog while data models train on token shards".split()
SHARD_LOADER = {"seq_len": 16, "seed": 3, "batch": 4, "batches": 3}


def shard_digest(root: Path) -> dict:
    """What today's code reads from a prepared corpus: per split its tokens' count and SHA-256, and
    the first training batches of its loader."""
    import hashlib

    from titan_hydra.data.dataset import TokenDataset
    from titan_hydra.data.shards import ShardedTokens

    out = {}
    for split in ("train", "val"):
        tokens = ShardedTokens(root, split)
        flat = np.concatenate([np.asarray(m, dtype=np.int64) for m in tokens.maps])
        out[split] = {"tokens": int(len(flat)), "documents": tokens.documents,
                      "sha256": hashlib.sha256(flat.tobytes()).hexdigest()}
    ds = TokenDataset("prepared", path=str(root), seq_len=SHARD_LOADER["seq_len"], seed=SHARD_LOADER["seed"])
    loader = ds.loader("train", SHARD_LOADER["batch"])
    out["batches"] = [next(loader)[0].tolist() for _ in range(SHARD_LOADER["batches"])]
    return out


def write_shards(out: Path) -> dict:
    """A prepared corpus of 60 generated documents in two files, and what it reads as."""
    from titan_hydra.data.prepare import PrepareSettings, prepare
    from titan_hydra.data.shards import FORMAT_VERSION
    from titan_hydra.version import project_version

    out = Path(out)
    work = out.parent / (out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    work.mkdir(parents=True)
    rng = np.random.default_rng(0)
    files = []
    for f in range(2):
        path = work / f"part{f}.jsonl"
        path.write_text("".join(json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(3, 30))))}) + "\n"
                                for _ in range(30)))
        files.append(str(path))
    prepare(files, PrepareSettings(source="json", text_field="text", tokenizer="builtin", val_every=5,
                                   shard_tokens=256, out=str(out)))
    shutil.rmtree(out / "done")  # the preparation's resume records and settings (this machine's
    (out / "settings.json").unlink()  # paths): not what a reader of the corpus reads
    shutil.rmtree(work)
    fixture = {"format": FORMAT_VERSION, "titan_hydra": project_version(), "loader": SHARD_LOADER,
               "reads": shard_digest(out)}
    (out / "fixture.json").write_text(json.dumps(fixture) + "\n")
    return fixture


if __name__ == "__main__":
    if sys.argv[1] == "--shards":
        print(json.dumps({k: v for k, v in write_shards(Path(sys.argv[2])).items() if k != "reads"}, indent=1))
    elif sys.argv[1] == "--model":
        print(json.dumps({k: v for k, v in write(Path(sys.argv[3]), sys.argv[2]).items() if k != "cpu"}, indent=1))
    else:
        print(json.dumps({k: v for k, v in write(Path(sys.argv[1])).items() if k != "cpu"}, indent=1))
