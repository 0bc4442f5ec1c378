"""Stop 61 (core, second): the fast paths of a decode (a pre-armed stream, greedy ahead) as a
claim of equality. One scripted history per case, run on the plain path (``enqueue``), on a
pre-armed stream and on a greedy-ahead stream, on the stepped executor (the step fired ahead
sits in the queue when the history's event comes) and on the threaded one (it has ended on
the device first: a bounded wait for that condition); the answers (code, category, tokens)
must be equal. Real executor on the bundled emulator; nothing asserts a duration.
"""

from __future__ import annotations

import threading

import attrs
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.clock import Clock
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.job import InferenceResult, JobHandle
from executor_harness import (
    MANIFEST,
    arm,
    decode,
    prefill,
    until,
    write_calbin,
)

PROMPT = [1, 2, 3, 4]
PATHS = ("enqueue", "prearm", "greedy")
#: how far the ``deadline`` event moves the executor's clock, past the caller's deadline
LATE_S = 2.0


class _Shifted(Clock):
    """The system clock, moved on by ``offset`` seconds: a deadline passes when the test
    says so, not when a thread happens to be slow."""

    __slots__ = ("offset",)

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return super().monotonic() + self.offset


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe61b"))


def _drive(ex, handle) -> None:
    if not ex.config.threads:  # stepped: this thread is the submitter and the completion
        while not handle.done and (ex.submit_one() or ex.complete_one()):
            pass


def _answer(result) -> tuple:
    """What a differential compares: the code and category of a refusal, the token and
    length of a result."""
    if isinstance(result, InferenceResult):
        return ("ok", result.argmax, result.kv_len)
    assert isinstance(result, Status), result
    return (result.code, result.category)


class _Caller:
    """One caller's decode of sequence 1 on one path, every request with the deadline
    ``end``: ``step(token)`` answers as the path answers it; ``cancel()`` is a caller that
    gave up (a server cancels every job of a request its client left)."""

    def __init__(self, ex, path: str, past: int, end: float) -> None:
        self.ex, self.path, self.past, self.end = ex, path, past, end
        self.cancelled = False
        #: answers of other callers' requests an event made (compared as the steps are)
        self.notes: list[tuple] = []
        self.beside: JobHandle | None = None  # another sequence's request, not waited yet
        self.stream = (None if path == "enqueue" else
                       ex.decode_stream(1, past, end, greedy_ahead=path == "greedy"))

    def step(self, token: int):
        if self.stream is None:
            request = attrs.evolve(decode(1, token, self.past), deadline=self.end)
            handle = self.ex.enqueue(request, on_created=(
                (lambda created: created.cancel()) if self.cancelled else None))
            _drive(self.ex, handle)
            result = handle.wait_until(self.end)
        else:
            result = self.stream.step(token)
        if isinstance(result, InferenceResult):
            self.past = result.kv_len
        return result

    def cancel(self) -> None:
        self.cancelled = True
        if self.stream is not None:
            self.stream.cancel()

    def ahead_ended(self) -> bool:
        ahead = None if self.stream is None else self.stream.ahead
        return ahead is None or (ahead[1] is not None and ahead[1].done)


class _HeldLifecycle:
    """``switch_model`` on its own thread, held just before its fence closes the serving
    generation: admission has stopped, the generation is still current and not closing.
    (``shutdown``: ``shutdown()`` held just after it cancelled the queued jobs.)"""

    def __init__(self, ex, calbin, shutdown: bool = False) -> None:
        self.ex, self.paused, self.go = ex, threading.Event(), threading.Event()
        self.answers: list[Status] = []
        name = "cancel_pending" if shutdown else "close"
        original = getattr(ex.dispatch, name)

        def gate(*args):
            if threading.current_thread() is self.thread and not self.paused.is_set():
                if shutdown:
                    original(*args)
                self.paused.set()
                self.go.wait(10)
                if shutdown:
                    return None
            return original(*args)

        setattr(ex.dispatch, name, gate)
        call = ((lambda: ex.shutdown(5.0)) if shutdown else
                (lambda: ex.switch_model(calbin)))
        self.thread = threading.Thread(target=lambda: self.answers.append(call()),
                                       name="probe61b-lifecycle", daemon=True)
        self.thread.start()
        assert self.paused.wait(10), f"the {name} gate was never reached"
        assert not ex.life.admitting

    def finish(self) -> None:
        self.go.set()
        self.thread.join(10)
        assert self.answers and self.answers[0].ok, self.answers


