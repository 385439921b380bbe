"""Evaluation during training: the ``eval`` config group's object.

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
scores, which every rank logs as ``eval/<task>/<metric>``. The training model is not touched (no
mode switch, no cache, its own random generator for the pictures' noise), so the run continues
exactly as without evaluation. The cost is one full copy of the weights on rank 0's host memory
for the duration: right for the model sizes this evaluates quickly; a sharded harness run is
future work.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from titan_hydra.errors import ConfigError
from titan_hydra.models.protocol import DrawsSamples
from titan_hydra.parallel.full_state import gather_full_state


class PeriodicEval:
    """lm-eval harness tasks run on a full copy of the model every ``freq`` steps (0 = never);
    sample pictures drawn by it every ``sample_every`` steps (families that draw them: Flux).
    The ``eval`` group's target: its keyword defaults are the group's schema."""

    def __init__(self, freq: int = 0,
                 tasks: Sequence[str] = (),  # builtin_ppl, jsonl_mc:<file>, harness names
                 limit: int | None = None,  # documents per task
                 batch_size: int = 8,
                 max_seq_len: int | None = None,  # scoring window (the schema links it to training.seq_len)
                 sample_every: int = 0,  # steps between sample pictures (and at the end); 0 = none
                 sample_prompts: Sequence[str] = (),  # one picture each, in one row
                 sample_steps: int = 20,  # sampler steps per picture
                 sample_guidance: float = 3.0,  # guidance scale (classifier-free, or flux_dev's embedded one)
                 sample_seed: int = 0,  # the pictures' noise: the same at every step, so rows compare
                 fidelity_every: int = 0,  # steps between fidelity scores (and at the end); 0 = none
                 fidelity_prompts: int = 64,  # held-out captions scored, one picture each
                 sharded: bool = False):  # harness requests scored across the dp ranks by the training model
        if freq < 0:
            raise ConfigError(f"eval.freq={freq} must be >= 0 (0 = no evaluation during training)")
        if sample_every < 0:
            raise ConfigError(f"eval.sample_every={sample_every} must be >= 0 (0 = no sample pictures)")
        if fidelity_every < 0:
            raise ConfigError(f"eval.fidelity_every={fidelity_every} must be >= 0 (0 = no fidelity scores)")
        if fidelity_prompts <= 0:
            raise ConfigError(f"eval.fidelity_prompts={fidelity_prompts} must be > 0 (held-out captions scored "
                              "each time)")
        if sample_steps <= 0:
            raise ConfigError(f"eval.sample_steps={sample_steps} must be positive (sampler steps per picture)")
        self.freq, self.tasks, self.limit = int(freq), [str(t) for t in tasks], limit
        self.batch_size, self.max_seq_len = int(batch_size), max_seq_len
        self.sample_every, self.sample_prompts = int(sample_every), [str(p) for p in sample_prompts]
        self.sample_steps, self.sample_guidance, self.sample_seed = int(sample_steps), float(sample_guidance), int(sample_seed)
        self.fidelity_every, self.fidelity_prompts = int(fidelity_every), int(fidelity_prompts)
        self.sharded = bool(sharded)

    @property
    def enabled(self) -> bool:
        return self.freq > 0 or self.sample_every > 0 or self.fidelity_every > 0

    def check(self, family) -> None:
        """Before training (one line each): lm-eval importable and every task known; a family
        that draws pictures, and prompts to draw, for sample pictures."""
        if self.enabled and not family.builds_models():
            raise ConfigError(f"eval: model family {family.name!r} has no build(args) to make the evaluation copy "
                              "from; define ModelFamily.build in it, or set eval.freq=0 eval.sample_every=0")
        if self.fidelity_every > 0 and not isinstance(family, DrawsSamples):
            raise ConfigError(f"eval.fidelity_every={self.fidelity_every}: model family {family.name!r} draws no "
                              "pictures to score; set eval.fidelity_every=0")
        if self.sample_every > 0:
            if not isinstance(family, DrawsSamples):
                raise ConfigError(f"eval.sample_every={self.sample_every}: model family {family.name!r} draws no "
                                  "sample pictures; set eval.sample_every=0")
            if not self.sample_prompts:
                raise ConfigError(f"eval.sample_every={self.sample_every} needs prompts: set "
                                  "eval.sample_prompts=['a red circle', ...]")
        if self.freq <= 0:
            return
        if family.objective.unit != "token":
            raise ConfigError(f"eval.freq={self.freq}: the lm-eval harness scores language models, not model family "
                              f"{family.name!r}; set eval.freq=0")
        try:
            import lm_eval  # noqa: F401
        except ImportError:
            raise ConfigError(f"eval.freq={self.freq} needs the lm-eval harness: pip install -e '.[eval]' "
                              "(or set eval=none)") from None
        from titan_hydra.evaluation import check_tasks  # lm-eval: the optional eval extra, loaded only when asked for
        check_tasks(self.tasks)

    def check_layout(self, dims) -> None:
        """``sharded`` scores through the training model's own forward: not a pipeline's stages (one line)."""
        if self.sharded and self.freq > 0 and dims.pp > 1:
            raise ConfigError(f"eval.sharded=true scores through the model's forward, which a pipeline (parallelism.pp="
                              f"{dims.pp}) splits into stages; set eval.sharded=false (one full copy on rank 0)")

    def check_data(self, dataset) -> None:
        """Fidelity needs held-out captions and a reader of pictures from the data (one line if not)."""
        if self.fidelity_every > 0:
            if not hasattr(dataset, "heldout_prompts"):
                raise ConfigError(f"eval.fidelity_every={self.fidelity_every}: this data holds no captions out to "
                                  "score pictures against; set eval.fidelity_every=0")
            dataset.heldout_prompts(self.fidelity_prompts)

    def _fidelity_due(self, step: int, last: bool) -> bool:
        return self.fidelity_every > 0 and (step % self.fidelity_every == 0 or last)

    def _harness_due(self, step: int, last: bool) -> bool:
        return self.freq > 0 and (step % self.freq == 0 or last)

    def _samples_due(self, step: int, last: bool) -> bool:
        return self.sample_every > 0 and (step % self.sample_every == 0 or last)

    def due(self, step: int, last: bool) -> bool:
        return self._harness_due(step, last) or self._samples_due(step, last) or self._fidelity_due(step, last)

    def run(self, parts: list[torch.nn.Module], family, args, dataset, step: int, last: bool, dims=None
            ) -> tuple[dict[str, float], dict[str, tuple[np.ndarray, list[str]]]]:
        """(the harness's scores, the same dict on every rank; {key: (uint8 pictures [N, H, W, 3],
        their prompts)} on rank 0, {} elsewhere) of the current weights. ``sharded``: the harness
        runs on every rank over the training model (``dims``: its data-parallel place), no copy."""
        sharded = {}
        if self.sharded and self._harness_due(step, last):
            sharded = self._evaluate_sharded(parts, args, dataset.tokenizer, dims)
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
            if self._harness_due(step, last) and not self.sharded:
                scores[0] = self._evaluate(model, args, dataset.tokenizer)
            if self._fidelity_due(step, last):
                scores[0].update(self.fidelity(model, family, dataset))
            if self._samples_due(step, last):
                images = family.sample_images(model, dataset, self.sample_prompts, steps=self.sample_steps,
                                              guidance=self.sample_guidance, seed=self.sample_seed)
                pictures["samples"] = (np.asarray(images), list(self.sample_prompts))
        if distributed:
            dist.broadcast_object_list(scores, src=0)
        return scores[0], pictures

    def fidelity(self, model: torch.nn.Module, family, dataset) -> dict[str, float]:
        """{val/fidelity/<what>: fraction right} of one picture per held-out caption, drawn with
        the sample pictures' sampler (steps, guidance) and fixed noise (``sample_seed``)."""
        prompts = dataset.heldout_prompts(self.fidelity_prompts)
        images = family.sample_images(model, dataset, prompts, steps=self.sample_steps,
                                      guidance=self.sample_guidance, seed=self.sample_seed)
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

        return self._harness(TitanLM(model, tokenizer, self._window(args), self.batch_size))

    def _evaluate_sharded(self, parts: list[torch.nn.Module], args, tokenizer, dims) -> dict[str, float]:
        from titan_hydra.evaluation import ShardedLM  # lm-eval (optional extra): see check

        model = parts[0]
        device = next(model.parameters()).device

        @torch.no_grad()
        def forward(ids: torch.Tensor) -> torch.Tensor:
            logits = model(ids.to(device))
            return logits.full_tensor() if isinstance(logits, DTensor) else logits  # tp: vocab-sharded logits

        dp_rank, dp_degree = (dims.dp_rank(), dims.dp_degree) if dims is not None else (0, 1)
        return self._harness(ShardedLM(forward, tokenizer, self._window(args), self.batch_size, dp_rank, dp_degree))

    def _window(self, args) -> int:
        return min(self.max_seq_len or args.max_seq_len, args.max_seq_len)

    def _harness(self, lm) -> dict[str, float]:
        from titan_hydra.evaluation import run_harness  # lm-eval (optional extra): see check

        with torch.autocast("cpu", enabled=False):
            results = run_harness(lm, self.tasks, self.limit)
        return {f"eval/{task}/{metric}": float(value) for task, metrics in results.items()
                for metric, value in metrics.items() if metric != "sample_len"}
