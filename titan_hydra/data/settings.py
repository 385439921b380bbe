"""``DataSettings``: the ``data`` group read once into typed values.

The dataset itself is built on each rank from the group's node (it reads files, and an image
group's example builder may load encoders), so the node travels along; everything the engine,
validation and a family's data rules read before that is a typed field here, read from the node
in one place (``DataSettings.of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional


def _given(node: Mapping[str, Any], key: str) -> Any:
    """``node[key]``, or None where it is absent, null or unset (``???``)."""
    value = node.get(key)
    return None if value is None or value == "???" else value


@dataclass(frozen=True)
class DataSettings:
    """The ``data`` group: one token source, a mixture of prepared ones, or image-caption samples."""

    name: str  # the option's label (``data.name``), or "custom"
    dataset_node: Mapping[str, Any]  # what the dataset's ``_target_`` is built from, on each rank
    source: Optional[str] = None  # the source's kind (builtin, json, prepared, hf, shapes, ...); None: a mixture
    tokenizer: Optional[str] = None  # None: not a tokenized corpus (the family's own samples, e.g. images)
    path: Optional[str] = None
    hf_name: Optional[str] = None
    seq_len: int = 0
    val_fraction: float = 0.0
    streaming: bool = False
    max_documents: Optional[int] = None  # a cap on the documents read
    document_mask: bool = False
    mixture: bool = False  # data=mixture: ``sources`` names the prepared corpora
    sources: Optional[Mapping[str, Any]] = None  # {name: {path, weight}} as given (``mixture.check_sources``)
    image_size: Optional[int] = None  # pixels on a side of every picture (image data)
    text_tokens: Optional[int] = None  # caption tokens of every sample, padded or cut to them (image data)
    guidance: Optional[float] = None  # the scale the example builder feeds a guidance-distilled model

    @classmethod
    def of(cls, node: Mapping[str, Any]) -> DataSettings:
        """The settings of a resolved ``data`` node (plain values, with the option's label ``name``)."""
        examples = node.get("examples")
        examples = examples if isinstance(examples, Mapping) else {}
        image = node.get("examples") is not None and node.get("image_size") is not None
        return cls(
            name=str(node.get("name", "custom")), dataset_node={k: v for k, v in node.items() if k != "name"},
            source=_given(node, "source"), tokenizer=_given(node, "tokenizer"), path=_given(node, "path"),
            hf_name=_given(node, "hf_name"), seq_len=int(node.get("seq_len") or 0),
            val_fraction=float(node.get("val_fraction") or 0.0), streaming=bool(node.get("streaming")),
            max_documents=_given(node, "max_documents"),
            document_mask=bool(node.get("document_mask")), mixture="sources" in node,
            sources=node.get("sources"),
            image_size=int(node["image_size"]) if image else None,
            text_tokens=int(examples["max_text_len"]) if image else None,
            guidance=examples.get("guidance"),
        )

    @property
    def token_data(self) -> bool:
        """A tokenized corpus (False: the family's own samples, e.g. images)."""
        return self.tokenizer is not None

    @property
    def image_data(self) -> bool:
        """An image-caption group: an example builder and an image size."""
        return self.image_size is not None

    @property
    def packed(self) -> bool:
        """One source of token windows read from a position (not streamed, not a mixture): what a
        seq-len schedule re-windows between stages."""
        return self.token_data and not self.streaming and not self.mixture
