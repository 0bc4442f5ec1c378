"""Found at stop 52 by an embedder writing its own server on the executor (docs/embedding.md):
misuse of the documented API that the page's promises did not survive. Every case runs on the
bundled emulator through the public API.

No timing threshold: every wait is bounded, and a bound that is reached fails the test.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.clock import SYSTEM
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.job import InferenceResult, Job, JobHandle
from executor_harness import (
    MANIFEST,
    deadline,
    decode,
    expected_greedy,
    prefill,
    running_executor,
    running_job_path,
    until,
    write_calbin,
)

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
BOUND_S = 30.0  # a hang guard: reaching it fails the test
SMALL_KV = "kv_blocks=4;kv_block_size=16;max_seqs=8"  # 64 tokens of KV in all


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


# ---- a deadline centuries away ----------------------------------------------------------------
@pytest.mark.parametrize("far", [1e12, 1e300], ids=["monotonic+1e12", "1e300"])
def test_an_admission_wait_with_a_deadline_centuries_away_waits_for_the_kv(calbin, far):
    """docs/embedding.md: a deadline is any absolute time.monotonic() value; one far away is
    accepted and never passes. A request whose admission had to wait for KV with a finite
    deadline beyond ``threading.TIMEOUT_MAX`` (about 292 years) was failed at once with
    ``internal.unexpected_exception: enqueue raised OverflowError: timestamp out of range
    for platform time_t`` (INTERNAL, a 500), though a job with the same deadline that found
    its KV free ran. It now waits for the KV like any other request."""
    with running_job_path(calbin, device_config=SMALL_KV) as ex:
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=64)).wait_until(deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first  # all the KV is seq 1's now
        request = prefill(2, PROMPT, seconds=far, kv_reserve_len=16)  # monotonic() + far
        assert request.deadline > time.monotonic() + threading.TIMEOUT_MAX
        got: dict[str, object] = {}

        def admit() -> None:
            handle = ex.enqueue(request)
            got["result"] = handle.wait_until(deadline(BOUND_S))

        waiter = threading.Thread(target=admit, name="admit-far")
        waiter.start()
        released = False
        try:
            until(lambda: ex.kvc.waiting == 1 or "result" in got, BOUND_S,
                  "the far-deadline request waiting for KV")
            assert "result" not in got, got  # it waits: it was not failed at once
            released = ex.release_sequence(1).ok
            assert released
        finally:
            if not released:
                ex.shutdown(5.0)  # a failed test: end the wait (the KV never comes back)
            waiter.join(BOUND_S)
        assert not waiter.is_alive()
        result = got["result"]
        assert isinstance(result, InferenceResult), result
        assert result.argmax == expected_greedy(PROMPT, 0)[0]
        assert ex.release_sequence(2, 1.0).ok
        assert ex.health() == []


def test_the_clock_waits_past_timeout_max_instead_of_raising():
    """The one place every executor wait goes through (machines/clock.py): a timeout beyond
    ``threading.TIMEOUT_MAX`` raised OverflowError from ``Condition.wait``."""
    cond = threading.Condition()
    notifier = threading.Thread(target=lambda: (cond.acquire(), cond.notify_all(),
                                                cond.release()), name="notifier")
    with cond:
        notifier.start()  # it notifies once this thread waits (it needs the lock)
        assert SYSTEM.wait(cond, threading.TIMEOUT_MAX * 10) is True
    notifier.join(BOUND_S)
    assert not notifier.is_alive()
    event = threading.Event()
    setter = threading.Timer(0.0, event.set)
    setter.start()
    assert SYSTEM.wait_event(event, 1e300) is True
    setter.join(BOUND_S)


# ---- a done callback raising what is no Exception ---------------------------------------------
def _cancelled_future_result() -> None:
    loop = asyncio.new_event_loop()
    try:
        future = loop.create_future()
        future.cancel()
        future.result()  # raises asyncio.CancelledError, a BaseException
    finally:
        loop.close()


def _exit() -> None:
    raise SystemExit(3)


def _interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize("raiser", [_cancelled_future_result, _exit, _interrupt],
                         ids=["CancelledError", "SystemExit", "KeyboardInterrupt"])
def test_a_done_callback_raising_a_base_exception_never_ends_the_completion_thread(
        calbin, raiser, caplog):
    """docs/embedding.md section 4: an exception a done callback raises is logged on
    ``calexec.job`` and never reaches the executor's thread. A callback raising a
    BaseException that is no Exception (``asyncio.CancelledError`` from reading a cancelled
    future's ``result()``, ``sys.exit()``) passed through and ended ``calexec-completion``:
    health said the thread was not running, every later job waited until its deadline and
    shutdown ended ``shutdown.not_drained`` (Failed). Now it is logged like any other."""
    with running_job_path(calbin) as ex, caplog.at_level(logging.ERROR, logger="calexec.job"):
        first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first
        ran = threading.Event()

        def callback(_handle) -> None:
            ran.set()
            raiser()

        handle = ex.enqueue(decode(1, first.argmax, first.kv_len),
                            on_created=lambda h: h.add_done_callback(callback))
        second = handle.wait_until(deadline(BOUND_S))
        assert isinstance(second, InferenceResult), second
        assert ran.wait(BOUND_S)
        # the next job needs the completion thread: it is served
        third = ex.enqueue(decode(1, second.argmax, second.kv_len)).wait_until(
            deadline(BOUND_S))
        assert isinstance(third, InferenceResult), third
        assert [first.argmax, second.argmax, third.argmax] == expected_greedy(PROMPT, 2)
        assert all(ex.threads_alive().values()), ex.threads_alive()
        assert ex.health() == []
        assert any(r.name == "calexec.job" and f"job {handle.job_id} raised" in r.getMessage()
                   for r in caplog.records)
        assert ex.release_sequence(1, 1.0).ok
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


@pytest.mark.parametrize("raiser", [_exit, _interrupt], ids=["SystemExit", "KeyboardInterrupt"])
def test_a_ctrl_c_in_a_callback_run_at_once_on_the_main_thread_is_raised_on(calbin, raiser):
    """The other side of the test above: ``add_done_callback`` on a job already resolved runs
    the callback at once on the caller's thread. On the main thread a ``KeyboardInterrupt``
    or ``SystemExit`` there is the embedder's own Ctrl-C or exit: it is raised on, not
    logged and swallowed (the first fix swallowed it on every thread)."""
    assert threading.current_thread() is threading.main_thread()
    with running_job_path(calbin) as ex:
        handle = ex.enqueue(prefill(1, PROMPT))
        assert isinstance(handle.wait_until(deadline(BOUND_S)), InferenceResult)
        with pytest.raises((KeyboardInterrupt, SystemExit)):
            handle.add_done_callback(lambda _handle: raiser())
        assert ex.release_sequence(1, 1.0).ok
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


# ---- a done callback calling shutdown or decode_sync ------------------------------------------
@pytest.mark.parametrize("call", ["shutdown", "decode_sync", "enqueue"])
def test_shutdown_or_decode_sync_from_a_done_callback_raises_naming_it_and_changes_nothing(
        calbin, call):
    """A done callback runs on ``calexec-completion``. ``shutdown()`` there stopped admission,
    then raised ``RuntimeError: cannot join current thread`` and left the executor Draining
    (not admitting) until another thread shut it down; ``decode_sync()`` there waited for a
    job that only that same thread could complete, so every other job stalled until the
    deadline and a shutdown meanwhile ended ``shutdown.not_drained`` (Failed). Both now raise
    a RuntimeError naming the call and the thread at once (logged on ``calexec.job``, as any
    exception of a callback), and the executor serves on. ``enqueue()`` there (stop 53) was
    taken: an admission that had to wait for KV or a buffer held the completion thread until
    its deadline, every other job with it (a job whose KV was free took the callback's whole
    deadline); it is refused the same way, whether its admission would wait or not."""
    with running_executor(calbin) as ex:
        first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first
        seen: dict[str, object] = {}
        ran = threading.Event()

        def callback(_handle) -> None:
            seen["thread"] = threading.current_thread().name
            try:
                if call == "shutdown":
                    seen["answer"] = ex.shutdown(2.0)
                elif call == "enqueue":
                    seen["answer"] = ex.enqueue(prefill(2, PROMPT, seconds=BOUND_S))
                else:
                    seen["answer"] = ex.decode_sync(prefill(2, PROMPT, seconds=BOUND_S))
            except RuntimeError as exc:
                seen["error"] = str(exc)
            finally:
                ran.set()

        handle = ex.enqueue(decode(1, first.argmax, first.kv_len),
                            on_created=lambda h: h.add_done_callback(callback))
        second = handle.wait_until(deadline(BOUND_S))
        assert isinstance(second, InferenceResult), second
        assert ran.wait(BOUND_S)
        assert seen["thread"] == "calexec-completion"
        assert "answer" not in seen, seen
        assert f"{call}()" in str(seen["error"]) and "calexec-completion" in str(seen["error"])
        assert ex.state == "Ready" and ex.health() == []
        third = ex.enqueue(decode(1, second.argmax, second.kv_len)).wait_until(
            deadline(BOUND_S))
        assert isinstance(third, InferenceResult), third
        assert [first.argmax, second.argmax, third.argmax] == expected_greedy(PROMPT, 2)
        assert ex.release_sequence(1, 1.0).ok and ex.release_sequence(2, 1.0).ok
        status = ex.shutdown(5.0)
        assert status.ok and ex.state == "Stopped", status


def test_shutdown_from_a_done_callback_on_a_thread_of_the_callers_own_still_works(calbin):
    """The refusal is only for the executor's own threads: a callback that runs on the
    caller's thread (registered on a job already resolved) may shut down."""
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(1, PROMPT))
        assert isinstance(handle.wait_until(deadline(BOUND_S)), InferenceResult)
        assert ex.release_sequence(1, 1.0).ok
        answers: list[Status] = []
        handle.add_done_callback(lambda _h: answers.append(ex.shutdown(5.0)))
        assert len(answers) == 1 and answers[0].ok, answers
        assert ex.state == "Stopped"


