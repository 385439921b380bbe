"""Evaluate a checkpoint with the lm-eval harness (lm-eval 0.4.13), offline, one process.

    python recipes/eval.py <checkpoint step dir | HF dir> [--tasks builtin_ppl[,hellaswag,...] | --suite fast] \\
        [--limit N] [--batch-size 8] [--tokenizer builtin|<dir>] [--max-seq-len 256] [--out results.json]

With no ``--tasks`` it scores the built-in held-out corpus (``builtin_ppl``): the perplexity of
the validation split the trainer reports ``val/loss`` on. Tasks are the harness's registry names (they download their data: the machine needs network
access or a filled HF datasets cache) or local tasks that need no download:

* ``builtin_ppl``: rolling log-likelihood over the built-in corpus's held-out files (the
  validation split the trainer reports ``val/loss`` on), with the harness's word perplexity,
  byte perplexity and bits per byte (and ``ppl``: the byte perplexity, every task's one name);
  ``builtin_ppl:N`` scores each file's first N characters (reported as ``builtin_ppl_N``);
* ``jsonl_mc:<file.jsonl>``: multiple choice from local lines ``{"query", "choices", "gold"}``
  (accuracy and length-normalized accuracy); ``recipes/eval_tasks/tiny_mc.jsonl`` is an example.

``--suite fast|full`` scores a named task set of ``conf/eval_suites.yaml``: the tasks
``eval.suite`` runs during training. Prints one line per task and metric, writes the full
results as JSON (``--out``). Errors (an unknown task or suite, a checkpoint that does not exist,
a JSONL file that is missing or does not parse: its line) are one line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from titan_hydra.quiet import without_progress_bars

without_progress_bars()  # before anything imports tqdm: lm-eval's and datasets' bars say nothing to act on

from titan_hydra.analysis.flags import add_out, parser  # noqa: E402
from titan_hydra.checkpoint.offline import load_model, tokenizer_for  # noqa: E402
from titan_hydra.config.eval_suites import suite_tasks  # noqa: E402
from titan_hydra.errors import ConfigError, exit_status  # noqa: E402
from titan_hydra.evaluation import TitanLM, check_tasks, run_harness, task_manager_for  # noqa: E402


def evaluate(checkpoint: str | Path, tasks: list[str], limit: int | None = None, batch_size: int = 8,
             tokenizer: str | None = None, device: str = "cpu", max_seq_len: int | None = None
             ) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of the harness on a checkpoint; ``max_seq_len`` (default: the
    model's) is the scoring window, e.g. the training sequence length."""
    _, args, model = load_model(checkpoint, device)
    tok = tokenizer_for(checkpoint, tokenizer)
    manager = task_manager_for(tasks)
    check_tasks(tasks, manager)
    lm = TitanLM(model, tok, min(max_seq_len or args.max_seq_len, args.max_seq_len), batch_size, device)
    return run_harness(lm, tasks, limit, manager)


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--tasks", default=None,
                   help="comma-separated (default builtin_ppl: perplexity of the built-in held-out corpus)")
    p.add_argument("--suite", default=None, help="a named task set of conf/eval_suites.yaml (fast, full)")
    p.add_argument("--limit", type=int, default=None, help="documents per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=None, help="scoring window (default: the model's)")
    add_out(p, "write the full results here as JSON")
    a = p.parse_args(argv)

    def score() -> str:
        if not Path(a.checkpoint).exists():
            raise ConfigError(f"checkpoint {a.checkpoint} does not exist")
        if a.suite and a.tasks:
            raise ConfigError(f"--suite {a.suite} and --tasks {a.tasks} both name the tasks; give one of them")
        tasks = list(suite_tasks(a.suite)) if a.suite else [t for t in (a.tasks or "builtin_ppl").split(",") if t]
        scores = evaluate(a.checkpoint, tasks, a.limit, a.batch_size, a.tokenizer, a.device, a.max_seq_len)
        if a.out:
            Path(a.out).write_text(json.dumps(scores, indent=2))
        return "\n".join(f"{task:24s} {metric:18s} {value:.4f}" for task, metrics in scores.items()
                         for metric, value in metrics.items())

    return exit_status(score)


if __name__ == "__main__":
    sys.exit(main())
