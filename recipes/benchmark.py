"""Throughput benchmark: runs variants of a training config side by side, prints a markdown
table and writes JSON.

Every variant is a real `launch.py` run in its own process (same data, same steps), measured
from its metrics.jsonl after warm-up steps: tokens/s per rank and in total, achieved TFLOP/s,
MFU against this machine's measured bf16 matmul peak (one yardstick for every variant), and
peak memory per rank. Variants run one after another in the same invocation so their ratios
are comparable; absolute numbers on shared 2-core machines are noisy.

    python recipes/benchmark.py                         # default suite: fp32 vs bf16, debug model
    python recipes/benchmark.py --suite layouts         # 2-rank layouts
    python recipes/benchmark.py --steps 30 --threads 2 --out bench_out/foundation.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> (overrides, nproc)
SUITES: dict[str, dict[str, tuple[list[str], int]]] = {
    "precision": {
        "fp32 eager": (["training.mixed_precision=fp32"], 1),
        "bf16 autocast": (["training.mixed_precision=bf16"], 1),
    },
    "layouts": {
        "single (1 rank)": (["parallelism=single"], 1),
        "fsdp (2 ranks)": (["parallelism=fsdp"], 2),
        "ddp (2 ranks)": (["parallelism=ddp"], 2),
        "hsdp (2x1 ranks)": (["parallelism=hsdp", "parallelism.dp_replicate=2"], 2),
        "tp (2 ranks)": (["parallelism=tp"], 2),
        "pp 1F1B (2 ranks)": (["parallelism=pp", "parallelism.pp_schedule=1F1B"], 2),
        "cp (2 ranks)": (["parallelism=cp"], 2),
    },
    # Performance features on the debug model, one process. float8 turns off torchao's H100 size
    # filter (it would skip every layer this small) so the float8 path really runs (emulated cost on CPU).
    "perf": {
        "fp32 eager": (["training.mixed_precision=fp32"], 1),
        "bf16": (["training.mixed_precision=bf16"], 1),
        "compile": (["training.mixed_precision=fp32", "compile=model_loss"], 1),
        "compile + bf16": (["training.mixed_precision=bf16", "compile=model_loss"], 1),
        "float8 tensorwise": (["float8=tensorwise", "float8.auto_filter_small_kn=false"], 1),
        "float8 rowwise": (["float8=rowwise", "float8.auto_filter_small_kn=false"], 1),
        "ac full": (["training.mixed_precision=bf16", "activation_checkpoint=full"], 1),
        "ac selective_op": (["training.mixed_precision=bf16", "activation_checkpoint=selective_op"], 1),
        "ac selective_layer": (["training.mixed_precision=bf16", "activation_checkpoint=selective_layer"], 1),
    },
}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run_variant(name: str, overrides: list[str], nproc: int, args, workdir: Path) -> dict:
    run_dir = workdir / name.replace(" ", "_").replace("(", "").replace(")", "")
    cmd = [
        sys.executable, str(REPO / "launch.py"),
        f"training.steps={args.steps}", "training.val_freq=0", "logger=minimal",
        f"cluster.nproc_per_node={nproc}", f"cluster.threads_per_proc={args.threads}",
        f"hydra.run.dir={run_dir}", *args.extra, *overrides,
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=workdir)
    wall = time.time() - t0
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {"variant": name, "nproc": nproc, "status": f"failed: {tail}", "wall_s": wall}
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    first = next((r for r in rows if "memory_params_gib" in r), {})
    state_gib = first.get("memory_params_gib", 0.0) + first.get("memory_optimizer_gib", 0.0)
    rows = [r for r in rows if "tps" in r and r["step"] > args.warmup]
    tps = statistics.median(r["tps"] for r in rows)
    tflops = statistics.median(r["tflops"] for r in rows)
    return {
        "variant": name,
        "nproc": nproc,
        "threads_per_proc": args.threads,
        "status": "ok",
        "tps_per_rank": tps,
        "tps_total": tps * nproc,
        "tflops_per_rank": tflops,
        "peak_memory_gib": max(r.get("memory", 0.0) for r in rows),
        "params_optimizer_gib": state_gib,
        "final_loss": rows[-1]["loss"],
        "wall_s": wall,
        "overrides": overrides,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="precision", choices=sorted(SUITES))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the medians")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out", default=None, help="JSON path (default bench_out/<suite>.json)")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every variant")
    args = p.parse_args()

    import torch

    from titan_hydra.metrics.throughput import measure_cpu_peak_tflops

    torch.set_num_threads(args.threads)
    peak_bf16 = measure_cpu_peak_tflops(torch.bfloat16, fresh=True)
    results = []
    with tempfile.TemporaryDirectory(prefix="titan_bench_") as tmp:
        for name, (overrides, nproc) in SUITES[args.suite].items():
            r = run_variant(name, overrides, nproc, args, Path(tmp))
            if r["status"] == "ok":
                r["mfu_vs_bf16_peak_pct"] = 100 * r["tflops_per_rank"] / peak_bf16
            results.append(r)
            print(f"  {name}: {r['status']} ({r['wall_s']:.0f}s)", file=sys.stderr, flush=True)

    base = next((r for r in results if r["status"] == "ok"), None)
    lines = [
        f"suite `{args.suite}` — {time.strftime('%Y-%m-%d')}, {cpu_name()}, {os.cpu_count()} cores, "
        f"{args.threads} thread(s)/process, torch {torch.__version__}, bf16 matmul peak "
        f"{peak_bf16:.2f} TFLOP/s/process, {args.steps} steps (median after {args.warmup})",
        "",
        "| variant | ranks | tok/s/rank | tok/s total | TFLOP/s/rank | MFU (bf16 peak) | peak RSS/rank GiB | params+optim/rank GiB | vs first |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["status"] != "ok":
            lines.append(f"| {r['variant']} | {r['nproc']} | {r['status']} | | | | | | |")
            continue
        ratio = r["tps_total"] / base["tps_total"]
        lines.append(
            f"| {r['variant']} | {r['nproc']} | {r['tps_per_rank']:,.0f} | {r['tps_total']:,.0f} | "
            f"{r['tflops_per_rank']:.3f} | {r['mfu_vs_bf16_peak_pct']:.1f}% | {r['peak_memory_gib']:.2f} | "
            f"{r['params_optimizer_gib']:.4f} | {ratio:.2f}x |"
        )
    table = "\n".join(lines)
    print(table)
    out = Path(args.out or REPO / "bench_out" / f"{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "suite": args.suite, "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(),
        "threads_per_proc": args.threads, "torch": torch.__version__, "peak_bf16_tflops": peak_bf16,
        "steps": args.steps, "warmup": args.warmup, "results": results, "table": table,
    }, indent=2))
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