# ---- cancelling the task that awaits wait_async -----------------------------------------------
def test_cancelling_the_awaiting_task_as_the_result_arrives_raises_cancelled_error():
    """docs/embedding.md section 4: cancelling the task that awaits ``wait_async`` (a client
    that disconnected) stops the observation. On Python 3.11 ``asyncio.wait_for``, which
    ``wait_async`` used, swallowed a cancel that came once the job's result was already
    scheduled on the loop: ``await`` returned the result, the task ran on as if never
    cancelled (``cancelling()`` stuck at 1), so a handler whose client left went on
    generating and an enclosing ``asyncio.timeout`` never fired. Now the task gets its
    CancelledError, and the job's registration is gone."""
    done = Status.cancelled(Phase.CANCEL, "resolved by the test")

    def resolve_now(job: Job) -> None:
        resolver = threading.Thread(target=job.resolve, args=(done,), name="resolver")
        resolver.start()
        resolver.join(BOUND_S)
        assert not resolver.is_alive()

    async def main() -> list[str]:
        seen = []
        job = Job(1, 1, decode(1, 5, 0), on_cancel=lambda: None)
        handle = JobHandle(job)
        task = asyncio.create_task(handle.wait_async(deadline(BOUND_S)))
        await asyncio.sleep(0)  # the task awaits the job
        resolve_now(job)  # the result is scheduled on the loop, not yet delivered
        assert task.cancel()
        try:
            await asyncio.wait_for(task, BOUND_S)
            seen.append("returned")
        except asyncio.CancelledError:
            seen.append("cancelled")
        assert handle.pending_callbacks == 0 and job.done

        # the same inside asyncio.timeout: what follows the await must not run
        job = Job(2, 1, decode(1, 5, 0), on_cancel=lambda: None)
        handle = JobHandle(job)
        after: list[str] = []

        async def handler() -> None:
            async with asyncio.timeout(BOUND_S):
                await handle.wait_async(deadline(BOUND_S))
            after.append("ran on")
            await asyncio.sleep(0)

        task = asyncio.create_task(handler())
        await asyncio.sleep(0)
        resolve_now(job)
        assert task.cancel()
        try:
            await asyncio.wait_for(task, BOUND_S)
        except asyncio.CancelledError:
            seen.append("handler cancelled")
        seen.extend(after)
        return seen

    assert asyncio.run(main()) == ["cancelled", "handler cancelled"]


