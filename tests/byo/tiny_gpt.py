"""A model defined outside titan_hydra: a small GPT-2-style decoder and its ModelFamily.

It exists to prove the model protocol (titan_hydra/models/protocol.py) is enough to plug in a
model the engine has never seen: different module names (wte/wpe/h/ln_f/lm_head), LayerNorm,
learned positions, GELU MLP, biases. Nothing here is imported by titan_hydra; the config names
it (tests/byo/conf/model/tiny_gpt.yaml: ``_target_: tiny_gpt.TinyGPT``, ``family: tiny_gpt.FAMILY``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from titan_hydra.errors import ConfigError
from titan_hydra.models.protocol import ModelFamily, ModelShape


@dataclass
class TinyGPTArgs:
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 2048
    max_seq_len: int = 256
    mlp_ratio: int = 4


class Block(nn.Module):
    def __init__(self, a: TinyGPTArgs):
        super().__init__()
        self.head_dim = a.dim // a.n_heads
        self.ln_1 = nn.LayerNorm(a.dim)
        self.c_q, self.c_k, self.c_v = (nn.Linear(a.dim, a.dim) for _ in range(3))
        self.c_proj = nn.Linear(a.dim, a.dim)
        self.ln_2 = nn.LayerNorm(a.dim)
        self.c_fc = nn.Linear(a.dim, a.mlp_ratio * a.dim)
        self.c_out = nn.Linear(a.mlp_ratio * a.dim, a.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.ln_1(x)
        q, k, v = (w(h).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.c_q, self.c_k, self.c_v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(att.transpose(1, 2).reshape(b, s, -1))
        return x + self.c_out(F.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    def __init__(self, **fields):
        super().__init__()
        self.args = a = TinyGPTArgs(**fields)
        self.wte = nn.Embedding(a.vocab_size, a.dim)
        self.wpe = nn.Embedding(a.max_seq_len, a.dim)
        self.h = nn.ModuleDict({str(i): Block(a) for i in range(a.n_layers)})
        self.ln_f = nn.LayerNorm(a.dim)
        self.lm_head = nn.Linear(a.dim, a.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # first pipeline stage (or the whole model)
            pos = torch.arange(tokens.shape[1], device=tokens.device)
            x = self.wte(tokens) + self.wpe(pos)[None]
        else:
            x = tokens
        for block in self.h.values():
            x = block(x)
        if self.ln_f is not None:
            x = self.lm_head(self.ln_f(x))
        return x

    @torch.no_grad()
    def init_weights(self, buffer_device=None) -> None:
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif ".ln_" in f".{name}":
                nn.init.ones_(p)
            else:
                std = 0.02 / math.sqrt(2 * self.args.n_layers) if name.endswith(("c_proj.weight", "c_out.weight")) else 0.02
                nn.init.normal_(p, std=std)


class TinyGPTFamily(ModelFamily):
    name = "tiny_gpt"
    args_cls = TinyGPTArgs

    def shape(self, a: TinyGPTArgs) -> ModelShape:
        emb = (a.vocab_size + a.max_seq_len) * a.dim
        block = 4 * (a.dim * a.dim + a.dim) + 2 * a.mlp_ratio * a.dim * a.dim + a.mlp_ratio * a.dim + a.dim + 4 * a.dim
        head = 2 * a.dim + a.vocab_size * a.dim
        total = emb + a.n_layers * block + head
        return ModelShape(n_layers=a.n_layers, dim=a.dim, vocab_size=a.vocab_size, n_heads=a.n_heads,
                          n_kv_heads=a.n_heads, head_dim=a.dim // a.n_heads, ffn_dim=a.mlp_ratio * a.dim,
                          params=total, active_params=total, embedding_params=emb, head_params=head)

    def flops_per_token(self, a: TinyGPTArgs, seq_len: int) -> float:
        s = self.shape(a)
        return float(6 * (s.params - s.embedding_params) + 12 * a.n_layers * a.dim * seq_len)

    def check(self, a: TinyGPTArgs, dims, seq_len: int) -> None:
        if seq_len > a.max_seq_len:
            raise ConfigError(f"training.seq_len={seq_len} exceeds model.max_seq_len={a.max_seq_len}")
        if a.n_heads % dims.tp:
            raise ConfigError(f"parallelism.tp={dims.tp} must divide model.n_heads={a.n_heads}")
        if dims.cp > 1:  # learned positions would have to follow the load-balanced token shards
            raise ConfigError("tiny_gpt has learned positions and does not support context parallel; set parallelism.cp=1")

    def blocks(self, model: TinyGPT) -> nn.ModuleDict:
        return model.h

    def fsdp_units(self, model: TinyGPT) -> list:
        units = []
        if model.wte is not None:
            units.append(([model.wte, model.wpe], False))
        blocks = list(model.h.values())
        units += [(b, i == len(blocks) - 1 and model.ln_f is None) for i, b in enumerate(blocks)]
        if model.ln_f is not None:
            units.append(([model.ln_f, model.lm_head], True))
        return units

    def tp_plan(self, model: TinyGPT, sequence_parallel: bool, loss_parallel: bool) -> dict:
        """Megatron-style TP without sequence parallel (this family ignores that flag)."""
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        from titan_hydra.models.common.tp_styles import ReplicateParallel

        plan: dict = {}
        if model.wte is not None:
            plan["wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
            plan["wpe"] = ReplicateParallel()
        for i in model.h:
            p = f"h.{i}."
            plan.update({p + "ln_1": ReplicateParallel(), p + "ln_2": ReplicateParallel(),
                         p + "c_q": ColwiseParallel(), p + "c_k": ColwiseParallel(), p + "c_v": ColwiseParallel(),
                         p + "c_proj": RowwiseParallel(), p + "c_fc": ColwiseParallel(),
                         p + "c_out": RowwiseParallel()})
        if model.ln_f is not None:
            plan["ln_f"] = ReplicateParallel()
            plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                              use_local_output=not loss_parallel)
        return plan

    def cut_stage(self, model: TinyGPT, layer_ids: range, is_first: bool, is_last: bool) -> TinyGPT:
        stage = copy.deepcopy(model)
        for name in list(stage.h):
            if int(name) not in layer_ids:
                del stage.h[name]
        if not is_first:
            stage.wte = stage.wpe = None
        if not is_last:
            stage.ln_f = stage.lm_head = None
        return stage


FAMILY = TinyGPTFamily()
