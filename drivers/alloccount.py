"""How many allocations a piece of code makes (§13.3: "allocation count", not only bytes).

``count(fn, calls)`` runs ``fn`` ``calls`` times with the counting hooks of the compiled
``calexec.drivers._alloccount`` module installed (see drivers/alloccount_build.py) and returns
the allocations per call:

- ``python``: calls into Python's allocators (RAW, MEM and OBJ domains): object headers (an
  array view is one), array shape/stride blocks, lists, ints;
- ``numpy_data``: numpy data buffers (NEP 49 handler): a temporary array is one.

Frees are not counted. The numpy count covers the calling thread only (numpy's handler is per
context); the Python count covers every thread (an executor's own threads' work is part of a
token's cost), or with ``every_thread=False`` the calling thread only: a function measured
alone, whose count another thread of the process (a test suite's, a server's) must not move.
The hooks are removed afterwards.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

# compiled at install time (setup.py cffi_modules)
from calexec.drivers._alloccount import lib as _lib


@attrs.frozen
class AllocCount:
    """Allocations per call of one measured function."""

    python: float
    numpy_data: float
    calls: int

    def as_dict(self) -> dict[str, float]:
        return {"python": self.python, "numpy_data": self.numpy_data}


class AllocCounterError(RuntimeError):
    """The counting hooks could not be installed (the reason is numpy's or Python's)."""


def count(fn: Callable[[], object], calls: int, warmup: int = 1, *,
          every_thread: bool = True) -> AllocCount:
    """Allocations per call of ``fn`` over ``calls`` calls, after ``warmup`` uncounted calls
    (first-call effects such as caches are not a per-token cost); Python's on every thread or,
    ``every_thread=False``, on the calling thread only (module doc)."""
    if calls < 1:
        raise ValueError(f"calls={calls}: must be >= 1")
    for _ in range(warmup):
        fn()
    rc = _lib.alloccount_install(0 if every_thread else 1)
    if rc == 1:
        raise AllocCounterError("allocation counter is already installed (nested count())")
    if rc != 0:
        raise AllocCounterError("could not install the allocation counter "
                                "(numpy's C API or data-memory handler unavailable)")
    try:
        py0, np0 = _lib.alloccount_python(), _lib.alloccount_numpy()
        for _ in range(calls):
            fn()
        py1, np1 = _lib.alloccount_python(), _lib.alloccount_numpy()
    finally:
        _lib.alloccount_uninstall()
    return AllocCount(python=(py1 - py0) / calls, numpy_data=(np1 - np0) / calls, calls=calls)


def installed() -> bool:
    """Whether the counting hooks are installed now (only inside ``count``)."""
    return bool(_lib.alloccount_installed())
