"""Hydra discovers launchers only inside the ``hydra_plugins`` namespace package.

The implementation lives in ``titan_hydra.launch`` (``slurm.py``, ``submitit_jobs.py``); this
package only gives it the module path Hydra accepts (``hydra/launcher=titan_slurm`` targets it,
and ``SweepCheckCallback`` points ``submitit_local`` / ``submitit_slurm`` at its subclasses).
"""
