#!/usr/bin/env python3
"""titan_hydra side by side with torchtitan 0.3.0 on CPU, on torchtitan's own debug models.

For each comparison the two systems alternate (torchtitan, titan_hydra; the order flips every
round) for ``--rounds`` rounds on the same tokenizer, the same JSON-lines text, the same
sequence length, batch and step count. Each run's tok/s is the median of its per-step rates after
the first 2 steps (3 when compiled); a row reports the median over rounds and the range of the
ratio. Parameter counts and precision come from each system's own log.

    python3 scripts/torchtitan_side_by_side/run.py                      # everything, 3 rounds
    python3 scripts/torchtitan_side_by_side/run.py --only qwen3_moe_eager_bf16 --rounds 1 --steps 5
    python3 scripts/torchtitan_side_by_side/run.py --dry-run            # print the commands

Standard library only: it runs under any python3. torchtitan runs in its own venv
(``--tt-venv``, created when missing) through ``tt_cpu_shim.py``; titan_hydra through this
repository's ``launch.py`` with ``.venv/bin/python``. See README.md next to this file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TOKENIZER_SRC = REPO / "tests" / "data" / "torchtitan_test_tokenizer"
DEFAULT_TT_VENV = Path(os.environ.get("TMPDIR") or "/tmp") / "th_tt" / "venv"
DEFAULT_WORK = Path(os.environ.get("TMPDIR") or "/tmp") / "th_tt" / "side_by_side"
TT_VENV_CREATE = "{py} -m venv {v} && {v}/bin/pip install torch==2.13.0 torchtitan==0.3.0 triton"

# ------------------------------------------------------------------------------ the comparisons

# titan_hydra overrides that give torchtitan's debug shapes and routing (read from torchtitan
# 0.3.0's models/qwen3 ``_debugmodel_moe`` and models/deepseek_v3 ``_debugmodel``).
TH_SHAPES: dict[str, list[str]] = {
    "qwen3_moe": [
        "model=qwen3_moe_debug",
        "model.n_layers=8", "model.n_heads=16", "model.n_kv_heads=8", "model.head_dim=128",
        "model.max_seq_len=4096", "model.rope_theta=1000000.0", "model.norm_eps=1e-6",
        "model.tie_word_embeddings=false", "model.n_dense_layers=0",
        "model.moe.num_experts=64", "model.moe.top_k=8", "model.moe.expert_dim=768",
        "model.moe.num_shared_experts=0", "model.moe.score_func=softmax", "model.moe.route_norm=true",
        "model.moe.route_scale=1.0", "model.moe.num_expert_groups=1", "model.moe.num_limited_groups=1",
        # torchtitan's MoE default: the aux-loss-free expert bias at rate 1e-3, no auxiliary loss
        "model.moe.load_balance_coeff=0.001", "model.moe.aux_loss_coeff=0.0",
    ],
    "deepseek_v3": [
        "model=deepseek_v3_debug",
        "model.n_layers=6", "model.n_heads=16", "model.n_dense_layers=1", "model.ffn_hidden_dim=1024",
        "model.q_lora_rank=0", "model.kv_lora_rank=512", "model.qk_nope_head_dim=128",
        "model.qk_rope_head_dim=64", "model.v_head_dim=128", "model.norm_eps=1e-5",
        "model.max_seq_len=16384", "model.rope_type=yarn", "model.rope_theta=10000.0",
        "model.rope_factor=40.0", "model.rope_original_max_seq_len=4096", "model.beta_fast=32.0",
        "model.beta_slow=1.0", "model.mscale=0.7", "model.mscale_all_dim=0.7",
        "model.tie_word_embeddings=false",
        "model.moe.num_experts=8", "model.moe.top_k=3", "model.moe.expert_dim=256",
        "model.moe.num_shared_experts=2", "model.moe.score_func=softmax", "model.moe.route_norm=false",
        "model.moe.route_scale=1.0", "model.moe.num_expert_groups=1", "model.moe.num_limited_groups=1",
        "model.moe.load_balance_coeff=0.001", "model.moe.aux_loss_coeff=0.0",
    ],
    # llama3_debug has torchtitan's llama3 debugmodel shapes; torchtitan also scales RoPE (Llama 3.1)
    "llama3": ["model=llama3_debug", "model.rope_scaling=true", "model.rope_scaling_factor=8.0"],
}

# What differs and no override removes, (rows, what); README.md has the details.
COMMON_DIFFERENCES = [
    ("all rows", "RoPE positions restart per document in torchtitan (its attention still spans documents), "
                 "0..L-1 in titan_hydra"),
    ("all rows", "torchtitan's loss runs in 8 sequence chunks, titan_hydra's on the full logits"),
    ("selective-AC rows", "torchtitan's SelectiveAC recomputes the CPU attention op and grouped GEMMs (not in its "
                          "save list); titan_hydra's selective_op saves attention"),
    ("deepseek rows", "torchtitan's SDPA takes the math path (q/k 192 vs v 128 wide); titan_hydra pads v to 192 "
                      "for the flash kernel"),
    ("MoE bf16 rows", "router gate and softmax in bf16 in torchtitan on CPU (its fp32 autocast is refused), "
                      "fp32 in titan_hydra"),
]

# torchtitan's optimizer settings for each debug config (lr; both warm up 2 steps)
TT_LR = {"qwen3_moe": 3e-4, "deepseek_v3": 8e-4, "llama3": 8e-4}
# torchtitan's selective AC (saves attention and every second matmul), as titan_hydra names it
TH_SELECTIVE_AC = ["activation_checkpoint=selective_op", "activation_checkpoint.selective_op_policy=every_second_mm"]


@dataclasses.dataclass(frozen=True)
class Comparison:
    name: str
    label: str
    family: str  # key of TH_SHAPES
    tt_config: str  # function of tt_cpu_configs.py
    th_overrides: tuple[str, ...]  # what this comparison sets beyond shapes, data, steps, batch
    nproc: int = 1
    compiled: bool = False
    batch: int = 4  # local batch per rank (torchtitan's debug config's)
    seq_len: int | None = None  # None: --seq-len
    precision: str = "bf16"
    note: str = ""  # what could not be matched, printed under the table


def _cmp(name, label, family, tt_config, th, **kw) -> Comparison:
    return Comparison(name, label, family, tt_config, tuple(th), **kw)


BF16, FP32 = "training.mixed_precision=bf16", "training.mixed_precision=fp32"
LLAMA_AUTO_NOTE = ("titan_hydra's precision and attention kernel are its auto choices on this CPU (the run header "
                   "says which); torchtitan computes in bf16 (FSDP's mixed-precision policy, even on one rank)")
# ``--isa-cap avx2``: both sides as on a CPU without AVX-512 (oneDNN then has no bf16 dot products, so
# titan_hydra's auto precision resolves to fp32). Inductor's cache does not key on the ATen capability:
# capped runs get a cache of their own, or code built for the other width corrupts memory.
ISA_CAPS = {"avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}


def isa_cap_env(cap: str | None, work: Path) -> dict[str, str]:
    """The environment both sides run under for ``--isa-cap`` (empty without one)."""
    if cap is None:
        return {}
    return {**ISA_CAPS[cap], "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor_{cap}")}
EP2 = ["parallelism=ep", "cluster.nproc_per_node=2"]
TT_EP_NOTE = "torchtitan with spmd_backend=partial_dtensor (its default spmd_types fails at FSDP setup on 2 ranks)"
COMPARISONS: dict[str, Comparison] = {c.name: c for c in [
    _cmp("qwen3_moe_eager_bf16", "qwen3_moe eager bf16", "qwen3_moe", "qwen3_moe_debug_sdpa",
         [BF16, *TH_SELECTIVE_AC]),
    _cmp("qwen3_moe_compile_bf16", "qwen3_moe compiled bf16", "qwen3_moe", "qwen3_moe_debug_sdpa_compile",
         [BF16, *TH_SELECTIVE_AC, "compile=model_loss"], compiled=True),
    _cmp("qwen3_moe_eager_fp32", "qwen3_moe eager fp32", "qwen3_moe", "qwen3_moe_debug_sdpa_fp32",
         [FP32, *TH_SELECTIVE_AC], precision="fp32",
         note="torchtitan's routed experts still compute in bf16 (its grouped GEMM casts to bf16 in any precision)"),
    _cmp("qwen3_moe_ep2_eager", "qwen3_moe ep2 eager bf16", "qwen3_moe", "qwen3_moe_debug_sdpa_ep2",
         [BF16, *TH_SELECTIVE_AC, *EP2], nproc=2, note=TT_EP_NOTE),
    # no AC on either side: torchtitan compiled + checkpointed under EP fails in torch 2.13 (README)
    _cmp("qwen3_moe_ep2_compile", "qwen3_moe ep2 compiled bf16, no AC", "qwen3_moe", "qwen3_moe_debug_sdpa_ep2_compile",
         [BF16, "activation_checkpoint=none", *EP2, "compile=model_loss"], nproc=2, compiled=True,
         note="no activation checkpointing on either side: torchtitan compiled with selective or full AC under "
              "EP fails in torch 2.13 ('expected all tensors_saved_with_vc_check to be Tensors'); " + TT_EP_NOTE),
    _cmp("deepseek_v3_eager_bf16", "deepseek_v3 eager bf16", "deepseek_v3", "deepseek_v3_debugmodel_sdpa",
         [BF16, *TH_SELECTIVE_AC], batch=8),
    _cmp("deepseek_v3_compile_bf16", "deepseek_v3 compiled bf16", "deepseek_v3", "deepseek_v3_debugmodel_sdpa_compile",
         [BF16, *TH_SELECTIVE_AC, "compile=model_loss"], batch=8, compiled=True),
    _cmp("deepseek_v3_ep2_eager", "deepseek_v3 ep2 eager bf16", "deepseek_v3", "deepseek_v3_debugmodel_sdpa_ep2",
         [BF16, *TH_SELECTIVE_AC, *EP2], batch=8, nproc=2, note=TT_EP_NOTE),
    # the dense model of the earlier side-by-side: both systems' defaults (titan_hydra: no AC), bf16
    _cmp("llama3_eager_bf16", "llama3 dense eager bf16", "llama3", "llama3_debugmodel_sdpa",
         [BF16], batch=8, seq_len=2048,
         note="both systems' defaults otherwise: torchtitan selective AC, titan_hydra none (as the earlier measurement)"),
    # each system at its defaults: titan_hydra's training.mixed_precision=auto and attention_kernel=auto
    # resolve per CPU (bf16 where matmuls are native, else fp32), torchtitan computes in bf16
    _cmp("llama3_defaults", "llama3 dense, both defaults", "llama3", "llama3_debugmodel_sdpa",
         [], batch=8, seq_len=2048, precision="auto", note=LLAMA_AUTO_NOTE),
    _cmp("llama3_compile", "llama3 dense compiled, precision as each defaults", "llama3",
         "llama3_debugmodel_sdpa_compile", ["compile=model_loss"], batch=8, seq_len=2048, compiled=True,
         precision="auto", note=LLAMA_AUTO_NOTE),
    _cmp("llama3_eager_fp32", "llama3 dense eager fp32", "llama3", "llama3_debugmodel_sdpa_fp32",
         [FP32], batch=8, seq_len=2048, precision="fp32"),
    # best against best where bf16 is emulated (AVX2 only): both compiled in fp32
    _cmp("llama3_compile_fp32", "llama3 dense compiled fp32", "llama3", "llama3_debugmodel_sdpa_fp32_compile",
         [FP32, "compile=model_loss"], batch=8, seq_len=2048, compiled=True, precision="fp32"),
]}


def seq_len_of(c: Comparison, seq_len: int) -> int:
    return c.seq_len if c.seq_len is not None else seq_len


def threads_of(c: Comparison, threads: int) -> int:
    return 1 if c.nproc > 1 else threads


def skip_steps(c: Comparison) -> int:
    return 3 if c.compiled else 2


# ------------------------------------------------------------------------------ command builders


def tt_command(c: Comparison, *, steps: int, seq_len: int, threads: int, tt_venv: Path, out_dir: Path
               ) -> tuple[list[str], dict[str, str]]:
    """(argv, extra env) of one torchtitan run; runs with cwd = the prepared run dir."""
    argv = [str(tt_venv / "bin" / "python"), "-m", "torch.distributed.run",
            f"--nproc_per_node={c.nproc}", "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0",
            "--local-ranks-filter=0", "--role=rank", "--tee=3",
            str(HERE / "tt_cpu_shim.py"), "--module", "tt_cpu_configs", "--config", c.tt_config,
            "--training.steps", str(steps), "--training.seq_len", str(seq_len_of(c, seq_len)),
            "--training.local_batch_size", str(c.batch), "--dump_folder", str(out_dir)]
    env = {"OMP_NUM_THREADS": str(threads_of(c, threads)), "TT_SHIM_VERBOSE": "1",
           "PYTHONPATH": str(HERE)}
    return argv, env


def th_command(c: Comparison, *, steps: int, seq_len: int, threads: int, data_path: Path,
               tokenizer: Path, run_dir: Path, python: Path | None = None) -> tuple[list[str], dict[str, str]]:
    """(argv, extra env) of one titan_hydra run; runs with cwd = the repository."""
    python = python or REPO / ".venv" / "bin" / "python"
    t = threads_of(c, threads)
    argv = [str(python), str(REPO / "launch.py"), *TH_SHAPES[c.family], *c.th_overrides,
            f"training.steps={steps}", f"training.seq_len={seq_len_of(c, seq_len)}",
            f"training.local_batch_size={c.batch}", f"training.global_batch_size={c.batch * c.nproc}",
            f"optimizer.lr={TT_LR[c.family]}", "lr_scheduler.warmup_steps=2",
            "training.val_freq=0", "logger.tensorboard=null", "logger.wandb=null",
            f"cluster.threads_per_proc={t}",
            "data=json", f"data.path={data_path}", f"data.tokenizer={tokenizer}",
            f"hydra.run.dir={run_dir}"]
    return argv, {"OMP_NUM_THREADS": str(t)}


def commands(c: Comparison, *, steps: int, seq_len: int, threads: int, tt_venv: Path, work: Path,
             tag: str = "r1", isa_cap: str | None = None) -> dict[str, tuple[list[str], dict[str, str], Path]]:
    """Both runs of one comparison: {"torchtitan"|"titan_hydra": (argv, extra env, cwd)}."""
    run_root = work / "run"
    assets = run_root / "tests" / "assets"
    base = work / c.name
    tt_argv, tt_env = tt_command(c, steps=steps, seq_len=seq_len, threads=threads, tt_venv=tt_venv,
                                 out_dir=base / f"{tag}_tt")
    th_argv, th_env = th_command(c, steps=steps, seq_len=seq_len, threads=threads,
                                 data_path=assets / "c4_test" / "data.json",
                                 tokenizer=assets / "tokenizer" / "tokenizer.json", run_dir=base / f"{tag}_th")
    cap = isa_cap_env(isa_cap, work)
    return {"torchtitan": (tt_argv, {**tt_env, **cap}, run_root), "titan_hydra": (th_argv, {**th_env, **cap}, REPO)}


# ------------------------------------------------------------------------------ setup


def ensure_tt_venv(venv: Path) -> None:
    if (venv / "bin" / "python").exists():
        return
    cmd = TT_VENV_CREATE.format(py=sys.executable, v=venv)
    print(f"creating torchtitan's venv: {cmd}", flush=True)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(cmd, shell=True, check=True)


def corpus_lines(min_chars: int = 1_500_000) -> list[str]:
    """Deterministic English-like text: docstrings of standard-library modules and their public
    members, in sorted order (repeated until ``min_chars``). Depends only on the Python version."""
    import importlib
    import inspect
    import warnings

    modules = ["abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "calendar", "cmath",
               "collections", "concurrent.futures", "configparser", "contextlib", "copy", "csv",
               "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions",
               "functools", "gettext", "glob", "gzip", "hashlib", "heapq", "hmac", "html", "http.client",
               "inspect", "io", "ipaddress", "itertools", "json", "logging", "math", "mimetypes",
               "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re", "sched",
               "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "struct",
               "subprocess", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit",
               "tokenize", "traceback", "types", "typing", "unittest", "urllib.parse", "uuid",
               "warnings", "weakref", "zipfile", "zlib"]
    docs: list[str] = []
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in modules:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            objs = [mod] + [getattr(mod, a) for a in sorted(dir(mod)) if not a.startswith("_")]
            for obj in objs:
                try:
                    doc = inspect.getdoc(obj)
                except Exception:
                    doc = None
                if doc and len(doc) > 80 and doc not in seen:
                    seen.add(doc)
                    docs.append(doc)
    out, total = [], 0
    while total < min_chars and docs:
        for d in docs:
            out.append(d)
            total += len(d)
            if total >= min_chars:
                break
    return out


def prepare_run_dir(work: Path) -> dict[str, str]:
    """torchtitan's expected assets under work/run/tests/assets (shared by both systems)."""
    assets = work / "run" / "tests" / "assets"
    tok = assets / "tokenizer"
    tok.mkdir(parents=True, exist_ok=True)
    for f in TOKENIZER_SRC.iterdir():
        shutil.copy2(f, tok / f.name)
    data = assets / "c4_test" / "data.json"
    data.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps({"text": d}) + "\n" for d in corpus_lines())
    if not data.exists() or data.read_text() != text:
        data.write_text(text)
    return {"data": str(data), "data_sha256": hashlib.sha256(text.encode()).hexdigest()[:16],
            "data_documents": text.count("\n"), "data_chars": len(text), "tokenizer": str(tok / "tokenizer.json"),
            "corpus_python": platform.python_version()}


