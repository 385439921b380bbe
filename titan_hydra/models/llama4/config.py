"""Config schema of ``model=llama4_*`` options: derived from ``Llama4Args`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml. The nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from titan_hydra.models.common.moe_config import MoEConfig
from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.llama4.model import Llama4Args


Llama4Config = schema_of(
    Llama4Args,
    name="Llama4Config",
    module=__name__,
    target="titan_hydra.models.llama4.Llama4",
    family="llama4",
    nested={"moe": MoEConfig},
)
