"""Found at stop 53 by an embedder writing its own server on the executor (docs/embedding.md):
what the page promises, checked with small programs on the bundled emulator through the public
API (``DeviceExecutor``, ``ExecutorConfig``, ``InferenceRequest``, handles, decode streams).

No timing threshold: every wait is bounded, and a bound that is reached fails the test.
"""

from __future__ import annotations

import threading
import time

import pytest

from calexec.contracts.status import Status
from calexec.machines.job import InferenceResult, JobHandle
from executor_harness import (
    deadline,
    decode,
    prefill,
    running_executor,
    running_job_path,
    until,
    write_calbin,
)

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
BOUND_S = 30.0  # a hang guard: reaching it fails the test
#: a prefill of PROMPT takes 8 x 60 ms of device time: long enough to shut down beside it
SLOW_PREFILL = "prefill_per_token_us=60000"
SMALL_KV = "kv_blocks=4;kv_block_size=16;max_seqs=8"  # 64 tokens of KV in all
#: a decode step takes 300 ms of device time: a stream deadline passes while one runs
SLOW_DECODE = "decode_us=300000"


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


# ---- two shutdowns at once ---------------------------------------------------------------------
def test_a_shutdown_beside_another_threads_shutdown_waits_for_it_not_for_a_recovery(calbin):
    """docs/embedding.md section 6: shutdown is idempotent, and ``shutdown.recovery_busy``
    means a recovery or model switch outlived the grace and nothing was torn down. A second
    ``shutdown`` called while another thread's drained a job (a SIGTERM handler's beside a
    ``finally``) found ``recovery_mu`` held by that shutdown and answered
    ``shutdown.recovery_busy`` ("a recovery or model switch still runs ...; nothing was torn
    down") though no recovery ran and the other call was tearing everything down: a server
    exiting on it (exit 3) reported a state that never was. It now waits for the other
    shutdown within its grace: past it ``shutdown.in_progress``; within it, the answer of a
    call after it (OK, Stopped)."""
    with running_executor(calbin, device_config=SLOW_PREFILL) as ex:
        job = ex.enqueue(prefill(1, PROMPT, seconds=BOUND_S))
        until(lambda: ex.snapshot()["inflight"] == 1, BOUND_S, "the prefill on the device")
        answers: dict[str, Status] = {}

        def shut(name: str, grace: float) -> None:
            answers[name] = ex.shutdown(grace)

        first = threading.Thread(target=shut, args=("first", BOUND_S), name="shutdown-first")
        first.start()
        until(lambda: ex.state == "Draining" or "first" in answers, BOUND_S,
              "the first shutdown draining")
        short = threading.Thread(target=shut, args=("short", 0.05), name="shutdown-short")
        patient = threading.Thread(target=shut, args=("patient", BOUND_S),
                                   name="shutdown-patient")
        short.start()
        patient.start()
        for thread in (first, short, patient):
            thread.join(BOUND_S)
            assert not thread.is_alive(), thread.name
        assert answers["first"].ok, answers["first"]
        assert ex.state == "Stopped"
        assert isinstance(job.wait_until(deadline(BOUND_S)), InferenceResult)
        # the short one gave up waiting while the first drained: it says so, not "recovery"
        short_answer = answers["short"]
        assert short_answer.code == "shutdown.in_progress", short_answer
        assert "recovery" not in short_answer.message, short_answer
        # the patient one waited for the first and answers as a call after it
        assert answers["patient"].ok, answers["patient"]
        assert ex.shutdown(1.0).ok  # and later calls too


