"""The class ``conf/hydra/launcher/titan_slurm.yaml`` names (see titan_hydra.launch.slurm)."""

from titan_hydra.launch.slurm import SlurmLauncher


class TitanSlurmLauncher(SlurmLauncher):
    """Hydra's submitit SLURM launcher, rank-aware; see ``titan_hydra.launch.slurm.SlurmLauncher``."""

    _EXECUTOR = "slurm"
