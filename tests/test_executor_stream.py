"""The pre-armed decode stream (issue 17, machines/stream.py): the next decode job is admitted
and prepared while the current one runs; the token is all a step hands over.

Correctness against the enqueue path and the oracle, and release exactly once (lease, KV txn
rolled back, chart Failed, budget) when the job between pre-arm and submit is cancelled, passes
its deadline, its stream closes, the job before it fails on the device, its preparation fails,
or its generation is replaced by a recovery (fencing: it never reaches generation N+1).
No timing threshold: waits are bounded polls on conditions.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.job import InferenceResult, job_of
from executor_harness import (
    arm,
    deadline,
    decode,
    expected_greedy,
    fired,
    greedy,
    prefill,
    running_executor,
    running_job_path,
    settle,
    until,
    write_calbin,
)

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def open_stream(ex, seq: int, steps: int, seconds: float = 10.0, **kw):
    """Prefill ``PROMPT`` reserving the KV of ``steps`` decodes (as the server does), then a
    stream from its end; returns (stream, first token)."""
    ex.kvc.reset_sequence(seq)
    result = ex.enqueue(prefill(seq, PROMPT, kv_reserve_len=len(PROMPT) + steps)).wait_until(
        deadline())
    assert isinstance(result, InferenceResult), result
    return ex.decode_stream(seq, result.kv_len, deadline(seconds), **kw), result.argmax


def assert_released(ex, seq: int) -> None:
    """Nothing of the stream is held: no armed job, every slot Free, no KV txn open or
    chained, no budget taken, no permit held."""
    until(lambda: not ex.dispatch.armed_jobs() and not ex.snapshot()["dispatch"]["to_arm"]
          and not ex.snapshot()["dispatch"]["arm_later"]
          and not ex.kvc.seqs[seq].next_txn, what="armed jobs released")
    snap = settle(ex)
    assert snap["pending_tokens"] == 0 and snap["inflight"] == 0, snap
    assert ex.pool.counts()["Leased"] == 0 and ex.pool.counts()["InFlight"] == 0
    view = ex.kvc.seqs[seq]
    assert view.open_txn is None and view.next_txn is None, view
    assert ex.locks.violations == []


def test_stream_tokens_identical_to_enqueue_and_oracle_every_step_prearmed(calbin):
    steps = 24
    with running_job_path(calbin) as ex:
        direct = greedy(ex, 1, PROMPT, steps)
        row = np.empty(ex.generation.vocab_size, np.float32)
        stream, token = open_stream(ex, 2, steps, logits_out=row)
        out = [token]
        with stream:
            for _ in range(steps):
                result = stream.step(out[-1])
                assert isinstance(result, InferenceResult), result
                assert result.logits.base is row or result.logits is row  # the caller's row
                out.append(result.argmax)
        assert out == direct == expected_greedy(PROMPT, steps)
        # the first job is armed when the stream opens; later ones by the submitter once it
        # is idle, which may come after the step they were for on a busy host (then the step
        # admits its job itself): the stepped test below pins the order
        assert 1 <= stream.prearmed_steps <= steps
        assert ex.kvc.seqs[2].committed_len == len(PROMPT) + steps
        assert ex.infer_threads == {"calexec-submitter"}  # invariant 2 unchanged
        assert ex.wait_threads == {"calexec-completion"}
        assert_released(ex, 2)
        assert ex.snapshot()["failed"] == 0 and ex.snapshot()["cancelled"] == 0


def test_stepped_every_step_is_prearmed_by_the_submitter_and_tokens_match(calbin):
    """Stepped mode fixes the order: the submitter submits job N, then (idle) arms N+1, then
    the completion step finishes N; so with the KV reserved every step is pre-armed."""
    steps = 12
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stream_stepped(ex, 1, steps)
        out = [token]
        for _ in range(steps):
            handle = stream.submit(out[-1])
            assert job_of(handle).run.state == "Queued"  # only the token was missing
            result = stream.wait()
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
            assert stream.armed is not None and stream.armed in ex.dispatch.armed_jobs()
        assert stream.prearmed_steps == steps
        assert out == expected_greedy(PROMPT, steps)
        assert ex.infer_threads == ex.wait_threads  # stepped: the test thread drives both
        stream.close()
        assert not ex.dispatch.armed_jobs() and ex.pool.counts()["Leased"] == 0
        assert ex.kvc.seqs[1].open_txn is None and ex.snapshot()["pending_tokens"] == 0


def open_stream_stepped(ex, seq: int, steps: int):
    handle = ex.enqueue(prefill(seq, PROMPT, kv_reserve_len=len(PROMPT) + steps))
    while not handle.done and (ex.submit_one() or ex.complete_one()):
        pass
    result = handle.wait_until(deadline())
    assert isinstance(result, InferenceResult), result
    return ex.decode_stream(seq, result.kv_len, deadline()), result.argmax


def test_close_releases_the_armed_job_without_counting_a_failure(calbin):
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 4)
        assert isinstance(stream.step(token), InferenceResult)
        until(lambda: stream.armed is not None, what="next job armed")
        armed = stream.armed
        assert armed.run.state == "Preparing" and armed.lease.held
        assert ex.kvc.seqs[1].open_txn is armed.txn  # promoted when the step committed
        before = ex.snapshot()
        status = stream.close()
        assert status.category is Category.CANCELLED and stream.closed
        assert armed.done and armed.run.state == "Failed"
        assert armed.txn.run.state == "RolledBack"
        assert_released(ex, 1)
        after = ex.snapshot()
        assert (after["failed"], after["cancelled"]) == (before["failed"], before["cancelled"])
        assert stream.step(7) is status  # closed: every later step answers why
        # the sequence goes on through the ordinary path from its committed length
        assert isinstance(ex.enqueue(prefill(1, [3], past=ex.kvc.seqs[1].committed_len))
                          .wait_until(deadline()), InferenceResult)


def test_cancel_between_prearm_and_submit_releases_everything_once(calbin):
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 4)
        armed = stream.armed
        assert armed is not None and armed in ex.dispatch.armed_jobs()
        assert stream.cancel() is True
        until(lambda: armed.done, what="the submitter releasing the cancelled armed job")
        assert armed.result.category is Category.CANCELLED
        assert armed.run.state == "Failed" and armed.txn.run.state == "RolledBack"
        result = stream.step(token)
        assert isinstance(result, Status) and result.category is Category.CANCELLED
        assert stream.closed
        assert_released(ex, 1)
        assert ex.snapshot()["cancelled"] == 1


def test_deadline_between_prearm_and_submit_releases_everything(calbin):
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 4, seconds=0.3)
        armed = stream.armed
        assert armed is not None
        until(lambda: armed.done, what="the submitter expiring the armed job")
        assert armed.result.category is Category.DEADLINE
        result = stream.step(token)
        assert isinstance(result, Status) and result.category is Category.DEADLINE
        assert_released(ex, 1)


@pytest.mark.parametrize("point", ["CCU_EXCEPTION", "WAIT_RC", "OUTPUT_NAN"])
def test_fault_after_submit_rolls_back_the_chained_job_and_closes(calbin, point):
    """Job N fails on the device while N+1 is armed behind it: N+1's KV txn was chained to a
    job that did not commit, so it is rolled back and its slot freed; the stream closes."""
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 6)
        first = stream.step(token)
        assert isinstance(first, InferenceResult)
        arm(ex, point)
        result = stream.step(first.argmax)
        assert isinstance(result, Status), result
        assert fired(ex, point) == 1 and stream.closed
        view = ex.kvc.seqs[1]
        # the submitter may be arming the next job right now: it sees the stream closed
        until(lambda: not ex.dispatch.armed_jobs() and not stream.arming and view.next_txn is None,
              what="armed job released")
        settle(ex)
        assert view.unknown_reason is not None  # §7: a failure after submit is Unknown
        assert view.open_txn is None and view.next_txn is None
        counts = ex.pool.counts()
        assert counts["Leased"] == 0 and counts["InFlight"] == 0
        assert counts["Quarantined"] == 1  # job N's slot only; the armed one went back Free
        assert ex.snapshot()["pending_tokens"] == 0
        assert ex.kvc.reset_sequence(1).ok


def test_prearm_that_fails_to_prepare_is_the_steps_answer_reported_once(calbin):
    """SetCsr fails while the submitter arms the next job: nothing stays armed or held, and
    that step answers the fault, reported and counted once, as ``enqueue`` of the step meets
    it (the plain path). Until stop 67 the step was admitted again and, the fault not
    recurring, succeeded: the runtime's refusal reached no log, no metric and no §8 action."""
    steps = 4
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, steps)
        out = [token]
        result = stream.step(out[-1])
        out.append(result.argmax)
        until(lambda: stream.armed is not None, what="armed")
        # fail the next arm: the one after the step below
        arm(ex, "UNKNOWN_CSR")
        result = stream.step(out[-1])
        assert isinstance(result, InferenceResult), result
        out.append(result.argmax)
        until(lambda: fired(ex, "UNKNOWN_CSR") == 1 and not stream.arming,
              what="the failed pre-arm")
        assert stream.armed is None and not ex.dispatch.armed_jobs()  # the failed arm left nothing armed
        assert not ex.faults.reports and ex.snapshot()["failed"] == 0  # a guess: not yet
        result = stream.step(out[-1])
        assert isinstance(result, Status) and result.code == "calrt.csr_failed", result
        assert result.raw == 4 and stream.closed
        assert [s.code for s in ex.faults.reports] == ["calrt.csr_failed"]
        assert ex.snapshot()["failed"] == 1
        assert out == expected_greedy(PROMPT, steps)[:len(out)]
        assert_released(ex, 1)


