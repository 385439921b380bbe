"""Replica groups that come and go: torchft around the same training loop (``fault_tolerance``).

Without it a lost rank stops the job, and the job resumes from its last checkpoint. With
``fault_tolerance=torchft`` the data-parallel replicas are split into ``replica_groups`` groups,
each an ordinary run of this platform (``cluster.nproc_per_node`` ranks, any layout inside it).
The groups do not share a process group; each step:

1. ``begin_step``: the group asks torchft's Lighthouse for the quorum of live groups (async);
2. backward as usual inside the group (FSDP/TP/... over the group's own mesh);
3. ``reduce_gradients``: every gradient is averaged over the groups in the quorum through
   torchft's managed process group (gloo here, NCCL on GPUs), whose failures do not raise;
4. ``commit``: the optimizer steps only if every rank of every participating group succeeded
   and at least ``min_replicas`` groups took part; otherwise the step is dropped and retried.

Semi-synchronous training (``semi_sync=local_sgd|diloco``) lets each group take ``sync_every``
optimizer steps on its own and meets the others only then: LocalSGD averages the weights,
DiLoCo averages the pseudo-gradient (weights at the last meeting minus weights now) and steps an
outer optimizer (Nesterov SGD) with it. torchft's own ``LocalSGD`` / ``DiLoCo`` do this from
hooks on the (inner) optimizer, so the training loop is the same; between meetings the groups
send nothing, and a failed meeting rolls the group back to the last one.

A group that joins late or comes back after a crash is told so by the quorum: it receives the
live groups' state (``checkpoint/live.py``: model, optimizer, schedule, loader position, step)
from a peer over the network, not from disk, and steps on with them. The groups read different
slices of every global batch (``ParallelDims.data_rank``), so a fault-free run equals a
data-parallel run of ``replica_groups x dp`` ranks.

The launcher (``launch/ft_local.py``) starts the Lighthouse and the groups and restarts a group
that died; each group learns its index and the Lighthouse from the environment.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from titan_hydra.errors import ConfigError, UserError
from titan_hydra.runtime.rendezvous import free_port

GROUP_ENV = "TITAN_HYDRA_FT_GROUP"  # this process's replica group (the launcher sets it)
LIGHTHOUSE_ENV = "TITAN_HYDRA_FT_LIGHTHOUSE"  # http://host:port (the launcher sets it)
# a directory where the groups of a fresh launch wait for each other once (not set on a restart)
START_BARRIER_ENV = "TITAN_HYDRA_FT_START_BARRIER"
NAMES = ("none", "torchft")
SEMI_SYNC = ("local_sgd", "diloco")


class FaultTolerance:
    """The ``fault_tolerance`` group's object (``_target_``): its keyword defaults are the group's schema."""

    def __init__(self, name: str = "none",  # one of NAMES
                 replica_groups: int = 1,  # groups the local launcher starts (each cluster.nproc_per_node ranks)
                 min_replicas: int = 1,  # a step commits only with at least this many groups in the quorum
                 lighthouse: str | None = None,  # http://host:port of a running Lighthouse; None: launcher starts one
                 timeout_s: float = 60.0,  # collectives and checkpoint transfer between groups
                 quorum_timeout_s: float = 60.0,  # how long a step waits for its quorum
                 join_timeout_ms: int = 1000,  # Lighthouse: how long a forming quorum waits for more groups
                 max_restarts: int = 3,  # local launcher: restarts of a group that died, per group
                 # this run is replica group <group> alone (started on its own: another machine, a SLURM
                 # job), meeting the others at ``lighthouse``; None: launch.py starts every group here
                 group: int | None = None,
                 # None: every step averages gradients over the groups; local_sgd / diloco: each group
                 # steps on its own and the groups meet every sync_every steps (weights averaged /
                 # DiLoCo outer step)
                 semi_sync: str | None = None,
                 sync_every: int = 20,
                 # DiLoCo's outer optimizer: SGD with Nesterov momentum (the paper's values)
                 outer_lr: float = 0.7, outer_momentum: float = 0.9, outer_nesterov: bool = True) -> None:
        if name not in NAMES:
            raise ConfigError(f"fault_tolerance={name!r} is not one of {', '.join(NAMES)}")
        if replica_groups < 1 or not 1 <= min_replicas <= replica_groups:
            raise ConfigError(f"fault_tolerance.min_replicas={min_replicas} must be in [1, replica_groups="
                              f"{replica_groups}]")
        if group is not None and not 0 <= group < replica_groups:
            raise ConfigError(f"fault_tolerance.group={group} must be in [0, replica_groups={replica_groups})")
        if semi_sync is not None and semi_sync not in SEMI_SYNC:
            raise ConfigError(f"fault_tolerance.semi_sync={semi_sync!r} is not one of null, {', '.join(SEMI_SYNC)}")
        if sync_every < 1:
            raise ConfigError(f"fault_tolerance.sync_every={sync_every} must be >= 1 (optimizer steps between syncs)")
        self._group = group
        self.semi_sync, self.sync_every = semi_sync, int(sync_every)
        self.outer = {"lr": float(outer_lr), "momentum": float(outer_momentum), "nesterov": bool(outer_nesterov)}
        self.name, self.replica_groups, self.min_replicas = name, int(replica_groups), int(min_replicas)
        self.lighthouse, self.timeout_s, self.quorum_timeout_s = lighthouse, timeout_s, quorum_timeout_s
        self.join_timeout_ms, self.max_restarts = int(join_timeout_ms), int(max_restarts)
        self.manager = None
        self.recoveries = 0
        self.recover_s = 0.0
        self.dropped = 0  # steps not committed (a group failed during them)
        self._rank = 0
        self.sent_bytes = 0  # what this rank handed to the cross-group allreduce (gradients, weights)
        self._quorum_ids: set[int] = set()
        self._store = None
        self._sync = None  # torchft's LocalSGD / DiLoCo, while semi-synchronous

    @property
    def enabled(self) -> bool:
        return self.name == "torchft"

    @property
    def group(self) -> int:
        """This process's replica group: the launcher's (environment), else ``fault_tolerance.group``
        (a group started on its own), else 0."""
        if GROUP_ENV in os.environ:
            return int(os.environ[GROUP_ENV])
        return int(self._group or 0)

    @property
    def starts_alone(self) -> bool:
        """``fault_tolerance.group`` is set: this launch is that one group, meeting the others at the
        Lighthouse (else the launcher starts every group)."""
        return self._group is not None

    def lighthouse_addr(self) -> str:
        addr = os.environ.get(LIGHTHOUSE_ENV) or self.lighthouse
        if not addr:
            raise ConfigError("fault_tolerance=torchft needs a Lighthouse: launch through launch.py (it starts "
                              "one) or set fault_tolerance.lighthouse=http://host:port")
        return addr if "://" in addr else f"http://{addr}"

    # ------------------------------------------------------------------ lifetime
    def start(self, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None], *, rank: int,
              world_size: int, step: int = 0, device: torch.device = torch.device("cpu"),
              model_parts: list[torch.nn.Module] | None = None, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Create this rank's torchft manager (after the group's own process group exists); ``step``
        is where this group stands (a resumed checkpoint's step): the quorum heals groups that are
        behind from one that is furthest. Semi-synchronous runs hook ``optimizer`` (the inner one)
        to meet the other groups every ``sync_every`` steps over ``model_parts``' weights."""
        # torchft logs every quorum and commit at INFO (Rust and Python) and warns at each quorum
        # that CPU runs have no NCCL flight recorder: the console keeps its own step line and the
        # ft/* metrics instead, and torchft's errors; RUST_LOG / the loggers' levels bring the rest back.
        # A lost peer makes torchft log one ERROR with a traceback per tensor of the failed step
        # (hundreds of lines): commit() says it once instead, with the error's first line.
        os.environ.setdefault("RUST_LOG", "warn")
        for name in ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
        self._rank = rank
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL  # only fault-tolerant runs load torchft

        timed_load = self._timed(load_state_dict)
        check_lighthouse(self.lighthouse_addr())
        if dist.is_initialized():  # the group's rendezvous store hosts the manager's keys too
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        else:  # a one-rank group: a store of its own
            addr, port = "127.0.0.1", free_port()
            self._store = dist.TCPStore(addr, port, 1, is_master=True, wait_for_workers=False)
        self.manager = Manager(
            # gradients on GPUs cross groups through NCCL; on CPU through gloo
            pg=(ProcessGroupNCCL if device.type == "cuda" else ProcessGroupGloo)(timeout=timedelta(seconds=self.timeout_s)),
            min_replica_size=self.min_replicas,
            load_state_dict=timed_load, state_dict=state_dict, replica_id=f"group{self.group}",
            lighthouse_addr=self.lighthouse_addr(), rank=rank, world_size=world_size, store_addr=addr,
            store_port=port, timeout=timedelta(seconds=self.timeout_s),
            quorum_timeout=timedelta(seconds=self.quorum_timeout_s),
            connect_timeout=timedelta(seconds=self.quorum_timeout_s),
            # every group initializes its weights from training.seed: step 0 needs no copy (with one,
            # the first step averages in the copying group's zeros)
            init_sync=False,
            # LocalSGD / DiLoCo form the quorum at a meeting and heal before averaging (synchronously)
            use_async_quorum=self.semi_sync is None,
        )
        self._count_sent_bytes()
        if step:  # the manager counts meetings: every step when synchronous, every sync_every otherwise
            meetings = int(step) // (self.sync_every if self.semi_sync else 1)
            self.manager.load_state_dict({"step": meetings, "batches_committed": meetings * self.replica_groups})
        if self.semi_sync is not None:
            self._attach(model_parts, optimizer)
        self._wait_for_the_other_groups(rank, world_size)

    def _attach(self, model_parts: list[torch.nn.Module] | None, optimizer: torch.optim.Optimizer | None) -> None:
        from torchft.local_sgd import DiLoCo, LocalSGD  # only semi-synchronous runs load it

        if not model_parts or optimizer is None:
            raise ValueError("semi-synchronous fault tolerance needs the model parts and the inner optimizer")
        model = torch.nn.ModuleList(model_parts)  # every stage of this rank as one module (its parameters)
        if self.semi_sync == "local_sgd":
            self._sync = LocalSGD(self.manager, model, optimizer, self.sync_every)
        else:  # one fragment: the whole model meets at once (streaming DiLoCo would split it)
            outer = torch.optim.SGD(model.parameters(), **self.outer)
            self._sync = DiLoCo(self.manager, [model], optimizer, outer, self.sync_every)
        self._sync.__enter__()  # registers the optimizer hooks; close() removes them

    def _count_sent_bytes(self) -> None:
        """Count what goes through the manager's allreduce (ours and LocalSGD's / DiLoCo's): the
        communication a layout costs, measured rather than computed."""
        allreduce = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args, **kwargs):
            self.sent_bytes += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted

    def _wait_for_the_other_groups(self, rank: int, world_size: int) -> None:
        """On a fresh launch, start stepping when every group's manager is up: the Lighthouse only
        waits (join_timeout_ms) for groups that already heartbeat, and a group still importing
        torch would otherwise find the others some steps ahead and have to copy their state."""
        barrier = os.environ.get(START_BARRIER_ENV)
        if not barrier:
            return
        path = Path(barrier)
        (path / f"{self.group}.{rank}").touch()
        deadline = time.monotonic() + self.quorum_timeout_s
        while len(list(path.glob("*.*"))) < self.replica_groups * world_size and time.monotonic() < deadline:
            time.sleep(0.05)

    def _timed(self, load: Callable[[dict], None]) -> Callable[[dict], None]:
        def timed(sd: dict) -> None:
            t0 = time.perf_counter()
            load(sd)
            self.recoveries += 1
            self.recover_s += time.perf_counter() - t0
        return timed

    def close(self) -> None:
        if self._sync is not None:
            self._sync.__exit__(None, None, None)
            self._sync = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ------------------------------------------------------------------ one step
    # Synchronous: a quorum, a gradient average and a commit every step. Semi-synchronous: none of
    # these (the optimizer hooks meet the other groups every sync_every steps); the loss logged is
    # the group's own.
    def begin_step(self) -> None:
        if self.semi_sync is None:
            self.manager.start_quorum()

    def reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        """Average every gradient over the replica groups in the quorum (a group that is healing
        contributes zeros and is not counted)."""
        if self.semi_sync is not None:
            return
        works = []
        for p in params:
            if p.grad is None:
                continue
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a DTensor's local shard
            works.append(self.manager.allreduce(grad))
        for work in works:
            work.wait()

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` averaged over the replica groups in the quorum (the loss the console shows)."""
        if self.semi_sync is not None:
            return value
        value = value.detach().float().clone()
        self.manager.allreduce(value).wait()
        return value

    def commit(self) -> bool:
        """Whether this step may update the weights (every group of the quorum agrees)."""
        if self.semi_sync is not None:
            return True
        if self.manager.should_commit():
            return True
        self.dropped += 1
        if self._rank == 0:
            error = self.manager.errored()
            # the first sentence, without gloo's "[source/file.cc:553] " prefix
            why = re.sub(r"^\[[^\]]*\]\s*", "", str(error.original_exception).strip().splitlines()[0]).split(". ")[0][:160] \
                if error else "a group did not finish it"
            print(f"torchft: step {self.manager.current_step() + 1} of group {self.group} not committed ({why}); "
                  "the next batch retries it", flush=True)
        return False

    def metrics(self) -> dict[str, float]:
        """ft/participants: groups in the last quorum; ft/quorums: distinct quorums this group has
        been in (a group leaving or joining forms a new one); ft/recoveries and ft/recover_s: states
        received from a peer and the seconds spent applying them; ft/sent_mb: cumulative MB this
        rank sent to the other groups; ft/syncs: meetings committed; ft/dropped: steps not committed."""
        self._quorum_ids.add(int(getattr(self.manager, "_quorum_id", -1)))  # torchft keeps it private
        return {"ft/participants": float(self.manager.num_participants()), "ft/recoveries": float(self.recoveries),
                "ft/recover_s": self.recover_s, "ft/quorums": float(len(self._quorum_ids - {-1})),
                "ft/sent_mb": self.sent_bytes / 2**20, "ft/syncs": float(self.manager.current_step()),
                "ft/dropped": float(self.dropped)}

    def describe(self) -> str:
        mode = (f"{self.semi_sync} every {self.sync_every} steps" if self.semi_sync else "synchronous")
        return (f"torchft, replica group {self.group} of {self.replica_groups} ({mode}, at least {self.min_replicas} "
                f"group(s) per quorum), Lighthouse {self.lighthouse_addr()}")


def check_lighthouse(addr: str, timeout_s: float = 5.0) -> None:
    """One line when nothing answers at the Lighthouse's address (before any group starts)."""
    hostport = addr.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
            return
    except (OSError, ValueError) as e:
        raise UserError(f"cannot reach the torchft Lighthouse at {addr} ({e}); start one (torchft_lighthouse "
                        "--bind host:port) or leave fault_tolerance.lighthouse unset for launch.py to start one") from None



