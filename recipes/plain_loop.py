"""The benchmark's yardstick: a plain fp32 eager PyTorch loop training the same model.

No framework on the hot path: the model is built from the same composed config (so it is the
same architecture and the same batches from the same data pipeline), then trained with
nothing but fp32 eager ``forward -> cross_entropy -> backward -> clip -> AdamW.step``. It
writes ``metrics.jsonl`` rows in the trainer's format (step, loss, tps, tflops) so the
benchmark reads both the same way. `recipes/benchmark.py` runs it side by side with the
framework's variants; on its own:

    python recipes/plain_loop.py --steps 10 --threads 2 --run-dir /tmp/plain [hydra overrides]
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--run-dir", required=True)
    p.add_argument("overrides", nargs="*", help="Hydra overrides (model, data, batch, seq_len)")
    args = p.parse_args()

    import torch
    import torch.nn.functional as F
    from titan_hydra.groups import compose_config
    from titan_hydra.models.registry import model_from_args
    from titan_hydra.spec import spec_of
    from titan_hydra.train.optimizers import build_optimizer
    from titan_hydra.train.services import build_dataset

    torch.set_num_threads(args.threads)
    spec = spec_of(compose_config(args.overrides))
    family = spec.family
    model = model_from_args(spec.model_target, family, spec.model_args)
    torch.manual_seed(spec.training.seed)  # after construction, as the trainer's init does
    model.init_weights()
    optimizer = build_optimizer(spec.optimizer, list(model.named_parameters()))  # the trainer's groups
    loader = build_dataset(spec.data).loader("train", spec.training.local_batch_size)
    fpt = family.flops_per_token(spec.model_args, spec.training.seq_len)

    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as out:
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            inputs, labels = next(loader)
            optimizer.zero_grad(set_to_none=True)
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.training.max_norm)
            optimizer.step()
            loss_value = loss.item()
            tps = inputs.numel() / (time.perf_counter() - t0)
            rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
            row = {"step": step, "loss": loss_value, "tps": tps, "tflops": tps * fpt / 1e12, "memory": rss_gib}
            out.write(json.dumps(row) + "\n")
            print(f"step {step:5d} | loss {loss_value:.4f} | tps {tps:,.0f}", flush=True)


if __name__ == "__main__":
    main()
