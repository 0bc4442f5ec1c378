"""CalRT 0.7.6 return codes (spec §8) and device job statuses, as the C ABI numbers them.

The numbers are the runtime's ABI: a driver passes them through unchanged and
``calexec.contracts.errors.classify`` maps them to a category and actions. Numbers the
runtime does not define (3, 6, 26, > 29, negative) have no member here; use
:func:`describe` to print any raw code.
"""

from __future__ import annotations

import enum


class CalrtCode(enum.IntEnum):
    """Return code of a CalRT call; 0 is success, everything else a failure (spec §8)."""

    SUCCESS = 0
    MEM_ALLOC = 1
    ALREADY_REGISTERED = 2
    INVALID_VALUE = 4
    INVALID_CONFIG = 5
    ALREADY_CONFIGURED = 7
    DRIVER_INCOMPATIBLE = 8
    RUNTIME_TOO_OLD = 9
    FILE_NOT_FOUND = 10
    FILE_READ = 11
    FILE_FORMAT = 12
    TIMEOUT = 13
    OUT_OF_BOUNDS = 14
    UNEXPECTED = 15
    MISSING_CONFIG = 16
    DEVICE_BUSY = 17
    DEVICE_UNAVAILABLE = 18
    INVALID_CALBIN = 19
    UNKNOWN = 20
    DTYPE_MISMATCH = 21
    SHAPE_MISMATCH = 22
    DEPENDENCY = 23
    MAP_BROKEN = 24
    SOFT_RESET_FAILED = 25
    UNSUPPORTED = 27
    DEVICE_CRASH = 28
    WRONG_DIRECTION = 29


class DeviceJobStatus(enum.IntEnum):
    """``OutputBuf::GetStatus()`` after ``Wait()``: only DONE means the output may be read.

    DONE_CCU_EXCEPTION is a device failure even when ``Wait()`` returned SUCCESS (FI08).
    """

    IDLE = 0
    PENDING = 1
    RUNNING = 2
    DONE = 3
    DONE_CCU_EXCEPTION = 4
    ABORTED = 5  # discarded by a reset before it finished (output not written)


def describe(raw_code: int) -> str:
    """``"13 (TIMEOUT)"`` for a known code, ``"26 (not a CalRT 0.7.6 code)"`` otherwise."""
    try:
        return f"{raw_code} ({CalrtCode(raw_code).name})"
    except ValueError:
        return f"{raw_code} (not a CalRT 0.7.6 code)"