def test_armed_job_of_a_replaced_generation_never_reaches_the_next(calbin):
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 4)
        armed = stream.armed
        old = ex.gen
        assert armed is not None and armed.gen is old
        status = ex.recover(Status.internal("test", Phase.RECOVERY, "replace the generation"), reset=False)
        assert status.ok, status
        assert ex.gen is not old and ex.gen.id == old.id + 1
        assert armed.done and armed.result.category is Category.UNAVAILABLE
        assert armed.txn.run.state == "RolledBack"
        past = stream.past_len
        result = stream.step(token)
        # the armed job was a guess: the step is admitted the ordinary way and answers what a
        # plain decode at that position answers in the new generation (its KV is gone)
        plain = ex.enqueue(decode(1, token, past)).wait_until(deadline())
        assert isinstance(result, Status) and isinstance(plain, Status)
        assert result.code == plain.code == "kv.past_len_beyond_committed", (result, plain)
        settle(ex)
        assert ex.gen.pool.counts()["Free"] == len(ex.gen.pool.slots)  # nothing of it taken
        assert ex.snapshot()["queued"] == 0  # (nothing of the old generation queued)
        assert not ex.dispatch.armed_jobs() and ex.locks.violations == []


def test_a_second_stream_is_never_starved_of_a_slot(calbin):
    """Two streams, two decode slots: pre-arming never waits for a slot, so each stream's
    step admits its job even when the other stream's armed job holds one."""
    steps = 6
    with running_job_path(calbin) as ex:
        a, ta = open_stream(ex, 1, steps)
        b, tb = open_stream(ex, 2, steps)
        out_a, out_b = [ta], [tb]
        for _ in range(steps):
            ra, rb = a.step(out_a[-1]), b.step(out_b[-1])
            assert isinstance(ra, InferenceResult) and isinstance(rb, InferenceResult), (ra, rb)
            out_a.append(ra.argmax)
            out_b.append(rb.argmax)
        a.close(), b.close()
        assert out_a == out_b == expected_greedy(PROMPT, steps)
        assert_released(ex, 1)
        assert_released(ex, 2)


