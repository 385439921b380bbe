"""Bytes alive on one simulated rank, op by op: what a device's allocator would hold.

A dispatch mode that sees every aten op's outputs and counts each new storage once, until the
storage is freed (a weak reference's finalizer). Wrapper subclasses (DTensor, FSDP's views) are
skipped: their local tensors are dispatched too and are what occupies memory; counting both would
count a sharded tensor at its global size. Fake tensors have storages with sizes and no data, so
a 405B model on 512 ranks is counted without allocating it.

Each storage is counted under the phase it was made in (``forward``, ``backward``, ``optimizer``;
``static`` for what existed before: parameters, buffers, optimizer state of earlier steps), and
storages resized in place (FSDP2's unsharded parameters) are counted at their new size and
under the phase of the resize; the peak keeps the per-phase split of that moment: ``forward`` at the peak is what the forward
pass left for backward (saved activations and the unsharded parameters FSDP keeps), ``backward``
is gradients and backward's temporaries.

Why not torch's ``MemTracker`` / ``FSDPMemTracker``: under a dispatch mode the DTensor-level op
arrives before its local op, and torch 2.13's trackers count both (measured: the AdamW state of a
64 x 8 layout counted at twice its unsharded size).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

PHASES = ("static", "forward", "backward", "optimizer")


@dataclass
class Peak:
    """The largest total seen, with its split by phase."""

    total: int = 0
    by_phase: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of live storages created by ops run under it (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = dict.fromkeys(PHASES, 0)
        self.phase = "forward"
        self.peak = Peak()
        self.phase_peaks = dict.fromkeys(PHASES, 0)  # each phase's own largest live bytes
        self._seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # storage -> key
        self._phase_of: dict[int, str] = {}
        self._bytes_of: dict[int, int] = {}
        self._next_key = 0
        self._propagating = 0  # inside DTensor's sharding propagation (``__enter__``)

    # --- what is alive ------------------------------------------------------------
    @property
    def total(self) -> int:
        return sum(self.live.values())

    def adopt(self, tensors) -> None:
        """Count tensors that exist already (parameters, buffers) as ``static``."""
        for t in tensors:
            self._count(t, "static")

    def reset_peak(self) -> None:
        self.peak = Peak(self.total, dict(self.live))
        self.phase_peaks = dict(self.live)

    def _count(self, t: torch.Tensor, phase: str) -> None:
        if is_traceable_wrapper_subclass(t):
            attrs, _ = t.__tensor_flatten__()
            for a in attrs:
                inner = getattr(t, a)
                if isinstance(inner, torch.Tensor):
                    self._count(inner, phase)
            return
        st = t.untyped_storage()
        if st in self._seen:
            return
        key = self._next_key = self._next_key + 1
        n = st.nbytes()
        self._seen[st] = key
        self._phase_of[key], self._bytes_of[key] = phase, n
        self.live[phase] += n
        weakref.finalize(st, self._free, key)
        self._note_peak(phase)

    def _free(self, key: int) -> None:
        self.live[self._phase_of.pop(key)] -= self._bytes_of.pop(key)

    def _resized(self, st: torch.UntypedStorage) -> None:
        """FSDP2 frees and re-allocates unsharded parameters by resizing their storage in place
        (``resize_(0)`` / ``resize_(n)``), which no dispatch mode sees."""
        key = self._seen.get(st)
        if key is None:
            return
        n = st.nbytes()
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase  # noqa: SLF001
        self.live[self._phase_of[key]] -= self._bytes_of[key]
        self._phase_of[key], self._bytes_of[key] = phase, n
        self.live[phase] += n
        self._note_peak(phase)

    def _note_peak(self, phase: str) -> None:
        total = self.total
        if total > self.peak.total:
            self.peak = Peak(total, dict(self.live))
        if self.live[phase] > self.phase_peaks[phase]:
            self.phase_peaks[phase] = self.live[phase]

    def __enter__(self):
        original = self._original_resize = torch.UntypedStorage.resize_

        def resize_(st: torch.UntypedStorage, size: int):
            out = original(st, size)
            self._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        # DTensor's sharding propagation runs an op it has not seen before on fake tensors of the
        # GLOBAL shape to learn its output's shape (a full-vocabulary logits tensor under TP:
        # 3.9 GiB for llama3_8b at 8192 tokens); those are metadata, not memory.
        propagate = self._original_propagate = ShardingPropagator._propagate_tensor_meta_non_cached

        def propagate_quietly(propagator, op_schema):
            self._propagating += 1
            try:
                return propagate(propagator, op_schema)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_quietly
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._original_resize
        ShardingPropagator._propagate_tensor_meta_non_cached = self._original_propagate
        return super().__exit__(*exc)

    def settle(self, phase: str = "static") -> None:
        """What is alive now becomes ``phase`` (after a step: the optimizer state it made stays)."""
        for key, old in self._phase_of.items():
            if old != phase:
                n = self._bytes_of[key]
                self.live[old] -= n
                self.live[phase] += n
                self._phase_of[key] = phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:  # DTensor deriving an output's global shape on fake tensors: no memory
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # DTensor's dispatch first: its local ops, the temporaries inside the op included
            # (a redistribution's buffer, loss parallel's log-softmax, context parallel's
            # gathered keys and values), then come back here one by one.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        # inside the autograd engine (a graph task running) everything made is backward's
        phase = "backward" if torch._C._current_graph_task_id() != -1 else self.phase  # noqa: SLF001
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._count(t, phase)
        return out
