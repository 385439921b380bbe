"""Where an architecture keeps its repeated blocks, and what sits around them.

transformers names the decoder stack differently per architecture (``model.layers``, GPT-2's
``transformer.h``, OPT's ``model.decoder.layers``, GPT-NeoX's ``gpt_neox.layers``, MPT's
``transformer.blocks``, ...), but each declares it the same way: a ``ModuleList`` of the classes its
``_no_split_modules`` names (the units transformers itself never splits across devices), one per
``num_hidden_layers``. ``find_block_list`` reads that declaration; the builder swaps the list for a
``LayerDict`` in place, and from then on the blocks are found by that type (``block_list``): a pipeline
stage's deep copy, an activation-checkpointed or compiled model all still hold it.

The stack's *owner* (the module whose attribute is the list: ``model``, ``transformer``,
``model.decoder``) is what transformers' parallel plans are written against: its
``base_model_tp_plan`` patterns read ``layers.*.self_attn.q_proj`` and its ``base_model_pp_plan``
lists the owner's children in forward order (embedding, blocks, final norm).
"""

from __future__ import annotations

from typing import Any

from torch import nn

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


class NoBlockList(ValueError):
    """The architecture has no single list of repeated blocks the engine can wrap and cut."""


def find_block_list(model: nn.Module) -> str:
    """The fqn of the ``ModuleList`` of the architecture's repeated blocks (see the module docstring):
    a list of the classes ``_no_split_modules`` declares (of ``num_hidden_layers`` entries first, then
    the longest); without a declaration, the one list of ``num_hidden_layers`` entries (BioGPT's
    ``biogpt.layers``). Several such lists side by side (XLM's attentions, norms and FFNs) are no stack."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    n_layers = getattr(model.config, "num_hidden_layers", None)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    marked = [(name, m) for name, m in lists if any(type(x).__name__ in declared for x in m)]
    if marked:
        return max(marked, key=lambda item: (len(item[1]) == n_layers, len(item[1])))[0]
    full = [name for name, m in lists if len(m) == n_layers]
    outer = [n for n in full if not any(n.startswith(o + ".") for o in full)]
    if len(outer) == 1:
        return outer[0]
    if not outer:
        raise NoBlockList(f"it has no list of its {n_layers} blocks")
    raise NoBlockList(f"its layers are split over parallel lists ({', '.join(outer)}), not one list of blocks")


def install_layer_dict(model: nn.Module, fqn: str) -> None:
    """Replace the ``ModuleList`` at ``fqn`` by a ``LayerDict`` of the same modules (keys "0", "1", ...)."""
    owner_path, _, attr = fqn.rpartition(".")
    owner = model.get_submodule(owner_path)
    setattr(owner, attr, LayerDict({str(i): layer for i, layer in enumerate(getattr(owner, attr))}))


def block_list(model: nn.Module) -> tuple[str, LayerDict]:
    """(fqn, the blocks) of a model ``install_layer_dict`` prepared (or a stage or wrapper of one)."""
    for name, m in model.named_modules():
        if isinstance(m, LayerDict):
            return name, m
    raise NoBlockList(f"{type(model).__name__} holds no LayerDict")


def stack_owner(model: nn.Module) -> tuple[str, nn.Module, str]:
    """(prefix of the owner's fqns, e.g. "model." or "", the owner, the list's attribute on it)."""
    fqn, _ = block_list(model)
    owner_path, _, attr = fqn.rpartition(".")
    return (owner_path + "." if owner_path else ""), model.get_submodule(owner_path), attr


def is_norm(module: nn.Module) -> bool:
    return "Norm" in type(module).__name__ or isinstance(module, (nn.LayerNorm, nn.RMSNorm))


def pipeline_ends(config: Any) -> tuple[str, str] | None:
    """(embedding, final norm): the owner's first and last children in its pipeline plan (None: no plan)."""
    names = [n for n in (getattr(config, "base_model_pp_plan", None) or {}) if n != "layers"]
    return (names[0], names[-1]) if names else None


def end_names(model: nn.Module) -> tuple[str | None, str | None]:
    """(input embedding, final norm): their attribute names on the stack's owner, None where absent.
    The pipeline plan names both; without one, the embedding is ``get_input_embeddings()`` and the norm
    the owner's only child that is a norm (GPT-2's ``ln_f``, OPT's ``final_layer_norm``)."""
    _, owner, _ = stack_owner(model)
    ends = pipeline_ends(model.config)
    if ends is not None:
        emb, norm = ends
        return (emb if getattr(owner, emb, None) is not None else None,
                norm if isinstance(getattr(owner, norm, None), nn.Module) and is_norm(getattr(owner, norm)) else None)
    embedding = model.get_input_embeddings()
    emb = next((n for n, m in owner.named_children() if m is embedding), None)
    norms = [n for n, m in owner.named_children() if is_norm(m)]
    return emb, (norms[0] if len(norms) == 1 else None)


def stack_ends(model: nn.Module) -> tuple[nn.Module | None, nn.Module | None]:
    """(input embedding, final norm) modules around the blocks (``end_names``), None where absent."""
    _, owner, _ = stack_owner(model)
    return tuple(getattr(owner, n) if n is not None else None for n in end_names(model))  # type: ignore[return-value]
