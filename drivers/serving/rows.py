"""The server's FP32 logits rows, reused across requests (issue 28: the server's share).

Every request hands the executor a row of ``vocab_size`` FP32 logits (``RequestRun.logits``,
151,936 x 4 bytes, 594 KiB, for Qwen3), which the completion thread writes each job's result
into. Allocated afresh per request, with glibc's mmap threshold pinned at 128 KiB
(``drivers/memory.py``, the serving process's memory policy), every row was a fresh mapping:
148 page faults taken by the completion thread on its first write, and an ``munmap`` when the
request ended, per request (measured with ``calexec bench server``'s CPU per thread role:
docs/benchmarks.md, stop 55). The direct side of that benchmark, like any embedder following
the executor's API advice, reuses one row per sequence.

A row goes back to the pool only on proof that nothing can read or write it any more: the
pool hands out an array over a lease object made for that one take, and the lease's
finalizer returns the memory when the last array over it is gone. Every view of the row (the
job's ``logits_out`` the completion thread writes through, a result's ``logits`` slice, a
deferred conversion's destination) keeps the lease alive, so a job still on the device for an
abandoned request keeps its row out of the pool until the job lets go of it. Free rows are
bounded (``max_free``; beyond it a returned row is dropped) and all of one size: a take of
another size (a model switch to another vocabulary) drops the free rows of the old one.
"""

from __future__ import annotations

import ctypes
import threading
import weakref

import numpy as np


class RowPool:
    """FP32 rows of one size, reused once no array over them is left (module docstring).
    Thread-safe: rows are taken on the event loop and may come back on any thread (whichever
    drops the last reference: the completion thread, a worker, the loop)."""

    def __init__(self, max_free: int) -> None:
        if max_free < 0:
            raise ValueError(f"max_free={max_free}: must be >= 0")
        self.max_free = max_free
        # reentrant: should a garbage collection run inside a locked section (they allocate
        # nothing the collector tracks), a lease it frees gives its row back on this thread
        self._mu = threading.RLock()
        self._free: list[bytearray] = []
        self._count = 0  # the size (elements) of the free rows
        self._lent = 0
        self._created = 0

    def take(self, count: int) -> np.ndarray:
        """A writable FP32 array of ``count`` elements (contents undefined, as
        ``np.empty``), a free row's memory when there is one of that size."""
        if count < 1:
            raise ValueError(f"count={count}: must be >= 1")
        with self._mu:
            if count != self._count:  # another vocabulary: the old size's rows are dropped
                self._free.clear()
                self._count = count
            memory = self._free.pop() if self._free else None
            self._lent += 1
            if memory is None:
                self._created += 1
        if memory is None:
            memory = bytearray(count * 4)
        lease = (ctypes.c_float * count).from_buffer(memory)
        weakref.finalize(lease, self._give_back, count, memory).atexit = False
        # over a byte view of the lease: the array keeps the view, the view the lease
        return np.frombuffer(memoryview(lease).cast("B"), dtype=np.float32)

    def _give_back(self, count: int, memory: bytearray) -> None:
        """The lease of ``memory`` died (no array over it is left): free it for a next take."""
        with self._mu:
            self._lent -= 1
            if count == self._count and len(self._free) < self.max_free:
                self._free.append(memory)

    def counts(self) -> dict[str, int]:
        """``{"lent", "free", "created"}``: rows out now (an array over them is alive), rows
        waiting for a take, rows ever allocated."""
        with self._mu:
            lent, free, created = self._lent, len(self._free), self._created
        return {"lent": lent, "free": free, "created": created}
