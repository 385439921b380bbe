"""A run whose planned memory cannot fit the machine it runs on is refused in one line before anything
is built (``planner/fit.py``): the planned peak, the machine's memory, the first thing to change, and
the key that goes on anyway. A dry run sizes any cluster from any machine and is never refused."""

from __future__ import annotations

import pytest

from titan_hydra.errors import ConfigError
from titan_hydra.planner import fit
from titan_hydra.validate import validate
from helpers import compose_cfg


def test_an_8b_model_on_this_host_is_refused_at_once(monkeypatch):
    monkeypatch.setattr(fit, "host_memory_gib", lambda: 24.0)
    with pytest.raises(ConfigError) as e:
        validate(compose_cfg(["model=llama3_8b", "training.steps=2"]))
    message = str(e.value)
    assert message.startswith("the planned peak, 121.6 GiB per rank x 1 rank(s) on this host, cannot fit this host's "
                              "24.0 GiB of RAM less the 17% headroom; train a smaller model"), message
    assert message.endswith("(or cluster.memory_check=false to go on anyway)") and "\n" not in message


def test_activations_name_the_batch_and_every_local_rank_counts(monkeypatch):
    cfg = ["training.local_batch_size=64", "training.seq_len=2048", "parallelism=fsdp", "cluster.nproc_per_node=2"]
    monkeypatch.setattr(fit, "host_memory_gib", lambda: 2.0)
    with pytest.raises(ConfigError, match=r"per rank x 2 rank\(s\) on this host.*lower training.local_batch_size or "
                                          r"training.seq_len, or set activation_checkpoint=full"):
        validate(compose_cfg(cfg))


def test_the_override_and_a_dry_run_go_on(monkeypatch):
    monkeypatch.setattr(fit, "host_memory_gib", lambda: 24.0)
    validate(compose_cfg(["model=llama3_8b", "training.steps=2", "cluster.memory_check=false"]))
    validate(compose_cfg(["model=llama3_8b", "training.steps=2", "dry_run=true"]))
    validate(compose_cfg([]))  # the debug model fits
