"""Throughput benchmark: runs variants of a training config side by side, prints a markdown
table and writes JSON.

Every variant is a real `launch.py` run in its own process (same data, same steps), or, as the
yardstick, `recipes/plain_loop.py` (a plain fp32 eager loop of the same model), measured from
its metrics.jsonl after warm-up steps: tokens/s per rank and in total, achieved TFLOP/s,
MFU against this machine's measured bf16 matmul peak (one yardstick for every variant), and
peak memory per rank. Variants run one after another in the same invocation so their ratios
are comparable; absolute numbers on shared 2-core machines are noisy.

    python recipes/benchmark.py                         # default suite: fp32 vs bf16, debug model
    python recipes/benchmark.py --suite layouts         # 2-rank layouts
    python recipes/benchmark.py --suite targets --threads 2 --steps 10 --warmup 3
                                                        # debug and ~100M models vs a plain fp32 loop
    python recipes/benchmark.py --suite perf --threads 2  # compile, float8, AC modes
    python recipes/benchmark.py --suite families --threads 2  # each model family's debug model
    python recipes/benchmark.py --suite moe --threads 2       # MoE: grouped mm vs loop, fp32/bf16, ep
    python recipes/benchmark.py --suite hf --threads 2        # model=hf vs the native Llama, same shape
    python recipes/benchmark.py --suite flux --threads 2      # FLUX.1 debug: images/s, eager/compiled, fsdp
    python recipes/benchmark.py --steps 30 --threads 2 --out bench_out/foundation.json
    python recipes/benchmark.py --suite data --corpus-mb 1024 --heap-cap-mb 400
        # corpus preparation (tokens/s per process and in total, under a per-process heap cap) and
        # the shard loader's tokens/s against what a training step consumes
    python recipes/benchmark.py --suite ft --steps 120 --sync-every 20
        # torchft: DDP vs synchronous replica groups vs LocalSGD / DiLoCo (2 groups x 1 rank):
        # validation loss at the same steps, MB each rank sends per step, tokens/s
    python recipes/benchmark.py --suite moe_memory --steps 300 --threads 2
        # resident memory of a long qwen3_moe_debug run: at step 30 and at the end, bf16 with and
        # without bucketed expert rows, fp32, and expert parallel on 2 ranks
    python recipes/benchmark.py --suite mtp --steps 200 --threads 2 training.seq_len=128
        # DeepSeek-V3 debug with and without multi-token prediction: validation loss at equal tokens
    python recipes/benchmark.py --suite hybrid --steps 200 --batch 4 --seq-len 512 training.seq_len=128
        # Qwen3.5 debug against transformers' implementation, tokens/s against the sequence length
        # and loss at equal tokens for full attention / hybrid 3:1 / all Gated DeltaNet
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

@dataclass(frozen=True)
class Variant:
    overrides: tuple[str, ...] = ()
    nproc: int = 1
    plain: bool = False  # the plain fp32 eager loop (recipes/plain_loop.py), not launch.py
    group: str = ""  # "vs baseline" compares with the first variant of the same group
    threads: int | None = None  # torch threads per process; None = --threads


DEBUG_FP32 = ("training.mixed_precision=fp32",)
M100 = ("experiment=llama_100m",)
FLUX = ("experiment=flux_debug", "checkpoint.enable=false", "eval.sample_every=0")  # 64 px: 16 image + 64 text tokens, batch 16

HF_LLAMA = ("model=hf_llama_debug", "model.fields.hidden_size=256", "model.fields.num_hidden_layers=6",
            "model.fields.num_attention_heads=16", "model.fields.num_key_value_heads=16",
            "model.fields.intermediate_size=768")
SUITES: dict[str, dict[str, Variant]] = {
    "precision": {
        "fp32 eager": Variant(("training.mixed_precision=fp32",)),
        "bf16 autocast": Variant(("training.mixed_precision=bf16",)),
    },
    "layouts": {
        "single (1 rank)": Variant(("parallelism=single",)),
        "fsdp (2 ranks)": Variant(("parallelism=fsdp",), 2),
        "ddp (2 ranks)": Variant(("parallelism=ddp",), 2),
        "hsdp (2x1 ranks)": Variant(("parallelism=hsdp", "parallelism.dp_replicate=2"), 2),
        "tp (2 ranks)": Variant(("parallelism=tp",), 2),
        "pp 1F1B (2 ranks)": Variant(("parallelism=pp", "parallelism.pp_schedule=1F1B"), 2),
        "cp (2 ranks)": Variant(("parallelism=cp",), 2),
    },
    # The issue-5 targets: each model against a plain fp32 eager loop of itself, same run.
    "targets": {
        "debug: plain fp32 eager loop": Variant(DEBUG_FP32, plain=True, group="debug"),
        "debug: fp32 eager": Variant(DEBUG_FP32, group="debug"),
        "debug: bf16": Variant(("training.mixed_precision=bf16",), group="debug"),
        "debug: compile + bf16": Variant(("training.mixed_precision=bf16", "compile=model_loss"), group="debug"),
        # The same 2 cores as 2 data-parallel ranks of 1 thread, same global batch (2 x 4).
        "debug: ddp 2x1 thread, compile + bf16": Variant(
            ("training.mixed_precision=bf16", "compile=model_loss", "parallelism=ddp",
             "training.local_batch_size=4"), nproc=2, group="debug", threads=1),
        "100M: plain fp32 eager loop": Variant(M100 + ("training.mixed_precision=fp32",), plain=True, group="100M"),
        "100M: auto precision": Variant(M100, group="100M"),
        "100M: compile, auto precision": Variant(M100 + ("compile=model_loss",), group="100M"),
    },
    # Performance features on the debug model, one process. float8 turns off torchao's H100 size
    # filter (it would skip every layer this small) and emulates the float8 matmul (real
    # _scaled_mm is a slow reference kernel on CPU), so the float8 path runs at a measurable speed.
    "perf": {
        "fp32 eager": Variant(DEBUG_FP32),
        "bf16": Variant(("training.mixed_precision=bf16",)),
        "bf16, bf16 attention": Variant(("training.mixed_precision=bf16", "training.attention_precision=compute")),
        "compile": Variant(DEBUG_FP32 + ("compile=model_loss",)),
        "compile + bf16": Variant(("training.mixed_precision=bf16", "compile=model_loss")),
        "float8 tensorwise": Variant(("float8=tensorwise", "float8.auto_filter_small_kn=false", "float8.emulate=true")),
        "float8 rowwise": Variant(("float8=rowwise", "float8.auto_filter_small_kn=false", "float8.emulate=true")),
        "ac full": Variant(("training.mixed_precision=bf16", "activation_checkpoint=full")),
        "ac selective_op": Variant(("training.mixed_precision=bf16", "activation_checkpoint=selective_op")),
        "ac selective_layer": Variant(("training.mixed_precision=bf16", "activation_checkpoint=selective_layer")),
    },
    # Variants that name no precision run training.mixed_precision=auto (bf16 where this CPU
    # multiplies bf16 natively, fp32 elsewhere); the table's precision column says which it was.
    # Each model family at its debug shape (same data, batch and sequence): eager, compiled,
    # and tp on 2 ranks (where tied embeddings and QK-norm change the plan). "vs baseline"
    # compares within a family.
    "families": {
        "llama3_debug: eager": Variant(("model=llama3_debug",), group="llama3"),
        "llama3_debug: compile": Variant(("model=llama3_debug", "compile=model_loss"), group="llama3"),
        "llama3_debug: tp 2 ranks": Variant(("model=llama3_debug", "parallelism=tp"), 2, group="llama3", threads=1),
        "qwen3_debug: eager": Variant(("model=qwen3_debug",), group="qwen3"),
        "qwen3_debug: compile": Variant(("model=qwen3_debug", "compile=model_loss"), group="qwen3"),
        "qwen3_debug: tp 2 ranks": Variant(("model=qwen3_debug", "parallelism=tp"), 2, group="qwen3", threads=1),
    },
    # model=hf against the native port of the same architecture: transformers' LlamaForCausalLM at
    # llama3_debug's exact shape (6,163,712 parameters, same FLOPs per token), eager, compiled, tp 2.
    "hf": {
        f"{name}: {label}": Variant((*model, *ov), nproc, group=label, threads=th)
        for label, ov, nproc, th in (("eager", (), 1, None), ("compile", ("compile=model_loss",), 1, None),
                                     ("tp 2 ranks", ("parallelism=tp",), 2, 1))
        for name, model in (("native llama3_debug", ("model=llama3_debug",)), ("hf llama (same shape)", HF_LLAMA))
    },
    # Mixture-of-Experts debug models: grouped GEMM vs the per-expert loop, auto vs bf16, one
    # process vs expert parallel on 2 ranks of 1 thread (same global batch). MFU counts active
    # parameters; "load max/mean" is the worst layer's busiest expert over the mean.
    "moe": {
        **{f"{m}: {label}": Variant((f"model={m}", *ov), nproc, group=m, threads=th)
           for m in ("qwen3_moe_debug", "deepseek_v3_debug", "gpt_oss_debug", "llama4_debug")
           for label, ov, nproc, th in (
               ("grouped mm", (), 1, None),
               ("per-expert loop", ("model.moe.use_grouped_mm=false",), 1, None),
               ("bf16, grouped mm", ("training.mixed_precision=bf16",), 1, None),
               ("ep 2 ranks", ("parallelism=ep", "training.local_batch_size=4"), 2, 1),
           )},
    },
    # FLUX.1 debug (images/s; MFU from FLOPs per image): fp32 and auto precision, regional
    # compile, and fsdp / tp / cp on 2 ranks of 1 thread with the same global batch.
    "flux": {
        "flux_debug: fp32 eager": Variant(FLUX + DEBUG_FP32, group="flux"),
        "flux_debug: auto precision": Variant(FLUX, group="flux"),
        "flux_debug: compile, fp32": Variant(FLUX + DEBUG_FP32 + ("compile=model",), group="flux"),
        "flux_debug: fsdp 2 ranks, fp32": Variant(FLUX + DEBUG_FP32 + ("parallelism=fsdp", "training.local_batch_size=8"),
                                                  2, group="flux", threads=1),
        "flux_debug: tp 2 ranks, fp32": Variant(FLUX + DEBUG_FP32 + ("parallelism=tp", "parallelism.tp_sequence_parallel=false"),
                                                2, group="flux", threads=1),
        "flux_debug: cp 2 ranks, fp32": Variant(FLUX + DEBUG_FP32 + ("parallelism=cp",), 2, group="flux", threads=1),
    },
}


def run_variant(name: str, v: Variant, args, workdir: Path) -> dict:
    run_dir = workdir / "".join(c if c.isalnum() else "_" for c in name)
    threads = v.threads or args.threads
    overrides = [*args.extra, *v.overrides]
    if v.plain:
        cmd = [sys.executable, str(REPO / "recipes" / "plain_loop.py"), f"--steps={args.steps}",
               f"--threads={threads}", f"--run-dir={run_dir}", *overrides]
    else:
        cmd = [
            sys.executable, str(REPO / "launch.py"),
            f"training.steps={args.steps}", "training.val_freq=0", "logger=minimal",
            f"cluster.nproc_per_node={v.nproc}", f"cluster.threads_per_proc={threads}",
            f"hydra.run.dir={run_dir}", *overrides,
        ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"variant": name, "nproc": v.nproc, "group": v.group, "status": f"failed: {tail}", "wall_s": wall}
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next((r for r in rows if "memory_params_gib" in r), {})
    state_gib = first.get("memory_params_gib", 0.0) + first.get("memory_optimizer_gib", 0.0)
    rate_key = "ips" if any("ips" in r for r in rows) else "tps"  # images/s (Flux) or tokens/s
    rows = [r for r in rows if rate_key in r and r["step"] > args.warmup]
    tps = statistics.median(r[rate_key] for r in rows)
    tflops = statistics.median(r["tflops"] for r in rows)
    return {
        "variant": name,
        "group": v.group,
        "nproc": v.nproc,
        "threads_per_proc": threads,
        "status": "ok",
        "unit": "img" if rate_key == "ips" else "tok",
        "tps_per_rank": tps,
        "tps_total": tps * v.nproc,
        "tflops_per_rank": tflops,
        "peak_memory_gib": max(r.get("memory", 0.0) for r in rows),
        "params_optimizer_gib": state_gib,
        "final_loss": rows[-1]["loss"],
        "moe_max_over_mean": (statistics.median(r["moe/max_over_mean"] for r in rows)
                              if "moe/max_over_mean" in rows[-1] else None),
        "precision": "fp32" if v.plain else header_value(proc.stdout, "precision").split(" ")[0],
        "attention": "sdpa" if v.plain else header_value(proc.stdout, "attention").split(" ")[0],
        "wall_s": wall,
        "overrides": overrides,
    }


def header_value(stdout: str, row: str) -> str:
    """A row of the run header (``  precision  fp32 (auto: ...)``) from rank 0's output ('?' if absent)."""
    for line in stdout.splitlines():
        if line.startswith(f"  {row} "):
            return line[len(row) + 2:].strip()
    return "?"