def _event(ex, calbin, caller: _Caller, event: str) -> _HeldLifecycle | None:
    if event == "switching":  # a switch under way: admission stopped, not fenced yet
        return _HeldLifecycle(ex, calbin)
    if event == "shutting":  # a shutdown under way: the queued jobs cancelled
        return _HeldLifecycle(ex, calbin, shutdown=True)
    if event == "switch":  # a completed model switch (to the same calbin)
        status = ex.switch_model(calbin)
    elif event == "recover":  # a completed recovery (a device fault's, reset made)
        status = ex.recover(Status.failure("test.ccu_fault", Category.DEVICE, Phase.RECOVERY,
                                           "a CCU fault the test reports"))
    elif event == "ccu":  # another sequence's job meets a CCU exception: the fault
        arm(ex, "CCU_EXCEPTION")  # controller's recovery replaces the generation
        gen = ex.snapshot()["generation"]
        handle = ex.enqueue(prefill(2, PROMPT))
        _drive(ex, handle)
        failed = handle.wait_until(caller.end)
        assert isinstance(failed, Status) and failed.category is Category.DEVICE, failed
        until(lambda: ex.state == "Ready" and ex.snapshot()["generation"] > gen, what="the recovery")
        status = Status.OK
    elif event == "release":
        status = ex.release_sequence(1, wait_s=5.0)
    elif event == "kv_wait":  # (a KV of 3 blocks) seq 2 takes the last block; its decode
        # beyond it waits for KV no one frees, until its deadline
        taken = ex.enqueue(prefill(2, list(range(16))))
        _drive(ex, taken)
        assert isinstance(taken.wait_until(caller.end), InferenceResult)
        waits = ex.enqueue(decode(2, 7, 16, seconds=0.3))
        _drive(ex, waits)
        caller.notes.append(_answer(waits.wait_until(caller.end)))
        status = Status.OK
    elif event == "beside":  # another sequence's prefill, queued beside the stream's steps
        caller.beside = ex.enqueue(prefill(2, PROMPT))
        status = Status.OK
    elif event == "request":  # another request of the sequence (its prompt again, from 0)
        handle = ex.enqueue(prefill(1, PROMPT))
        _drive(ex, handle)
        done = handle.wait_until(caller.end)
        status = done if isinstance(done, Status) else Status.OK
    elif event == "shutdown":
        status = ex.shutdown(5.0)
    elif event == "cancel":
        caller.cancel()
        status = Status.OK
    elif event == "deadline":  # the caller's deadline passes (the executor's clock moves)
        ex.clock.offset += LATE_S
        status = Status.OK
    else:
        raise AssertionError(event)
    assert status.ok, (event, status)
    return None


