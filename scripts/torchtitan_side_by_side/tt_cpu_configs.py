"""torchtitan 0.3.0 configs for CPU runs, selected with ``--module tt_cpu_configs --config NAME``.

Each one is one of torchtitan's own debug configs (model, optimizer, schedule, activation
checkpointing, loss) changed only where CPU needs it:

* every layer's inner attention becomes plain causal ``F.scaled_dot_product_attention``
  (``ScaledDotProductAttention``): FlexAttention has no CPU backward and varlen attention needs
  CUDA. With it the trainer builds no document masks (attention is causal over the whole
  packed sequence); RoPE still gets the dataloader's per-document positions.
* ``training.disable_cuda_graphs = True`` where the field exists;
* validation off (``llama3_debugmodel`` runs it every 5 steps), so every step is a training step.

Variants: ``_sdpa`` (torchtitan's default: FSDP's mixed-precision policy casts parameters and
compute to bf16 even on one rank), ``_sdpa_fp32`` (``mixed_precision_param = "float32"``),
``_sdpa_compile`` (``compile.enable``: each block and the loss), ``_sdpa_fp32_compile`` (both), ``_sdpa_ep2`` /
``_sdpa_ep2_compile`` (``expert_parallel_degree = 2`` with ``spmd_backend = "partial_dtensor"``,
see ``_cpu``; launch with 2 ranks; the compiled one without activation checkpointing, see there).
Only importable inside torchtitan's environment.
"""

from __future__ import annotations

from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel
from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.models.qwen3.config_registry import qwen3_moe_debug


def _cpu(c, *, fp32: bool = False, compile: bool = False, ep: int = 1):
    layers = c.model_spec.model.layers
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if hasattr(c.training, "disable_cuda_graphs"):
        c.training.disable_cuda_graphs = True
    if hasattr(c, "validator") and hasattr(c.validator, "enable"):
        c.validator.enable = False
    if fp32:
        c.training.mixed_precision_param = "float32"
    if compile:
        c.compile.enable = True
    if ep > 1:
        c.parallelism.expert_parallel_degree = ep
        # The default SPMD backend ("spmd_types") leaves parameters as plain annotated tensors,
        # and torch 2.13's fully_shard refuses those on a 2-rank data-parallel mesh ("When
        # dp_mesh_dims is provided, all parameters must be DTensors ..."): on more than one rank
        # use DTensor for the model-parallel (EP) axis and plain FSDP2 over the rest.
        c.parallelism.spmd_backend = "partial_dtensor"
    return c


def qwen3_moe_debug_sdpa():
    return _cpu(qwen3_moe_debug())


def qwen3_moe_debug_sdpa_fp32():
    return _cpu(qwen3_moe_debug(), fp32=True)


def qwen3_moe_debug_sdpa_compile():
    return _cpu(qwen3_moe_debug(), compile=True)


def qwen3_moe_debug_sdpa_ep2():
    return _cpu(qwen3_moe_debug(), ep=2)


def qwen3_moe_debug_sdpa_ep2_compile():
    # Without activation checkpointing: compiled and checkpointed (selective or full) under EP, the
    # first forward fails in torch 2.13's AOTAutograd ("expected all tensors_saved_with_vc_check to
    # be Tensors", a DeviceMesh among the saved values) with every SPMD backend.
    c = _cpu(qwen3_moe_debug(), ep=2, compile=True)
    c.activation_checkpoint = None
    return c


def deepseek_v3_debugmodel_sdpa():
    return _cpu(deepseek_v3_debugmodel())


def deepseek_v3_debugmodel_sdpa_fp32():
    return _cpu(deepseek_v3_debugmodel(), fp32=True)


def deepseek_v3_debugmodel_sdpa_compile():
    return _cpu(deepseek_v3_debugmodel(), compile=True)


def deepseek_v3_debugmodel_sdpa_ep2():
    return _cpu(deepseek_v3_debugmodel(), ep=2)


def llama3_debugmodel_sdpa():
    return _cpu(llama3_debugmodel())


def llama3_debugmodel_sdpa_fp32():
    return _cpu(llama3_debugmodel(), fp32=True)


def llama3_debugmodel_sdpa_compile():
    return _cpu(llama3_debugmodel(), compile=True)


def llama3_debugmodel_sdpa_fp32_compile():
    return _cpu(llama3_debugmodel(), fp32=True, compile=True)
