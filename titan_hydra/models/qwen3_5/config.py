"""Config schema of ``model=qwen3_5_*`` (dense) options: derived from ``Qwen35Args``
(models/common/schema.py); shape fields are MISSING here and live in each flavor's yaml."""

from __future__ import annotations

from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.qwen3_5.model import Qwen35Args


Qwen35Config = schema_of(
    Qwen35Args,
    name="Qwen35Config",
    module=__name__,
    target="titan_hydra.models.qwen3_5.Qwen35",
    family="qwen3_5",
)
