#!/usr/bin/env bash
# Install a single-node SLURM with accounting from Debian 12 packages (idempotent).
#
# Why these packages: slurmctld + slurmd run the cluster; slurm-client gives sbatch/srun/
# squeue/scontrol; munge authenticates; slurmdbd + mariadb give `sacct`, which submitit polls
# for job state (without accounting a cancelled job makes job.result() hang).
# Debian's maintainer scripts try to start the daemons; with no systemd that fails, so a
# policy-rc.d that exits 101 is put in place for the install (and removed again if we made it).
# Fast when everything is installed already: no apt call at all.
set -euo pipefail

PKGS=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins munge
      slurmdbd slurm-wlm-mysql-plugin mariadb-server)

missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "slurm: all packages installed"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "slurm: need root to install: ${missing[*]}" >&2
  exit 3
fi
command -v apt-get >/dev/null || { echo "slurm: no apt-get on this machine" >&2; exit 3; }

made_policy=0
if [ ! -e /usr/sbin/policy-rc.d ]; then
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
  chmod +x /usr/sbin/policy-rc.d
  made_policy=1
fi
export DEBIAN_FRONTEND=noninteractive
# One `apt-get update` per machine (the lists may be empty on a fresh image).
stamp=/var/lib/apt/titan_hydra_slurm_updated
# Another apt (an image's first-boot updates) may hold the dpkg lock: wait for it instead of failing.
APT=(apt-get -o DPkg::Lock::Timeout=900)
[ -e "$stamp" ] || { "${APT[@]}" update -q && touch "$stamp"; }
"${APT[@]}" install -y -q --no-install-recommends "${missing[@]}"
[ $made_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
echo "slurm: installed ${missing[*]}"