# ------------------------------------------------------------------------------ log parsing

ANSI = re.compile(r"\x1b\[[0-9;]*m")
TT_STEP = re.compile(r"step:\s*(\d+)\s+loss:\s*(\S+).*?tps:\s*([\d,]+)")
TT_PARAMS = re.compile(r"size:\s*([\d,]+) total parameters")
TT_MP = re.compile(r"tt_cpu_shim: FSDP mixed precision: param_dtype=(\w+) reduce_dtype=(\w+)")
TH_PARAMS = re.compile(r"^\s*model\s+.*?:\s*([\d,]+) parameters(.*)$", re.M)
TH_PRECISION = re.compile(r"^\s*precision\s+(.*)$", re.M)
TH_FEATURES = re.compile(r"^\s*features\s+(.*)$", re.M)
TH_ATTENTION = re.compile(r"^\s*attention\s+(.*)$", re.M)


def _num(s: str) -> float:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return float("nan")


def median_tps(steps: list[dict], skip: int) -> float | None:
    rates = [r["tps"] for r in steps if r["step"] > skip and r.get("tps") is not None]
    return statistics.median(rates) if rates else None


def parse_tt_log(text: str) -> dict:
    text = ANSI.sub("", text)
    steps = {}
    for m in TT_STEP.finditer(text):
        steps[int(m.group(1))] = {"step": int(m.group(1)), "loss": _num(m.group(2)), "tps": _num(m.group(3))}
    p = TT_PARAMS.search(text)
    mp = TT_MP.search(text)
    return {
        "steps": [steps[k] for k in sorted(steps)],
        "params": int(p.group(1).replace(",", "")) if p else None,
        "precision": (f"params/compute {mp.group(1)}, grad reduce {mp.group(2)} (FSDP mixed-precision policy)"
                      if mp else None),
        "ac": ("selective (op-level)" if "Applied SelectiveAC" in text else "full" if "Applied FullAC" in text
               else "none"),
        "compile": ", ".join(x for x, key in (("blocks", "Compiling each TransformerBlock"),
                                              ("loss", "Compiling the loss function")) if key in text) or "none",
        "mesh": (re.search(r"Building device mesh with parallelism: (.*)", text) or [None, None])[1],
    }


