"""The calbins that served, held by content (found at stop 73).

A recovery reconfigures the calbin that served and a refused switch rolls back to the last
one that served; both loaded it again from its *path*. A calbin written over that path since
(a new file renamed over it, ``cp`` over it) was loaded instead: a refused reload of the same
path rolled back onto the refused file and the lifecycle ended Failed, and a recovery after a
deploy script replaced the file switched models behind the operator's back.

:class:`ServedFiles` keeps the newest calbins that reached Ready open (a file descriptor
each, at most :data:`HELD_MAX`) with the sha256 of what served. A restore (a recovery, a roll
back) loads the file held (``/proc/self/fd/N``: a file renamed over the path or removed
leaves the one held intact) and the generation is refused unless its sha256 is the one that
served (a file changed in place: ``calbin.changed``, saying what to do). An operator's reload
of the path loads the path as before: that is a new calbin.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import threading

log = logging.getLogger("calexec.executor")  # (the lifecycle's logger: docs/embedding.md)

#: how many calbins that served are held open (the newest; the older ones are restored from
#: their path, still checked against the sha256 that served)
HELD_MAX = 4

#: the code of a restore refused because the path no longer holds what served
CALBIN_CHANGED = "calbin.changed"
#: the code of a model switch refused before anything moved because the calbin it would roll
#: back to was written over in place since it served (``ServedFiles.changed``, stop 75)
ROLLBACK_CHANGED = "calbin.rollback_changed"


class ServedFiles:
    """Path -> (the file that served, held open; its sha256). Thread-safe; ``close`` once."""

    def __init__(self, held_max: int = HELD_MAX) -> None:
        self._mu = threading.Lock()
        self._held_max = held_max
        self._fds: dict[str, int] = {}  # newest last
        self._sha: dict[str, str] = {}
        #: the held file's (size, mtime, ctime) when its sha256 was last known to be the
        #: served one: a write in place changes its ctime (``changed`` hashes it only then)
        self._looks: dict[str, tuple[int, int, int]] = {}

    def served(self, path: str, sha256: str) -> None:
        """``path`` reached Ready with a calbin of ``sha256``: hold it open (kept as it is
        when the one held already served with this sha256 and was not written since: the
        path may hold another file by now; one written over in place holds nothing that
        served, the path's file is held instead: a switch to a new file renamed over it)."""
        with self._mu:
            held = self._fds.pop(path, None)
            if (held is not None and self._sha.get(path) == sha256
                    and _looks(os.fstat(held)) == self._looks.get(path)):
                self._fds[path] = held
                return
            if held is not None:
                os.close(held)
            self._sha[path] = sha256
            fd = _open_regular(path)
            if fd is not None:
                self._fds[path] = fd
                self._looks[path] = _looks(os.fstat(fd))
            while len(self._fds) > self._held_max:
                oldest = next(iter(self._fds))
                os.close(self._fds.pop(oldest))
                self._looks.pop(oldest, None)

    def changed(self, path: str) -> tuple[str, str] | None:
        """(the sha256 ``path`` served with, the sha256 of the file held now) when the file a
        restore of ``path`` would load (the one held open) no longer holds what served: it
        was written over in place (``cp new.calbin served.calbin``), and no copy of what
        served is left to restore. None when it still holds it, or when no file of ``path``
        is held (a restore then checks the path's sha256 as it loads it). The file is hashed
        only when its size, mtime or ctime moved since it served (any write moves its
        ctime): a model switch's check, not a read of every byte at each reload."""
        with self._mu:
            sha, fd = self._sha.get(path), self._fds.get(path)
            if sha is None or fd is None:
                return None
            try:
                looks = _looks(os.fstat(fd))
                if looks == self._looks.get(path):
                    return None
                now = _pread_sha256(fd)  # (pread: the held file's offset is not moved)
            except OSError:
                return None
            if now == sha:  # (the same bytes written again: still what served)
                self._looks[path] = looks
                return None
            return sha, now

    def source(self, path: str) -> tuple[str, str | None]:
        """(what to load to restore ``path``, the sha256 it served with or None): the file
        held, as ``/proc/self/fd/N``, when the path names another file now (renamed over,
        removed) and ``/proc`` shows it; else ``path`` itself."""
        with self._mu:
            sha = self._sha.get(path)
            fd = self._fds.get(path)
            if fd is None:
                return path, sha
            held = f"/proc/self/fd/{fd}"
            if not _replaced(path, fd) or not os.path.exists(held):
                return path, sha  # (the same file: the sha256 check still sees a rewrite)
            log.warning("calbin %r was replaced since it served: restoring the file that "
                        "served (held open)", path)
            return held, sha

    def held(self) -> tuple[str, ...]:
        """The paths held open, oldest first."""
        with self._mu:
            return tuple(self._fds)

    def close(self) -> None:
        with self._mu:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
            self._looks.clear()


def _open_regular(path: str) -> int | None:
    """An O_RDONLY descriptor of ``path`` if it is a regular file, else None (without
    waiting: a FIFO put at the path is not opened for a read that never ends)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except (OSError, ValueError):
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _pread_sha256(fd: int, piece: int = 1 << 20) -> str:
    digest, at = hashlib.sha256(), 0
    while True:
        chunk = os.pread(fd, piece, at)
        if not chunk:
            return digest.hexdigest()
        digest.update(chunk)
        at += len(chunk)


def _looks(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _replaced(path: str, fd: int) -> bool:
    try:
        now, held = os.stat(path), os.fstat(fd)
    except (OSError, ValueError):
        return True
    return (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino)
