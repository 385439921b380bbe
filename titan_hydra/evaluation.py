"""A titan_hydra model as an lm-eval harness ``LM`` (lm-eval 0.4.13), for ``recipes/eval.py``.

The harness asks three things of a model; each maps onto ``forward(tokens) -> logits``:

* ``loglikelihood(context, continuation)``: sum of log p(continuation tokens | context) and
  whether greedy decoding would produce them. Context is BOS + the context's tokens (documents
  were trained as BOS + text), truncated from the left to fit ``max_seq_len``; requests are
  batched right-padded (causal attention: padding after a row's end changes nothing before it).
* ``loglikelihood_rolling(text)``: the whole text's log-likelihood, scored in disjoint windows
  of ``max_seq_len`` tokens (the harness's own window helpers), BOS conditioning the first token.
* ``generate_until(context, until, max_gen_toks)``: greedy (or sampled, from ``gen_kwargs``)
  continuation through ``titan_hydra.generate``, cut at the first stop string.

Every request is scored in fp32 on one process (the harness shards requests itself when run
under ``accelerate``; not wired here).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from datasets.utils import logging as datasets_logging
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from titan_hydra.data import corpus
from titan_hydra.errors import ConfigError
from titan_hydra.generate import SamplingConfig, generate
from titan_hydra.quiet import loggers_at_error

LOCAL_TASKS = ("builtin_ppl", "builtin_ppl:<chars>", "jsonl_mc:<file.jsonl>")
BUILTIN_PPL, JSONL_MC = "builtin_ppl", "jsonl_mc:"
KNOWN = "use builtin_ppl, builtin_ppl:<chars>, jsonl_mc:<file>, or a name from `lm-eval ls tasks`"


class TitanLM(LM):
    def __init__(self, model: torch.nn.Module, tokenizer, max_seq_len: int, batch_size: int = 8,
                 device: str = "cpu"):
        super().__init__()
        self.model, self.tok = model.eval(), tokenizer
        self.max_seq_len, self.batch_size, self._device = int(max_seq_len), int(batch_size), device

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(context ids, continuation ids) -> (sum log p(continuation), continuation is greedy)."""
        out: list[tuple[float, bool]] = []
        for start in range(0, len(pairs), self.batch_size):
            chunk = pairs[start:start + self.batch_size]
            rows = []
            for ctx, cont in chunk:
                full = (ctx + cont)[-(self.max_seq_len + 1):]  # keep the continuation, cut the context's left
                rows.append(full)
            width = max(len(r) - 1 for r in rows)
            inputs = torch.zeros(len(rows), width, dtype=torch.long)
            for i, r in enumerate(rows):
                inputs[i, : len(r) - 1] = torch.tensor(r[:-1])
            logprobs = F.log_softmax(self.model(inputs.to(self._device)).float(), dim=-1).cpu()
            for i, ((_, cont), r) in enumerate(zip(chunk, rows)):
                n = len(cont)
                pos = torch.arange(len(r) - 1 - n, len(r) - 1)
                target = torch.tensor(cont)
                lp = logprobs[i, pos]
                out.append((float(lp.gather(1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all())))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        pairs = []
        for req in requests:
            context, continuation = req.args
            pairs.append(([self.tok.bos_id] + self.tok.encode(context), self.tok.encode(continuation)))
        return self._score(pairs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        results = []
        for req in requests:
            (text,) = req.args
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok.encode(text), prefix_token=self.tok.bos_id, max_seq_len=self.max_seq_len, context_len=1)]
            results.append(sum(lp for lp, _ in self._score(windows)))
        return results

    # ------------------------------------------------------------------ generation
    def generate_until(self, requests) -> list[str]:
        results = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs: dict[str, Any] = dict(gen_kwargs or {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            cfg = SamplingConfig(max_new_tokens=int(kwargs.get("max_gen_toks", 256)),
                                 temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0)
            ids = [self.tok.bos_id] + self.tok.encode(context)
            budget = self.max_seq_len - cfg.max_new_tokens
            ids = ids[-max(budget, 1):]
            out = generate(self.model, torch.tensor([ids], device=self._device), cfg, self.max_seq_len,
                           eos_id=self.tok.eos_id)
            new = out[0, len(ids):].tolist()
            if self.tok.eos_id in new:
                new = new[: new.index(self.tok.eos_id)]
            text = self.tok.decode(new)
            for stop in until:
                if stop and stop in text:
                    text = text[: text.index(stop)]
            results.append(text)
        return results


# ------------------------------------------------------------------------------ tasks

# Each metric names its aggregation (the harness's own defaults for them): unnamed, the harness
# prints a line per metric saying it picked the default.
PPL_METRICS = [{"metric": m, "aggregation": agg, "higher_is_better": False}
               for m, agg in (("word_perplexity", "weighted_perplexity"), ("byte_perplexity", "weighted_perplexity"),
                              ("bits_per_byte", "bits_per_byte"))]
FEWSHOT_SEED = 1234  # simple_evaluate's default
MC_METRICS = [{"metric": m, "aggregation": "mean", "higher_is_better": True} for m in ("acc", "acc_norm")]


def builtin_heldout_jsonl(out_dir: Path, chars: int | None = None) -> Path:
    """The built-in corpus's validation documents (those TokenDataset holds out) as JSON lines;
    ``chars``: each one's first ``chars`` characters, cut back to the last line end within them
    (every held-out file stays in, a fixed small share of each: the files range from 1 to 229 kB,
    so the first N files would be mostly the largest one)."""
    path = out_dir / f"builtin_val_{chars or 'all'}.jsonl"
    with open(path, "w") as f:
        for text in corpus.builtin_documents("val"):
            if chars is not None and len(text) > chars:
                head = text[:chars]
                text = head[: head.rindex("\n") + 1] if "\n" in head else head
            f.write(json.dumps({"text": text}) + "\n")
    return path


def builtin_chars(name: str) -> int | None:
    """N of ``builtin_ppl:N`` (characters of each held-out file), None for ``builtin_ppl``."""
    if name == BUILTIN_PPL:
        return None
    text = name[len(BUILTIN_PPL) + 1:]
    if not text.isdigit() or int(text) <= 0:
        raise ConfigError(f"task {name}: the characters of each held-out file to score must be a positive integer "
                          "(builtin_ppl:1024), or builtin_ppl for the whole files")
    return int(text)


def local_task_name(name: str) -> str:
    """The name the harness reports (and ``eval/<name>/...`` logs) a local task under."""
    if name.startswith(JSONL_MC):
        return f"jsonl_mc_{Path(name[len(JSONL_MC):]).stem}"
    chars = builtin_chars(name)
    return BUILTIN_PPL if chars is None else f"{BUILTIN_PPL}_{chars}"


def check_mc_file(name: str) -> Path:
    """The file of a ``jsonl_mc:<file>`` task, every line of it a question the task can score: one
    line (the file and the line number) for the first that is not."""
    path = Path(name[len(JSONL_MC):]).expanduser().resolve()
    if not path.is_file():
        raise ConfigError(f"task {name}: {path} does not exist; give a JSON-lines file of query/choices/gold lines")
    lines = [(n, line) for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if line.strip()]  # (blank lines: the harness's JSON reader skips them too)
    if not lines:
        raise ConfigError(f"task file {path} is empty; give one question a line: {MC_LINE}")
    for number, line in lines:
        problem = _mc_problem(line)
        if problem:
            raise ConfigError(f"task file {path} line {number} {problem}; each line is {MC_LINE}")
    return path


MC_LINE = '{"query": "...", "choices": ["...", "..."], "gold": <index of the right choice>}'


def _mc_problem(line: str) -> str | None:
    """What is wrong with one line of a multiple-choice file (None: nothing)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        return f"is not JSON ({e.msg} at column {e.colno})"
    if not isinstance(row, dict):
        return "is not a JSON object"
    missing = [k for k in ("query", "choices", "gold") if k not in row]
    if missing:
        return f"lacks {', '.join(missing)}"
    choices, gold = row["choices"], row["gold"]
    if not isinstance(row["query"], str):
        return "has a query that is not a string"
    if not (isinstance(choices, list) and len(choices) >= 2 and all(isinstance(c, str) for c in choices)):
        return "has choices that are not a list of two or more strings"
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        return f"has gold {gold!r}, not the index of one of its {len(choices)} choices"
    return None


def task_configs(names: list[str], work: Path) -> list[Any]:
    """Harness task names pass through; local task names become task config dicts."""
    tasks: list[Any] = []
    for name in names:
        if name == BUILTIN_PPL or name.startswith(BUILTIN_PPL + ":"):
            data = builtin_heldout_jsonl(work, builtin_chars(name))
            tasks.append({"task": local_task_name(name), "dataset_path": "json",
                          "dataset_kwargs": {"data_files": {"test": str(data)}},
                          "test_split": "test", "output_type": "loglikelihood_rolling", "doc_to_text": "",
                          "doc_to_target": "{{text}}", "metric_list": PPL_METRICS})
        elif name.startswith(JSONL_MC):
            path = check_mc_file(name)
            tasks.append({"task": local_task_name(name), "dataset_path": "json",
                          "dataset_kwargs": {"data_files": {"test": str(path)}}, "test_split": "test",
                          "output_type": "multiple_choice", "doc_to_text": "{{query}}", "doc_to_choice": "{{choices}}",
                          "doc_to_target": "{{gold}}", "metric_list": MC_METRICS})
        else:
            tasks.append(name)
    return tasks


def _is_local(task: str) -> bool:
    return task == BUILTIN_PPL or task.startswith((BUILTIN_PPL + ":", JSONL_MC))


def task_manager_for(tasks: list[str]):
    """The harness's TaskManager; without its registry (indexing it takes ~5 s) when every task is local."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_defaults=not all(_is_local(t) for t in tasks))


def check_tasks(tasks: list[str], manager=None) -> None:
    """One-line ConfigError for a task that is neither local nor in the harness's registry, a local
    task's bad size, or a local task file that does not parse (its file and line)."""
    if not tasks:
        raise ConfigError(f"no evaluation task given: {KNOWN}")
    local = [t for t in tasks if _is_local(t)]
    for task in local:
        if task.startswith(JSONL_MC):
            check_mc_file(task)
        else:
            builtin_chars(task)
    if len(local) == len(tasks):
        return
    if manager is None:
        manager = task_manager_for(tasks)
    unknown = [t for t in tasks if t not in local and t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"unknown task(s) {unknown}: {KNOWN}")


def run_harness(lm: LM, tasks: list[str], limit: int | None = None, manager=None) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of lm-eval's ``evaluate`` on ``lm``, with the task setup its
    ``simple_evaluate`` does (zero-shot unless a task says otherwise, a seeded few-shot sampler)
    and without what that adds for a results file: its environment report runs ``git describe``,
    whose "fatal: not a git repository" reached the console outside a clone. Quiet meanwhile: the
    harness's info log and HF datasets' bar while it builds a local task's split."""
    from lm_eval import evaluator

    if manager is None:
        manager = task_manager_for(tasks)
    bars = datasets_logging.is_progress_bar_enabled()
    datasets_logging.disable_progress_bar()
    try:
        with tempfile.TemporaryDirectory() as work, loggers_at_error("lm_eval"):
            loaded = manager.load(task_configs(tasks, Path(work)))
            for task in loaded["tasks"].values():
                if task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=FEWSHOT_SEED)
            results = evaluator.evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)
    finally:
        if bars:
            datasets_logging.enable_progress_bar()
    return {task: with_ppl({k.split(",")[0]: v for k, v in metrics.items()
                            if isinstance(v, (int, float)) and k != "alias"})
            for task, metrics in results["results"].items()}


