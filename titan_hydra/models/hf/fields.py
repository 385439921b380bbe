"""``model.fields`` against the architecture's config class, and transformers' build errors as one line.

transformers stores a keyword its config class does not know as a plain attribute and builds the
architecture's defaults around it: a misspelt ``num_hiden_layers`` would silently train the default
(billions of parameters). A field is known when the config class declares it (its dataclass fields),
maps it (``attribute_map``: GPT-2's ``hidden_size`` is ``n_embd``), or consumes it while it builds
(``rope_theta`` goes into ``rope_parameters``, so it is no attribute of the built config), or its
modeling code reads it (Qwen3-MoE's attention takes ``getattr(config, "head_dim", ...)``, a field its
config class never declares); anything else is refused with the closest known name.

transformers validates fields itself when it builds the config (huggingface_hub's strict dataclass
validators: ``hidden_size`` not a multiple of ``num_attention_heads``) or the model (a negative width
fails in torch): ``build_error`` turns either into one line that names the ``model.fields`` keys the
message is about.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import re
from typing import Any, Mapping

from titan_hydra.errors import ConfigError

# a field whose name says it is a width or a count (not a token id, a seed, a window that may be off)
COUNT_NAME = re.compile(r"(size|^num_|^n_|layers|heads|_dim$|experts)(?!.*_id$)")
# what torch calls a field in its own messages ("Padding_idx must be within num_embeddings": the
# config's pad_token_id does not fit a small vocab_size)
ALIASES = {"padding_idx": "pad_token_id", "num_embeddings": "vocab_size"}
# words a field name carries that a message leaves out ("num_attention_heads" -> "attention heads")
FILLER = {"num", "n", "of"}


@functools.lru_cache(maxsize=None)
def known_fields(config_cls: type) -> frozenset[str]:
    """What the class declares, maps, and what a default instance holds or the class computes
    (``_name_or_path``, ``output_attentions``: the base class's own, which a saved config.json carries)."""
    declared = {f.name for f in dataclasses.fields(config_cls)} if dataclasses.is_dataclass(config_cls) else set()
    try:
        held = set(vars(config_cls()))
    except Exception:  # noqa: BLE001 -- a class whose defaults do not validate holds nothing to add
        held = set()
    properties = {k for k in dir(config_cls)  # settable ones only (Falcon's head_dim is computed)
                  if isinstance(getattr(config_cls, k, None), property) and getattr(config_cls, k).fset is not None}
    return frozenset(declared | held | properties | set(getattr(config_cls, "attribute_map", None) or {}))


def check_fields(config: Any, fields: Mapping[str, Any]) -> None:
    """ConfigError for the first field ``config``'s class neither declares, maps nor consumed."""
    known = known_fields(type(config))
    built = config.to_dict()
    for key, value in fields.items():
        default = _default(type(config), key)
        if _count(value) and value <= 0 and _count(default) and default > 0 and COUNT_NAME.search(key):
            raise ConfigError(f"model.fields.{key}={value} must be > 0 (a size or count: transformers' "
                              f"{type(config).__name__} defaults it to {default})")
        if key in known or key not in built or _read_by_model(config.model_type, key):
            continue
        close = difflib.get_close_matches(key, sorted(known), n=1)
        hint = f"did you mean model.fields.{close[0]}?" if close else "see its config class for the fields it has"
        raise ConfigError(f"model.fields.{key}: transformers' {type(config).__name__} ({config.model_type}) has no "
                          f"field {key!r}; {hint}")


@functools.lru_cache(maxsize=None)
def _model_source(model_type: str) -> str:
    import transformers  # lazy: only an hf run has imported it (hf_config did, before calling here)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, ""), None)
    return inspect.getsource(inspect.getmodule(cls)) if cls is not None else ""


def _read_by_model(model_type: str, key: str) -> bool:
    """Whether the architecture's modeling code reads ``key`` off its config (``config.key``, or by
    name: ``getattr(config, "head_dim", ...)`` reads a field its config class does not declare)."""
    key = re.escape(key)
    return re.search(rf"config\.{key}\b|[\"']{key}[\"']", _model_source(model_type)) is not None


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _default(config_cls: type, key: str) -> Any:
    key = (getattr(config_cls, "attribute_map", None) or {}).get(key, key)
    found = [f for f in dataclasses.fields(config_cls) if f.name == key] if dataclasses.is_dataclass(config_cls) else []
    return found[0].default if found else None


def message_of(error: BaseException) -> str:
    """The line of an exception's text that says what is wrong (a strict-dataclass validation error
    opens with a header line ending in ':' and gives the validator's own error below it)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    line = lines[-1] if len(lines) > 1 and lines[0].endswith(":") else lines[0]
    return re.sub(r"^\w+(Error|Exception): ", "", line).rstrip(".")


def _mentioned(key: str, text: str) -> bool:
    words = [w for w in key.lower().split("_") if w not in FILLER]
    return bool(words) and (key.lower() in text or all(w in text for w in words))


def _value_in(value: Any, text: str) -> bool:
    return re.search(rf"(?<![\w.-]){re.escape(str(value))}(?![\w.])", text) is not None


def build_error(error: BaseException, fields: Mapping[str, Any], what: str) -> ConfigError:
    """One line for an error transformers raised while building ``what`` (e.g. "llama") from these
    fields: the ``model.fields`` keys its message is about, by name ("hidden size") or else by value
    ("negative dimension -4", "'nope'"); the whole node when it names none."""
    text = message_of(error)
    named = [k for k in fields if _mentioned(k, text.lower())] or [
        k for k, v in fields.items() if not isinstance(v, bool) and _value_in(v, text)]
    named += [k for word, k in ALIASES.items() if word in text.lower() and k not in named]
    keys = ", ".join(f"model.fields.{k}={fields[k]!r}" if k in fields else f"model.fields.{k} (unset: the "
                     "architecture's default)" for k in named) if named else "model.fields"
    fix = "change that field" if len(named) == 1 else "change those fields" if named else "change model.fields"
    return ConfigError(f"transformers cannot build {what} from {keys}: {text}; {fix}")