# ---- cancelling a decode stream whose step waits in admission ---------------------------------
def test_cancelling_a_stream_ends_a_step_that_waits_for_kv_at_once(calbin):
    """docs/embedding.md section 2: a request's admission may wait for KV (a prefill without
    ``kv_reserve_len`` reserves only its prompt, so a decode step past its last block needs
    one more), and ``DecodeSteps.cancel()`` cancels the stream's job "from any thread" (a
    client disconnect handler calls it). A step whose job the stream admitted itself (nothing
    was armed: no KV for it) was out of its reach while it waited: ``cancel()`` answered False
    and the step waited on, holding the owner's thread and the sequence, until the stream's
    deadline, and then answered ``kv.deadline`` (a 429, "retry later") for a client that had
    left. Now the wait ends at once, CANCELLED, and the stream is closed."""
    block = 16
    with running_job_path(calbin, device_config=SMALL_KV) as ex:
        # seq 2 holds exactly one block; seq 1 reserves the other three
        prompt = list(range(1, block + 1))
        two = ex.enqueue(prefill(2, prompt)).wait_until(deadline(BOUND_S))
        assert isinstance(two, InferenceResult) and two.kv_len == block, two
        one = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=3 * block)).wait_until(
            deadline(BOUND_S))
        assert isinstance(one, InferenceResult), one
        stream = ex.decode_stream(2, two.kv_len, deadline(BOUND_S))
        answers: list[object] = []
        owner = threading.Thread(target=lambda: answers.append(stream.step(two.argmax)),
                                 name="stream-owner")
        owner.start()
        try:
            until(lambda: ex.kvc.waiting == 1 or bool(answers), BOUND_S,
                  "the step waiting for a KV block")
            assert not answers, answers  # it waits: seq 1 holds every other block
            assert stream.cancel()  # something was still running: the step's admission
            owner.join(BOUND_S / 3)  # far less than the stream's deadline
            assert not owner.is_alive(), "the step still waits for KV after cancel()"
        finally:
            if owner.is_alive():
                ex.release_sequence(1)  # a failed test: let the step end
                owner.join(BOUND_S)
        answer = answers[0]
        assert isinstance(answer, Status) and answer.code == "request.cancelled", answer
        assert stream.closed
        assert ex.kvc.waiting == 0
        assert stream.close().code == "request.cancelled"
        assert ex.release_sequence(2, 1.0).ok and ex.release_sequence(1, 1.0).ok


