"""A file replaced by a FIFO between a look at it and its use: the tests of a reload's check
and of the driver's load (stops 70, 71) put the FIFO in right after the code under test
looked at the file it opened (``os.fstat`` of its descriptor), so the swap lands exactly
between the look and any later open by path, never by luck of timing.
"""

from __future__ import annotations

import os

import pytest


def to_fifo(path: str) -> None:
    """Put a FIFO no one writes to where the file ``path`` was (an operator's script
    rewriting the file the reload names; ``mv`` of a named pipe over it)."""
    os.unlink(path)
    os.mkfifo(path)


def fifo_after_look(monkeypatch: pytest.MonkeyPatch, path: str) -> list[int]:
    """Patch ``os.fstat`` (undone by ``monkeypatch.undo()``): the first ``fstat`` of the file
    now at ``path`` (by its inode) answers as it would, then replaces ``path`` by a FIFO
    (:func:`to_fifo`). Answers the list the descriptor looked at is appended to: empty while
    nothing looked at the file it opened."""
    inode = os.stat(path).st_ino
    real_fstat = os.fstat
    swapped: list[int] = []

    def fstat_then_swap(fd, *args, **kwargs):
        result = real_fstat(fd, *args, **kwargs)
        if result.st_ino == inode and not swapped:  # the code under test looked at it
            swapped.append(fd)
            to_fifo(path)
        return result

    monkeypatch.setattr(os, "fstat", fstat_then_swap)
    return swapped
