"""Hydra discovers launchers only inside the ``hydra_plugins`` namespace package.

The implementation lives in ``titan_hydra.launch.slurm``; this package only gives it the
module path Hydra accepts (``hydra/launcher=titan_slurm`` targets it).
"""
