"""Stop 61 (core): a decode stream's step during a shutdown, and the shutdown a failed start
owes; each interleaving forced (a gate on the shutdown's own steps, the stepped executor)
rather than hoped for. Real executor on the bundled emulator; every wait is a bounded wait
for a condition or a bounded join; nothing asserts a duration.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.clock import Clock
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.job import InferenceResult
from executor_harness import (
    MANIFEST,
    deadline,
    jobs_on_device,
    make_executor,
    prefill,
    until,
    write_calbin,
)
from test_recovery import SteppedRuntime

PROMPT = [1, 2, 3, 4]
SHUTDOWN = "the executor is shutting down (shutdown() called)"


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe61"))


class _PausedShutdown:
    """``shutdown()`` on its own thread, held just after it cancelled the pending jobs (the
    executor stopping, its generation not fenced yet: a stream's pre-armed job is still
    armed, its cancel flag set)."""

    def __init__(self, ex) -> None:
        self.ex = ex
        self.paused, self.go = threading.Event(), threading.Event()
        self.answers: list[Status] = []
        original = ex.dispatch.cancel_pending

        def cancel_pending() -> None:
            original()
            if threading.current_thread() is self.thread:
                self.paused.set()
                self.go.wait(10)

        self.cancel_pending = cancel_pending
        self.thread = threading.Thread(target=lambda: self.answers.append(ex.shutdown(5.0)),
                                       name="probe61-shutdown", daemon=True)

    def start(self) -> None:
        self.thread.start()
        assert self.paused.wait(10), "the shutdown never cancelled the pending jobs"

    def finish(self) -> Status:
        self.go.set()
        self.thread.join(10)
        assert self.answers, "the shutdown still runs"
        return self.answers[0]


def _prefilled(ex) -> InferenceResult:
    """Sequence 3's prefill of ``PROMPT``, driven on this thread (a stepped executor): its
    result."""
    first = ex.enqueue(prefill(3, PROMPT))
    while not first.done and (ex.submit_one() or ex.complete_one()):
        pass
    result = first.wait_until(deadline())
    assert isinstance(result, InferenceResult), result
    return result


# ---- 1. a stream's step during a shutdown: one answer, whether its job was armed or not ----
@pytest.mark.parametrize("released_first", [False, True])
@pytest.mark.parametrize("greedy_ahead", [False, True])
def test_a_step_during_a_shutdown_answers_as_enqueue_whether_or_not_its_job_was_armed(
        calbin, monkeypatch, released_first, greedy_ahead):
    """A decode stream stepped once ``shutdown()`` had begun answered ``request.cancelled``
    when its pre-armed job was still armed (the shutdown's cancel flag refused the job as it
    was fired) and ``lifecycle.unavailable`` when the job had been released first (the step
    admitted afresh): which one, the submitter's timing decided. The token came after the
    shutdown began either way: the step now answers what ``enqueue`` answers then
    (``lifecycle.unavailable`` naming the shutdown), in both interleavings, each forced on the
    stepped executor with the shutdown held after its cancel."""
    ex = make_executor(calbin, threads=False)
    paused = _PausedShutdown(ex)
    monkeypatch.setattr(ex.dispatch, "cancel_pending", paused.cancel_pending)
    try:
        result = _prefilled(ex)
        stream = ex.decode_stream(3, result.kv_len, deadline(), greedy_ahead=greedy_ahead)
        armed = stream.armed
        assert armed is not None, "the stream armed no job"
        paused.start()
        assert armed.cancel_flag and not armed.done  # cancelled, still armed
        if released_first:  # the submitter's look releases the cancelled armed job
            for _ in range(10):
                if armed.done:
                    break
                ex.submit_one()
            assert armed.done and not ex.dispatch.armed_jobs()
        refused = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert isinstance(refused, Status) and SHUTDOWN in refused.message, refused
        answer = stream.step(result.argmax)
        assert isinstance(answer, Status), answer
        assert (answer.code, answer.category, answer.message) == (
            refused.code, refused.category, refused.message), answer
        assert answer.category is Category.UNAVAILABLE and answer.seq_id == 3, answer
        assert stream.closed and armed.done
        assert paused.finish().ok
        assert ex.state == "Stopped"
    finally:
        paused.go.set()
        ex.shutdown(5.0)


def test_a_step_submitted_before_the_shutdown_is_cancelled_as_a_queued_enqueue(calbin,
                                                                              monkeypatch):
    """The other half of the rule: a step whose token came before ``shutdown()`` (its job
    queued, not yet submitted) is cancelled by the shutdown as a queued ``enqueue`` is:
    ``request.cancelled`` naming the shutdown, on the stepped executor with the shutdown
    held after its cancel."""
    ex = make_executor(calbin, threads=False)
    paused = _PausedShutdown(ex)
    monkeypatch.setattr(ex.dispatch, "cancel_pending", paused.cancel_pending)
    try:
        result = _prefilled(ex)
        queued = ex.enqueue(prefill(4, PROMPT))
        stream = ex.decode_stream(3, result.kv_len, deadline())
        handle = stream.submit(result.argmax)
        assert not isinstance(handle, Status) and not handle.done, handle
        paused.start()
        for _ in range(10):  # the submitter's looks release the cancelled queued jobs
            if queued.done and handle.done:
                break
            ex.submit_one()
        answers = [queued.wait_until(deadline()), stream.wait()]
        for answer in answers:
            assert isinstance(answer, Status) and answer.code == "request.cancelled", answer
            assert SHUTDOWN in answer.message, answer
        assert paused.finish().ok
    finally:
        paused.go.set()
        ex.shutdown(5.0)


# ---- 2. a failed start completing the shutdown it owes --------------------------------------
class _SleepHook(Clock):
    """The system clock; ``hook`` (when set) runs before each of its sleeps (the executor's
    polls: a drain's, a wait for a job to leave the device)."""

    __slots__ = ("hook",)

    def __init__(self) -> None:
        self.hook = None

    def sleep(self, seconds: float) -> None:
        hook = self.hook
        if hook is not None:
            hook()
        super().sleep(seconds)


def test_a_start_owing_a_shutdown_waits_for_its_golden_job_and_ends_stopped(calbin,
                                                                           monkeypatch):
    """``shutdown(0.0)`` while ``start()``'s golden job was on the device answered
    ``shutdown.start_busy``; the start, interrupted, completed that shutdown as it ended, with
    its grace 0: its golden job still on the device, the shutdown's drain gave up at once, and
    the executor ended ``Failed`` (``shutdown.not_drained``) with the device open and the
    refused generation's buffers mapped until some later ``shutdown()``, which nothing made.
    The golden job has a deadline: the start now waits for it (bounded by that deadline)
    before completing the owed shutdown, and the device answering within it ends the executor
    ``Stopped`` with the generation released and the device closed. Forced: the device
    (stepped) finishes the golden job only once the start's thread polls for it."""
    clock = _SleepHook()
    ex = DeviceExecutor(SteppedRuntime(CalRT.load()), MANIFEST,
                        ExecutorConfig(calbin_path=calbin), clock=clock)
    answers: dict[str, Status] = {}
    started: list[Status] = []
    starter = threading.Thread(target=lambda: started.append(ex.start()),
                               name="probe61-start", daemon=True)
    original = ex.dispatch.close

    def close(gen):
        # the interrupted start fencing its generation: held until the shutdown answered
        if threading.current_thread() is starter and "shutdown" not in answers:
            until(lambda: "shutdown" in answers, 10, "the shutdown's answer")
        return original(gen)

    monkeypatch.setattr(ex.dispatch, "close", close)
    released = threading.Event()

    def let_go() -> None:  # on the start's thread, once it polls: the device finishes
        if threading.current_thread() is starter and not released.is_set():
            released.set()
            assert ex.device.emu.set_stepped(False) == 0

    starter.start()
    try:
        until(lambda: ex.state == "Warming" and jobs_on_device(ex, 1), 20,
              "the golden job on the device")
        clock.hook = let_go
        answers["shutdown"] = ex.shutdown(0.0)
        starter.join(30)
        assert not starter.is_alive(), "start() still runs"
        assert answers["shutdown"].code == "shutdown.start_busy", answers
        assert started and not started[0].ok, started
        assert "interrupted by shutdown()" in started[0].message, started[0]
        assert released.is_set(), "the start never waited for its golden job"
        assert ex.state == "Stopped", (ex.state, ex.failure)
        assert ex.gen is None and not ex.life.retired, "the refused generation was kept"
        assert ex.device.emu.counters() == {}, "the device was never closed"
        assert not any(ex.threads_alive().values()), ex.threads_alive()
        assert ex.shutdown(1.0).ok, "a later shutdown answers as the one it completed"
    finally:
        clock.hook = None
        if ex.device is not None and not released.is_set():
            ex.device.emu.set_stepped(False)
        starter.join(30)
        ex.shutdown(5.0)
