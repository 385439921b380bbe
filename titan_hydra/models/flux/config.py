"""Config schema of ``model=flux_*`` options: derived from ``FluxArgs`` (models/common/schema.py),
so every field, type and default is written once, in the args dataclass; its shape fields are
MISSING here and live in each flavor's conf/model/*.yaml."""

from __future__ import annotations

from titan_hydra.models.common.schema import schema_of
from titan_hydra.models.flux.model import FluxArgs

FluxConfig = schema_of(FluxArgs, name="FluxConfig", module=__name__, target="titan_hydra.models.flux.Flux",
                       family="flux")
