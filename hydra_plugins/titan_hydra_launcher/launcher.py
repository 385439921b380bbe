"""The launcher classes Hydra instantiates: ``conf/hydra/launcher/titan_slurm.yaml`` names
``TitanSlurmLauncher``; ``SweepCheckCallback`` hands ``hydra/launcher=submitit_local`` and
``submitit_slurm`` to the other two. All report each failed job as one line
(``titan_hydra.launch.submitit_jobs``)."""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher as _StockSlurm

from titan_hydra.launch.slurm import SlurmLauncher
from titan_hydra.launch.submitit_jobs import OneLineFailures
from titan_hydra.runtime.threads import exported, launches_env


class TitanSlurmLauncher(SlurmLauncher):
    """Hydra's submitit SLURM launcher, rank-aware; see ``titan_hydra.launch.slurm.SlurmLauncher``."""

    _EXECUTOR = "slurm"


class TitanLocalLauncher(OneLineFailures, LocalLauncher):
    """``hydra/launcher=submitit_local``: the same local processes, points checked first, a
    failed job one line, and the jobs of a batch (which run at once) share the cores."""

    def launch(self, job_overrides, initial_job_idx):
        # submitit's local jobs inherit this environment when they start
        with exported(launches_env(len(job_overrides))):
            return super().launch(job_overrides, initial_job_idx)


class TitanSubmititSlurmLauncher(OneLineFailures, _StockSlurm):
    """``hydra/launcher=submitit_slurm`` (not ``cluster=slurm``): Hydra's SLURM launcher, points
    checked first, a failed job one line."""
