"""Expert parallelism on CPU/gloo: the token all-to-all, the ExpertParallel style, and training
parity of EP layouts with one process (losses, expert biases, resharded resume).

Tolerances: fp32 layouts must match the single-process losses within 1e-5 like every other
layout (EP only changes where an expert's matmul runs and the order of gradient sums). Measured
max |loss - single| over 10 steps: ep2 + accumulation, efsdp2 x ep2, pp2 x ep2 and both
resharded resumes 9.5e-7 (one float32 ulp at loss 8) or 0; trained parameters 6e-7.

Cost: one 2-rank spawn, three in-process single runs, five launches (two at a time), three of
them compiled.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import (BASE, GLOBAL_BATCH, STEPS, assert_parity, by_step, compose_cfg, floor_bound, launch_here,
                     norm_bound, param_count, series, spawn_gloo)
from titan_hydra.checkpoint.storage import load_plain, read_metadata, tensor_entries
from titan_hydra.errors import ConfigError
from titan_hydra.validate import validate

# --------------------------------------------------------------------------- unit: 2 gloo ranks
# One spawn runs every unit check (process start-up is most of the cost). FSDP of the experts over
# efsdp > 1 runs in the 4-rank training layouts below.
SENDS = [[1, 3], [0, 2]]  # rows rank r sends to rank j: uneven, one empty
DIM, HIDDEN, EXPERTS = 8, 12, 8


def _check_all_to_all(rank: int) -> dict:
    """Uneven splits with empty sends; rank r's loss weighs the rows it received by r + 1."""
    import torch.distributed as dist

    from titan_hydra.models.common.expert_parallel import all_to_all

    send = SENDS[rank]
    recv = [SENDS[src][rank] for src in range(2)]
    x = (torch.arange(sum(send), dtype=torch.float32) + 100 * rank).unsqueeze(1).repeat(1, 2).requires_grad_()
    y = all_to_all(x, recv, send, dist.group.WORLD)
    (y[:, 0] * (rank + 1)).sum().backward()
    return {"received": y[:, 0].tolist(), "grad": x.grad[:, 0].tolist()}


