"""A file replaced by a FIFO while the code under test holds its path: what the tests of a
reload's check and of the driver's load (stops 70, 71) share."""

from __future__ import annotations

import os


def to_fifo(path: str) -> None:
    """Put a FIFO no one writes to where the file ``path`` was (an operator's script
    rewriting the file the reload names; ``mv`` of a named pipe over it)."""
    os.unlink(path)
    os.mkfifo(path)
