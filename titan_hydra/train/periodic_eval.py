"""Evaluation during training: the ``eval`` config group's object (``eval.freq`` steps apart).

Every rank contributes its weights as full tensors (``gather_full_state``: FSDP / TP / EP shards
all-gathered inside their groups, each pipeline stage's blocks from its own ranks); rank 0
assembles one unsharded copy of the model on CPU, runs the lm-eval harness on it
(``titan_hydra.evaluation``) and broadcasts the scores, which every rank logs as
``eval/<task>/<metric>``. The training model is not touched (no mode switch, no cache), so the
run continues exactly as without evaluation. The cost is one full copy of the weights on rank
0's host memory for the duration: right for the model sizes this evaluates quickly; a sharded
harness run is future work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from titan_hydra.errors import ConfigError
from titan_hydra.parallel.full_state import gather_full_state


class PeriodicEval:
    def __init__(self, freq: int = 0, tasks: list[str] | tuple[str, ...] = (), limit: int | None = None,
                 batch_size: int = 8, max_seq_len: int | None = None):
        if freq < 0:
            raise ConfigError(f"eval.freq={freq} must be >= 0 (0 = no evaluation during training)")
        self.freq, self.tasks, self.limit = int(freq), [str(t) for t in tasks], limit
        self.batch_size, self.max_seq_len = int(batch_size), max_seq_len

    @property
    def enabled(self) -> bool:
        return self.freq > 0

    def check(self) -> None:
        """Before training: lm-eval importable and every task known (one line each)."""
        if not self.enabled:
            return
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ConfigError("eval.freq > 0 needs the lm-eval harness: pip install -e '.[eval]' "
                              "(or set eval=none)") from None
        from titan_hydra.evaluation import check_tasks  # lm-eval: the optional eval extra, loaded only when asked for

        check_tasks(self.tasks)

    def due(self, step: int, last: bool) -> bool:
        return self.enabled and (step % self.freq == 0 or last)

    def run(self, parts: list[torch.nn.Module], family, args, tokenizer) -> dict[str, float]:
        """The harness's scores of the current weights, the same dict on every rank."""

        state = gather_full_state(parts)  # collective inside each rank's sharding groups
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        if distributed:
            pieces: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(state, pieces, dst=0)
            if rank == 0:
                state = {k: v for piece in pieces for k, v in piece.items()}
        scores: list[Any] = [None]
        if rank == 0:
            scores[0] = self._evaluate(state, family, args, tokenizer)
        if distributed:
            dist.broadcast_object_list(scores, src=0)
        return scores[0]

    def _evaluate(self, state: dict[str, torch.Tensor], family, args, tokenizer) -> dict[str, float]:
        from titan_hydra.evaluation import TitanLM, run_harness  # lm-eval (optional extra): see check

        with torch.device("meta"):
            model = family.build(args)
        model.to_empty(device="cpu")
        model.init_weights(buffer_device="cpu")
        missing, _ = model.load_state_dict(state, strict=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        missing = [k for k in missing if not (k == "output.weight" and getattr(args, "tie_word_embeddings", False))]
        if missing:
            raise RuntimeError(f"evaluation copy of the model lacks {missing[:3]} after gathering every rank's weights")
        window = min(self.max_seq_len or args.max_seq_len, args.max_seq_len)
        with torch.autocast("cpu", enabled=False):
            results = run_harness(TitanLM(model.float(), tokenizer, window, self.batch_size), self.tasks, self.limit)
        return {f"eval/{task}/{metric}": float(value) for task, metrics in results.items()
                for metric, value in metrics.items() if metric != "sample_len"}
