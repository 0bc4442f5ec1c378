"""The dispatch object alone (machines/dispatch.py, issue 25): no thread, no device, a table of
situations and the outcome each must give. The executor's threads act on these outcomes; the
differential, stateful and explorer tests prove the whole behaves as before."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.machines.chart_names import (
    JOB_EV_ADMIT,
    JOB_EV_BEGIN_PREPARATION,
    JOB_QUEUED,
)
from calexec.machines.clock import SYSTEM
from calexec.machines.dispatch import Dispatch, Held, RelayOffer
from calexec.machines.job import Job
from calexec.machines.locks import LockOrder


class Gen:
    """The part of a Generation the dispatch reads: its fence."""

    def __init__(self, gen_id: int = 1) -> None:
        self.id = gen_id
        self.users = 0
        self.closing = False


def make_job(job_id: int, gen: Gen, deadline: float = 1e12, tokens: int = 1,
             seq: int = 1, internal: bool = False) -> Job:
    request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                               tokens=np.zeros(tokens, np.int32),
                               positions=np.arange(tokens, dtype=np.int32), past_len=0,
                               deadline=deadline)
    job = Job(job_id, gen.id, request, lambda: None, internal=internal)
    job.gen = gen
    job.lease = SimpleNamespace(slot=SimpleNamespace(host_input=np.zeros(4, np.int32)))
    job.run.send(JOB_EV_ADMIT)
    job.run.send(JOB_EV_BEGIN_PREPARATION)  # Preparing: armed, or about to be queued
    return job


def never(job, now):
    return None


def expired(job, now):
    return Status.deadline(Phase.SUBMIT, "queue deadline passed") if now >= job.deadline \
        else None


@pytest.fixture
def d():
    return Dispatch(LockOrder(), SYSTEM, capacity=1)


def test_nothing_to_do_is_idle_without_blocking(d):
    step = d.next_for_submitter(never, 1, block=False, wake_at=None)
    assert step.idle


def test_a_queued_job_is_submitted_when_a_permit_is_free(d):
    gen = Gen()
    job = make_job(1, gen)
    assert d.queue(job, gen)
    step = d.next_for_submitter(never, 1, block=False, wake_at=None)
    assert step.submit is job and job.permit_held and d.inflight == 1
    assert d.snapshot()["handing_off"] == 1
    d.handed_off(1)
    assert d.snapshot()["handing_off"] == 0


def test_no_permit_no_submit(d):
    gen = Gen()
    d.queue(make_job(1, gen), gen)
    assert d.next_for_submitter(never, 1, False, None).submit is not None
    d.queue(make_job(2, gen), gen)
    assert d.next_for_submitter(never, 1, False, None).idle  # capacity 1, one in flight
    assert d.next_for_submitter(never, 2, False, None).submit is not None  # Phase B


def test_a_job_past_its_deadline_is_failed_wherever_it_stands(d):
    gen = Gen()
    first, late = make_job(1, gen), make_job(2, gen, deadline=time.monotonic() - 1)
    d.queue(first, gen), d.queue(late, gen)
    step = d.next_for_submitter(expired, 1, False, None)
    assert [job for job, _ in step.fail] == [late] and step.fail[0][1].code == "submit.deadline"
    assert d.next_for_submitter(expired, 1, False, None).submit is first


def test_armed_jobs_are_failed_too_and_a_guess_is_counted(d):
    gen = Gen()
    job = make_job(1, gen, deadline=time.monotonic() - 1)
    assert d.arm(job, gen)
    entry = SimpleNamespace(seq_id=1, job=None, dropped=False)
    assert d.add_guess(entry, at=1e12)
    with d.cv:
        assert d.guess_armed_locked(entry, job)
    step = d.next_for_submitter(expired, 1, False, None)
    assert step.fail[0][0] is job and step.guesses == 1
    assert d.guess(1) is None and entry.dropped and d.armed_jobs() == []


def test_an_arming_that_is_due_is_handed_out_and_ends(d):
    armer = SimpleNamespace(seq_id=7)
    d.schedule_arm(armer, at=0.0)
    step = d.next_for_submitter(never, 1, True, None)
    assert step.arm is armer
    with d.cv:
        assert d.arming(armer)
    d.done_arming()
    with d.cv:
        assert not d.arming(armer)


def test_an_arming_not_due_yet_waits_when_blocking_and_not_otherwise(d):
    armer = SimpleNamespace(seq_id=7)
    d.schedule_arm(armer, at=time.monotonic() + 0.05)
    step = d.next_for_submitter(never, 1, True, None)
    assert step.woke and step.arm is None  # waited (bounded by the arming time)
    assert d.next_for_submitter(never, 1, False, None).arm is armer  # stepped: at once


def test_a_refusal_fails_queued_and_armed_jobs_with_it(d):
    gen = Gen()
    queued, armed = make_job(1, gen), make_job(2, gen)
    d.queue(queued, gen), d.arm(armed, gen)
    refusal = Status.unavailable(Phase.RECOVERY, "recovering")
    d.refuse(refusal)
    step = d.next_for_submitter(lambda job, now: d.refusal, 1, False, None)
    assert {job for job, _ in step.fail} == {queued, armed}
    assert all(status is refusal for _, status in step.fail)


def test_the_token_budget(d):
    gen = Gen()
    big, small, golden = (make_job(1, gen, tokens=3), make_job(2, gen, tokens=2),
                          make_job(3, gen, tokens=9, internal=True))
    assert d.take_budget(big, budget=4) and d.pending_tokens == 3
    assert not d.take_budget(small, budget=4) and not small.budget_taken
    assert d.take_budget(golden, budget=4)  # the golden run is never refused
    d.release_budget(big), d.release_budget(big)  # once
    assert d.pending_tokens == 9


def test_the_fence(d):
    gen, other = Gen(1), Gen(2)
    assert d.enter(gen, current=gen) and gen.users == 1
    assert not d.enter(gen, current=other)  # replaced
    armed = make_job(1, gen)
    d.arm(armed, gen)
    assert d.close(gen) == [armed] and gen.closing and d.armed_jobs() == []
    assert not d.enter(gen, current=gen)  # closing
    assert not d.wait_left(gen, time.monotonic() + 0.01)  # one request thread still in it
    d.exit(gen)
    assert d.wait_left(gen, time.monotonic() + 0.01)
    assert not d.queue(make_job(2, gen), gen) and not d.arm(make_job(3, gen), gen)


def test_firing_an_armed_job_queues_it_with_its_token_once(d):
    gen = Gen()
    job = make_job(1, gen)
    d.arm(job, gen)
    armer = SimpleNamespace(seq_id=1)
    assert d.fire(job, 42, gen, rearm=armer, at=0.0) == (True, None)
    assert job.run.state == JOB_QUEUED and job.lease.slot.host_input[0] == 42
    assert d.snapshot()["queued"] == 1 and d.snapshot()["to_arm"] == 1
    assert d.fire(job, 43, gen) == (False, None)  # not armed any more: someone owns it


def test_firing_into_a_closed_generation_or_a_cancelled_job_gives_it_back(d):
    gen = Gen()
    job = make_job(1, gen)
    d.arm(job, gen)
    gen.closing = True
    owned, status = d.fire(job, 1, gen)
    assert owned and status.code == "lifecycle.unavailable"
    gen2 = Gen(2)
    cancelled = make_job(2, gen2)
    d.arm(cancelled, gen2)
    cancelled.cancel_flag = True
    owned, status = d.fire(cancelled, 1, gen2)
    assert owned and status.code == "request.cancelled"
    assert cancelled.run.state != JOB_QUEUED and d.snapshot()["queued"] == 0


def offer(unsubmittable=never, capacity=1, eligible=True) -> RelayOffer:
    return RelayOffer(unsubmittable, lambda: capacity, lambda job: eligible)


def test_a_fired_job_the_submitter_would_submit_at_once_is_taken_for_the_relay(d):
    """The same decision ``next_for_submitter`` makes, on the firing thread: the job's
    permit and hand-off are taken, the submitter's relay wait is not woken (the relay's
    fire wakes it in C), and the job is the submitter's again when the relay reports it."""
    woken = []
    d.relay_wake = lambda: woken.append(1)
    gen = Gen()
    job = make_job(1, gen)
    d.arm(job, gen)
    assert d.fire(job, 42, gen, relay=offer()) == (True, None)
    assert job.relayed and job.permit_held and d.inflight == 1 and not woken
    snap = d.snapshot()
    assert (snap["queued"], snap["relayed"], snap["handing_off"]) == (0, 1, 1)
    assert not d.drained()  # a recovery's drain waits for it
    # the submitter has nothing else to do, and it waits in the relay for the job
    step = d.next_for_submitter(never, 1, block=True, wake_at=None, relay_idle=True)
    assert step.idle_for is not None and step.submit is None
    assert d.take_relayed(1) is job and d.take_relayed(1) is None
    d.handed_off(1)
    d.release_permit(job)
    assert d.drained()


