"""Sampling from a trained model: greedy, temperature, top-k and top-p (nucleus), seeded.

Works with any model family's ``forward(tokens) -> logits`` (the model protocol). A model that
sets ``supports_kv_cache`` (every ``Decoder``: GQA, MLA, sinks, windows, chunks, NoPE) runs the
prompt once and then one token per step against its key/value cache
(``models/common/kv_cache.py``); any other model re-runs the whole sequence for each new token.

Order of the logit filters, as in transformers' ``generate``: temperature, then top-k, then
top-p; ``temperature=0`` is greedy (argmax, the filters do not matter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_hydra.errors import ConfigError
from titan_hydra.models.common.kv_cache import KVCache


@dataclass
class SamplingConfig:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens} must be >= 1")
        if self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"top_k={self.top_k} must be >= 1 (or unset)")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (or unset)")


def filter_logits(logits: torch.Tensor, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """Logits [B, V] with everything outside the top-k / the top-p probability mass set to -inf
    (the most likely token always stays)."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        mass_before = sorted_logits.softmax(dim=-1).cumsum(dim=-1) - sorted_logits.softmax(dim=-1)
        drop_sorted = mass_before >= top_p  # a token is kept while the mass before it is < top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def next_token(logits: torch.Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> torch.Tensor:
    """[B, V] last-position logits -> [B] token ids."""
    if cfg.temperature == 0:
        return logits.argmax(dim=-1)
    probs = filter_logits(logits.float() / cfg.temperature, cfg.top_k, cfg.top_p).softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(model: torch.nn.Module, prompt: torch.Tensor, cfg: SamplingConfig, max_seq_len: int,
             eos_id: int | None = None, use_cache: bool = True) -> torch.Tensor:
    """prompt [B, S] int64 -> [B, S + n] (n <= max_new_tokens; stops early once every row has
    produced ``eos_id`` when ``cfg.stop_at_eos``). Refuses a prompt that leaves no room.
    ``use_cache=False`` re-runs the full sequence per token even where a KV cache exists."""
    if prompt.dim() != 2 or prompt.shape[1] < 1:
        raise ConfigError(f"the prompt must be a non-empty [batch, tokens] tensor, got shape {tuple(prompt.shape)}")
    if prompt.shape[1] >= max_seq_len:
        raise ConfigError(f"the prompt has {prompt.shape[1]} tokens, not fewer than the model's max_seq_len="
                          f"{max_seq_len}; shorten it")
    generator = torch.Generator(device=prompt.device).manual_seed(cfg.seed)
    tokens = prompt
    done = torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    steps = min(cfg.max_new_tokens, max_seq_len - prompt.shape[1])
    cache = KVCache() if use_cache and getattr(model, "supports_kv_cache", False) else None
    for _ in range(steps):
        if cache is None:
            logits = model(tokens)[:, -1, :]
        else:  # the prompt once, then only the newest token
            logits = model(tokens[:, cache.length:], cache=cache)[:, -1, :]
        new = next_token(logits, cfg, generator)
        if eos_id is not None:
            new = torch.where(done, torch.full_like(new, eos_id), new)  # finished rows pad with EOS
        tokens = torch.cat([tokens, new[:, None]], dim=1)
        if eos_id is not None and cfg.stop_at_eos:
            done |= new == eos_id
            if bool(done.all()):
                break
    return tokens
