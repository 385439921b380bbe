"""``parallelism=auto``: pick the parallel degrees from the model and the cluster.

Why in the planner: the choice is a ranking of plans (planner/plan.py) and builds nothing.
Why before validation: the degrees decide everything downstream (mesh, memory, checks), so
``launch()`` resolves them once, in the launching process, before ``validate``; every later
step sees an ordinary layout. Under torchrun / SLURM each rank composes its own
config and resolves it the same way: the choice is a pure function of the config and the
world size (no timing, no randomness), so all ranks agree.

How the choice is made:
  * candidates follow the hardware: TP only inside a node (tp divides the GPUs of a node and
    the attention/KV heads), PP only across nodes (pp divides the node count; pp=1 on one
    node), CP only for long sequences (> ``CP_MIN_SEQ_LEN``), inside the node next to TP;
    the rest is data parallel: FSDP over all of it, or HSDP (shard inside a node, replicate
    across nodes) when there are several nodes per pipeline stage;
  * each candidate must pass the same pre-launch rules the launch will apply (the parallel
    modules' checks) and fit the device memory by ``plan()`` (planner/plan.py's
    own fit check: peak per rank <= device memory less ``cluster.memory_headroom``, the
    estimator's measured error, so a layout at the edge of the device is not chosen; CPU has
    no limit);
  * among those, the highest estimated tokens/s wins. ``plan`` gives compute time at
    ``ASSUMED_MFU`` (40%), which is the same for every layout of one world size, so the ranking
    adds what differs between layouts: the pipeline bubble and stage imbalance, exposed TP/CP
    collectives on the intra-node link, and FSDP/HSDP traffic (overlapped with compute) on the
    link its group spans. Within ``TIE_TOLERANCE`` of the best, fewer model-parallel
    dimensions win (the model is rough; a simpler layout is the safer bet).

Candidates are the spec's own dims with the degrees replaced (``RunSpec.with_dims``): nothing is
composed or copied per candidate. The launcher writes the chosen degrees into the config
(``launch/resolve.py``), which records the choice in the run's logged config.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

from titan_hydra.errors import ConfigError, UserError
from titan_hydra.layout import check_layout
from titan_hydra.planner.devices import device_memory_of, peak_tflops_of, usable_memory_of
from titan_hydra.planner.plan import ASSUMED_MFU, plan
from titan_hydra.planner.shape import stage_params
from titan_hydra.spec import RunSpec

CP_MIN_SEQ_LEN = 32768  # consider context parallel only above this sequence length
TIE_TOLERANCE = 0.02  # candidates within 2% of the best estimate count as tied
NOMINAL_PEAK_TFLOPS = 1.0  # ranking only, when the cluster gives no peak (CPU)
# Effective per-device collective bandwidth (bytes/s): inside a node, across nodes.
# cuda: NVLink4 (~450 GB/s per direction, ~350 achieved) and 8x400 Gb/s IB per node (~40 per GPU).
LINK_BYTES_PER_S = {"cuda": (350e9, 40e9), "cpu": (5e9, 1e9)}


@dataclass
class Candidate:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    cp: int
    pp_microbatches: int | None
    ep: int = 1  # expert parallel (MoE models): borrowed from dp_shard x cp
    local_batch: int = 0  # samples per rank per step when auto raised it to feed the pipeline (0: the run's)
    grows_global_batch: bool = False  # that raise makes the global batch larger (global_batch_size=-1)
    mem_gib: float = 0.0
    fits: bool = True
    tokens_per_s: float = 0.0
    invalid: str = ""  # why the launch rules reject it ("" = valid)

    @property
    def model_parallel_dims(self) -> int:
        return sum(d > 1 for d in (self.tp, self.pp, self.cp, self.ep))

    def degrees(self) -> dict:
        return {"dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard, "tp": self.tp,
                "pp": self.pp, "cp": self.cp, "ep": self.ep}

    def describe(self, sep: str = " ") -> str:
        return sep.join(f"{k}={v}" for k, v in self.degrees().items() if k == "dp_shard" or v > 1)

    def batch_note(self) -> str:
        """What auto changed of the batch to feed the pipeline ("" when nothing)."""
        return f"local batch {self.local_batch} in {self.pp_microbatches} microbatches" if self.local_batch else ""


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def topology(spec: RunSpec) -> tuple[int, int]:
    """(nodes, ranks per node) of this run; the world size comes from the environment under torchrun."""
    world, per_node = spec.world_size, int(spec.cluster.nproc_per_node)
    if per_node < 1 or world % per_node:
        return 1, world
    return world // per_node, per_node


def pp_microbatches_for(spec: RunSpec, pp: int) -> int | None:
    """The user's value, else one microbatch per sample (smallest bubble and in-flight memory)."""
    if pp == 1 or spec.dims.pp_microbatches:
        return spec.dims.pp_microbatches
    return spec.batch.local


