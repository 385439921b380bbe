"""FLUX.1 through the engine: the first family whose batch is not tokens and whose loss is not
cross-entropy. The examples are layout-invariant (noise, timesteps and caption dropout keyed by
the global stream position), so data-parallel layouts match one process step for step in fp32;
tensor and context parallel match it too; a resumed run continues exactly; throughput counts
images; layouts Flux has no plan for are refused in one line before anything is built.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from titan_hydra.spec import spec_of
from helpers import (by_step, compose_cfg, float8_bound, launch_here, param_count, read_metrics, run_launch, series,
                     series_bounds)
from numerics import U32
from titan_hydra.errors import ConfigError
from titan_hydra.validate import validate

STEPS = 8
# What layouts, resumes and compile are compared on; each may differ from one process by what
# rounding alone moves that series by here (helpers.series_bounds: the same run accumulated 2 x 4)
KEYS = ("loss", "grad_norm", "val/loss")
FLUX = [
    "experiment=flux_debug",
    "data.num_images=48",
    "data.examples.max_text_len=32",  # truncated captions: parity and resume do not need them whole
    # the recipe's settings before its fidelity tuning, which these tests' tolerances were measured with
    "data.examples.tokenizer=bytes",
    "data.examples.timestep_shift=1.0",
    "optimizer.lr=1e-3",
    "data.holdout=0.0",
    f"training.steps={STEPS}",
    "training.global_batch_size=8",
    "training.mixed_precision=fp32",
    "training.init_mode=full",
    "training.val_freq=4",
    "training.val_steps=1",
    "training.val_local_batch_size=4",
    "lr_scheduler.warmup_steps=2",
    "logger=minimal",
    "cluster.threads_per_proc=1",
    "checkpoint.enable=false",
    "eval.sample_every=0",  # pictures are tested on their own (flux_debug draws them every 100 steps and at the end)
    "eval.fidelity_every=0",  # so is fidelity (flux_debug scores held-out captions every 500 steps and at the end)
]


def run_in_process(tmp_path: Path, overrides: list[str]) -> list[dict]:
    from titan_hydra.train.pretrain import run

    run_dir = tmp_path / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    run(spec_of(compose_cfg(FLUX + ["training.local_batch_size=8", *overrides])), str(run_dir))
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> list[dict]:
    return run_in_process(tmp_path_factory.mktemp("flux_single"), [])


def bounds_of(tmp_path: Path, ref: list[dict], overrides: list[str] = ()) -> dict[str, float]:
    """Per compared series of ``ref`` (the one-process run with ``overrides``), what rounding alone
    moves it by: the same run accumulated as 2 x 4 (``helpers.series_bounds``)."""
    accumulated = run_in_process(tmp_path, [*overrides, "training.local_batch_size=4"])
    keys = [key for key in KEYS if series(ref, key)]
    return series_bounds({key: series(ref, key) for key in keys}, {key: series(accumulated, key) for key in keys},
                         param_count([*FLUX, "training.local_batch_size=8", *overrides]))


@pytest.fixture(scope="module")
def bounds(tmp_path_factory, single) -> dict[str, float]:
    return bounds_of(tmp_path_factory.mktemp("flux_accumulated"), single)


def build_dataset(num_images: int = 24):
    from titan_hydra.config import to_container
    from titan_hydra.data.settings import DataSettings
    from titan_hydra.train.services import build_dataset as build

    return build(DataSettings.of(to_container(compose_cfg(FLUX + [f"data.num_images={num_images}"]).data)))


def test_examples_are_the_same_in_every_data_parallel_layout():
    dataset = build_dataset()
    whole = dataset.loader("train", 4)
    halves = [dataset.loader("train", 2, dp_rank=r, dp_degree=2) for r in range(2)]
    for _ in range(3):
        inputs, target = next(whole)
        parts = [next(h) for h in halves]
        for key, value in inputs.items():
            assert torch.equal(value, torch.cat([p[0][key] for p in parts])), key
        assert torch.equal(target, torch.cat([p[1] for p in parts]))
    # resuming from the state continues with the next batch, under another layout too
    state = whole.state_dict()
    expected = next(whole)
    resumed = dataset.loader("train", 2, dp_rank=0, dp_degree=2)
    resumed.load_state_dict(state)
    assert torch.equal(next(resumed)[1], expected[1][:2])
    # validation: fixed timesteps and noise, the same on every pass
    first = [b[1] for b in dataset.loader("val", 2, infinite=False)]
    again = [b[1] for b in dataset.loader("val", 2, infinite=False)]
    assert all(torch.equal(a, b) for a, b in zip(first, again)) and len(first) == 1


def test_the_encoded_set_is_cached():
    a = build_dataset()
    b = build_dataset()  # a second build reads the cache: identical tensors
    for key, value in a._encoded["samples"].items():
        assert torch.equal(value, b._encoded["samples"][key]), key
    assert a.cache_key() == b.cache_key()


def test_trains_counting_images(single):
    train = [r for r in single if "loss" in r]
    assert len(train) == STEPS
    losses = [r["loss"] for r in train]
    assert losses[-1] < losses[0], losses  # falls from the zero-output init (velocity variance ~1)
    assert all("ips" in r and "tps" not in r for r in train if "mfu" in r)
    val = [r for r in single if "val/loss" in r]
    assert len(val) == 2 and all("val/ppl" not in r for r in val)  # perplexity means nothing here


def launch_layout(tmp_path: Path, layout: str, nproc: int, extra: list[str] = (), dp: int | None = None
                  ) -> tuple[Path, list[dict]]:
    """Launch ``layout`` on ``nproc`` ranks, ``dp`` of them data parallel (all unless given)."""
    run_dir = tmp_path / "run"
    dp = nproc if dp is None else dp
    launch_here(FLUX + [f"parallelism={layout}", f"cluster.nproc_per_node={nproc}",
                        f"training.local_batch_size={8 // dp}", f"training.val_local_batch_size={4 // dp}", *extra],
                run_dir)
    return run_dir, read_metrics(run_dir)


def assert_matches(got: list[dict], ref: list[dict], what: str, bounds: dict[str, float]) -> None:
    for key, bound in bounds.items():
        ours, theirs = series(got, key), series(ref, key)
        assert len(ours) == len(theirs) > 0, (what, key)
        diff = max(abs(a - b) for a, b in zip(ours, theirs))
        assert diff <= bound, (what, key, diff, bound, ours, theirs)


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    """2-rank FSDP with a checkpoint after step 4 (the resharded-resume test starts from it)."""
    return launch_layout(tmp_path_factory.mktemp("flux_fsdp"), "fsdp", 2,
                         ["checkpoint.enable=true", "checkpoint.interval=4"])


@pytest.mark.slow
def test_fsdp_matches_one_process(single, bounds, fsdp_run):
    assert_matches(fsdp_run[1], single, "fsdp", bounds)


@pytest.mark.parametrize("layout,nproc", [("ddp", 2), ("hsdp", 4)])
@pytest.mark.slow
@pytest.mark.extended
def test_data_parallel_matches_one_process(tmp_path, single, bounds, layout, nproc):
    """ddp, and hsdp 2 x 2 (reduce-scatter within a replica, all-reduce across)."""
    assert_matches(launch_layout(tmp_path, layout, nproc)[1], single, layout, bounds)


@pytest.mark.slow
def test_resharded_resume_continues_one_process_run(tmp_path, single, bounds, fsdp_run):
    """The FSDP run's step-4 checkpoint (2 shards) loaded by one process: steps 5..8 as the
    uninterrupted one-process run (DCP reshards; the data position is the global sample count)."""
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp_run[0] / "checkpoint" / "step-4", run_dir / "checkpoint" / "step-4")
    rows = run_in_process(tmp_path, ["checkpoint.enable=true", "checkpoint.interval=4"])
    resumed, reference = by_step(rows, "loss"), by_step(single, "loss")
    assert sorted(resumed) == [5, 6, 7, 8]
    diff = max(abs(resumed[s] - reference[s]) for s in resumed)
    assert diff <= bounds["loss"], (diff, bounds["loss"], resumed, reference)


@pytest.mark.extended
def test_compile_per_block_matches_eager(tmp_path):
    """compile=model captures each double- and single-stream block (family.blocks()) whole, as
    for decoders. The backend is aot_eager: dynamo's capture and AOT autograd are where a model
    breaks; inductor's code generation is model-agnostic, costs ~45 s of cold CPU compile for
    these two blocks, and runs in the decoder tests and `recipes/benchmark.py --suite flux`.
    AOT autograd's graphs may order the same sums otherwise: within the rounding floor."""
    small = ["model.n_double_blocks=1", "model.n_single_blocks=1", "training.steps=3", "training.val_freq=0"]
    eager = run_in_process(tmp_path / "eager", small)
    compiled = run_in_process(tmp_path / "compiled", [*small, "compile=model", "compile.backend=aot_eager"])
    assert_matches(compiled, eager, "compiled", bounds_of(tmp_path / "accumulated", eager, small))


