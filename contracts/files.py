"""The process's file-creation mask, read without changing it; a file replaced whole; a
TOML file read as an editor saves it.

``os.umask`` can only be read by setting it: a thread that creates a file between the set and
the restore creates it under the wrong mask (with ``os.umask(0)``: world-writable). Every
reader of the umask in calexec goes through :func:`process_umask`, which reads it from
``/proc/self/status`` where Linux shows it.
"""

from __future__ import annotations

import os
import stat
import tempfile
import tomllib


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


def write_whole(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that it holds the old content or the new, never a part: a
    regular file (or none yet) is replaced by a scratch file beside it once that is whole,
    keeping the old file's mode (a new one gets ``open()``'s); anything else there (a pipe,
    ``/dev/stdout``, a device) is written to as it is. OSError as ``open``/``write`` raise it."""
    try:
        mode: int | None = os.stat(path).st_mode  # (through a symlink: what it points to)
    except FileNotFoundError:
        mode = None
    if not path or (mode is not None and not stat.S_ISREG(mode)):
        with open(path, "wb") as out:
            out.write(data)
        return
    target = os.path.realpath(path)  # (a symlink stays; the file it points to is replaced)
    fd, scratch = tempfile.mkstemp(prefix=f".{os.path.basename(target)}.",
                                   dir=os.path.dirname(target))
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        os.chmod(scratch, new_file_mode() if mode is None else stat.S_IMODE(mode))
        os.replace(scratch, target)
    except BaseException:
        os.unlink(scratch)
        raise


class TomlTooDeep(tomllib.TOMLDecodeError):
    """A TOML document nested past the parser's recursion (``tomllib`` raises RecursionError
    on ``x = [[[[...]]]]`` some thousand levels deep): a ``TOMLDecodeError``, as every other
    document the parser does not read (until stop 73 the RecursionError came out of a
    reload's re-read of the goldens file, a 500, and out of ``load_manifest``)."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)  # (not TOMLDecodeError's: no document position)


def read_toml(path: str | os.PathLike[str]) -> dict[str, object]:
    """The TOML document in file ``path``, a leading UTF-8 byte order mark (an editor's, as
    Notepad saves) not part of it: ``tomllib`` refused such a file as ``Invalid statement (at
    line 1, column 1)``. Raises ``OSError``, ``UnicodeDecodeError`` (its ``start`` the byte
    of the file, the mark counted) and ``tomllib.TOMLDecodeError``, as ``tomllib.load``
    (:class:`TomlTooDeep` for a document nested past the parser's recursion)."""
    with open(path, "rb") as fh:
        text = fh.read().decode("utf-8")
    try:
        return tomllib.loads(text.removeprefix("\ufeff"))
    except RecursionError:
        raise TomlTooDeep("nested deeper than the TOML parser reads (Python's recursion "
                          "limit)") from None