def test_invalid_token_and_misuse_are_values(calbin):
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 2)
        handle = stream.submit(token)
        again = stream.submit(token)  # before wait(): one job of a sequence at a time
        assert isinstance(again, Status) and "wait()" in again.message
        assert isinstance(stream.wait(), InferenceResult) and handle.done
        bad = stream.step(-1)
        assert isinstance(bad, Status) and "token=-1" in bad.message and stream.closed
        assert_released(ex, 1)


def test_max_len_stops_arming(calbin):
    """``max_len`` bounds what the stream arms ahead, not what its caller may ask: a step
    beyond it is admitted the ordinary way and answers as a plain request does (here within
    the reservation: served)."""
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 2, max_len=len(PROMPT) + 1)
        result = stream.step(token)
        assert isinstance(result, InferenceResult)
        assert stream.armed is None and not ex.snapshot()["dispatch"]["to_arm"]
        prearmed = stream.prearmed_steps
        over = stream.step(result.argmax)
        assert isinstance(over, InferenceResult), over
        assert stream.prearmed_steps == prearmed  # not armed ahead
        assert [token, result.argmax, over.argmax] == expected_greedy(PROMPT, 2)
        stream.close()
        assert_released(ex, 1)


def test_close_while_the_submitter_arms_returns_with_the_sequence_free(calbin, monkeypatch):
    """close() racing the submitter's arming of the next job: it waits for the arming to end
    (the submitter releases that job itself), so the sequence is free when close() returns.
    Before the fix close() returned at once and a reset right after met kv.sequence_busy."""
    import threading

    entered, release = threading.Event(), threading.Event()
    with running_job_path(calbin) as ex:
        original = ex.admit_armed

        def gated(request, logits_out, arm):
            if arm.prev_txn is not None:  # the submitter arming behind a fired job
                entered.set()
                assert release.wait(10)
            return original(request, logits_out, arm)

        monkeypatch.setattr(ex, "admit_armed", gated)
        stream, token = open_stream(ex, 1, 4)
        assert isinstance(stream.step(token), InferenceResult)
        assert entered.wait(10)  # the submitter is arming the next job now

        def let_go():  # once close() waits for the arming, let the submitter finish it
            until(lambda: stream.closed, what="close() waiting for the arming")
            release.set()

        helper = threading.Thread(target=let_go)
        helper.start()
        try:
            stream.close()
            assert not stream.arming and stream.armed is None
            view = ex.kvc.seqs[1]
            assert view.open_txn is None and view.next_txn is None, view
            assert ex.kvc.reset_sequence(1).ok  # free at once
        finally:
            release.set()
            helper.join(10)
        assert not ex.dispatch.armed_jobs() and ex.snapshot()["pending_tokens"] == 0


def test_close_while_the_submitter_releases_the_cancelled_armed_job_waits_for_it(calbin,
                                                                                monkeypatch):
    """The submitter took the armed job (cancelled) and is releasing it when close() runs:
    close() waits for that release to end, so the sequence is free once it returns. Before
    the fix close() returned at once and a reset right after met kv.sequence_busy (the
    server retried it in a loop)."""
    import threading

    entered, release = threading.Event(), threading.Event()
    with running_job_path(calbin) as ex:
        original = ex.outcomes.fail_before_submit

        def slow(job, status):  # the submitter's release of a cancelled armed job, gated
            if threading.current_thread().name == "calexec-submitter" and job.lease is not None \
                    and job.cancel_flag:
                entered.set()
                assert release.wait(10)
            return original(job, status)

        monkeypatch.setattr(ex.outcomes, "fail_before_submit", slow)
        stream, token = open_stream(ex, 1, 4)
        assert isinstance(stream.step(token), InferenceResult)
        until(lambda: stream.armed is not None, what="next job armed")
        armed = stream.armed
        stream.cancel()  # another thread's cancel: the submitter releases the armed job
        assert entered.wait(10)
        threading.Timer(0.2, release.set).start()
        stream.close()
        assert armed.done  # close waited for the submitter's release
        view = ex.kvc.seqs[1]
        assert view.open_txn is None and view.next_txn is None, view
        assert ex.kvc.reset_sequence(1).ok  # free at once
        release.set()
        assert not ex.dispatch.armed_jobs() and ex.pool.counts()["Leased"] == 0


