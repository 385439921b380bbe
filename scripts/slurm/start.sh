#!/usr/bin/env bash
# Start a single-node SLURM by hand (no systemd): munge, mariadb + slurmdbd, slurmctld, slurmd.
#
#   scripts/slurm/start.sh            # idempotent: does nothing if `sinfo` already answers
#   TITAN_SLURM_DIR=/tmp/x scripts/slurm/start.sh
#
# Writes /etc/slurm/slurm.conf and /etc/slurm/slurmdbd.conf from the templates beside this
# script, keeps state, spool, pids and logs in $TITAN_SLURM_DIR (default /var/tmp/titan_slurm),
# and waits until the node accepts jobs. Everything runs as root (SlurmUser=root), which a test
# cluster may do. Needs scripts/slurm/install.sh first. stop.sh ends what this started.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
DIR="${TITAN_SLURM_DIR:-/var/tmp/titan_slurm}"
CPUS="${TITAN_SLURM_CPUS:-8}"
HOST="$(hostname -s)"

# Running only if the node answers AND accounting does (submitit polls sacct; a dead mariadb or
# slurmdbd would make jobs look unfinished). Otherwise the steps below start what is missing.
if [ -e /etc/slurm/slurm.conf ] && timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE 'idle|mix|alloc' \
   && timeout 10 sacct -n -X -S now-1minute >/dev/null 2>&1; then
  echo "slurm: already running"; exit 0
fi
mkdir -p "$DIR"/state "$DIR"/spool /etc/slurm
MEM="$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p')"
sub() { sed -e "s#@DIR@#$DIR#g" -e "s#@HOST@#$HOST#g" -e "s#@CPUS@#$CPUS#g" -e "s#@MEM@#$MEM#g" \
            -e "s#@CTLD_PORT@#${TITAN_SLURM_CTLD_PORT:-6817}#g" -e "s#@SLURMD_PORT@#${TITAN_SLURM_SLURMD_PORT:-6818}#g" "$1"; }
sub "$HERE/slurm.conf.in" > /etc/slurm/slurm.conf
sub "$HERE/slurmdbd.conf.in" > /etc/slurm/slurmdbd.conf
chmod 600 /etc/slurm/slurmdbd.conf

running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
wait_for() {  # wait_for SECONDS CMD...
  local n=$(( $1 * 5 )); shift
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "slurm: timed out waiting for: $*" >&2; return 1
}

# munge: key made by the package; socket dir owned by munge.
[ -s /etc/munge/munge.key ] || { mungekey --create 2>/dev/null || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key; chown munge: /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
mkdir -p /run/munge && chown munge: /run/munge && chmod 755 /run/munge
if ! running /run/munge/munged.pid; then
  runuser -u munge -- /usr/sbin/munged --pid-file=/run/munge/munged.pid
fi
wait_for 10 munge -n

# mariadb + the accounting database user.
mkdir -p /run/mysqld && chown mysql: /run/mysqld
if ! running /run/mysqld/mariadb.pid; then
  nohup /usr/sbin/mariadbd --user=mysql --pid-file=/run/mysqld/mariadb.pid --socket=/run/mysqld/mysqld.sock \
    --skip-networking=0 --bind-address=127.0.0.1 > "$DIR/mariadb.log" 2>&1 &
fi
wait_for 30 mariadb -e 'select 1'
mariadb -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost'; FLUSH PRIVILEGES;"

running "$DIR/slurmdbd.pid" || slurmdbd
wait_for 30 sacctmgr -n list cluster
sacctmgr -i -Q add cluster titan >/dev/null 2>&1 || true

running "$DIR/slurmctld.pid" || slurmctld -c
wait_for 30 scontrol ping
running "$DIR/slurmd.pid" || slurmd
wait_for 60 sh -c "sinfo -h -o %T | grep -qE 'idle|mix|alloc'"
echo "slurm: running (state in $DIR)"
