"""Any transformers causal LM, trained by the engine (``model=hf``): the model is transformers'
own class (``model.py``), its parallel plans are transformers' own (``plans.py``), and the family
(``family.py``) answers the engine's questions from the instantiated meta model and its config.

``FAMILY`` is what ``model.family: hf`` resolves to. Debug flavors: ``conf/model/hf_*_debug.yaml``.
"""

from __future__ import annotations

from titan_hydra.models.hf.family import HFFamily
from titan_hydra.models.hf.model import HFArgs, causal_lm

FAMILY = HFFamily()

__all__ = ["FAMILY", "HFArgs", "causal_lm"]
