"""Stop 63 (core audit): the concurrency rules in library code, one test per defect found.

Every thread has a join path at shutdown; every wait is bounded by a deadline it was given.
"""

from __future__ import annotations

import threading

import pytest

from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.tools.bench import server_overhead as bench_server

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


def _load_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate()
            if t.name.startswith(bench_server.LOAD_THREAD) and t.is_alive()]


def test_bench_server_load_gives_no_figures_for_a_run_still_going_at_its_bound():
    # ``calexec bench server``'s direct side joined each load thread for 4 * 60 s of its
    # own, then returned req_per_s/p50/p99 whether or not the threads had ended: a request
    # still running was counted as done (4 requests/s over a run where 3 had ended) and the
    # next side was measured beside the thread left running (not a daemon: it also held
    # the process at exit). Now every thread is joined under one bound the caller gives,
    # and a thread still running then is a BenchError naming it.
    release = threading.Event()

    def one(worker: int, i: int) -> None:
        if i == 0:
            release.wait(30.0)  # one request still running past the bound

    try:
        with pytest.raises(bench_server.BenchError, match=r"1 load thread\(s\) still running "
                           r"after 0.3 s \(bench-load-\d\); no figures"):
            bench_server.load(4, 2, one, timeout_s=0.3)
        assert all(t.daemon for t in _load_threads())
    finally:
        release.set()
    for t in _load_threads():
        t.join(10.0)
    assert _load_threads() == []


def test_bench_server_load_still_measures_a_run_that_ends_within_its_bound():
    done: list[int] = []
    out = bench_server.load(6, 3, lambda w, i: done.append(i), raw=True, timeout_s=30.0)
    assert sorted(done) == list(range(6))
    assert len(out["latencies_ms"]) == 6 and out["req_per_s"] > 0
    assert _load_threads() == []
