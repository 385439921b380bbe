#!/usr/bin/env python3
"""titan_hydra and torchtitan 0.3.0 side by side on one CUDA GPU, in one call of at most 8 minutes.

On a machine with one CUDA GPU, a CUDA torch and no network: installs the pinned wheels carried
beside the repository (``--wheels``), then trains the same ~1B Llama 3 (torchtitan's "1B", Llama
3.2 1B shapes) at seq 2048 with bf16 + compile, then float8 rowwise + compile, on both systems,
alternated (torchtitan's own ``run_train`` entry, ``torch.distributed.run`` + ``torchtitan.train``,
with its own configs in ``tt_gpu_configs.py``; titan_hydra's ``launch.py``), and prints tok/s,
MFU and peak memory of each side, their ratio and each side's settings as its log reports them,
writing one JSON.

    python3 scripts/gpu_side_by_side/run.py download --wheels .whl      # where there is network
    python3 scripts/gpu_side_by_side/run.py run --wheels .whl --json out/gpu_side_by_side.json
    python3 scripts/gpu_side_by_side/run.py run --cpu --tt-python /path/to/torchtitan/venv/bin/python
    python3 scripts/gpu_side_by_side/run.py run --dry-run               # the commands, nothing run

``--cpu`` is the rehearsal: every step but the GPU ones (wheel install when ``--wheels`` is given,
run-dir assets, both trainers through the same command builders, log parsing, table, JSON) on
torchtitan's debug model. Standard library only. The pieces the CPU harness already has (assets,
corpus, torchtitan's CPU shim and configs, log parsers) are imported from
scripts/torchtitan_side_by_side/. README.md beside this file says what each side runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from gpu_results import cpu, row_summary, run_summary, table  # noqa: E402  (beside this file)

PINS = {"torchtitan": HERE / "pins_torchtitan.txt", "titan_hydra": HERE / "pins_titan_hydra.txt"}
SDIST_ONLY = {"antlr4-python3-runtime"}  # no wheel published: `pip wheel` builds its pure-Python one
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64", "any"]
BF16, COMPILE = "training.mixed_precision=bf16", "compile=model_loss"
# torchtitan's "1B" is Llama 3.2 1B with Llama 3.1 RoPE scaling at factor 8 (titan_hydra's llama3_1b: 32)
TH_1B = ["model=llama3_1b", "model.rope_scaling_factor=8.0"]
TT_LR = cpu.TT_LR["llama3"]  # torchtitan's llama3 trainer config: AdamW 8e-4, 2 warmup steps


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    label: str
    tt_config: str  # function of tt_gpu_configs.py
    th_overrides: tuple[str, ...]


GPU_CASES = [
    Case("llama3_1b_bf16_compile", "Llama 3 1B, bf16 + compile", "llama3_1b_bf16_compile", (*TH_1B, BF16, COMPILE)),
    # float8: every block linear on both sides (torchtitan converts all; titan_hydra's small-K/N filter off)
    Case("llama3_1b_float8_compile", "Llama 3 1B, float8 rowwise + compile", "llama3_1b_float8_compile",
         (*TH_1B, BF16, COMPILE, "float8=rowwise", "float8.auto_filter_small_kn=false")),
]
CPU_CASES = [Case("llama3_debug_bf16_compile", "Llama 3 debug model, bf16 + compile (CPU rehearsal)",
                  "llama3_debug_bf16_compile_cpu", (*cpu.TH_SHAPES["llama3"], BF16, COMPILE))]


@dataclasses.dataclass(frozen=True)
class Settings:
    """What one invocation runs: the GPU defaults fit 8 minutes of one H100 (README.md: timing)."""

    gpu: bool = True
    seq_len: int = 2048
    batch: int = 4
    steps: int = 30
    skip: int = 10  # steps left out of the medians: compile, CUDA-graph capture, allocator warm-up
    rounds: int = 2
    budget_s: float = 420.0  # no pair starts unless the slowest pair so far still fits
    first_pair_s: float = 150.0  # the guess before any pair has run
    timeout_s: float = 240.0  # one run; never past budget_s + 60
    threads: int = 2  # CPU rehearsal only


def settings_of(args) -> Settings:
    base = Settings() if not args.cpu else Settings(gpu=False, seq_len=256, batch=2, steps=6, skip=3, rounds=1,
                                                     budget_s=3600.0, first_pair_s=0.0, timeout_s=1800.0)
    given = {k: getattr(args, k) for k in ("seq_len", "batch", "steps", "skip", "rounds", "budget_s", "timeout_s")
             if getattr(args, k) is not None}
    return dataclasses.replace(base, **given)


# ------------------------------------------------------------------------------ wheels


def read_pins(path: Path) -> list[str]:
    out = []
    for line in path.read_text().splitlines():
        req = line.split("#", 1)[0].strip()
        if req:
            out.append(req)
    return out


def download_commands(wheels: Path, python_version: str) -> list[list[str]]:
    """``pip download`` of every pin as the GPU machine's wheel (CPython ``python_version``,
    manylinux x86_64), no dependencies (the pins are the closure); sdist-only pins built by ``pip wheel``."""
    pins = sorted({p for f in PINS.values() for p in read_pins(f)})
    binary = [p for p in pins if p.split("==")[0] not in SDIST_ONLY]
    source = [p for p in pins if p.split("==")[0] in SDIST_ONLY]
    plat = [a for p in PLATFORMS for a in ("--platform", p)]
    cmds = [[sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
             python_version, "--implementation", "cp", *plat, "-d", str(wheels), *binary]]
    if source:
        cmds.append([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(wheels), *source])
    return cmds


def install_commands(python: str, wheels: Path, site: Path) -> dict[str, list[str]]:
    """Each side's pins into a folder of its own (their datasets pins differ), from the wheels only."""
    return {side: [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
                   "--find-links", str(wheels), "--target", str(site / side), "-r", str(pins)]
            for side, pins in PINS.items()}


