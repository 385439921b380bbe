#!/usr/bin/env bash
# Stop the daemons that start.sh started (by their pid files), newest first.
DIR="${TITAN_SLURM_DIR:-/var/tmp/titan_slurm}"
for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/slurmdbd.pid" /run/mysqld/mariadb.pid /run/munge/munged.pid; do
  [ -s "$pidfile" ] || continue
  pid="$(cat "$pidfile")"
  kill "$pid" 2>/dev/null || continue
  for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
done
echo "slurm: stopped"
