"""The native relay (drivers/native/calexec_relay.h, issue 28): its contract on a fake
runtime, equal answers with its Python reference model (drivers/native/relay_model.py) for
random operation sequences (and the same for the executor's relay on an injected clock,
``ClockRelay``, in the submitter-only form), and the withdraw-versus-fire race under real
threads. On the emulator: tests/test_bench_relayfloor.py and tests/test_executor_relay.py."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from calexec.drivers.native.relay import (
    QUEUE,
    RULES,
    CallbackFunctions,
    Kind,
    NativeRelay,
    Rc,
    RelayJob,
    Why,
)
from calexec.drivers.native.relay_model import ModelRule, RelayModel
from calexec.drivers.tools.explore import ClockRelay
from calexec.machines.clock import SYSTEM

DONE, CCU_EXCEPTION = 3, 4
VOCAB = 64
NAN_BF16 = 0x7FC0


def _bf16(values: np.ndarray) -> np.ndarray:
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


class Outcome:
    """How a fake job ends: infer's code, Wait's codes in order (13 = timeout, then the next), GetStatus,
    valid bytes, and its logits (BF16)."""

    def __init__(self, waits: tuple[int, ...] = (0,), status: int = DONE, valid: int = VOCAB * 2,
                 argmax: int = 5, nonfinite: bool = False, infer_rc: int = 0) -> None:
        self.infer_rc = infer_rc
        self.waits = list(waits)
        self.status = status
        self.valid = valid
        row = np.linspace(-1.0, 1.0, VOCAB).astype(np.float32)
        row[argmax] = 4.0
        self.logits = _bf16(row)
        if nonfinite:
            self.logits[VOCAB // 2] = NAN_BF16
        self.argmax = None if nonfinite else argmax


class FakeDevice:
    """A runtime whose jobs end as their Outcome says; outbuf address = 0x1000 + 16 * tag."""

    def __init__(self, outcomes: dict[int, Outcome]) -> None:
        self.outcomes = outcomes
        self.waits = {tag: list(o.waits) for tag, o in outcomes.items()}
        self.inferred: list[int] = []

    @staticmethod
    def tag_of(outbuf: int) -> int:
        return (outbuf - 0x1000) // 16

    # the C relay's side (handles as integers)
    def infer(self, dev: int, model: int, kv: int, seq: int, inbuf: int, outbuf: int) -> int:
        tag = self.tag_of(outbuf)
        self.inferred.append(tag)
        return self.outcomes[tag].infer_rc

    def wait(self, outbuf: int, timeout_us: int) -> int:
        codes = self.waits[self.tag_of(outbuf)]
        return codes.pop(0) if len(codes) > 1 else codes[0]

    def status(self, outbuf: int) -> tuple[int, int]:
        return 0, self.outcomes[self.tag_of(outbuf)].status

    def valid_bytes(self, outbuf: int) -> tuple[int, int]:
        return 0, self.outcomes[self.tag_of(outbuf)].valid


class ModelDevice:
    """The same outcomes, seen by the reference model (jobs instead of addresses)."""

    def __init__(self, fake: FakeDevice) -> None:
        self.fake = fake

    def infer(self, job: RelayJob) -> int:
        return self.fake.infer(job.dev, job.model, job.kv, job.seq, job.inbuf, job.outbuf)

    def wait(self, job: RelayJob) -> int:
        return self.fake.wait(job.outbuf, 0)

    def status(self, job: RelayJob) -> tuple[int, int]:
        return self.fake.status(job.outbuf)

    def valid_bytes(self, job: RelayJob) -> tuple[int, int]:
        return self.fake.valid_bytes(job.outbuf)

    def argmax(self, tag: int) -> int | None:
        return self.fake.outcomes[tag].argmax


def job(tag: int) -> RelayJob:
    return RelayJob(tag=tag, dev=0x10, model=0x20, kv=0x30, inbuf=0x2000 + 16 * tag,
                    outbuf=0x1000 + 16 * tag, seq=1)


class Relay:
    """A C relay on a fake device, with the arrays its rules point into."""

    def __init__(self, outcomes: dict[int, Outcome], submitter_only: bool = False) -> None:
        self.device = FakeDevice(outcomes)
        self.functions = CallbackFunctions(self.device, done_status=DONE)
        self.relay = NativeRelay(self.functions.functions, submitter_only=submitter_only)
        self.token_dst = {tag: np.full(1, -7, np.int32) for tag in outcomes}
        self.rows = {tag: np.zeros(VOCAB, np.float32) for tag in outcomes}

    def register(self, tag: int, nxt: int, stop: tuple[int, ...] = ()) -> Rc:
        o = self.device.outcomes[tag]
        return self.relay.register(tag, job(nxt), self.token_dst[nxt], o.logits, 0, VOCAB,
                                   self.rows[tag], VOCAB * 2, stop)

    def close(self) -> None:
        self.relay.close()
        self.relay.free()


@pytest.fixture
def relay_of():
    made: list[Relay] = []

    def make(outcomes: dict[int, Outcome]) -> Relay:
        r = Relay(outcomes)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


# ---- the contract, one case at a time --------------------------------------------------------

def test_a_rule_fires_the_successor_with_the_argmax_before_python_sees_the_completion(relay_of):
    r = relay_of({1: Outcome(argmax=9), 2: Outcome()})
    assert r.relay.fire(job(1)) == Rc.OK
    assert r.register(1, 2) == Rc.OK
    inferred = r.relay.submitter_wait(1.0)
    assert (inferred.kind, inferred.tag, inferred.rc) == (Kind.INFERRED, 1, 0)
    done = r.relay.completion_wait(1.0)
    assert (done.kind, done.tag, done.status, done.why, done.token, done.fired_tag) == (
        Kind.DONE, 1, DONE, Why.FIRED, 9, 2)
    assert r.token_dst[2][0] == 9  # written before the successor was queued
    assert r.relay.withdraw(1) == 0  # decided: nothing to withdraw
    nxt = r.relay.submitter_wait(1.0)
    assert (nxt.kind, nxt.tag) == (Kind.INFERRED, 2)
    assert r.device.inferred == [1, 2]
    assert r.relay.counters()["fired_by_rule"] == 1


@pytest.mark.parametrize("outcome, why", [
    (Outcome(waits=(18,)), Why.WAIT_FAILED),
    (Outcome(status=CCU_EXCEPTION), Why.NOT_DONE),
    (Outcome(valid=VOCAB * 2 - 2), Why.SHORT),
    (Outcome(nonfinite=True), Why.NONFINITE),
    (Outcome(argmax=7), Why.STOP),
])
def test_a_job_the_plain_path_would_not_fire_after_fires_nothing(relay_of, outcome, why):
    r = relay_of({1: outcome, 2: Outcome()})
    r.relay.fire(job(1))
    assert r.register(1, 2, stop=(3, 7)) == Rc.OK
    r.relay.submitter_wait(1.0)
    done = r.relay.completion_wait(1.0)
    assert (done.kind, done.why, done.fired_tag) == (Kind.DONE, why, -1)
    assert r.token_dst[2][0] == -7  # the successor's input untouched
    assert r.relay.submitter_wait(0).kind == Kind.TIMEOUT  # nothing queued
    assert r.relay.counters()["rules"] == 0  # the rule is spent either way


def test_a_withdrawn_rule_never_fires(relay_of):
    r = relay_of({1: Outcome(), 2: Outcome()})
    r.relay.fire(job(1))
    r.register(1, 2)
    r.relay.submitter_wait(1.0)
    assert r.relay.withdraw(1) == 1
    done = r.relay.completion_wait(1.0)
    assert (done.why, done.token, done.fired_tag) == (Why.NO_RULE, -1, -1)
    assert r.token_dst[2][0] == -7
    assert r.relay.submitter_wait(0).kind == Kind.TIMEOUT


def test_a_wait_that_times_out_keeps_the_job_for_the_next_wait(relay_of):
    r = relay_of({1: Outcome(waits=(13, 0)), 2: Outcome()})
    r.relay.fire(job(1))
    r.register(1, 2)
    r.relay.submitter_wait(1.0)
    first = r.relay.completion_wait(0.01)
    assert (first.kind, first.tag, first.rc) == (Kind.TIMEOUT, 1, 13)
    second = r.relay.completion_wait(1.0)
    assert (second.kind, second.tag, second.why) == (Kind.DONE, 1, Why.FIRED)


def test_wake_and_close_end_the_waits_and_refuse_what_comes_after(relay_of):
    r = relay_of({1: Outcome(), 2: Outcome(), 3: Outcome()})
    assert r.relay.wake() == Rc.OK
    assert r.relay.wake() == Rc.OK  # coalesced
    assert r.relay.submitter_wait(1.0).kind == Kind.WAKE
    assert r.relay.submitter_wait(0).kind == Kind.TIMEOUT
    r.relay.fire(job(1))
    r.relay.fire(job(2))
    assert r.relay.close() == [1, 2]  # never given to infer
    assert r.relay.submitter_wait(1.0).kind == Kind.CLOSED
    assert r.relay.completion_wait(1.0).kind == Kind.CLOSED
    assert r.relay.fire(job(3)) == Rc.ECLOSED
    assert r.register(2, 3) == Rc.ECLOSED
    assert r.device.inferred == []


def test_bad_rules_and_full_queues_are_refused_by_code(relay_of):
    r = relay_of({t: Outcome() for t in range(1, 20)})
    assert r.register(1, 2, stop=tuple(range(17))) == Rc.EARG
    assert r.register(1, 2) == Rc.OK
    assert r.register(1, 3) == Rc.EARG  # the tag registered twice
    for t in range(2, RULES + 1):
        assert r.register(t, t + 1) == Rc.OK
    assert r.register(RULES + 1, RULES + 2) == Rc.EFULL
    for t in range(1, QUEUE + 1):
        assert r.relay.fire(job(t)) == Rc.OK
    assert r.relay.fire(job(QUEUE + 1)) == Rc.EFULL
    bad = r.relay.register(15, job(16), np.zeros(1, np.int64), r.device.outcomes[15].logits, 0,
                           VOCAB, r.rows[15], VOCAB * 2)
    assert bad == Rc.EARG  # the token's array is not int32
    beyond = r.relay.register(15, job(16), r.token_dst[16], r.device.outcomes[15].logits, 1,
                              VOCAB, r.rows[15], VOCAB * 2)
    assert beyond == Rc.EARG  # the slice runs past the logits


def test_a_blocked_wait_holds_no_gil_and_a_second_waiter_is_refused(relay_of):
    r = relay_of({1: Outcome()})
    got: list[object] = []
    started = threading.Event()

    def submitter() -> None:
        started.set()
        got.append(r.relay.submitter_wait(10.0))

    t = threading.Thread(target=submitter, daemon=True)
    t.start()
    assert started.wait(10.0)
    # the thread is in C (or about to be): Python runs here meanwhile; a second submitter
    # wait is refused once the first is in
    for _ in range(10000):
        second = r.relay.submitter_wait(0)
        if second == Rc.EBUSY:
            break
    assert second == Rc.EBUSY
    assert r.relay.wake() == Rc.OK
    t.join(10.0)
    assert not t.is_alive()
    assert got[0].kind == Kind.WAKE


def test_a_caller_waiting_in_c_wakes_with_the_decision(relay_of):
    r = relay_of({1: Outcome(argmax=9), 2: Outcome()})
    r.relay.fire(job(1))
    r.register(1, 2)
    assert r.relay.result_wait(1, 0).kind == Kind.TIMEOUT  # not decided yet
    got: list[object] = []
    caller = threading.Thread(target=lambda: got.append(r.relay.result_wait(1, 10.0)))
    caller.start()
    r.relay.submitter_wait(1.0)
    r.relay.completion_wait(1.0)
    caller.join(10.0)
    assert not caller.is_alive()
    decided = got[0]
    assert (decided.kind, decided.tag, decided.why, decided.token, decided.fired_tag) == (
        Kind.DONE, 1, Why.FIRED, 9, 2)
    assert r.relay.result_wait(1, 0).token == 9  # kept: asked again, answered again
    waiting: list[object] = []
    other = threading.Thread(target=lambda: waiting.append(r.relay.result_wait(7, 10.0)))
    other.start()
    r.relay.close()  # a caller waiting for a job never decided returns CLOSED
    other.join(10.0)
    assert not other.is_alive() and waiting[0].kind == Kind.CLOSED


# ---- the reference model: equal answers for random operation sequences ---------------------

TAGS = st.integers(1, 12)


def _outcomes(draw_seed: int) -> dict[int, Outcome]:
    rng = np.random.default_rng(draw_seed)
    out = {}
    for tag in range(1, 14):
        kind = int(rng.integers(0, 8))
        out[tag] = Outcome(
            waits=(13, 0) if kind == 1 else (18,) if kind == 2 else (0,),
            status=CCU_EXCEPTION if kind == 3 else DONE,
            valid=VOCAB * 2 - 2 if kind == 4 else VOCAB * 2,
            nonfinite=kind == 5, argmax=int(rng.integers(0, 4)), infer_rc=4 if kind == 6 else 0)
    return out


class RelayVersusModel(RuleBasedStateMachine):
    """Every operation on the C relay (single thread, waits that poll) and on the model;
    their answers must be equal."""

    def __init__(self) -> None:
        super().__init__()
        self.r: Relay | None = None
        self.m: RelayModel | None = None

    @precondition(lambda self: self.r is None)
    @rule(seed=st.integers(0, 2**16), submitter_only=st.booleans())
    def start(self, seed: int, submitter_only: bool) -> None:
        # submitter_only: the executor's relay (inferred jobs untracked, rules refused)
        self.r = Relay(_outcomes(seed), submitter_only)
        self.m = RelayModel(ModelDevice(FakeDevice(_outcomes(seed))), done_status=DONE,
                            submitter_only=submitter_only)

    def teardown(self) -> None:
        if self.r is not None:
            self.r.close()

    @precondition(lambda self: self.r is not None)
    @rule(tag=TAGS)
    def fire(self, tag: int) -> None:
        assert self.r.relay.fire(job(tag)) == self.m.fire(job(tag))

    @precondition(lambda self: self.r is not None)
    @rule(tag=TAGS)
    def track(self, tag: int) -> None:
        assert self.r.relay.track(job(tag)) == self.m.track(job(tag))

    @precondition(lambda self: self.r is not None)
    @rule()
    def wake(self) -> None:
        assert self.r.relay.wake() == self.m.wake()

    @precondition(lambda self: self.r is not None)
    @rule(tag=TAGS, stop=st.sets(st.integers(0, 3), max_size=2))
    def register(self, tag: int, stop: set[int]) -> None:
        stops = tuple(sorted(stop))
        got = self.r.register(tag, tag + 1, stops)
        want = self.m.register(ModelRule(tag, job(tag + 1), VOCAB * 2, stops))
        assert got == want

    @precondition(lambda self: self.r is not None)
    @rule(tag=TAGS)
    def withdraw(self, tag: int) -> None:
        assert self.r.relay.withdraw(tag) == self.m.withdraw(tag)

    @precondition(lambda self: self.r is not None)
    @rule()
    def submitter_poll(self) -> None:
        got, want = self.r.relay.submitter_wait(0), self.m.submitter_wait()
        assert (got.kind, got.tag, got.rc) == (want.kind, want.tag, want.rc)
        if got.kind == Kind.INFERRED:
            assert got.why == want.why

    @precondition(lambda self: self.r is not None)
    @rule()
    def completion_poll(self) -> None:
        got, want = self.r.relay.completion_wait(0), self.m.completion_wait()
        assert (got.kind, got.tag, got.rc) == (want.kind, want.tag, want.rc)
        if got.kind == Kind.DONE:
            assert (got.status, got.why, got.token, got.fired_tag) == (
                want.status, want.why, want.token, want.fired_tag)

    @precondition(lambda self: self.r is not None)
    @rule(tag=TAGS)
    def result_poll(self, tag: int) -> None:
        got, want = self.r.relay.result_wait(tag, 0), self.m.result(tag)
        assert (got.kind, got.tag) == (want.kind, want.tag)
        if got.kind == Kind.DONE:
            assert (got.rc, got.status, got.why, got.token, got.fired_tag) == (
                want.rc, want.status, want.why, want.token, want.fired_tag)

    @precondition(lambda self: self.r is not None)
    @rule()
    def close(self) -> None:
        assert self.r.relay.close() == self.m.close()

    @invariant()
    def same_state(self) -> None:
        if self.r is None:
            return
        c = self.r.relay.counters()
        assert (c["queued"], c["in_flight"], c["rules"]) == (
            len(self.m.fires), len(self.m.in_flight), len(self.m.rules))
        assert self.r.device.inferred == self.m.rt.fake.inferred
        written = {t: int(a[0]) for t, a in self.r.token_dst.items() if a[0] != -7}
        assert written == self.m.tokens


RelayVersusModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("CALEXEC_RELAY_EXAMPLES", "150")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestRelayVersusModel = RelayVersusModel.TestCase


class _InferOnly:
    """The device as ``ClockRelay``'s waiter calls it (the executor's ``device.infer``)."""

    def __init__(self, fake: FakeDevice) -> None:
        self.fake = fake

    def infer(self, model: int, kv: int, seq: int, inbuf: int, outbuf: int) -> int:
        return self.fake.infer(0x10, model, kv, seq, inbuf, outbuf)


class ClockRelayVersusModel(RuleBasedStateMachine):
    """The executor's relay under the explorer and the differential test (``ClockRelay``,
    drivers/tools/explore.py) against the same model in its submitter-only form, which the
    C relay is checked against above: fire, wake, a wait that polls, close."""

    def __init__(self) -> None:
        super().__init__()
        self.c: ClockRelay | None = None
        self.m: RelayModel | None = None
        self.device: _InferOnly | None = None

    @precondition(lambda self: self.c is None)
    @rule(seed=st.integers(0, 2**16))
    def start(self, seed: int) -> None:
        self.device = _InferOnly(FakeDevice(_outcomes(seed)))
        self.c = ClockRelay(SYSTEM)
        self.m = RelayModel(ModelDevice(FakeDevice(_outcomes(seed))), done_status=DONE,
                            submitter_only=True)

    @precondition(lambda self: self.c is not None)
    @rule(tag=TAGS)
    def fire(self, tag: int) -> None:
        j = job(tag)
        got = self.c.fire(tag, self.device, j.model, j.kv, j.seq, j.inbuf, j.outbuf)
        assert got == (self.m.fire(j) == Rc.OK)

    @precondition(lambda self: self.c is not None)
    @rule()
    def wake(self) -> None:
        self.c.wake()
        self.m.wake()

    @precondition(lambda self: self.c is not None)
    @rule()
    def submitter_poll(self) -> None:
        got = self.c.wait(0)  # infers on the device given with the job, as the executor's
        want = self.m.submitter_wait()
        assert got == (int(want.kind), want.tag if want.kind == Kind.INFERRED else 0,
                       want.rc if want.kind == Kind.INFERRED else 0)

    @precondition(lambda self: self.c is not None)
    @rule()
    def close(self) -> None:
        assert self.c.close() == self.m.close()

    @invariant()
    def same_state(self) -> None:
        if self.c is not None:
            assert self.device.fake.inferred == self.m.rt.fake.inferred


ClockRelayVersusModel.TestCase.settings = settings(
    max_examples=int(os.environ.get("CALEXEC_RELAY_EXAMPLES", "150")), stateful_step_count=40,
    deadline=None, suppress_health_check=[HealthCheck.too_slow])
TestClockRelayVersusModel = ClockRelayVersusModel.TestCase


# ---- the race the model does not show: a withdrawal against the completion's decision -------

def test_a_withdrawal_racing_the_completion_either_wins_or_finds_the_rule_decided():
    """Threads: the completion thread waits for job 1 (its rule registered) while the test
    withdraws the rule at once. Exactly one side wins: a withdrawal that answered 1 means
    nothing fired and the successor's input is untouched; a firing means the withdrawal
    answered 0. Many rounds, so both orders (and the withdrawal during the argmax) occur."""
    outcomes = {1: Outcome(argmax=11), 2: Outcome()}
    tally = {"withdrawn": 0, "fired": 0, "withdrawn_during_argmax": 0}
    for _ in range(300):
        r = Relay(outcomes)
        try:
            r.relay.fire(job(1))
            r.register(1, 2)
            assert r.relay.submitter_wait(1.0).kind == Kind.INFERRED
            events: list = []

            def complete(relay: NativeRelay = r.relay, out: list = events) -> None:
                out.append(relay.completion_wait(5.0))
            t = threading.Thread(target=complete)
            t.start()
            withdrew = r.relay.withdraw(1)
            t.join(10.0)
            assert not t.is_alive()
            done = events[0]
            assert done.kind == Kind.DONE
            if withdrew == 1:
                assert done.why in (Why.NO_RULE, Why.WITHDRAWN)
                assert r.token_dst[2][0] == -7
                assert r.relay.submitter_wait(0).kind == Kind.TIMEOUT
                tally["withdrawn_during_argmax" if done.why == Why.WITHDRAWN else "withdrawn"] += 1
            else:
                assert done.why == Why.FIRED and r.token_dst[2][0] == 11
                assert r.relay.submitter_wait(0).tag == 2
                tally["fired"] += 1
        finally:
            r.close()
    assert sum(tally.values()) == 300
