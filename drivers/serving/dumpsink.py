"""The controlled dump sink (spec S12): off unless configured, bounded, private by default.

The legacy code dumped to a path hard-coded under a user's home directory. Here:

* there is no default: a sink exists only when a directory is given explicitly;
* a directory under a home directory (``$HOME``, or the system's home and root-user home
  directories, see ``_home_roots``) is refused unless
  ``allow_home=True`` is passed explicitly;
* records are JSON lines appended to ``<dir>/calexec-dump-<pid>.jsonl``; once the file would
  exceed ``max_bytes`` further records are dropped and counted, never truncated mid-line (the
  file's size when the record is written: a file rotated away or emptied is written again);
* prompt and completion content (token ids and text) is written only with
  ``include_content=True``; otherwise a record holds counts, status, finish reason and timings;
* a record the file system refuses (the directory removed or read-only, ENOSPC, ...) is
  dropped and counted in ``errors``, never raised: the dump never breaks the request it
  describes. One warning line names the file and the errno when writes start failing (and
  again when the errno changes); a write that succeeds again ends the streak;
* the file is created ``0600`` (the umask may only take more away): it holds users' prompts
  with ``include_content``, and what was asked when and how long it took without; a record
  is appended only to a regular file (never through a symlink, never into a FIFO or a
  device at that name: refused as the file system's errors are, without waiting);
* the server hands records over with :meth:`DumpSink.submit`, which never touches the file:
  a writer thread of the sink's own appends them, in the order they were submitted, so a
  slow or stuck disk never holds the event loop. What waits for it is bounded
  (``max_pending_bytes``): past it a record is dropped and counted in ``overflowed`` (one
  warning line per streak). :meth:`DumpSink.flush` waits (bounded) until every record
  submitted is written or refused; :meth:`DumpSink.close` flushes, then ends the writer,
  counting in ``overflowed`` the records it could not write in its time.
"""

from __future__ import annotations

import collections
import errno
import json
import logging
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

#: Record keys that carry user content; removed unless the sink allows content.
CONTENT_KEYS = ("prompt", "prompt_token_ids", "text", "token_ids")
#: the dump file's permission bits when the sink creates it (less the umask)
FILE_MODE = 0o600
#: bytes of submitted records that may wait for the writer thread (a slow or stuck disk)
DEFAULT_MAX_PENDING_BYTES = 8 << 20

log = logging.getLogger("calexec.dump")


class DumpConfigError(ValueError):
    """The dump sink configuration is refused; the message names the field and value."""


def _home_roots() -> list[Path]:
    roots = [Path("/home"), Path("/root")]
    home = os.environ.get("HOME")
    if home and Path(home).resolve() != Path("/"):  # HOME=/ (a service account): no home
        roots.append(Path(home))
    return [r.resolve() for r in roots]


def under_home(path: Path) -> bool:
    """True when ``path`` (resolved) is a home directory or lies inside one."""
    resolved = path.resolve()
    return any(resolved == root or root in resolved.parents for root in _home_roots())


