"""Process memory policy for long-running embeddings (server, acceptance soak).

glibc raises its mmap threshold dynamically after the first large block is freed; from then
on large arrays (per-job logits, a rebuilt generation's host buffers and device memory) come
from per-thread arenas and are kept by the allocator after they are freed. Measured here: 40
recoveries in a row took RSS from 77 MiB to a plateau of 334 MiB with only the current and
four retired generations alive; with the threshold pinned at its initial 128 KiB RSS stayed at
77 MiB. Nothing leaks either way, but a soak that watches RSS cannot tell that apart from a
leak, and a server pays the plateau for nothing. ``pin_mmap_threshold`` pins it (process-wide,
so only a process's entry point calls it: ``calexec serve`` and ``calexec accept`` do; the
library never does). Setting ``MALLOC_MMAP_THRESHOLD_=131072`` in the environment is the same.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
DEFAULT_THRESHOLD = 128 << 10


def pin_mmap_threshold(threshold: int = DEFAULT_THRESHOLD) -> bool:
    """Pin glibc's mmap threshold; False where the C library is not glibc (nothing done)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        return bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError):
        return False


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
