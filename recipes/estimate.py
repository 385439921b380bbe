"""Print the plan of a run (parameters, FLOPs, per-rank memory) without allocating anything.

Composes the config exactly like launch.py (Hydra compose API, same overrides), so any model,
parallelism and cluster can be sized before a job is submitted:

    python recipes/estimate.py model=llama3_70b parallelism=fsdp_tp cluster=slurm_h100 cluster.nnodes=8 \
        training.seq_len=8192 training.local_batch_size=1 activation_checkpoint=full
    python recipes/estimate.py --json model=llama3_405b ...

``--law scaling_law.json`` (what recipes/scaling_law.py fits from a sweep) adds the run's predicted
loss, with the fit's bootstrap interval, at its N (counted as the fit counted it) and
D = training.steps x tokens per step, and the wall time of training.steps at the planner's step time
(the layout's estimate at 40% MFU of the cluster's peak; ``cluster.peak_tflops`` sets a CPU's).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from titan_hydra.analysis.flags import parser
from titan_hydra.analysis.scaling_law import load_fit
from titan_hydra.errors import exit_status
from titan_hydra.groups import compose_config
from titan_hydra.planner.auto import estimated_step_time
from titan_hydra.planner.plan import Plan, plan
from titan_hydra.spec import RunSpec, spec_of


def prediction(spec: RunSpec, p: Plan, law_path: Path) -> dict:
    """The planned run's predicted loss (and interval) under the fit at ``law_path``, and its wall time."""
    fit, record = load_fit(law_path)
    params = record.get("params", "non_embedding")
    n = p.non_embedding_params if params == "non_embedding" else p.params
    steps = int(spec.training.steps)
    d = steps * p.tokens_per_step
    loss, lo, hi = fit.predict(n, d)
    wall = steps * estimated_step_time(spec, p) if p.step_time_s_at_mfu40 is not None else None
    return {"law": str(law_path), "params": params, "n": n, "d": d, "flops": p.flops_per_token * d, "loss": loss,
            "loss_interval": [lo, hi], "level": fit.level, "wall_time_s": wall}


def format_prediction(pred: dict) -> str:
    wall = (f"{pred['wall_time_s']:,.0f} s ({pred['wall_time_s'] / 3600:.3g} h)" if pred["wall_time_s"] is not None
            else "unknown: the cluster names no peak (set cluster.peak_tflops=<TFLOP/s per device>)")
    rows = [("scaling law", pred["law"]),
            ("N / D / C", f"{pred['n']:,} {pred['params'].replace('_', '-')} params / {pred['d']:,} tokens / {pred['flops']:.4g} FLOPs"),
            ("predicted loss", f"{pred['loss']:.4f} [{pred['loss_interval'][0]:.4f}, {pred['loss_interval'][1]:.4f}] "
                               f"({pred['level']:.0%} bootstrap interval)"),
            ("wall time of training.steps", wall)]
    return "\n".join(f"{k:<29}{v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, full=True)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--law", type=Path, help="a fit from recipes/scaling_law.py: add the predicted loss and wall time")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    args = p.parse_args(argv)
    cfg = compose_config(args.overrides)

    def estimate() -> str:
        spec = spec_of(cfg)
        result = plan(spec)
        pred = prediction(spec, result, args.law) if args.law else None
        if args.json:
            return json.dumps({**result.as_dict(), **({"prediction": pred} if pred else {})}, indent=1)
        return result.format() + (f"\n{format_prediction(pred)}" if pred else "")

    return exit_status(estimate)


if __name__ == "__main__":
    sys.exit(main())