def parse_th(log: str, run_dir: Path) -> dict:
    steps = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "step" in row and "tps" in row and "loss" in row:
                steps.append({"step": int(row["step"]), "loss": float(row["loss"]), "tps": float(row["tps"])})
    p = TH_PARAMS.search(log)
    prec, feat, att = TH_PRECISION.search(log), TH_FEATURES.search(log), TH_ATTENTION.search(log)
    return {
        "steps": steps,
        "params": int(p.group(1).replace(",", "")) if p else None,
        "precision": prec.group(1).strip() if prec else None,
        "features": feat.group(1).strip() if feat else None,
        "attention": att.group(1).strip() if att else None,
    }


def last_error(text: str) -> str:
    lines = [ln.strip() for ln in ANSI.sub("", text).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|error:|Exception|Traceback|Killed|FAILED)", ln) and "warn" not in ln.lower():
            return ln[:300]
    return lines[-1][:300] if lines else "(no output)"


# ------------------------------------------------------------------------------ running


def run_one(system: str, c: Comparison, argv: list[str], env_extra: dict[str, str], cwd: Path, log: Path,
            run_dir: Path, timeout: int) -> dict:
    log.parent.mkdir(parents=True, exist_ok=True)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    env = {**os.environ, **env_extra}
    if system == "titan_hydra":
        env.pop("PYTHONPATH", None)
    t0 = time.time()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(argv, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = time.time() - t0
    text = log.read_text(errors="replace")
    parsed = parse_tt_log(text) if system == "torchtitan" else parse_th(text, run_dir)
    tps = median_tps(parsed["steps"], skip_steps(c))
    losses = [s["loss"] for s in parsed["steps"]]
    ok = rc == 0 and tps is not None and all(l == l and abs(l) != float("inf") for l in losses)
    out = {"ok": ok, "rc": rc, "wall_s": round(wall, 1), "tps": tps, "log": str(log), **parsed}
    if not ok:
        out["error"] = f"exit {rc}: {last_error(text)}" if rc != 0 else "no step rates / non-finite loss"
    return out


def summarize(c: Comparison, rounds: list[dict], seq_len: int, threads: int) -> dict:
    tt = [r["torchtitan"]["tps"] for r in rounds if r["torchtitan"]["ok"]]
    th = [r["titan_hydra"]["tps"] for r in rounds if r["titan_hydra"]["ok"]]
    ratios = [r["titan_hydra"]["tps"] / r["torchtitan"]["tps"] for r in rounds
              if r["torchtitan"]["ok"] and r["titan_hydra"]["ok"]]
    first = rounds[0]
    tt_params, th_params = first["torchtitan"].get("params"), first["titan_hydra"].get("params")
    warnings = []
    if tt_params and th_params and abs(tt_params - th_params) / tt_params > 0.01:
        warnings.append(f"{c.name}: PARAMETER COUNTS DIFFER: torchtitan {tt_params:,} vs titan_hydra {th_params:,}")
    for r in rounds:
        for system in ("torchtitan", "titan_hydra"):
            if not r[system]["ok"]:
                warnings.append(f"{c.name} round {r['round']}: {system} failed: {r[system].get('error')}")
    return {
        "comparison": c.name, "label": c.label, "torchtitan_config": c.tt_config,
        "titan_hydra_overrides": " ".join(c.th_overrides), "titan_hydra_shape_overrides": TH_SHAPES[c.family],
        "ranks_x_threads": f"{c.nproc}x{threads_of(c, threads)}", "seq_len": seq_len_of(c, seq_len),
        "local_batch": c.batch, "tps_skip_steps": skip_steps(c),
        "torchtitan_tps": statistics.median(tt) if tt else None,
        "titan_hydra_tps": statistics.median(th) if th else None,
        "ratio": round(statistics.median(ratios), 3) if ratios else None,
        "ratio_range": [round(min(ratios), 3), round(max(ratios), 3)] if ratios else None,
        "torchtitan_params": tt_params, "titan_hydra_params": th_params,
        "torchtitan_precision": first["torchtitan"].get("precision"),
        "titan_hydra_precision": first["titan_hydra"].get("precision"),
        "torchtitan_ac": first["torchtitan"].get("ac"), "torchtitan_compile": first["torchtitan"].get("compile"),
        "titan_hydra_features": first["titan_hydra"].get("features"),
        "titan_hydra_attention": first["titan_hydra"].get("attention"),
        "note": c.note, "warnings": warnings, "rounds": rounds,
    }


def _fmt(x, digits=0):
    return "-" if x is None else f"{x:,.{digits}f}"


def print_tables(rows: list[dict]) -> None:
    print("\n| comparison | torchtitan config | titan_hydra overrides | torchtitan tok/s | titan_hydra tok/s | ratio |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        rng = f" ({r['ratio_range'][0]:.2f}-{r['ratio_range'][1]:.2f})" if r["ratio_range"] else ""
        ratio = f"**{r['ratio']:.2f}**{rng}" if r["ratio"] is not None else "failed"
        print(f"| {r['label']} | `{r['torchtitan_config']}` | `{r['titan_hydra_overrides']}` | "
              f"{_fmt(r['torchtitan_tps'])} | {_fmt(r['titan_hydra_tps'])} | {ratio} |")
    print("\nWhat each side ran (from its own log):\n")
    print("| comparison | ranks x threads | seq x batch/rank | params torchtitan / titan_hydra | "
          "torchtitan precision, AC, compile | titan_hydra precision | titan_hydra features | loss first -> last (tt / th, round 1) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        first = r["rounds"][0]

        def loss(system):
            s = first[system]["steps"]
            return f"{s[0]['loss']:.3f} -> {s[-1]['loss']:.3f}" if s else "-"

        print(f"| {r['label']} | {r['ranks_x_threads']} | {r['seq_len']} x {r['local_batch']} | "
              f"{_fmt(r['torchtitan_params'])} / {_fmt(r['titan_hydra_params'])} | "
              f"{r['torchtitan_precision'] or '?'}; AC {r['torchtitan_ac']}; compile {r['torchtitan_compile']} | "
              f"{r['titan_hydra_precision'] or '?'} | {r['titan_hydra_features'] or '?'} | "
              f"{loss('torchtitan')} / {loss('titan_hydra')} |")
    notes = [f"- {r['label']}: {r['note']}" for r in rows if r["note"]]
    notes += [f"- {rows_}: {what}" for rows_, what in COMMON_DIFFERENCES]
    print("\nWhat could not be matched:\n" + "\n".join(notes))
    print("\ntitan_hydra shape overrides (torchtitan's debug shapes):")
    for family in dict.fromkeys(COMPARISONS[r["comparison"]].family for r in rows):
        print(f"  {family}: {' '.join(TH_SHAPES[family])}")
    warnings = [w for r in rows for w in r["warnings"]]
    if warnings:
        print("\n" + "!" * 80)
        for w in warnings:
            print(f"WARNING: {w}")
        print("!" * 80)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=sorted(COMPARISONS), metavar="NAME",
                    help="comparisons to run (default: all): " + ", ".join(COMPARISONS))
    ap.add_argument("--rounds", type=int, default=3, help="alternated rounds per comparison (default 3)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per run (default 10)")
    ap.add_argument("--seq-len", type=int, default=512,
                    help="sequence length of the MoE comparisons, both systems (default 512; llama3 keeps 2048)")
    ap.add_argument("--threads", type=int, default=2, help="threads per process (ep2 runs use 1 per rank)")
    ap.add_argument("--tt-venv", type=Path, default=DEFAULT_TT_VENV, help=f"torchtitan's venv (default {DEFAULT_TT_VENV})")
    ap.add_argument("--work", type=Path, default=DEFAULT_WORK, help=f"run dirs and logs (default {DEFAULT_WORK})")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per run before it counts as failed")
    ap.add_argument("--isa-cap", choices=sorted(ISA_CAPS), help="run both sides as on a CPU with only this "
                    "instruction set (oneDNN and ATen capped; a separate inductor cache)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return ap.parse_args(argv)


def print_commands(args: argparse.Namespace, names: list[str], work: Path) -> None:
    """--dry-run: each comparison's two commands, as a shell would run them."""
    for name in names:
        c = COMPARISONS[name]
        print(f"# {name}: {c.label}")
        for system, (cmd, env, cwd) in commands(c, steps=args.steps, seq_len=args.seq_len, threads=args.threads,
                                                tt_venv=args.tt_venv, work=work,
                                                isa_cap=args.isa_cap).items():
            envs = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"(cd {cwd} && {envs} {' '.join(cmd)})")
        print()


def run_rounds(name: str, args: argparse.Namespace, work: Path) -> list[dict]:
    """A comparison's rounds, the two systems alternating which goes first."""
    c = COMPARISONS[name]
    rounds = []
    for k in range(1, args.rounds + 1):
        cmds = commands(c, steps=args.steps, seq_len=args.seq_len, threads=args.threads,
                        tt_venv=args.tt_venv, work=work, tag=f"r{k}",
                        isa_cap=args.isa_cap)
        order = ["torchtitan", "titan_hydra"] if k % 2 else ["titan_hydra", "torchtitan"]
        result = {"round": k}
        for system in order:
            cmd, env, cwd = cmds[system]
            short = "tt" if system == "torchtitan" else "th"
            run_dir = work / name / f"r{k}_{short}"
            res = run_one(system, c, cmd, env, cwd, work / name / f"r{k}_{short}.log", run_dir, args.timeout)
            res["command"] = " ".join(f"{a}={b}" for a, b in env.items()) + " " + " ".join(cmd)
            result[system] = res
            status = f"{_fmt(res['tps'])} tok/s" if res["ok"] else f"FAILED ({res.get('error')})"
            print(f"[{name} round {k}] {system:11s} {status}  ({res['wall_s']} s, log {res['log']})", flush=True)
        rounds.append(result)
    return rounds


def write_json(args: argparse.Namespace, rows: list[dict], data_info: dict) -> None:
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "date": time.strftime("%Y-%m-%d %H:%M"), "machine": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(), "rounds": args.rounds, "steps": args.steps, "seq_len": args.seq_len,
        "threads": args.threads, "isa_cap": args.isa_cap, "method": "alternated per round (order flips every round); tok/s per rank = "
        "median of step rates after the first 2 steps (3 compiled); row = median over rounds",
        "data": data_info, "rows": rows}, indent=1))
    print(f"\nJSON: {args.json}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    names = args.only or list(COMPARISONS)
    work = args.work.resolve()
    if args.dry_run:
        print_commands(args, names, work)
        return 0
    ensure_tt_venv(args.tt_venv)
    data_info = prepare_run_dir(work)
    print(f"data: {data_info['data']} ({data_info['data_documents']} documents, sha256 {data_info['data_sha256']})",
          flush=True)
    rows = [summarize(COMPARISONS[name], run_rounds(name, args, work), args.seq_len, args.threads) for name in names]
    print_tables(rows)
    if args.json:
        write_json(args, rows, data_info)
    return 0 if all(r["ratio"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
