"""Writes a checkpoint fixture that tests/test_checkpoint_compat.py keeps resuming with later code.

    python tests/compat_fixture.py tests/data/compat/llama3_format1     # once per checkpoint format

A Llama 3 debug model shrunk to ~35k parameters (tied embeddings: the 2048-token vocabulary is most
of it) trains 6 steps in one process with everything a checkpoint holds mid-run: AdamW state, the
data position, an EMA of the weights and a batch schedule that has ramped (2 -> 4 sequences after
128 tokens, so steps 3 on accumulate 2 micro-batches). The step-3 checkpoint is kept with the
losses of steps 4-6 and what they depend on: the overrides (every default that changes the run
is pinned by one), this CPU's model and flags, and the versions that wrote it (``fixture.json``).
"""

from __future__ import annotations

import json
import platform
import shutil
import sys
from pathlib import Path

OVERRIDES = [
    "model.dim=16", "model.n_layers=1", "model.n_heads=2", "model.multiple_of=16", "model.tie_word_embeddings=true",
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


def write(out: Path) -> dict:
    import torch

    from titan_hydra.checkpoint.versions import FORMAT_VERSION, project_version
    from titan_hydra.groups import compose_config
    from titan_hydra.spec import spec_of
    from titan_hydra.train.pretrain import run

    out = Path(out)
    work = out.parent / (out.name + ".work")
    shutil.rmtree(work, ignore_errors=True)
    summary = run(spec_of(compose_config(OVERRIDES)), str(work))
    shutil.rmtree(out, ignore_errors=True)
    (out / "checkpoint").mkdir(parents=True)
    shutil.copytree(work / "checkpoint" / f"step-{STEP}", out / "checkpoint" / f"step-{STEP}")
    shutil.rmtree(work)
    fixture = {"overrides": OVERRIDES, "step": STEP, "losses_after": summary["losses"][STEP:],
               "losses_before": summary["losses"][:STEP], "format": FORMAT_VERSION,
               "titan_hydra": project_version(), "torch": torch.__version__, "cpu": cpu_kind()}
    (out / "fixture.json").write_text(json.dumps(fixture, indent=1) + "\n")
    return fixture


if __name__ == "__main__":
    print(json.dumps({k: v for k, v in write(Path(sys.argv[1])).items() if k != "cpu"}, indent=1))
