"""Config schema of ``model=qwen3_5_moe_*`` options: derived from ``Qwen35MoeArgs``
(models/common/schema.py); the nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from titan_hydra.models.common.moe_config import MoEConfig
from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.qwen3_5_moe.model import Qwen35MoeArgs


Qwen35MoeConfig = schema_of(
    Qwen35MoeArgs,
    name="Qwen35MoeConfig",
    module=__name__,
    target="titan_hydra.models.qwen3_5_moe.Qwen35Moe",
    family="qwen3_5_moe",
    nested={"moe": MoEConfig},
)
