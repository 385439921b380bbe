"""The ``data`` suite: corpus preparation and the shard loader against what training consumes.

Preparation throughput of ``recipes/prepare_data.py`` (tokens/s per process and in total, each
process under a heap cap) on a generated JSON-lines corpus, and of datatrove's pipeline on the same
corpus when a venv with it is given; the shuffled loader's tokens/s over the prepared shards; and
the tokens/s and data time of the debug model training on them.
"""

from __future__ import annotations

import json
import os
import random
import resource
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from titan_hydra.bench.common import REPO
from titan_hydra.data.dataset import TokenDataset
from titan_hydra.data.tokenizer import BUILTIN_PATH, Tokenizer


WORDS = ("the of and to in is for that with as on by this be are from it at an or which not have data model token "
         "train shard corpus python import return class def self value list dict").split()


def generate_corpus(root: Path, megabytes: int, files: int = 8) -> Path:
    """A JSON-lines corpus of about ``megabytes`` MB in ``files`` files (200-word documents)."""
    rng = random.Random(0)
    lines = [" ".join(rng.choice(WORDS) for _ in range(200)) for _ in range(512)]
    root.mkdir(parents=True, exist_ok=True)
    per_file = megabytes * (1 << 20) // files
    for f in range(files):
        with open(root / f"part{f:03d}.jsonl", "w") as out:
            size, i = 0, 0
            while size < per_file:
                line = json.dumps({"text": f"{lines[i % len(lines)]} doc {f}-{i}"}) + "\n"
                out.write(line)
                size, i = size + len(line), i + 1
    return root


def _heap_cap(megabytes: int | None):
    """preexec_fn capping each process's heap (RLIMIT_DATA: anonymous memory, not mapped libraries)."""
    if not megabytes:
        return None
    limit = megabytes * (1 << 20)
    return lambda: resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def data_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """Preparation throughput (prepare_data, and datatrove on the same corpus if given), the
    loader's rate over the shards, and what the debug model's training step consumes."""
    corpus = generate_corpus(tmp / "corpus", args.corpus_mb)
    corpus_bytes = sum(f.stat().st_size for f in corpus.iterdir())
    rows = [prepare_row(args, corpus, tmp / f"prepared_{workers}", workers) for workers in sorted({1, args.workers})]
    if args.datatrove_python:  # the same corpus, tokenizer, workers and cap through datatrove's pipeline
        # a pool whose worker died (the heap cap) waits forever: 5x prepare_data's time, then it failed
        limit = 5 * max(r["wall_s"] for r in rows) + 60
        rows += [datatrove_row(args, corpus, tmp, workers, limit) for workers in sorted({1, args.workers})]
    prepared = tmp / f"prepared_{args.workers}"
    loader_tps = loader_tokens_per_s(prepared, args)
    train_tps, data_ms = training_consumption(prepared, args, tmp)
    result = {"suite": "data", "corpus_bytes": corpus_bytes, "heap_cap_mb": args.heap_cap_mb, "prepare": rows,
              "loader_tokens_per_s": loader_tps, "train_tokens_per_s": train_tps, "data_time_ms": data_ms,
              "seq_len": args.seq_len, "batch": args.batch}
    return data_table(args, result), result


def prepare_row(args, corpus: Path, out: Path, workers: int) -> dict:
    """recipes/prepare_data.py over the corpus with ``workers`` processes, timed."""
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(REPO / "recipes" / "prepare_data.py"), "data=json",
                           f"data.path={corpus}", f"out={out}", f"workers={workers}"],
                          capture_output=True, text=True, preexec_fn=_heap_cap(args.heap_cap_mb))
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"prepare_data failed: {proc.stderr.strip().splitlines()[-1:]}")
    manifest = json.loads((out / "manifest.json").read_text())
    tokens = sum(s["tokens"] for s in manifest["splits"].values())
    return {"system": "titan_hydra prepare_data", "workers": workers, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "tokens_per_s_per_process": tokens / wall / workers,
            "shard_bytes": sum(f.stat().st_size for f in out.rglob("*.bin"))}


