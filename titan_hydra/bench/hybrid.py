"""The ``hybrid`` suite of recipes/benchmark.py: Qwen3.5's Gated DeltaNet hybrid on this CPU.

Three tables, each from one invocation so its rows share the machine's load:

* (a) training tokens/s of ``qwen3_5_debug`` against transformers' ``Qwen3_5ForCausalLM`` of the
  same config and weights (its torch fallback: the chunked rule in a Python loop over chunks), in
  this process, fp32, the same threads; the two models' steps alternate, so a burst of load on a
  shared machine hits both alike. A step is forward, next-token cross entropy, backward and AdamW.
* (b) training tokens/s against the sequence length for three layer patterns of the same model
  (``model.full_attention_interval``: 1 = all full attention, 4 = 3 linear : 1 full, 0 = all
  Gated DeltaNet), alternated per step the same way; the parameter counts are in the table (a
  DeltaNet layer and a gated attention layer of the debug shape differ by ~2%).
* (c) validation loss after equal tokens of the built-in corpus for those three patterns: real
  ``launch.py`` runs (``mtp.mtp_run``), the same seed, batches and steps.

Measured in-process (a, b) rather than through ``launch.py``: both implementations get the same
loop, and process start-up stays out of a sub-second step.
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from titan_hydra.bench.mtp import mtp_run
from titan_hydra.groups import compose_config
from titan_hydra.hardware import cpu_isa, cpu_model
from titan_hydra.models.registry import args_of
from titan_hydra.quiet import import_quietly

PATTERNS = {"full attention (interval 1)": 1, "hybrid 3:1 (interval 4)": 4, "all Gated DeltaNet (interval 0)": 0}


def debug_model(model: str, extra: list[str], interval: int | None = None, max_seq_len: int | None = None):
    """(family, args, model) of a flavor with its own init, seed 0: the ``model.*`` overrides of the
    suite's extra arguments apply (a smaller model for a quick run); ``interval`` sets the pattern."""
    overrides = [f"model={model}", *(o for o in extra if o.startswith("model."))]
    if interval is not None:
        overrides.append(f"model.full_attention_interval={interval}")
    if max_seq_len is not None:
        overrides.append(f"model.max_seq_len={max_seq_len}")
    family, args = args_of(compose_config(overrides).model)
    torch.manual_seed(0)
    net = family.build(args)
    net.init_weights()
    return family, args, net


def transformers_twin(family, args, ours: torch.nn.Module) -> torch.nn.Module:
    """transformers' Qwen3_5ForCausalLM of the same config and weights, on its torch forms even where
    flash-linear-attention is installed."""
    hf_mod = import_quietly("transformers.models.qwen3_5.modeling_qwen3_5")
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(hf_mod, name)
        setattr(hf_mod, name, getattr(fn, "__wrapped__", fn))
    transformers = import_quietly("transformers")
    cfg = {k: v for k, v in family.hf.hf_config(args).items() if k not in ("architectures", "model_type")}
    twin = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**cfg))
    twin.load_state_dict(family.hf.to_hf_state(ours.state_dict(), args))
    return twin


def step_fn(model: torch.nn.Module, hf: bool):
    """One training step of ``model`` on tokens [B, S+1]: forward, next-token CE, backward, AdamW."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)

    def step(tokens: torch.Tensor) -> float:
        inputs, targets = tokens[:, :-1], tokens[:, 1:]
        logits = model(input_ids=inputs).logits if hf else model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    return step


def alternated_tps(steps: dict, vocab: int, batch: int, seq: int, n: int, warmup: int
                   ) -> tuple[dict[str, float], dict[str, float]]:
    """(median tokens/s of each step function over ``n`` steps after ``warmup``, each one's first
    loss), the functions taking turns within every step (the same batch for all). Equal first losses
    say two implementations compute the same function."""
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {name: [] for name in steps}
    first: dict[str, float] = {}
    for i in range(warmup + n):
        tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
        for name, step in steps.items():
            t0 = time.perf_counter()
            loss = step(tokens)
            first.setdefault(name, loss)
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return {name: batch * seq / statistics.median(t) for name, t in times.items()}, first


def versus_transformers(args, model: str = "qwen3_5_debug") -> dict:
    """Table (a): ours against transformers' implementation, same weights, same batches."""
    family, margs, ours = debug_model(model, args.extra)
    twin = transformers_twin(family, margs, ours)
    steps = {"titan_hydra": step_fn(ours, hf=False), "transformers (torch fallback)": step_fn(twin, hf=True)}
    tps, first = alternated_tps(steps, margs.vocab_size, args.batch, args.seq_len, args.timed_steps, 1)
    return {"model": model, "batch": args.batch, "seq": args.seq_len, "tokens_per_s": tps,
            "speedup": tps["titan_hydra"] / tps["transformers (torch fallback)"], "first_loss": first,
            "params": sum(p.numel() for p in ours.parameters())}


