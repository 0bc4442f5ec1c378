"""The fused native logits postprocess (spec §10.1, S10, FI10), over ``_calexec_native``.

``FusedLogits`` wraps ``calexec_bf16_logits`` (drivers/native/calexec_native.h): for the slice
``src[base:base+n]`` of a BF16 tensor (``uint16`` bits) it converts to FP32 straight into the
caller's ``dst``, checks finiteness, and finds the argmax (np.argmax's rule), the maximum and,
with ``with_sumexp``, the sum of ``exp(x - max)``, in one pass over the bytes, with the GIL
released. It is bit-identical to ``bf16_to_f32_into`` + ``bf16_all_finite`` + ``np.argmax``
(tested), with one difference on failure: a NaN/Inf is found while converting, so ``dst[:n]``
may then be partly written (the numpy path checked first and left it untouched); a failed
job's row is not a result.

The executor gets one through the runtime (``CalRT.logits_postprocessor()``): machines/
imports no cffi. Errors are values: the call returns a ``calexec_logits_rc`` code (``OK``,
``EBOUNDS`` when ``base <= size and n <= size - base`` fails, ``EDST`` when ``dst`` is too
short, ``NONFINITE`` with ``first_nonfinite`` set); only Python-side misuse (wrong dtype, not
contiguous, not a numpy array) raises ``ValueError`` naming the argument, as in runtime.py.

Allocation: ``ffi.from_buffer`` allocates a cdata object per call, so the pointer of each array
is cached, holding the array, for the last ``CACHE_ARRAYS`` sources and destinations (round
robin). A call with cached arrays allocates nothing; reading ``argmax`` makes one int. The
out-parameters are per thread, so one object may be shared by threads.
"""

from __future__ import annotations

import threading

import numpy as np

from calexec.drivers.native._calexec_native import ffi as _ffi
from calexec.drivers.native._calexec_native import lib as _lib

OK = _lib.CALEXEC_LOGITS_OK
EBOUNDS = _lib.CALEXEC_LOGITS_EBOUNDS
EDST = _lib.CALEXEC_LOGITS_EDST
NONFINITE = _lib.CALEXEC_LOGITS_NONFINITE
ENULL = _lib.CALEXEC_LOGITS_ENULL
EFLAGS = _lib.CALEXEC_LOGITS_EFLAGS
SUMEXP = _lib.CALEXEC_LOGITS_SUMEXP
NOSTORE = _lib.CALEXEC_LOGITS_NOSTORE

RC_NAMES = {OK: "ok", EBOUNDS: "slice out of bounds", EDST: "destination too short",
            NONFINITE: "NaN/Inf in the slice", ENULL: "null pointer",
            EFLAGS: "flags that do not go together"}

#: arrays whose pointer is kept per role (sources: the slots' output arrays, 2 per task kind by
#: default; destinations: the callers' rows). A kept array stays alive until replaced.
CACHE_ARRAYS = 8
_U16 = np.dtype(np.uint16)
_F32 = np.dtype(np.float32)


