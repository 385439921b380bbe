"""A seq-len schedule's training loader: one packed loader per stage's window length.

Each stage reads its own ``BatchLoader`` (windows of its seq_len over the same packed tokens,
the same data seed), so a micro-batch of a stage has one shape and every stage keeps the
packed loader's properties: the same global batches under every data-parallel layout, and a
position that is a number of samples. The state is every stage's position, so a resume on
either side of a stage boundary continues bit for bit.

Entering a stage whose loader has read nothing starts it at the tokens seen so far, in its own
windows: ceil(tokens_before / seq_len). Without shuffling that continues the token stream where
the previous stage stopped (no text read twice); with shuffling it is the same fraction of the
new stage's own shuffled order.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

from titan_hydra.data.loader import STATE_VERSION
from titan_hydra.errors import DataError


class StagedLoader:
    """``select(seq_len, tokens_before)`` before each step; ``next()`` serves that stage's batch."""

    kind = "staged"

    def __init__(self, make: Callable[[int], Any], seq_lens: Sequence[int]) -> None:
        self.loaders = {int(s): make(int(s)) for s in seq_lens}
        self.seq_len = int(seq_lens[0])

    def select(self, seq_len: int, tokens_before: int) -> None:
        loader = self.loaders[seq_len]
        if loader.consumed == 0 and tokens_before > 0:  # entering a stage this run has not read yet
            loader.consumed = -(-tokens_before // seq_len)
        self.seq_len = seq_len

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        return self.loaders[self.seq_len].next_batch()

    @property
    def consumed(self) -> int:
        return self.loaders[self.seq_len].consumed

    def state_dict(self) -> dict:
        return {"version": STATE_VERSION, "kind": self.kind, "rank_independent": True, "seq_len": self.seq_len,
                "stages": {str(s): loader.state_dict() for s, loader in self.loaders.items()}}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or sd.get("kind") != self.kind:
            raise DataError(f"the checkpoint's data loader state is {sd.get('kind') if isinstance(sd, dict) else sd!r}, "
                            "not a seq-len schedule's: resume with the training.seq_len_schedule it was saved with")
        stages = sorted(int(s) for s in sd["stages"])
        if stages != sorted(self.loaders):
            raise DataError(f"the checkpoint was saved with seq_len stages {stages}, now {sorted(self.loaders)}; "
                            "resume with the same training.seq_len_schedule")
        for s, loader in self.loaders.items():
            loader.load_state_dict(sd["stages"][str(s)])
        self.seq_len = int(sd["seq_len"])
