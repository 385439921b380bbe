"""Config schemas and helpers every layer reads.

A misspelled key (``training.stepz=5``) or a wrong type (``training.steps=abc``) fails while Hydra
composes, before any process starts: every option file under ``conf/<group>/`` extends its
group's schema (``defaults: [/schema_<group>@_here_, _self_]``) and the primary config extends
``schema_titan``.

Where a default lives: a group whose option builds an object (``_target_``), a model family
included, has its schema derived from that object's class (``titan_hydra.groups``, a layer above
the classes; it holds the group list, registers every schema and composes configs). This package
holds what builds nothing (the root, ``training``, ``cluster``: ``schemas``), the one derivation
(``derive``), Choice enums, run-dir naming and the precision helpers, and the settings a rank
later binds to its parts (``eval``, ``health``, ``fault_injection``, ``optimizer``): typed here,
below the ``RunSpec`` that carries them, and run by ``train/``.
"""

from titan_hydra.config.choice import Choice, choice
from titan_hydra.config.derive import schema_from
from titan_hydra.config.plain import plain, run_settings, to_container
from titan_hydra.config.precision import mixed_precision_of, precision_choice_of
from titan_hydra.config.run_dir import run_subdir
from titan_hydra.config.schemas import ClusterConfig, TrainingConfig, register_resolvers, root_schema

__all__ = ["Choice", "choice", "schema_from", "plain", "run_settings", "to_container", "mixed_precision_of",
           "precision_choice_of", "run_subdir", "ClusterConfig", "TrainingConfig", "register_resolvers", "root_schema"]
