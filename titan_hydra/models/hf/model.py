"""A transformers causal LM as a titan_hydra model: built from transformers' own code and config.

``HFArgs`` names an architecture (a ``model_type`` plus config fields, or a local directory
holding a ``config.json``); ``causal_lm(**fields)`` builds ``AutoModelForCausalLM.from_config`` on
the current default device (meta, for the engine) and returns it with two things changed, so the
engine can treat it like any other model:

* its class is a subclass of the architecture's own (``Titan<Class>``) whose ``forward(tokens,
  doc_ids=None)`` returns logits (hidden states on a pipeline stage without the head) and whose
  ``init_weights(buffer_device=None)`` reruns transformers' own initialization (rotary buffers
  included) from the current RNG state. Everything else, state-dict names included, is the
  architecture's: a checkpoint is already the format ``from_pretrained`` loads.
* its list of repeated blocks (``model.layers``, ``transformer.h``, ``model.decoder.layers``, ...:
  ``stack.find_block_list``) is a ``LayerDict`` keyed by layer index instead of a ``ModuleList``:
  FSDP, activation checkpointing and compile replace blocks by key, and a pipeline stage keeps the
  keys (state-dict names) of its layers while the architecture's own ``for layer in self.layers[:n]``
  still iterates them in order.

Every MoE block counts its tokens per expert (the ``moe/*`` load metrics), and with
``output_router_logits=True`` in its config an MoE architecture's training forward adds
transformers' auxiliary load-balancing loss to the gradient (``router.py``).

Packed documents (``doc_ids``) become position ids restarting at every document: transformers
then builds the block-causal mask itself (``masking_utils.find_packed_sequence_indices``).
"""

from __future__ import annotations

import functools
import inspect
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.masking import positions_in_documents
from titan_hydra.models.hf import attention, router
from titan_hydra.models.hf.fields import build_error, check_fields, message_of
from titan_hydra.models.hf.stack import NoBlockList, find_block_list, install_layer_dict
from titan_hydra.quiet import loggers_at_error



@dataclass(frozen=True)
class HFArgs:
    """What builds one transformers architecture: ``model_type`` + ``fields`` (config keys), or
    ``config`` (a local directory with a ``config.json``; ``fields`` then override its values)."""

    model_type: str | None = None
    config: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "auto"  # attention.MODES: auto | sdpa | eager

    def __post_init__(self):
        if (self.model_type is None) == (self.config is None):
            raise ValueError("model=hf needs exactly one of model.model_type=<type> (with model.fields) or "
                             "model.config=<local dir with config.json>")
        if self.attn_implementation not in attention.MODES:
            raise ValueError(f"model.attn_implementation={self.attn_implementation!r} is not one of "
                             f"{', '.join(attention.MODES)}")

    @functools.cached_property
    def hf_config(self) -> Any:
        return hf_config(self.model_type, self.config, dict(self.fields), self.attn_implementation)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def max_seq_len(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 0) or 1 << 20)


def hf_config(model_type: str | None, config_dir: str | None, fields: dict[str, Any], attn: str) -> Any:
    """The architecture's ``PretrainedConfig``, with one-line errors for what cannot be built here."""
    # Lazy: transformers takes ~2 s to import and only an hf run needs it (every schema imports this module).
    import titan_hydra.models.hf.preload  # noqa: F401 -- transformers without torchao's import lines
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with loggers_at_error("transformers"):
        if config_dir is not None:
            path = os.path.expanduser(str(config_dir))
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ConfigError(f"model.config={config_dir!r} holds no config.json; give a local directory "
                                  "with a transformers config.json (nothing is downloaded)")
            try:
                cfg, unused = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True,
                                                         return_unused_kwargs=True, **fields)
                for key in unused:  # from_pretrained drops what its class does not know: name it instead
                    cfg.__dict__[key] = unused[key]
            except Exception as e:  # noqa: BLE001 -- whatever transformers raises: one line
                if "trust_remote_code" in str(e) or "auto_map" in str(e):
                    raise ConfigError(f"model.config={config_dir!r} needs remote code (auto_map), which model=hf "
                                      "never runs; use an architecture transformers ships") from None
                if fields:
                    raise build_error(e, fields, f"the config in {config_dir}") from None
                raise ConfigError(f"model.config={config_dir!r}: {message_of(e)}") from None
        else:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

            if model_type not in CONFIG_MAPPING_NAMES:
                raise ConfigError(f"model.model_type={model_type!r} is not a transformers architecture; see "
                                  "transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES")
            try:
                cfg = AutoConfig.for_model(model_type, **fields)
            except Exception as e:  # noqa: BLE001 -- whatever transformers raises: one line
                raise build_error(e, fields, model_type) from None
        check_fields(cfg, fields)
    if getattr(cfg, "auto_map", None):
        raise ConfigError(f"the {cfg.model_type} config names remote code (auto_map), which model=hf never runs; "
                          "use an architecture transformers ships")
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model_type={cfg.model_type!r} has no causal-LM class in transformers "
                          "(AutoModelForCausalLM); model=hf trains decoder language models")
    cfg._attn_implementation = attention.choice(cfg.model_type, attn).implementation
    cfg.use_cache = False
    return cfg