@pytest.mark.parametrize("case", ["busy", "other_ended", "self_ended", "queued_before",
                                  "held", "not_eligible", "stopping"])
def test_a_fired_job_is_left_to_the_submitter_unless_it_would_submit_it_at_once(d, case):
    """Every situation in which the submitter's next look would do something else first
    (fail an ended job, submit the job queued before, wait for a permit) or would not use
    the relay's plain infer: the job is queued as on the plain path (and the submitter
    woken: the next test)."""
    gen = Gen()
    job = make_job(1, gen, deadline=time.monotonic() + (-1 if case == "self_ended" else 60))
    d.arm(job, gen)
    kw = {}
    if case == "busy":
        kw["capacity"] = 0
    elif case == "other_ended":
        d.arm(make_job(2, gen, deadline=time.monotonic() - 1, seq=2), gen)
    elif case == "queued_before":
        d.queue(make_job(3, gen, seq=3), gen)
    elif case == "held":
        d.hold(Held(slot=SimpleNamespace(), kvc=SimpleNamespace(), seq_id=9,
                    job=make_job(4, gen, seq=9), grace_end=0.0))
    elif case == "not_eligible":
        kw["eligible"] = False
    elif case == "stopping":
        d.stop()
    assert d.fire(job, 42, gen, relay=offer(expired, **kw)) == (True, None)
    assert not job.relayed and d.snapshot()["relayed"] == 0
    assert d.snapshot()["queued"] >= 1


