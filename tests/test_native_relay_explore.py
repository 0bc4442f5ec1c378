"""The native relay's protocol under the interleaving explorer (issue 28; docs/architecture.md,
"Native hand-offs", proof obligations).

``ThreadedRelay`` is the reference model (drivers/native/relay_model.py) cut into the C
relay's critical sections: each ``with self.mu`` block here is one of calexec_relay.c's
mutex holds, and what runs between them there (infer, Wait, GetStatus, the argmax) runs
between them here, so the explorer's scheduling points fall where the C code's threads can
interleave. tests/test_native_relay.py holds the C relay to the sequential model; this file
explores the threads around it: a submitter that arms each next job and registers its rule
after the infer, a completion thread that fires a job itself when no rule did, and a third
thread withdrawing rules (a cancel), with the bookkeeping the relay floor and the executor use
for a rule registered after its job was decided. Every explored schedule must end with every
job completed once and in order, each job's input the argmax of the one before, no
withdrawal that answered 1 followed by its rule's firing, and no rule left behind. Without the
decision point's re-check the explorer finds the withdrawal that is fired anyway.
"""

from __future__ import annotations

import os
from collections import deque

from calexec.drivers.native.relay import Kind, Why
from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.clock import Clock

#: schedules per exploration (a longer run: CALEXEC_EXPLORE_SCHEDULES=2000)
SCHEDULES = int(os.environ.get("CALEXEC_EXPLORE_SCHEDULES", "200"))
JOBS = 6
DEVICE_S = 0.002


def argmax_of(token: int) -> int:
    return (token * 31 + 7) % 97


class Event:
    def __init__(self, kind: Kind, tag: int = 0, why: Why = Why.NO_RULE, token: int = -1) -> None:
        self.kind, self.tag, self.why, self.token = kind, tag, why, token