@pytest.mark.extended
def test_float8_emulated_tracks_fp32(tmp_path, single, float8_conversions):
    """Every linear of the debug model (all widths are multiples of 16) trains in float8
    (tensor-wise scales, emulated on CPU): the losses follow fp32's closely but not exactly
    (within ``helpers.float8_bound`` of bf16 autocast's distance from fp32)."""
    from torch import nn

    from titan_hydra.models.registry import build_model

    converted = float8_conversions
    rows = run_in_process(tmp_path, ["float8=tensorwise", "float8.emulate=true", "float8.auto_filter_small_kn=false"])
    with torch.device("meta"):
        _, model = build_model(compose_cfg(FLUX).model)
    assert len(converted) == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    ours, ref = series(rows, "loss"), series(single, "loss")
    diff = max(abs(a - b) for a, b in zip(ours, ref))
    bound = float8_bound(series(run_in_process(tmp_path / "bf16", ["training.mixed_precision=bf16"]), "loss"), ref)
    assert len(ours) == len(ref) and 0 < diff <= bound, (diff, bound, ours, ref)


def test_sample_pictures_during_training_leave_the_run_unchanged(tmp_path, single):
    """eval.sample_every draws a row of pictures (one per prompt) from an unsharded copy of the
    weights at steps 4 and 8; training goes on exactly as without them."""
    from PIL import Image

    prompts = ["a red circle in the centre on a blue background", "a green square"]
    rows = run_in_process(tmp_path, ["eval.sample_every=4", f"eval.sample_prompts=[{','.join(map(repr, prompts))}]",
                                     "eval.sample_steps=2"])
    assert series(rows, "loss") == series(single, "loss") and series(rows, "val/loss") == series(single, "val/loss")
    logged = {r["step"]: r["samples"] for r in rows if "samples" in r}
    assert sorted(logged) == [4, 8]
    pictures = []
    for step, path in sorted(logged.items()):
        assert path.endswith(f"samples/samples-step{step:06d}.png")
        with Image.open(path) as grid:
            assert grid.size == (2 * 64, 64)
            pictures.append(np.asarray(grid))
    assert not np.array_equal(*pictures)  # drawn by the weights of their own step


