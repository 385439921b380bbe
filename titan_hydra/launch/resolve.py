"""The run's spec, built once per process, with what the composed config leaves open resolved:
``parallelism=auto``.

The planner picks the layout from the run's spec (``planner/auto.py``; with
``parallelism.auto_verify=simulate`` the simulator checks its best candidates first,
``launch/verify_layout.py``); the spec continues on the
chosen dims (its logged config records them), and the degrees are also written into the config
with the name ``auto:<degrees>``: the config a SLURM submission hands its tasks then names a
concrete layout, and a second call (a task re-entering ``launch``) resolves nothing.
"""

from __future__ import annotations

import dataclasses

from omegaconf import DictConfig, OmegaConf, open_dict

from titan_hydra.launch.verify_layout import verified_layout
from titan_hydra.planner.auto import Candidate, candidate_spec, candidates, choose_layout, show_candidates
from titan_hydra.spec import RunSpec, spec_of


def resolved_spec(cfg: DictConfig) -> RunSpec:
    """``spec_of(cfg)``, under ``parallelism=auto`` on the planner's layout (the config updated in
    place); other layouts as composed."""
    spec = spec_of(cfg)
    if OmegaConf.select(cfg, "parallelism.name") != "auto":
        return spec
    cands = candidates(spec)
    if spec.dims.auto_verify == "simulate":  # the simulator judges the fit, not the closed form
        show_candidates(spec, cands)
        chosen = verified_layout(spec, cands)
    else:
        chosen = choose_layout(spec, cands)
    set_degrees(cfg, chosen)
    on_layout = candidate_spec(spec, chosen)
    resolved = dict(on_layout.resolved)
    resolved["parallelism"] = {**resolved["parallelism"], **layout_settings(chosen)}
    resolved["training"] = {**resolved["training"], **batch_settings(chosen)}
    return dataclasses.replace(on_layout, resolved=resolved)


def layout_settings(c: Candidate) -> dict:
    """The ``parallelism`` keys a chosen layout sets."""
    return {**c.degrees(), "pp_microbatches": c.pp_microbatches, "name": "auto:" + c.describe(",")}


def batch_settings(c: Candidate) -> dict:
    """The ``training`` keys a chosen layout sets: the local batch auto raised to feed a pipeline."""
    return {"local_batch_size": c.local_batch} if c.local_batch else {}


def set_degrees(cfg: DictConfig, c: Candidate) -> None:
    with open_dict(cfg):
        for k, v in layout_settings(c).items():
            cfg.parallelism[k] = v
        for k, v in batch_settings(c).items():
            cfg.training[k] = v