def test_a_completed_job_gives_its_permit_back_before_the_caller_wakes_and_wakes_no_idle_submitter(
        calbin):
    """Issue 17's wake-up cut: the permit (and budget) go back before the result is delivered,
    so the caller's next job finds it free; and a permit nobody waits for (empty queue) does
    not wake the idle submitter. Counted with the benchmark's counting clock. Before the fix
    the idle submitter was woken by every completion and the permit was still held when the
    caller woke."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.tools.bench.core import CountingClock, HandoffTally
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST, decode

    tally = HandoffTally()
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(calbin_path=calbin),
                        fault_sink=RecordingFaultSink(), clock=CountingClock(tally))
    assert ex.start().ok
    try:
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        tally.reset()
        held_at_wake = []
        for _ in range(20):
            result = ex.enqueue(decode(1, result.argmax, result.kv_len)).wait_until(deadline())
            assert isinstance(result, InferenceResult), result
            held_at_wake.append(ex.snapshot()["inflight"])
        assert held_at_wake == [0] * 20  # the permit was back before the caller woke
        woken = {label: n for (role, label, woke), n in tally.counts.items()
                 if woke and role == "calexec-completion" and label == "submit_cv"}
        assert woken == {}, woken  # the completion thread never woke the idle submitter
    finally:
        ex.shutdown(grace=5.0)


def test_arming_never_waits_for_ready_on_the_submitter(calbin):
    """Issue 24 defect 3: with ``ready_queue_max > 0`` a request that arrives during a
    recovery waits for Ready, but the submitter must never: the recovery's golden run needs
    it. A recovery that starts between a step's fire and the arming of the next step ends
    Ready quickly (it used to sit in Warming until the golden's deadline, then Failed)."""
    with running_executor(calbin, "decode_us=20000", ready_queue_max=4) as ex:
        stream, token = open_stream(ex, 1, 8, seconds=30.0)
        handle = stream.submit(token)  # fired; the submitter arms the next step ~2 ms later
        assert not isinstance(handle, Status), handle
        ex.faults.report(Status.failure("test.device_fault", Category.DEVICE, Phase.WAIT,
                                        "injected between a step's fire and its arming"))
        until(lambda: ex.snapshot()["recoveries"] >= 1 or ex.state == "Failed", seconds=8.0,
              what="the recovery to end")
        assert ex.state == "Ready", (ex.state, ex.failure)
        stream.close()
        assert ex.recoveries[-1]["ok"], ex.recoveries[-1]


def test_a_request_short_of_a_slot_takes_the_slot_of_a_streams_armed_job(calbin):
    """Issue 24 (found by the differential test): a stream's armed next step is a guess, like
    an implicit pre-arm. Two decode slots: stream 1's step in flight holds one, its armed next
    step the other. A decode of sequence 2 must get a slot at once, as without the stream
    (stepped: a wait for a slot would last until its deadline, and the device order of the
    two sequences changed); stream 1's next step is then admitted the ordinary way."""
    with running_job_path(calbin, threads=False) as ex:
        prefilled = ex.enqueue(prefill(2, PROMPT))
        while not prefilled.done and (ex.submit_one() or ex.complete_one()):
            pass
        tb = prefilled.wait_until(deadline()).argmax
        a, ta = open_stream_stepped(ex, 1, 4)
        handle = a.submit(ta)
        while ex.submit_one():  # stream 1's step on the device, its next step armed
            pass
        counts = ex.pool.counts()
        assert a.armed is not None and counts["Leased"] + counts["InFlight"] == 2
        other = ex.enqueue(decode(2, tb, len(PROMPT), seconds=0.5))
        assert other.state == "Queued", other.wait_until(deadline(0))  # admitted at once
        assert a.armed.done  # the guess gave its slot back
        while not handle.done and (ex.submit_one() or ex.complete_one()):
            pass
        first = a.wait()
        assert isinstance(first, InferenceResult), first
        while not other.done and (ex.submit_one() or ex.complete_one()):
            pass
        assert other.wait_until(deadline()).argmax == expected_greedy(PROMPT, 1)[1]
        second = a.step(first.argmax)  # admitted the ordinary way: same token
        assert isinstance(second, InferenceResult), second
        assert [ta, first.argmax, second.argmax] == expected_greedy(PROMPT, 2)
        a.close()
        assert ex.snapshot()["pending_tokens"] == 0 and ex.pool.counts()["Leased"] == 0


def test_a_steps_own_admission_is_never_reclaimed_as_a_guess(calbin, monkeypatch):
    """Issue 24 (found by ``calexec bench faults``: a client saw 499 ``request.cancelled``
    that it never asked for). A step with nothing armed is admitted for its caller and then
    fired; in between, another request short of a slot reclaimed it as if it were an armed
    guess, and the caller's step answered CANCELLED where the plain path admits and runs
    it. Two decode slots: sequence 2's step on the device holds one, stream 1's own step
    takes the other; sequence 3's decode, arriving between that admission and the fire,
    waits for a slot as it would without streams (here until its short deadline)."""
    with running_job_path(calbin, threads=False) as ex:
        tokens = {}
        for seq in (2, 3):
            done = ex.enqueue(prefill(seq, PROMPT))
            while not done.done and (ex.submit_one() or ex.complete_one()):
                pass
            tokens[seq] = done.wait_until(deadline()).argmax
        first_of_1 = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 4))
        while not first_of_1.done and (ex.submit_one() or ex.complete_one()):
            pass
        ta = first_of_1.wait_until(deadline()).argmax
        # max_len bounds what the stream arms ahead: nothing; the caller's step is admitted
        a = ex.decode_stream(1, len(PROMPT), deadline(), max_len=len(PROMPT))
        on_device = ex.enqueue(decode(2, tokens[2], len(PROMPT)))
        assert ex.submit_one() and on_device.state == "Submitted"
        assert a.armed is None
        real_fire = ex.fire_armed
        others = []

        def fire_armed(job, token, *args, **kwargs):
            if not others:  # between the step's admission and its fire
                others.append(ex.enqueue(decode(3, tokens[3], len(PROMPT), seconds=0.2)))
            return real_fire(job, token, *args, **kwargs)

        monkeypatch.setattr(ex, "fire_armed", fire_armed)
        handle = a.submit(ta)
        monkeypatch.undo()
        assert not isinstance(handle, Status), handle
        assert others and others[0].done  # it waited for a slot until its deadline
        assert others[0].wait_until(deadline(0)).category == Category.DEADLINE, \
            others[0].wait_until(deadline(0))
        while not handle.done and (ex.submit_one() or ex.complete_one()):
            pass
        first = a.wait()
        assert isinstance(first, InferenceResult), first
        assert [ta, first.argmax] == expected_greedy(PROMPT, 1)
        while not on_device.done and ex.complete_one():
            pass
        a.close()
        assert ex.snapshot()["pending_tokens"] == 0 and ex.pool.counts()["Leased"] == 0