def test_wait_async_still_returns_the_result_or_its_deadline_status():
    """The other answers of ``wait_async`` stay what they were: the result when the job is
    resolved first, ``wait.deadline`` (the job not cancelled, nothing registered) when the
    deadline passes first."""
    done = Status.cancelled(Phase.CANCEL, "resolved by the test")

    async def main() -> tuple[object, object, Job]:
        job = Job(1, 1, decode(1, 5, 0), on_cancel=lambda: None)
        handle = JobHandle(job)
        task = asyncio.create_task(handle.wait_async(deadline(BOUND_S)))
        await asyncio.sleep(0)
        resolver = threading.Thread(target=job.resolve, args=(done,), name="resolver")
        resolver.start()
        resolved = await asyncio.wait_for(task, BOUND_S)
        resolver.join(BOUND_S)
        late = Job(2, 1, decode(1, 5, 0), on_cancel=lambda: None)
        expired = await JobHandle(late).wait_async(time.monotonic() - 1.0)
        return resolved, expired, late

    resolved, expired, late = asyncio.run(main())
    assert resolved == done.with_context(job_id=1, seq_id=1, generation=1)
    assert isinstance(expired, Status) and expired.code == "wait.deadline"
    assert not late.done and not late.cancel_flag and JobHandle(late).pending_callbacks == 0


