"""Model weights from a Hugging Face directory (safetensors + config.json) of this run's family.

``initial_load_path`` may name an HF directory instead of a DCP checkpoint: fine-tuning starts
from published weights. The directory's config must describe the same model as the run (its
signature), and every parameter must be present with this run's shape, before anything changes.
"""

from __future__ import annotations

from pathlib import Path

from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from titan_hydra.checkpoint.state import RunParts, signature_diff
from titan_hydra.checkpoint.storage import CheckpointError
from titan_hydra.models.hf_io import load_hf_checkpoint


def load_hf(run: RunParts, path: Path) -> None:
    """Load the HF weights at ``path`` into ``run``'s model (all parameters, or nothing)."""
    _, args, full = load_hf_checkpoint(path, run.family)
    diffs = signature_diff(run.family.signature(args), run.family.signature(run.model_args))
    if diffs:
        raise CheckpointError(f"HF checkpoint {path} does not match this run's model: " + ", ".join(diffs))
    ours = run.model_state()
    template = {k[len("model."):]: v for k, v in ours.items()}
    missing = [k for k in template if k not in full]
    if missing:
        raise CheckpointError(f"HF checkpoint {path} lacks {missing[:4]}")
    for k, v in template.items():
        if tuple(full[k].shape) != tuple(v.shape):
            raise CheckpointError(
                f"HF checkpoint {path}: {k} has shape {list(full[k].shape)}, this run needs {list(v.shape)}"
            )
    sd = {k: full[k].to(v.dtype) for k, v in template.items()}
    set_model_state_dict(run.module, sd, options=StateDictOptions(full_state_dict=True))
    run.log(f"loaded HF weights from {path}")