def test_another_request_on_a_streams_sequence_releases_its_armed_job(calbin):
    """Issue 24 (found by the differential test): between two steps a stream holds no job
    of its sequence the plain path would: its armed next step is a guess. A request for the
    same sequence (here a new prefill, as a second owner of the id would send) is admitted as
    without the stream, not refused ``kv.sequence_busy``; the stream's next step is then
    admitted the ordinary way and answers as a plain request at that position does."""
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stream_stepped(ex, 1, 4)
        first = stream.step(token)
        assert isinstance(first, InferenceResult), first
        while ex.submit_one():  # the submitter arms the next step
            pass
        assert stream.armed is not None
        other = ex.enqueue(prefill(1, PROMPT[:3]))
        while not other.done and (ex.submit_one() or ex.complete_one()):
            pass
        result = other.wait_until(deadline())
        assert isinstance(result, InferenceResult), result  # not kv.sequence_busy
        assert result.argmax == expected_greedy(PROMPT[:3], 0)[0]
        assert stream.armed.done  # released, not counted
        step = stream.step(first.argmax)  # at len(PROMPT) + 1: beyond the new committed 3
        plain = ex.enqueue(decode(1, first.argmax, len(PROMPT) + 1))
        while not plain.done and (ex.submit_one() or ex.complete_one()):
            pass
        assert isinstance(step, Status), step
        assert step.code == plain.wait_until(deadline()).code == "kv.past_len_beyond_committed"
        stream.close()
        assert ex.snapshot()["pending_tokens"] == 0 and ex.pool.counts()["Leased"] == 0


def stream_after_a_failed_arming(ex):
    """A stepped stream on sequence 1 whose first step answered and whose arming of the next
    met a runtime fault (its SetCsr refused): ``(stream, first step's result)``, nothing armed."""
    stream, token = open_stream_stepped(ex, 1, 4)
    assert stream.armed is not None
    arm(ex, "UNKNOWN_CSR")  # the submitter's arming of the step after the next fails
    first = stream.step(token)
    assert isinstance(first, InferenceResult), first
    while ex.submit_one():
        pass
    assert fired(ex, "UNKNOWN_CSR") == 1 and stream.armed is None
    return stream, first


def test_a_request_on_the_sequence_after_a_failed_prearm_leaves_the_step_the_plain_answer(calbin):
    """The stream's next arming met a runtime fault (its SetCsr refused), then another
    request of the sequence came (here a new prefill): the step the fault was kept for is
    admitted after that request, as ``release_armed_of`` has a released armed step admitted,
    and answers what a plain request at that position answers
    (``kv.past_len_beyond_committed``), nothing reported. Until stop 67's review it answered
    the arming's ``calrt.csr_failed``, reported to the fault controller then, for a step
    whose plain admission never reaches a CSR write (its KV check refuses it first)."""
    with running_job_path(calbin, threads=False) as ex:
        stream, first = stream_after_a_failed_arming(ex)
        assert not ex.faults.reports  # a guess: not yet
        other = ex.enqueue(prefill(1, PROMPT[:3]))
        while not other.done and (ex.submit_one() or ex.complete_one()):
            pass
        result = other.wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        step = stream.step(first.argmax)  # at len(PROMPT) + 1: beyond the new committed 3
        plain = ex.enqueue(decode(1, first.argmax, len(PROMPT) + 1))
        while not plain.done and (ex.submit_one() or ex.complete_one()):
            pass
        assert isinstance(step, Status), step
        assert step.code == plain.wait_until(deadline()).code == "kv.past_len_beyond_committed"
        assert not ex.faults.reports, ex.faults.reports
        stream.close()
        assert ex.snapshot()["pending_tokens"] == 0 and ex.pool.counts()["Leased"] == 0


