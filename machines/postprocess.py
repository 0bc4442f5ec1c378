"""Output checks and the direct BF16 -> FP32 logits conversion (spec §6.5, §10.1, S10, FI09, FI10).

The legacy path converted the whole BF16 vocab into a temporary FP32 vector and then copied
the needed slice (S10). Here only ``n`` elements starting at ``base`` are converted, straight
into the caller's FP32 destination: a BF16 value is the top half of an FP32, so the
conversion widens the ``uint16`` bits into a ``uint32`` view of the destination and shifts
them left by 16 in place. No numpy data buffer is allocated (counted by
``calexec bench logits``: ``allocation_count_per_call``); the constants are 0-d arrays
because a scalar operand costs a fresh 0-d array per call. Bounds use the overflow-safe form
``base <= size and n <= size - base``.

The finiteness check (FI10) reads the same slice: a BF16 value is NaN or Inf iff its eight
exponent bits are all ones (``x & 0x7F80 == 0x7F80``); it is computed into a scratch buffer
owned by the caller (one per buffer slot), again without allocating per token.
"""

from __future__ import annotations

import numpy as np


def _const(value: int, dtype: type) -> np.ndarray:
    """A read-only 0-d array: a ufunc given a Python or numpy scalar converts it to a fresh 0-d
    array (a numpy data allocation) on every call; given this, it allocates nothing."""
    array: np.ndarray = np.array(value, dtype=dtype)
    array.flags.writeable = False
    return array


_EXP_MASK = _const(0x7F80, np.uint16)
_SHIFT_16 = _const(16, np.uint32)


def logits_slice_ok(base: int, n: int, size: int) -> bool:
    """§10.1 bounds: the slice ``[base, base + n)`` lies inside ``size`` (no overflow)."""
    return 0 <= base <= size and 0 <= n <= size - base


def bf16_all_finite(src: np.ndarray, scratch: np.ndarray) -> bool:
    """True iff no element of the BF16 (``uint16``) array ``src`` is NaN or Inf.

    ``scratch`` is a ``uint16`` array at least as long as ``src`` (reused, never allocated here).
    """
    view = scratch[: src.shape[0]]
    np.bitwise_and(src, _EXP_MASK, out=view)
    return src.shape[0] == 0 or int(view.max()) != 0x7F80


def bf16_first_nonfinite(src: np.ndarray) -> int:
    """The index of the first NaN or Inf of the BF16 (``uint16``) array ``src``, or -1: what
    the fused native pass reports as ``first_nonfinite``, for the numpy path's message (a
    failed job's path: it allocates)."""
    found = np.flatnonzero((src & _EXP_MASK) == _EXP_MASK)
    return int(found[0]) if found.shape[0] else -1


def bf16_to_f32_into(src: np.ndarray, base: int, n: int, dst: np.ndarray) -> None:
    """Convert ``src[base:base+n]`` (BF16 bits as ``uint16``) into ``dst[:n]`` (``float32``).

    Raises ``ValueError`` naming the values when the slice is out of bounds or ``dst`` is too
    small or not float32/contiguous; callers validate first and treat this as a bug."""
    if not logits_slice_ok(base, n, src.shape[0]):
        raise ValueError(f"logits slice base={base} n={n} outside tensor of {src.shape[0]} elements")
    if dst.dtype != np.float32 or not dst.flags.c_contiguous or dst.shape[0] < n:
        raise ValueError(f"logits destination must be contiguous float32 with >= {n} elements, "
                         f"got dtype={dst.dtype} shape={dst.shape}")
    bits = dst[:n].view(np.uint32)
    np.copyto(bits, src[base:base + n], casting="safe")
    np.left_shift(bits, _SHIFT_16, out=bits)


def bf16_to_f32_legacy(src: np.ndarray, base: int, n: int, dst: np.ndarray) -> None:
    """The legacy path (S10), kept only as the benchmark baseline: convert the whole tensor
    into a temporary FP32 vector, then copy the slice."""
    full = src.astype(np.uint32) << 16
    dst[:n] = full.view(np.float32)[base:base + n]
