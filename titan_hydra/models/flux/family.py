"""FLUX.1 as a model family: what the engine may ask of it (``models/protocol.ModelFamily``).

The first family whose batch is not tokens and whose loss is not cross-entropy. Its objective
(``FlowMatching``) regresses the rectified-flow velocity and counts images; the batch is a dict
of keyword inputs (``examples.FluxExamples`` makes it); the engine's runner, trainer,
checkpointing and metrics take it through the protocol without naming the family.

Layouts: data parallel (FSDP, HSDP, DDP), tensor parallel (``tp_plan``; without sequence
parallel), context parallel over the joint image + text sequence (the objective names the
tensors to shard: ``FlowMatching.sequence_buffers``), activation checkpointing and compile per
block run as for the language families. Pipeline and expert parallelism are refused with one
line: PP stages would pass the image and text streams plus the conditioning vector between
stages, and Flux has no experts.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.flux.diffusers_io import FluxDiffusersAdapter
from titan_hydra.models.flux.examples import image_tokens_of
from titan_hydra.models.flux.model import Flux, FluxArgs, image_ids, text_ids
from titan_hydra.models.flux.sampling import sample_images
from titan_hydra.models.objective import Objective
from titan_hydra.models.protocol import (DrawsSamples, ModelFamily, ModelShape, SampleSettings, ShapesBatches,
                                         SizesSamples)


class FlowMatching(Objective):
    """Mean squared error between the predicted and the true velocity (fp32); counts images."""

    unit = "image"
    rate_key = "ips"

    def loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), target.float())

    def units(self, inputs: dict[str, torch.Tensor]) -> int:
        return int(inputs["img"].shape[0])

    def sequence_buffers(self, inputs: dict[str, torch.Tensor], target: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
        """Image tokens, text tokens, their position ids and the target velocity, each split along
        its token dim. Joint attention is not causal, so each rank may hold any equal share of
        image and text tokens: queries meet every rank's keys on the ring, and each token keeps the
        rotary angle of its own position id."""
        return [(inputs[name], 1) for name in ("img", "img_ids", "txt", "txt_ids")] + [(target, 1)]


FLOW_MATCHING = FlowMatching()

# Parameters by what they run over: once per image (conditioning: timestep, guidance and pooled
# text embedders, every adaLN modulation), per image token, per text token, or per token of
# either stream (the single-stream blocks).
_PER_IMAGE = ("time_in.", "guidance_in.", "vector_in.", "_mod.", ".mod.", "final_layer.mod.")
_IMAGE_TOKENS = ("img_in.", "img_attn.", "img_mlp.", "final_layer.linear.")
_TEXT_TOKENS = ("txt_in.", "txt_attn.", "txt_mlp.")


def parameter_groups(args: FluxArgs) -> dict[str, int]:
    """Parameter counts of a meta-built model by what they run over (see above)."""
    with torch.device("meta"):
        model = Flux(**FluxFamily().args_fields(args))
    groups = {"image": 0, "per_image_token": 0, "per_text_token": 0, "per_token": 0}
    for name, p in model.named_parameters():
        if any(tag in name for tag in _PER_IMAGE):
            groups["image"] += p.numel()
        elif any(name.startswith(tag) or f".{tag}" in name for tag in _IMAGE_TOKENS):
            groups["per_image_token"] += p.numel()
        elif any(name.startswith(tag) or f".{tag}" in name for tag in _TEXT_TOKENS):
            groups["per_text_token"] += p.numel()
        else:
            groups["per_token"] += p.numel()
    return groups


# What a Flux run needs from its data settings (``FluxFamily.require``): image-caption data, and for a
# guidance-distilled flavor the scale it was distilled at (FLUX.1 [dev]'s default, as in diffusers).
NEEDS_IMAGE_DATA = "model.family=flux trains on image-caption data"
IMAGE_DATA = "data=flux_shapes"
OWN_IMAGES = "or data=flux_images with data.path for your own images"
DEV_GUIDANCE = 3.5


class FluxFamily(ModelFamily, SizesSamples, DrawsSamples, ShapesBatches):
    name = "flux"
    args_cls = FluxArgs
    model_cls = Flux
    objective = FLOW_MATCHING
    hf = FluxDiffusersAdapter()  # a diffusers FluxTransformer2DModel directory (recipes/convert.py)

    def build(self, args: FluxArgs) -> Flux:
        return Flux(**self.args_fields(args))

    # --- shape ----------------------------------------------------------------------------
    def shape(self, args: FluxArgs) -> ModelShape:
        with torch.device("meta"):
            model = Flux(**self.args_fields(args))
        params = sum(p.numel() for p in model.parameters())
        head = sum(p.numel() for p in model.final_layer.parameters())
        return ModelShape(n_layers=args.n_double_blocks + args.n_single_blocks, dim=args.dim, vocab_size=0,
                          n_heads=args.n_heads, n_kv_heads=args.n_heads, head_dim=args.head_dim,
                          ffn_dim=int(args.dim * args.mlp_ratio), params=params, active_params=params,
                          embedding_params=0, head_params=head, qk_norm=True, gated_mlp=False)

    def flops_per_image(self, args: FluxArgs, image_tokens: int, text_tokens: int) -> float:
        """Training FLOPs (forward + backward) of one image: 6 x parameters x the tokens each
        parameter runs over, plus non-causal joint attention (4 L^2 dim per block forward)."""
        g = parameter_groups(args)
        tokens = image_tokens + text_tokens
        matmul = (g["image"] + g["per_image_token"] * image_tokens + g["per_text_token"] * text_tokens
                  + g["per_token"] * tokens)
        attention = 4 * tokens * tokens * args.dim * (args.n_double_blocks + args.n_single_blocks)
        return 6.0 * matmul + 3.0 * attention

    def flops_per_unit(self, args: FluxArgs, dataset: Any) -> float:
        return self.flops_per_image(args, int(dataset.image_tokens), int(dataset.text_tokens))

    def flops_per_token(self, args: FluxArgs, seq_len: int) -> float:
        """Per token of a joint sequence of ``seq_len`` (planner's view; half image, half text)."""
        return self.flops_per_image(args, seq_len // 2, seq_len - seq_len // 2) / max(seq_len, 1)

    def tokens_of(self, data: SampleSettings) -> tuple[int, int]:
        """(image, text) tokens of one sample of image-caption data, before any data is read."""
        if not data.image_data:
            raise ConfigError(f"{NEEDS_IMAGE_DATA}: set {IMAGE_DATA} ({OWN_IMAGES})")
        return image_tokens_of(data.image_size), data.text_tokens

    def require(self, args: FluxArgs, data: SampleSettings) -> None:
        """Everything this flavor needs from the data settings and lacks, named in one line with the
        overrides that supply it: a user meets all of them at once, not one per attempt."""
        missing = []  # (why, the override that supplies it)
        if not data.image_data:
            missing.append((NEEDS_IMAGE_DATA, IMAGE_DATA))
        if args.guidance_embed and data.guidance is None:
            missing.append(("model.guidance_embed=true (a guidance-distilled flavor like flux_dev) needs the scale "
                            "it is trained at", f"data.examples.guidance={DEV_GUIDANCE}"))
        if not missing:
            return
        message = "; ".join(why for why, _ in missing) + ": set " + " ".join(fix for _, fix in missing)
        if not data.image_data:
            message += f" ({OWN_IMAGES})"
        if args.guidance_embed:
            name = data.name if data.image_data and data.name != "custom" else "flux_shapes"
            message += (f", e.g. python launch.py model=flux_dev data={name} "
                        f"data.examples.guidance={DEV_GUIDANCE} dry_run=true")
        raise ConfigError(message)

    def sample_tokens(self, args: FluxArgs, data: SampleSettings, seq_len: int) -> int:
        self.require(args, data)
        return sum(self.tokens_of(data))

    def flops_per_sample(self, args: FluxArgs, data: SampleSettings, seq_len: int) -> float:
        self.require(args, data)
        return self.flops_per_image(args, *self.tokens_of(data))

    def batch_like(self, args: FluxArgs, data: SampleSettings, local_batch: int) -> tuple[dict[str, torch.Tensor],
                                                                                         torch.Tensor]:
        """A batch of ``FluxExamples.make_batch``'s shapes, zeros (the ShapesBatches capability)."""
        self.require(args, data)
        image, text = self.tokens_of(data)
        side = math.isqrt(image)
        b = int(local_batch)
        inputs = {"img": torch.zeros(b, image, args.in_channels), "img_ids": image_ids(side, side, batch=b).contiguous(),
                  "txt": torch.zeros(b, text, args.context_dim), "txt_ids": text_ids(text, batch=b).contiguous(),
                  "timesteps": torch.zeros(b), "y": torch.zeros(b, args.pooled_dim)}
        if data.guidance is not None:
            inputs["guidance"] = torch.zeros(b)
        return inputs, torch.zeros(b, image, args.in_channels)

    def dataset_sizes(self, data: SampleSettings) -> dict[str, int]:
        """The image-caption dataset's tokens per sample (what ``flops_per_unit`` reads), from the settings."""
        image, text = self.tokens_of(data)
        return {"image_tokens": image, "text_tokens": text}

    def check(self, args: FluxArgs, dims: Any, seq_len: int) -> None:
        for name, degree, why in (("pp", dims.pp, "pipeline stages would pass both streams and the conditioning"),
                                  ("ep", dims.ep, "Flux has no experts")):
            if degree > 1:
                raise ConfigError(f"parallelism.{name}={degree} is not supported for model.family=flux ({why}); "
                                  "use data, tensor or context parallelism (fsdp, hsdp, ddp, tp, cp)")
        if dims.tp > 1:
            if args.n_heads % dims.tp:
                raise ConfigError(f"parallelism.tp={dims.tp} must divide model.n_heads={args.n_heads} "
                                  "(each rank computes whole heads)")
            if args.mlp_hidden_dim % dims.tp:
                raise ConfigError(f"parallelism.tp={dims.tp} must divide the MLP width {args.mlp_hidden_dim} "
                                  "(model.dim * model.mlp_ratio)")
            if dims.tp_sequence_parallel:
                raise ConfigError("parallelism.tp_sequence_parallel=true is not supported for model.family=flux "
                                  "(the image and text streams join mid-block); set "
                                  "parallelism.tp_sequence_parallel=false")

    def check_data(self, args: FluxArgs, dims: Any, data: SampleSettings) -> None:
        """The examples feed a guidance scale iff the model embeds one; context parallel splits the
        image and the text tokens of each sample into 2*cp equal chunks."""
        self.require(args, data)
        image, text = self.tokens_of(data)
        if not args.guidance_embed and data.guidance is not None:
            raise ConfigError(f"data.examples.guidance={data.guidance}: model.guidance_embed=false has no guidance "
                              "embedding to feed; set data.examples.guidance=null (or use model=flux_dev)")
        if dims.cp <= 1:
            return
        for what, n, key in (("image", image, "data.image_size"), ("text", text, "data.examples.max_text_len")):
            if n % (2 * dims.cp):
                raise ConfigError(f"{what} tokens per sample ({n}) must be divisible by 2*parallelism.cp="
                                  f"{2 * dims.cp} (context parallel splits them into equal chunks); change {key}")

    # --- pictures (eval.sample_every: the DrawsSamples capability) ----------------------------
    def sample_images(self, model: Flux, dataset: Any, prompts: list[str], steps: int, guidance: float,
                      seed: int) -> torch.Tensor:
        return sample_images(model, dataset.examples, prompts, int(dataset.image_size), steps=steps,
                             guidance=guidance, seed=seed)

    # --- tensor parallel ------------------------------------------------------------------
    def tp_plan(self, model: Flux, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """Megatron-style, one all-reduce per sub-layer: every q/k/v and MLP input projection is
        column-wise (whole heads, a slice of the MLP per rank), every output projection row-wise;
        the per-head QK norms run on the local heads; everything else (embedders, modulations,
        final layer) is replicated. Tokens stay whole between sub-layers (no sequence parallel);
        the output is a plain replicated tensor, so the loss needs no loss parallel."""
        # Lazy, as in the decoder families' plan: torch.distributed.tensor takes about a second to
        # import and only TP runs need it.
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from titan_hydra.models.common.tp_styles import HeadShardedNorm, ReplicateParallel  # lazy: see above

        plan: dict = {name: ReplicateParallel() for name in ("img_in", "txt_in", "time_in", "vector_in", "final_layer")}
        if model.guidance_in is not None:
            plan["guidance_in"] = ReplicateParallel()

        def attention(prefix: str, out: str) -> None:
            plan.update({f"{prefix}{w}": ColwiseParallel() for w in ("q", "k", "v")})
            plan.update({f"{prefix}{n}": HeadShardedNorm() for n in ("q_norm", "k_norm")})
            plan[f"{prefix}{out}"] = RowwiseParallel()

        for name in model.double_blocks:
            p = f"double_blocks.{name}."
            for stream in ("img", "txt"):
                plan[f"{p}{stream}_mod"] = ReplicateParallel()
                attention(f"{p}{stream}_attn.", "proj")
                plan[f"{p}{stream}_mlp.fc1"] = ColwiseParallel()
                plan[f"{p}{stream}_mlp.fc2"] = RowwiseParallel()
        for name in model.single_blocks:
            p = f"single_blocks.{name}."
            plan[f"{p}mod"] = ReplicateParallel()
            attention(p, "attn_out")
            plan[f"{p}mlp_in"] = ColwiseParallel()
            plan[f"{p}mlp_out"] = RowwiseParallel()
        return plan

    # --- layout ----------------------------------------------------------------------------
    def blocks(self, model: Flux) -> nn.ModuleDict:
        """Double-stream then single-stream blocks (a view: the model keeps its own two dicts)."""
        return nn.ModuleDict({**{f"double_{k}": b for k, b in model.double_blocks.items()},
                              **{f"single_{k}": b for k, b in model.single_blocks.items()}})

    def fsdp_units(self, model: Flux) -> list[tuple[Any, bool]]:
        blocks = list(self.blocks(model).values())
        return [(b, False) for b in blocks] + [(model.final_layer, True)]
