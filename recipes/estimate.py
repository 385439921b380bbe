"""Print the plan of a run (parameters, FLOPs, per-rank memory) without allocating anything.

Composes the config exactly like launch.py (Hydra compose API, same overrides), so any model,
parallelism and cluster can be sized before a job is submitted:

    python recipes/estimate.py model=llama3_70b parallelism=fsdp_tp cluster=slurm_h100 cluster.nnodes=8 \
        training.seq_len=8192 training.local_batch_size=1 activation_checkpoint=full
    python recipes/estimate.py --json model=llama3_405b ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for launch.py")
    args = p.parse_args(argv)

    from titan_hydra.groups import compose_config
    from titan_hydra.errors import UserError
    from titan_hydra.spec import spec_of
    from titan_hydra.planner.plan import plan

    cfg = compose_config(args.overrides)
    try:
        result = plan(spec_of(cfg))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.as_dict(), indent=1) if args.json else result.format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
