"""Evaluation during training: the ``eval`` group's settings run on the rank's model.

Three things, each on its own schedule: the lm-eval harness (``eval.freq`` steps apart; language
families), sample pictures (``eval.sample_every`` steps apart; families that draw them, e.g. a
text-to-image model: one picture per ``eval.sample_prompts`` entry, logged to TensorBoard and W&B
and written as a PNG row under ``<run>/samples/``) and fidelity (``eval.fidelity_every`` steps
apart: pictures drawn with the same sampler and fixed noise from captions the data holds out of
training, read back by the data's own reader, logged as ``val/fidelity/<what>``: the fraction
right). All run on one unsharded copy of the model: every rank
contributes its weights as full tensors (``gather_full_state``: FSDP / TP / EP shards all-gathered
inside their groups, each pipeline stage's blocks from its own ranks); rank 0 assembles the copy on
CPU, runs the harness (``titan_hydra.evaluation``) and draws the pictures, and broadcasts the
scores, which every rank logs as ``eval/<task>/<metric>`` (every task's summary under one name:
``acc`` or ``ppl``). The training model is not touched (no mode switch, no cache, its own random
generator for the pictures' noise), so the run continues exactly as without evaluation. The cost
is one full copy of the weights on rank 0's host memory for the duration: right for the model
sizes this evaluates quickly; ``eval.sharded=true`` scores the harness's requests without it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from titan_hydra.config.eval import EvalSettings
from titan_hydra.parallel.full_state import gather_full_state


class PeriodicEval:
    """The ``eval`` group's settings (``config/eval.EvalSettings``) run on this rank's model: the
    harness, the sample pictures and the fidelity scores, each when its schedule says."""

    def __init__(self, settings: EvalSettings):
        self.settings = settings

    @property
    def enabled(self) -> bool:
        return self.settings.enabled

    def _fidelity_due(self, step: int, last: bool) -> bool:
        every = self.settings.fidelity_every
        return every > 0 and (step % every == 0 or last)

    def _harness_due(self, step: int, last: bool) -> bool:
        every = self.settings.freq
        return every > 0 and (step % every == 0 or last)

    def _samples_due(self, step: int, last: bool) -> bool:
        every = self.settings.sample_every
        return every > 0 and (step % every == 0 or last)

    def due(self, step: int, last: bool) -> bool:
        return self._harness_due(step, last) or self._samples_due(step, last) or self._fidelity_due(step, last)

    def run(self, parts: list[torch.nn.Module], family, args, dataset, step: int, last: bool, dims=None,
            runner=None) -> tuple[dict[str, float], dict[str, tuple[np.ndarray, list[str]]]]:
        """(the harness's scores, the same dict on every rank; {key: (uint8 pictures [N, H, W, 3],
        their prompts)} on rank 0, {} elsewhere) of the current weights. ``sharded``: the harness
        runs on every rank through the layout's own forward (``runner.eval_logits``: FSDP, TP and
        pipeline stages as they train; ``dims``: the rank's data-parallel place), no copy."""
        sharded = {}
        if self.settings.sharded and self._harness_due(step, last):
            sharded = self._evaluate_sharded(runner, args, dataset.tokenizer, dims)
            if not (self._fidelity_due(step, last) or self._samples_due(step, last)):
                return sharded, {}
        state = gather_full_state(parts)  # collective inside each rank's sharding groups
        distributed = dist.is_initialized() and dist.get_world_size() > 1
        rank = dist.get_rank() if distributed else 0
        if distributed:
            pieces: list[Any] = [None] * dist.get_world_size() if rank == 0 else None
            dist.gather_object(state, pieces, dst=0)
            if rank == 0:
                state = {k: v for piece in pieces for k, v in piece.items()}
        scores: list[Any] = [{}]
        pictures: dict[str, tuple[np.ndarray, list[str]]] = {}
        if rank == 0:
            model = self._full_copy(state, family, args)
            scores[0] = dict(sharded)
            if self._harness_due(step, last) and not self.settings.sharded:
                scores[0] = self._evaluate(model, args, dataset.tokenizer)
            if self._fidelity_due(step, last):
                scores[0].update(self.fidelity(model, family, dataset))
            if self._samples_due(step, last):
                s = self.settings
                images = family.sample_images(model, dataset, list(s.sample_prompts), steps=s.sample_steps,
                                              guidance=s.sample_guidance, seed=s.sample_seed)
                pictures["samples"] = (np.asarray(images), list(s.sample_prompts))
        if distributed:
            dist.broadcast_object_list(scores, src=0)
        return scores[0], pictures

    def fidelity(self, model: torch.nn.Module, family, dataset) -> dict[str, float]:
        """{val/fidelity/<what>: fraction right} of one picture per held-out caption, drawn with
        the sample pictures' sampler (steps, guidance) and fixed noise (``sample_seed``)."""
        s = self.settings
        prompts = dataset.heldout_prompts(s.fidelity_prompts)
        images = family.sample_images(model, dataset, prompts, steps=s.sample_steps,
                                      guidance=s.sample_guidance, seed=s.sample_seed)
        return {f"val/fidelity/{k}": v for k, v in dataset.score_pictures(np.asarray(images), prompts).items()}

    @staticmethod
    def _full_copy(state: dict[str, torch.Tensor], family, args) -> torch.nn.Module:
        """An unsharded fp32 CPU model holding the gathered weights."""
        with torch.device("meta"):
            model = family.build(args)
        model.to_empty(device="cpu")
        with torch.random.fork_rng(devices=[]):  # buffers only matter; the run's random stream stays as it was
            model.init_weights(buffer_device="cpu")
        missing, _ = model.load_state_dict(state, strict=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        missing = [k for k in missing if not (k == "output.weight" and getattr(args, "tie_word_embeddings", False))]
        if missing:
            raise RuntimeError(f"evaluation copy of the model lacks {missing[:3]} after gathering every rank's weights")
        return model.float().eval()

    def _evaluate(self, model: torch.nn.Module, args, tokenizer) -> dict[str, float]:
        from titan_hydra.evaluation import TitanLM  # lm-eval (optional extra): see check

        return self._harness(TitanLM(model, tokenizer, self._window(args), self.settings.batch_size))

    def _evaluate_sharded(self, runner, args, tokenizer, dims) -> dict[str, float]:
        from titan_hydra.evaluation import ShardedLM  # lm-eval (optional extra): see check

        dp_rank, dp_degree = (dims.dp_rank(), dims.dp_degree) if dims is not None else (0, 1)
        return self._harness(ShardedLM(runner.eval_logits, tokenizer, self._window(args), self.settings.batch_size,
                                          dp_rank, dp_degree))

    def _window(self, args) -> int:
        return min(self.settings.max_seq_len or args.max_seq_len, args.max_seq_len)

    def _harness(self, lm) -> dict[str, float]:
        from titan_hydra.evaluation import run_harness  # lm-eval (optional extra): see check

        with torch.autocast("cpu", enabled=False):
            results = run_harness(lm, list(self.settings.tasks), self.settings.limit)
        return {f"eval/{task}/{metric}": float(value) for task, metrics in results.items()
                for metric, value in metrics.items() if metric != "sample_len"}
