"""Config schema of ``model=llama*`` options: derived from ``LlamaArgs`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml."""

from __future__ import annotations

from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.llama3.model import LlamaArgs


Llama3Config = schema_of(
    LlamaArgs,
    name="Llama3Config",
    module=__name__,
    target="titan_hydra.models.llama3.Llama3",
    family="llama3",
)
