"""Stop 63 (core audit): the concurrency rules in library code, one test per defect found.

Every thread has a join path at shutdown; every wait is bounded by a deadline it was given.
"""

from __future__ import annotations

import threading

from calexec.drivers.serving.dumpsink import DumpSink

WRITER = "calexec-dump-writer"


def _writers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == WRITER and t.is_alive()]


def test_dump_close_returns_only_once_its_writer_thread_ended(tmp_path):
    # DumpSink.close() flushed, told the writer to end and returned at once: the writer
    # thread was still alive after every close (50 of 50 runs), so a shutdown that counts
    # its threads (or the interpreter's exit) still found it. close() now joins it, within
    # what is left of its timeout.
    before = set(_writers())
    for i in range(5):
        sink = DumpSink(str(tmp_path / f"d{i}"), 1 << 20)
        assert sink.submit({"i": i})
        assert sink.close(30.0) is True
        left = [t for t in _writers() if t not in before]
        assert left == [], f"close() returned with the dump writer still running: {left}"
        assert sink.counts()["written"] == 1
