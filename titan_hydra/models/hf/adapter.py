"""Checkpoint conversion for ``model=hf``: the model already is the transformers class, so its
state-dict names are the checkpoint's; only a tied head (one tensor under two names, the class's
``_tied_weights_keys``) is written once, as ``save_pretrained`` does, and ``from_pretrained`` ties it again."""

from __future__ import annotations

from typing import Any

import torch

from titan_hydra.models.hf.model import HFArgs
from titan_hydra.models.protocol import HFAdapter

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
# config.json keys transformers writes for itself, not architecture fields
WRITTEN_BY_TRANSFORMERS = ("model_type", "architectures", "transformers_version", "dtype", "torch_dtype")


class HFCheckpointAdapter(HFAdapter):
    model_type = ""  # any: the run's config names it (a native family still reads its own types first)
    same_layout = True  # transformers' own names and layouts: each rank reads its slices (hf_import.py)

    def source_name(self, name: str, args: HFArgs) -> str:
        return tied_keys(args).get(name, name)

    def reads(self, model_type: str | None) -> bool:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: ~2 s import

        return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    def to_hf_state(self, sd: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
        tied = tied_keys(args)
        return {k: v for k, v in sd.items() if k not in tied}

    def from_hf_state(self, sd: dict[str, torch.Tensor], args: HFArgs) -> dict[str, torch.Tensor]:
        out = dict(sd)
        for target, source in tied_keys(args).items():
            if target not in out and source in out:
                out[target] = out[source]
        return out

    def hf_config(self, args: HFArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # lazy: ~2 s import

        cfg = args.hf_config.to_dict()
        cfg.pop("_attn_implementation", None)
        cfg.update(architectures=[MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg["model_type"]]], dtype=DTYPE_NAMES[dtype])
        return cfg

    def args_from_hf_config(self, cfg: dict[str, Any]) -> HFArgs:
        fields = {k: v for k, v in cfg.items() if k not in WRITTEN_BY_TRANSFORMERS}
        return HFArgs(model_type=cfg["model_type"], fields=fields)


def tied_keys(args: HFArgs) -> dict[str, str]:
    """{tied name: the name it shares a tensor with} of a tied architecture (the causal-LM class's
    ``_tied_weights_keys``: GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``), else {}."""
    import transformers  # lazy: ~2 s import
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cfg = args.hf_config
    if not getattr(cfg, "tie_word_embeddings", False):
        return {}
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type])
    return dict(getattr(cls, "_tied_weights_keys", None) or {})