def test_a_step_whose_arming_faulted_asked_while_admission_is_stopped_answers_as_plain(calbin):
    """The stream's next arming met a runtime fault (its SetCsr refused), then another job's
    device fault stopped admission (a recovery decided, not begun: the generation is still
    the current one). The step asked now answers what a plain request does then
    (UNAVAILABLE, 503: its admission stops at the lifecycle before any runtime call), and
    the arming's fault is not reported. Until stop 67's review it answered the arming's 500
    ``calrt.csr_failed``: only a replaced generation was told apart."""
    with running_executor(calbin, threads=False) as ex:
        stream, first = stream_after_a_failed_arming(ex)
        arm(ex, "SUBMIT_RC", rc=18)
        failing = ex.enqueue(prefill(2, PROMPT))
        while not failing.done and (ex.submit_one() or ex.complete_one()):
            pass
        assert isinstance(failing.wait_until(deadline()), Status)
        assert ex.life.recovery_pending and ex.gen.id == 1  # decided, not begun
        reports = ex.faults.reported()
        step = stream.step(first.argmax)
        plain = ex.enqueue(decode(1, first.argmax, len(PROMPT) + 1))
        ex.submit_one()
        answer = plain.wait_until(deadline())
        assert isinstance(step, Status) and isinstance(answer, Status), (step, answer)
        assert (step.code, step.http_status) == (answer.code, answer.http_status)
        assert step.category == Category.UNAVAILABLE, step
        assert ex.faults.reported() == reports  # the arming's: not reported
        stream.close()
        assert ex.life.run_pending_recovery().ok


# ---- submit_nowait: the step an event loop takes without blocking (issue 28) --------------------

def test_submit_nowait_takes_the_prearmed_job_and_tokens_match(calbin):
    """Stepped mode: the submitter arms N+1 while N is submitted, so every step's job is armed
    when the caller comes: ``submit_nowait`` fires it (no admission) and the tokens are the
    plain path's."""
    steps = 10
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stream_stepped(ex, 1, steps)
        out = [token]
        for _ in range(steps):
            assert stream.armed is not None
            handle = stream.submit_nowait(out[-1])
            assert handle is not None and not isinstance(handle, Status), handle
            assert job_of(handle).run.state == "Queued"
            assert stream.armed is None  # taken: the next one is the submitter's to arm
            result = stream.wait()
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
        assert stream.prearmed_steps == steps and stream.steps == steps
        assert out == expected_greedy(PROMPT, steps)
        stream.close()
        assert not ex.dispatch.armed_jobs() and ex.pool.counts()["Leased"] == 0


def test_submit_nowait_declines_without_changing_anything_then_submit_takes_the_step(calbin):
    """An invalid token, a pre-armed guess released meanwhile (reclaimed for a request short of
    a slot), a cancelled stream: None, and ``submit`` then answers as if called first."""
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stream_stepped(ex, 1, 4)
        armed = stream.armed
        assert armed is not None
        assert stream.submit_nowait(-1) is None and not stream.closed  # (submit closes it)
        assert stream.armed is armed and stream.steps == 0
        handle = stream.submit_nowait(token)
        assert handle is not None and not isinstance(handle, Status)
        assert isinstance(stream.submit_nowait(token), Status)  # before wait(), as submit
        result = stream.wait()
        assert isinstance(result, InferenceResult) and handle.done
        out = [token, result.argmax]
        # the next guess is released by someone else: the step is admitted the plain way
        until(lambda: ex.submit_one() or stream.armed is not None, what="the next job armed")
        guess = stream.armed
        assert guess is not None and ex.release_armed(guess, Status.cancelled(Phase.CANCEL))
        assert stream.submit_nowait(out[-1]) is None and stream.steps == 1
        result = stream.step(out[-1])
        assert isinstance(result, InferenceResult), result
        out.append(result.argmax)
        assert out[1:] == expected_greedy(PROMPT, 2)[1:] and stream.prearmed_steps == 1
        stream.cancel()
        assert stream.submit_nowait(out[-1]) is None  # a cancelled stream: submit's answer
        answer = stream.step(out[-1])
        assert isinstance(answer, Status) and answer.category == Category.CANCELLED, answer
        assert stream.closed and isinstance(stream.submit_nowait(out[-1]), Status)


@pytest.mark.parametrize("bad, named", [(True, "token=True: not a token id (an int), got bool"),
                                         ("5", "token='5': not a token id (an int), got str"),
                                         (-1, "token=-1: outside [0, vocab_size=")])