def _history(calbin, path: str, event: str, threads: bool, before: int,
             on_device: bool = False, **config) -> tuple[list[tuple], int]:
    """Prefill, ``before`` decode steps (greedy: until one fired its next step ahead, at most
    ``before``), ``event``, then up to two more steps with the argmax, then the answers of
    other requests the event made (``notes``). The answers, and how many steps came before
    the event. ``config``: ExecutorConfig fields."""
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(
        calbin_path=calbin, threads=threads, check_lock_order=True, strict_lock_order=False,
        **config), clock=_Shifted())
    started = ex.start()
    assert started.ok, started
    # the caller's deadline: one the ``deadline`` event passes, else far
    end = ex.clock.monotonic() + (LATE_S / 2 if event == "deadline" else 30.0)
    try:
        if threads:  # the caller waits for each step: the completion thread fires ahead
            assert ex.device.emu.set_latency(decode_us=20000) == 0
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 16))
        _drive(ex, first)
        result = first.wait_until(end)
        assert isinstance(result, InferenceResult), result
        caller = _Caller(ex, path, result.kv_len, end)
        answers = []
        for _ in range(before):
            result = caller.step(result.argmax)
            answers.append(_answer(result))
            assert isinstance(result, InferenceResult), result
            if path == "greedy" and caller.stream.ahead is not None:
                break
        if path == "greedy":
            # fired ahead with the argmax: queued (stepped) or ended on the device (threads)
            ahead = caller.stream.ahead
            assert ahead is not None and ahead[1] is not None, "nothing was fired ahead"
            if threads:
                until(caller.ahead_ended, what="the step fired ahead ended")
            else:  # nobody drives the stepped executor: it waits in the queue
                assert not ahead[1].done
                if on_device:  # (or, one submit later, on the device)
                    assert ex.submit_one() and not ahead[1].done
        taken = len(answers)
        switching = _event(ex, calbin, caller, event)
        for _ in range(2):
            result = caller.step(result.argmax)
            answers.append(_answer(result))
            if not isinstance(result, InferenceResult):
                break
        if caller.beside is not None:
            _drive(ex, caller.beside)
            caller.notes.append(_answer(caller.beside.wait_until(end)))
        answers.extend(caller.notes)
        if caller.stream is not None:
            caller.stream.close(wait=switching is None)
        if switching is not None:
            switching.finish()
        return answers, taken
    finally:
        ex.shutdown(5.0)


def _differential(calbin, event: str, threads: bool, on_device: bool = False, **config
                  ) -> dict[str, list[tuple]]:
    """The history on the three paths: the greedy one first (how many steps it took until
    one was fired ahead: the others take as many before the event)."""
    greedy, taken = _history(calbin, "greedy", event, threads, before=8, on_device=on_device,
                             **config)
    answers = {path: _history(calbin, path, event, threads, before=taken, **config)[0]
               for path in PATHS if path != "greedy"}
    answers["greedy"] = greedy
    return answers


@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
@pytest.mark.parametrize("event", ["switch", "recover"])
def test_a_step_after_a_completed_generation_change_answers_as_the_plain_path(
        calbin, event, threads):
    """A greedy stream's step taken after a completed ``switch_model`` (or recovery) adopted
    the job fired ahead before it: ``lifecycle.unavailable`` "device recovering after
    lifecycle.model_switch; retry later" when that job was still queued (the switch refused
    it), though the switch had finished, and the old generation's ``OK`` (a token decoded on
    KV that went with it) when it had ended first; ``enqueue`` and a pre-armed stream answer
    ``kv.past_len_beyond_committed`` ("prefill it again"). Now all three answer alike."""
    answers = _differential(calbin, event, threads)
    plain = answers["enqueue"]
    assert plain[-1][0] == "kv.past_len_beyond_committed", plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize(("event", "threads"), [("release", True), ("shutdown", False),
                                                ("shutdown", True)])
def test_a_step_after_a_release_or_a_shutdown_answers_as_the_plain_path(calbin, event,
                                                                        threads):
    """The same differential across a ``release_sequence`` of the stream's sequence and a
    completed ``shutdown()``, each made while the step fired ahead waits in the queue
    (stepped) or after it ended (threads). (The stepped executor's release:
    ``test_a_release_or_a_request_on_the_stepped_executor_answers_as_the_plain_path``.)"""
    answers = _differential(calbin, event, threads)
    plain = answers["enqueue"]
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


def test_a_step_after_a_ccu_fault_of_another_sequence_answers_as_the_plain_path(calbin):
    """The recovery of a device fault (a CCU exception of another sequence's job) between
    two steps: the step fired ahead before it is not adopted either. (Threaded: the step
    ahead ended first. On the stepped executor the queued step ahead would be the job that
    meets the fault: another history; ``recover`` there.)"""
    answers = _differential(calbin, "ccu", True)
    plain = answers["enqueue"]
    assert plain[-1][0] == "kv.past_len_beyond_committed", plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
def test_a_step_after_its_caller_gave_up_answers_as_the_plain_path(calbin, threads):
    """A cancel (the caller gave up) racing the step fired ahead: queued (stepped) or ended
    (threads); the next step is cancelled on every path."""
    answers = _differential(calbin, "cancel", threads)
    plain = answers["enqueue"]
    assert plain[-1][0] == "request.cancelled", plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("on_device", [False, True], ids=["queued", "on_device"])
