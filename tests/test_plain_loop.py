"""The benchmark's yardstick (recipes/plain_loop.py) trains exactly what the trainer trains.

Same config -> same initial weights, same batches, same fp32 math: its losses must equal an
fp32 `launch.py` run with a constant learning rate, which makes the "vs plain fp32 loop"
speedups in the README a like-for-like comparison (and checks the trainer adds nothing to the
numbers of a plain loop).
"""

from __future__ import annotations

import subprocess
import sys

from helpers import REPO, TINY, machine_bound, run_launch, series

# No warm-up: the plain loop runs AdamW at its configured lr throughout.
FP32 = [o for o in TINY if not o.startswith("lr_scheduler.")] + ["training.mixed_precision=fp32"]
STEPS = 6


def test_plain_loop_losses_equal_the_trainer_in_fp32(tmp_path, run_cache):
    plain = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "plain_loop.py"), f"--steps={STEPS}",
         f"--run-dir={tmp_path / 'plain'}", *FP32],
        capture_output=True, text=True, timeout=300,
    )
    assert plain.returncode == 0, plain.stderr[-2000:]
    run = run_launch([*FP32, f"training.steps={STEPS}", "training.val_freq=0", "logger=minimal",
                      "lr_scheduler=constant", f"hydra.run.dir={tmp_path / 'titan'}"], cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    plain_losses = series(tmp_path / "plain", "loss")
    titan_losses = series(tmp_path / "titan", "loss")
    assert len(plain_losses) == len(titan_losses) == STEPS
    bound = machine_bound(run_cache, titan_losses)
    for a, b in zip(plain_losses, titan_losses):
        assert abs(a - b) <= bound, (plain_losses, titan_losses)
    assert plain_losses[-1] < plain_losses[0]  # and it trains
