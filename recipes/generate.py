"""Sample text from a checkpoint (offline, one process, CPU or one GPU).

    python recipes/generate.py outputs/<run>/checkpoint/step-1000 --prompt "def main(" \\
        [--max-new-tokens 64] [--temperature 0.8] [--top-k 50] [--top-p 0.95] [--seed 0] \\
        [--tokenizer builtin|<dir or tokenizer.json>] [--num-samples 1] [--device cpu]

The checkpoint is a step directory this project wrote (any layout, any family) or a Hugging Face
directory (``config.json`` + safetensors, a family's ``model_type``). The prompt is encoded as
training saw documents: BOS first, no EOS; generation stops at EOS. ``--temperature 0`` (the
default) is greedy. ``--tokenizer`` defaults to the HF directory's own tokenizer when it has one,
else the built-in one. Errors (no such checkpoint, a prompt longer than the model's context, a
tokenizer whose ids exceed the model's vocabulary) are one line.
"""

from __future__ import annotations

import sys

import torch

from titan_hydra.analysis.flags import parser
from titan_hydra.checkpoint.offline import load_model, tokenizer_for
from titan_hydra.errors import UserError, exit_status
from titan_hydra.generate import SamplingConfig, generate


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("checkpoint")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--device", default="cpu")
    a = p.parse_args(argv)

    def sample() -> str:
        cfg = SamplingConfig(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed)
        _, args, model = load_model(a.checkpoint, a.device)
        tok = tokenizer_for(a.checkpoint, a.tokenizer)
        if tok.vocab_size > args.vocab_size:
            raise UserError(f"tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocabulary is "
                            f"{args.vocab_size}; pass the tokenizer it was trained with (--tokenizer)")
        ids = [tok.bos_id] + tok.encode(a.prompt)
        out = generate(model, torch.tensor([ids] * a.num_samples, device=a.device), cfg, args.max_seq_len,
                       eos_id=tok.eos_id)
        lines = []
        for i, row in enumerate(out.tolist()):
            new = row[len(ids):]
            if tok.eos_id in new:
                new = new[: new.index(tok.eos_id)]
            lines += [f"--- sample {i}"] * (a.num_samples > 1) + [a.prompt + tok.decode(new)]
        return "\n".join(lines)

    return exit_status(sample)


if __name__ == "__main__":
    sys.exit(main())