def test_a_step_whose_deadline_passed_answers_as_the_plain_path(calbin, on_device):
    """The caller's deadline passes while the step fired ahead waits in the queue or runs on
    the device (the stepped executor; the executor's clock moved past it). The token comes
    late: the plain path refuses it at admission (``admission.deadline``); the pre-armed
    stream answered ``submit.deadline`` (its armed job fired late) and greedy ahead the
    result of the step fired before the deadline."""
    answers = _differential(calbin, "deadline", False, on_device=on_device)
    plain = answers["enqueue"]
    assert plain[-1][:2] == ("admission.deadline", Category.DEADLINE), plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("event", ["switching", "shutting"])
def test_a_step_during_a_switch_or_a_shutdown_answers_as_the_plain_path(calbin, event):
    """A step taken while a model switch is under way (admission stopped, the generation not
    fenced yet), or a shutdown (its queued jobs cancelled); threaded, the step fired ahead
    ended on the device before: the plain path answers ``lifecycle.unavailable``; so must
    the fast paths."""
    answers = _differential(calbin, event, True)
    plain = answers["enqueue"]
    assert plain[-1][:2] == ("lifecycle.unavailable", Category.UNAVAILABLE), plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("event", ["release", "request"])
def test_a_release_or_a_request_on_the_stepped_executor_answers_as_the_plain_path(
        calbin, event):
    """Stop 62: on the stepped executor (threads off: the caller drives ``submit_one`` and
    ``complete_one``) a ``release_sequence`` of a greedy stream's sequence, or another
    request of it, made while the step fired ahead waits in the queue (where a step's
    ``wait()`` leaves it) answered ``kv.sequence_busy``: the discarded step's KV txn stayed
    open until someone drove the executor, where the plain path and a pre-armed stream
    answer ``OK`` (and the next step ``kv.past_len_beyond_committed``). The call now fails
    that cancelled queued step itself (``submit_one``: no device call). (A step the caller
    itself submitted to the device ends when the caller completes it: docs/embedding.md
    §3.)"""
    answers = _differential(calbin, event, False)
    plain = answers["enqueue"]
    assert plain[-1][0] == "kv.past_len_beyond_committed", plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
@pytest.mark.parametrize("greedy", [False, True], ids=["prearm", "greedy"])
def test_a_stream_closed_then_released_leaves_its_sequence_free(calbin, greedy, threads):
    """The order docs/embedding.md §3 gives an embedder: take a step, ``close()`` the stream,
    ``release_sequence``. On the stepped executor a greedy stream's ``close()`` left the step
    it fired ahead (cancelled, never taken) in the queue, its KV txn open, so the release
    answered ``kv.sequence_busy`` ("a bug in the order above": the id withheld for good) where
    a pre-armed stream's answers ``OK``. ``close()`` now drives the executor until that step
    ended; the sequence then takes a new prefill."""
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(
        calbin_path=calbin, threads=threads, check_lock_order=True, strict_lock_order=False))
    assert ex.start().ok
    try:
        end = ex.clock.monotonic() + 30.0
        if threads:  # the caller waits for each step: the completion thread fires ahead
            assert ex.device.emu.set_latency(decode_us=20000) == 0
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 16))
        _drive(ex, first)
        result = first.wait_until(end)
        assert isinstance(result, InferenceResult), result
        stream = ex.decode_stream(1, result.kv_len, end, greedy_ahead=greedy)
        for _ in range(8):  # (greedy: until one step was fired ahead)
            result = stream.step(result.argmax)
            assert isinstance(result, InferenceResult), result
            if not greedy or stream.ahead is not None:
                break
        if greedy:
            ahead = stream.ahead
            assert ahead is not None and ahead[1] is not None, "nothing was fired ahead"
        closed = stream.close()
        assert closed.code == "request.cancelled", closed
        assert stream.quiet
        released = ex.release_sequence(1, wait_s=5.0)
        assert released.ok, released
        again = ex.enqueue(prefill(1, PROMPT))
        _drive(ex, again)
        again_result = again.wait_until(end)
        assert isinstance(again_result, InferenceResult), again_result
        assert again_result.kv_len == len(PROMPT)
    finally:
        ex.shutdown(5.0)