# ------------------------------------------------------------------------------ commands


def tt_command(case: Case, s: Settings, python: str, site: Path | None, out_dir: Path) -> tuple[list[str], dict]:
    """torchtitan's own entry (what its run_train.sh runs), through the shim for the torch API it may miss."""
    argv = [python, "-m", "torch.distributed.run", "--nproc_per_node=1", "--rdzv_backend=c10d",
            "--rdzv_endpoint=localhost:0", "--local-ranks-filter=0", "--role=rank", "--tee=3",
            str(cpu.HERE / "tt_cpu_shim.py"), "--module", "tt_gpu_configs", "--config", case.tt_config,
            "--training.steps", str(s.steps), "--training.seq_len", str(s.seq_len),
            "--training.local_batch_size", str(s.batch), "--dump_folder", str(out_dir)]
    path = [str(site / "torchtitan")] if site else []
    env = {"PYTHONPATH": os.pathsep.join([*path, str(HERE), str(cpu.HERE)]), "TT_SHIM_VERBOSE": "1",
           "TT_SHIM_DEVICE": "cuda" if s.gpu else "cpu"}
    if not s.gpu:
        env["OMP_NUM_THREADS"] = str(s.threads)
    return argv, env


def th_command(case: Case, s: Settings, python: str, site: Path | None, assets: Path, run_dir: Path
               ) -> tuple[list[str], dict]:
    device = ["cluster=local_gpu", "cluster.nproc_per_node=1"] if s.gpu else [f"cluster.threads_per_proc={s.threads}"]
    argv = [python, str(REPO / "launch.py"), *case.th_overrides, *device,
            f"training.steps={s.steps}", f"training.seq_len={s.seq_len}", f"training.local_batch_size={s.batch}",
            f"training.global_batch_size={s.batch}", f"optimizer.lr={TT_LR}", "lr_scheduler.warmup_steps=2",
            "training.val_freq=0", "logger=minimal", "checkpoint=none",
            "data=json", f"data.path={assets / 'c4_test' / 'data.json'}",
            f"data.tokenizer={assets / 'tokenizer' / 'tokenizer.json'}", f"hydra.run.dir={run_dir}"]
    path = [str(site / "titan_hydra")] if site else []
    env = {"PYTHONPATH": os.pathsep.join([*path, str(REPO)])}
    if not s.gpu:
        env["OMP_NUM_THREADS"] = str(s.threads)
    return argv, env


