"""Joining the process group without hanging: a bounded rendezvous that fails with one line.

torch's ``env://`` rendezvous retries a TCP connection to MASTER_ADDR:MASTER_PORT for the
process group's timeout (30 minutes on gloo), logging a C++ warning now and then. A rank whose
master address does not resolve, or whose first node never comes up, therefore sat silent for
as long as the job's time limit allowed. Here every rank instead:

1. resolves MASTER_ADDR itself (``socket.getaddrinfo``) and fails at once if it does not resolve;
2. if it is not the store's host, waits for the store's port to accept a connection, for at most
   ``cluster.init_timeout_s``, before handing the address to torch (so a dead address costs the
   timeout, not 30 minutes, and prints one line instead of torch's retry warnings);
3. creates the process group with that timeout (the rendezvous and the backend's connections),
   then gives collectives back the backend's usual timeout, so a long rank-0-only step (a
   checkpoint export) does not trip a 5-minute limit.

Failures are ``UserError``s: ``launch.py`` prints ``error: cannot reach rendezvous at HOST:PORT
within Ns; ...`` and exits 2. On SLURM the master is the first node of the job; its name may not
resolve from the compute nodes (only SLURM's NodeAddr does), so ``master_address`` asks
``scontrol show node`` for it when DNS does not know the name.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from datetime import timedelta

from titan_hydra.errors import UserError

# ---------------------------------------------------------------- the master's address


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (a local rendezvous, store or Lighthouse binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_addr_of(scontrol_output: str) -> str | None:
    """``NodeAddr=`` of ``scontrol show node <name>`` output (None when it has none)."""
    match = re.search(r"(?:^|\s)NodeAddr=(\S+)", scontrol_output)
    return match.group(1) if match else None


def slurm_node_addr(node: str) -> str | None:
    """The address SLURM itself uses to reach ``node`` (None when scontrol cannot say)."""
    try:
        proc = subprocess.run(["scontrol", "show", "node", node], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return node_addr_of(proc.stdout) if proc.returncode == 0 else None


def resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (socket.gaierror, UnicodeError):
        return False


def master_address(node: str) -> str:
    """An address of SLURM node ``node`` that this machine can resolve: the name itself when it
    resolves (no call to slurmctld), else its NodeAddr. Unresolvable either way: the name, and
    the rendezvous fails on it with one line."""
    if resolves(node):
        return node
    addr = slurm_node_addr(node)
    return addr if addr and resolves(addr) else node


def resolve(host: str, port: int) -> str:
    """A numeric address for ``host`` (IPv4 preferred: torch's client otherwise logs IPv6
    failures every minute on hosts without IPv6 routes)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise UserError(
            f"cannot reach rendezvous at {host}:{port}: the host name does not resolve ({e}); "
            "set MASTER_ADDR to a resolvable name or address of rank 0's node"
        ) from None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return infos[0][4][0]


# ---------------------------------------------------------------- waiting for the store


def hosts_the_store(rank: int) -> bool:
    """Rank 0 starts the TCP store, unless torch elastic's agent already runs it for everyone."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return rank == 0 and not agent_store


def wait_for_port(host: str, address: str, port: int, timeout_s: float) -> None:
    """Return once ``address:port`` accepts a TCP connection; UserError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last: OSError | None = None
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            with socket.create_connection((address, port), timeout=min(2.0, remaining)):
                return
        except OSError as e:
            last = e
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    shown = host if host == address else f"{host} ({address})"
    reason = getattr(last, "strerror", None) or str(last or "no answer")
    raise UserError(
        f"cannot reach rendezvous at {shown}:{port} within {timeout_s:g}s ({reason}); rank 0 should "
        "be listening there: check that its node is up and reachable from this one, or raise "
        "cluster.init_timeout_s"
    )


# ---------------------------------------------------------------- the process group


def init_process_group(backend: str, timeout_s: float) -> None:
    """``torch.distributed.init_process_group`` from the env:// variables, bounded by ``timeout_s``."""
    import torch.distributed as dist

    if timeout_s <= 0:
        raise UserError(f"cluster.init_timeout_s={timeout_s:g} must be > 0")
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise UserError(f"{' and '.join(missing)} not set for rank {rank} of {world}; start ranks with "
                        "torchrun, SLURM (cluster=slurm) or cluster.nproc_per_node")
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    address = resolve(host, port)
    os.environ["MASTER_ADDR"] = address
    start = time.monotonic()
    if not hosts_the_store(rank):
        wait_for_port(host, address, port, timeout_s)
    remaining = max(1.0, timeout_s - (time.monotonic() - start))
    try:
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=remaining))
    except dist.DistError as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        joined = re.search(r"(\d+)/(\d+) clients joined", first)
        if joined:
            raise UserError(
                f"rendezvous at {host}:{port}: only {joined.group(1)} of {world} ranks arrived within "
                f"{timeout_s:g}s; the others could not reach this node (are they running? can they "
                "resolve and route to it?), or raise cluster.init_timeout_s"
            ) from None
        raise UserError(f"cannot reach rendezvous at {host}:{port} within {timeout_s:g}s ({first}); check that rank "
                        "0's node is up and reachable, or raise cluster.init_timeout_s") from None
    restore_collective_timeout(backend)


def restore_collective_timeout(backend: str) -> None:
    """Give collectives the backend's default timeout again (10 min NCCL, 30 min otherwise)."""
    import torch.distributed as dist
    from torch.distributed import constants

    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    if set_timeout is None:  # an older torch: collectives keep cluster.init_timeout_s
        return
    default = constants.default_pg_nccl_timeout if backend == "nccl" else constants.default_pg_timeout
    set_timeout(default)
