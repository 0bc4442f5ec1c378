"""Stop 64 (embedder): the executor embedded in a program of one's own, used from threads
and processes as such a program does. Real executor on the bundled emulator; every wait is
bounded; nothing asserts a duration."""

from __future__ import annotations

import json
import os
import sys
import warnings

import pytest

from calexec.contracts.status import Status
from calexec.machines.job import InferenceResult
from executor_harness import make_executor, prefill, running_executor, write_calbin

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe64"))


def _in_child(body) -> dict:
    """``body()`` in a child forked now; its dict (or the exception it raised) comes back
    through a pipe. The child never returns into pytest: it replaces itself with a Python
    that does nothing (``os.execv``: no test teardown, no exit handler runs there)."""
    read, write = os.pipe()
    with warnings.catch_warnings():  # (3.12+ warns of a fork beside threads: this test's point)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            out = body()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, never lost
            out = {"raised": f"{type(exc).__name__}: {exc}"}
        try:
            os.write(write, json.dumps(out).encode())
        finally:
            os.execv(sys.executable, [sys.executable, "-c", "pass"])
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        data = pipe.read()
    _, code = os.waitpid(pid, 0)
    assert code == 0, code
    out = json.loads(data)
    assert "raised" not in out, out["raised"]
    return out


def _said(status) -> list:
    return [status.code, status.message] if isinstance(status, Status) else ["result", ""]


def test_a_forked_childs_copy_of_a_started_executor_refuses_at_once_and_stops_nothing(calbin):
    """A child forked after ``start()`` (a pre-fork worker model, a ``multiprocessing``
    fork) has none of the executor's threads and shares the parent's device: its copy
    admitted a request that never ran (the handle's wait outlived the request's deadline,
    the job "Queued"), and its ``shutdown`` waited out all of its grace and answered
    ``shutdown.not_drained``, ``Failed``. Each call now answers at once naming the fork,
    the parent's executor serves on, and a new executor built in the child serves there."""
    with running_executor(calbin) as ex:
        assert isinstance(ex.enqueue(prefill(1, [3, 14, 15])).result(10.0), InferenceResult)
        assert ex.release_sequence(1, 1.0).ok
        parent = os.getpid()

        def child() -> dict:
            out = {"enqueue": _said(ex.enqueue(prefill(2, [3, 14, 15], seconds=2.0))
                                    .result(10.0)),
                   "decode_sync": _said(ex.decode_sync(prefill(2, [3, 14, 15]))[1]),
                   "stream": _said(ex.decode_stream(2, 0, prefill(2, [1]).deadline).status),
                   "release": _said(ex.release_sequence(1, 1.0)),
                   "health": ex.health(),
                   "shutdown": _said(ex.shutdown(5.0))}
            own = make_executor(calbin)  # what the message says to do
            out["own"] = _said(own.enqueue(prefill(1, [3, 14, 15])).result(10.0))
            out["own_shutdown"] = _said(own.shutdown(5.0))
            return out

        out = _in_child(child)
        named = f"started in process {parent} and this is a child forked from it"
        for call in ("enqueue", "decode_sync", "stream", "release", "shutdown"):
            code, message = out[call]
            assert code == "lifecycle.unavailable", (call, out[call])
            assert named in message and "new DeviceExecutor" in message, (call, message)
        assert len(out["health"]) == 1 and named in out["health"][0], out["health"]
        assert "nothing was stopped" in out["shutdown"][1]
        assert out["own"] == ["result", ""] and out["own_shutdown"] == ["ok", ""], out
        # the parent's executor is untouched: it serves, and stops cleanly
        assert ex.health() == []
        assert isinstance(ex.enqueue(prefill(3, [3, 14, 15])).result(10.0), InferenceResult)
        assert ex.release_sequence(3, 1.0).ok
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


