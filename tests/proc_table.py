"""The process table as the tests that look for leftover processes read it (from /proc: no
pgrep or psutil needed)."""

from __future__ import annotations

import os
from collections.abc import Iterator


def stat_rows() -> Iterator[tuple[int, str, int, int]]:
    """``(pid, state, parent pid, process group)`` of every process now (one that ended while
    read is left out)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # (ended meanwhile)
                continue
            yield int(entry), fields[0], int(fields[1]), int(fields[2])