# --------------------------------------------------------------------------- the data suite

WORDS = ("the of and to in is for that with as on by this be are from it at an or which not have data model token "
         "train shard corpus python import return class def self value list dict").split()


def generate_corpus(root: Path, megabytes: int, files: int = 8) -> Path:
    """A JSON-lines corpus of about ``megabytes`` MB in ``files`` files (200-word documents)."""
    import random

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
    import resource

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
    from titan_hydra.data.tokenizer import BUILTIN_PATH, Tokenizer

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
    from titan_hydra.data.dataset import TokenDataset

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


def variant_table(title: str, columns: list[str], rows: list[dict], cells) -> list[str]:
    """A suite's markdown table: one row per variant, ``cells(row)`` for the columns, or the
    variant's failure line."""
    lines = [title, "", "| variant | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for r in rows:
        lines.append(f"| {r['variant']} | failed: {r['failed']} |" if "failed" in r
                     else f"| {r['variant']} | {cells(r)} |")
    return lines


# --------------------------------------------------------------------------- the ft suite
def ft_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """2 data-parallel replicas of 1 thread each on the debug model, fp32, the same global batch and
    data: DDP, torchft synchronous groups, LocalSGD and DiLoCo meeting every ``sync_every`` steps.
    Validation runs at meetings, where the semi-synchronous groups hold the same weights."""
    h = args.sync_every
    ft = ("fault_tolerance=torchft", "fault_tolerance.replica_groups=2", "fault_tolerance.min_replicas=2")
    variants = {
        "DDP (2 ranks, no torchft)": ("parallelism=ddp", "cluster.nproc_per_node=2"),
        "torchft synchronous (2 groups)": ft,
        f"torchft LocalSGD every {h}": (*ft, "fault_tolerance.semi_sync=local_sgd", f"fault_tolerance.sync_every={h}"),
        f"torchft DiLoCo every {h} (outer Nesterov 0.7, 0.9)": (
            *ft, "fault_tolerance.semi_sync=diloco", f"fault_tolerance.sync_every={h}"),
    }
    val_freq = 2 * h
    rows = []
    for name, overrides in variants.items():
        run_dir = tmp / "".join(c if c.isalnum() else "_" for c in name)
        cmd = [sys.executable, str(REPO / "launch.py"), *overrides, f"training.steps={args.steps}",
               "training.mixed_precision=fp32", f"training.val_freq={val_freq}", "training.log_freq=1",
               "logger=minimal", "checkpoint=none", "cluster.threads_per_proc=1", f"hydra.run.dir={run_dir}",
               *args.extra]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, env=dict(os.environ, OMP_NUM_THREADS="1"))
        wall = time.time() - t0
        if proc.returncode != 0:
            rows.append({"variant": name, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        metrics = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
        train = [m for m in metrics if "tps" in m]
        params = int(header_value(proc.stdout, "model").split(": ")[1].split(" ")[0].replace(",", ""))
        sent = train[-1].get("ft/sent_mb")
        rows.append({
            "variant": name, "wall_s": wall, "overrides": list(overrides),
            "val_loss": {m["step"]: m["val/loss"] for m in metrics if "val/loss" in m},
            # DDP's gradient allreduce is not counted by torchft: one fp32 gradient per step
            "mb_per_step": (sent / args.steps) if sent is not None else params * 4 / 2**20,
            "mb_measured": sent is not None,
            "tokens_per_s_total": 2 * statistics.median(m["tps"] for m in train if m["step"] > args.warmup),
        })
    steps = sorted({s for r in rows if "val_loss" in r for s in r["val_loss"]})
    def cells(r: dict) -> str:
        vals = " | ".join(f"{r['val_loss'].get(s, float('nan')):.4f}" for s in steps)
        mb = f"{r['mb_per_step']:.3f}" + ("" if r["mb_measured"] else " (computed)")
        return f"{vals} | {mb} | {r['tokens_per_s_total']:,.0f}"

    lines = variant_table(f"suite `ft` — {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, debug model fp32, "
                          f"2 replicas x 1 thread, {args.steps} steps, validation loss at meetings",
                          [*(f"val loss @{s}" for s in steps), "MB sent/step/rank", "tok/s total"], rows, cells)
    return lines, {"suite": "ft", "steps": args.steps, "sync_every": h, "rows": rows}


# --------------------------------------------------------------------- the moe_memory suite
def moe_memory_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """Resident memory (rank 0's RSS after each step) of a long qwen3_moe_debug run, the issue's
    criterion: the last step within 10% of step 30. bf16 with the experts' rows bucketed (the CPU
    default) against the same run unpadded, fp32, and 2 expert-parallel ranks of 1 thread."""
    bf16 = ("model=qwen3_moe_debug", "training.mixed_precision=bf16")
    variants = {
        "bf16, bucketed expert rows (default)": (bf16, 1, args.threads),
        "bf16, unpadded expert rows": ((*bf16, "model.moe.bucket_rows=false"), 1, args.threads),
        "fp32": (("model=qwen3_moe_debug", "training.mixed_precision=fp32"), 1, args.threads),
        "bf16, ep 2 ranks x 1 thread": ((*bf16, "parallelism=ep", "training.local_batch_size=4"), 2, 1),
    }
    if args.variant:
        variants = {k: v for k, v in variants.items() if args.variant in k}
    marks = sorted({1, 30, 100, args.steps} & set(range(1, args.steps + 1)))
    rows = []
    for name, (overrides, nproc, threads) in variants.items():
        run_dir = tmp / "".join(c if c.isalnum() else "_" for c in name)
        cmd = [sys.executable, str(REPO / "launch.py"), *overrides, f"training.steps={args.steps}",
               "training.val_freq=0", "logger=minimal", "checkpoint=none", f"cluster.nproc_per_node={nproc}",
               f"cluster.threads_per_proc={threads}", f"hydra.run.dir={run_dir}", *args.extra]
        t0 = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,
                              env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
        wall = time.time() - t0
        if proc.returncode != 0:
            rows.append({"variant": name, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]})
            continue
        steps = {m["step"]: m for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
                 if "memory_current_gib" in m and "step" in m}
        rss = {s: steps[s]["memory_current_gib"] for s in marks if s in steps}
        rows.append({
            "variant": name, "overrides": list(overrides), "ranks": nproc, "threads": threads, "wall_s": wall,
            "rss_gib": rss, "growth_after_30_pct": 100 * (rss[marks[-1]] / rss[30] - 1) if 30 in rss else None,
            "tokens_per_s_total": nproc * statistics.median(
                m["tps"] for s, m in steps.items() if s > args.warmup and "tps" in m),
            "precision": header_value(proc.stdout, "precision").split(" ")[0],
        })
    from titan_hydra.hardware import cpu_isa, cpu_model

    def cells(r: dict) -> str:
        rss = " | ".join(f"{r['rss_gib'].get(s, float('nan')):.3f}" for s in marks)
        growth = "-" if r["growth_after_30_pct"] is None else f"{r['growth_after_30_pct']:+.1f}%"
        return f"{rss} | {growth} | {r['tokens_per_s_total']:,.0f}"

    lines = variant_table(f"suite `moe_memory` — {time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_isa()}), "
                          f"{os.cpu_count()} cores, qwen3_moe_debug, {args.steps} steps, rank 0's resident memory "
                          "(GiB) after the step",
                          [*(f"RSS @{s}" for s in marks), "growth after step 30", "tok/s total"], rows, cells)
    return lines, {"suite": "moe_memory", "steps": args.steps, "rows": rows}


# ------------------------------------------------------------------------------ the mtp suite
def mtp_run(args, tmp: Path, name: str, overrides: tuple[str, ...], model: str = "deepseek_v3_debug") -> dict:
    """One run of the mtp (or hybrid) suite: validation every steps/4, the next-token CE of the
    training batches (an MTP run's loss minus its weighted MTP term) and tokens/s."""
    run_dir = tmp / "".join(c if c.isalnum() else "_" for c in name)
    cmd = [sys.executable, str(REPO / "launch.py"), f"model={model}", *overrides,
           f"training.steps={args.steps}", f"training.val_freq={max(1, args.steps // 4)}", "training.val_steps=8",
           "logger=minimal", "checkpoint=none", "cluster.nproc_per_node=1",
           f"cluster.threads_per_proc={args.threads}", f"hydra.run.dir={run_dir}", *args.extra]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,
                          env=dict(os.environ, OMP_NUM_THREADS=str(args.threads)))
    if proc.returncode != 0:
        return {"variant": name, "failed": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss" in r and "tps" in r]
    weight = 0.3 if any("mtp/loss" in r for r in train) else 0.0
    last = train[-10:]
    return {
        "variant": name, "overrides": list(overrides), "wall_s": time.time() - t0,
        "val_loss": {r["step"]: r["val/loss"] for r in rows if "val/loss" in r},
        "train_next_token_ce_last10": statistics.mean(r["loss"] - weight * r.get("mtp/loss", 0.0) for r in last),
        "mtp_loss_last10": statistics.mean(r["mtp/loss"] for r in last) if weight else None,
        "tokens_per_s": statistics.median(r["tps"] for r in train if r["step"] > args.warmup),
        "precision": header_value(proc.stdout, "precision").split(" ")[0],
    }


def mtp_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """DeepSeek-V3 debug with and without one multi-token prediction depth (weight 0.3), the same
    batches, seed and token count: validation loss (next-token CE; eval forwards skip MTP) along
    the run, the training batches' next-token CE, and the throughput MTP costs."""
    from titan_hydra.hardware import cpu_isa, cpu_model

    variants = {"deepseek_v3_debug": ("model.mtp_layers=0",),
                "deepseek_v3_debug + MTP (1 depth, weight 0.3)": ("model.mtp_layers=1",)}
    rows = [mtp_run(args, tmp, name, ov) for name, ov in variants.items()]
    steps = sorted({s for r in rows for s in r.get("val_loss", {})})

    def cells(r: dict) -> str:
        vals = " | ".join(f"{r['val_loss'].get(s, float('nan')):.4f}" for s in steps)
        mtp = "-" if r["mtp_loss_last10"] is None else f"{r['mtp_loss_last10']:.4f}"
        return f"{vals} | {r['train_next_token_ce_last10']:.4f} | {mtp} | {r['tokens_per_s']:,.0f}"

    lines = variant_table(f"suite `mtp` — {time.strftime('%Y-%m-%d')}, {cpu_model()} ({cpu_isa()}), "
                          f"{os.cpu_count()} cores, {args.threads} thread(s), {args.steps} steps of the builtin corpus",
                          [*(f"val loss @{s}" for s in steps), "train next-token CE (last 10)",
                           "mtp/loss (last 10)", "tok/s"], rows, cells)
    return lines, {"suite": "mtp", "steps": args.steps, "rows": rows}


# ---------------------------------------------------------------------------- the hybrid suite
def hybrid_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """Qwen3.5's hybrid (recipes/bench_hybrid.py): (a) tokens/s against transformers' implementation,
    (b) tokens/s against the sequence length per layer pattern, (c) loss after equal tokens per
    pattern (``--steps`` steps of launch.py; 0 skips it)."""
    import torch

    import bench_hybrid
    from titan_hydra.hardware import cpu_isa, cpu_model

    torch.set_num_threads(args.threads)
    result = {"suite": "hybrid", "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": args.threads,
              "torch": torch.__version__, "timed_steps": args.timed_steps,
              "vs_transformers": bench_hybrid.versus_transformers(args),
              "seq_sweep": bench_hybrid.seq_sweep(args), "loss_steps": args.steps}
    result["loss"] = [mtp_run(args, tmp, name, (f"model.full_attention_interval={k}",), model="qwen3_5_debug")
                      for name, k in bench_hybrid.PATTERNS.items()] if args.steps else []
    heading = (f"suite `hybrid` — {result['date']}, {cpu_model()} ({cpu_isa()}), {os.cpu_count()} cores "
               f"(shared), {args.threads} thread(s), torch {torch.__version__}, median of {args.timed_steps} timed steps")
    return bench_hybrid.tables(result, heading), result


EXTRA_SUITES = {"data": data_suite, "ft": ft_suite, "moe_memory": moe_memory_suite, "mtp": mtp_suite,
                "hybrid": hybrid_suite}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="precision", choices=sorted([*SUITES, *EXTRA_SUITES]))
    p.add_argument("--sync-every", type=int, default=20, help="ft suite: steps between LocalSGD / DiLoCo meetings")
    p.add_argument("--corpus-mb", type=int, default=1024, help="data suite: generated corpus size")
    p.add_argument("--datatrove-python", default=None,
                   help="data suite: the python of a venv with datatrove (recipes/datatrove_tokenize.py): "
                        "its tokenization of the same corpus is timed beside prepare_data's")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="data suite: preparation workers")
    p.add_argument("--heap-cap-mb", type=int, default=None, help="data suite: RLIMIT_DATA per process")
    p.add_argument("--seq-len", type=int, default=256, help="data suite: loader and training sequence length; hybrid: of table (a)")
    p.add_argument("--batch", type=int, default=8, help="data suite: loader and training batch; hybrid: of table (a)")
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096, 8192],
                   help="hybrid suite: sequence lengths of the layer-pattern sweep")
    p.add_argument("--timed-steps", type=int, default=5, help="hybrid suite: timed steps per in-process point")
    p.add_argument("--variant", default=None, help="moe_memory suite: only the variants whose name contains this")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the medians")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default=None, help="JSON path (default bench_out/<suite>.json)")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every variant")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.suite in EXTRA_SUITES:
        run_extra_suite(args)
    else:
        run_training_suite(args)


