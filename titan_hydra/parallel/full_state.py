"""Every layout's shards of a model gathered back into full tensors.

Evaluation during training and the tests' parity checks need the whole model on one rank
whatever the layout (FSDP / TP / EP shards, pipeline stages): each rank contributes its parts as
full tensors through DCP's state-dict API (a collective inside each sharding group).
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict


def gather_full_state(parts: list[torch.nn.Module]) -> dict[str, torch.Tensor]:
    """Full (unsharded) CPU copies of this rank's parameters, keyed by FQN."""
    out: dict[str, torch.Tensor] = {}
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    for part in parts:
        for k, v in get_model_state_dict(part, options=options).items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = v.detach().cpu().clone()
    return out
