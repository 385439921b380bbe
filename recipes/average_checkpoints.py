"""The uniform average of a run's last N checkpoints, written as a checkpoint (offline, one process).

    python recipes/average_checkpoints.py OUT/run_dir --last 3 [--out OUT/run_dir/averaged]

The argument is a run dir (its ``checkpoint/`` folder), a checkpoint folder, or one step dir of
it (then the N complete checkpoints up to that step). The newest N complete checkpoints (those
with a completion marker) are read as global tensors, so they may come from any layout, and every
``model.*`` entry (and ``ema.*`` where all N hold one) is averaged; non-float entries (none in
today's models) are the newest's. Bad input is one line: fewer than N complete checkpoints,
checkpoints of different models or shapes.

The output is a model-only checkpoint (``kind: model_only``, with its completion marker, the
averaged steps recorded as ``averaged``): the optimizer state is left out because an average of
weights has none of its own (Adam's moments belong to the points of the trajectory that were
averaged, not to their mean). ``checkpoint.initial_load_path=<out>`` starts a run from it under
any layout (weights only, fresh optimizer, step 0); ``recipes/eval.py <out>`` evaluates it and
``recipes/convert.py to-hf <out> <hf_dir>`` exports it.

The average itself is ``torch.optim.swa_utils.get_swa_multi_avg_fn`` (the running mean
``avg += (w - avg) / (n + 1)`` that ``AveragedModel`` uses), applied one checkpoint at a time to
fp64 accumulators: memory holds the average and one checkpoint, not N, and the fp64 running mean
is within a few fp64 units of the exact mean, so the stored fp32 value is the mean rounded once.
"""

from __future__ import annotations

import sys

from titan_hydra.analysis.flags import add_out, parser
from titan_hydra.checkpoint.average import average_checkpoints
from titan_hydra.errors import exit_status


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("path", help="a run dir, its checkpoint folder, or a step dir (the newest to average)")
    p.add_argument("--last", type=int, default=3, help="how many of the newest complete checkpoints")
    add_out(p, "the averaged checkpoint's dir (default <folder>/average-<a>-<b>)")
    a = p.parse_args(argv)
    return exit_status(lambda: f"wrote {average_checkpoints(a.path, a.last, a.out)}")


if __name__ == "__main__":
    sys.exit(main())
