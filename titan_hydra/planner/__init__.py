"""The planner: sizes a run from its config (parameters, FLOPs, per-rank memory, step time) and
picks ``parallelism=auto``'s layout, building nothing.

A layer of its own, above the engine it models and below validation (it runs before it): it reads
the run's RunSpec and may import spec, layout, config, parallel, models, errors, hardware, kernels
and metrics.throughput (and, in attention.py only, the training code's attention policy), but
nothing in parallel / validate / models / checkpoint / data / metrics imports it; launch/ and
recipes/ call it.

  shape.py        model and stage parameter counts from the model's shape
  activations.py  saved activations per block, from coefficients measured on this model code
  attention.py    which attention a run uses and what upcast attention adds
  runtime.py      behaviours of the training code that are not config keys (titan_hydra, torchtitan)
  pipeline.py     pipeline stage split and per-rank F/B order (schedule simulator)
  cuda_memory.py  the CUDA step's dynamic peak and the caching allocator's reserve
  devices.py      device memory and peak TFLOP/s by GPU name
  plan.py         ``plan()``: the per-rank plan of a run, and its report
  auto.py         ``parallelism=auto``: candidate layouts, ranked by the plan

Fitting finished sweeps (scaling laws, IsoFLOP minima, mixture laws) is not planning: it lives in
titan_hydra/analysis/, which reads run dirs.
"""
