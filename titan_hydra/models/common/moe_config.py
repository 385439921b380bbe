"""Config schema of the nested ``model.moe`` node that every MoE family's schema embeds, derived
from ``MoEArgs``: the expert count, top-k and expert width are shapes (MISSING, set by each
flavor's yaml); the routing and balancing conventions take MoEArgs' defaults."""

from __future__ import annotations

from titan_hydra.models.common.moe import MoEArgs
from titan_hydra.models.common.schema import schema_of

MoEConfig = schema_of(MoEArgs, name="MoEConfig", module=__name__)
