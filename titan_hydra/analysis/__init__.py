"""Reading finished runs and sweeps, and fitting them: what the report and fit recipes stand on.

A layer above the planner (it sizes each run of a ladder with ``planner.plan``) and below nothing
that trains: it reads run dirs (metrics.jsonl, the saved ``.hydra`` config, ``status.json``), and
may import spec, planner, checkpoint, data, models, config and errors, never train/, launch/ or
groups (a contract in pyproject.toml says so). The recipes over it (sweep_report, compare_runs,
scaling_law, mixture_law, flux_fidelity, bench_anneal, ...) only parse flags and print.

  runs.py            one run dir: metrics rows, its config, tokens per step from the logged batch
  sweep.py           a multirun dir as job rows (status, losses, rates), labelled by what varies
  sweep_report.py    a sweep's report.md / report.csv and figures
  layout_sweep.py    a sweep of dry runs: a row per layout (memory, fit, collectives, tokens/s)
  anneal.py          cooldown branches off a stable run: validation loss against tokens
  compare.py         where two runs part: the first differing step per metric
  scaling_law.py     L(N, D) = E + A/N^alpha + B/D^beta fits with bootstrap intervals (numbers only)
  isoflop.py         IsoFLOP minima: the compute-optimal size per FLOP budget (numbers only)
  scaling_report.py  a scaling ladder's runs sized, fitted, reported and drawn
  mixture_law.py     data mixing laws per source and the best mixture (numbers only)
  mixture_report.py  a mixture search's proxy runs fitted and reported
  mixture_plots.py   the mixture law's figure
  fidelity.py        a FLUX.1 run's held-out caption fidelity, its table and labelled grid
  figures.py         the one way a figure is drawn and saved (Agg, tight layout, close)
  flags.py           command-line flags the recipes share (--out, sweep dirs, --resamples/--level)
"""