def datatrove_row(args, corpus: Path, tmp: Path, workers: int, limit: float) -> dict:
    """recipes/datatrove_tokenize.py (in ``--datatrove-python``'s venv) over the same corpus; a
    failure (the heap cap is part of what is measured) is a row, not fatal."""
    out = tmp / f"datatrove_{workers}"
    # its own session and files for output: a worker killed by the heap cap can leave datatrove's
    # multiprocessing manager behind, holding pipes open
    log = tmp / f"datatrove_{workers}.log"
    with log.open("w") as f:
        proc = subprocess.Popen([args.datatrove_python, str(REPO / "recipes" / "datatrove_tokenize.py"),
                                 "--corpus", str(corpus), "--tokenizer", str(BUILTIN_PATH), "--out", str(out),
                                 "--workers", str(workers), "--eos", Tokenizer("builtin").eos_token],
                                stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                                preexec_fn=_heap_cap(args.heap_cap_mb))
        try:
            proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the pool and its manager too
            except ProcessLookupError:
                pass
            proc.wait()
    lines = log.read_text().strip().splitlines()
    if proc.returncode != 0:
        failed = next((l for l in lines if "memory allocation" in l or "Error" in l), lines[-1] if lines else "")
        return {"system": "datatrove 0.10.1", "workers": workers, "failed": failed.strip()[:120]}
    got = json.loads(lines[-1])
    return {"system": "datatrove 0.10.1", "workers": workers, "tokens": got["tokens"],
            "wall_s": got["wall_s"], "tokens_per_s": got["tokens"] / got["wall_s"],
            "tokens_per_s_per_process": got["tokens"] / got["wall_s"] / workers,
            "shard_bytes": sum(f.stat().st_size for f in out.rglob("*.ds"))}


def loader_tokens_per_s(prepared: Path, args) -> float:
    """Tokens the shuffled loader serves per second over the prepared shards (5 s, after one batch)."""
    ds = TokenDataset("prepared", path=str(prepared), seq_len=args.seq_len, seed=0)
    loader = ds.loader("train", args.batch)
    next(loader)
    t0, served = time.perf_counter(), 0
    while time.perf_counter() - t0 < 5.0:
        served += next(loader)[0].numel()
    return served / (time.perf_counter() - t0)


def training_consumption(prepared: Path, args, tmp: Path) -> tuple[float | None, float | None]:
    """(tokens/s, data_time ms per step) of the debug model training on the shards (medians after
    warmup); (None, None) if the run failed."""
    run_dir = tmp / "train"
    train = subprocess.run([sys.executable, str(REPO / "launch.py"), "data=prepared", f"data.path={prepared}",
                            f"training.steps={args.steps}", f"training.seq_len={args.seq_len}",
                            f"training.local_batch_size={args.batch}", "training.mixed_precision=fp32",
                            "logger=minimal", "checkpoint=none", "training.val_freq=0",
                            f"cluster.threads_per_proc={args.threads}", f"hydra.run.dir={run_dir}"],
                           capture_output=True, text=True, cwd=tmp)
    metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()] if train.returncode == 0 else []
    steady = [m for m in metrics if "tps" in m and m["step"] > args.warmup]
    if not steady:
        return None, None
    return statistics.median(m["tps"] for m in steady), statistics.median(1e3 * m["data_time"] for m in steady)


def data_table(args, result: dict) -> list[str]:
    """The data suite's markdown report."""
    loader_tps, train_tps, data_ms = result["loader_tokens_per_s"], result["train_tokens_per_s"], result["data_time_ms"]
    cap = f", each process capped at {args.heap_cap_mb} MiB of heap" if args.heap_cap_mb else ""
    lines = [f"suite `data` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, a generated "
             f"{result['corpus_bytes'] / 1e9:.2f} GB JSON-lines corpus{cap}", "",
             "| what | workers | tokens | wall s | tokens/s total | tokens/s per process | shards MB |",
             "|---|---|---|---|---|---|---|"]
    for r in result["prepare"]:
        if "failed" in r:
            lines.append(f"| {r['system']} | {r['workers']} | failed: {r['failed']} | | | | |")
            continue
        lines.append(f"| {r['system']} | {r['workers']} | {r['tokens']:,} | {r['wall_s']:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s_per_process']:,.0f} | {r['shard_bytes'] / 1e6:,.0f} |")
    return lines + ["", f"loader over the shards (shuffled, {args.batch} x {args.seq_len}): {loader_tps:,.0f} tokens/s; "
                    f"the debug model's training step consumes {train_tps or 0:,.0f} tokens/s "
                    f"(data_time {data_ms or 0:.2f} ms per step; loader/consumption "
                    f"{loader_tps / train_tps if train_tps else float('nan'):,.0f}x)"]
