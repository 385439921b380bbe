"""The local SLURM cluster as a pytest fixture, shared by the SLURM test modules.

``slurm`` installs (idempotent, no apt call when installed) and starts scripts/slurm's
single-node cluster, then checks that accounting answers: submitit reads job states from
``sacct``, and without it a finished or requeued job is never seen as done.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from helpers import REPO

SCRIPTS = REPO / "scripts" / "slurm"


@pytest.fixture(scope="session")
def slurm():
    """Install and start the local SLURM; skip where it cannot be installed."""
    if os.geteuid() != 0 and shutil.which("sbatch") is None:
        pytest.skip("SLURM tests need root to install and start slurmctld/slurmd (not root here)")
    if shutil.which("apt-get") is None and shutil.which("sbatch") is None:
        pytest.skip("SLURM tests need apt-get to install Debian's SLURM packages (no apt here)")
    for script in ("install.sh", "start.sh"):
        proc = subprocess.run(["bash", str(SCRIPTS / script)], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, f"{script} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    acct = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True, timeout=60)
    assert acct.returncode == 0 and "error" not in acct.stderr, (
        "SLURM accounting does not answer (mariadb/slurmdbd down?); run scripts/slurm/stop.sh then start.sh:\n"
        + acct.stderr[-1000:]
    )
    return True