def commands(case: Case, s: Settings, work: Path, tag: str, th_python: str, tt_python: str,
             site: Path | None) -> dict[str, tuple[list[str], dict, Path, Path]]:
    """{"torchtitan"|"titan_hydra": (argv, extra env, cwd, run dir)} of one round of one case."""
    run_root = work / "run"  # torchtitan reads ./tests/assets from here (cpu.prepare_run_dir)
    tt_dir, th_dir = work / case.name / f"{tag}_tt", work / case.name / f"{tag}_th"
    tt_argv, tt_env = tt_command(case, s, tt_python, site, tt_dir)
    th_argv, th_env = th_command(case, s, th_python, site, run_root / "tests" / "assets", th_dir)
    return {"torchtitan": (tt_argv, tt_env, run_root, tt_dir), "titan_hydra": (th_argv, th_env, REPO, th_dir)}


# ------------------------------------------------------------------------------ running


def run_one(system: str, argv: list[str], env_extra: dict, cwd: Path, run_dir: Path, timeout: float,
            skip: int) -> dict:
    log = run_dir.with_suffix(".log")
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **env_extra}
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=max(timeout, 1)).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    text = log.read_text(errors="replace")
    out = run_summary(system, text, run_dir, skip)
    out.update(rc=rc, wall_s=round(time.time() - t0, 1), log=str(log),
               command=" ".join(f"{k}={v}" for k, v in env_extra.items()) + " " + " ".join(argv))
    out["ok"] = rc == 0 and out["tps"] is not None
    if not out["ok"]:
        out["error"] = f"exit {rc}: {cpu.last_error(text)}" if rc != 0 else "no step rates"
    return out


def plan_pairs(cases: list[Case], rounds: int) -> list[tuple[int, Case]]:
    """Round by round, so a budget cut leaves every case with its first pair; the order of the two
    systems flips every pair."""
    return [(k, c) for k in range(1, rounds + 1) for c in cases]


def run_pairs(cases: list[Case], s: Settings, work: Path, th_python: str, tt_python: str, site: Path | None,
              start: float) -> tuple[dict[str, list[dict]], list[str]]:
    results: dict[str, list[dict]] = {c.name: [] for c in cases}
    skipped, slowest = [], s.first_pair_s
    for i, (k, case) in enumerate(plan_pairs(cases, s.rounds)):
        elapsed = time.time() - start
        if elapsed + slowest > s.budget_s:
            skipped.append(f"{case.name} round {k}: {elapsed:.0f} s + {slowest:.0f} s > budget {s.budget_s:.0f} s")
            continue
        cmds = commands(case, s, work, f"r{k}", th_python, tt_python, site)
        order = ["torchtitan", "titan_hydra"] if i % 2 == 0 else ["titan_hydra", "torchtitan"]
        t0, pair = time.time(), {"round": k, "order": order}
        for system in order:
            argv, env, cwd, run_dir = cmds[system]
            timeout = min(s.timeout_s, s.budget_s + 60 - (time.time() - start))
            pair[system] = res = run_one(system, argv, env, cwd, run_dir, timeout, s.skip)
            status = f"{res['tps']:,.0f} tok/s" if res["ok"] else f"FAILED ({res.get('error')})"
            print(f"[{case.name} round {k}] {system:11s} {status}  ({res['wall_s']} s, log {res['log']})", flush=True)
        slowest = max(slowest, time.time() - t0)
        results[case.name].append(pair)
    return results, skipped


# ------------------------------------------------------------------------------ main


def device_info(python: str, env_extra: dict | None = None) -> str:
    code = ("import torch; print(torch.__version__, '|', torch.cuda.get_device_name() if torch.cuda.is_available() "
            "else 'no CUDA device')")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, env={**os.environ, **(env_extra or {})})
    return proc.stdout.strip() or cpu.last_error(proc.stderr)