# ---- a decode stream's deadline passing while its step runs ---------------------------------------
@pytest.mark.parametrize("greedy_ahead", [False, True], ids=["prearmed", "greedy-ahead"])
def test_a_stream_step_past_its_deadline_leaves_the_sequence_releasable(calbin, greedy_ahead):
    """docs/embedding.md section 3: once a request's last job is resolved and its stream
    closed, ``release_sequence`` gives the id back; ``kv.sequence_busy`` means the caller broke
    that order. ``DecodeSteps.wait`` (so ``step``) past the stream's deadline cancels its step
    and closes the stream, but returned at once with the cancelled step still on the device:
    ``close()`` returned at once too, ``quiet`` said nothing was left, and
    ``release_sequence(seq, 1.0)`` answered ``kv.sequence_busy`` (INVALID_REQUEST, "a bug in
    the order above") to a caller of ``step()``, which holds no handle to wait on (it would
    withhold a good id). ``decode_sync`` waits for the job it cancelled; ``wait()`` now does
    too (bounded by ``cancelled_job_bound``), so the sequence may be released at once."""
    with running_job_path(calbin, device_config=SLOW_DECODE) as ex:
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 8)).wait_until(
            deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first
        stream = ex.decode_stream(1, first.kv_len, time.monotonic() + 0.1,
                                  max_len=len(PROMPT) + 8, greedy_ahead=greedy_ahead)
        answer = stream.step(first.argmax)  # 300 ms of device time: the deadline passes
        assert isinstance(answer, Status) and answer.code == "wait.deadline", answer
        assert stream.closed
        stream.close()
        assert stream.quiet
        released = ex.release_sequence(1, 1.0)
        assert released.ok, released
        again = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(again, InferenceResult) and again.argmax == first.argmax, again


# ---- KV waiters and the other sequences' jobs ------------------------------------------------------
def test_kv_waiters_sleep_through_other_sequences_jobs_and_wake_on_the_release(calbin):
    """Spec FI04, docs/architecture.md "Every wait is bounded": a request waiting for KV is
    woken by a release, never polls. Every job's KV commit woke every KV waiter of the
    executor (``notify_all`` with a new capacity epoch, though a commit gives nothing back),
    and each asked ``canAllocate`` again and slept on: one wake-up per waiter per token of
    any sequence (3 waiters, 20 decode steps elsewhere: 53 wake-ups), a busy loop paced by the
    device under KV pressure, taking the GIL from the jobs that run. Now a waiter sleeps
    through the other sequences' jobs and wakes when KV is given back."""
    steps = 20
    with running_job_path(calbin, device_config=SMALL_KV) as ex:
        held = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=64)).wait_until(deadline(BOUND_S))
        assert isinstance(held, InferenceResult), held  # seq 1 holds all the KV
        answers: dict[int, object] = {}

        def wait_for_kv(seq: int) -> None:
            handle = ex.enqueue(prefill(seq, PROMPT, seconds=BOUND_S, kv_reserve_len=16))
            answers[seq] = handle.wait_until(deadline(BOUND_S))

        waiters = [threading.Thread(target=wait_for_kv, args=(seq,), name=f"kv-waiter-{seq}")
                   for seq in (2, 3, 4)]
        try:
            # one at a time: each that joins the KV queue behind others wakes those once (its
            # head retries: a "no" may have been transient), so after the k-th joined there
            # were 0 + 1 + ... + (k - 1) wake-ups; counted, they are over
            for joined, thread in enumerate(waiters, start=1):
                thread.start()
                woken = joined * (joined - 1) // 2
                until(lambda joined=joined, woken=woken: (
                    ex.kvc.waiting == joined and ex.kvc.wakeups == woken) or bool(answers),
                    BOUND_S, f"{joined} request(s) waiting for KV, {woken} wake-up(s) over")
            assert not answers, answers
            before = ex.kvc.wakeups
            token, past = held.argmax, held.kv_len
            for _ in range(steps):  # seq 1 decodes within its reservation: nothing given back
                result = ex.enqueue(decode(1, token, past)).wait_until(deadline(BOUND_S))
                assert isinstance(result, InferenceResult), result
                token, past = result.argmax, result.kv_len
            assert ex.kvc.wakeups == before, (
                f"{ex.kvc.wakeups - before} wake-ups of {len(waiters)} KV waiters in {steps} "
                "decode steps of another sequence, with no KV given back")
            assert ex.kvc.waiting == len(waiters) and not answers
        finally:
            released = ex.release_sequence(1, 1.0)
            for thread in waiters:
                if thread.is_alive() or thread.ident is not None:
                    thread.join(BOUND_S)
        assert released.ok, released
        assert not any(thread.is_alive() for thread in waiters)
        for seq in (2, 3, 4):  # the release woke them: each got its KV
            assert isinstance(answers[seq], InferenceResult), (seq, answers[seq])
            assert ex.release_sequence(seq, 1.0).ok


def test_an_on_created_that_raises_leaves_its_handle_resolved_on_the_plain_path(calbin):
    """``enqueue(request, on_created=fn)`` with an ``fn`` that keeps the handle (a disconnect
    handler's registry) and then raises: the exception reaches the caller, as on the
    guess-adoption path, but on the plain path the job it had been given stayed Created and
    unresolved for good (its done callbacks never ran; a ``wait_until`` on it waited out its
    deadline). Now it is resolved first, ``internal.on_created_raised`` (found by the embedder
    probe, fixed by the lead), and nothing else of the executor moved."""
    with running_job_path(calbin) as ex:
        kept: list[JobHandle] = []
        called: list[object] = []

        def on_created(handle: JobHandle) -> None:
            kept.append(handle)
            handle.add_done_callback(lambda h: called.append(h.result()))
            raise ValueError("registry full")

        with pytest.raises(ValueError, match="registry full"):
            ex.enqueue(prefill(1, PROMPT), on_created=on_created)
        assert len(kept) == 1 and kept[0].done, kept
        result = kept[0].wait_until(deadline(1.0))
        assert isinstance(result, Status) and result.code == "internal.on_created_raised", result
        assert "ValueError: registry full" in (result.message or ""), result
        assert called == [result]
        again = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(again, InferenceResult), again
        assert ex.release_sequence(1, 1.0).ok
