"""The decoder shell every dense and MoE language-model family here is built from.

``tok_embeddings -> layers (ModuleDict) -> norm -> output``, pre-norm blocks, rotary tables as
non-persistent buffers. A family subclasses ``Decoder`` and supplies its blocks and its rotary
frequencies; the layout code (``decoder_family.py``) addresses the module names used here.

Two small concessions make the layouts possible without the model knowing about them:

* ``tok_embeddings`` / ``norm`` / ``output`` may be ``None`` and entries of ``layers`` may be
  deleted: that is how pipeline stages are cut. forward then passes hidden states through
  instead of tokens/logits.
* ``layers`` is a ModuleDict keyed by the layer index, so a stage keeps its blocks' FQNs.

Tied input/output embeddings (Qwen3 small models, Llama 3.2) share one Parameter. Building on
the meta device and ``to_empty`` create a fresh tensor per module, so ``tie_weights`` re-points
the embedding at the output weight after every such step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from titan_hydra.models.common.layers import RMSNorm, trunc_normal_
from titan_hydra.models.common.masking import positions_in_documents
from titan_hydra.models.common.rotary import tables_from_frequencies


@dataclass(kw_only=True)
class Multipliers:
    """Forward multipliers a width / depth parametrization sets (``models/parametrization.py``):
    every family's args inherit them. 1.0 is the standard parametrization, which multiplies
    nothing, so its models compute exactly what they did before these fields existed."""

    logit_mult: float = 1.0  # logits = logit_mult * output(norm(h)) (muP: base_width / dim)
    attn_mult: float = 1.0  # attention scores = attn_mult * q.k / sqrt(head_dim) (muP: ~1/head_dim)
    residual_mult: float = 1.0  # each branch adds residual_mult * f(norm(x)) (CompleteP: base_depth / n_layers)


MULTIPLIERS = ("logit_mult", "attn_mult", "residual_mult")


class TransformerBlock(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + ffn(norm(h)), each branch times
    ``residual_mult`` when that is not 1."""

    def __init__(self, layer_id: int, attention: nn.Module, feed_forward: nn.Module, dim: int,
                 norm_eps: float, out_std: float):
        super().__init__()
        self.layer_id = layer_id
        self.attention = attention
        self.feed_forward = feed_forward
        self.attention_norm = RMSNorm(dim, norm_eps)
        self.ffn_norm = RMSNorm(dim, norm_eps)
        self.out_std = out_std
        self.residual_mult = 1.0  # the Decoder sets it from its args

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        # doc_ids / cache travel as keywords: TP's PrepareModuleInput lays out the positional inputs only
        extra = {k: v for k, v in (("doc_ids", doc_ids), ("cache", cache)) if v is not None}
        h = x + self._scaled(self.attention(self.attention_norm(x), cos, sin, **extra))
        return h + self._scaled(self.feed_forward(self.ffn_norm(h)))

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_mult == 1.0 else branch * self.residual_mult

    def init_weights(self) -> None:
        self.attention.init_weights(self.out_std)
        self.feed_forward.init_weights(self.out_std)
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()


def residual_out_std(layer_id: int, n_layers: int, depth_init: bool) -> float:
    """Output projections of residual branches start smaller in deeper models/layers, so the
    residual stream's variance does not grow with depth at init."""
    depth = (layer_id + 1) if depth_init else n_layers
    return 0.02 / math.sqrt(2 * depth)


