"""The model protocol: what the engine asks of every model family, and the capabilities some have.

The engine (``parallel/``, ``train/``, ``checkpoint/``, ``planner/``, ``recipes/convert.py``)
never names a family. It gets a ``ModelFamily`` from the ``model.family`` config key (see
``registry.py``) and asks every family:

* shape and counting: ``make_args`` + ``args_fields``, ``shape`` (parameters total/active, widths
  the memory estimator needs), ``flops_per_token``, ``signature`` (the fields that decide whether
  saved weights fit), ``check`` (family rules against a layout, as one-line ConfigErrors),
  ``build`` (the full model evaluation during training loads);
* layout: ``blocks`` (the units activation checkpointing, compile and FSDP wrap, and the
  pipeline cuts), ``fsdp_units``, ``tp_plan`` + ``finish_tp``, ``cut_stage``, ``expert_modules``
  (what expert parallelism shards over its own mesh);
* training: ``objective`` (the loss, and what throughput counts: ``objective.py``; language
  families predict the next token), ``training_loss`` (the objective's, or one with the model's
  own extra terms);
* conversion: ``hf`` (an ``HFAdapter``; None when the family has no HF counterpart).

Optional capabilities are not members of ``ModelFamily``, so a family implements only what it
has and the engine's default serves the rest: a capability is a small protocol of its own the
engine checks with ``isinstance`` (structural: a family need not name it), or a flag that says
what the model's ``forward`` takes (``supports_document_mask``). They are:

* ``SizesSamples``: samples that are not ``training.seq_len`` tokens (Flux's picture + caption),
  sized, costed and checked against a layout from the typed data settings (``SampleSettings``);
* ``ShardsRope``: rotary tables kept as buffers, which context parallel shards with the tokens;
* ``WeighsLosses``: losses the model adds to the gradient itself (MoE auxiliary loss), weighed
  like each microbatch's;
* ``RunsStepHooks``: the model's own work once per optimizer step, with metrics to log;
* ``ParallelizesExperts``: routed experts with a call signature of their own, sharded over the
  ep mesh by the family's style (default: ``common/expert_parallel.ExpertParallel``);
* ``DrawsSamples``: pictures from prompts (``eval.sample_every``).

``common/decoder_family.DecoderFamily`` implements it for models built from
``common/decoder.Decoder`` (rope tables and MoE losses included); a family subclasses it and
overrides what differs. A model that is not a ``Decoder`` subclasses ``ModelFamily`` directly
(README: "Bring your own model").
"""

from __future__ import annotations

from dataclasses import dataclass, fields as dc_fields
from typing import Any, Mapping, Protocol, runtime_checkable

import torch
from torch import nn

from titan_hydra.models.objective import NEXT_TOKEN, Objective


@dataclass(frozen=True)
class ModelShape:
    """Family-independent numbers of one model configuration (estimator, dry run, auto layout)."""

    n_layers: int
    dim: int
    vocab_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int  # FFN width a token passes through (MoE: the active experts' sum)
    params: int  # total, a tied matrix counted once
    active_params: int  # used per token (dense: == params)
    embedding_params: int  # the input lookup table (vocab x dim), whether or not it is tied to the output
    head_params: int  # final norm + output projection
    tied_embeddings: bool = False
    qk_norm: bool = False  # per-head norms on q and k (their saved activations count)
    gated_mlp: bool = True  # SwiGLU keeps ~twice the FFN-wide tensors of a plain GELU MLP (FLUX.1)
    # Mixture-of-Experts (0 = dense): routed experts per MoE layer, experts each token uses,
    # how many layers are MoE, and all routed-expert parameters of the model.
    n_experts: int = 0
    top_k: int = 0
    moe_layers: int = 0
    expert_params: int = 0
    # Multi-token prediction depths (DeepSeek-V3): each runs one more block and one more pass
    # through the output head; their non-expert parameters count in head_params (they sit with
    # the head on the last pipeline stage), their experts in expert_params / moe_layers.
    mtp_layers: int = 0
    # Linear-attention (Gated DeltaNet) layers of a hybrid, of n_layers: their saved activations
    # are linear in the sequence with a chunk and a per-chunk state term (planner/activations.py).
    linear_layers: int = 0
    linear_k_heads: int = 0
    linear_v_heads: int = 0
    linear_k_head_dim: int = 0
    linear_v_head_dim: int = 0
    linear_chunk: int = 64

    @property
    def block_params(self) -> float:
        """Average parameters of one transformer block."""
        rest = self.params - self.head_params - (0 if self.tied_embeddings else self.embedding_params)
        return rest / max(self.n_layers, 1)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