def test_a_token_that_is_no_token_id_is_refused_naming_it(calbin, bad, named):
    """A stream's step with ``True`` (taken as token 1 before) or ``"5"`` (answered "outside
    [0, vocab_size)") is refused ``request.invalid`` saying what it is; ``submit_nowait``
    declines it, changing nothing."""
    with running_job_path(calbin, threads=False) as ex:
        stream, _token = open_stream_stepped(ex, 1, 4)
        assert stream.submit_nowait(bad) is None and not stream.closed and stream.steps == 0
        answer = stream.submit(bad)
        assert isinstance(answer, Status) and answer.code == "request.invalid", answer
        assert named in answer.message, answer.message
        assert stream.closed and stream.steps == 0


def test_submit_nowait_takes_the_step_fired_ahead_and_refuses_another_token(calbin):
    """greedy_ahead: once the completion thread fired the argmax's step, ``submit_nowait``
    takes it; with another token it declines (``submit`` closes the stream for the misuse)."""
    steps = 6
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, steps, greedy_ahead=True, max_steps=steps)
        out = [token]
        # step 1 held on the device (stepped mode) until the submitter armed step 2: only
        # then can it be fired ahead. A 20 ms device did not make that so on a loaded host
        # (step 1 ended before step 2 was armed: nothing was fired ahead, the wait for it
        # below timed out)
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0
        try:
            handle = stream.submit(token)
            until(lambda: stream.armed is not None, what="step 2 armed while step 1 is held")
        finally:
            assert emu.set_stepped(False) == 0
        result = stream.wait()
        assert isinstance(result, InferenceResult), result
        out.append(result.argmax)
        until(lambda: stream.ahead is not None and stream.ahead[1] is not None,
              what="the next step fired ahead")
        assert stream.submit_nowait(result.argmax + 1) is None  # not the argmax fired
        assert stream.ahead is not None and not stream.closed  # nothing changed
        taken = stream.submit_nowait(result.argmax)
        assert taken is not None and not isinstance(taken, Status) and stream.ahead_steps == 1
        while len(out) < steps + 1:
            result = stream.wait()
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
            if len(out) == steps + 1:
                break
            step = stream.submit_nowait(out[-1])
            handle = step if step is not None else stream.submit(out[-1])
            assert not isinstance(handle, Status), handle
        assert out == expected_greedy(PROMPT, steps)
        stream.close()
        assert_released(ex, 1)


class _ArmingGate:
    """Stops ``BufferSlot.prepare`` on the ``holder`` thread (the submitter arming a stream's
    next step) until opened; its clock makes ``close()``'s bounded wait for that arming run
    out at once (what a host too busy to finish an arming in ``_CLOSE_WAIT_S`` does)."""

    def __init__(self) -> None:
        import threading

        self.holder = None
        self.holding = threading.Event()
        self.opened = threading.Event()
        self.skipped = 0.0  # seconds the clock jumped for a wait that met the held arming

    def clock(self):
        from calexec.machines.clock import Clock

        gate = self

        class _JumpingClock(Clock):
            __slots__ = ()

            def monotonic(self):
                return super().monotonic() + gate.skipped

            def now_us(self):
                return super().now_us() + int(gate.skipped * 1e6)

            def wait(self, cond, timeout):
                import threading

                if (gate.holding.is_set() and not gate.opened.is_set()
                        and threading.current_thread() is not gate.holder):
                    gate.skipped += (timeout or 0.0) + 1.0  # the wait runs out
                    return False
                return super().wait(cond, timeout)

        return _JumpingClock()


def test_a_step_armed_after_its_stream_closed_is_released_by_the_arming(calbin, monkeypatch):
    """``close()`` waits (bounded) for the submitter's arming of the next step and releases
    the job armed; when that wait runs out first (a host too busy for the arming to end in
    time), the arming itself must release the job it armed for the closed stream. Kept armed,
    it held a buffer slot, a token of budget and the sequence's chained KV txn, and the
    executor never went back to idle (found by a hand mutant of ``arm_next``, stop 47)."""
    import threading
    import time

    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from calexec.machines.pool import BufferSlot
    from executor_harness import MANIFEST

    gate = _ArmingGate()
    prepare = BufferSlot.prepare

    def gated_prepare(slot, request):
        if threading.current_thread() is gate.holder and not gate.opened.is_set():
            gate.holding.set()
            gate.opened.wait(10.0)
        return prepare(slot, request)

    monkeypatch.setattr(BufferSlot, "prepare", gated_prepare)
    ex = DeviceExecutor(CalRT.load(), MANIFEST,
                        ExecutorConfig(calbin_path=calbin, threads=False, auto_prearm=False),
                        fault_sink=RecordingFaultSink(), clock=gate.clock())
    assert ex.start().ok
    submitter = None
    try:
        handle = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 8))
        assert ex.submit_one() and ex.complete_one()
        first = handle.wait_until(deadline())
        assert isinstance(first, InferenceResult), first
        stream, token = ex.decode_stream(1, first.kv_len, deadline(60.0)), first.argmax
        assert stream.armed is not None
        assert not isinstance(stream.submit(token), Status)  # fired: queued, next to arm

        def drive() -> None:  # submit the fired step, then arm the next (bounded)
            for _ in range(5000):
                if gate.holding.is_set():
                    return
                if not ex.submit_one():
                    time.sleep(0.001)

        submitter = threading.Thread(target=drive, name="submitter", daemon=True)
        gate.holder = submitter
        submitter.start()
        assert gate.holding.wait(10.0), "the submitter never armed the next step"
        stream.close()  # its wait for the arming runs out; nothing armed to release yet
        assert gate.skipped > 0
        gate.opened.set()
        submitter.join(10.0)
        assert not submitter.is_alive()
        ex.complete_one()
        assert ex.dispatch.armed_jobs() == [], ex.dispatch.armed_jobs()
        snap = settle(ex)
        assert snap["pending_tokens"] == 0 and ex.pool.counts()["Leased"] == 0, snap
        assert ex.kvc.seqs[1].next_txn is None and ex.kvc.seqs[1].open_txn is None
    finally:
        gate.opened.set()
        if submitter is not None:
            submitter.join(10.0)
        ex.shutdown(grace=5.0)


