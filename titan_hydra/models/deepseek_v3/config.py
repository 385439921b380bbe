"""Config schema of ``model=deepseek_v3_*`` options: derived from ``DeepSeekV3Args`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml. The nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from titan_hydra.models.common.moe_config import MoEConfig
from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.deepseek_v3.model import DeepSeekV3Args


DeepSeekV3Config = schema_of(
    DeepSeekV3Args,
    name="DeepSeekV3Config",
    module=__name__,
    target="titan_hydra.models.deepseek_v3.DeepSeekV3",
    family="deepseek_v3",
    nested={"moe": MoEConfig},
)
