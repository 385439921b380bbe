"""Multi-token prediction (DeepSeek-V3 report, section 2.2): D extra depths after the decoder.

Depth k predicts token t(i+k+1) at position i from two inputs: the previous depth's hidden state
h(k-1, i) (depth 0: the main model's) and the embedding of token t(i+k):

    h'(k, i) = eh_proj([enorm(Emb(t(i+k))); hnorm(h(k-1, i))])
    h(k, i)  = norm(block(h'(k, i)))          logits(k, i) = output(h(k, i))

What it is built on, and why:

* The embedding and the output head are the main model's (shared, as in the report); ``norm`` is
  the depth's own (HF ``shared_head.norm``). The main model's hidden state enters after its final
  norm: that is what transformers' ``MtpModel`` and the serving engines hand the released MTP
  weights, so an imported DeepSeek-V3 MTP layer computes what it was trained to.
* Emb(t(i+k)) is the main embedding output shifted left by k, so a pipeline's last stage (which
  holds the MTP layers, but not the embedding) receives the first stage's embedding output along
  with the hidden states: the gradient reaches the one embedding by the ordinary backward.
* Shapes stay [B, S]: the last k positions, and positions whose t(i+k) lies in another packed
  document, have no input (zeroed) and no target (``future_valid``); the loss
  (``mtp_loss.py``) ignores them.
* A training forward (``model.train()``) returns ``(logits, valid, logits_depth1, ...)``; an
  eval forward, generation and HF parity see the plain decoder (the report discards the MTP
  modules at inference). With ``mtp_layers=0`` nothing here is built.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_hydra.models.common.decoder import Decoder
from titan_hydra.models.common.layers import RMSNorm, trunc_normal_


def shift_left(x: torch.Tensor, k: int) -> torch.Tensor:
    """[B, S, ...] -> x[:, k:] followed by k zero rows (position i holds x[:, i + k])."""
    pad = x.new_zeros((x.shape[0], min(k, x.shape[1]), *x.shape[2:]))
    return torch.cat([x[:, k:], pad], dim=1)


def future_valid(batch: int, seq: int, k: int, doc_ids: torch.Tensor | None, device) -> torch.Tensor:
    """[B, S] bool: position i has a token k ahead in its own document (i + k < S, same doc id)."""
    valid = (torch.arange(seq, device=device) < seq - k).expand(batch, seq)
    if doc_ids is not None:
        valid = valid & (shift_left(doc_ids, k) == doc_ids)
    return valid


class MTPLayer(nn.Module):
    """One prediction depth: enorm, hnorm, eh_proj, a decoder block, and its output norm."""

    def __init__(self, block: nn.Module, dim: int, norm_eps: float):
        super().__init__()
        self.enorm = RMSNorm(dim, norm_eps)
        self.hnorm = RMSNorm(dim, norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)

    def forward(self, h: torch.Tensor, emb: torch.Tensor, valid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = torch.cat([self.enorm(emb), self.hnorm(h)], dim=-1) * valid.unsqueeze(-1).to(h.dtype)
        extra = {} if doc_ids is None else {"doc_ids": doc_ids}
        return self.norm(self.block(self.eh_proj(x), cos, sin, **extra))

    def init_weights(self) -> None:
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, 0.02)
        self.block.init_weights()


class MultiTokenDecoder(Decoder):
    """A ``Decoder`` with ``args.mtp_layers`` prediction depths (``mtp_layers``, a ModuleList, or
    None when 0). Depth k's block is ``make_block(n_layers + k - 1)``: the family decides what a
    layer past the last one is (DeepSeek-V3: an MoE layer)."""

    def __init__(self, args) -> None:
        super().__init__(args)
        depths = int(getattr(args, "mtp_layers", 0))
        self.mtp_layers = nn.ModuleList(
            [MTPLayer(self.make_block(args.n_layers + k), args.dim, args.norm_eps) for k in range(depths)]
        ) if depths else None

    def forward(self, tokens: torch.Tensor, embeddings: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None, cache=None):
        """As ``Decoder.forward``, except in training with MTP layers: a first pipeline stage
        returns (hidden, embeddings), a middle one takes and returns that pair, and the last
        stage (or the whole model) returns ``(logits, valid [D, B, S], logits of each depth)``."""
        # args, not self.mtp_layers: a pipeline stage before the last has none but passes emb on
        if not int(getattr(self.args, "mtp_layers", 0)) or not self.training or cache is not None:
            return super().forward(tokens, doc_ids=doc_ids, cache=cache)
        emb = self.tok_embeddings(tokens) if self.tok_embeddings is not None else embeddings
        h = self.run_layers(emb if self.tok_embeddings is not None else tokens, doc_ids)
        if self.norm is None:  # not the last pipeline stage
            return h, emb
        h = self.norm(h)
        outputs, valid = [self.logits(h)], []
        cos, sin = self.rope_for(doc_ids)
        for k, layer in enumerate(self.mtp_layers, start=1):
            valid.append(future_valid(h.shape[0], h.shape[1], k, doc_ids, h.device))
            h = layer(h, shift_left(emb, k), valid[-1], cos, sin, doc_ids)
            outputs.append(self.logits(h))
        return (outputs[0], torch.stack(valid), *outputs[1:])

    @torch.no_grad()
    def init_weights(self, buffer_device: torch.device | str | None = None) -> None:
        super().init_weights(buffer_device)
        for layer in self.mtp_layers or ():
            layer.init_weights()
