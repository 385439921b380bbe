"""Evaluate a checkpoint with the lm-eval harness (lm-eval 0.4.13), offline, one process.

    python recipes/eval.py <checkpoint step dir | HF dir> [--tasks builtin_ppl[,hellaswag,...]] \\
        [--limit N] [--batch-size 8] [--tokenizer builtin|<dir>] [--max-seq-len 256] [--out results.json]

With no ``--tasks`` it scores the built-in held-out corpus (``builtin_ppl``): the perplexity of
the validation split the trainer reports ``val/loss`` on. Tasks are the harness's registry names (they download their data: the machine needs network
access or a filled HF datasets cache) or local tasks that need no download:

* ``builtin_ppl``: rolling log-likelihood over the built-in corpus's held-out files (the
  validation split the trainer reports ``val/loss`` on), with the harness's word perplexity,
  byte perplexity and bits per byte;
* ``jsonl_mc:<file.jsonl>``: multiple choice from local lines ``{"query", "choices", "gold"}``
  (accuracy and length-normalized accuracy); ``recipes/eval_tasks/tiny_mc.jsonl`` is an example.

Prints one line per task and metric, writes the full results as JSON (``--out``). Errors (an
unknown task, a checkpoint that does not exist, a missing JSONL) are one line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from titan_hydra.quiet import without_progress_bars  # noqa: E402

without_progress_bars()  # before anything imports tqdm: lm-eval's and datasets' bars say nothing to act on

from titan_hydra.errors import ConfigError, UserError, first_line  # noqa: E402

def evaluate(checkpoint: str | Path, tasks: list[str], limit: int | None = None, batch_size: int = 8,
             tokenizer: str | None = None, device: str = "cpu", max_seq_len: int | None = None
             ) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} of the harness on a checkpoint; ``max_seq_len`` (default: the
    model's) is the scoring window, e.g. the training sequence length."""
    from generate import load_model
    from titan_hydra.data.tokenizer import Tokenizer
    from titan_hydra.evaluation import TitanLM, check_tasks, run_harness, task_manager_for
    from titan_hydra.models.hf_io import is_hf_dir

    _, args, model = load_model(checkpoint, device)
    own = Path(checkpoint) / "tokenizer.json"
    tok = Tokenizer(tokenizer or (str(checkpoint) if is_hf_dir(checkpoint) and own.is_file() else "builtin"))
    manager = task_manager_for(tasks)
    check_tasks(tasks, manager)
    lm = TitanLM(model, tok, min(max_seq_len or args.max_seq_len, args.max_seq_len), batch_size, device)
    return run_harness(lm, tasks, limit, manager)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--tasks", default="builtin_ppl",
                   help="comma-separated (default builtin_ppl: perplexity of the built-in held-out corpus)")
    p.add_argument("--limit", type=int, default=None, help="documents per task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-seq-len", type=int, default=None, help="scoring window (default: the model's)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    try:
        if not Path(a.checkpoint).exists():
            raise ConfigError(f"checkpoint {a.checkpoint} does not exist")
        scores = evaluate(a.checkpoint, [t for t in a.tasks.split(",") if t], a.limit, a.batch_size, a.tokenizer,
                          a.device, a.max_seq_len)
    except UserError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 1
    for task, metrics in scores.items():
        for metric, value in metrics.items():
            print(f"{task:24s} {metric:18s} {value:.4f}")
    if a.out:
        Path(a.out).write_text(json.dumps(scores, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
