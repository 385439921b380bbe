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

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_hydra.errors import UserError, first_line  # noqa: E402
from titan_hydra.generate import SamplingConfig, generate  # noqa: E402


def load_model(path: str | Path, device: str = "cpu", weights: str = "model"):
    """(family, args, model in eval mode with the checkpoint's weights) of a step dir or HF dir;
    ``weights="ema"``: a step dir's EMA of the weights (``training.ema_decay``)."""
    from titan_hydra.checkpoint.storage import CheckpointError
    from titan_hydra.models.hf_io import is_hf_dir, load_hf_checkpoint

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if is_hf_dir(path):
        family, args, sd = load_hf_checkpoint(path)
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from convert import read_model

        family, args, sd = read_model(path, weights)
    with torch.device("meta"):
        model = family.build(args)
    model.to_empty(device=device)
    model.init_weights(buffer_device=device)  # non-persistent buffers (rotary tables)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if k != "output.weight" or not args.tie_word_embeddings]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit its own model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    return family, args, model.eval()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    try:
        from titan_hydra.data.tokenizer import Tokenizer
        from titan_hydra.models.hf_io import is_hf_dir

        cfg = SamplingConfig(a.max_new_tokens, a.temperature, a.top_k, a.top_p, a.seed)
        _, args, model = load_model(a.checkpoint, a.device)
        own = Path(a.checkpoint) / "tokenizer.json"
        tok = Tokenizer(a.tokenizer or (str(a.checkpoint) if is_hf_dir(a.checkpoint) and own.is_file() else "builtin"))
        if tok.vocab_size > args.vocab_size:
            raise UserError(f"tokenizer {tok.path} has {tok.vocab_size} ids but the model's vocabulary is "
                            f"{args.vocab_size}; pass the tokenizer it was trained with (--tokenizer)")
        ids = [tok.bos_id] + tok.encode(a.prompt)
        prompt = torch.tensor([ids] * a.num_samples, device=a.device)
        out = generate(model, prompt, cfg, args.max_seq_len, eos_id=tok.eos_id)
    except UserError as e:
        print(f"error: {first_line(e)}", file=sys.stderr)
        return 1
    for i, row in enumerate(out.tolist()):
        new = row[len(ids):]
        if tok.eos_id in new:
            new = new[: new.index(tok.eos_id)]
        if a.num_samples > 1:
            print(f"--- sample {i}")
        print(a.prompt + tok.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
