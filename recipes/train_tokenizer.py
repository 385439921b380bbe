"""Train the shipped byte-level BPE tokenizer on the built-in corpus's train split.

    python recipes/train_tokenizer.py [--vocab-size 2048] [--out titan_hydra/assets/builtin_tokenizer.json]

Byte-level BPE so that any input text is encodable (no unknown tokens). Only the train
split is used, so validation text is genuinely unseen. Deterministic for a given
Python standard library and ``tokenizers`` version.
"""

from __future__ import annotations

import time
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from titan_hydra.analysis.flags import add_out, parser
from titan_hydra.data.corpus import builtin_documents

REPO = Path(__file__).resolve().parent.parent

SPECIAL_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]


def train(vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(builtin_documents("train"), trainer=trainer)
    return tok


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=2048)
    add_out(ap, "the tokenizer file", default=str(REPO / "titan_hydra" / "assets" / "builtin_tokenizer.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    tok = train(args.vocab_size)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out))
    print(f"wrote {out}: vocab {tok.get_vocab_size()} in {time.perf_counter() - t0:.1f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
