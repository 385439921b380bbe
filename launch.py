"""titan_hydra's one entry point: compose (Hydra) -> validate -> launch.

    python launch.py                                  # debug Llama 3 on the built-in corpus, CPU
    python launch.py --cfg job                        # print the composed config, run nothing
    python launch.py dry_run=true                     # print the plan, train nothing
    python launch.py -m optimizer.lr=1e-4,3e-4        # a sweep
"""

from __future__ import annotations

import atexit
import gc

# Registered first, so it runs last of the exit hooks: the interpreter's final garbage collection
# would walk every object torch, sympy and Hydra created only to free what the process exit frees
# anyway (its cost: docs/testing.md).
atexit.register(gc.freeze)
# The imports below create objects that live as long as the process: collecting while they load
# finds nothing to free. After them, they are frozen out of every later collection.
gc.disable()

from titan_hydra.quiet import without_progress_bars  # noqa: E402  (standard library only)

# Before anything imports tqdm: the lm-eval harness's bars (eval.freq) and HF's would interleave
# with the step lines; the console already says where a run is.
without_progress_bars()

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

import titan_hydra.groups  # noqa: E402,F401  (registers schemas and resolvers before composing)
from titan_hydra.launch.entry import launch  # noqa: E402

gc.freeze()
gc.enable()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> float | None:
    return launch(cfg)


if __name__ == "__main__":
    main()