class FusedLogits:
    """``calexec_bf16_logits`` with cached pointers and per-thread out-parameters."""

    # the rc values, for callers that import no cffi module (machines/)
    OK, EBOUNDS, EDST, NONFINITE, ENULL, EFLAGS = OK, EBOUNDS, EDST, NONFINITE, ENULL, EFLAGS
    RC_NAMES = RC_NAMES

    __slots__ = ("_src", "_dst", "_next", "_local")

    def __init__(self) -> None:
        # per role, CACHE_ARRAYS entries (array, cdata pointer, element count) or None
        self._src: list = [None] * CACHE_ARRAYS
        self._dst: list = [None] * CACHE_ARRAYS
        self._next = [0, 0]  # round-robin replacement index per role
        self._local = threading.local()

    def _ptr(self, cache: list, arr: np.ndarray, dtype: np.dtype, what: str) -> tuple:
        """The cached ``(array, cdata pointer, element count)`` of ``arr``. A hit allocates
        nothing (``is`` comparisons over a short list: an ``id()`` key would allocate an int)."""
        i = 0
        while i < CACHE_ARRAYS:
            entry = cache[i]
            if entry is not None and entry[0] is arr:
                if arr.dtype is dtype:
                    return entry
                cache[i] = None  # its dtype was reassigned since: check and map it again
                break
            i += 1
        if not isinstance(arr, np.ndarray):
            raise ValueError(f"{what}: expected a numpy array, got {type(arr).__name__}")
        writable = what == "dst"
        if arr.dtype != dtype or not arr.flags.c_contiguous or (writable and not arr.flags.writeable):
            raise ValueError(f"{what}: must be a C-contiguous{' writeable' if writable else ''} "
                             f"{dtype} array, got dtype={arr.dtype} shape={arr.shape} "
                             f"c_contiguous={arr.flags.c_contiguous} "
                             f"writeable={arr.flags.writeable}")
        ctype = "uint16_t[]" if dtype is _U16 else "float[]"
        entry = (arr, _ffi.from_buffer(ctype, arr, require_writable=writable), arr.size)
        role = 0 if cache is self._src else 1
        slot = self._next[role]
        self._next[role] = (slot + 1) % CACHE_ARRAYS
        cache[slot] = entry
        return entry

    def _stats(self):
        try:
            return self._local.stats
        except AttributeError:
            self._local.stats = _ffi.new("calexec_logits_stats *")
            return self._local.stats

    def __call__(self, src: np.ndarray, base: int, n: int, dst: np.ndarray) -> int:
        """Convert ``src[base:base+n]`` into ``dst[:n]``, check finiteness, find the argmax
        and the maximum; returns the rc (``OK`` ...). ``argmax``/``max``/``first_nonfinite``
        then read this thread's results. ``base``/``n`` below 0 are refused as ``EBOUNDS``.
        (Four arguments: a fifth would cost CPython a heap block per call.)"""
        stats = self._stats()
        if base < 0 or n < 0:
            stats.argmax = stats.first_nonfinite = -1
            return EBOUNDS
        s = self._ptr(self._src, src, _U16, "src")
        d = self._ptr(self._dst, dst, _F32, "dst")
        return _lib.calexec_bf16_logits(s[1], s[2], base, n, d[1], d[2], 0, stats)

    def check(self, src: np.ndarray, base: int, n: int, dst: np.ndarray) -> int:
        """``__call__`` without writing ``dst`` (its arguments are checked all the same): the
        finiteness check, ``argmax`` and ``max`` alone, reading only the BF16 bytes (about half
        the time of the conversion on a row not in cache). Greedy ahead fires its next step
        with this argmax; the conversion (``__call__`` on the same arguments, which answers the
        same) follows, off the critical path, before the caller is woken."""
        stats = self._stats()
        if base < 0 or n < 0:
            stats.argmax = stats.first_nonfinite = -1
            return EBOUNDS
        s = self._ptr(self._src, src, _U16, "src")
        d = self._ptr(self._dst, dst, _F32, "dst")
        return _lib.calexec_bf16_logits(s[1], s[2], base, n, d[1], d[2], NOSTORE, stats)

    def with_sumexp(self, src: np.ndarray, base: int, n: int, dst: np.ndarray) -> int:
        """``__call__`` plus the sum of ``exp(x - max)`` over the slice (``sumexp``), what
        sampling and logprobs need (about 50 us more per 152k-entry row on AVX2)."""
        stats = self._stats()
        if base < 0 or n < 0:
            stats.argmax = stats.first_nonfinite = -1
            return EBOUNDS
        s = self._ptr(self._src, src, _U16, "src")
        d = self._ptr(self._dst, dst, _F32, "dst")
        return _lib.calexec_bf16_logits(s[1], s[2], base, n, d[1], d[2], SUMEXP, stats)

    @property
    def argmax(self) -> int:
        """Index within the slice of the first maximum (-1 when the call failed or n == 0)."""
        return self._local.stats.argmax

    @property
    def max(self) -> float:
        return self._local.stats.max

    @property
    def sumexp(self) -> float:
        """Sum of exp(x - max) over the slice (0.0 unless the call was ``with_sumexp``)."""
        return self._local.stats.sumexp

    @property
    def first_nonfinite(self) -> int:
        """Index within the slice of the first NaN/Inf (-1 unless the rc was ``NONFINITE``)."""
        return self._local.stats.first_nonfinite
