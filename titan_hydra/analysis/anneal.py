"""Anneal branches: cooldown jobs (``lr_scheduler=cooldown``) started from a stable run's checkpoints
(``experiment=anneal_branches``), read back as validation curves against tokens.

Each branch's curve starts at its branch point, where it leaves the stable run. The x axis is
tokens, counted from the runs' logged batches (``runs.tokens_of``): under a batch schedule a step
is not a fixed number of tokens, and a branch continues the stable run's count.
"""

from __future__ import annotations

from pathlib import Path

from titan_hydra.analysis import figures
from titan_hydra.analysis.runs import Tokens, job_config, read_metrics, read_yaml, tokens_of, val_curve


def job_dirs(sweep_dir: Path) -> list[Path]:
    """The numbered job dirs of a multirun dir, in order."""
    return sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))


def branch_base(run_dir: Path) -> Path | None:
    """The stable run a cooldown job branched off (its ``checkpoint.initial_load_path``'s run dir)."""
    raw = read_yaml(run_dir / ".hydra" / "config.yaml") or {}
    if (raw.get("lr_scheduler") or {}).get("name") != "cooldown":  # (read as written: cheap for other sweeps)
        return None
    path = job_config(run_dir).checkpoint.initial_load_path  # resolved (${th_cooldown_start:...})
    if not path:
        return None
    path = Path(path)
    if not path.is_absolute():  # relative to where the sweep was launched
        hydra = read_yaml(run_dir / ".hydra" / "hydra.yaml") or {}
        path = Path(((hydra.get("hydra") or {}).get("runtime") or {}).get("cwd") or ".") / path
    return path.parent.parent if path.name.startswith("step-") else path.parent


def branches(sweep_dir: Path) -> dict[int, tuple[Path, int]]:
    """{a branch's last validated step: (its job dir, its branch point)} over the sweep's cooldown
    jobs; the branch point is the step before the first it logged."""
    out = {}
    for run_dir in job_dirs(sweep_dir):
        curve = val_curve(run_dir)
        if curve and branch_base(run_dir) is not None:
            out[curve[-1][0]] = run_dir, min(int(r["step"]) for r in read_metrics(run_dir / "metrics.jsonl")) - 1
    return out


def anneal_curves(sweep_dir: Path) -> dict[int, list[tuple[int, float]]]:
    """{a branch's last step: its validation curve}, each starting at its branch point, where its
    value is None."""
    return {end: [(point, None), *val_curve(run_dir)] for end, (run_dir, point) in branches(sweep_dir).items()}


def branch_tokens(sweep_dir: Path, base: Tokens) -> dict[int, Tokens]:
    """{a branch's last step: its tokens, the stable run's up to its branch point}."""
    return {end: base.continued_by(tokens_of(run_dir), point) for end, (run_dir, point) in branches(sweep_dir).items()}


def plot_anneal(sweep_dir: Path, path: Path, extra: dict[str, tuple[list[tuple[int, float]], Tokens]] | None = None
                ) -> None:
    """Validation loss against tokens: the stable run, each branch from its branch point, and
    ``extra`` curves (other runs, with their own tokens, e.g. fully scheduled ones) dashed."""
    jobs = [p for p in job_dirs(sweep_dir) if branch_base(p)]
    if not jobs:
        return
    base = branch_base(jobs[0])
    base_curve = val_curve(base) if base.exists() else []
    base_tokens = tokens_of(base, config_dir=jobs[0])  # (a branch has the stable run's batch settings)
    tokens = branch_tokens(sweep_dir, base_tokens)
    fig, ax = figures.subplots(figsize=(7, 4.5))
    if base_curve:
        ax.plot([base_tokens.through(s) for s, _ in base_curve], [v for _, v in base_curve], "k-", label="stable run",
                lw=1.5)
    for i, (end, curve) in enumerate(sorted(anneal_curves(sweep_dir).items())):
        pts = [(s, v) for s, v in base_curve if s == curve[0][0]] + curve[1:]  # from the base's point there
        ax.plot([tokens[end].through(s) for s, _ in pts], [v for _, v in pts], "-o", color=f"C{i}", ms=3,
                label=f"cooldown to {end}")
    for i, (label, (curve, own)) in enumerate((extra or {}).items()):
        ax.plot([own.through(s) for s, _ in curve], [v for _, v in curve], "--", color=f"C{i}", alpha=0.6, label=label)
    ax.set_xlabel("tokens")
    ax.set_ylabel("validation loss")
    ax.set_title("Anneal branches off one stable run")
    ax.legend(fontsize=7)
    figures.save(fig, path, dpi=110)