@pytest.mark.parametrize(("kwargs", "error", "named"), [
    ({"stop_tokens": "ab"}, TypeError, "stop_tokens='ab'"),
    ({"stop_tokens": None}, TypeError, "stop_tokens=None"),
    ({"stop_tokens": [1, "2"]}, TypeError, "stop_tokens=[1, '2']"),
    ({"max_len": "9"}, TypeError, "max_len='9'"),
    ({"max_len": 0}, ValueError, "max_len=0"),
    ({"max_len": -1}, ValueError, "max_len=-1"),
    ({"max_steps": 2.5}, TypeError, "max_steps=2.5"),
    ({"max_steps": -1}, ValueError, "max_steps=-1"),
    ({"greedy_ahead": "yes"}, TypeError, "greedy_ahead='yes'"),
])
def test_decode_stream_settings_that_are_no_settings_raise_naming_them(calbin, kwargs, error,
                                                                       named):
    """``decode_stream(..., stop_tokens="ab")`` raised ``invalid literal for int() with base
    10: 'a'``, ``stop_tokens=None`` ``'NoneType' object is not iterable``, ``max_len="9"``
    ``'>' not supported``; ``max_len=-1`` and ``greedy_ahead="yes"`` were taken (found at stop
    50 by an embedder), ``max_steps=-1`` too (stop 53: it meant no step ahead, as 0 does).
    Each raises naming the argument and its value, before anything of the sequence is
    touched: a stream opened right after serves the oracle's tokens."""
    with running_job_path(calbin) as ex:
        stream, token = open_stream(ex, 1, 4)
        stream.close()
        with pytest.raises(error, match=rf"^decode_stream: {re.escape(named)}: "):
            ex.decode_stream(1, len(PROMPT), deadline(), **kwargs)
        stream = ex.decode_stream(1, len(PROMPT), deadline(), max_len=len(PROMPT) + 4)
        with stream:
            result = stream.step(token)
        assert isinstance(result, InferenceResult), result
        assert result.argmax == expected_greedy(PROMPT, 1)[1]
        assert_released(ex, 1)


def test_a_step_whose_own_admission_another_thread_releases_answers_that_release(calbin,
                                                                                monkeypatch):
    """Found by CI at stop 52 (``test_server_relay_probe``, a drain with no grace under
    load): a step whose pre-armed job was gone admits its own job and fires it; when another
    thread (a shutdown's close of the generation, a cancel) took that job first, the step
    answers what its release says. It read the job's result at once, before the releasing
    thread had resolved it: ``internal.job_unresolved`` ("the job has no result yet", a 500
    to the client) instead of the release's 503. The step now waits for the release,
    bounded by the stream's deadline."""
    import threading

    drained = Status.unavailable(Phase.ADMISSION, "server drained (probe)")
    taken, release = threading.Event(), threading.Event()
    releasers: list[threading.Thread] = []
    with running_job_path(calbin) as ex:
        fire, give_up = ex.fire_armed, ex.outcomes.fail_before_submit
        fired: list[object] = []

        def gated(job, status):  # the other thread's release of the step's own job
            if fired[1:] and job is fired[1]:
                taken.set()
                assert release.wait(10)
            return give_up(job, status)

        def racing(job, token, rearm=None, arm_delay_s=0.0):
            fired.append(job)
            if len(fired) == 1:  # the pre-armed job: released whole, the step admits its own
                assert ex.release_armed(job, drained)
            else:  # the step's own job: another thread owns it first, its release gated
                releaser = threading.Thread(target=ex.release_armed, args=(job, drained))
                releasers.append(releaser)
                releaser.start()
                assert taken.wait(10)
                threading.Timer(0.2, release.set).start()
            return fire(job, token, rearm, arm_delay_s)

        monkeypatch.setattr(ex.outcomes, "fail_before_submit", gated)
        stream, token = open_stream(ex, 1, 4)
        until(lambda: stream.armed is not None, what="the first step armed")
        monkeypatch.setattr(ex, "fire_armed", racing)
        try:
            answer = stream.submit(token)
        finally:
            release.set()
            for releaser in releasers:
                releaser.join(10)
        assert len(fired) == 2, fired
        assert isinstance(answer, Status) and answer.code == "lifecycle.unavailable", answer
        assert "server drained (probe)" in answer.message and stream.closed, answer
        stream.close()
        assert_released(ex, 1)