class Decoder(nn.Module):
    """A decoder-only LM. Subclasses set ``self.args`` and implement ``make_block`` and
    ``rope_frequencies``; ``args`` must have dim, n_layers, vocab_size, norm_eps, max_seq_len and
    tie_word_embeddings."""

    def __init__(self, args) -> None:
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): self.make_block(i) for i in range(args.n_layers)})
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.logit_mult = float(getattr(args, "logit_mult", 1.0))
        self.apply_multipliers()
        self.tie_weights()
        cos, sin = self.rope_tables()
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    # --- what a family supplies ----------------------------------------------------------
    def make_block(self, layer_id: int) -> nn.Module:
        raise NotImplementedError

    # a family whose rotary is YaRN-like sets ``scaled_rope`` to its ``args -> (frequencies, magnitude)``
    scaled_rope = None

    def rope_frequencies(self, device=None) -> torch.Tensor:
        """Inverse frequencies [rotary_dim/2]."""
        if self.scaled_rope is None:
            raise NotImplementedError
        return type(self).scaled_rope(self.args, device)[0]

    # --- shared behaviour ----------------------------------------------------------------
    def apply_multipliers(self) -> None:
        """Hand the args' residual and attention multipliers to the blocks and their attention
        modules (an args class without ``Multipliers`` fields keeps 1.0)."""
        residual, attn = (float(getattr(self.args, k, 1.0)) for k in ("residual_mult", "attn_mult"))
        for block in self.layers.values():
            block.residual_mult = residual
            for m in block.modules():
                if hasattr(m, "score_mult"):
                    m.score_mult = attn

    def rope_magnitude(self) -> float:
        """Multiplier of the cos/sin tables (YaRN's attention temperature); 1.0 = none."""
        return 1.0 if self.scaled_rope is None else type(self).scaled_rope(self.args)[1]

    def rope_tables(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = tables_from_frequencies(self.rope_frequencies(device), self.args.max_seq_len, device)
        magnitude = self.rope_magnitude()
        if magnitude != 1.0:
            cos, sin = cos * magnitude, sin * magnitude
        return cos, sin

    def tie_weights(self) -> None:
        """Point the embedding at the output projection's weight (tied models; both present)."""
        if self.args.tie_word_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.tok_embeddings.weight = self.output.weight

    supports_kv_cache = True  # forward(tokens, cache=KVCache()) decodes incrementally (generate.py)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """tokens [B, S] -> logits [B, S, vocab].

        On a pipeline stage without ``tok_embeddings`` the input is hidden states [B, S, dim];
        without ``output`` the return value is hidden states. ``doc_ids`` [B, S] (document
        masking, ``common/masking.py``): attention stays within each document and rotary
        positions restart at every document. ``cache`` (``common/kv_cache.py``): only the new
        tokens are run, attending to the cached keys/values of earlier calls.
        """
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        h = self.run_layers(h, doc_ids, cache)
        if self.norm is not None:
            h = self.norm(h)
        if self.output is not None:
            h = self.logits(h)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The output head on normed hidden states, times the parametrization's logit multiplier."""
        h = self.output(h)
        return h * self.logit_mult if self.logit_mult != 1.0 else h

    def rope_for(self, doc_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin tables every block of a training forward uses: per position, or per
        position within each document (``doc_ids``)."""
        if doc_ids is None:
            return self.rope_cos, self.rope_sin
        positions = positions_in_documents(doc_ids)
        return self.rope_cos[positions], self.rope_sin[positions]

    def run_layers(self, h: torch.Tensor, doc_ids: torch.Tensor | None = None, cache=None) -> torch.Tensor:
        """The blocks of this model (or pipeline stage) on hidden states [B, S, dim]."""
        if cache is not None:  # decoding: the new tokens sit at positions cache.length, ...
            if doc_ids is not None:
                raise ValueError("a KV cache decodes one sequence per row: document ids are not supported with it")
            start = cache.length
            for name, layer in self.layers.items():
                h = layer(h, self.rope_cos[start:], self.rope_sin[start:], cache=cache.layer(name))
            cache.advance(h.shape[1])
            return h
        cos, sin = self.rope_for(doc_ids)
        extra = {} if doc_ids is None else {"doc_ids": doc_ids}
        for layer in self.layers.values():
            h = layer(h, cos, sin, **extra)
        return h

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        """(Re)build rope tables and initialize every present parameter.

        Meant to run after ``to_empty`` on a meta-built (possibly sharded / staged) model.
        Untied: token embeddings std 1.0 (Meta/torchtitan convention: the first RMSNorm rescales
        them, and a unit-scale residual stream keeps the small residual branches near identity),
        output dim**-0.5 so initial logits are O(1) at any width. Tied: the one shared matrix gets
        std 1/dim. The final norm's output still points along the current token's own embedding
        (norm sqrt(dim)), so its self-logit is dim x std: 1/dim keeps it at ~1 and the initial loss
        at ln(vocab) at any width (dim**-0.5 would start it sqrt(dim) high: loss 10.8 instead of
        7.6 on qwen3_debug); the input side is rescaled by the first norm anyway.
        """
        if buffer_device is None:
            buffer_device = next((p.device for p in self.parameters()), self.rope_cos.device)
        self.rope_cos, self.rope_sin = self.rope_tables(buffer_device)
        self.tie_weights()
        tied = self.args.tie_word_embeddings
        if self.tok_embeddings is not None and not (tied and self.output is not None):
            nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=self.args.dim**-1.0 if tied else 1.0)
        for layer in self.layers.values():
            layer.init_weights()
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            trunc_normal_(self.output.weight, self.args.dim ** (-1.0 if tied else -0.5))
