"""Silent data corruption: replicas that must hold bit-identical weights are compared.

Under data-parallel replication (``parallelism.dp_replicate > 1``: DDP, HSDP) every replica holds
the same parameters (or the same shards) bit for bit after every step: the same reduced
gradients went through the same optimizer. Every ``health.checksum_every`` steps each rank sums
the bit patterns of each of its parameters (exact integers: one flipped bit changes its sum), the
replicas' sums are gathered over the ``dp_replicate`` group and compared. A rank that disagrees
with the majority is named (two replicas that disagree: both, which one is wrong is unknowable
from two copies), with the first parameter that differs; per ``health.checksum_action`` the run
stops (``SilentCorruption`` on every rank: a restart resumes from the last checkpoint) or logs it.
Without replication (one process, plain FSDP, TP) there is no second copy: the check is off.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

_BITS = {4: torch.int32, 2: torch.int16, 8: torch.int64}


class SilentCorruption(RuntimeError):
    """Replicas' weights differ: raised on every rank alike (they all see the gathered sums)."""


def _local(p: torch.Tensor) -> torch.Tensor:
    return (p.to_local() if isinstance(p, DTensor) else p).detach()


@torch.no_grad()
def param_checksums(params: list[torch.Tensor]) -> torch.Tensor:
    """int64 [len(params)]: each parameter's local bit patterns summed."""
    sums = []
    for p in params:
        t = _local(p).contiguous()
        sums.append(t.view(_BITS.get(t.element_size(), torch.uint8)).to(torch.int64).sum())
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)


class ReplicaCheck:
    """Compares this rank's parameter sums with its replicas' (``dp_replicate`` group) when due."""

    def __init__(self, every: int, action: str, dims, device: torch.device) -> None:
        mesh = dims.submesh("dp_replicate") if dims is not None and dist.is_initialized() else None
        self.group = mesh.get_group() if mesh is not None and mesh.size() > 1 else None
        self.every, self.action, self.device = every, action, device

    @property
    def enabled(self) -> bool:
        return self.every > 0 and self.group is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.every == 0

    def check(self, step: int, parts: list[torch.nn.Module]) -> tuple[dict[str, float], str | None]:
        """(metrics, console line or None); raises SilentCorruption when the action is ``stop``."""
        named = [(n, p) for part in parts for n, p in part.named_parameters()]
        mine = param_checksums([p for _, p in named]).to(self.device)
        ranks = dist.get_process_group_ranks(self.group)
        every = [torch.empty_like(mine) for _ in ranks]
        dist.all_gather(every, mine, group=self.group)
        keys = [tuple(t.tolist()) for t in every]
        majority, votes = Counter(keys).most_common(1)[0]
        odd = [r for r, k in zip(ranks, keys) if k != majority or votes * 2 <= len(keys)]
        if not odd:
            return {"health/replicas_differ": 0.0}, None
        first = next(i for i in range(len(named)) if len({k[i] for k in keys}) > 1)
        line = (f"silent corruption at step {step}: rank(s) {odd} hold weights that differ from their "
                f"replicas' (first: {named[first][0]})")
        if self.action == "stop":
            raise SilentCorruption(line + "; stopping: resume from the last checkpoint (health.checksum_action=log "
                                          "only reports it)")
        return {"health/replicas_differ": float(len(odd))}, line
