"""What the tests share, in one module: config composition and ``launch.py`` runs, gloo process
groups, ``metrics.jsonl`` reading, and the loss-parity harness. Fixtures live in conftest.py
(``run_cache`` keeps the results several tests compare with); this module holds plain functions
so that test modules, and the processes they spawn, can import it by name.
"""

from __future__ import annotations

import copy
import gc
import hashlib
import json
import math
import multiprocessing
import os
import pickle
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar

from filelock import FileLock  # torch's own dependency
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.override_parser.overrides_parser import OverridesParser

from titan_hydra.groups import compose_config
from titan_hydra.spec import spec_of

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "conf"

T = TypeVar("T")

# Tiny, fast settings shared by the end-to-end tests (seconds per run on 2 cores).
TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "training.seq_len=64",
    "training.local_batch_size=4",
    "lr_scheduler.warmup_steps=2",
    "data.max_documents=200",
]


# ----------------------------------------------------------------------------- config and launch


_COMPOSING = threading.Lock()  # Hydra's compose API keeps global state; fixtures launch from threads


_COMPOSED: dict[tuple[str, ...], Any] = {}  # group choices -> their composed config (never handed out)


def compose_cfg(overrides: list[str] | None = None):
    """The config launch.py would compose from these overrides (no Hydra run dir, no launch).

    A full Hydra compose costs ~0.2 s and the suite composes thousands of configs, most of them
    the same group choices with other values: the group choices are composed once and the value
    overrides applied to a copy by Hydra's own code, as Hydra applies them after composing
    (~0.013 s; test_config checks it equals a full compose). Anything else (a sweep, a ``hydra``
    key, an override that fails) takes the full compose, which gives Hydra's own error.
    """
    overrides = list(overrides or [])
    parsed = OverridesParser.create().parse_overrides(overrides)
    groups = [o.input_line for o in parsed if _is_group(o.key_or_group)]
    values = [o for o in parsed if not _is_group(o.key_or_group)]
    full = any(o.is_sweep_override() or o.key_or_group.startswith("hydra") for o in parsed)
    with _COMPOSING:
        if full:
            return compose_config(overrides)
        key = tuple(groups)
        if key not in _COMPOSED:
            _COMPOSED[key] = compose_config(groups)
        cfg = copy.deepcopy(_COMPOSED[key])
        try:
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
        except Exception:
            return compose_config(overrides)
        return cfg


def _is_group(key: str) -> bool:
    """A config group's override (``model=...``, ``+experiment=...``), not a value's."""
    return (CONF / key.split("@")[0]).is_dir()


