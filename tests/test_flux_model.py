"""FLUX.1 MMDiT: parity with diffusers' FluxTransformer2DModel (outputs and weights; state dicts
and whole directories through recipes/convert.py, both ways), its published parameter counts, latent packing as FluxPipeline does it, one-line shape errors, and init_weights
on a meta-built model. Everything runs on tiny random configs in fp32, on CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from diffusers import FluxPipeline, FluxTransformer2DModel

from titan_hydra.models.flux.diffusers_io import (
    args_from_diffusers_config, diffusers_config, from_diffusers_state, to_diffusers_state,
)
from titan_hydra.models.flux.model import Flux, FluxArgs, image_ids, patchify, text_ids, unpatchify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
import convert as convert_recipe  # noqa: E402  (recipes/convert.py)
from titan_hydra.checkpoint import convert  # noqa: E402  (read_model)
from numerics import assert_fp32_close  # noqa: E402

TINY = dict(dim=64, n_heads=4, n_double_blocks=2, n_single_blocks=2, context_dim=32, pooled_dim=16,
            in_channels=64, axes_dim=[4, 6, 6])
# FLUX.1 [dev]'s shape (black-forest-labs/FLUX.1-dev transformer/config.json); schnell drops guidance
DEV = dict(dim=3072, n_heads=24, n_double_blocks=19, n_single_blocks=38, context_dim=4096, pooled_dim=768,
           in_channels=64, guidance_embed=True)
DEV_PARAMS = 11_901_408_320  # published size of FLUX.1 [dev]'s transformer
SCHNELL_PARAMS = 11_891_178_560  # dev less the guidance embedder (2 linears: 256 -> 3072 -> 3072)
# Neither side has an fp64 form (our layer norms and rotary compute in fp32 whatever the dtype;
# diffusers' rotary too), so outputs are held to numerics.FP32_REL of the largest value: fp32 unit
# roundoff times 1e4 terms (4 blocks of ~6 matmuls whose sums have <= 256 terms)
GRID = (4, 4)  # patch rows, cols: 16 image tokens
TXT_LEN = 8


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random and O(1)-preserving, modulations and norms included: the real init
    zeroes the gates and the final layer, which would make the parity check vacuous."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g)
        if p.dim() == 2:
            p.copy_(noise / p.shape[1] ** 0.5)
        elif "norm" in name:
            p.copy_(1 + 0.1 * noise)
        else:
            p.copy_(0.1 * noise)


def inputs(args: FluxArgs, seed: int = 7) -> dict[str, torch.Tensor | None]:
    g = torch.Generator().manual_seed(seed)
    b, n_img = 2, GRID[0] * GRID[1]
    return {"img": torch.randn(b, n_img, args.in_channels, generator=g), "img_ids": image_ids(*GRID),
            "txt": torch.randn(b, TXT_LEN, args.context_dim, generator=g), "txt_ids": text_ids(TXT_LEN),
            "timesteps": torch.rand(b, generator=g).clamp(0.05, 0.95),
            "y": torch.randn(b, args.pooled_dim, generator=g),
            "guidance": torch.tensor([3.5, 5.0]) if args.guidance_embed else None}


@torch.no_grad()
def diffusers_forward(model: FluxTransformer2DModel, x: dict) -> torch.Tensor:
    """As FluxPipeline calls it: timestep = t in [0, 1] (its scheduler's t*1000, divided by 1000),
    guidance = the raw scale; the transformer multiplies both by 1000 itself."""
    return model(hidden_states=x["img"], encoder_hidden_states=x["txt"], pooled_projections=x["y"],
                 timestep=x["timesteps"], img_ids=x["img_ids"], txt_ids=x["txt_ids"], guidance=x["guidance"],
                 return_dict=False)[0]


def ours_with_seed(seed: int, **extra) -> Flux:
    torch.manual_seed(seed)
    model = Flux(**TINY, **extra)
    model.init_weights()
    randomize(model, seed)
    return model.eval()


@pytest.mark.parametrize("guidance", [False, True], ids=["schnell", "dev"])
def test_ours_to_diffusers_matches_outputs(guidance):
    ours = ours_with_seed(0, guidance_embed=guidance)
    theirs = FluxTransformer2DModel(**diffusers_config(ours.args)).eval()
    theirs.load_state_dict(to_diffusers_state(ours.state_dict(), ours.args), strict=True)
    x = inputs(ours.args)
    with torch.no_grad():
        out = ours(**x)
        batched_ids = ours(**{**x, "img_ids": image_ids(*GRID, batch=2), "txt_ids": text_ids(TXT_LEN, batch=2)})
    ref = diffusers_forward(theirs, x)
    assert out.shape == ref.shape == x["img"].shape
    assert ref.abs().mean() > 0.1  # a real signal, not the zero output of a fresh init
    assert_fp32_close({"out": out}, {"out": ref})
    assert torch.equal(batched_ids, out)


@pytest.mark.parametrize("guidance", [False, True], ids=["schnell", "dev"])
def test_diffusers_to_ours_matches_outputs(guidance):
    args = FluxArgs(**TINY, guidance_embed=guidance)
    torch.manual_seed(1)
    theirs = FluxTransformer2DModel(**diffusers_config(args)).eval()
    randomize(theirs, 1)
    assert args_from_diffusers_config(dict(theirs.config)) == args
    ours = Flux(**TINY, guidance_embed=guidance).eval()
    ours.load_state_dict(from_diffusers_state(theirs.state_dict(), args), strict=True)
    x = inputs(args, seed=8)
    with torch.no_grad():
        out = ours(**x)
    assert_fp32_close({"out": out}, {"out": diffusers_forward(theirs, x)})


@pytest.mark.parametrize("guidance", [False, True], ids=["schnell", "dev"])
def test_state_round_trips_are_bitwise(guidance):
    ours = ours_with_seed(2, guidance_embed=guidance)
    sd = ours.state_dict()
    there = to_diffusers_state(sd, ours.args)
    back = from_diffusers_state(there, ours.args)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)
    again = to_diffusers_state(back, ours.args)
    assert again.keys() == there.keys() and all(torch.equal(again[k], there[k]) for k in there)
    # final adaLN: ours (shift, scale), diffusers (scale, shift)
    d = ours.args.dim
    assert torch.equal(there["norm_out.linear.weight"][:d], sd["final_layer.mod.weight"][d:])
    # single blocks: diffusers' proj_out reads [attention | MLP]; ours is attn_out + mlp_out
    fused = there["single_transformer_blocks.0.proj_out.weight"]
    assert torch.equal(fused, torch.cat([sd["single_blocks.0.attn_out.weight"], sd["single_blocks.0.mlp_out.weight"]], 1))


def _convert(*argv: str) -> None:
    assert convert_recipe.main(list(argv)) == 0


@pytest.mark.parametrize("guidance", [False, True], ids=["schnell", "dev"])
def test_convert_recipe_round_trips_diffusers_directories(tmp_path, guidance):
    """diffusers save_pretrained -> convert.py from-hf (a model-only DCP step) -> our model: same
    outputs; -> convert.py to-hf -> FluxTransformer2DModel.from_pretrained: same tensors, same outputs."""
    args = FluxArgs(**TINY, guidance_embed=guidance)
    torch.manual_seed(3)
    theirs = FluxTransformer2DModel(**diffusers_config(args)).eval()
    randomize(theirs, 3)
    theirs.save_pretrained(tmp_path / "diffusers")
    _convert("from-hf", str(tmp_path / "diffusers"), str(tmp_path / "ckpt" / "step-0"))
    family, got_args, sd = convert.read_model(tmp_path / "ckpt" / "step-0")
    assert family.name == "flux" and got_args == args
    ours = Flux(**TINY, guidance_embed=guidance).eval()
    ours.load_state_dict(sd, strict=True)
    x = inputs(args, seed=9)
    with torch.no_grad():
        assert_fp32_close({"out": ours(**x)}, {"out": diffusers_forward(theirs, x)})

    _convert("to-hf", str(tmp_path / "ckpt" / "step-0"), str(tmp_path / "back"))
    again = FluxTransformer2DModel.from_pretrained(tmp_path / "back").eval()
    def shape(cfg):
        return {k: v for k, v in dict(cfg).items() if not k.startswith("_")}

    assert shape(again.config) == shape(theirs.config)
    ref = theirs.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in again.state_dict().items()) and again.state_dict().keys() == ref.keys()
    assert torch.equal(diffusers_forward(again, x), diffusers_forward(theirs, x))


@pytest.mark.parametrize("guidance, published", [(True, DEV_PARAMS), (False, SCHNELL_PARAMS)], ids=["dev", "schnell"])
def test_full_size_parameter_counts_and_layout(guidance, published):
    with torch.device("meta"):
        ours = Flux(**{**DEV, "guidance_embed": guidance})
        theirs = FluxTransformer2DModel(**diffusers_config(ours.args))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters()) == published
    converted, expected = to_diffusers_state(ours.state_dict(), ours.args), theirs.state_dict()
    assert converted.keys() == expected.keys()
    assert all(converted[k].shape == expected[k].shape for k in expected)


def test_packing_matches_flux_pipeline():
    latents = torch.randn(2, 16, 8, 6)  # [B, C, H, W]: a 4x3 patch grid
    tokens = patchify(latents)
    assert torch.equal(tokens, FluxPipeline._pack_latents(latents, 2, 16, 8, 6))
    vae_scale = 8  # the pipeline's unpack takes pixel sizes and the VAE's downscale factor
    assert torch.equal(unpatchify(tokens, 8, 6), FluxPipeline._unpack_latents(tokens, 8 * vae_scale, 6 * vae_scale,
                                                                              vae_scale))
    assert torch.equal(unpatchify(tokens, 8, 6), latents)
    ref_ids = FluxPipeline._prepare_latent_image_ids(2, 4, 3, "cpu", torch.float32)
    assert torch.equal(image_ids(4, 3), ref_ids)
    assert image_ids(4, 3, batch=2).shape == (2, 12, 3) and not text_ids(5).any()
    with pytest.raises(ValueError, match="even"):
        patchify(torch.zeros(1, 16, 7, 6))


@pytest.mark.parametrize("change, key", [
    ({"dim": 66}, "model.dim"),
    ({"axes_dim": [4, 6, 8]}, "model.axes_dim"),
    ({"axes_dim": [5, 5, 6]}, "model.axes_dim"),
    ({"axes_dim": [8, 8]}, "model.axes_dim"),
    ({"time_dim": 255}, "model.time_dim"),
])
def test_bad_shapes_are_one_line_errors_naming_the_key(change, key):
    with pytest.raises(ValueError) as err:
        FluxArgs(**{**TINY, **change})
    assert key in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("bad", [
    lambda: diffusers_config(FluxArgs(**TINY, qkv_bias=False)),
    lambda: diffusers_config(FluxArgs(**TINY, mlp_ratio=2.0)),
    lambda: args_from_diffusers_config({**diffusers_config(FluxArgs(**TINY)), "patch_size": 2}),
    lambda: args_from_diffusers_config({**diffusers_config(FluxArgs(**TINY)), "out_channels": 32}),
    lambda: args_from_diffusers_config({**diffusers_config(FluxArgs(**TINY)), "mystery": 1}),
    lambda: from_diffusers_state({}, FluxArgs(**TINY)),
    lambda: Flux(**TINY)(**inputs(FluxArgs(**TINY, guidance_embed=True))),  # guidance given, model has none
], ids=["qkv_bias", "mlp_ratio", "patch_size", "out_channels", "unknown_key", "empty_state", "stray_guidance"])
def test_what_cannot_be_represented_is_a_one_line_error(bad):
    with pytest.raises(ValueError) as err:
        bad()
    assert "\n" not in str(err.value)


def test_init_weights_on_meta_is_complete_deterministic_and_starts_at_zero():
    def build(seed: int) -> Flux:
        with torch.device("meta"):
            model = Flux(**TINY, guidance_embed=True)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))  # whatever init_weights misses stays NaN
        torch.manual_seed(seed)
        model.init_weights()
        return model

    a, b, c = build(0).state_dict(), build(0).state_dict(), build(1).state_dict()
    assert all(torch.isfinite(t).all() for t in a.values())
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["double_blocks.0.img_attn.q.weight"], c["double_blocks.0.img_attn.q.weight"])
    assert not a["single_blocks.1.mod.weight"].any() and not a["final_layer.linear.weight"].any()
    model = build(0)
    with torch.no_grad():
        assert not model(**inputs(model.args)).any()  # adaLN-Zero: velocity 0 at step 0
