"""Config schema of ``model=qwen3_moe_debug`` / ``qwen3_30b_a3b`` / ``qwen3_235b_a22b`` options: derived from ``Qwen3MoeArgs`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml. The nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from titan_hydra.models.common.moe_config import MoEConfig
from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.qwen3_moe.model import Qwen3MoeArgs


Qwen3MoeConfig = schema_of(
    Qwen3MoeArgs,
    name="Qwen3MoeConfig",
    module=__name__,
    target="titan_hydra.models.qwen3_moe.Qwen3Moe",
    family="qwen3_moe",
    nested={"moe": MoEConfig},
)
