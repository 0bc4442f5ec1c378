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
  again when the errno changes); a write that succeeds again ends the streak.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

#: Record keys that carry user content; removed unless the sink allows content.
CONTENT_KEYS = ("prompt", "prompt_token_ids", "text", "token_ids")

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
    """Append-only, size-capped JSON-lines sink. Thread-safe."""

    def __init__(self, directory: str | os.PathLike[str], max_bytes: int,
                 include_content: bool = False, allow_home: bool = False) -> None:
        if not str(directory):
            raise DumpConfigError("dump directory='': an explicit directory is required")
        path = Path(directory)
        if not path.is_absolute():
            raise DumpConfigError(f"dump directory={str(directory)!r}: must be an absolute path")
        if max_bytes <= 0:
            raise DumpConfigError(f"dump max_bytes={max_bytes}: must be > 0")
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

    def counts(self) -> dict[str, int]:
        """Records by outcome: ``written``, ``dropped`` (the size cap), ``error`` (the file
        system refused it); the server's ``calexec_dump_records_total``."""
        with self._mu:
            return {"written": self.records, "dropped": self.dropped, "error": self.errors}

    def write(self, record: dict[str, Any]) -> bool:
        """Append one record (content keys removed unless allowed). False when dropped: by
        the size cap (``dropped``) or because the file system refused it (``errors``)."""
        if not self.include_content:
            record = {k: v for k, v in record.items() if k not in CONTENT_KEYS}
        line = (json.dumps(record, sort_keys=True, separators=(",", ":")) + "\n").encode("utf-8")
        with self._mu:
            try:
                # the file's own size, not a count of the bytes this sink wrote: a file
                # rotated away (renamed, or truncated in place by logrotate's copytruncate)
                # is a new, small file, and the cap counted the old one's bytes against it
                with open(self.path, "ab") as f:
                    size = os.fstat(f.fileno()).st_size
                    if size + len(line) > self.max_bytes:
                        self.written_bytes = size
                        self.dropped += 1
                        return False
                    try:
                        f.write(line)
                        f.flush()
                    except OSError:
                        try:  # a part of the line may have reached the file (ENOSPC): cut
                            f.truncate(size)  # it off (this file's, wherever its name is)
                        except OSError:
                            pass
                        raise
            except OSError as err:
                self.errors += 1
                if err.errno != self._failing:
                    self._failing = err.errno
                    name = errno.errorcode.get(err.errno or 0, str(err.errno))
                    log.warning("dump record not written to %s: %s (errno %s %s); records are "
                                "dropped and counted until a write succeeds", self.path,
                                err.strerror or err, err.errno, name)
                return False
            self._failing = None
            self.written_bytes = size + len(line)
            self.records += 1
        return True
