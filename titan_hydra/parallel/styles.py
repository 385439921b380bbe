"""ParallelStyles that torch does not ship, for tensor-parallel plans (``ModelFamily.tp_plan``).

They are defined in ``titan_hydra/models/common/tp_styles.py`` (the decoder families' plan names
them, and models do not import the engine); a model defined outside this package may import them
from either place.
"""

from titan_hydra.models.common.tp_styles import HeadShardedNorm, ReplicateParallel

__all__ = ["HeadShardedNorm", "ReplicateParallel"]
