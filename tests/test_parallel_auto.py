"""parallelism=auto: the chosen layout fits by the estimator, respects the topology, and trains.

Resolution is analytic (no process group), so the cluster-scale cases run in-process on the
composed config; the end-to-end cases go through launch.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from titan_hydra.spec import spec_of
from helpers import (BASE, GLOBAL_BATCH, STEPS, assert_parity, compose_cfg, parity_bound, reference_losses, run_launch,
                     series)

from titan_hydra.config.schemas import ClusterConfig
from titan_hydra.errors import ConfigError
from titan_hydra.launch.resolve import resolved_spec
from titan_hydra.planner import auto
from titan_hydra.planner.plan import plan
from titan_hydra.validate import validate

H100 = ["cluster=slurm_h100", "parallelism=auto", "training.seq_len=8192"]


def resolved(overrides):
    cfg = compose_cfg(overrides)
    spec = resolved_spec(cfg)  # the spec on the chosen layout, the degrees written into cfg
    assert spec.dims == spec_of(cfg).dims
    return cfg, plan(spec)


def fixed_layout_plan(overrides, **degrees):
    cfg = compose_cfg(overrides)
    for k, v in degrees.items():
        cfg.parallelism[k] = v
    return plan(spec_of(cfg))


def test_llama3_8b_one_h100_node(capsys):
    ov = ["model=llama3_8b", *H100, "training.local_batch_size=1"]
    cfg, p = resolved(ov)
    out = capsys.readouterr().out
    par = cfg.parallelism
    assert p.device_memory_gib == 80.0 and p.mem_total_gib <= 80.0
    assert par.tp <= 8 and par.pp == 1 and par.cp == 1
    assert par.dp_replicate * par.dp_shard * par.tp == 8
    # Pure FSDP would be fastest, but the estimator says it does not fit: auto must not pick it.
    assert fixed_layout_plan(ov, dp_shard=8).mem_total_gib > 80.0
    assert (par.dp_shard, par.tp) == (4, 2), out
    assert par.name == "auto:dp_shard=4,tp=2"
    line = [l for l in out.splitlines() if l.startswith("parallelism=auto chose")]
    assert line == [f"parallelism=auto chose dp_shard=4 tp=2: fits ({p.mem_total_gib:.3g} GiB/rank), "
                    f"est. {p.tokens_per_step / auto.estimated_step_time(spec_of(cfg), p):.4g} "
                    "tokens/s, the highest of 3 fitting layouts; faster dp_shard=8 needs "
                    f"{fixed_layout_plan(ov, dp_shard=8).mem_total_gib:.1f} GiB/rank"]


def test_choice_is_the_fastest_fitting_candidate():
    cfg = compose_cfg(["model=llama3_8b", *H100, "training.local_batch_size=2"])
    cands = auto.candidates(spec_of(cfg))
    assert [c.tp for c in cands] == [1, 2, 4, 8]  # one node: tp over the divisors of 8 only
    for c in cands:  # each row agrees with plan() on the same degrees
        p = fixed_layout_plan(["model=llama3_8b", *H100, "training.local_batch_size=2"], **c.degrees())
        assert math.isclose(c.mem_gib, p.mem_total_gib, rel_tol=1e-12)
        assert p.usable_memory_gib == pytest.approx(80.0 * (1 - ClusterConfig.memory_headroom))
        assert c.fits == (p.mem_total_gib <= p.usable_memory_gib)
    chosen = auto.choose(cands)
    fitting = [c for c in cands if c.fits]
    assert chosen.tokens_per_s == max(c.tokens_per_s for c in fitting)
    assert (chosen.dp_shard, chosen.tp) == (2, 4)


def test_llama3_70b_one_node_does_not_fit():
    ov = ["model=llama3_70b", *H100, "training.local_batch_size=1"]
    mems = {tp: fixed_layout_plan(ov, tp=tp).mem_total_gib for tp in (1, 2, 4, 8)}
    assert min(mems.values()) > 80.0  # the estimator: no TP degree inside a node fits
    with pytest.raises(ConfigError) as e:
        resolved_spec(compose_cfg(ov))
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("parallelism=auto: model=llama3_70b does not fit on 1x8 devices")
    assert f"(dp_shard=1 tp=8) needs {mems[8]:.1f} GiB/rank, the device has 80 GiB" in msg
    assert "cluster.nnodes" in msg and "activation_checkpoint=full" in msg and "local_batch_size" in msg


def test_llama3_405b_published_cluster_uses_pp_across_nodes():
    """torchtitan's published 405B run (64 nodes of 96 GB H100s, local batch 32, full AC) used
    FSDP 8 x TP 8 x PP 8; auto, given the same model, cluster and batch, lands on that layout."""
    ov = ["model=llama3_405b", "cluster=slurm_h100_96gb", "parallelism=auto", "training.seq_len=8192",
          "cluster.nnodes=64", "training.local_batch_size=32", "activation_checkpoint=full"]
    cfg, p = resolved(ov)
    par = cfg.parallelism
    assert par.pp > 1 and 64 % par.pp == 0  # whole nodes per stage
    assert par.tp <= 8 and 8 % par.tp == 0
    assert p.world_size == 512 and p.device_memory_gib == 96.0 and p.mem_total_gib <= 96.0
    assert (par.dp_shard, par.tp, par.pp, par.pp_microbatches) == (8, 8, 8, 32)
    # without PP nothing fits: even tp=8 with all 64 nodes sharding needs more than 96 GiB
    assert fixed_layout_plan(ov, tp=8).mem_total_gib > 96.0


def test_deepseek_v3_671b_thirty_two_nodes_uses_expert_parallel():
    """671B MoE on 256 H100s: without EP one MoE layer's 256 experts (11 GB of bf16 weights per
    layer) are all-gathered whole; EP keeps 1/ep of them on a rank and its all-to-all shows up in
    the plan."""
    ov = ["model=deepseek_v3_671b", *H100[:2], "cluster.nnodes=32", "training.seq_len=4096",
          "training.local_batch_size=2", "activation_checkpoint=full"]
    cfg, p = resolved(ov)
    par = cfg.parallelism
    assert par.ep > 1 and 256 % par.ep == 0 and (par.dp_shard * par.cp) % par.ep == 0
    assert p.mem_total_gib <= 80.0 and p.expert_parallel == par.ep and p.alltoall_gib_per_step > 0
    assert p.params == 671_026_404_352 and p.active_params < p.params / 15  # ~37.6B active
    # the same degrees without EP need more memory: the unsharded expert layer is the transient
    no_ep = fixed_layout_plan(ov, dp_shard=par.dp_shard, pp=par.pp, pp_microbatches=par.pp_microbatches, ep=1)
    assert no_ep.mem_total_gib > 80.0 > p.mem_total_gib and no_ep.mem_transient_gib > 4 * p.mem_transient_gib


@pytest.mark.parametrize("features", [["compile=model", "activation_checkpoint=full"],
                                      ["compile=model", "activation_checkpoint=selective_op"]],
                         ids=["compile_full_ac", "compile_selective_op"])
def test_deepseek_v3_671b_keeps_expert_parallel_when_compiled_or_selectively_checkpointed(features):
    """Compile and selective-op AC used to be refused under EP, which made every EP candidate
    invalid for auto; now EP stays on the table (and is chosen where it fits)."""
    ov = ["model=deepseek_v3_671b", *H100[:2], "cluster.nnodes=32", "training.seq_len=4096",
          "training.local_batch_size=2", *features]
    cfg = compose_cfg(ov)
    cands = auto.candidates(spec_of(cfg))
    reasons = {c.invalid for c in cands if c.ep > 1 and c.invalid}
    assert not [r for r in reasons if "compile" in r or "activation_checkpoint" in r], reasons
    assert any(c.ep > 1 and not c.invalid for c in cands)
    if "activation_checkpoint=full" in features:  # fits 80 GiB with full AC (selective_op does not)
        cfg, _ = resolved(ov)
        assert cfg.parallelism.ep > 1


def test_resolution_is_deterministic_and_idempotent():
    ov = ["model=llama3_70b", *H100, "cluster.nnodes=8", "training.local_batch_size=1",
          "activation_checkpoint=selective_op"]
    a, _ = resolved(ov)
    b, _ = resolved(ov)
    assert a.parallelism == b.parallelism
    resolved_spec(a)  # a SLURM task re-entering launch(): already concrete
    assert a.parallelism == b.parallelism
    fixed = compose_cfg(["parallelism=fsdp_tp", "cluster.nproc_per_node=4"])
    resolved_spec(fixed)
    assert fixed.parallelism == compose_cfg(["parallelism=fsdp_tp"]).parallelism


# 8B at 2 x 8192 tokens with torchtitan's selective AC on one 80 GB node: pure FSDP is estimated
# at 77.6 GiB per rank, inside the device but not inside its default headroom.
EDGE = ["model=llama3_8b", *H100, "training.local_batch_size=2", "activation_checkpoint=selective_op",
        "activation_checkpoint.selective_op_policy=every_second_mm"]


def test_a_layout_that_fits_only_without_headroom_is_not_chosen(capsys):
    edge = fixed_layout_plan(EDGE, dp_shard=8)
    assert edge.usable_memory_gib < edge.mem_total_gib <= edge.device_memory_gib == 80.0
    cfg, p = resolved(EDGE)
    assert (cfg.parallelism.dp_shard, cfg.parallelism.tp) == (4, 2)
    assert p.mem_total_gib <= p.usable_memory_gib == pytest.approx(80.0 * (1 - ClusterConfig.memory_headroom))
    out = capsys.readouterr().out
    assert (f"parallelism=auto memory: estimated peak per rank <= {p.usable_memory_gib:.1f} GiB usable "
            f"(80 GiB device, cluster.memory_headroom={ClusterConfig.memory_headroom} kept free)") in out
    assert f"faster dp_shard=8 needs {edge.mem_total_gib:.1f} GiB/rank" in out
    # the plan reports the estimate, the headroom and the device memory
    assert f"(exceeds the {edge.usable_memory_gib:.1f} GiB usable)" in edge.format()
    row = [r for r in edge.format().splitlines() if r.startswith("device memory / headroom")]
    assert row[0].split(None, 4)[-1] == (f"80 GiB / {ClusterConfig.memory_headroom:.0%} kept free -> "
                                         f"{edge.usable_memory_gib:.1f} GiB usable")
    cfg, p = resolved([*EDGE, "cluster.memory_headroom=0"])  # trusting the estimate: pure FSDP
    assert (cfg.parallelism.dp_shard, cfg.parallelism.tp) == (8, 1)
    assert p.mem_total_gib == pytest.approx(edge.mem_total_gib) and p.usable_memory_gib == 80.0


@pytest.mark.parametrize("value", ["-0.1", "1", "1.5"])
def test_memory_headroom_out_of_range_is_a_one_line_error(value):
    """Checked by auto (before validation) and by validation (for the runs that never plan)."""
    for check in (resolved_spec, lambda cfg: validate(cfg, environment=False)):
        with pytest.raises(ConfigError) as e:
            check(compose_cfg([*EDGE, f"cluster.memory_headroom={value}"]))
        assert str(e.value) == (f"cluster.memory_headroom={float(value)} must be within [0, 1): the fraction of "
                                "device memory the planner keeps free (0 = none)")


def test_launch_builds_the_spec_once(monkeypatch, capsys):
    """parallelism=auto: the planner chooses from the spec that validation then checks and the dry
    run plans; nothing composes or builds the groups a second time in the process."""
    from titan_hydra import validate as validation
    from titan_hydra.launch import entry, resolve

    built = []

    def counting(cfg):
        built.append(cfg)
        return spec_of(cfg)

    monkeypatch.setattr(resolve, "spec_of", counting)
    monkeypatch.setattr(validation, "spec_of", counting)
    cfg = compose_cfg(["model=llama3_8b", *H100, "training.local_batch_size=1", "dry_run=true"])
    entry.launch(cfg)
    assert len(built) == 1 and cfg.parallelism.name.startswith("auto:")
    assert f"chose {cfg.parallelism.name[len('auto:'):].replace(',', ' ')}" in capsys.readouterr().out


def test_long_sequences_consider_context_parallel():
    cfg = compose_cfg(["model=llama3_8b", "cluster=slurm_h100", "parallelism=auto", "training.seq_len=65536",
                       "training.local_batch_size=1"])
    cands = auto.enumerate_candidates(spec_of(cfg))
    assert {c.cp for c in cands} == {1, 2, 4, 8}
    assert all(c.tp * c.cp <= 8 for c in cands)
    short = auto.enumerate_candidates(spec_of(compose_cfg(["model=llama3_8b", *H100])))
    assert {c.cp for c in short} == {1}


@pytest.mark.slow
@pytest.mark.extended
def test_debug_model_trains_with_auto_on_two_cpu_processes(tmp_path, run_cache, record_property):
    run_dir = tmp_path / "run"
    args = BASE + ["parallelism=auto", "cluster.nproc_per_node=2",
                   f"training.local_batch_size={GLOBAL_BATCH // 2}", f"hydra.run.dir={run_dir}"]
    proc = run_launch(args, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "parallelism=auto chose dp_shard=2:" in proc.stdout  # FSDP: no TP traffic on CPU
    losses = series(run_dir, "loss")
    assert len(losses) == STEPS
    assert_parity(losses, reference_losses(run_cache), atol=parity_bound(run_cache), label="auto fsdp", record=record_property)


@pytest.mark.slow
def test_launch_nothing_fits_one_line_error(tmp_path):
    proc = run_launch(["parallelism=auto", "model=llama3_70b", "cluster=slurm_h100", "training.seq_len=8192",
                       "training.local_batch_size=1", "activation_checkpoint=selective_op", "data.max_documents=1"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    assert lines[-1].startswith("error: parallelism=auto: model=llama3_70b does not fit on 1x8 devices")
    assert "the device has 80 GiB" in lines[-1]


@pytest.mark.slow
def test_launch_dry_run_prints_the_choice(tmp_path):
    ov = ["parallelism=auto", "model=llama3_70b", "cluster=slurm_h100", "cluster.nnodes=8", "training.seq_len=8192",
          "training.local_batch_size=1", "activation_checkpoint=selective_op", "data.max_documents=1"]
    proc = run_launch(["dry_run=true", *ov], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg, p = resolved(ov)
    assert (cfg.parallelism.dp_shard, cfg.parallelism.tp) == (16, 4)
    assert f"parallelism=auto chose dp_shard=16 tp=4: fits ({p.mem_total_gib:.3g} GiB/rank)" in proc.stdout
    assert "64 / dp_replicate=1 dp_shard=16 tp=4 pp=1 cp=1" in proc.stdout
    assert f"memory per rank: peak         {p.mem_total_gib:.3f} GiB (fits)" in proc.stdout
    assert f"80 GiB / {ClusterConfig.memory_headroom:.0%} kept free -> {p.usable_memory_gib:.1f} GiB usable" in proc.stdout


def _candidate(overrides, **degrees):
    spec = spec_of(compose_cfg(overrides))
    found = [c for c in auto.candidates(spec) if all(getattr(c, k) == v for k, v in degrees.items())]
    assert len(found) == 1, found
    return spec, found[0]


def test_a_pipeline_deeper_than_the_local_batch_gets_one_sample_per_microbatch():
    """1F1B needs a microbatch per stage: pp=16 with the default local batch of 8 was refused;
    auto raises the local batch to 16 (16 microbatches of one sample) and the launch rules accept it."""
    ov = ["model=llama3_405b", *H100, "cluster.nnodes=64"]
    spec, c = _candidate(ov, dp_replicate=1, tp=8, pp=16)
    assert spec.batch.local == 8 and spec.dims.pp_schedule == "1F1B"
    assert (c.local_batch, c.pp_microbatches, c.invalid) == (16, 16, "")
    on = auto.candidate_spec(spec, c)
    assert (on.batch.local, on.batch.grad_accum, on.batch.global_) == (16, 1, 16 * on.dims.dp_degree)
    assert auto.layout_problem(on) == ""
    # the user's own microbatch count is kept, and refused as before
    _, mine = _candidate([*ov, "parallelism.pp_microbatches=8"], dp_replicate=1, tp=8, pp=16)
    assert mine.local_batch == 0 and "pp_microbatches=8" in mine.invalid


def test_auto_keeps_the_runs_batch_when_a_layout_at_it_fits(capsys):
    """With global_batch_size=-1 a pipeline fed a larger local batch grows the global batch, and its
    amortized communication would win the speed ranking: it is taken only when nothing fits at the
    run's batch. 405B at the default 8 x 2048 on 64 H100 nodes: dp_shard=64 tp=8 fits at local
    batch 8; dp_shard=4 tp=4 pp=32 is estimated faster only at local batch 32."""
    ov = ["model=llama3_405b", "cluster=slurm_h100", "parallelism=auto", "cluster.nnodes=64"]
    cands = auto.candidates(spec_of(compose_cfg(ov)))
    chosen = auto.choose(cands)
    assert (chosen.describe(), chosen.local_batch, chosen.grows_global_batch) == ("dp_shard=64 tp=8", 0, False)
    grown = [c for c in cands if c.fits and not c.invalid and c.grows_global_batch]
    assert grown and max(c.tokens_per_s for c in grown) > chosen.tokens_per_s
    order = auto.ranked(cands)  # the order auto_verify simulates in: the run's batch first
    assert [c for c in order if c.fits][0] is chosen
    assert [c.grows_global_batch for c in order] == sorted(c.grows_global_batch for c in order)
    cfg, _ = resolved(ov)
    assert cfg.training.local_batch_size == 8
    assert "faster dp_shard=4 tp=4 pp=32 needs a larger global batch (local batch 32 in 32 microbatches" in capsys.readouterr().out
    # with the global batch fixed, the larger local batch only shrinks accumulation: ranked by speed alone
    fixed = auto.candidates(spec_of(compose_cfg([*ov, "training.global_batch_size=4096"])))
    assert not any(c.grows_global_batch for c in fixed)
    fastest = max((c for c in fixed if c.fits and not c.invalid), key=lambda c: c.tokens_per_s)
    assert auto.choose(fixed).tokens_per_s >= (1 - auto.TIE_TOLERANCE) * fastest.tokens_per_s


def test_a_fixed_global_batch_stays_fixed_when_auto_feeds_the_pipeline():
    """With training.global_batch_size set, the larger local batch comes out of gradient accumulation."""
    ov = ["model=llama3_405b", *H100, "cluster.nnodes=64", "training.global_batch_size=4096"]  # 8 x 512 ranks
    spec, c = _candidate(ov, dp_replicate=1, tp=8, pp=16)  # dp 4
    at_eight = auto.candidate_spec(spec, dataclasses.replace(c, local_batch=0, pp_microbatches=8))
    on = auto.candidate_spec(spec, c)
    assert (at_eight.batch.local, at_eight.batch.grad_accum, at_eight.batch.global_) == (8, 128, 4096)
    assert (c.local_batch, on.batch.local, on.batch.grad_accum, on.batch.global_) == (16, 16, 64, 4096)
