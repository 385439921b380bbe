"""A run's state as live tensors: what a recovering torchft replica group receives from a peer.

A group that died and came back must continue from the step the live groups are at, not from
the last checkpoint on disk. torchft's manager asks each rank for a state dict, sends a live
peer's to the recovering rank of the same group rank and hands it to a load function; these are
those two functions. The state is a checkpoint's (model, optimizer, LR schedule, optimizer
hyper-parameters, data loader position, train state) held as tensors and JSON, without the
per-rank RNG state (another group's random streams are not this group's), and it is applied
by the same code as a checkpoint load (``load.apply_state``), so the two cannot drift.
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed.checkpoint.state_dict import get_model_state_dict

from titan_hydra.checkpoint.load import apply_state
from titan_hydra.checkpoint.state import RunParts, members


def live_state_fns(run: RunParts) -> tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]:
    """(state_dict, load_state_dict) for ``torchft.Manager``."""

    def state_dict() -> dict[str, Any]:
        # torch's optimizer state-dict reader first initializes an optimizer that holds no state
        # (a stateless SGD; any optimizer before its first step) with a zero-lr step on zero
        # gradients it sets and then clears. torchft calls this from its quorum thread while the
        # training thread runs forward and backward: that step bumps the parameters' versions
        # (autograd then refuses the backward) and drops the gradients. Such an optimizer has
        # nothing to send; the receiver keeps its own, equally empty, state.
        stateful = all(o.state for o in members(run.optimizer))
        return {"model": get_model_state_dict(run.module), "optim": run.optim_state() if stateful else {},
                "extra": run.extra_state(), "loader": run.rank_state()["dataloader"]}

    def load_state_dict(sd: dict[str, Any]) -> None:
        # torchft applies the state mid-step, with this step's gradients in place; torch's optimizer
        # loader only creates the optimizer's state (a zero-lr step) when no gradient is set, and a
        # group that restarted has none yet. The gradients are put back for the step that follows.
        params = [p for m in run.model_parts for p in m.parameters()]
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            apply_state(run, sd["model"], sd["optim"], sd["extra"], {"dataloader": sd["loader"]},
                        source="the state received from a live replica group")
        finally:
            for p, g in zip(params, grads):
                p.grad = g

    return state_dict, load_state_dict
