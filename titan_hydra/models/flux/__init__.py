"""FLUX.1 family: the MMDiT of black-forest-labs FLUX.1 dev/schnell (model.py), its diffusers
converter (diffusers_io.py), frozen encoders (encoders.py), the training examples it learns from
(examples.py) and what the engine asks of it (family.py).
``FAMILY`` is what ``model.family: flux`` resolves to; flavors live in ``conf/model/flux_*.yaml``.
"""

from __future__ import annotations

from titan_hydra.models.flux.family import FLOW_MATCHING, FluxFamily
from titan_hydra.models.flux.model import Flux, FluxArgs

FAMILY = FluxFamily()

__all__ = ["FAMILY", "FLOW_MATCHING", "Flux", "FluxArgs"]
