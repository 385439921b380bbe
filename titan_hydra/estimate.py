"""Analytic plan of a run: parameters, FLOPs and per-rank memory, without allocating.

Used by ``dry_run=true`` and ``recipes/estimate.py``. Memory is the sum of parameters,
gradients and AdamW state (sharded over dp_shard*cp by FSDP, split by tp and pp) plus
activations from the standard per-layer estimate for a transformer block.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from omegaconf import DictConfig, OmegaConf

from titan_hydra.models.llama3 import LlamaArgs, flops_per_token, num_params

GIB = 1024**3


@dataclass
class Plan:
    flavor: str
    params: int
    non_embedding_params: int
    flops_per_token: float
    tokens_per_step: int
    flops_per_step: float
    world_size: int
    layout: str
    grad_accum_steps: int
    mem_params_gib: float
    mem_grads_gib: float
    mem_optimizer_gib: float
    mem_activations_gib: float
    mem_total_gib: float

    def as_dict(self) -> dict:
        return asdict(self)

    def format(self) -> str:
        rows = [
            ("model", self.flavor),
            ("parameters", f"{self.params:,} ({self.params / 1e9:.3f}B)"),
            ("non-embedding parameters", f"{self.non_embedding_params:,}"),
            ("FLOPs per token", f"{self.flops_per_token:.4g}"),
            ("tokens per step (global)", f"{self.tokens_per_step:,}"),
            ("FLOPs per step (global)", f"{self.flops_per_step:.4g}"),
            ("world size / layout", f"{self.world_size} / {self.layout}"),
            ("gradient accumulation", str(self.grad_accum_steps)),
            ("memory per rank: params", f"{self.mem_params_gib:.3f} GiB"),
            ("memory per rank: grads", f"{self.mem_grads_gib:.3f} GiB"),
            ("memory per rank: optimizer", f"{self.mem_optimizer_gib:.3f} GiB"),
            ("memory per rank: activations", f"{self.mem_activations_gib:.3f} GiB"),
            ("memory per rank: total", f"{self.mem_total_gib:.3f} GiB"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def model_args(cfg: DictConfig) -> LlamaArgs:
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    fields = {k: v for k, v in fields.items() if k not in ("_target_", "flavor")}
    return LlamaArgs(**fields)


def activation_bytes_per_layer(seq: int, batch: int, dim: int, heads: int, ffn: int, bytes_per: int) -> float:
    """Saved activations of one block for backward (no recompute), in bytes.

    Inputs of the two norms, q/k/v, attention output, the FFN's three hidden-size tensors and
    the residual inputs, each seq*batch wide; SDPA keeps only its output and logsumexp.
    """
    tokens = seq * batch
    per_token = bytes_per * (2 * dim + 3 * dim + dim + dim + 3 * ffn + 2 * dim)
    return tokens * per_token + tokens * heads * 4


def plan(cfg: DictConfig, dims) -> Plan:
    args = model_args(cfg)
    t = cfg.training
    mp = str(getattr(t.mixed_precision, "value", t.mixed_precision))
    n = num_params(args)
    n_emb = args.vocab_size * args.dim
    fpt = flops_per_token(args, t.seq_len)
    local_bs = t.local_batch_size
    global_bs = t.global_batch_size if t.global_batch_size > 0 else local_bs * dims.dp_degree
    accum = global_bs // (local_bs * dims.dp_degree)
    tokens = global_bs * t.seq_len
    model_split = dims.tp * dims.pp
    shard = model_split * (dims.dp_shard * dims.cp if dims.fsdp_enabled else 1)
    params_local = n / shard
    mem_params = params_local * 4  # fp32 master weights
    mem_grads = params_local * 4
    mem_optim = params_local * 8  # AdamW exp_avg + exp_avg_sq
    bytes_per = 2 if mp == "bf16" else 4
    act = activation_bytes_per_layer(
        t.seq_len // dims.cp, local_bs, args.dim, args.n_heads, args.ffn_hidden_dim, bytes_per
    ) * (args.n_layers / dims.pp) / dims.tp
    logits = local_bs * (t.seq_len // dims.cp) * args.vocab_size / dims.tp * (bytes_per + 4 + 4)
    act += logits
    total = mem_params + mem_grads + mem_optim + act
    layout = (
        f"dp_replicate={dims.dp_replicate} dp_shard={dims.dp_shard} tp={dims.tp} pp={dims.pp} cp={dims.cp}"
    )
    return Plan(
        flavor=str(cfg.model.flavor),
        params=n,
        non_embedding_params=n - n_emb,
        flops_per_token=fpt,
        tokens_per_step=tokens,
        flops_per_step=fpt * tokens,
        world_size=dims.world_size,
        layout=layout,
        grad_accum_steps=accum,
        mem_params_gib=mem_params / GIB,
        mem_grads_gib=mem_grads / GIB,
        mem_optimizer_gib=mem_optim / GIB,
        mem_activations_gib=act / GIB,
        mem_total_gib=total / GIB,
    )