def _tokens_of(rank: int, idle_upper: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-specific tokens sorted by global expert, with an expert that gets no token
    (``idle_upper``: none for the upper half of the experts, i.e. for ep rank 1's experts)."""
    g = torch.Generator().manual_seed(10 + rank)
    counts = torch.randint(1, 5, (EXPERTS,), generator=g)
    counts[rank % EXPERTS] = 0
    if idle_upper:
        counts[EXPERTS // 2:] = 0
    return torch.randn(int(counts.sum()), DIM, generator=g), counts


class _ProjExperts(torch.nn.Module):
    """A dense projection (FSDP on the dense mesh) feeding routed experts (EP + FSDP on efsdp)."""

    def __init__(self):
        from titan_hydra.models.common.moe import GroupedExperts

        super().__init__()
        self.proj = torch.nn.Linear(DIM, DIM, bias=False)
        self.experts = GroupedExperts(DIM, HIDDEN, EXPERTS)  # torch._grouped_mm where it works

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return self.experts(self.proj(x), counts)


def _check_style(rank: int, world: int, ep: int, idle_upper: bool = False) -> dict:
    """The real layout code (apply_ep, then apply_data_parallel with the experts) vs the full
    module in one process: outputs, gradients against the gradient of mean_r(loss_r), and
    gradient clipping with the dense and the expert gradients on two different meshes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from titan_hydra.models.protocol import ModelFamily
    from titan_hydra.parallel.parallelism import ParallelDims
    from titan_hydra.parallel.ep import apply_ep
    from titan_hydra.parallel.fsdp import apply_data_parallel
    from titan_hydra.train.grad_clip import clip_grad_norm_

    torch.manual_seed(0)
    full = _ProjExperts()
    full.experts.init_weights(0.02)
    dims = ParallelDims(world_size=world, dp_shard=world, ep=ep)
    dims.build_mesh("cpu")
    with torch.device("meta"):
        model = _ProjExperts()
    experts = [m for _, m in apply_ep(model, ModelFamily(), dims)]
    apply_data_parallel(model, [(model.proj, False)], dims, "fp32", torch.device("cpu"), experts)
    model.to_empty(device="cpu")
    set_model_state_dict(model, full.state_dict(), options=StateDictOptions(full_state_dict=True))
    x, counts = _tokens_of(rank, idle_upper)
    y = model(x, counts)
    (y * (rank + 1)).sum().backward()
    ref_y = full(x, counts)
    for r in range(world):
        xr, cr = _tokens_of(r, idle_upper)
        ((full(xr, cr) * (r + 1)).sum() / world).backward()
    ref_grads = {n: p.grad for n, p in full.named_parameters()}
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    ref_norm = torch.stack([g.double().norm() for g in ref_grads.values()]).norm().item()
    norm = clip_grad_norm_(model.parameters(), max_norm=ref_norm / 2).item()
    clipped = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
    coef = (ref_norm / 2) / (ref_norm + 1e-6)
    ranks = torch.distributed.get_process_group_ranks
    return {
        "y": (y - ref_y).abs().max().item(),
        "grad": max((grads[n] - g).abs().max().item() for n, g in ref_grads.items()),
        "meshes": sorted({str(p.device_mesh.mesh_dim_names) for p in model.parameters()}),
        "norm_rel_err": abs(norm - ref_norm) / ref_norm,
        # torch clips with max_norm / (norm + 1e-6)
        "clipped_rel_err": max(((clipped[n] - g * coef).abs().max() / g.abs().max()).item()
                               for n, g in ref_grads.items()),
        "local_experts": model.experts.w1.to_local().shape[0],
        "ep_group": ranks(dims.submesh("ep").get_group()),
        "efsdp_group": ranks(dims.submesh("efsdp").get_group()),
    }


def _unit_worker(rank: int, out: dict) -> None:
    from titan_hydra.parallel import fsdp

    results = {"a2a": _check_all_to_all(rank), "ep2": _check_style(rank, 2, 2),
               "ep2_idle_rank": _check_style(rank, 2, 2, idle_upper=True)}
    fsdp.experts_need_fsdp = lambda dims, device: True  # the GPU layout: FSDP on a 1-rank efsdp mesh
    results["ep2_fsdp_experts"] = _check_style(rank, 2, 2)
    out[rank] = results


@pytest.fixture(scope="module")
def unit_results() -> dict:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        spawn_gloo(_unit_worker, 2, out)
        return dict(out)


@pytest.mark.slow
def test_all_to_all_uneven_splits_and_backward(unit_results):
    """Rank 0 sends 1 row to itself and 3 to rank 1, rank 1 sends none and 2: each receives its
    rows in source-rank order, and each sent row's gradient is the receiving rank's weight
    (its rank + 1), so the backward sent it home."""
    assert unit_results[0]["a2a"] == {"received": [0.0], "grad": [1.0, 2.0, 2.0, 2.0]}
    assert unit_results[1]["a2a"] == {"received": [1.0, 2.0, 3.0, 100.0, 101.0], "grad": [2.0, 2.0]}


@pytest.mark.parametrize("case", ["ep2", "ep2_idle_rank", "ep2_fsdp_experts"])
@pytest.mark.slow
def test_expert_parallel_matches_full_experts(unit_results, case):
    """ep=2 on 2 ranks (efsdp 1): each rank keeps E/2 experts; outputs equal the unsharded
    module's and gradients the single-process gradient. With a 1-rank efsdp mesh FSDP leaves the
    experts out (fp32 DTensors over ep only) and a gradient hook divides by the whole dp size
    (without it the expert gradients were twice the right value). Clipping to half the norm
    combines the dense (dp_shard mesh) and expert (ep mesh) norms and scales both groups.
    ``ep2_fsdp_experts``: the layout GPUs get, FSDP on the experts over a 1-rank efsdp mesh; it
    needs fsdp.py's fix for torch dividing such a gradient twice (half the right value).
    ``ep2_idle_rank``: no token goes to rank 1's experts; they still run (on zero rows, through
    torch._grouped_mm) and get exactly zero gradient, and rank 1's own tokens come back."""
    for rank in range(2):
        got = unit_results[rank][case]
        assert got["y"] <= 1e-6 and got["grad"] <= 1e-7, (rank, got)  # measured 3e-11 / 1e-9
        expert_mesh = "('efsdp', 'ep')" if case == "ep2_fsdp_experts" else "('ep',)"
        assert got["meshes"] == ["('dp_shard',)", expert_mesh], (rank, got)
        assert got["norm_rel_err"] <= 1e-6 and got["clipped_rel_err"] <= 1e-6, (rank, got)
        assert got["local_experts"] == EXPERTS // 2, (rank, got)
        assert got["ep_group"] == [0, 1] and got["efsdp_group"] == [rank], (rank, got)


# --------------------------------------------------------------------------- training parity
# Every run trains the same tiny Qwen3-MoE (2 layers, 8 experts of width 32, top-2) on helpers.BASE
# (fp32, full init, global batch 8, 10 steps). The expert bias moves (load_balance_coeff 0.01) so
# that it steers routing from step 2 on, the sequence-wise aux loss is on (its injected gradient
# takes the runner's microbatch weight: accumulation and pipeline microbatches), and max_norm 0.3
# is below every step's gradient norm (~0.45), so clipping, with norms combined over the dense and
# the expert mesh, acts every step. Under PP, torch's stage-shape inference runs a probe forward in
# step 1 that would count as expert load; pp.PipelineRunner undoes its buffer changes, so the pp
# layout matches the same reference.
MOE = ["model=qwen3_moe_debug", "model.n_layers=2", "model.head_dim=16", "model.moe.expert_dim=32",
       "model.moe.aux_loss_coeff=0.01", "model.moe.load_balance_coeff=0.01", "training.max_norm=0.3"]
CKPT = ["checkpoint=default", "checkpoint.interval=5", "checkpoint.keep_latest_k=0"]
FINAL_CKPT = ["checkpoint=default", "checkpoint.interval=0"]  # saved once, after the last step
RESUME_STEP = 5  # the ep checkpoint the resharded resumes start from
# fp32 losses, gradient norms and trained parameters: EP only moves where an expert's matmul runs
# and the order of gradient sums, so each is held to what rounding alone moves it by on this
# machine: ``helpers.floor_bound`` of the single run against itself accumulated as 2 x 4 (the
# "accumulated" reference). The exact two-mesh norm is checked in the unit test.
# name -> (overrides, processes, data-parallel degree: local batch 8 // dp), reference
# Every EP layout also runs compiled (the MoE blocks in pieces, the experts eager) with one of the
# activation-checkpointing modes, against the eager single process: compile and AC are no longer
# refused under EP, and these runs show they change nothing but speed and memory. Captured with
# aot_eager (dynamo + AOTAutograd: the graph breaks and recompiles under test, without inductor's
# C++ builds: ep2 with inductor cost 91 s of CI instead of ~25); with inductor all three were
# checked by hand within 1e-6 of eager (docs/reference.md).
COMPILED = ["compile=model", "compile.backend=aot_eager", "training.log_freq=1"]
LAYOUTS = {
    # ep=2 on 2 ranks, local batch 2: 2 accumulation steps; selective-op AC saving every second matmul
    "ep2_accum2": (["parallelism=ep", *CKPT, *COMPILED, "activation_checkpoint=selective_op",
                    "activation_checkpoint.selective_op_policy=every_second_mm"], 2, 4, "bias"),
    # experts: FSDP over 2 x EP over 2; full AC
    "efsdp2_ep2": (["parallelism=fsdp_ep", *FINAL_CKPT, *COMPILED, "activation_checkpoint=full"], 4, 4, "bias"),
    # per stage: ep 2, efsdp 1; full AC. Step 1's stage-shape inference
    # runs a backward through its probe, which recomputes the checkpointed blocks and counted
    # the probe's routing into the expert load once more (biases off by then: losses ~5e-5 away
    # by step 10); pp.PipelineRunner now undoes the buffers after that backward
    "pp2_ep2": (["parallelism=fsdp_ep", "parallelism.pp=2", *FINAL_CKPT, *COMPILED,
                 "activation_checkpoint=full"], 4, 2, "bias"),
}
RESUMES = {  # name -> (overrides, processes, dp): full state from ep2_accum2's step-5 checkpoint
    "fsdp2": (["parallelism=fsdp"], 2, 2),
    "single": (["parallelism=single"], 1, 1),
}
# single-process runs: name -> overrides ("no_bias" only shows that the bias steers routing)
REFERENCES = {"bias": CKPT, "no_bias": ["model.moe.load_balance_coeff=0"],
              "accumulated": [*CKPT, f"training.local_batch_size={GLOBAL_BATCH // 2}"]}
PARALLEL = 2  # launches at a time (most of a launch is single-threaded start-up)


def _launch(run_dir: Path, overrides: list[str], nproc: int, dp: int) -> Path:
    launch_here([*BASE, *MOE, f"cluster.nproc_per_node={nproc}", f"training.local_batch_size={GLOBAL_BATCH // dp}",
                 *overrides], run_dir)
    return run_dir


def _single(run_dir: Path, overrides: list[str]) -> Path:
    """One process, in this process (pretrain.run, the program a launched rank runs)."""
    from titan_hydra.train.pretrain import run

    cfg = compose_cfg([*BASE, *MOE, "cluster.nproc_per_node=1", "parallelism=single",
                       f"training.local_batch_size={GLOBAL_BATCH}", *overrides])
    run_dir.mkdir(parents=True, exist_ok=True)
    run(spec_of(cfg), str(run_dir))
    return run_dir


def _bound(runs, key: str) -> float:
    """What rounding alone moves the single run's ``key`` series by (``helpers.floor_bound``;
    ``norm_bound`` for the gradient norm, which sharded layouts reduce in pieces)."""
    ref, accumulated = (series(runs[n].result(), key) for n in ("bias", "accumulated"))
    floor = max(abs(a - b) for a, b in zip(accumulated, ref))
    return norm_bound(floor, ref, param_count([*BASE, *MOE])) if key == "grad_norm" else floor_bound(floor, ref)


def _after(dep: Future, fn, *args):
    dep.result()
    return fn(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, run_cache):
    """Every run of this module, started once (two launches at a time); tests read the futures.
    In-process runs change torch's global state, so they get their own one-thread pool."""
    base = tmp_path_factory.mktemp("ep_runs")
    pool, here = ThreadPoolExecutor(PARALLEL), ThreadPoolExecutor(1)
    f: dict[str, Future] = {}
    for name, overrides in REFERENCES.items():
        f[name] = here.submit(run_cache.once, ("ep_single", *MOE, *overrides),
                              lambda path, overrides=overrides: _single(path / "run", overrides))
    for name, (overrides, nproc, dp, _) in LAYOUTS.items():
        f[name] = pool.submit(_launch, base / name, overrides, nproc, dp)
    src = base / "ep2_accum2" / "checkpoint" / f"step-{RESUME_STEP}"
    load = ["checkpoint=default", f"checkpoint.initial_load_path={src}", "checkpoint.initial_load_model_only=false"]
    for name, (overrides, nproc, dp) in RESUMES.items():
        if nproc == 1:
            f[f"resume_{name}"] = here.submit(_after, f["ep2_accum2"], _single, base / f"resume_{name}", load)
        else:
            f[f"resume_{name}"] = pool.submit(_after, f["ep2_accum2"], _launch, base / f"resume_{name}",
                                              overrides + load, nproc, dp)
    yield f
    pool.shutdown(wait=True)
    here.shutdown(wait=True)


def _checkpoint(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoint" / f"step-{step}"
    return load_plain(path, [k for k in tensor_entries(read_metadata(path)) if k.startswith("model.")])


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
@pytest.mark.gate("efsdp2_ep2")
def test_ep_loss_and_grad_norm_parity(name, runs, record_property):
    """Losses and (clipped-against) gradient norms of each EP layout equal the single process's."""
    ref, got = runs[LAYOUTS[name][3]].result(), runs[name].result()
    assert_parity(series(got, "loss"), series(ref, "loss"), atol=_bound(runs, "loss"), label=f"qwen3_moe {name}",
                  record=record_property)
    norms, ref_norms = series(got, "grad_norm"), series(ref, "grad_norm")
    assert min(ref_norms) > 0.3, ref_norms  # clipping acted on every step
    assert_parity(norms, ref_norms, atol=_bound(runs, "grad_norm"), label=f"qwen3_moe {name} grad_norm",
                  record=record_property)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.slow
@pytest.mark.gate("efsdp2_ep2")
def test_compiled_ep_layouts_do_not_recompile(name, runs):
    """Dynamo compiled its graphs in the first step (forward and backward) and none after: the
    experts, whose token counts change every step, stay out of the graphs (compile/graphs, logged
    every step, is the process's count of compiled graphs)."""
    graphs = series(runs[name].result(), "compile/graphs")
    assert len(graphs) == STEPS and graphs[0] > 0 and len(set(graphs)) == 1, graphs


@pytest.mark.parametrize("name, steps", [("ep2_accum2", (RESUME_STEP, STEPS)), ("efsdp2_ep2", (STEPS,)),
                                         ("pp2_ep2", (STEPS,))])
@pytest.mark.slow
def test_ep_expert_bias_and_params_match_single(name, steps, runs, record_property):
    """The expert biases equal the single process's bit for bit at every saved step (each rank
    counts its own tokens per global expert before dispatch, and the step hook sums the counts
    over all dp x cp ranks), and they matter (the losses differ from the frozen-bias run); after
    10 steps every parameter, routed experts included, matches within float rounding."""
    for step in steps:
        ref = _checkpoint(runs["bias"].result(), step)
        got = _checkpoint(runs[name].result(), step)
        assert got.keys() == ref.keys()
        biases = [k for k in ref if k.endswith("expert_bias")]
        assert len(biases) == 2, biases
        for k in biases:
            assert torch.equal(got[k], ref[k]), (step, k, got[k], ref[k])
        assert max(ref[k].abs().max().item() for k in biases) >= 0.005, {k: ref[k] for k in biases}
    steering = max(abs(a - b) for a, b in zip(series(runs["bias"].result(), "loss"),
                                               series(runs["no_bias"].result(), "loss")))
    assert steering > 10 * _bound(runs, "loss"), steering  # a wrong bias would break loss parity
    assert any(k.endswith("experts.w1") for k in ref), sorted(ref)
    diffs = {k: (got[k] - v).abs().max().item() for k, v in ref.items()}
    worst = max(diffs, key=diffs.get)
    record_property(f"{name} max |param - single| ({worst})", diffs[worst])
    accumulated = _checkpoint(runs["accumulated"].result(), STEPS)
    bound = floor_bound(max((accumulated[k] - v).abs().max().item() for k, v in ref.items()),
                        [max(v.abs().max().item() for v in ref.values())])
    assert diffs[worst] <= bound, f"{name} {worst}: max |ep - single| = {diffs[worst]:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", list(RESUMES))
@pytest.mark.slow
def test_resume_ep_checkpoint_resharded(name, runs):
    """The ep(2) step-5 full state (experts saved as ep-sharded DTensors) loads into one process
    and into plain fsdp(2); steps 6-10 continue the single-process run's losses."""
    ref = by_step(runs["bias"].result(), "loss")
    got = by_step(runs[f"resume_{name}"].result(), "loss")
    assert sorted(got) == list(range(RESUME_STEP + 1, STEPS + 1)), got
    diff = max(abs(got[s] - ref[s]) for s in got)
    assert diff <= _bound(runs, "loss"), (name, diff, got, ref)


# --------------------------------------------------------------------------- config errors
def _refused(overrides: list[str]) -> str:
    cfg = compose_cfg(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    message = str(err.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("overrides, expected", [
    (["parallelism=ep", "cluster.nproc_per_node=2"], "needs a mixture-of-experts model"),  # dense llama3_debug
    (["model=qwen3_moe_debug", "parallelism=ep", "cluster.nproc_per_node=3"], "must divide the model's 8 routed"),
    (["model=qwen3_moe_debug", "parallelism=fsdp", "parallelism.ep=3", "cluster.nproc_per_node=4"],
     "must divide dp_shard*cp=4"),
    (["model=qwen3_moe_debug", "parallelism=fsdp_tp", "parallelism.ep=2", "cluster.nproc_per_node=4"],
     "parallelism.tp=2 is not supported"),
    (["model=qwen3_moe_debug", "parallelism.ep=0"], "must be >= 1 or -1"),
], ids=["dense_model", "experts_not_divisible", "ep_not_dividing_dp", "with_tp", "zero"])
def test_ep_config_errors(overrides, expected):
    assert expected in _refused(overrides)


def test_compile_and_selective_ac_are_accepted_under_ep():
    validate(compose_cfg(["model=qwen3_moe_debug", "parallelism=ep", "cluster.nproc_per_node=2", "compile=model",
                          "activation_checkpoint=selective_op"]))