def seq_sweep(args, model: str = "qwen3_5_debug") -> dict:
    """Table (b): tokens/s per layer pattern and sequence length (batch 1, the models built once)."""
    top = max(args.seqs)
    built = {name: debug_model(model, args.extra, k, max(top, 64))[1:] for name, k in PATTERNS.items()}
    params = {name: sum(p.numel() for p in net.parameters()) for name, (_, net) in built.items()}
    vocab = next(iter(built.values()))[0].vocab_size
    rows = []
    for seq in args.seqs:
        steps = {name: step_fn(net, hf=False) for name, (_, net) in built.items()}
        n = max(1, args.timed_steps if seq <= 1024 else args.timed_steps // 2)  # long sequences: fewer steps
        rows.append({"seq": seq, "tokens_per_s": alternated_tps(steps, vocab, 1, seq, n, 1)[0]})
    return {"model": model, "params": params, "rows": rows}


def tables(result: dict, heading: str) -> list[str]:
    """The three markdown tables of a hybrid suite result."""
    a = result["vs_transformers"]
    tps = a["tokens_per_s"]
    names = list(tps)
    lines = [heading, "", f"(a) {a['model']}, batch {a['batch']} x seq {a['seq']}, fp32, training step "
             "(forward, CE, backward, AdamW), steps alternated", "",
             f"| {' | '.join(f'{n} tok/s' for n in names)} | speed-up |", f"|{'---|' * (len(names) + 1)}",
             f"| {' | '.join(f'{tps[n]:,.0f}' for n in names)} | {a['speedup']:.2f}x |", "",
             "first-step loss (same weights, same batch): "
             + ", ".join(f"{n} {a['first_loss'][n]:.6f}" for n in names), ""]
    b = result["seq_sweep"]
    params = b["params"]
    pats = list(params)
    lines += [f"(b) {b['model']} layer patterns, batch 1, fp32, tokens/s of a training step", "",
              f"| seq | {' | '.join(pats)} | all-GDN / full |", f"|{'---|' * (len(pats) + 2)}",
              f"| params | {' | '.join(f'{params[p]:,}' for p in pats)} | |"]
    for r in b["rows"]:
        t = r["tokens_per_s"]
        lines.append(f"| {r['seq']} | {' | '.join(f'{t[p]:,.0f}' for p in pats)} | {t[pats[-1]] / t[pats[0]]:.2f}x |")
    c = result.get("loss", [])
    if c:
        steps = sorted({s for r in c for s in r.get("val_loss", {})})
        lines += ["", f"(c) validation loss after equal tokens ({result['loss_steps']} steps), builtin corpus", "",
                  f"| pattern | {' | '.join(f'val loss @{s}' for s in steps)} | train CE (last 10) | tok/s |",
                  f"|{'---|' * (len(steps) + 3)}"]
        for r in c:
            if "failed" in r:
                lines.append(f"| {r['variant']} | failed: {r['failed']} |")
                continue
            vals = " | ".join(f"{r['val_loss'].get(s, float('nan')):.4f}" for s in steps)
            lines.append(f"| {r['variant']} | {vals} | {r['train_next_token_ce_last10']:.4f} | {r['tokens_per_s']:,.0f} |")
    return lines


def hybrid_suite(args, tmp: Path) -> tuple[list[str], dict]:
    """Qwen3.5's hybrid: (a) tokens/s against transformers' implementation,
    (b) tokens/s against the sequence length per layer pattern, (c) loss after equal tokens per
    pattern (``--steps`` steps of launch.py; 0 skips it)."""
    torch.set_num_threads(args.threads)
    result = {"suite": "hybrid", "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(), "threads": args.threads,
              "torch": torch.__version__, "timed_steps": args.timed_steps,
              "vs_transformers": versus_transformers(args),
              "seq_sweep": seq_sweep(args), "loss_steps": args.steps}
    result["loss"] = [mtp_run(args, tmp, name, (f"model.full_attention_interval={k}",), model="qwen3_5_debug")
                      for name, k in PATTERNS.items()] if args.steps else []
    heading = (f"suite `hybrid` — {result['date']}, {cpu_model()} ({cpu_isa()}), {os.cpu_count()} cores "
               f"(shared), {args.threads} thread(s), torch {torch.__version__}, median of {args.timed_steps} timed steps")
    return tables(result, heading), result
