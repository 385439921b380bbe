"""The numbers of the GPU side by side: each run's log or metrics into per-step rows, a run into its
steady-state medians, a case's rounds into one row, and the table. Standard library only.

torchtitan prints one line per step (``step: 12  loss: ...  memory: 9.61GiB(12.1%)  tps: 41,230
tflops: 340.2  mfu: 34.4%``; ``mfu: N/A`` under float8, where it skips MFU); titan_hydra writes
``metrics.jsonl`` (``tps``, ``tflops``, ``mfu``; ``memory_reserved_gib`` on CUDA, the allocator's
reserved peak as torchtitan's ``memory``, else the process peak). Both count FLOPs per token
their own way, so each side's MFU is reported as it computes it, and next to it both sides'
TFLOP/s over one peak: the peak titan_hydra's own MFU implies (TFLOP/s / MFU).
"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import sys
from pathlib import Path

CPU_DIR = Path(__file__).resolve().parent.parent / "torchtitan_side_by_side"


def _load_cpu_harness():
    """scripts/torchtitan_side_by_side/run.py: its assets, log parsers and constants are reused here."""
    if "tt_side_by_side_run" in sys.modules:
        return sys.modules["tt_side_by_side_run"]
    spec = importlib.util.spec_from_file_location("tt_side_by_side_run", CPU_DIR / "run.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve the module by name
    spec.loader.exec_module(module)
    return module


cpu = _load_cpu_harness()
# the per-step numbers the CPU harness does not read: memory, TFLOP/s and MFU
TT_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+).*?memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)\s+"
                     r"tflops:\s*([\d,.]+)\s+mfu:\s*(N/A|[\d.]+%)")


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", "").rstrip("%"))
    except ValueError:
        return None


def tt_steps(text: str) -> list[dict]:
    rows = {}
    for m in TT_STEP.finditer(cpu.ANSI.sub("", text)):
        rows[int(m.group(1))] = {"step": int(m.group(1)), "loss": _num(m.group(2)), "memory_gib": _num(m.group(3)),
                                 "tps": _num(m.group(4)), "tflops": _num(m.group(5)), "mfu": _num(m.group(6))}
    return [rows[k] for k in sorted(rows)]


def th_steps(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "tps" in r and "loss" in r:
            rows.append({"step": int(r["step"]), "loss": r["loss"], "tps": r["tps"], "tflops": r.get("tflops"),
                         "mfu": r.get("mfu"), "memory_gib": r.get("memory_reserved_gib", r.get("memory_peak_gib"))})
    return rows


def tt_settings(text: str) -> dict:
    """What torchtitan's own log says it ran (the CPU harness's parser, plus its float8 line)."""
    p = cpu.parse_tt_log(text)
    lines = cpu.ANSI.sub("", text).splitlines()
    float8 = next((ln.split(" - ")[-1].strip() for ln in lines if "float8" in ln.lower()), "none")
    return {"params": p["params"], "precision": p["precision"], "activation_checkpoint": p["ac"],
            "compile": p["compile"], "mesh": p["mesh"], "float8": float8[:160]}


def th_settings(text: str, run_dir: Path) -> dict:
    """The header titan_hydra prints before its first step (the CPU harness's parser)."""
    p = cpu.parse_th(text, run_dir)
    return {k: p[k] for k in ("params", "precision", "features", "attention")}


def _median(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def run_summary(system: str, text: str, run_dir: Path, skip: int) -> dict:
    """Steady state of one run: medians of the steps after ``skip``, the largest memory of any step."""
    steps = tt_steps(text) if system == "torchtitan" else th_steps(run_dir)
    later = [r for r in steps if r["step"] > skip]
    memory = [r["memory_gib"] for r in steps if r.get("memory_gib") is not None]
    return {"steps": steps, "tps": _median(later, "tps"), "tflops": _median(later, "tflops"),
            "mfu": _median(later, "mfu"), "memory_gib": max(memory) if memory else None,
            "settings": tt_settings(text) if system == "torchtitan" else th_settings(text, run_dir)}


def row_summary(name: str, label: str, pairs: list[dict]) -> dict:
    """One case over its rounds: each side's medians, titan_hydra / torchtitan tok/s, both MFUs."""
    ok = [p for p in pairs if p["torchtitan"]["ok"] and p["titan_hydra"]["ok"]]
    row = {"case": name, "label": label, "rounds": len(pairs), "rounds_ok": len(ok)}
    for side in ("torchtitan", "titan_hydra"):
        runs = [p[side] for p in pairs if p[side]["ok"]]
        row[side] = {key: _median(runs, key) for key in ("tps", "tflops", "mfu", "memory_gib")}
        row[side]["settings"] = next((r["settings"] for r in runs), pairs[0][side]["settings"] if pairs else {})
    ratios = [p["titan_hydra"]["tps"] / p["torchtitan"]["tps"] for p in ok]
    row["ratio"] = round(statistics.median(ratios), 3) if ratios else None
    row["ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None
    th = row["titan_hydra"]
    peak = th["tflops"] / th["mfu"] * 100 if th["tflops"] and th["mfu"] else None
    row["bf16_peak_tflops"] = round(peak, 1) if peak else None
    for side in ("torchtitan", "titan_hydra"):
        t = row[side]["tflops"]
        row[side]["mfu_at_bf16_peak"] = round(100 * t / peak, 2) if peak and t is not None else None
    row["errors"] = [f"round {p['round']} {side}: {p[side].get('error')}" for p in pairs
                     for side in ("torchtitan", "titan_hydra") if not p[side]["ok"]]
    return row


def _f(x, fmt: str = ",.0f") -> str:
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    lines = ["| case | torchtitan tok/s | titan_hydra tok/s | ratio | MFU tt / th (own) | MFU tt / th (one peak) "
             "| peak memory GiB tt / th | rounds |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tt, th = r["torchtitan"], r["titan_hydra"]
        rng = f" ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})" if r["ratio_range"] else ""
        ratio = f"**{r['ratio']:.2f}**{rng}" if r["ratio"] is not None else "failed"
        lines.append(f"| {r['label']} | {_f(tt['tps'])} | {_f(th['tps'])} | {ratio} | {_f(tt['mfu'], '.1f')} / "
                     f"{_f(th['mfu'], '.1f')} | {_f(tt['mfu_at_bf16_peak'], '.1f')} / {_f(th['mfu_at_bf16_peak'], '.1f')} "
                     f"| {_f(tt['memory_gib'], '.2f')} / {_f(th['memory_gib'], '.2f')} | {r['rounds_ok']}/{r['rounds']} |")
    lines += ["", "What each side reports it ran:", ""]
    for r in rows:
        for side in ("torchtitan", "titan_hydra"):
            settings = "; ".join(f"{k} {v}" for k, v in r[side]["settings"].items() if v is not None)
            lines.append(f"- {r['label']}, {side}: {settings}")
        lines += [f"- {r['label']}: FAILED {e}" for e in r["errors"]]
    return "\n".join(lines)