class SampleSettings(Protocol):
    """What a family's data rules read of the ``data`` group, before any data is read (the
    settings themselves, ``titan_hydra.data.settings.DataSettings``, live with the data, a layer
    above this protocol): no raw config node crosses into a family."""

    @property
    def name(self) -> str: ...  # the option's label, or "custom"

    @property
    def image_data(self) -> bool: ...  # an image-caption group: an example builder and an image size

    @property
    def image_size(self) -> int | None: ...  # pixels on a side of every picture (image data only)

    @property
    def text_tokens(self) -> int | None: ...  # caption tokens of every sample (image data only)

    @property
    def guidance(self) -> float | None: ...  # the scale fed to a guidance-distilled model (None: none)


class HFAdapter:
    """Our state dict <-> a Hugging Face checkpoint of the same architecture."""

    model_type: str = ""  # config.json model_type (diffusers: _class_name) this adapter reads and writes
    weights_file: str = "model.safetensors"  # the file name its library's from_pretrained looks for
    # Our state dict IS the checkpoint's, name for name and layout for layout (``source_name`` aside):
    # the HF import then reads each rank's own slices of the files, never a whole tensor it does not hold.
    same_layout: bool = False

    def source_name(self, name: str, args: Any) -> str:
        """The file's tensor that holds our ``name`` (a tied head: the embedding); ``same_layout`` only."""
        return name

    def reads(self, model_type: str | None) -> bool:
        """Whether this adapter reads checkpoints whose config.json names ``model_type``."""
        return model_type == self.model_type

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def hf_config(self, args: Any, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        raise NotImplementedError

    def args_from_hf_config(self, cfg: dict[str, Any]) -> Any:
        raise NotImplementedError

    def args_for_weights(self, args: Any, names: Any) -> Any:
        """``args`` fitted to the tensor names the files hold (default: unchanged). A checkpoint
        saved by a library that drops optional layers keeps them in its config.json."""
        return args


def fsdp_units_in_order(embedding: nn.Module | None, blocks: list[nn.Module], ends: list[nn.Module],
                        tied: bool) -> list[tuple[Any, bool]]:
    """``ModelFamily.fsdp_units`` of a decoder: the embedding, each block, the final norm + head as one
    unit; a tied embedding joins the head's unit (a parameter can belong to only one unit)."""
    units: list[tuple[Any, bool]] = []
    if embedding is not None and not tied:
        units.append((embedding, False))
    for i, block in enumerate(blocks):
        units.append((block, i == len(blocks) - 1 and not ends and not tied))
    if tied:
        units.append(([embedding, *ends], True))
    elif ends:
        units.append((ends if len(ends) > 1 else ends[0], True))
    return units


class ModelFamily:
    """Base of every family spec. Subclass ``DecoderFamily`` unless the model is not a Decoder."""

    name: str = ""
    args_cls: type | None = None
    # What ``model._target_`` names: a built-in family's schema is derived from these two classes.
    model_cls: type | None = None
    hf: HFAdapter | None = None
    # The model's forward takes ``doc_ids`` [B, S] (``data.document_mask=true``): attention within
    # each packed document, positions restarting per document (``models/common/masking.py``).
    supports_document_mask: bool = False
    # What a batch is and how its loss is computed (next-token cross entropy for language models).
    objective: Objective = NEXT_TOKEN
    # Modules every rank of a local launch imports before its first step: the fork server imports
    # them once (``launch/local.py``) instead of each forked rank on its own.
    worker_imports: tuple[str, ...] = ()

    # --- shape --------------------------------------------------------------------------
    def make_args(self, fields: Mapping[str, Any]) -> Any:
        """The family's args object from a model config node (``_target_``/``family``/``flavor`` removed)."""
        return self.args_cls(**dict(fields))

    def args_fields(self, args: Any) -> dict[str, Any]:
        """Plain dict of ``args`` (stored in checkpoint markers; ``make_args`` inverts it)."""
        return {f.name: getattr(args, f.name) for f in dc_fields(args)}

    def shape(self, args: Any) -> ModelShape:
        raise NotImplementedError

    def build(self, args: Any) -> nn.Module:
        """A model of ``args`` on the current default device: what evaluation during training
        loads the gathered weights into. A family without it cannot evaluate during training
        (``PeriodicEval.check`` says so before the run starts)."""
        raise NotImplementedError(f"model family {self.name!r} has no build(args)")

    def builds_models(self) -> bool:
        """Whether this family overrides ``build`` (evaluation during training needs it)."""
        return type(self).build is not ModelFamily.build

    def flops_per_token(self, args: Any, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token: 6 x active matmul params + attention."""
        raise NotImplementedError

    def signature(self, args: Any) -> dict[str, Any]:
        """Fields that decide whether saved weights fit this model (checkpoint compatibility)."""
        return self.args_fields(args)

    def check(self, args: Any, dims: Any, seq_len: int) -> None:
        """Raise ConfigError (one line) for a layout or length this family cannot run."""

    # --- layout -------------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleDict:
        """The repeated units, keyed by layer id (AC, compile and FSDP wrap them; PP cuts between)."""
        raise NotImplementedError

    def fsdp_units(self, model: nn.Module) -> list[tuple[Any, bool]]:
        """(module or [modules], is_last_in_forward) in forward order, the root excluded."""
        raise NotImplementedError

    def tp_plan(self, model: nn.Module, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """{fqn: ParallelStyle} for ``parallelize_module`` on the whole model (or one stage)."""
        raise NotImplementedError

    def finish_tp(self, model: nn.Module) -> None:
        """Fix-ups after the TP plan was applied (e.g. re-tie shared weights)."""

    def cut_stage(self, model: nn.Module, layer_ids: range, is_first: bool, is_last: bool) -> nn.Module:
        """A copy of the meta model holding only one pipeline stage's modules, FQNs unchanged."""
        raise NotImplementedError

    def expert_modules(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        """(fqn, module) of every routed-experts module: expert parallelism shards these over the
        ep mesh and FSDP over the expert data-parallel mesh. A module opts in with a truthy class
        attribute ``routed_experts``, so a model needs no knowledge of EP."""
        return [(n, m) for n, m in model.named_modules() if getattr(type(m), "routed_experts", False)]

    # --- training -----------------------------------------------------------------------
    def training_loss(self, args: Any) -> Any:
        """The loss the runners backpropagate, ``(output, labels) -> scalar``: the objective's,
        unless the model trains terms of its own on the same batch (multi-token prediction)."""
        return self.objective.loss


@runtime_checkable
class DrawsSamples(Protocol):
    """The capability of a family that draws pictures from prompts (``eval.sample_every``): an
    image family implements it, a language family does not (checked with ``isinstance``)."""

    def sample_images(self, model: nn.Module, dataset: Any, prompts: list[str], steps: int, guidance: float,
                      seed: int) -> torch.Tensor:
        """uint8 pictures [len(prompts), H, W, 3] drawn by ``model`` (an unsharded CPU copy) from
        these prompts, with the dataset's encoders."""
        ...


@runtime_checkable
class SizesSamples(Protocol):
    """The capability of a family whose training sample is not ``training.seq_len`` tokens of a
    corpus (an image family's picture and caption): its length, cost and layout rules come from
    the data settings, before any data is read. Without it a sample is ``seq_len`` tokens that
    cost ``flops_per_token`` each, and the data puts no rule on the layout."""

    def sample_tokens(self, args: Any, data: SampleSettings, seq_len: int) -> int:
        """Sequence positions one training sample occupies (what activations scale with)."""
        ...

    def flops_per_sample(self, args: Any, data: SampleSettings, seq_len: int) -> float:
        """Training FLOPs of one sample (the planner's per-step arithmetic, from config alone)."""
        ...

    def flops_per_unit(self, args: Any, dataset: Any) -> float:
        """Training FLOPs per unit the objective counts (MFU's numerator), for the samples the
        built ``dataset`` serves."""
        ...

    def check_data(self, args: Any, dims: Any, data: SampleSettings) -> None:
        """Raise ConfigError (one line) for a layout this family cannot run on these samples
        (e.g. context parallel splits every sample's tokens into equal chunks)."""
        ...


@runtime_checkable
class ShapesBatches(Protocol):
    """The capability of a family whose training batch is not a token tensor (an image family's
    dict of latents, caption states and conditioning): a batch of its exact shapes and dtypes,
    zero-filled, from the config alone (``dry_run=simulate`` steps the model on one)."""

    def batch_like(self, args: Any, data: SampleSettings, local_batch: int) -> tuple[Any, torch.Tensor]:
        """(inputs, target) of one local batch, zeros: what the data loader would hand the model."""
        ...

    def dataset_sizes(self, data: SampleSettings) -> dict[str, int]:
        """What the model build reads of the built dataset (e.g. ``image_tokens``), from the settings."""
        ...


@runtime_checkable
class LimitsSimulation(Protocol):
    """The capability of a family that some configs of cannot be stepped on fake tensors
    (``dry_run=simulate``): the reason in one line, or None where they can."""

    def simulation_refusal(self, args: Any, device: str, mixed_precision: str) -> str | None:
        """Why ``args`` on ``device`` under ``mixed_precision`` cannot be simulated (None: it can)."""


@runtime_checkable
class ShardsRope(Protocol):
    """The capability of a family whose model keeps rotary tables as buffers indexed by position:
    context parallel shards them with the tokens, so each rank rotates its own positions."""

    rope_buffers: tuple[str, ...]  # buffer names on each model part, sequence along dim 0


@runtime_checkable
class WeighsLosses(Protocol):
    """The capability of a family whose model adds losses to the gradient itself (an MoE auxiliary
    loss): those must take the runner's microbatch weight to equal one big batch."""

    def set_loss_scale(self, model_parts: list[nn.Module], scale: float) -> None:
        """The runner backpropagates each microbatch's loss times ``scale`` (1 / (gradient
        accumulation x pipeline microbatches)); the model's own losses take the same weight."""
        ...


@runtime_checkable
class RunsStepHooks(Protocol):
    """The capability of a family with work of its own once per optimizer step."""

    def step_hooks(self, model_parts: list[nn.Module], dims: Any) -> list:
        """Callables the trainer runs once per optimizer step (after backward of every microbatch,
        before ``optimizer.step``); each returns ``{metric: value}`` logged with the step."""
        ...


@runtime_checkable
class ParallelizesExperts(Protocol):
    """The capability of a family whose routed-experts modules are not called like
    ``GroupedExperts`` (tokens sorted by expert + counts): it gives the ``ParallelStyle`` that
    shards each over the ep mesh and carries its tokens to their experts' ranks and back."""

    def expert_parallel_style(self, module: nn.Module) -> Any:
        """A torch ``ParallelStyle`` for ``module`` (one of ``expert_modules``), applied with
        ``parallelize_module(module, ep_mesh, style)`` before FSDP."""
        ...
