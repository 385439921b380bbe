"""From a ``model`` config node to its family and model: the only place that maps names to families.

``model.family`` is a short name of a built-in family (``llama3``, ``qwen3``) or the dotted path
of any ``ModelFamily`` object (``my_pkg.my_model.FAMILY``): a model defined outside this package
plugs in with ``model._target_`` + ``model.family`` and nothing else. ``family`` and ``flavor``
are labels for the engine; every other key of the node is a constructor argument of
``_target_`` and a field of the family's args.
"""

from __future__ import annotations

import importlib
from typing import Any

from omegaconf import DictConfig, OmegaConf

from titan_hydra.errors import ConfigError
from titan_hydra.errors import instantiate_checked as instantiate
from titan_hydra.models.common.hf_decoder import HFConversionError
from titan_hydra.models.protocol import ModelFamily

# The built-in families: each is the package ``titan_hydra.models.<name>`` and its ``FAMILY``, whose
# args class and model class are all its schema is derived from (``schema_model_<name>``, titan_hydra.groups).
BUILTIN = ("llama3", "qwen3", "qwen3_moe", "deepseek_v3", "gpt_oss", "llama4", "qwen3_5", "qwen3_5_moe", "qwen3_next",
           "flux", "hf")
LABELS = ("_target_", "family", "flavor")
# Checkpoints written before model families existed hold a Llama and no family name.
LEGACY_FAMILY = "llama3"


def get_family(name: str) -> ModelFamily:
    """The family spec for ``model.family`` (built-in name or dotted path to a ModelFamily)."""
    if name in BUILTIN:
        return importlib.import_module(f"{__package__}.{name}").FAMILY
    module_name, _, attr = str(name).rpartition(".")
    try:
        obj = getattr(importlib.import_module(module_name), attr) if module_name else None
    except (ImportError, AttributeError):
        obj = None
    if isinstance(obj, type) and issubclass(obj, ModelFamily):
        obj = obj()
    if not isinstance(obj, ModelFamily):
        raise ConfigError(
            f"model.family={name!r} is neither a built-in family ({', '.join(BUILTIN)}) nor the dotted "
            "path of a titan_hydra.models.protocol.ModelFamily"
        )
    return obj


def family_for_hf_type(model_type: str | None) -> ModelFamily:
    """The built-in family whose HF adapter reads ``config.json``'s ``model_type``: a native port
    first (BUILTIN's order puts ``hf``, which reads any transformers causal LM, last)."""
    for name in BUILTIN:
        family = get_family(name)
        if family.hf is not None and family.hf.reads(model_type):
            return family
    known = ", ".join(t for t in (get_family(n).hf.model_type for n in BUILTIN if get_family(n).hf) if t)
    raise HFConversionError(f"config.json model_type={model_type!r} is not supported (known: {known}; or any "
                            "transformers causal LM)")


def model_node(model_cfg: Any) -> dict[str, Any]:
    """The model config node as a plain, resolved dict."""
    if isinstance(model_cfg, DictConfig):
        return OmegaConf.to_container(model_cfg, resolve=True, enum_to_str=True)  # type: ignore[return-value]
    return dict(model_cfg)


def family_of(model_cfg: Any) -> ModelFamily:
    node = model_node(model_cfg)
    if "family" not in node:
        raise ConfigError("the model config has no `family` key; set model.family=<family name or dotted path>")
    return get_family(node["family"])


def args_of(model_cfg: Any) -> tuple[ModelFamily, Any]:
    """(family, its args) for a model config, with a bad shape reported as one line."""
    family = family_of(model_cfg)
    fields = {k: v for k, v in model_node(model_cfg).items() if k not in LABELS}
    try:
        return family, family.make_args(fields)
    except ValueError as e:  # a shape rule of the family's args
        raise ConfigError(str(e).splitlines()[0]) from None
    except TypeError as e:  # a field the family's args do not have
        raise ConfigError(f"model config does not fit family {family.name!r}: {e}") from None


def build_model(model_cfg: Any) -> tuple[ModelFamily, Any]:
    """Instantiate ``model._target_`` with the node's fields (on the current default device)."""
    family = family_of(model_cfg)
    node = {k: v for k, v in model_node(model_cfg).items() if k not in ("family", "flavor")}
    return family, instantiate(node, _convert_="all")


def model_from_args(target: str, family: ModelFamily, args: Any) -> Any:
    """The model class ``target`` names, built from ``args`` (on the current default device): the
    run's model with whatever the args carry that its config node does not (a parametrization's
    multipliers)."""
    return instantiate({"_target_": target, **family.args_fields(args)}, _convert_="all")

