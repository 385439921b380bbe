"""Config schema of ``model=gpt_oss_*`` options: derived from ``GptOssArgs`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml. The nested ``moe`` node is ``MoEConfig``."""

from __future__ import annotations

from titan_hydra.models.common.moe_config import MoEConfig
from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.gpt_oss.model import GptOssArgs


GptOssConfig = schema_of(
    GptOssArgs,
    name="GptOssConfig",
    module=__name__,
    target="titan_hydra.models.gpt_oss.GptOss",
    family="gpt_oss",
    nested={"moe": MoEConfig},
)