def test_a_child_forked_before_start_starts_its_own_copy(calbin):
    """Only a started executor's copy is refused: one built and forked before ``start()``
    is the child's own to start, serve and shut down."""
    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    ex = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                        ExecutorConfig(calbin_path=calbin))

    def child() -> dict:
        started = ex.start()
        out = {"start": _said(started),
               "enqueue": _said(ex.enqueue(prefill(1, [3, 14, 15])).result(10.0))}
        out["shutdown"] = _said(ex.shutdown(5.0))
        return out

    assert _in_child(child) == {"start": ["ok", ""], "enqueue": ["result", ""],
                                "shutdown": ["ok", ""]}
    assert ex.shutdown(1.0).ok  # never started here: nothing opened


def test_the_snapshot_says_which_kv_is_held_and_a_release_gives_it_back(calbin):
    """docs/embedding.md §3: an embedder releases each id once its jobs are done, and checks
    with ``snapshot()`` that nothing leaked; the snapshot told the slots and the token
    budget, not the KV: which ids hold KV and how many blocks (the reference server read
    the executor's private coordinator for its KV gauge)."""
    with running_executor(calbin, "kv_blocks=8;kv_block_size=16;max_seqs=8") as ex:
        snap = ex.snapshot()
        assert (snap["kv_blocks_reserved"], snap["kv_blocks_capacity"],
                snap["kv_sequences"]) == (0, 8, [])
        first = ex.enqueue(prefill(1, [3, 14, 15], kv_reserve_len=40)).result(10.0)
        second = ex.enqueue(prefill(2, [3, 14, 15])).result(10.0)
        assert isinstance(first, InferenceResult) and isinstance(second, InferenceResult)
        snap = ex.snapshot()
        assert (snap["kv_blocks_reserved"], snap["kv_sequences"]) == (3 + 1, [1, 2]), snap
        assert ex.release_sequence(1, 1.0).ok
        snap = ex.snapshot()
        assert (snap["kv_blocks_reserved"], snap["kv_sequences"]) == (1, [2]), snap
        assert ex.release_sequence(2, 1.0).ok
        snap = ex.snapshot()
        assert (snap["kv_blocks_reserved"], snap["kv_sequences"]) == (0, []), snap
        assert ex.shutdown(5.0).ok
        snap = ex.snapshot()
        assert (snap["kv_blocks_reserved"], snap["kv_blocks_capacity"],
                snap["kv_sequences"]) == (0, None, [])


def gated_preparation(monkeypatch):
    """``BufferSlot.prepare`` held, in the thread the test appends to ``holder``, until
    ``opened`` is set (bounded: 10 s); ``holding`` is set once it holds.
    ``(holding, opened, holder)``."""
    import threading

    from calexec.machines.pool import BufferSlot

    holding, opened = threading.Event(), threading.Event()
    holder: list[threading.Thread] = []
    prepare = BufferSlot.prepare

    def gated_prepare(slot, request):
        if holder and threading.current_thread() is holder[0] and not opened.is_set():
            holding.set()
            opened.wait(10.0)
        return prepare(slot, request)

    monkeypatch.setattr(BufferSlot, "prepare", gated_prepare)
    return holding, opened, holder