def test_fidelity_during_training_is_logged_beside_val_loss_and_leaves_the_run_unchanged(tmp_path):
    """eval.fidelity_every draws one picture per held-out caption (data.holdout) from an unsharded
    copy at steps 4 and 8 and logs what it reads back as val/fidelity/*; training goes on exactly
    as without it."""
    from titan_hydra.data.shapes_reader import METRICS

    held_out = ["data.holdout=0.1"]
    plain = run_in_process(tmp_path / "plain", held_out)
    rows = run_in_process(tmp_path / "scored", [*held_out, "eval.fidelity_every=4", "eval.fidelity_prompts=4",
                                                "eval.sample_steps=2"])
    assert series(rows, "loss") == series(plain, "loss") and series(rows, "val/loss") == series(plain, "val/loss")
    scored = {r["step"]: r for r in rows if "val/fidelity/background" in r}
    assert sorted(scored) == [4, 8]
    for row in scored.values():
        assert all(0.0 <= row[f"val/fidelity/{k}"] <= 1.0 for k in METRICS)
        assert row["val/fidelity/background_and_colour"] <= min(row["val/fidelity/background"],
                                                                row["val/fidelity/colour"])


def test_guidance_distilled_flavor_trains_and_draws(tmp_path):
    """flux_dev's guidance embedding on the debug shape: the examples feed the scale it trains at,
    the loss falls, and the end-of-run pictures are drawn with the embedded (not classifier-free)
    guidance."""
    rows = run_in_process(tmp_path, ["model.guidance_embed=true", "data.examples.guidance=3.5", "eval.sample_every=8",
                                     "eval.sample_prompts=[a red circle]", "eval.sample_steps=2"])
    losses = series(rows, "loss")
    assert len(losses) == STEPS and all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert [r["step"] for r in rows if "samples" in r] == [8]


@pytest.mark.parametrize("ac", ["full", "selective_op"])
def test_activation_checkpointing_matches(tmp_path, single, ac):
    """AC wraps Flux's double- and single-stream blocks through family.blocks(), as for decoders."""
    rows = run_in_process(tmp_path, [f"activation_checkpoint={ac}"])
    assert series(rows, "loss") == series(single, "loss")  # the recomputed forward is the same ops: bit for bit