def run_launch(args: list[str], cwd: Path, timeout: int = 600, env: dict | None = None,
               unset: Iterable[str] = ()):
    """Run ``python launch.py ARGS`` in a subprocess (one thread per process unless ``env`` says
    otherwise or ``unset`` drops OMP_NUM_THREADS, W&B quiet); returns the CompletedProcess with
    its output captured."""
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env["WANDB_SILENT"] = "true"
    full_env.update(env or {})
    for name in unset:
        full_env.pop(name, None)
    return subprocess.run(
        [sys.executable, str(REPO / "launch.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )


def launch_here(args: list[str], run_dir: Path) -> None:
    """``python launch.py ARGS hydra.run.dir=RUN_DIR`` in this process: the same compose ->
    validate -> launch, with the workers forked from this test process's fork server, which starts
    once per test worker. A launch.py process costs ~7 CPU-seconds of interpreter start and imports
    (its own and its fork server's) before a tiny run's first step; the layout tests launch ~150
    times. What only a real process shows (exit codes, the console, signals) stays with
    ``run_launch``. A refusal fails the test with launch.py's exit code (its line is on stderr)."""
    from titan_hydra.launch.entry import launch  # lazy: the processes spawn_gloo starts import this module

    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        launch(compose_cfg(args), str(run_dir))
    except SystemExit as e:
        raise AssertionError(f"launch.py {' '.join(args)} exited with {e.code} (its error line is on stderr)") from None


# ----------------------------------------------------------------------------- gloo process groups


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now: every spawned group rendezvouses on its own port,
    so a group never meets a previous one's socket (TIME_WAIT) or another test run's."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_rank(rank: int, fn: Callable[..., None], nprocs: int, port: int, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    gc.enable()  # the fork server paused collection while it imported (titan_hydra/launch/gc_paused.py)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # nprocs ranks on 2 shared cores
    dist.init_process_group("gloo", rank=rank, world_size=nprocs)
    try:
        fn(rank, *args)
        # Every rank past its last collective before any tears the group down: a rank destroying
        # it while a peer's gloo work is still in flight can abort the process ("terminate called
        # without an active exception", seen once in ~6 CI runs of the CP shim test).
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Success: results are on disk and every rank passed the barrier. Leave without gloo's C++
    # teardown, which still aborted a rank (SIGABRT) once under load after the barrier; the
    # process ends here, so nothing is left to clean up.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_gloo(fn: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes joined in one gloo group (default
    group initialized before ``fn``, destroyed after; one thread each) and wait for all of them;
    an exception in any rank fails the call. ``fn`` and ``args`` must pickle (module-level ``fn``;
    results go back through files or an ``mp.Manager`` dict)."""
    import torch.multiprocessing as mp

    # Forked from a server that imported torch and the package once (the one launch_here's runs
    # use, when it is already up): a rank starts in milliseconds, not the seconds of a spawned
    # interpreter's imports, and inherits nothing of this test process.
    multiprocessing.set_forkserver_preload(["titan_hydra.launch.gc_paused", "helpers", "torch._dynamo",
                                            "titan_hydra.train.pretrain"])
    mp.start_processes(_gloo_rank, args=(fn, nprocs, free_port(), args), nprocs=nprocs, start_method="forkserver")


# ----------------------------------------------------------------------------- metrics.jsonl


def read_metrics(run_dir: Path, missing_ok: bool = False) -> list[dict]:
    """The rows of ``run_dir/metrics.jsonl`` in logged order (a resumed run appends its re-run
    steps again). ``missing_ok``: a run that trained no step may write no file; read it as empty."""
    path = Path(run_dir) / "metrics.jsonl"
    if missing_ok and not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _rows(source: Path | Iterable[dict]) -> Iterable[dict]:
    return read_metrics(source) if isinstance(source, (str, Path)) else source


def series(source: Path | Iterable[dict], key: str) -> list[float]:
    """Every logged value of ``key`` ("loss", "grad_norm", "val/loss", ...) in order; ``source`` is
    a run dir or rows from read_metrics."""
    return [r[key] for r in _rows(source) if key in r]


def by_step(source: Path | Iterable[dict], key: str) -> dict[int, float]:
    """``key`` per step, the last logged value winning (a resumed run logs its re-run steps again)."""
    return {r["step"]: r[key] for r in _rows(source) if key in r}


# ----------------------------------------------------------------------------- session cache


class RunCache:
    """Results that several tests compare with (single-process reference runs), computed once
    per session: conftest's ``run_cache`` fixture is the one instance per process. Under xdist
    the workers share them through files beside their temp dirs (under a lock per key): each
    reference is computed by the first worker that asks, not once per worker."""

    def __init__(self, tmp_path_factory):
        self._factory = tmp_path_factory
        self._values: dict[tuple, Any] = {}
        base = tmp_path_factory.getbasetemp()
        # xdist gives each worker <session root>/popen-gwN; the root is the session's, shared.
        self._shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "run_cache"
        self._shared.mkdir(exist_ok=True)

    def once(self, key: tuple, compute: Callable[[Path], T]) -> T:
        """``compute(fresh temp dir)`` the first time ``key`` is asked for in the session, the
        stored result after. Keys are global to the session: start them with a name of their own
        (``("pp_single", family)``). A compute that raises stores nothing: the next asker retries."""
        if key not in self._values:
            name = re.sub(r"[^\w.=-]+", "_", "_".join(map(str, key)))[:60]
            name += "-" + hashlib.sha1(repr(key).encode()).hexdigest()[:8]
            stored = self._shared / f"{name}.pkl"
            with FileLock(str(self._shared / f"{name}.lock")):
                if stored.exists():
                    self._values[key] = pickle.loads(stored.read_bytes())
                else:
                    folder = self._shared / name
                    shutil.rmtree(folder, ignore_errors=True)  # what a compute that raised left
                    folder.mkdir()
                    value = compute(folder)
                    partial = stored.with_suffix(".partial")
                    partial.write_bytes(pickle.dumps(value))
                    partial.replace(stored)
                    self._values[key] = value
        return self._values[key]


# ----------------------------------------------------------------------------- loss parity
# Every layout trains the same tiny model, from the same full-model init (training.init_mode=full),
# on the same global batches (the loader gives data-parallel ranks disjoint slices of one global
# batch), in fp32, so per-step losses must match the single-process run.
#
# Model families: ``family`` picks an entry of FAMILIES (overrides applied after BASE), and the
# single-process reference is kept per family. Llama 3 is the default and runs every layout;
# Qwen3 runs a chosen few (tests pass ``family="qwen3"``), so the suite's time stays bounded.

GLOBAL_BATCH = 8
STEPS = 10

BASE = [
    "model.dim=64",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "training.seq_len=64",
    f"training.steps={STEPS}",
    f"training.global_batch_size={GLOBAL_BATCH}",
    "training.mixed_precision=fp32",
    "training.init_mode=full",
    "training.val_freq=0",
    "lr_scheduler.warmup_steps=2",
    "data.max_documents=60",
    "logger=minimal",
    "cluster.threads_per_proc=1",
]

# Model family -> overrides after BASE. BASE's shape (dim 64, 4 layers, 4 heads, 2 kv heads) holds
# for every family; Qwen3 adds what it sets on its own: head_dim 32 (q is 128 wide on a 64-wide
# model, so head_dim really is decoupled from dim/n_heads) and the FFN width. qwen3_debug ties
# its embeddings (model.tie_word_embeddings=true), so its layouts run tied unless a test adds UNTIED.
FAMILIES: dict[str, list[str]] = {
    "llama3": [],
    "qwen3": ["model=qwen3_debug", "model.head_dim=32", "model.ffn_hidden_dim=192"],
}
# Tied embeddings cannot be cut into pipeline stages: PP runs (and their references) untie.
UNTIED = "model.tie_word_embeddings=false"


def base_for(overrides: list[str]) -> list[str]:
    """BASE, less its model shape keys for a transformers architecture (``model=hf_*``), whose
    fields are named by transformers and set by the caller (``model.fields.hidden_size=64``)."""
    if any(o == "model=hf" or o.startswith("model=hf_") for o in overrides):
        return [b for b in BASE if not b.startswith("model.")]
    return BASE


def run_layout(tmp_path: Path, overrides: list[str], nproc: int, dp: int,
               family: str = "llama3") -> list[float]:
    """Train one layout of ``family`` through launch.py with ``nproc`` workers and ``dp``
    data-parallel ranks (local batch GLOBAL_BATCH // dp) in ``tmp_path/run``; return its losses."""
    run_dir = tmp_path / "run"
    args = base_for(overrides) + FAMILIES[family] + [
        f"cluster.nproc_per_node={nproc}",
        f"training.local_batch_size={GLOBAL_BATCH // dp}",
        *overrides,
    ]
    launch_here(args, run_dir)
    losses = series(run_dir, "loss")
    assert len(losses) == STEPS, losses
    return losses


def run_single(tmp_path: Path, overrides: list[str], family: str = "llama3") -> list[float]:
    """The single-process run of ``family``, in this process (pretrain.run, the program a launched
    rank runs): bitwise the losses of ``run_layout(..., ["parallelism=single"], 1, 1)`` without
    its ~5 s of process start-up. Writes ``tmp_path/run/metrics.jsonl`` like a launched run."""
    from titan_hydra.train.pretrain import run

    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = compose_cfg(base_for(overrides) + FAMILIES[family] + ["cluster.nproc_per_node=1", "parallelism=single",
                                                 f"training.local_batch_size={GLOBAL_BATCH}", *overrides])
    run(spec_of(cfg), str(run_dir))
    losses = series(run_dir, "loss")
    assert len(losses) == STEPS, losses
    return losses


def reference_losses(run_cache: RunCache, extra: tuple[str, ...] = (), family: str = "llama3") -> list[float]:
    """Single-process losses of ``family`` with ``extra`` overrides (once per family and extras
    per session)."""
    return run_cache.once(("reference", family, *extra), lambda path: run_single(path, list(extra), family=family))


FSDP2 = ["cluster.nproc_per_node=2", "parallelism=fsdp", f"training.local_batch_size={GLOBAL_BATCH // 2}"]


def fsdp2_reference(run_cache: RunCache) -> tuple[Path, dict]:
    """BASE under fsdp(2) through the local launcher, uninterrupted, its last step checkpointed:
    (run dir, summary with ``losses`` and ``full_state``), once per session. The clean run that
    the fsdp parity, SLURM requeue and hang-restart tests compare with."""
    from titan_hydra.launch.local import run_local  # as run_single: the launcher only where a test needs it

    def compute(path: Path) -> tuple[Path, dict]:
        cfg = compose_cfg(BASE + FSDP2 + ["checkpoint=default"])
        return path, run_local(spec_of(cfg), str(path), return_state=True)

    return run_cache.once(("fsdp2_reference",), compute)


def assert_same_checkpoint(run_dir: Path, clean_dir: Path, step: int) -> int:
    """Every tensor of the two runs' step-``step`` checkpoints is equal, bit for bit: model,
    optimizer, and the train state, schedule, loader position and each rank's RNG (stored as
    tensors). Returns how many were compared."""
    import torch  # as model_logits: torch only where a helper needs it

    from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries

    a, b = (d / "checkpoint" / f"step-{step}" for d in (run_dir, clean_dir))
    keys = list(tensor_entries(read_metadata(b)))
    assert sorted(tensor_entries(read_metadata(a))) == sorted(keys)
    assert {"extra", "rank_state.0"} <= set(keys) and any(k.startswith("optim.state.") for k in keys), keys
    ours, clean = load_plain(a, keys), load_plain(b, keys)
    differ = [k for k in keys if not torch.equal(ours[k], clean[k])]
    assert not differ, f"{len(differ)} of {len(keys)} tensors of {a} differ from {b}'s, first {differ[0]}"
    return len(keys)


# ----------------------------------------------------------------------------- the rounding floor
# Two layouts of one run sum the same terms in other orders, so their losses differ by fp32 (or
# bf16) rounding, and how much depends on the CPU's kernels: a fixed bound tuned on one CPU fails
# on another. The floor is measured instead, on the machine that runs the test: the same run in
# one process with its batch of 8 accumulated as 2 x 4 (another summation order, nothing else
# changed). A layout may differ from one process by FLOOR_FACTOR floors (its reduce-scatter, split
# matmuls and pipeline stages reorder more sums than one accumulation does) plus LOSS_ULPS units
# in the last place of the largest loss (the floor of two runs that happen to round alike).
# A real bug (a dropped gradient, a wrong scale) moves a 10-step curve by 1e-3 or more.
FLOOR_FACTOR = 10
LOSS_ULPS = 8


def rounding_floor(run_cache: RunCache, extra: tuple[str, ...] = (), family: str = "llama3") -> float:
    """max |loss| between ``reference_losses`` and the same run accumulated as 2 x 4 (once per session)."""
    ref = reference_losses(run_cache, extra, family)
    accumulated = run_cache.once(("accumulated", family, *extra), lambda path: run_single(
        path, [*extra, f"training.local_batch_size={GLOBAL_BATCH // 2}"], family=family))
    return max(abs(a - b) for a, b in zip(accumulated, ref))


def fp32_ulp(x: float) -> float:
    """The spacing of fp32 numbers at ``x`` (fp64's, ``math.ulp``, times 2^(52 - 23))."""
    return math.ulp(x) * 2.0 ** 29


def floor_bound(floor: float, values: Iterable[float]) -> float:
    """What rounding may move a series of ``values`` by, given the measured ``floor``."""
    return FLOOR_FACTOR * floor + LOSS_ULPS * fp32_ulp(max(abs(v) for v in values))


def machine_bound(run_cache: RunCache, values: Iterable[float]) -> float:
    """The bound for a run of similar size and precision whose own floor is not measured (a user's
    model, torchft groups, the plain loop): the standard tiny Llama's floor on this machine,
    applied to the compared ``values``."""
    return floor_bound(rounding_floor(run_cache), values)


def parity_bound(run_cache: RunCache, extra: tuple[str, ...] = (), family: str = "llama3") -> float:
    """The loss-parity bound of a layout of ``family`` with ``extra`` against one process."""
    return floor_bound(rounding_floor(run_cache, extra, family), reference_losses(run_cache, extra, family))


def norm_bound(floor: float, norms: Iterable[float], n_terms: int) -> float:
    """The bound of a gradient norm series: ``floor_bound``, plus the norm's own reduction, which
    one process sums in one pass and a sharded layout in pieces (accumulation does not change it,
    so the floor cannot see it): sqrt(n) unit roundoffs of the norm for a sum of n squares (the
    classical estimate for rounding errors of random sign; the worst case is n)."""
    norms = list(norms)
    return floor_bound(floor, norms) + math.sqrt(n_terms) * fp32_ulp(1.0) / 2 * max(norms)


def series_bounds(ref: dict[str, list[float]], accumulated: dict[str, list[float]], n_params: int
                  ) -> dict[str, float]:
    """Per series of a run (``ref``: "loss", "val/loss", ...), what rounding alone may move it by,
    from the same run accumulated as 2 x 4 (``floor_bound``; ``norm_bound`` for "grad_norm", with
    the model's ``n_params``)."""
    floors = {key: max(abs(a - b) for a, b in zip(accumulated[key], values)) for key, values in ref.items()}
    return {key: norm_bound(floors[key], values, n_params) if key == "grad_norm" else floor_bound(floors[key], values)
            for key, values in ref.items()}


def param_count(overrides: list[str]) -> int:
    """The parameter count of the model these overrides compose (no weights built)."""
    return int(spec_of(compose_cfg(overrides)).shape.params)


def param_floor_bound(single: dict, accumulated: dict) -> float:
    """The parameter-parity bound from two one-process runs' trained parameters (``full_state``):
    the same run and its 2 x 4 accumulation, as ``floor_bound`` does for losses."""
    floor = max((single[k] - v).abs().max().item() for k, v in accumulated.items())
    return floor_bound(floor, [max(v.abs().max().item() for v in single.values())])


# FSDP's mixed precision computes with bf16 copies of every parameter (norms, embeddings included)
# where autocast rounds only the matmul inputs: more bf16 roundings per layer, by the same factor
# as a layout's reordered sums against the floor
BF16_FACTOR = FLOOR_FACTOR


def low_precision_bound(low: Iterable[float], fp32: Iterable[float], floor: float) -> float:
    """Two runs that round the same kind of tensors to a low precision in other ways (other
    tensors, other shards, other scales) differ by that rounding itself: at most BF16_FACTOR
    times one process's distance from its fp32 curve (``low`` against ``fp32``), plus ``floor``,
    the bound of the low-precision run's own summation order."""
    return BF16_FACTOR * max(abs(a - b) for a, b in zip(low, fp32)) + floor


def bf16_bound(run_cache: RunCache, family: str = "llama3") -> float:
    """bf16 layouts round other tensors than one process's autocast does (FSDP's bf16 parameter
    copies, two bf16 partial sums where one process sums once): ``low_precision_bound`` of one
    process's bf16 curve."""
    bf16 = ("training.mixed_precision=bf16",)
    fp32, half = reference_losses(run_cache, family=family), reference_losses(run_cache, bf16, family)
    return low_precision_bound(half, fp32, parity_bound(run_cache, bf16, family))


# Unit roundoffs: bf16 keeps 7 mantissa bits; float8's e4m3 (inputs, weights) 3 and e5m2
# (torchao's gradients under tensor-wise scales) 2
BF16_U = 2.0**-8
E4M3_U = 2.0**-4
E5M2_U = 2.0**-3


def float8_bound(bf16: Iterable[float], fp32: Iterable[float]) -> float:
    """How far float8 training (tensor-wise scales, every block linear) may move a loss curve from
    fp32, given the same run's bf16 autocast curve: autocast rounds every matmul's inputs and output
    to bf16, a superset of what float8 rounds (the linears' inputs, weights and output gradients),
    so its distance from fp32 holds the linears' share; to first order a loss moves in proportion
    to its operands' relative rounding, and float8's coarsest (e5m2) is E5M2_U / BF16_U = 32 times
    bf16's. Both distances are sums of roundings of random sign, so one short curve's may happen to
    cancel where the other's does not (Qwen3's bf16 curve was 4e-5 from fp32 over 4 steps, its
    float8 curve 38x that at one step): BF16_FACTOR more, as for bf16 layouts. A lost scale or cast
    moves the loss by O(0.1) or more."""
    return BF16_FACTOR * E5M2_U / BF16_U * max(abs(a - b) for a, b in zip(bf16, fp32))


def assert_parity(losses: list[float], reference: list[float], atol: float, label: str = "",
                  record: Callable[[str, object], None] | None = None) -> float:
    """Assert max |loss - reference| <= atol (``parity_bound``'s, or one the caller's comment
    derives) and return it; ``record`` (pytest's record_property) keeps the measured value in the
    test report (``--junitxml``) on success too."""
    assert len(losses) == len(reference) > 0, (losses, reference)
    diff = max(abs(a - b) for a, b in zip(losses, reference))
    if record is not None:
        record(f"{label} max |loss - single|".strip(), diff)
        record(f"{label} bound".strip(), atol)
    assert diff <= atol, f"{label} max |loss - single| = {diff:.3g} > {atol}\nlayout: {losses}\nsingle: {reference}"
    return diff


def model_logits(family: Any, args: Any, state: dict, tokens) -> Any:
    """Logits of a family's model built from ``args`` with ``state`` loaded (what ``convert.read_model``
    returns), in eval mode: the HF parity tests compare these with transformers'."""
    import torch  # as above: torch only where a helper needs it

    model = family.build(args).eval()
    model.load_state_dict(state)
    with torch.no_grad():
        return model(tokens)