def test_shutdown_never_tears_down_a_generation_a_request_thread_still_prepares_in(
        calbin, monkeypatch):
    """A ``shutdown`` while another thread's ``enqueue`` prepared its job in a buffer slot
    (copy, SliceTensor, SetCSR: inside the generation's fence) ignored the fence's answer:
    it released the generation and closed the device under that thread and answered OK,
    ``Stopped``; the request then failed ``internal.slot_dropped`` (a 500 and a fault asking
    for a reset, after the shutdown), where docs/embedding.md section 6 has it answered
    ``lifecycle.unavailable`` naming the shutdown (and a SetCSR on a destroyed buffer was a
    step away). Now nothing is torn down while a request thread is inside: the shutdown
    answers ``shutdown.not_drained`` naming it, everything kept; the request answers
    ``lifecycle.unavailable``; a later ``shutdown`` tears the generation down."""
    import threading

    holding, opened, holder = gated_preparation(monkeypatch)
    with running_executor(calbin) as ex:
        answers: list = []
        thread = threading.Thread(target=lambda: answers.append(
            ex.enqueue(prefill(1, [3, 14, 15])).result(10.0)), name="request")
        holder.append(thread)
        thread.start()
        try:
            assert holding.wait(10.0), "the request never reached its preparation"
            status = ex.shutdown(0.0)
            assert status.code == "shutdown.not_drained", status
            assert "a request thread" in status.message and "nothing was torn down" in \
                status.message, status.message
            snap = ex.snapshot()  # kept: the generation and its slots (one leased)
            assert snap["generation"] == 1 and snap["slots"] is not None, snap
            assert snap["slots"]["Leased"] == 1, snap["slots"]
        finally:
            opened.set()
            thread.join(10.0)
        assert not thread.is_alive()
        (answer,) = answers
        assert isinstance(answer, Status) and answer.code == "lifecycle.unavailable", answer
        assert "shutting down" in answer.message, answer.message
        assert ex.snapshot()["slots"]["Leased"] == 0
        ex.shutdown(5.0)  # the thread left: the generation is torn down, the device closed
        snap = ex.snapshot()
        assert snap["generation"] is None and snap["slots"] is None, snap


def test_a_later_shutdown_that_tears_down_never_says_nothing_was_torn_down(
        calbin, monkeypatch):
    """After a ``shutdown`` a request thread's preparation kept from tearing down (answered
    ``shutdown.not_drained``, "nothing was torn down"), the later ``shutdown`` that tears the
    generation down and closes the device answered those very words again, and ``health()``
    kept saying them for good: an embedder could not tell that the device was closed (and
    one retrying while told "nothing was torn down" never stopped). The lifecycle's failure
    names the request thread; only the call that kept everything says it kept it."""
    import threading

    holding, opened, holder = gated_preparation(monkeypatch)
    with running_executor(calbin) as ex:
        thread = threading.Thread(target=lambda: ex.enqueue(prefill(1, [3, 14, 15])).result(
            10.0), name="request")
        holder.append(thread)
        thread.start()
        try:
            assert holding.wait(10.0), "the request never reached its preparation"
            first = ex.shutdown(0.0)
        finally:
            opened.set()
            thread.join(10.0)
        assert not thread.is_alive()
        assert first.code == "shutdown.not_drained", first
        assert "nothing was torn down" in first.message, first.message
        later = ex.shutdown(5.0)  # the thread left: this one tears down
        snap = ex.snapshot()
        assert snap["generation"] is None and snap["slots"] is None, snap
        assert later.code == "shutdown.not_drained", later  # (the lifecycle stays Failed)
        assert "a request thread" in later.message, later.message
        assert "nothing was torn down" not in later.message, later.message
        assert not any("nothing was torn down" in reason for reason in ex.health()), \
            ex.health()


def test_a_child_forked_after_shutdown_answers_as_after_a_shutdown(calbin):
    """An executor the parent shut down (its device closed) has nothing of the parent's
    left to guard: the child's copy answers as the parent's does, the shutdown named."""
    ex = make_executor(calbin)
    assert ex.shutdown(5.0).ok

    def child() -> dict:
        return {"enqueue": _said(ex.enqueue(prefill(1, [3, 14, 15])).result(10.0)),
                "shutdown": _said(ex.shutdown(1.0)), "health": ex.health()}

    out = _in_child(child)
    assert out["enqueue"][0] == "lifecycle.unavailable", out
    assert "shutting down" in out["enqueue"][1] and "forked" not in out["enqueue"][1], out
    assert out["shutdown"] == ["ok", ""] and out["health"] == [
        "lifecycle is Stopped, not admitting"], out
