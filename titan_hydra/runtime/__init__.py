"""What a rank needs from the machine and the job it runs in, below the recipe that trains and the
launchers that start it: a bounded process-group start with one-line failures (``rendezvous``) and
SLURM's time-limit / preemption signal turned into a checkpoint and a requeue (``preemption``);
the cluster's device, backend and start-method rules (``device``)."""