class DumpSink:
    """Append-only, size-capped JSON-lines sink. Thread-safe; :meth:`submit` appends on a
    writer thread of its own."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int,
                 include_content: bool = False, allow_home: bool = False,
                 max_pending_bytes: int = DEFAULT_MAX_PENDING_BYTES) -> None:
        if not str(directory):
            raise DumpConfigError("dump directory='': an explicit directory is required")
        path = Path(directory)
        if not path.is_absolute():
            raise DumpConfigError(f"dump directory={str(directory)!r}: must be an absolute path")
        if max_bytes <= 0:
            raise DumpConfigError(f"dump max_bytes={max_bytes}: must be > 0")
        if max_pending_bytes <= 0:
            raise DumpConfigError(f"dump max_pending_bytes={max_pending_bytes}: must be > 0")
        if under_home(path) and not allow_home:
            raise DumpConfigError(f"dump directory={str(directory)!r} is under a home directory; "
                                  "choose another directory (S12)")
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"calexec-dump-{os.getpid()}.jsonl"
        self.max_bytes = max_bytes
        self.include_content = include_content
        self.written_bytes = self.path.stat().st_size if self.path.exists() else 0
        self.records = 0
        self.dropped = 0
        #: records the file system refused (OSError on open or write), none of them raised
        self.errors = 0
        self._failing: int | None = None  # the errno of the current streak of failed writes
        self._mu = threading.Lock()
        self.max_pending_bytes = max_pending_bytes
        #: submitted records dropped because the writer was too far behind (``max_pending_
        #: bytes``), or still unwritten when :meth:`close` ran out of time
        self.overflowed = 0
        # the writer thread's queue (lines in submission order) and its state, under _cv
        self._cv = threading.Condition(threading.Lock())
        self._pending: collections.deque[bytes] = collections.deque()
        self._pending_bytes = 0
        self._writing = False  # the writer holds a line it took off the queue
        self._writer: threading.Thread | None = None
        self._closing = False
        self._behind = False  # a streak of overflowed records (warned once)

    def counts(self) -> dict[str, int]:
        """Records by outcome: ``written``, ``dropped`` (the size cap), ``error`` (the file
        system refused it), ``overflow`` (the writer too far behind; :meth:`submit`); the
        server's ``calexec_dump_records_total``."""
        with self._cv:
            return {"written": self.records, "dropped": self.dropped, "error": self.errors,
                    "overflow": self.overflowed}

    def _line(self, record: dict[str, Any]) -> bytes:
        if not self.include_content:
            record = {k: v for k, v in record.items() if k not in CONTENT_KEYS}
        return (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")

    def write(self, record: dict[str, Any]) -> bool:
        """Append one record now, on the calling thread (content keys removed unless
        allowed). False when dropped: by the size cap (``dropped``) or because the file
        system refused it (``errors``). A server calls :meth:`submit` instead."""
        return self._append(self._line(record))

    def submit(self, record: dict[str, Any]) -> bool:
        """Queue one record for the writer thread (started when needed), which appends it as
        :meth:`write` does, after every record submitted before it; nothing here waits for
        the file system. False when it is dropped at once, counted in ``overflowed``: the
        records waiting for the writer already hold ``max_pending_bytes`` (a slow or stuck
        disk; one warning line until a record is taken again)."""
        line = self._line(record)
        with self._cv:
            if self._pending and self._pending_bytes + len(line) > self.max_pending_bytes:
                self.overflowed += 1
                if not self._behind:
                    self._behind = True
                    log.warning("dump writer behind: %d records (%d bytes) wait for %s; "
                                "records are dropped and counted until it catches up",
                                len(self._pending), self._pending_bytes, self.path)
                return False
            self._behind = False
            self._pending.append(line)
            self._pending_bytes += len(line)
            self._closing = False
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_pending, daemon=True,
                                                name="calexec-dump-writer")
                self._writer.start()
            self._cv.notify_all()
        return True

    def _write_pending(self) -> None:
        """The writer thread: appends the queued lines in order until :meth:`close`."""
        while True:
            with self._cv:
                while not self._pending and not self._closing:
                    self._cv.wait()
                if not self._pending:  # closing, nothing left
                    self._writer = None
                    self._cv.notify_all()
                    return
                line = self._pending.popleft()
                self._pending_bytes -= len(line)
                self._writing = True
            try:
                self._append(line)
            except Exception:  # (never raises by design; a bug must not kill the writer)
                log.exception("dump writer: appending a record to %s", self.path)
            finally:
                with self._cv:
                    self._writing = False
                    self._cv.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds until every record submitted so far is written
        (or refused by the cap or the file system). True when none is left waiting."""
        end = time.monotonic() + timeout
        with self._cv:
            while self._pending or self._writing:
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """:meth:`flush` within ``timeout``, then end the writer thread (waiting for it to end
        within what is left of ``timeout``). Records still waiting then are given up: counted
        in ``overflowed``, one warning line names how many. True
        when every record was written (or refused) in time. A later :meth:`submit` starts a
        new writer. Called again with nothing submitted since (a drain closed it, then the
        app's shutdown), it does not wait again for a write the disk still holds."""
        with self._cv:
            if self._closing and not self._pending:
                return not self._writing
        end = time.monotonic() + timeout
        flushed = self.flush(timeout)
        with self._cv:
            lost = len(self._pending)
            if lost:
                self._pending.clear()
                self._pending_bytes = 0
                self.overflowed += lost
                log.warning("dump: %d records not written to %s within %gs (a slow or stuck "
                            "disk): dropped and counted", lost, self.path, timeout)
            self._closing = True
            self._cv.notify_all()
            writer = self._writer
        # the writer ends once it sees ``_closing`` with nothing queued: wait for that within
        # what is left of ``timeout`` (it returned with the thread still running, so a
        # shutdown's thread count, or the interpreter's exit, still found it); one held by a
        # stuck disk is left, a daemon, as the flush above was
        if writer is not None and writer is not threading.current_thread():
            writer.join(max(0.0, end - time.monotonic()))
        return flushed

    def _append(self, line: bytes) -> bool:
        """Append ``line`` to the file (``_mu``: one writer at a time); the counters are
        updated under ``_cv``'s lock alone, so a scrape (:meth:`counts`, on the event loop)
        never waits for a write the disk holds."""
        with self._mu:
            outcome, size = self._append_locked(line)
        with self._cv:
            if outcome == "written":
                self.records += 1
                self.written_bytes = size + len(line)
            elif outcome == "dropped":
                self.dropped += 1
                self.written_bytes = size
            else:
                self.errors += 1
        return outcome == "written"

    def _append_locked(self, line: bytes) -> tuple[str, int]:
        """(outcome, the file's size before the line) of one append: ``written``,
        ``dropped`` (the size cap) or ``error`` (the file system refused it; warned)."""
        try:
            # the file's own size, not a count of the bytes this sink wrote: a file rotated
            # away (renamed, or truncated in place by logrotate's copytruncate) is a new,
            # small file, and the cap counted the old one's bytes against it; made 0600 (S12:
            # the records are private), the umask applied; never through a symlink (a dump
            # directory others can write to, /tmp: one planted at the predictable name made
            # the prompts go wherever it pointed): ELOOP, counted and warned as any refusal
            # (the directory removed or read-only, ENOSPC: the errno named below); never
            # waiting in the open either (O_NONBLOCK; a FIFO with no reader: ENXIO), and only
            # into a regular file: a FIFO at that name (made there by someone else) held the
            # writer in its open for ever, every later record dropped as "writer behind",
            # or, read by whoever made it, was handed every record (until stop 71)
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
                         | os.O_NOFOLLOW | os.O_NONBLOCK, FILE_MODE)
            with open(fd, "ab") as f:
                info = os.fstat(f.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise OSError(errno.EINVAL, "not a regular file (mode "
                                  f"{stat.filemode(info.st_mode)}): records go only into a "
                                  "regular file")
                size = info.st_size
                if size + len(line) > self.max_bytes:
                    return "dropped", size
                try:
                    f.write(line)
                    f.flush()
                except OSError:
                    try:  # a part of the line may have reached the file (ENOSPC): cut it
                        f.truncate(size)  # off (this file's, wherever its name is)
                    except OSError:
                        pass
                    raise
        except OSError as err:
            if err.errno != self._failing:
                self._failing = err.errno
                name = errno.errorcode.get(err.errno or 0, str(err.errno))
                log.warning("dump record not written to %s: %s (errno %s %s); records are "
                            "dropped and counted until a write succeeds", self.path,
                            err.strerror or err, err.errno, name)
            return "error", 0
        self._failing = None
        return "written", size