def run_extra_suite(args) -> None:
    """A suite that measures something other than training variants (data, ft, moe_memory)."""
    with tempfile.TemporaryDirectory(prefix=f"titan_bench_{args.suite}_") as tmp:
        lines, result = EXTRA_SUITES[args.suite](args, Path(tmp))
    print("\n".join(lines))
    out = Path(args.out or f"bench_out/{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


def run_training_suite(args) -> None:
    """Every variant of ``SUITES[args.suite]`` as a training run; the table against each group's baseline."""
    import torch

    from titan_hydra.hardware import cpu_isa, cpu_model
    from titan_hydra.metrics.throughput import device_peak_tflops

    torch.set_num_threads(args.threads)
    # The trainer's denominator: measured bf16 matmul peak (fp32's where that is faster).
    peak_bf16 = device_peak_tflops("cpu", torch.bfloat16, fresh=True)
    cpu = f"{cpu_model()} ({cpu_isa()})"
    results = []
    with tempfile.TemporaryDirectory(prefix="titan_bench_") as tmp:
        for name, variant in SUITES[args.suite].items():
            r = run_variant(name, variant, args, Path(tmp))
            if r["status"] == "ok":
                # The matmul peak scales with threads (measured: 0.45 -> 0.90 TFLOP/s, 1 -> 2).
                rank_peak = peak_bf16 * r["threads_per_proc"] / args.threads
                r["mfu_vs_bf16_peak_pct"] = 100 * r["tflops_per_rank"] / rank_peak
            results.append(r)
            print(f"  {name}: {r['status']} ({r['wall_s']:.0f}s)", file=sys.stderr, flush=True)
    heading = (f"suite `{args.suite}` — {time.strftime('%Y-%m-%d')}, {cpu}, {os.cpu_count()} cores, "
               f"{args.threads} thread(s)/process unless a variant says, torch {torch.__version__}, bf16 matmul peak "
               f"{peak_bf16:.2f} TFLOP/s/process, {args.steps} steps (median after {args.warmup})")
    table = training_table(heading, results)
    print(table)
    out = Path(args.out or REPO / "bench_out" / f"{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "suite": args.suite, "date": time.strftime("%Y-%m-%d"), "cpu": cpu,
        "threads_per_proc": args.threads, "torch": torch.__version__, "peak_bf16_tflops": peak_bf16,
        "steps": args.steps, "warmup": args.warmup, "results": results, "table": table,
    }, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


def training_table(heading: str, results: list[dict]) -> str:
    """The markdown table of a training suite; sets each row's ``speedup_vs_baseline`` (against
    the first successful variant of its group)."""
    unit = next((r["unit"] for r in results if r["status"] == "ok"), "tok")  # a suite counts one unit
    baselines: dict[str, dict] = {}
    for r in results:
        if r["status"] == "ok":
            baselines.setdefault(r["group"], r)
    lines = [
        heading,
        "",
        f"| variant | precision, attention | ranks x threads | {unit}/s/rank | {unit}/s total | TFLOP/s/rank | MFU (bf16 peak) | peak RSS/rank GiB | params+optim/rank GiB | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    moe = any(r.get("moe_max_over_mean") for r in results)
    if moe:  # MoE suites: one more column, the expert-load imbalance
        lines[-2] += " load max/mean |"
        lines[-1] += "---|"
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | | {r['nproc']} | {r['status']} | | | | | | |")
            continue
        ratio = r["tps_total"] / baselines[r["group"]]["tps_total"]
        r["speedup_vs_baseline"] = ratio
        state = f"{r['params_optimizer_gib']:.4f}" if r["params_optimizer_gib"] else "-"  # plain loop: not logged
        lines.append(
            f"| {r['variant']} | {r['precision']}, {r['attention']} | {r['nproc']}x{r['threads_per_proc']} | {r['tps_per_rank']:,.0f} | {r['tps_total']:,.0f} | "
            f"{r['tflops_per_rank']:.3f} | {r['mfu_vs_bf16_peak_pct']:.1f}% | {r['peak_memory_gib']:.2f} | "
            f"{state} | {ratio:.2f}x |" + (f" {r['moe_max_over_mean'] or 0:.2f} |" if moe else "")
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