@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
def test_a_kv_wait_beside_an_armed_step_answers_as_the_plain_path(calbin, threads):
    """Stop 62: another sequence's request waits for KV no one frees (a KV of 3 blocks, all
    held) until its deadline while the stream's next step is armed (or fired ahead): it
    answers as beside the plain path (``kv.deadline``, RESOURCE_EXHAUSTED), and so do the
    stream's steps after."""
    answers = _differential(calbin, "kv_wait", threads,
                            device_config="kv_blocks=3;kv_block_size=16")
    plain = answers["enqueue"]
    assert plain[-1][0] == "kv.deadline", plain
    assert [a[0] for a in plain[:-1]] == ["ok"] * (len(plain) - 1), plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("capacity", [1, 2], ids=["phase_a", "phase_b"])
@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
def test_a_request_beside_the_step_fired_ahead_answers_as_the_plain_path(calbin, threads,
                                                                         capacity):
    """Stop 62: another sequence's prefill queued beside the stream's steps (the step fired
    ahead queued, or on the device; Phase B: two jobs in flight): every step and that
    request answer as beside the plain path."""
    answers = _differential(calbin, "beside", threads, inflight_capacity=capacity)
    plain = answers["enqueue"]
    assert [a[0] for a in plain] == ["ok"] * len(plain), plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize("on_device", [False, True], ids=["queued", "on_device"])
def test_a_cancel_while_the_step_fired_ahead_is_queued_or_on_the_device_answers_as_the_plain_path(
        calbin, on_device):
    """Stop 62: the caller gives up (``cancel()``) between the firing ahead and the adoption,
    the step fired ahead queued or already on the device (the stepped executor, one submit
    later): the next step is cancelled on every path."""
    answers = _differential(calbin, "cancel", False, on_device=on_device)
    plain = answers["enqueue"]
    assert plain[-1][0] == "request.cancelled", plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


def _early_history(calbin, path: str, threads: bool) -> list[tuple]:
    """The stream opened, and its first token sent, before the prefill's result is read (the
    prefill queued, or on the device); then the prefill's result, and two steps with the
    argmax (a stream closed by a refused step is opened again, as a server's next request
    would)."""
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(
        calbin_path=calbin, threads=threads, check_lock_order=True, strict_lock_order=False))
    assert ex.start().ok
    end = ex.clock.monotonic() + 30.0
    try:
        if threads:  # the prefill is on the device when the first token comes
            assert ex.device.emu.set_latency(prefill_per_token_us=250000) == 0
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 16))
        if threads:
            until(lambda: first.state == "Submitted",
                  what="the prefill on the device")
        caller = _Caller(ex, path, len(PROMPT), end)
        answers = [_answer(caller.step(0))]
        _drive(ex, first)
        result = first.wait_until(end)
        answers.append(_answer(result))
        assert isinstance(result, InferenceResult), result
        for _ in range(2):
            if caller.stream is not None and caller.stream.closed:
                caller.stream = ex.decode_stream(1, caller.past, end,
                                                 greedy_ahead=path == "greedy")
            result = caller.step(result.argmax)
            answers.append(_answer(result))
            if not isinstance(result, InferenceResult):
                break
        if caller.stream is not None:
            caller.stream.close()
        return answers
    finally:
        ex.shutdown(5.0)


@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
def test_a_stream_whose_first_token_comes_before_the_prefill_result_answers_as_the_plain_path(
        calbin, threads):
    """Stop 62: a stream opened, and its first token sent, while its sequence's prefill is
    still queued (or on the device): the plain path refuses that token (``kv.sequence_busy``,
    the prefill's job open); so must a pre-armed and a greedy stream, and the steps after the
    prefill's result answer alike."""
    answers = {path: _early_history(calbin, path, threads) for path in PATHS}
    plain = answers["enqueue"]
    assert plain[0][0] == "kv.sequence_busy", plain
    assert [a[0] for a in plain[1:]] == ["ok"] * 3, plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)