def enumerate_candidates(spec: RunSpec) -> list[Candidate]:
    """Every layout that respects the topology rules (TP in a node, PP across nodes)."""
    nodes, per_node = topology(spec)
    m = spec.shape
    heads = math.gcd(m.n_heads, m.n_kv_heads)
    long_seq = spec.batch.seq_len > CP_MIN_SEQ_LEN
    out = []
    for pp in divisors(nodes):
        if pp > int(m.n_layers):
            continue
        for tp in divisors(per_node):
            if heads % tp:
                continue
            for cp in divisors(per_node // tp) if long_seq else [1]:
                in_node = per_node // (tp * cp)  # data-parallel ranks inside one node
                groups = nodes // pp  # nodes per pipeline stage
                mb = pp_microbatches_for(spec, pp)
                shapes = [(1, in_node * groups)]
                if groups > 1:  # HSDP: shard inside the node, replicate across nodes
                    shapes.append((groups, in_node))
                for rep, shard in shapes:
                    for ep in expert_degrees(m.n_experts, shard * cp, tp):
                        out.append(Candidate(rep, shard, tp, pp, cp, mb, ep))
    return out


def expert_degrees(n_experts: int, shard_ranks: int, tp: int) -> list[int]:
    """ep degrees to try: 1, and for MoE models every divisor of the dp_shard x cp ranks that also
    divides the expert count (EP does not compose with TP here)."""
    if not n_experts or tp > 1:
        return [1]
    return [d for d in divisors(shard_ranks) if n_experts % d == 0]


def candidate_spec(spec: RunSpec, c: Candidate) -> RunSpec:
    """The run on the candidate's layout; ConfigError when its degrees or batch plan do not hold."""
    dims = dataclasses.replace(spec.dims, **c.degrees(), pp_microbatches=c.pp_microbatches)
    if c.local_batch:
        spec = dataclasses.replace(spec, training=dataclasses.replace(spec.training, local_batch_size=c.local_batch))
    return spec.with_dims(dims)


def fed_pipeline(base: RunSpec, c: Candidate) -> Candidate:
    """A pipeline candidate whose schedule needs more microbatches than the local batch has samples
    (1F1B: one per stage) gets a larger local batch, in microbatches of one sample, when the user
    left ``parallelism.pp_microbatches`` to auto: the smallest multiple of the run's local batch
    that the launch rules accept. A fixed ``training.global_batch_size`` stays fixed (gradient
    accumulation shrinks by the same factor; a multiple it cannot absorb is not taken); with
    ``global_batch_size=-1`` the global batch is local x data parallel, as on every layout. The
    planner sizes the larger batch like any other, so memory still decides; a candidate that grows
    the global batch this way is chosen only when none at the run's batch fits (``choose``)."""
    if c.pp == 1 or base.dims.pp_microbatches or not layout_problem_of(base, c):
        return c
    local = base.batch.local
    for k in range(2, max(2, math.ceil(2 * c.pp / local)) + 1):  # V schedules hold 2 stages per rank
        fed = dataclasses.replace(c, local_batch=k * local, pp_microbatches=k * local,
                                  grows_global_batch=base.training.global_batch_size == -1)
        if not layout_problem_of(base, fed):
            return fed
    return c


def layout_problem_of(base: RunSpec, c: Candidate) -> str:
    """Why the launch would refuse candidate ``c`` of run ``base`` ("" = it would not)."""
    try:
        return layout_problem(candidate_spec(base, c))
    except UserError as e:
        return str(e).splitlines()[0]


def layout_problem(spec: RunSpec) -> str:
    """Why the launch would refuse this candidate's layout ("" = it would not)."""
    try:
        check_layout(spec)
    except UserError as e:
        return str(e).splitlines()[0]
    return ""


def estimated_step_time(spec: RunSpec, p) -> float:
    """Seconds per step: compute at ``ASSUMED_MFU`` (``plan``) + what the layout adds."""
    dims, args = spec.dims, spec.shape
    compute = p.flops_per_step / dims.world_size / (ASSUMED_MFU * NOMINAL_PEAK_TFLOPS * 1e12)
    if p.step_time_s_at_mfu40 is not None:
        compute = p.step_time_s_at_mfu40
    intra, inter = LINK_BYTES_PER_S.get(str(spec.cluster.device), LINK_BYTES_PER_S["cpu"])
    nodes, per_node = topology(spec)
    if dims.pp > 1:  # slowest stage sets the pace; 1F1B-style bubble (pp-1)/(m+pp-1)
        m = dims.pp_microbatches or dims.pp
        imbalance = math.ceil(args.n_layers / dims.pp) / (args.n_layers / dims.pp)
        compute *= imbalance * (m + dims.pp - 1) / m
    layers = math.ceil(args.n_layers / dims.pp)
    tokens = spec.batch.local * spec.batch.seq_len / dims.cp * p.grad_accum_steps  # per rank per step
    exposed = 0.0
    if dims.tp > 1:  # SP: all-gather + reduce-scatter around attention and FFN, fwd and bwd
        act = tokens * args.dim * 2
        exposed += 8 * layers * act * (dims.tp - 1) / dims.tp / intra
    if dims.cp > 1:  # all-gather K/V forward, reduce-scatter their grads backward
        kv = tokens * args.kv_dim * 2 * 2 / dims.tp
        exposed += 2 * layers * kv * (dims.cp - 1) / intra
    ep = int(getattr(dims, "ep", 1))
    if ep > 1:  # token all-to-all of the MoE layers: on the critical path
        exposed += p.alltoall_gib_per_step * 2**30 / (intra if ep <= per_node else inter)
    overlapped = 0.0
    weights = stage_params(args, dims.pp) / dims.tp
    shard = dims.dp_shard * dims.cp
    if dims.fsdp_enabled:  # all-gather bf16 params fwd + bwd, reduce-scatter fp32 grads
        link = intra if dims.tp * dims.cp * dims.dp_shard <= per_node else inter
        experts = args.expert_params / dims.pp
        overlapped += (weights - experts) * (2 + 2 + 4) * (shard - 1) / shard / link
        # Routed experts: each rank holds 1/ep of them, FSDP-sharded over the other shard/ep ranks.
        eshard = shard // ep
        elink = intra if dims.tp * dims.cp * dims.dp_shard // ep <= per_node else inter
        overlapped += experts / ep * (2 + 2 + 4) * (eshard - 1) / max(eshard, 1) / elink
    if dims.dp_replicate > 1:  # all-reduce of the (sharded) fp32 grads across nodes
        r = dims.dp_replicate
        overlapped += 2 * weights / (shard if dims.fsdp_enabled else 1) * 4 * (r - 1) / r / inter
    return max(compute, overlapped) + exposed


def evaluate(base: RunSpec, c: Candidate) -> Candidate:
    """Fill memory, fit and estimated tokens/s of one candidate (or why it is invalid)."""
    try:
        spec = candidate_spec(base, c)  # degrees vs world size, batch plan
    except UserError as e:
        c.invalid = str(e).splitlines()[0]
        return c
    c.invalid = layout_problem(spec)
    p = plan(spec)
    c.mem_gib = p.mem_total_gib
    c.fits = p.fits
    c.tokens_per_s = p.tokens_per_step / estimated_step_time(spec, p)
    return c


def candidates(spec: RunSpec) -> list[Candidate]:
    """Every candidate layout of the run, evaluated."""
    return [evaluate(spec, fed_pipeline(spec, c)) for c in enumerate_candidates(spec)]


def preference(c: Candidate) -> tuple:
    """Among near-tied candidates: fewer model-parallel dims, smaller model-parallel groups, fewer
    replicas, shallower pipeline, then the faster estimate."""
    return c.model_parallel_dims, c.tp * c.pp * c.cp, c.dp_replicate, c.pp, -c.tokens_per_s


def by_speed(cands: list[Candidate]) -> list[Candidate]:
    """By estimated tokens/s, candidates within ``TIE_TOLERANCE`` of each other ordered by ``preference``."""
    rest = sorted(cands, key=lambda c: -c.tokens_per_s)
    out = []
    while rest:
        near = [c for c in rest if c.tokens_per_s >= (1 - TIE_TOLERANCE) * rest[0].tokens_per_s]
        best = min(near, key=preference)
        out.append(best)
        rest.remove(best)
    return out


def ranked(cands: list[Candidate]) -> list[Candidate]:
    """Valid candidates, best first (``choose`` takes the first that fits): those at the run's own
    batch before those that grow its global batch to feed a pipeline (a larger batch is a
    different training run, and its amortized communication would win every speed comparison),
    each group ``by_speed``."""
    valid = [c for c in cands if not c.invalid]
    return by_speed([c for c in valid if not c.grows_global_batch]) + by_speed([c for c in valid if c.grows_global_batch])


def choose(cands: list[Candidate]) -> Candidate | None:
    """The first of ``ranked`` that fits: the fastest estimate at the run's batch, near-ties to simpler
    layouts; a layout that grows the global batch only when none at the run's batch fits."""
    return next((c for c in ranked(cands) if c.fits), None)


def table(cands: list[Candidate], device_gib: float | None) -> str:
    cap = f"{device_gib:.1f} GiB" if device_gib else "no limit"
    rows = [f"{'layout':<40} {'mem/rank GiB':>12} {'fits ' + cap:>14} {'est. tokens/s':>14}"]
    for c in cands:
        status = ("yes" if c.fits else "no") if not c.invalid else "invalid"
        note = f"  ({c.invalid[:70]})" if c.invalid else (f"  ({c.batch_note()})" if c.local_batch else "")
        rows.append(f"{c.describe():<40} {c.mem_gib:>12.3g} {status:>14} {c.tokens_per_s:>14.4g}{note}")
    return "\n".join(rows)


def reason(chosen: Candidate, cands: list[Candidate], peak_known: bool) -> str:
    ok = [c for c in cands if c.fits and not c.invalid]
    same = [c for c in ok if c.grows_global_batch == chosen.grows_global_batch]  # what it was ranked among
    fastest = max(same, key=lambda c: c.tokens_per_s)
    unit = "tokens/s" if peak_known else "tokens/s at a nominal 1 TFLOP/s peak"
    why = f"fits ({chosen.mem_gib:.3g} GiB/rank), est. {chosen.tokens_per_s:.4g} {unit}"
    if chosen.grows_global_batch:
        why += f" with {chosen.batch_note()} (no layout at the run's batch fits)"
    if fastest is chosen:
        why += f", the highest of {len(same)} fitting layouts"
    else:
        why += (f", within {TIE_TOLERANCE:.0%} of the fastest fitting ({fastest.describe()}) with fewer "
                "model-parallel dims")
    grown = [c for c in ok if c.grows_global_batch and c.tokens_per_s > chosen.tokens_per_s]
    if grown and not chosen.grows_global_batch:
        g = max(grown, key=lambda c: c.tokens_per_s)
        why += (f"; faster {g.describe()} needs a larger global batch ({g.batch_note()}: set "
                "training.global_batch_size and auto raises the local batch without growing it)")
    too_big = [c for c in cands if not c.invalid and not c.fits and c.tokens_per_s > chosen.tokens_per_s]
    if too_big:
        b = min(too_big, key=lambda c: c.mem_gib)  # the closest miss
        why += f"; faster {b.describe()} needs {b.mem_gib:.1f} GiB/rank"
    return why


def is_launcher_rank() -> bool:
    return os.environ.get("RANK", "0") == "0"


def choose_layout(spec: RunSpec, cands: list[Candidate] | None = None) -> Candidate:
    """``parallelism=auto``'s layout for the run ``spec`` describes (its dims' degrees are
    replaced); the launching rank prints the candidates and why; ConfigError when none fits."""
    cands = candidates(spec) if cands is None else cands
    chosen = choose(cands)
    if chosen is None:
        raise ConfigError(no_fit_message(spec, cands))
    if is_launcher_rank():
        show_candidates(spec, cands)
        peak = peak_tflops_of(spec.cluster) is not None
        print(f"parallelism=auto chose {chosen.describe()}: {reason(chosen, cands, peak)}", flush=True)
    return chosen


def show_candidates(spec: RunSpec, cands: list[Candidate]) -> None:
    """The candidates' table and the memory budget they were judged by."""
    usable = usable_memory_of(spec.cluster)
    print(f"parallelism=auto candidates ({len(cands)}):\n{table(cands, usable)}", flush=True)
    if usable is not None:
        print(f"parallelism=auto memory: {budget(spec)}", flush=True)


def budget(spec: RunSpec) -> str:
    """The fit check's limit in words: device memory, headroom, what is left."""
    c = spec.cluster
    return (f"estimated peak per rank <= {usable_memory_of(c):.1f} GiB usable ({device_memory_of(c):.0f} GiB device, "
            f"cluster.memory_headroom={c.memory_headroom} kept free)")


def no_fit_message(spec: RunSpec, cands: list[Candidate]) -> str:
    nodes, per_node = topology(spec)
    valid = [c for c in cands if not c.invalid]
    if not valid:  # every layout breaks a launch rule (memory was not the problem)
        why = f": {cands[0].describe()} is refused ({cands[0].invalid})" if cands else ""
        return f"parallelism=auto found no valid layout for model={spec.flavor} on {nodes}x{per_node} devices{why}"
    best = min(valid, key=lambda c: c.mem_gib)
    return (
        f"parallelism=auto: model={spec.flavor} does not fit on {nodes}x{per_node} devices: the "
        f"smallest layout ({best.describe()}) needs {best.mem_gib:.1f} GiB/rank, the device has "
        f"{device_memory_of(spec.cluster):.0f} GiB of which {usable_memory_of(spec.cluster):.1f} GiB usable "
        f"(cluster.memory_headroom={spec.cluster.memory_headroom}); add nodes (cluster.nnodes), set "
        "activation_checkpoint=full, or lower training.local_batch_size (or, at the risk of an OOM, "
        "cluster.memory_headroom)"
    )
