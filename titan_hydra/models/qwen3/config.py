"""Config schema of ``model=qwen3_*`` (dense) options: derived from ``Qwen3Args`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml."""

from __future__ import annotations

from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.qwen3.model import Qwen3Args


Qwen3Config = schema_of(
    Qwen3Args,
    name="Qwen3Config",
    module=__name__,
    target="titan_hydra.models.qwen3.Qwen3",
    family="qwen3",
)
