"""The process's file-creation mask, read without changing it.

``os.umask`` can only be read by setting it: a thread that creates a file between the set and
the restore creates it under the wrong mask (with ``os.umask(0)``: world-writable). Every
reader of the umask in calexec goes through :func:`process_umask`, which reads it from
``/proc/self/status`` where Linux shows it.
"""

from __future__ import annotations

import os


def process_umask() -> int:
    """The process's umask: read from ``/proc/self/status`` where Linux shows it; elsewhere by
    setting it (to the strictest mask, 0o077, meanwhile: never none) and back."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    umask = os.umask(0o077)
    os.umask(umask)
    return umask


def new_file_mode() -> int:
    """The permission bits ``open()`` gives a new file now: 0o666 less the umask."""
    return 0o666 & ~process_umask()
