"""Train many transformers architectures as ``model=hf``, each from tiny fields, and tabulate them.

    python recipes/hf_sweep.py                       # the default list, 8 steps each
    python recipes/hf_sweep.py gpt2 falcon mamba --steps 8 --out bench_out/hf_sweep.json

Each architecture gets the tiny fields below that its config knows (``model.fields`` refuses the
others, ``models/hf/fields.py``: GPT-2 has ``n_inner``, not ``intermediate_size``), trains in this
process (``pretrain.run``, one process, fp32, the built-in corpus), and gets one row: its block list,
attention, parameters, first and last loss, whether the loss fell, or the one line that stopped it
(a ``ConfigError`` or ``UserError`` is the platform's refusal; anything else is a bug to report).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

from titan_hydra.errors import UserError
from titan_hydra.groups import compose_config
from titan_hydra.models.hf.fields import known_fields
from titan_hydra.quiet import loggers_at_error
from titan_hydra.spec import spec_of

ARCHITECTURES = [
    # dense, model.layers
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi", "phi3", "olmo", "olmo2", "olmo3",
    "granite", "smollm3", "glm", "glm4", "cohere", "cohere2", "starcoder2", "stablelm", "helium", "exaone4",
    "ernie4_5", "seed_oss", "apertus", "arcee", "persimmon", "diffllama",
    # blocks elsewhere: transformer.h, model.decoder.layers, gpt_neox.layers, biogpt.layers
    "gpt2", "gpt_bigcode", "gpt_neo", "falcon", "opt", "gpt_neox", "biogpt", "xglm",
    # no SDPA path: eager
    "bloom", "mpt", "codegen", "gptj",
    # MoE
    "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "phimoe", "deepseek_v2", "deepseek_v3", "jetmoe",
    # hybrid SSM / conv / recurrent
    "jamba", "lfm2", "bamba", "falcon_h1", "zamba2", "mamba", "mamba2", "recurrent_gemma",
]
# Tiny fields, each given where the architecture's config knows it (canonical names reach GPT-2's
# n_embd etc. through its attribute_map).
TINY = {
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "vocab_size": 2048, "max_position_embeddings": 2048, "head_dim": 16,
    "ffn_dim": 128, "n_inner": 128, "word_embed_proj_dim": 64, "ffn_hidden_size": 128,
    "moe_intermediate_size": 64, "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "shared_expert_intermediate_size": 64,
    "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8, "v_head_dim": 16, "n_group": 1, "topk_group": 1,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_expand": 2, "state_size": 8,
    "expand": 2, "n_groups": 1, "num_heads": 4, "mamba_d_conv": 4, "conv_kernel": 4,
    "attention_window_size": 32, "lru_width": 64, "block_types": ["recurrent", "attention"],
    "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "dropout": 0.0, "hidden_dropout": 0.0,
    "attention_dropout": 0.0, "summary_first_dropout": 0.0, "pad_token_id": 0,
}


# where the shared tiny fields do not fit an architecture's own rules
OWN = {
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 8},
    "bamba": {"mamba_d_head": 32, "mamba_n_heads": 4},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 32},
    "codegen": {"rotary_dim": 8}, "gptj": {"rotary_dim": 8},  # the default (64) is wider than a 16-wide head
    "deepseek_v3": {"head_dim": 8},  # its rotary width: qk_rope_head_dim
    "zamba2": {"layer_types": ["mamba", "hybrid"]},
    "mamba2": {"num_heads": 8},  # hidden_size x expand = num_heads x head_dim
}


def fields_for(model_type: str) -> dict:
    from transformers import AutoConfig

    cls = type(AutoConfig.for_model(model_type))
    known = known_fields(cls)
    return {**{k: v for k, v in TINY.items() if k in known}, **OWN.get(model_type, {})}


def train(model_type: str, steps: int, run_dir: Path) -> dict:
    from titan_hydra.models.hf.stack import block_list
    from titan_hydra.train.pretrain import run

    row: dict = {"model_type": model_type}
    try:
        fields = fields_for(model_type)
        cfg = compose_config(["model=hf", f"model.model_type={model_type}", "model.fields={" + ", ".join(f"{k}: {json.dumps(v)}" for k, v in fields.items()) + "}",
                              f"training.steps={steps}", "training.seq_len=64", "training.local_batch_size=4",
                              "training.val_freq=0", "training.mixed_precision=fp32", "logger=minimal",
                              "lr_scheduler.warmup_steps=2", "optimizer.lr=3e-3"])
        spec = spec_of(cfg)
        import torch

        with torch.device("meta"):
            model = spec.family.build(spec.model_args)
        row.update(blocks=block_list(model)[0], attention=model.config._attn_implementation,
                   params=spec.shape.params)
        with loggers_at_error("titan_hydra"):
            losses = run(spec, str(run_dir))["losses"]
        row.update(first=losses[0], last=losses[-1], falls=losses[-1] < losses[0], status="ok")
    except UserError as e:
        row.update(status=f"refused: {str(e).splitlines()[0]}")
    except Exception as e:  # noqa: BLE001 -- a row, not a crash: the table is the report
        line = (str(e).splitlines() or [""])[0]
        row.update(status=f"failed: {type(e).__name__}: {line}", where=traceback.format_exc(limit=-2).splitlines()[-3:])
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model_type | blocks | attention | parameters | loss step 1 -> last | status |",
             "|---|---|---|---:|---|---|"]
    for r in rows:
        loss = f"{r['first']:.3f} -> {r['last']:.3f}" if "first" in r else ""
        status = ("falls" if r.get("falls") else "does not fall") if r["status"] == "ok" else r["status"]
        lines.append(f"| {r['model_type']} | `{r.get('blocks', '')}` | {r.get('attention', '')} | "
                     f"{r.get('params', 0):,} | {loss} | {status} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model_types", nargs="*", default=ARCHITECTURES)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", default=None, help="JSON of the rows (default: none)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_type in args.model_types:
            rows.append(train(model_type, args.steps, Path(tmp) / model_type))
            r = rows[-1]
            print(f"{model_type}: {r['status']}" + (f" {r['first']:.3f} -> {r['last']:.3f}" if "first" in r else ""),
                  flush=True)
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1, default=str))


if __name__ == "__main__":
    main()
