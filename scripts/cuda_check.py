"""The CUDA path in one short run: a handful of `launch.py` jobs on one GPU, a table and a JSON.

Everything else in this repository runs and is tested on CPU (gloo). This script is what to run
when a GPU is at hand, to see the CUDA side of the same code: NCCL process groups, bf16 on tensor
cores, torch.compile through Triton, torch._grouped_mm's CUDA kernel under the MoE families,
torchao Float8 on real float8 matmuls (sm89+), and fp32 loss parity between CPU and GPU.

    python scripts/cuda_check.py --out cuda_check_out          # all cases, ~5 min on one H100
    python scripts/cuda_check.py --only llama_bf16,moe_bf16    # a subset

Each case is one `launch.py` process (logger=minimal: no W&B, no TensorBoard needed); its losses,
tok/s and MFU are read from the run's metrics.jsonl. A case that fails keeps the last lines of its
output in the JSON and the rest still run. Exit status: 0 when every case trained and every parity
check held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = ["cluster=local_gpu", "cluster.nproc_per_node=1"]
COMMON = ["logger=minimal", "training.val_freq=0", "checkpoint=none"]
MOE = ["model=qwen3_moe_debug"]

# name -> (overrides, steps). Parity pairs below name two of these.
CASES: dict[str, tuple[list[str], int]] = {
    "llama_fp32_cpu": (["training.mixed_precision=fp32", "training.deterministic=true"], 5),
    "llama_fp32_cuda": (GPU + ["training.mixed_precision=fp32", "training.deterministic=true"], 5),
    "llama_bf16": (GPU + ["training.mixed_precision=bf16"], 30),
    "llama_bf16_compile": (GPU + ["training.mixed_precision=bf16", "compile=model"], 30),
    "llama_float8_compile": (GPU + ["training.mixed_precision=bf16", "compile=model", "float8=rowwise",
                                    "float8.auto_filter_small_kn=false"], 30),
    "llama_fsdp_sac": (GPU + ["training.mixed_precision=bf16", "parallelism=fsdp",
                              "activation_checkpoint=selective_op"], 30),
    "moe_fp32_cpu": (MOE + ["training.mixed_precision=fp32", "training.deterministic=true",
                            "training.seq_len=128", "training.local_batch_size=2"], 5),
    "moe_fp32_cuda": (MOE + GPU + ["training.mixed_precision=fp32", "training.deterministic=true",
                                   "training.seq_len=128", "training.local_batch_size=2"], 5),
    "moe_bf16": (MOE + GPU + ["training.mixed_precision=bf16"], 30),
    "moe_bf16_compile_sac": (MOE + GPU + ["training.mixed_precision=bf16", "compile=model",
                                          "activation_checkpoint=selective_op"], 30),
    "deepseek_bf16": (["model=deepseek_v3_debug"] + GPU + ["training.mixed_precision=bf16"], 30),
}
# (cpu case, cuda case, largest relative loss difference allowed at any step). TF32 is off in fp32
# runs (torch's default), so the gap is reduction order alone.
PARITY = [("llama_fp32_cpu", "llama_fp32_cuda", 1e-4), ("moe_fp32_cpu", "moe_fp32_cuda", 1e-4)]


def run_case(name: str, overrides: list[str], steps: int, out: Path, timeout: int) -> dict:
    run_dir = out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)  # metrics.jsonl appends: start each case clean
    cmd = [sys.executable, "launch.py", *COMMON, *overrides, f"training.steps={steps}", f"hydra.run.dir={run_dir}"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
    wall = time.perf_counter() - start
    rows = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps_done = [r for r in rows if "loss" in r and "tps" in r]
    later = steps_done[len(steps_done) // 2:]  # second half: past compile and warm-up
    result = {
        "case": name, "overrides": overrides, "steps": steps, "rc": rc, "wall_s": round(wall, 1),
        "losses": [r["loss"] for r in steps_done],
        "tps": round(sum(r["tps"] for r in later) / len(later)) if later else None,
        "mfu": round(sum(r.get("mfu", 0.0) for r in later) / len(later), 1) if later else None,
        "memory_gib": round(max(r.get("memory", 0.0) for r in steps_done), 2) if steps_done else None,
        "plan": [ln.strip() for ln in text.splitlines() if ln.strip().startswith(("precision", "features", "layout", "attention", "moe", "compile"))],
    }
    if rc != 0 or len(steps_done) != steps:
        result["tail"] = text.splitlines()[-25:]
    return result


def parity(results: dict[str, dict]) -> list[dict]:
    checks = []
    for cpu, cuda, tol in PARITY:
        if cpu not in results or cuda not in results:
            continue
        a, b = results[cpu]["losses"], results[cuda]["losses"]
        worst = max((abs(x - y) / abs(x) for x, y in zip(a, b)), default=None)
        ok = worst is not None and len(a) == len(b) and len(a) > 0 and worst <= tol
        checks.append({"cpu": cpu, "cuda": cuda, "max_rel_diff": worst, "tol": tol, "ok": ok})
    return checks


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("cuda_check_out"))
    ap.add_argument("--only", default="", help="comma-separated case names (default: all)")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per case")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    env_info = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"],
                              capture_output=True, text=True).stdout.strip()
    print(f"torch / device: {env_info}", flush=True)
    results: dict[str, dict] = {}
    for name in names:
        overrides, steps = CASES[name]
        results[name] = r = run_case(name, overrides, steps, args.out, args.timeout)
        last = f"{r['losses'][-1]:.4f}" if r["losses"] else "-"
        print(f"{name:24s} rc={r['rc']:<3d} steps={len(r['losses']):>2d}/{steps:<2d} loss={last:>7s} "
              f"tok/s={r['tps'] or '-':>8} mfu={r['mfu'] or '-':>5}% mem={r['memory_gib'] or '-'} GiB "
              f"wall={r['wall_s']}s", flush=True)
        for line in r.get("tail", []):
            print("    | " + line, flush=True)
        (args.out / "cuda_check.json").write_text(json.dumps({"device": env_info, "results": results}, indent=1))
    checks = parity(results)
    for c in checks:
        print(f"parity {c['cpu']} vs {c['cuda']}: max relative loss difference {c['max_rel_diff']} "
              f"(tol {c['tol']}) -> {'OK' if c['ok'] else 'FAIL'}")
    (args.out / "cuda_check.json").write_text(json.dumps({"device": env_info, "results": results, "parity": checks}, indent=1))
    failed = [n for n, r in results.items() if r["rc"] != 0 or len(r["losses"]) != r["steps"]]
    return 1 if failed or not all(c["ok"] for c in checks) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