class Device:
    """A fake runtime: a job takes DEVICE_S of virtual time; its argmax is argmax_of(input)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.inputs: dict[int, int] = {}  # slot (tag % 2) -> the token written into it
        self.ran: dict[int, int] = {}  # tag -> the input it ran with
        #: set when a job's Wait returns (the canceller withdraws its rule then)
        self.ended = {tag: clock.event() for tag in range(1, JOBS + 1)}

    def infer(self, tag: int) -> int:
        self.ran[tag] = self.inputs[tag % 2]
        return 0

    def wait(self, tag: int) -> int:
        self.clock.sleep(DEVICE_S)
        self.ended[tag].set()
        return 0


class ThreadedRelay:
    """The relay model with the C relay's mutex holds (module docstring). ``recheck``: the
    decision point looks the rule up again (the C relay does); False is the mutant."""

    def __init__(self, clock: Clock, device: Device, recheck: bool = True) -> None:
        self.device = device
        self.recheck = recheck
        self.mu = clock.lock()
        self.to_submitter = clock.condition(self.mu)
        self.to_completion = clock.condition(self.mu)
        self.fires: deque[int] = deque()
        self.in_flight: deque[int] = deque()
        self.rules: dict[int, int] = {}  # tag -> the successor's tag
        self.closed = False

    def fire(self, tag: int) -> None:
        with self.mu:
            self.fires.append(tag)
            self.to_submitter.notify()

    def register(self, tag: int, nxt: int) -> bool:
        with self.mu:
            if self.closed or tag in self.rules:
                return False
            self.rules[tag] = nxt
            return True

    def withdraw(self, tag: int) -> int:
        with self.mu:
            return 1 if self.rules.pop(tag, None) is not None else 0

    def close(self) -> None:
        with self.mu:
            self.closed = True
            self.fires.clear()
            self.rules.clear()
            self.to_submitter.notify_all()
            self.to_completion.notify_all()

    def submitter_wait(self, timeout: float) -> Event:
        with self.mu:
            if not self.to_submitter.wait_for(lambda: self.fires or self.closed, timeout):
                return Event(Kind.TIMEOUT)
            if self.closed:
                return Event(Kind.CLOSED)
            tag = self.fires.popleft()
        rc = self.device.infer(tag)  # outside the mutex, as in C
        with self.mu:
            if rc == 0:
                self.in_flight.append(tag)
                self.to_completion.notify()
            return Event(Kind.INFERRED, tag)

    def completion_wait(self, timeout: float) -> Event:
        with self.mu:
            if not self.to_completion.wait_for(lambda: self.in_flight or self.closed, timeout):
                return Event(Kind.TIMEOUT)
            if self.closed:
                return Event(Kind.CLOSED)
            tag = self.in_flight[0]
        self.device.wait(tag)  # Wait, outside the mutex
        with self.mu:
            self.in_flight.popleft()
            nxt = self.rules.get(tag)
        token = argmax_of(self.device.ran[tag])  # the argmax, outside the mutex
        why = Why.NO_RULE if nxt is None else Why.FIRED
        with self.mu:  # the decision point
            if nxt is not None:
                if self.recheck and tag not in self.rules:
                    why = Why.WITHDRAWN
                if why == Why.FIRED:
                    self.device.inputs[nxt % 2] = token
                    self.fires.append(nxt)
                    self.to_submitter.notify()
                self.rules.pop(tag, None)
            return Event(Kind.DONE, tag, why, token)


def scenario(recheck: bool, withdrawals: tuple[int, ...] = (2, 4)):
    def build(clock: Clock):
        device = Device(clock)
        relay = ThreadedRelay(clock, device, recheck)
        book = clock.lock()  # the Python side's bookkeeping of decided jobs
        done: list[int] = []
        events: dict[int, Event] = {}
        won: set[int] = set()  # tags whose withdrawal answered 1

        def submitter() -> None:
            while True:
                event = relay.submitter_wait(1.0)
                if event.kind == Kind.CLOSED:
                    return
                if event.kind != Kind.INFERRED or event.tag >= JOBS:
                    continue
                with book:  # a rule for a job already decided would never be
                    if event.tag not in done:
                        relay.register(event.tag, event.tag + 1)

        def completion() -> None:
            while len(done) < JOBS:
                event = relay.completion_wait(1.0)
                if event.kind != Kind.DONE:
                    continue
                with book:
                    done.append(event.tag)
                    events[event.tag] = event
                    if event.why != Why.FIRED:
                        relay.withdraw(event.tag)  # registered after the decision: spent
                if event.why != Why.FIRED and event.tag < JOBS:
                    device.inputs[(event.tag + 1) % 2] = event.token
                    relay.fire(event.tag + 1)
            relay.close()

        def canceller() -> None:
            # each withdrawal as its job's Wait returns: the explorer orders it against the
            # completion thread's holds of the mutex that follow
            for tag in withdrawals:
                if not device.ended[tag].wait(1.0):
                    return
                if relay.withdraw(tag) == 1:
                    won.add(tag)

        device.inputs[1] = 5
        relay.fire(1)
        for target, name in ((submitter, "submitter"), (completion, "completion"),
                             (canceller, "canceller")):
            clock.start_thread(target, name)

        def final() -> bool | str:
            if done != list(range(1, JOBS + 1)):
                return f"completed {done}, not 1..{JOBS} once each in order"
            for tag in range(2, JOBS + 1):
                if device.ran[tag] != argmax_of(device.ran[tag - 1]):
                    return f"job {tag} ran with {device.ran[tag]}, not its predecessor's argmax"
            fired_anyway = sorted(t for t in won if events[t].why == Why.FIRED)
            if fired_anyway:
                return f"withdrawn (answered 1) and fired anyway: jobs {fired_anyway}"
            return not relay.rules or f"rules left behind: {relay.rules}"
        return final
    return build


#: PCT's priority change points among the first LENGTH choices: a schedule of this scenario
#: makes about 150 choices, and the withdrawal must land between two of the completion
#: thread's holds of the mutex
DEPTH, LENGTH = 5, 200


def test_every_explored_schedule_of_the_relay_protocol_is_correct():
    found = explore_threads(scenario(recheck=True), seeds=range(SCHEDULES), depth=DEPTH,
                            length=LENGTH)
    assert found.failure is None, found.failure
    assert found.schedules == SCHEDULES


def test_without_the_recheck_at_the_decision_point_a_withdrawal_is_fired_anyway():
    found = explore_threads(scenario(recheck=False), seeds=range(SCHEDULES), depth=DEPTH,
                            length=LENGTH)
    assert found.failure is not None, f"no failing schedule in {found.schedules}"
    assert "withdrawn (answered 1) and fired anyway" in found.failure.message
    again = replay_threads(scenario(recheck=False), found.failure.choices)
    assert again is not None and again.message == found.failure.message