# ---- shutdown while start() runs on another thread --------------------------------------------
SLOW_WARMUP = "prefill_per_token_us=30000;decode_us=30000"  # the golden run takes a while


def _starting(calbin: str):
    """A DeviceExecutor whose start() runs on a thread of its own, returned once it is in
    the golden warm-up; and a dict that gets start's answer."""
    ex = DeviceExecutor(CalRT.load(), MANIFEST,
                        ExecutorConfig(calbin_path=calbin, device_config=SLOW_WARMUP))
    answers: dict[str, object] = {}

    def start() -> None:
        try:
            answers["start"] = ex.start()
        except BaseException as exc:  # noqa: BLE001 - reported to the test
            answers["start"] = exc

    starter = threading.Thread(target=start, name="starter")
    starter.start()
    until(lambda: ex.state == "Warming" or "start" in answers, BOUND_S, "start warming up")
    assert "start" not in answers, answers  # still warming up: the shutdown meets it
    return ex, starter, answers


def test_shutdown_while_start_warms_up_on_another_thread_waits_for_it_and_ends_stopped(
        calbin):
    """A server's SIGTERM handler shutting down while ``start()`` (run on the server's pool,
    as docs/embedding.md says) is in its golden warm-up tore down beside it: start failed
    (``lifecycle.unavailable: generation 1 is closing``), and shutdown, depending on the
    instant, raised ``AttributeError: 'NoneType' object has no attribute 'released'`` (a
    generation start had just released); the executor ended Failed. Now shutdown lets start
    end first
    (half of its grace), then drains as usual: OK, Stopped, start answered OK, no thread
    left."""
    ex, starter, answers = _starting(calbin)
    status = ex.shutdown(BOUND_S)
    starter.join(BOUND_S)
    assert not starter.is_alive()
    assert isinstance(answers["start"], Status) and answers["start"].ok, answers
    assert status.ok and ex.state == "Stopped", status
    assert not any(ex.threads_alive().values()), ex.threads_alive()
    assert ex.health() == ["lifecycle is Stopped, not admitting"]
    assert ex.shutdown(1.0).ok  # idempotent


def test_shutdown_with_no_grace_during_start_is_start_busy_then_starts_failure(calbin):
    """With no grace for start to end on its own, shutdown interrupts it (its golden run is
    refused) and answers ``shutdown.start_busy``, tearing nothing down beside it; start then
    answers a Status naming the shutdown and completes that shutdown: its golden job (if the
    device holds it) is waited for within its deadline, and the lifecycle ends Stopped, as a
    later shutdown answers (until stop 61: Failed, with the device open while that job ran)."""
    ex, starter, answers = _starting(calbin)
    status = ex.shutdown(0.0)
    assert status.code == "shutdown.start_busy", status
    starter.join(BOUND_S)
    assert not starter.is_alive()
    started = answers["start"]
    assert isinstance(started, Status) and not started.ok, answers
    assert "interrupted by shutdown()" in started.message
    assert ex.state == "Stopped", (ex.state, ex.failure)
    again = ex.shutdown(1.0)
    assert again.ok, again
    assert not any(ex.threads_alive().values()), ex.threads_alive()


# ---- enqueue's on_created ----------------------------------------------------------------------
@pytest.mark.parametrize("on_created", [3, "cancel"], ids=["int", "str"])
def test_an_on_created_that_is_not_callable_raises_naming_it_before_anything_is_created(
        calbin, on_created):
    """``enqueue(request, on_created=...)`` with something that is not callable raised
    ``TypeError: 'int' object is not callable`` from inside ``enqueue``, naming neither the
    argument nor the call, after a job had been created for it (the error of a caller's
    argument, as ``add_done_callback`` names ``fn``). Now a TypeError naming ``on_created``
    before any job exists; the executor serves on."""
    with running_job_path(calbin) as ex:
        before = ex.snapshot()
        with pytest.raises(TypeError, match=r"enqueue: on_created=.*expected a callable"):
            ex.enqueue(prefill(1, PROMPT), on_created=on_created)
        after = ex.snapshot()
        assert {key: after[key] for key in ("submitted", "failed", "queued", "inflight")} == \
            {key: before[key] for key in ("submitted", "failed", "queued", "inflight")}
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result
        assert ex.release_sequence(1, 1.0).ok and ex.health() == []
