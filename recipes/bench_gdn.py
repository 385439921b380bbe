"""Gated DeltaNet layer benchmark: forward + backward time of the common kit's layer against
transformers' Qwen3.5 layer (its torch fallback: the chunked rule with a Python loop over chunks),
same weights, same input. Prints a markdown table and writes JSON.

    python recipes/bench_gdn.py                                  # CPU, fp32, 1 thread
    python recipes/bench_gdn.py --threads 2 --seqs 256 1024 4096 --out bench_out/gdn.json
    python recipes/bench_gdn.py --device cuda --dtype bfloat16   # adds flash-linear-attention if installed

Each shape times best-of ``--reps`` calls after one warm-up, the implementations alternated
within every repetition so a burst of load on a shared machine hits all of them alike.
"""

from __future__ import annotations

import datetime
import json
import time
from pathlib import Path

import torch

from titan_hydra.analysis.flags import add_out, add_threads, parser
from titan_hydra.hardware import cpu_model
from titan_hydra.quiet import import_quietly

# transformers' Qwen3.5 module imports torchao where it is installed, which logs its missing CUDA kernels
modeling_qwen3_5 = import_quietly("transformers.models.qwen3_5.modeling_qwen3_5")
Qwen3_5GatedDeltaNet = modeling_qwen3_5.Qwen3_5GatedDeltaNet
Qwen3_5TextConfig = import_quietly("transformers").Qwen3_5TextConfig

from titan_hydra.kernels import gated_delta_policy
from titan_hydra.models.common.gated_deltanet import GatedDeltaNet
from titan_hydra.models.qwen3_5.hf import fuse_qkv


def layers(args, device: torch.device, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """The implementations to time, all with the same weights; transformers' layer always on its torch
    forms (with flash-linear-attention installed it would call that instead)."""
    for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
        fn = getattr(modeling_qwen3_5, name)
        setattr(modeling_qwen3_5, name, getattr(fn, "__wrapped__", fn))
    heads, width = args.heads, args.head_dim
    ours = GatedDeltaNet(args.dim, heads, heads, width, width, chunk_size=args.chunk_size)
    cfg = Qwen3_5TextConfig(hidden_size=args.dim, linear_num_key_heads=heads, linear_num_value_heads=heads,
                            linear_key_head_dim=width, linear_value_head_dim=width, num_hidden_layers=1,
                            layer_types=["linear_attention"])
    ref = Qwen3_5GatedDeltaNet(cfg, layer_idx=0)
    ref.load_state_dict(fuse_qkv(ours.state_dict()))  # transformers fuses q | k | v
    found = {"transformers (torch fallback)": ref, "titan_hydra (torch)": ours}
    if device.type == "cuda" and gated_delta_policy.fla_import_error() is None:
        fla = GatedDeltaNet(args.dim, heads, heads, width, width)
        fla.load_state_dict(ours.state_dict())
        gated_delta_policy.apply_gated_delta_kernel(fla, "fla", device)
        found["titan_hydra (flash-linear-attention)"] = fla
    return {name: m.to(device=device, dtype=dtype) for name, m in found.items()}


def time_shape(modules: dict[str, torch.nn.Module], x: torch.Tensor, reps: int) -> dict[str, float]:
    """Best-of seconds of one forward + backward per implementation."""
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    best = {name: float("inf") for name in modules}
    for rep in range(reps + 1):  # rep 0 warms up
        for name, module in modules.items():
            sync()
            t0 = time.perf_counter()
            module(x).float().square().mean().backward()
            sync()
            if rep:
                best[name] = min(best[name], time.perf_counter() - t0)
            module.zero_grad(set_to_none=True)
    return best


def main() -> None:
    p = parser(__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    add_threads(p)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqs", type=int, nargs="+", default=[256, 1024, 4096])
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    add_out(p, "JSON path", default="bench_out/gdn.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.manual_seed(0)
    modules = layers(args, device, dtype)
    names = list(modules)
    rows = []
    print(f"| batch x seq | {' | '.join(f'{n} (ms)' for n in names)} | speed-up over transformers |")
    print(f"|---|{'---|' * (len(names) + 1)}")
    for seq in args.seqs:
        x = torch.randn(args.batch, seq, args.dim, device=device, dtype=dtype, requires_grad=True)
        times = time_shape(modules, x, args.reps)
        base = times[names[0]]
        rows.append({"batch": args.batch, "seq": seq, "seconds": times})
        speedups = ", ".join(f"{base / times[n]:.2f}x" for n in names[1:])
        print(f"| {args.batch} x {seq} | {' | '.join(f'{times[n] * 1e3:.1f}' for n in names)} | {speedups} |")
    meta = {"date": datetime.date.today().isoformat(), "cpu": cpu_model(), "threads": torch.get_num_threads(),
            "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "dtype": args.dtype,
            "torch": torch.__version__, "heads": args.heads, "head_dim": args.head_dim, "dim": args.dim,
            "chunk_size": args.chunk_size, "reps": args.reps}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**meta, "rows": rows}, indent=1))
    print(f"{meta['cpu']}, {meta['threads']} thread(s), {meta['device']}, {args.dtype}; wrote {out}")


if __name__ == "__main__":
    main()
