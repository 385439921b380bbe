"""A thin wrapper over an HF ``tokenizers.Tokenizer`` with explicit BOS/EOS ids.

Why a wrapper: the packer needs ``bos_id``/``eos_id`` and a batch encoder that adds
no special tokens (documents are framed by the packer, not by the tokenizer's
post-processor), and the model needs ``vocab_size`` including added tokens. Those
come from different places in different tokenizer files; this class normalises them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from titan_hydra.errors import DataError

BUILTIN_PATH = Path(__file__).resolve().parent.parent / "assets" / "builtin_tokenizer.json"
DEFAULT_BOS = "<|begin_of_text|>"
DEFAULT_EOS = "<|end_of_text|>"
PAD = "<|pad|>"


def _token_content(value) -> str | None:
    """tokenizer_config.json stores special tokens as a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def resolve_tokenizer_file(path: str) -> Path:
    """Map ``"builtin"``, a ``tokenizer.json`` file or a directory to the JSON file."""
    p = BUILTIN_PATH if path == "builtin" else Path(path).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        hint = (
            "run `python recipes/train_tokenizer.py` to regenerate the built-in tokenizer"
            if path == "builtin"
            else "set data.tokenizer=builtin or to a tokenizer.json file / a directory holding one"
        )
        raise DataError(f"tokenizer not found: {p} ({hint})")
    return p


class Tokenizer:
    """Tokenizer loaded from ``"builtin"``, a ``tokenizer.json`` file or a directory.

    In a directory, an optional ``tokenizer_config.json`` names the BOS/EOS tokens;
    otherwise the Llama-3 style names ``<|begin_of_text|>``/``<|end_of_text|>`` are used.
    """

    def __init__(self, path: str = "builtin"):
        self.path = resolve_tokenizer_file(path)
        try:
            self._tok = _HFTokenizer.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(
                f"invalid tokenizer file {self.path}: {msg} (point data.tokenizer at a valid HF tokenizer.json)"
            ) from None
        bos_name, eos_name = DEFAULT_BOS, DEFAULT_EOS
        cfg_file = self.path.parent / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise DataError(f"invalid tokenizer config {cfg_file}: {e} (fix or remove the file)") from None
            bos_name = _token_content(cfg.get("bos_token")) or bos_name
            eos_name = _token_content(cfg.get("eos_token")) or eos_name
        self.bos_token, self.eos_token = bos_name, eos_name
        self.bos_id = self._special_id(bos_name, "BOS")
        self.eos_id = self._special_id(eos_name, "EOS")

    def _special_id(self, name: str, role: str) -> int:
        tid = self._tok.token_to_id(name)
        if tid is None:
            raise DataError(
                f"tokenizer {self.path} has no {role} token {name!r} "
                "(add it to the vocabulary or name it in tokenizer_config.json)"
            )
        return tid

    @property
    def vocab_size(self) -> int:
        """Size of the id space including added tokens (what the embedding must cover)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def content_hash(self) -> str:
        """Hash of the tokenizer file and its config: part of every token-cache key."""
        h = hashlib.sha256(self.path.read_bytes())
        h.update(f"|{self.bos_id}|{self.eos_id}".encode())
        return h.hexdigest()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, vocab_size={self.vocab_size}, bos={self.bos_id}, eos={self.eos_id})"