def test_resume_is_exact(tmp_path, single):
    ckpt = ["checkpoint.enable=true", "checkpoint.interval=4"]
    run_in_process(tmp_path, ckpt)
    shutil.rmtree(tmp_path / "run" / "checkpoint" / f"step-{STEPS}")  # as if killed after step 4's save
    rows = run_in_process(tmp_path, ckpt)  # same run dir: restores step 4 (weights, optimizer, data position)
    assert len(series(rows, "loss")) == STEPS + STEPS // 2  # the second run trained steps 5..8 only
    resumed = {s: v for s, v in by_step(rows, "loss").items() if s > 4}
    reference = {s: v for s, v in by_step(single, "loss").items() if s > 4}
    assert resumed.keys() == reference.keys() and resumed == reference  # bit-identical


@pytest.mark.parametrize("flavor", ["flux_debug", "flux_schnell", "flux_dev"])
def test_flavor_parameter_counts_equal_diffusers(flavor):
    """Every conf/model/flux_*.yaml against diffusers' FluxTransformer2DModel of the same config,
    both built on the meta device (dev: 11,901,408,320, FLUX.1-dev's published count)."""
    diffusers = pytest.importorskip("diffusers")
    from titan_hydra.models.flux.diffusers_io import diffusers_config
    from titan_hydra.models.registry import args_of, build_model

    cfg = compose_cfg([f"model={flavor}"])
    family, args = args_of(cfg.model)
    with torch.device("meta"):
        _, ours = build_model(cfg.model)
        theirs = diffusers.FluxTransformer2DModel(**diffusers_config(args))
    count = sum(p.numel() for p in ours.parameters())
    assert count == family.shape(args).params == sum(p.numel() for p in theirs.parameters())
    if flavor == "flux_dev":
        assert count == 11_901_408_320


# Tensor parallel: whole heads and MLP slices per rank (column-wise in, row-wise out, QK norms on
# the local heads). Context parallel: image and text tokens, their position ids and the target
# split along the joint sequence, attention as a ring (not causal: any equal split is exact).
@pytest.mark.parametrize("layout,extra", [("tp", ["parallelism.tp_sequence_parallel=false"]), ("cp", [])])
@pytest.mark.slow
@pytest.mark.extended
def test_tensor_and_context_parallel_match_one_process(tmp_path, single, bounds, layout, extra):
    _, rows = launch_layout(tmp_path, layout, 2, extra, dp=1)
    assert_matches(rows, single, layout, bounds)


@pytest.mark.parametrize("overrides,match", [
    (["parallelism=pp", "cluster.nproc_per_node=2"], r"parallelism.pp=2 is not supported for model.family=flux"),
    (["parallelism=tp", "cluster.nproc_per_node=2"], r"tp_sequence_parallel=true is not supported .* set "
                                                     r"parallelism.tp_sequence_parallel=false"),
    (["parallelism=cp", "cluster.nproc_per_node=2", "data.examples.max_text_len=30"],
     r"text tokens per sample \(30\) must be divisible by 2\*parallelism.cp=4 .* change data.examples.max_text_len"),
    (["model.guidance_embed=true"], r"model.guidance_embed=true .* set data.examples.guidance=3.5"),
    (["data.examples.guidance=3.5"], r"data.examples.guidance=3.5: model.guidance_embed=false has no guidance"),
    (["eval.sample_every=100", "eval.sample_prompts=[]"], r"eval.sample_every=100 needs prompts: set eval.sample_prompts="),
    (["eval.freq=10"], r"eval.freq=10: the lm-eval harness scores language models, not model family 'flux'"),
], ids=["pp", "tp_sequence_parallel", "cp_uneven_text", "guidance_unfed", "guidance_unused",
        "samples_without_prompts", "harness"])
def test_what_it_cannot_run_is_refused_in_one_line(overrides, match):
    cfg = compose_cfg(FLUX + ["training.local_batch_size=8", *overrides])
    with pytest.raises(ConfigError, match=match) as err:
        validate(cfg)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.extended
