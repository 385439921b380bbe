"""The throughput benchmark's suites (``recipes/benchmark.py --suite <name>``), one module each.

A layer of its own at the top, beside ``launch``: a suite measures whole runs, so it may use every
layer below (it composes configs through ``groups`` and builds models in process for the hybrid
suite, reads run dirs), but runs training only as a user does, through ``launch.py`` in a process
of its own; nothing in the package imports it.

  common.py      running launch.py per variant, reading its metrics and run header, the tables
  variants.py    the training suites: named variants of one config (precision, layouts, ...)
  training.py    running a training suite: tokens/s, TFLOP/s, MFU, memory against each group's baseline
  data.py        corpus preparation and the shard loader against what training consumes
  ft.py          torchft replica groups (synchronous, LocalSGD, DiLoCo) against DDP
  moe_memory.py  resident memory of a long MoE run
  mtp.py         multi-token prediction: validation loss at equal tokens
  hybrid.py      Qwen3.5's Gated DeltaNet hybrid against transformers', tokens/s per layer pattern
  simulate_grid.py  the closed-form planner against dry_run=simulate on a grid of layouts and families
"""
