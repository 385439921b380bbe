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
* ``model.layers`` is a ``LayerDict`` keyed by layer index instead of a ``ModuleList``: FSDP,
  activation checkpointing and compile replace blocks by key, and a pipeline stage keeps the keys
  (state-dict names) of its layers while the architecture's own ``for layer in self.layers[:n]``
  still iterates them in order.

Packed documents (``doc_ids``) become position ids restarting at every document: transformers
then builds the block-causal mask itself (``masking_utils.find_packed_sequence_indices``).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.masking import positions_in_documents
from titan_hydra.quiet import loggers_at_error

ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass(frozen=True)
class HFArgs:
    """What builds one transformers architecture: ``model_type`` + ``fields`` (config keys), or
    ``config`` (a local directory with a ``config.json``; ``fields`` then override its values)."""

    model_type: str | None = None
    config: str | None = None
    fields: dict[str, Any] = field(default_factory=dict)
    attn_implementation: str = "sdpa"

    def __post_init__(self):
        if (self.model_type is None) == (self.config is None):
            raise ValueError("model=hf needs exactly one of model.model_type=<type> (with model.fields) or "
                             "model.config=<local dir with config.json>")
        if self.attn_implementation not in ATTN_IMPLEMENTATIONS:
            raise ValueError(f"model.attn_implementation={self.attn_implementation!r} is not one of "
                             f"{', '.join(ATTN_IMPLEMENTATIONS)}")

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
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    with loggers_at_error("transformers"):
        if config_dir is not None:
            path = os.path.expanduser(str(config_dir))
            if not os.path.isfile(os.path.join(path, "config.json")):
                raise ConfigError(f"model.config={config_dir!r} holds no config.json; give a local directory "
                                  "with a transformers config.json (nothing is downloaded)")
            try:
                cfg = AutoConfig.from_pretrained(path, trust_remote_code=False, local_files_only=True, **fields)
            except ValueError as e:
                if "trust_remote_code" in str(e) or "auto_map" in str(e):
                    raise ConfigError(f"model.config={config_dir!r} needs remote code (auto_map), which model=hf "
                                      "never runs; use an architecture transformers ships") from None
                raise ConfigError(f"model.config={config_dir!r}: {str(e).splitlines()[0]}") from None
        else:
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

            if model_type not in CONFIG_MAPPING_NAMES:
                raise ConfigError(f"model.model_type={model_type!r} is not a transformers architecture; see "
                                  "transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES")
            try:
                cfg = AutoConfig.for_model(model_type, **fields)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"model.fields do not fit model_type={model_type!r}: "
                                  f"{str(e).splitlines()[0]}") from None
    if getattr(cfg, "auto_map", None):
        raise ConfigError(f"the {cfg.model_type} config names remote code (auto_map), which model=hf never runs; "
                          "use an architecture transformers ships")
    if cfg.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(f"model_type={cfg.model_type!r} has no causal-LM class in transformers "
                          "(AutoModelForCausalLM); model=hf trains decoder language models")
    cfg._attn_implementation = attn
    cfg.use_cache = False
    return cfg


class LayerDict(nn.ModuleDict):
    """The decoder layers keyed by their index: iterates in index order and slices like the
    ``ModuleList`` it replaces (``self.layers[:n]`` in the architectures' forwards)."""

    def _ordered(self) -> list[str]:
        return sorted(self.keys(), key=int)

    def __getitem__(self, key):
        if isinstance(key, slice):
            return [self._modules[k] for k in self._ordered()[key]]
        if isinstance(key, int):
            return self._modules[self._ordered()[key]]
        return super().__getitem__(key)

    def __iter__(self):
        return iter([self._modules[k] for k in self._ordered()])


class TitanForward:
    """The two methods the engine calls on a model, mixed into the architecture's own class."""

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab]; hidden states [B, S, dim] in and/or out on a
        pipeline stage without the embedding / the head. Position ids are always passed, so a
        stage computes rotary embeddings for the positions it really holds."""
        b, s = tokens.shape[:2]
        positions = (positions_in_documents(doc_ids) if doc_ids is not None
                     else torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s))
        embedded = getattr(base_model(self), pipeline_ends(self.config)[0], None) is None
        inputs = {"inputs_embeds": tokens} if embedded else {"input_ids": tokens}
        if self.get_output_embeddings() is None:
            return base_model(self)(**inputs, position_ids=positions, use_cache=False).last_hidden_state
        return super().forward(**inputs, position_ids=positions, use_cache=False).logits

    def init_weights(self, buffer_device: Any = None) -> None:
        """transformers' own initialization of every parameter and buffer, drawn afresh."""
        for m in self.modules():
            m.__dict__.pop("_is_hf_initialized", None)
            for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)):
                t.__dict__.pop("_is_hf_initialized", None)
        self.tie_weights()  # before drawing: a tied pair is one tensor, drawn in the order a CPU build draws it
        self.initialize_weights()


def pipeline_ends(config: Any) -> tuple[str, str]:
    """(embedding, final norm): the base model's first and last modules in its pipeline plan."""
    names = [n for n in (getattr(config, "base_model_pp_plan", None) or {}) if n != "layers"]
    return (names[0], names[-1]) if names else ("embed_tokens", "norm")


def base_model(model: nn.Module) -> nn.Module:
    return getattr(model, model.base_model_prefix)


@functools.lru_cache(maxsize=None)
def titan_class(cls: type) -> type:
    """``Titan<cls>``: the architecture's class with the engine's forward and init."""
    return type(f"Titan{cls.__name__}", (TitanForward, cls), {"__module__": __name__})


def causal_lm(model_type: str | None = None, config: str | None = None, fields: dict[str, Any] | None = None,
              attn_implementation: str = "sdpa") -> nn.Module:
    """The architecture's causal LM on the current default device (meta for the engine)."""
    from transformers import AutoModelForCausalLM  # lazy: see hf_config

    args = HFArgs(model_type, config, dict(fields or {}), attn_implementation)
    cfg = args.hf_config
    try:
        with loggers_at_error("transformers"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (KeyError, ValueError, TypeError, AttributeError, AssertionError) as e:
        raise ConfigError(f"transformers could not build {cfg.model_type} from model.fields: "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    model.__class__ = titan_class(type(model))
    base = base_model(model)
    base.layers = LayerDict({str(i): layer for i, layer in enumerate(base.layers)})
    model.tie_weights()  # from_config leaves a meta build untied; counting and FSDP need one tensor
    return model