class TitanForward:
    """The two methods the engine calls on a model, mixed into the architecture's own class."""

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab]; hidden states [B, S, dim] in and/or out on a
        pipeline stage without the embedding / the head. Position ids are passed wherever the
        architecture takes them, so a stage computes rotary embeddings for the positions it really
        holds (ALiBi and recurrent architectures take none: their positions are implicit)."""
        b, s = tokens.shape[:2]
        inputs = {"inputs_embeds": tokens} if tokens.is_floating_point() else {"input_ids": tokens}
        if takes_position_ids(type(self)):
            inputs["position_ids"] = (positions_in_documents(doc_ids) if doc_ids is not None
                                      else torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s))
        if doc_ids is not None and self.config._attn_implementation == attention.NAME:
            inputs["titan_doc_ids"] = doc_ids  # through the layers' **kwargs to attention.titan_attention
        if self.get_output_embeddings() is None:
            return base_model(self)(**inputs, use_cache=False).last_hidden_state
        if not router.aux_enabled(self.config):
            return super().forward(**inputs, use_cache=False).logits
        # transformers' recorder and its own aux loss stay off: router.py's hooks keep the logits
        router.clear_logits(self)  # what an eval forward or the last step's AC recompute left
        logits = super().forward(**inputs, use_cache=False, output_router_logits=False).logits
        if not (self.training and torch.is_grad_enabled()):
            return logits
        return router.inject_aux(self, logits, router.take_logits(self))

    def init_weights(self, buffer_device: Any = None) -> None:
        """transformers' own initialization of every parameter and buffer, drawn afresh."""
        for m in self.modules():
            m.__dict__.pop("_is_hf_initialized", None)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                t.__dict__.pop("_is_hf_initialized", None)
        self.tie_weights()  # before drawing: a tied pair is one tensor, drawn in the order a CPU build draws it
        with torch.no_grad():  # a buffer initialize_weights leaves alone keeps this NaN: caught below
            floating = [(n, b, b.clone()) for n, b in self.named_buffers()
                        if b.is_floating_point() and b.device.type != "meta" and b.numel()]
            for _, b, _ in floating:
                b.fill_(float("nan"))
        self.initialize_weights()
        lost = [n for n, b, _ in floating if bool(b.isnan().all())]
        if lost and not getattr(self, "built_on_meta", False):  # __init__'s values are real: keep them
            with torch.no_grad():
                for n, b, before in floating:
                    if n in lost:
                        b.copy_(before)
        elif lost:  # computed in __init__, which ran on the meta device: its values exist nowhere now
            raise ConfigError(f"transformers' {self.config.model_type} computes buffer {lost[0]} when it is built and "
                              "does not set it again in initialize_weights, so a meta-device build (every model=hf "
                              "run) cannot give it its values; this architecture cannot train under model=hf yet")
        router.zero_counts(self)




def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


@functools.lru_cache(maxsize=None)
def takes_position_ids(cls: type) -> bool:
    """Whether the architecture's causal-LM forward has a ``position_ids`` parameter (packed
    documents restart their positions through it; transformers masks across them from it)."""
    return "position_ids" in inspect.signature(super(TitanForward, cls).forward).parameters


@functools.lru_cache(maxsize=None)
def titan_class(cls: type) -> type:
    """``Titan<cls>``: the architecture's class with the engine's forward and init."""
    return type(f"Titan{cls.__name__}", (TitanForward, cls), {"__module__": __name__})


def causal_lm(model_type: str | None = None, config: str | None = None, fields: dict[str, Any] | None = None,
              attn_implementation: str = "auto") -> nn.Module:
    """The architecture's causal LM on the current default device (meta for the engine)."""
    from transformers import AutoModelForCausalLM  # lazy: see hf_config

    args = HFArgs(model_type, config, dict(fields or {}), attn_implementation)
    cfg = args.hf_config
    chosen = attention.choice(cfg.model_type, args.attn_implementation)  # registers auto's, in this process too
    try:
        with loggers_at_error("transformers"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception as e:  # noqa: BLE001 -- whatever transformers (or torch under it) raises: one line
        raise build_error(e, args.fields, cfg.model_type) from None
    model.__class__ = titan_class(type(model))
    model.built_on_meta = any(p.is_meta for p in model.parameters())  # init_weights: buffers __init__ computed are lost
    try:
        install_layer_dict(model, find_block_list(model))
    except NoBlockList as e:
        raise ConfigError(f"model=hf cannot lay out {cfg.model_type}: {e}; the engine wraps, shards and cuts "
                          "a model block by block") from None
    router.install_counters(model)  # the moe/* load metrics, as the native MoE counts
    try:
        router.install_logit_capture(model)
    except router.NoRouterLogits as e:
        raise ConfigError(f"model.fields.output_router_logits=true: transformers' {cfg.model_type} has no router auxiliary loss "
                          f"here ({e}); remove the field") from None
    model.tie_weights()  # from_config leaves a meta build untied; counting and FSDP need one tensor
    if chosen.implementation == attention.NAME:
        attention.expose_hooks(model)  # the kernel policies fill them, as on the native Attention
    else:
        model.fixed_attention = tuple(chosen)  # what the kernel policy reports instead of choosing
    return model