def test_generate_image_writes_a_grid_from_the_newest_checkpoint(tmp_path):
    from PIL import Image

    from helpers import REPO

    run_dir = tmp_path / "run"
    proc = run_launch(FLUX + ["training.steps=2", "training.val_freq=0", "training.local_batch_size=8",
                              "lr_scheduler.warmup_steps=1", "checkpoint.enable=true", f"hydra.run.dir={run_dir}"],
                      cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "grid.png"
    gen = subprocess.run([sys.executable, str(REPO / "recipes" / "generate_image.py"), str(run_dir),
                          "--prompt", "a red circle in the centre on a blue background", "--prompt", "a green square",
                          "--per-prompt", "3", "--steps", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert "checkpoint/step-2" in gen.stdout
    for noise in ("register_constant", "Failed to load", "Unable to import"):  # torchao/diffusers at import
        assert noise not in proc.stderr and noise not in gen.stderr, noise
    with Image.open(out) as grid:
        assert grid.size == (3 * 64, 2 * 64)  # a row per prompt, a column per sample
        pixels = np.asarray(grid)
    assert pixels.std() > 0  # decoded pictures, not a blank canvas
    bad = subprocess.run([sys.executable, str(REPO / "recipes" / "generate_image.py"), str(tmp_path / "nowhere"),
                          "--prompt", "x"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "does not exist" in bad.stderr


def test_autoencoders():
    """The kl path is diffusers' AutoencoderKL with FLUX.1's normalization, exactly; the dct one
    (the tiny default) is an orthonormal projection: decoding then encoding gives the latents back."""
    from titan_hydra.models.flux.encoders import LATENT_SCALE, LATENT_SHIFT, DCTAutoencoder, FluxEncoders

    images = torch.randint(0, 256, (2, 32, 32, 3), dtype=torch.uint8)
    kl = FluxEncoders.tiny(16, 8, autoencoder="kl")
    latents = kl.encode_images(images)
    pixels = images.permute(0, 3, 1, 2).float() / 127.5 - 1.0
    vae = kl.autoencoder.vae
    assert torch.equal(latents, (vae.encode(pixels).latent_dist.mode() - LATENT_SHIFT) * LATENT_SCALE)
    assert latents.shape == (2, 16, 4, 4)
    assert torch.equal(kl.autoencoder.decode(latents), vae.decode(latents / LATENT_SCALE + LATENT_SHIFT).sample)

    # fp32 rounding only, by the classical bound: a product of a matrix with orthonormal rows (or
    # its transpose, whose columns then have norm <= 1) and a vector x rounds each entry by at most
    # (n + 1) unit roundoffs times |x| (n: the terms summed, Cauchy-Schwarz for the sum of |terms|);
    # the fp64 basis rounded to fp32 adds one more. A 192-term projection and its 16-term inverse:
    dct = DCTAutoencoder()
    n = 192 + 16 + 2 * 2
    assert (dct.basis @ dct.basis.T - torch.eye(16)).abs().max() <= (192 + 2) * U32
    z = dct.encode(pixels)
    z_norm = z.norm(dim=1).max() / dct.SCALE  # the largest patch's coefficients, unscaled
    assert (dct.encode(dct.decode(z)) - z).abs().max() <= n * U32 * z_norm * dct.SCALE
    flat = torch.full((1, 3, 16, 16), 0.5)  # a flat colour is kept (the DC terms)
    assert (dct.decode(dct.encode(flat)) - flat).abs().max() <= n * U32 * 0.5 * 192**0.5


def test_local_images_folder_and_jsonl(tmp_path):
    """Your own pictures: a folder of images with <name>.txt captions, or a JSONL of
    {"image", "text"}; a missing caption or a bad line is one line naming the file."""
    from PIL import Image

    from titan_hydra.data.image_caption import folder_dataset, jsonl_dataset
    from titan_hydra.errors import DataError

    folder = tmp_path / "pics"
    folder.mkdir()
    for i, colour in enumerate(["red", "blue", "green"]):
        Image.new("RGB", (40 + 8 * i, 32), colour).save(folder / f"{i}.png")  # not square: centre-cropped
        (folder / f"{i}.txt").write_text(f"a {colour} picture\n")
    images, captions = folder_dataset(str(folder), 16, None)
    assert images.shape == (3, 16, 16, 3) and captions == ["a red picture", "a blue picture", "a green picture"]
    assert tuple(images[0, 8, 8]) == (255, 0, 0)
    lines = [f'{{"image": "pics/{i}.png", "text": "picture {i}"}}' for i in range(3)]
    (tmp_path / "data.jsonl").write_text("\n".join(lines) + "\n")
    images2, captions2 = jsonl_dataset(str(tmp_path / "data.jsonl"), 16, 2)
    assert (images2 == images[:2]).all() and captions2 == ["picture 0", "picture 1"]
    (folder / "1.txt").unlink()
    with pytest.raises(DataError, match="1.png has no caption file 1.txt"):
        folder_dataset(str(folder), 16, None)
    (tmp_path / "bad.jsonl").write_text('{"image": "pics/0.png"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:1 is not a JSON object"):
        jsonl_dataset(str(tmp_path / "bad.jsonl"), 16, None)
