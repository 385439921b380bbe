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
    python recipes/benchmark.py --suite simulate_grid
        # the closed-form planner against dry_run=simulate on 44 points (every family, 1-D to 4-D,
        # AC none/selective/full, 8 to 2,048 H100 ranks; depth cut, real widths); add
        # --simulated bench_out/simulate_grid.json to rerun only the planner against those figures
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import tempfile
from pathlib import Path

from titan_hydra.analysis.flags import add_out, add_threads, parser
from titan_hydra.bench.variants import SUITES

# The suites that measure something other than training variants: (module of titan_hydra.bench,
# function). A suite's module (torch, models, the config groups) is imported only once it is the
# one asked for, so parsing the arguments (--help) costs nothing.
EXTRA_SUITES = {"data": ("data", "data_suite"), "ft": ("ft", "ft_suite"), "moe_memory": ("moe_memory", "moe_memory_suite"),
                "mtp": ("mtp", "mtp_suite"), "hybrid": ("hybrid", "hybrid_suite"),
                "simulate_grid": ("simulate_grid", "simulate_grid_suite")}


def suite_function(module: str, name: str):
    return getattr(importlib.import_module(f"titan_hydra.bench.{module}"), name)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__, full=True)
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
    p.add_argument("--variant", default=None,
                   help="moe_memory, simulate_grid suites: only the variants (grid points) whose name contains this")
    p.add_argument("--simulated", default=None,
                   help="simulate_grid suite: a previous run's JSON; its simulated figures are reused, the planner "
                        "rerun (points it lacks are simulated)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the medians")
    add_threads(p)
    add_out(p, "JSON path (default bench_out/<suite>.json)")
    p.add_argument("extra", nargs="*", help="extra Hydra overrides for every variant")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.suite in EXTRA_SUITES:
        run_extra_suite(args)
    else:
        suite_function("training", "run_training_suite")(args)


def run_extra_suite(args) -> None:
    """A suite that measures something other than training variants (data, ft, moe_memory, mtp, hybrid,
    simulate_grid)."""
    with tempfile.TemporaryDirectory(prefix=f"titan_bench_{args.suite}_") as tmp:
        lines, result = suite_function(*EXTRA_SUITES[args.suite])(args, Path(tmp))
    print("\n".join(lines))
    out = Path(args.out or f"bench_out/{args.suite}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
