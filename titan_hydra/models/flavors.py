"""Published Llama shapes, keyed by the names users type (``model=llama3_8b``).

Plain dicts of ``LlamaArgs`` fields so this module stays import-cycle free and Hydra
configs can mirror them one to one. Fields not given take ``LlamaArgs`` defaults
(vocab 128256, norm_eps 1e-5, rope_theta 500000, max_seq_len 8192, ...).

Deliberate difference from Meta's release: Llama 3.2 1B/3B tie the output projection to
the token embedding; here the output is untied for every flavor (simpler FSDP/PP/TP
sharding: the two matrices live on different pipeline stages). Their parameter counts
therefore include a separate ``vocab x dim`` output matrix (1.50B and 3.61B, not 1.24B
and 3.21B).
"""

from __future__ import annotations

_LLAMA3_VOCAB = 128256
_LLAMA2_VOCAB = 32000

FLAVORS: dict[str, dict] = {
    # Tiny shape for CPU runs and tests; keeps Llama 3's rope base.
    "llama3_debug": dict(
        dim=256, n_layers=6, n_heads=16, vocab_size=2048, multiple_of=256,
        rope_theta=500000.0, max_seq_len=2048,
    ),
    # Llama 3.2 1B (ffn hidden 8192); rope scaled by 32 as released.
    "llama3_1b": dict(
        dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.5, multiple_of=256, rope_theta=500000.0,
        rope_scaling=True, rope_scaling_factor=32.0,
    ),
    # Llama 3.2 3B (ffn hidden 8192).
    "llama3_3b": dict(
        dim=3072, n_layers=28, n_heads=24, n_kv_heads=8, vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.0, multiple_of=256, rope_theta=500000.0,
        rope_scaling=True, rope_scaling_factor=32.0,
    ),
    # Llama 3.1 8B (ffn hidden 14336).
    "llama3_8b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3, multiple_of=1024, rope_theta=500000.0,
        rope_scaling=True, rope_scaling_factor=8.0,
    ),
    # Llama 3.1 70B (ffn hidden 28672).
    "llama3_70b": dict(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=500000.0,
        rope_scaling=True, rope_scaling_factor=8.0,
    ),
    # Llama 3.1 405B (ffn hidden 53248).
    "llama3_405b": dict(
        dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=_LLAMA3_VOCAB,
        ffn_dim_multiplier=1.2, multiple_of=4096, rope_theta=500000.0,
        rope_scaling=True, rope_scaling_factor=8.0,
    ),
    # Llama 2 7B (MHA, ffn hidden 11008).
    "llama2_7b": dict(
        dim=4096, n_layers=32, n_heads=32, n_kv_heads=None, vocab_size=_LLAMA2_VOCAB,
        multiple_of=256, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096,
    ),
    # Llama 2 13B (MHA, ffn hidden 13824).
    "llama2_13b": dict(
        dim=5120, n_layers=40, n_heads=40, n_kv_heads=None, vocab_size=_LLAMA2_VOCAB,
        multiple_of=256, rope_theta=10000.0, norm_eps=1e-5, max_seq_len=4096,
    ),
    # Llama 2 70B (GQA 8 kv heads, ffn hidden 28672).
    "llama2_70b": dict(
        dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=_LLAMA2_VOCAB,
        ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=10000.0, norm_eps=1e-5,
        max_seq_len=4096,
    ),
}


def flavor_args(name: str, **overrides):
    """``LlamaArgs`` for a published flavor, with optional field overrides."""
    from titan_hydra.models.llama3 import LlamaArgs  # lazy: llama3 imports this module

    if name not in FLAVORS:
        raise KeyError(f"unknown Llama flavor {name!r}; known: {sorted(FLAVORS)}")
    return LlamaArgs(**{**FLAVORS[name], **overrides})
