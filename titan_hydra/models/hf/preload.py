"""Importing this module imports transformers' model base without the lines its imports print.

``transformers.modeling_utils`` imports its quantizers, which import torchao where it is installed:
torchao logs that its CUDA kernels (``_C_mxfp8``, ``_C_cutlass_90a``) and triton are absent, and
torch's pytree warns about torchao's Enum constants. Nothing there is a user's to act on, so torchao
is imported first under ``quiet.import_quietly`` (its loggers at ERROR for the import only) and
transformers then finds it loaded. ``model=hf`` imports this before it touches transformers, and
the family names it in ``worker_imports`` so the fork server's preload is quiet too.
"""

from __future__ import annotations

import importlib.util

from titan_hydra.quiet import import_quietly, loggers_at_error

if importlib.util.find_spec("torchao") is not None:
    import_quietly("torchao")
with loggers_at_error("transformers"):
    import_quietly("transformers.modeling_utils")
