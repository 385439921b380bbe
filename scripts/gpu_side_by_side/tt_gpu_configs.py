"""torchtitan 0.3.0 configs of the GPU side by side, selected with ``--module tt_gpu_configs --config NAME``.

Each one is torchtitan's own Llama 3 trainer config (``llama3_debugmodel``: AdamW at 8e-4, 2 warmup
steps, its chunked cross entropy, the ``c4_test`` loader and test tokenizer the driver lays out)
with torchtitan's own "1B" model (Llama 3.2 1B: dim 2048, 16 layers, 32 heads / 8 KV heads, FFN
8192, vocab 128,256, tied embeddings), changed only where the comparison needs it:

* inner attention: causal ``F.scaled_dot_product_attention`` (flash on Hopper), the attention
  titan_hydra runs; torchtitan's default for the model is FlexAttention with per-document masks,
  other work than a causal mask over the packed sequence;
* compile on (each block and the loss, torchtitan's ``compile.components``), no activation
  checkpointing (the 1B at 4 x 2048 tokens fits an 80 GB GPU without it), validation off;
* ``_float8``: torchtitan's ``Float8LinearConverter`` (rowwise: 0.3.0 has no tensorwise recipe),
  the output projection left in bf16 as titan_hydra leaves it.

Everything else is torchtitan's default, its CUDA-graph capture of forward + backward included.
``llama3_debug_bf16_compile_cpu`` is the same config on torchtitan's debug model for the CPU
rehearsal (``tt_cpu_configs``' CPU changes). Only importable inside torchtitan's environment.
"""

from __future__ import annotations

from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
from torchtitan.components.quantization import Float8LinearConverter
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.common.config_utils import decoder_vocab_size
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from tt_cpu_configs import _cpu


def _side_by_side(flavor: str, float8: bool = False):
    c = llama3_debugmodel()
    converters = [Float8LinearConverter.Config(model_compile_enabled=True, filter_fqns=["lm_head"])] if float8 else None
    c.model_spec = model_registry(flavor, converters=converters)
    for layer in c.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    c.loss = ChunkedLossWrapper.Config(loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(c.model_spec)))
    c.compile.enable = True
    c.activation_checkpoint = None
    c.validator.enable = False
    return c


def llama3_1b_bf16_compile():
    return _side_by_side("1B")


def llama3_1b_float8_compile():
    return _side_by_side("1B", float8=True)


def llama3_debug_bf16_compile_cpu():
    return _cpu(_side_by_side("debugmodel"), compile=True)
