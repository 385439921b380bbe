"""The estimator against torchtitan's published Llama 3.1 H100 runs (memory and tokens/s per GPU).

Every row of tests/data/torchtitan_h100_202412.yaml (transcribed from torchtitan's
benchmarks/llama3_h100_202412_torchtitan.md) becomes the titan_hydra config of the same setup
(cluster=slurm_h100_96gb, same degrees, batch, sequence, AC, compile, Float8, schedule), and
``estimate.plan`` sizes it analytically (nothing is allocated) with the behaviours of the code
that ran it (``estimate.TORCHTITAN_2024_12``). Prints a markdown table and writes JSON:

    python recipes/estimate_published.py                 # -> bench_out/estimator_h100.json
    python recipes/estimate_published.py --out docs/bench/2026-11-25_estimator_h100.json

Tokens/s per GPU is ``parallel/auto.py``'s ``estimated_step_time`` at its assumed MFU on the
cluster's 989 TFLOP/s (SXM H100 dense bf16) peak; these were 500 W HBM2e parts, whose real peak
is lower, and Float8 rows run matmuls on FP8 tensor cores the estimate does not model: the
ratio is reported as it is, without a target.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path

from titan_hydra.analysis.flags import add_out, parser

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "tests" / "data" / "torchtitan_h100_202412.yaml"
GPUS_PER_NODE = 8
DEVICE_GIB = 96.0


def load_rows(path: Path = DATA) -> list[dict]:
    import yaml

    return yaml.safe_load(path.read_text())["rows"]


def overrides(row: dict) -> list[str]:
    """The titan_hydra overrides of one published run."""
    out = [
        f"model={row['model']}", "cluster=slurm_h100_96gb", f"cluster.nnodes={row['gpus'] // GPUS_PER_NODE}",
        "parallelism=fsdp", "parallelism.dp_replicate=1", f"parallelism.dp_shard={row['dp_shard']}",
        f"parallelism.tp={row['tp']}", f"parallelism.pp={row['pp']}", f"parallelism.cp={row['cp']}",
        f"parallelism.tp_async={str(row['async_tp']).lower()}",
        f"training.local_batch_size={row['local_batch']}", f"training.seq_len={row['seq_len']}",
        f"model.max_seq_len={row['seq_len']}",  # torchtitan sizes its RoPE table to training.seq_len
        "training.mixed_precision=bf16", f"activation_checkpoint={row['ac']}",
        f"compile={'model' if row['compile'] else 'none'}", f"float8={'tensorwise' if row['float8'] else 'none'}",
    ]
    if row["ac"] == "selective_op":  # torchtitan 9dec370's op policy: every second matmul saved
        out.append("activation_checkpoint.selective_op_policy=every_second_mm")
    if row["pp"] > 1:  # torchtitan 9dec370: n_microbatches = pipeline_parallel_degree
        out += [f"parallelism.pp_schedule={row['schedule']}", f"parallelism.pp_microbatches={row['pp']}"]
    return out


def evaluate_row(row: dict) -> dict:
    """Estimated peak GiB and tokens/s per GPU of one row, with the published numbers beside."""
    from titan_hydra.groups import compose_config
    from titan_hydra.planner.auto import estimated_step_time
    from titan_hydra.spec import spec_of
    from titan_hydra.planner.plan import ASSUMED_MFU, plan
    from titan_hydra.planner.runtime import TORCHTITAN_2024_12

    cfg = compose_config(overrides(row))
    spec = spec_of(cfg)
    p = plan(spec, runtime=TORCHTITAN_2024_12)
    tps = p.tokens_per_step / estimated_step_time(spec, p) / spec.world_size
    return {
        "id": row["id"], "table": row["table"], "model": row["model"], "gpus": row["gpus"],
        "layout": p.layout, "published_gib": row["memory_gib"], "estimated_gib": round(p.mem_total_gib, 2),
        "memory_ratio": round(p.mem_total_gib / row["memory_gib"], 3),
        "published_tps_per_gpu": row["tps_per_gpu"], "estimated_tps_per_gpu": round(tps, 1),
        "tps_ratio": round(tps / row["tps_per_gpu"], 3), "assumed_mfu": ASSUMED_MFU,
    }


def headroom_covering(results: list[dict]) -> tuple[float, dict]:
    """The smallest ``cluster.memory_headroom`` (whole percent) under which no row's estimate
    fits a device its published peak overflows: the fit check keeps estimate <= (1 - h) x device,
    and the real peak is estimate / ratio, so h >= 1 - the lowest estimated/published ratio.
    Returns it with the row that sets it."""
    worst = min(results, key=lambda r: r["estimated_gib"] / r["published_gib"])
    return math.ceil(100 * (1 - worst["estimated_gib"] / worst["published_gib"])) / 100, worst


def markdown(results: list[dict]) -> str:
    lines = ["| row | published GiB | estimated GiB | ratio | published TPS/GPU | estimated TPS/GPU | ratio |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results:
        lines.append(f"| {r['id']} | {r['published_gib']:.1f} | {r['estimated_gib']:.1f} | {r['memory_ratio']:.2f} "
                     f"| {r['published_tps_per_gpu']:,} | {r['estimated_tps_per_gpu']:,.0f} | {r['tps_ratio']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__, full=True)
    add_out(ap, "JSON output path", default=str(REPO / "bench_out" / "estimator_h100.json"))
    args = ap.parse_args(argv)
    results = [evaluate_row(r) for r in load_rows()]
    print(markdown(results))
    headroom, worst = headroom_covering(results)
    print(f"\nlargest underestimate: {worst['id']} at {worst['memory_ratio']:.3f} -> "
          f"cluster.memory_headroom >= {headroom:.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.date.today().isoformat(),
        "source": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (runs at torchtitan 9dec370)",
        "device": "H100 96 GB HBM2e, 500 W; peak taken as 989 TFLOP/s dense bf16",
        "runtime": "estimate.TORCHTITAN_2024_12",
        "rows": results,
        "memory_headroom_covering_all_rows": headroom,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