def test_a_submitter_waiting_in_its_relay_is_woken_once_per_wait(d):
    """Whatever may give the submitter work wakes its relay wait, once (the relay's wake
    is coalesced too); while the submitter looks at the state itself (in Python, between
    two waits) nothing calls into the relay."""
    woken = []
    d.relay_wake = lambda: woken.append(1)
    gen = Gen()
    d.queue(make_job(1, gen), gen)
    assert not woken  # the submitter was never told to wait: it will look
    step = d.next_for_submitter(never, 0, block=True, wake_at=None, relay_idle=True)
    assert step.idle_for is not None  # no permit: wait
    d.queue(make_job(2, gen, seq=2), gen)
    d.refuse(None)
    assert woken == [1]  # one wake for the wait
    step = d.next_for_submitter(never, 0, block=True, wake_at=None, relay_idle=True)
    assert step.idle_for is not None
    job = make_job(3, gen, seq=3)
    d.arm(job, gen)
    assert d.fire(job, 7, gen, relay=offer(capacity=0)) == (True, None)  # queued, not taken
    assert woken == [1, 1]


def test_a_job_the_relay_refused_is_submitted_by_the_submitter_first(d):
    gen = Gen()
    job = make_job(1, gen)
    d.arm(job, gen)
    d.fire(job, 42, gen, relay=offer())
    other = make_job(2, gen, seq=2)
    d.queue(other, gen)
    d.relay_refused(job)  # the relay was closed: the submitter's Python submits it
    step = d.next_for_submitter(never, 2, block=False, wake_at=None)
    assert step.submit is job and d.inflight == 1 and d.snapshot()["relayed"] == 0
    assert d.snapshot()["handing_off"] == 1  # counted once, when it was taken


def test_a_job_the_relay_refused_wakes_the_submitter_waiting_in_its_relay(d):
    """Taking a job for the relay tells the submitter's relay wait nothing (the relay's fire
    wakes it in C); a fire the relay refuses (full, or it raised) wakes nobody in C, so the
    refusal must: the submitter, still waiting in its relay, slept out its idle wait (up to
    ``RELAY_IDLE_MAX_S``) with the job waiting for it."""
    woken = []
    d.relay_wake = lambda: woken.append(1)
    gen = Gen()
    step = d.next_for_submitter(never, 2, block=True, wake_at=None, relay_idle=True)
    assert step.idle_for is not None  # nothing to do: it waits in its relay
    job = make_job(1, gen)
    d.arm(job, gen)
    assert d.fire(job, 42, gen, relay=offer()) == (True, None) and job.relayed
    assert not woken  # the fire would wake it in C
    d.relay_refused(job)
    assert woken == [1]  # it did not: the refusal does
    step = d.next_for_submitter(never, 2, block=False, wake_at=None)
    assert step.submit is job


def test_a_stopping_submitter_waits_for_the_jobs_taken_for_its_relay(d):
    gen = Gen()
    job = make_job(1, gen)
    d.arm(job, gen)
    d.fire(job, 42, gen, relay=offer())
    d.stop()
    step = d.next_for_submitter(never, 1, block=True, wake_at=None, relay_idle=True)
    assert step.idle_for is not None  # not "nothing to do": the relay reports the job first
    d.take_relayed(1)
    step = d.next_for_submitter(never, 1, block=True, wake_at=None, relay_idle=True)
    assert step.idle and step.idle_for is None  # now the thread may end


def test_reclaim_takes_every_armed_job_not_fired(d):
    gen = Gen()
    stream_job, guess_job = make_job(1, gen, seq=1), make_job(2, gen, seq=2)
    d.arm(stream_job, gen), d.arm(guess_job, gen)
    entry = SimpleNamespace(seq_id=2, job=None, dropped=False)
    d.add_guess(entry, at=1e12)
    with d.cv:
        d.guess_armed_locked(entry, guess_job)
    guesses, streams = d.reclaim(time.monotonic() + 1)
    assert guesses == [guess_job] and streams == [stream_job] and d.armed_jobs() == []


