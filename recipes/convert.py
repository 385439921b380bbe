"""Convert between titan_hydra DCP checkpoints and Hugging Face directories (offline, one process).

    python recipes/convert.py to-hf   OUT/checkpoint/step-1000  hf_out/  [--dtype bfloat16] [--weights ema]
    python recipes/convert.py from-hf hf_model_dir/             ckpt/step-0

``to-hf`` reads the model weights of any checkpoint this project wrote (any layout: DCP stores
global tensors), and writes ``config.json`` + ``model.safetensors`` through the model family's
HF adapter (names, rotary layout, tied weights), which ``<Family>ForCausalLM.from_pretrained``
loads; ``--weights ema`` exports the EMA of the weights that a ``training.ema_decay`` run kept.
``from-hf`` picks the family from ``config.json``'s ``model_type`` and writes a model-only DCP checkpoint (with completion marker) that ``checkpoint.initial_load_path`` loads
under any layout. (``initial_load_path`` also accepts an HF directory directly.)

For FLUX.1 the "HF directory" is diffusers' layout: ``config.json`` (``_class_name``
``FluxTransformer2DModel``) + ``diffusion_pytorch_model.safetensors``, what
``FluxTransformer2DModel.from_pretrained`` loads (e.g. the ``transformer/`` folder of a FLUX.1 repo).
"""

from __future__ import annotations

import sys

from titan_hydra.analysis.flags import parser
from titan_hydra.checkpoint.convert import from_hf, to_hf
from titan_hydra.errors import exit_status


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("direction", choices=("to-hf", "from-hf"))
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--weights", default="model", choices=("model", "ema"),
                   help="to-hf: the trained weights, or their EMA (a run with training.ema_decay > 0)")
    a = p.parse_args(argv)

    def convert() -> str:
        if a.direction == "to-hf":
            to_hf(a.src, a.dst, a.dtype, a.weights)
        else:
            from_hf(a.src, a.dst, a.dtype)
        return f"wrote {a.dst}"

    return exit_status(convert)


if __name__ == "__main__":
    sys.exit(main())
