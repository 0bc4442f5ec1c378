"""``drivers/tools/bench/threadcpu.py``: CPU per thread role for ``calexec bench server``
(issue 28, "profile the server's share"): role names, a span's account (threads that grew,
started, ended, or whose id was reused), pooling per request, the difference of two sides, and
a live snapshot of this process (Linux), where the emulator's engine threads carry their names.
No timing threshold: the work a thread does is a bounded loop, and what is asserted is where
its CPU was counted, not how much there was."""

from __future__ import annotations

import sys
import threading

import pytest

from calexec.drivers.tools.bench import threadcpu
from calexec.drivers.tools.bench.threadcpu import SpanCpu, ThreadCpu


@pytest.mark.parametrize(("name", "role"), [
    ("calexec-submitter", "calexec-submitter"), ("AnyIO worker thread", "AnyIO worker thread"),
    ("bench-load-3", "bench-load"), ("Thread-7 (worker)", "worker"), ("Thread-12", "Thread"),
    ("worker 12", "worker"), ("", "?"), ("42", "?"), ("MainThread", "MainThread")])
def test_a_role_is_the_name_without_its_thread_number(name, role):
    assert threadcpu.role_of(name) == role


def test_a_span_counts_growth_new_threads_and_ended_ones():
    before = {1: ThreadCpu("a", 1.0), 2: ThreadCpu("b", 5.0), 3: ThreadCpu("gone", 2.0),
              4: ThreadCpu("old", 3.0)}
    after = {1: ThreadCpu("a", 1.5), 2: ThreadCpu("b", 5.0), 5: ThreadCpu("a", 0.25),
             4: ThreadCpu("new", 0.5)}  # id 4 reused by a thread of another role
    got = threadcpu.span(before, after, {"told": 0.75, "idle": 0.0})
    assert got == SpanCpu({"a": 0.75, "new": 0.5, "told": 0.75}, threads_ended=1)


def test_spans_pool_per_request_and_two_sides_differ_per_role():
    spans = [SpanCpu({"x": 0.002, "y": 0.001}, 0), SpanCpu({"x": 0.002, "z": 0.004}, 1)]
    assert threadcpu.per_request_ms(spans, 4) == {"x": 1.0, "z": 1.0, "y": 0.25}
    assert list(threadcpu.per_request_ms(spans, 4)) == ["x", "z", "y"]  # largest first, by name
    diff = threadcpu.difference({"x": 1.0, "loop": 2.0}, {"x": 0.25, "load": 0.5})
    assert diff == {"loop": 2.0, "x": 0.75, "load": -0.5}
    assert list(diff) == ["loop", "x", "load"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task: Linux only")
def test_a_live_snapshot_names_python_threads_and_counts_their_cpu():
    go, done, release = threading.Event(), threading.Event(), threading.Event()

    def busy() -> None:
        go.wait(30)
        total = 0
        for i in range(3_000_000):  # bounded work, CPU the kernel counts for this thread
            total += i
        done.set()
        release.wait(30)  # stays alive for the second snapshot

    thread = threading.Thread(target=busy, name="probe-busy-7", daemon=True)
    thread.start()
    try:
        before = threadcpu.snapshot()
        go.set()
        assert done.wait(30)
        after = threadcpu.snapshot()
    finally:
        release.set()
        thread.join(30)
    assert before is not None and after is not None
    assert after[thread.native_id].role == "probe-busy"
    assert after[threading.main_thread().native_id].role == "MainThread"
    span = threadcpu.span(before, after)
    assert span.by_role.get("probe-busy", 0.0) > 0.0  # its loop, not another thread's
    assert span.threads_ended == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task: Linux only")
def test_the_emulators_engine_threads_carry_their_names(tmp_path):
    """The emulator names its engine threads (one per chiplet) ``calrt-emu-eN``: a thread
    Python did not start is known by its kernel name, which before was the process's
    (``python``), so the device's CPU could not be told from the host's."""
    from calexec.drivers.device_spec import DeviceSpec
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    spec = DeviceSpec()
    ex = DeviceExecutor(spec.runtime(), spec.manifest(),
                        ExecutorConfig(calbin_path=spec.calbin(str(tmp_path)),
                                       device_config="decode_us=0", recovery=spec.recovery()))
    assert ex.start().ok
    try:
        roles = {one.role for one in (threadcpu.snapshot() or {}).values()}
    finally:
        ex.shutdown()
    assert {"calrt-emu-e0", "calrt-emu-e1", "calexec-submitter", "calexec-completion"} <= roles


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/task: Linux only")
def test_a_native_thread_that_never_named_itself_is_not_counted_as_python():
    """A thread a library starts without naming it (numpy's OpenBLAS workers, an OpenMP pool)
    keeps the kernel name it inherited, the process's own (``python``): its CPU was reported
    under the role ``python``, read as the interpreter's. It is now ``native (unnamed)``. The
    thread here is a real one of libc's (``pthread_create`` running ``sleep``), no Python
    in it, as OpenBLAS's are."""
    import ctypes
    import time

    libc = ctypes.CDLL(None)
    before = threadcpu.snapshot() or {}
    handle = ctypes.c_ulong()
    start = ctypes.cast(libc.sleep, ctypes.c_void_p)  # void *(*)(void *): sleep(2)
    assert libc.pthread_create(ctypes.byref(handle), None, start, ctypes.c_void_p(2)) == 0
    try:
        deadline = time.monotonic() + 1.5
        new: dict[int, ThreadCpu] = {}
        while not new and time.monotonic() < deadline:  # bounded: the thread sleeps 2 s
            new = {tid: one for tid, one in (threadcpu.snapshot() or {}).items()
                   if tid not in before}
            time.sleep(0.01)
    finally:
        assert libc.pthread_join(handle, None) == 0
    assert [one.role for one in new.values()] == ["native (unnamed)"], new
    roles = {one.role for one in before.values()}
    assert "python" not in roles and "MainThread" in roles