def test_what_was_armed_for_a_sequence_is_taken_for_another_request_of_it(d):
    gen = Gen()
    mine, other = make_job(1, gen, seq=1), make_job(2, gen, seq=2)
    d.arm(mine, gen), d.arm(other, gen)
    armer = SimpleNamespace(seq_id=1)
    d.schedule_arm(armer, at=1e12)
    stream = object()
    d.open_stream(1, stream)
    assert d.anything_for(1)
    guess, streams, found = d.take_armed_of(1, time.monotonic() + 1)
    assert guess is None and streams == [mine] and found is stream
    assert d.armed_jobs() == [other] and not d.scheduled(armer)


def test_a_callers_own_step_is_never_taken_as_a_guess(d):
    """Issue 24 (``calexec bench faults``: a 499 nobody asked for): a step admitted for its
    caller and about to be fired is a request, not a guess: neither a request short of a
    slot nor another request of its sequence takes it; the fence and the caller's fire do."""
    gen = Gen()
    own, guess = make_job(1, gen, seq=1), make_job(2, gen, seq=1)
    d.arm(own, gen, for_caller=True), d.arm(guess, gen)
    assert d.reclaim(time.monotonic() + 1) == ([], [guess])
    assert d.take_armed_of(1, time.monotonic() + 1)[1] == [] and d.armed_jobs() == [own]
    assert d.fire(own, 7, gen) == (True, None) and d.armed_jobs() == []
    fenced = make_job(3, gen, seq=2)
    d.arm(fenced, gen, for_caller=True)
    assert d.close(gen) == [fenced] and d.armed_jobs() == []


def test_a_slot_the_runtime_keeps_holds_its_permit_until_it_lets_go(d):
    gen = Gen()
    d.queue(make_job(1, gen), gen)
    job = d.next_for_submitter(never, 1, False, None).submit
    entry = Held(slot=None, kvc=None, seq_id=1, job=job, grace_end=time.monotonic() + 60)
    d.hold(entry)
    assert not job.permit_held and d.inflight == 1
    freed, hung, none_left = d.reaped([], time.monotonic(), report=True)
    assert (freed, hung, none_left) == ([], [], False)
    freed, hung, none_left = d.reaped([], time.monotonic() + 61, report=True)
    assert hung == [entry] and entry.reported  # once
    assert d.reaped([], time.monotonic() + 62, report=True)[1] == []
    freed, hung, none_left = d.reaped([entry], time.monotonic(), report=True)
    assert freed == [entry] and none_left and d.inflight == 0


def test_a_stop_is_never_missed_between_the_check_and_the_wait(d):
    """``stop`` is read under the lock: a blocking call after it returns at once (the bug
    of reading it before: a submitter that waited for ever after shutdown)."""
    d.stop()
    assert d.next_for_submitter(never, 1, True, None).idle
    d.stop(False)
    assert d.next_for_submitter(never, 1, True, time.monotonic() + 0.01).woke


def test_a_blocking_submitter_woken_by_a_queued_job_gets_that_job_in_the_same_call(d):
    """With the capacity and the early wake-up as callables (the executor's threads), a wait
    that a new job ends looks again under the same lock: the call returns the job, not
    ``woke`` (issue 25's before/after bench: a round trip out of the dispatch and back after
    every wake-up sat in the submitter's queue wait). The capacity and ``wake_at`` are read
    after the wait, and ``wake_at`` only right before a wait."""
    gen = Gen()
    job = make_job(1, gen)
    reads: list[str] = []

    def capacity() -> int:
        reads.append("capacity")
        return 1

    def wake_at(now: float) -> float | None:
        reads.append("wake_at")
        return None

    result: list = []
    thread = SYSTEM.start_thread(
        lambda: result.append(d.next_for_submitter(never, capacity, True, wake_at)), "sub")
    end = time.monotonic() + 10
    while "wake_at" not in reads and time.monotonic() < end:  # bounded: it is waiting
        time.sleep(0.001)
    assert reads == ["wake_at"]  # nothing queued: no capacity read, one wait
    assert d.queue(job, gen)
    thread.join(timeout=10)
    assert not thread.is_alive()
    (step,) = result
    assert step.submit is job and not step.woke
    assert reads == ["wake_at", "capacity"]


def test_with_fixed_values_a_blocking_call_returns_woke_after_one_wait(d):
    """Plain values (a caller that recomputes them, as the tables above) keep the one-wait
    contract: the call returns ``woke`` and the caller asks again."""
    step = d.next_for_submitter(never, 1, True, time.monotonic() + 0.01)
    assert step.woke and step.submit is None