def with_ppl(metrics: dict[str, float]) -> dict[str, float]:
    """A task's metrics with ``ppl`` beside the harness's own names, so every task's perplexity is
    read under one name (``eval/<task>/ppl``; accuracy is the harness's ``acc`` already): the
    harness's ``perplexity`` where the task reports one (lambada), else its byte perplexity (rolling
    tasks: builtin_ppl, wikitext), which needs no tokenizer to compare runs by."""
    for name in ("perplexity", "byte_perplexity"):
        if name in metrics:
            return {**metrics, "ppl": metrics[name]}
    return metrics


# ------------------------------------------------------------------------------ sharded scoring


class ShardedLM(TitanLM):
    """The harness's requests scored across the data-parallel ranks by the training model itself:
    every rank runs the same harness over the same requests, scores its slice of them (request i
    goes to data-parallel rank i % dp) through ``forward`` (the layout's own, FSDP / TP sharded:
    no full copy anywhere), then the slices are all-gathered, so every rank's harness aggregates
    the full list and reports the same numbers as the one-copy path, in about 1/dp of its time.
    Each rank runs as many batches as the rank with the most requests (padded with a one-token
    request): a sharded forward is a collective. ``forward(ids) -> logits`` (full, on every rank)."""

    def __init__(self, forward, tokenizer, max_seq_len: int, batch_size: int, dp_rank: int, dp_degree: int):
        super().__init__(_Forward(forward), tokenizer, max_seq_len, batch_size)
        self.dp_rank, self.dp_degree = int(dp_rank), int(dp_degree)

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        import torch.distributed as dist

        per_rank = -(-len(pairs) // self.dp_degree)
        batches = -(-per_rank // self.batch_size)
        mine = pairs[self.dp_rank::self.dp_degree]
        pad = ([self.tok.bos_id], [self.tok.bos_id])
        scored = super()._score(mine + [pad] * (batches * self.batch_size - len(mine)))[:len(mine)]
        if not (dist.is_initialized() and dist.get_world_size() > 1):
            return scored
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, (self.dp_rank, scored))  # tp / pp peers of a dp rank send the same slice
        slices = dict(every)
        out: list[tuple[float, bool]] = [None] * len(pairs)  # type: ignore[list-item]
        for r, part in slices.items():
            out[r::self.dp_degree] = part
        return out

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Every request's windows scored in one sharded pass (a pass per request would make every
        rank wait for every document), then summed per request."""
        windows, owner = [], []
        for i, req in enumerate(requests):
            (text,) = req.args
            for w in get_rolling_token_windows(self.tok.encode(text), prefix_token=self.tok.bos_id,
                                               max_seq_len=self.max_seq_len, context_len=1):
                windows.append(make_disjoint_window(w))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (lp, _) in zip(owner, self._score(windows)):
            totals[i] += lp
        return totals

    def generate_until(self, requests) -> list[str]:
        raise ConfigError("eval.sharded=true scores log-likelihoods only (builtin_ppl, jsonl_mc, multiple-choice "
                          "tasks); a generation task needs eval.sharded=false")


class _Forward(torch.nn.Module):
    """``forward`` as the module TitanLM calls (``eval()`` is a no-op: the training model keeps its mode)."""

    def __init__(self, forward):
        super().__init__()
        self._forward = forward

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self._forward(ids)