class StepFailed(RuntimeError):
    pass


def check(cmd: list[str]) -> None:
    print("$ " + " ".join(cmd), flush=True)
    if subprocess.run(cmd).returncode:
        raise StepFailed(f"failed: {' '.join(cmd[:6])} ... (its output is above)")


def parse_args(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("action", choices=["download", "run"], help="download: fetch the pinned wheels (network); "
                    "run: install them (with --wheels) and run the side by side")
    ap.add_argument("--wheels", type=Path, help="the wheel folder (download: written; run: installed from)")
    ap.add_argument("--python-version", default="3.12", help="download: the GPU machine's CPython (default 3.12)")
    ap.add_argument("--cpu", action="store_true", help="the CPU rehearsal: torchtitan's debug model, tiny steps")
    ap.add_argument("--only", nargs="+", help="case names (default: all of the mode)")
    ap.add_argument("--tt-python", default=None, help="torchtitan's python (default: this one on GPU; on CPU "
                    f"the CPU harness's venv, {cpu.DEFAULT_TT_VENV})")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR") or "/tmp") / "th_gpu_side_by_side")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    for flag, kind in (("--seq-len", int), ("--batch", int), ("--steps", int), ("--skip", int), ("--rounds", int),
                       ("--budget-s", float), ("--timeout-s", float)):
        ap.add_argument(flag, type=kind, default=None, help="override the mode's default (Settings)")
    return ap.parse_args(argv)


def install(args, python: str, site: Path) -> None:
    if not args.wheels:
        return
    for side, cmd in install_commands(python, args.wheels, site).items():
        shutil.rmtree(site / side, ignore_errors=True)
        check(cmd)


def main(argv: list[str] | None = None) -> int:
    start = time.time()
    args = parse_args(argv)
    if args.action == "download":
        wheels = args.wheels or REPO / ".whl"
        wheels.mkdir(parents=True, exist_ok=True)
        for cmd in download_commands(wheels, args.python_version):
            check(cmd)
        return 0
    s = settings_of(args)
    cases = [c for c in (GPU_CASES if s.gpu else CPU_CASES) if not args.only or c.name in args.only]
    work = args.work.resolve()
    th_python = sys.executable
    tt_python = args.tt_python or (sys.executable if s.gpu else str(cpu.DEFAULT_TT_VENV / "bin" / "python"))
    site = work / "site" if args.wheels else None
    if args.dry_run:
        for case in cases:
            for system, (argv_, env, cwd, _) in commands(case, s, work, "r1", th_python, tt_python, site).items():
                print(f"# {case.name} {system}\n(cd {cwd} && {' '.join(f'{k}={v}' for k, v in env.items())} "
                      f"{' '.join(argv_)})")
        return 0
    install(args, th_python, work / "site")
    data = cpu.prepare_run_dir(work)
    devices = {side: device_info(py) for side, py in (("titan_hydra", th_python), ("torchtitan", tt_python))}
    print(f"torch | device: {devices}\ndata: {data['data']} (sha256 {data['data_sha256']})", flush=True)
    results, skipped = run_pairs(cases, s, work, th_python, tt_python, site, start)
    rows = [row_summary(c.name, c.label, results[c.name]) for c in cases]
    print("\n" + table(rows) + "".join(f"\nskipped (budget): {x}" for x in skipped), flush=True)
    record = {"date": time.strftime("%Y-%m-%d %H:%M"), "mode": "gpu" if s.gpu else "cpu rehearsal",
              "devices": devices, "machine": platform.node(), "settings": dataclasses.asdict(s),
              "wall_s": round(time.time() - start, 1), "skipped": skipped, "data": data,
              "method": "pairs alternated (order flips every pair), round by round; per run the medians of the steps "
                        "after `skip`, peak memory the largest any step logged; a row is the median over rounds",
              "rows": rows, "runs": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"JSON: {args.json}")
    return 0 if rows and all(r["ratio"] is not None for r in rows) else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        sys.exit(main())
    except StepFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
