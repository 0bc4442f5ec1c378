"""The reference model of the native relay (drivers/native/calexec_relay.h), in Python.

Same operations, same codes and events, one thread's view: a wait with nothing ready returns
TIMEOUT at once (the model never blocks). ``tests/test_native_relay.py`` runs random
operation sequences on the C relay and on this model, against one fake runtime, and requires
equal answers; the interleaving of the threads' critical sections is the C relay's own (one
mutex), and the race the model does not show, a withdrawal while the argmax is computed, is
the C relay's WITHDRAWN outcome (tested on its own with threads).

The runtime is a :class:`FakeDevice`-like object with ``infer(job)``, ``wait(job)``,
``status(job)``, ``valid_bytes(job)`` and ``logits(rule)`` (the slice's argmax, or None when
it holds a NaN/Inf).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import attrs

from calexec.drivers.native.relay import MAX_STOP, QUEUE, RULES, Kind, Rc, RelayJob, Why


class ModelRuntime(Protocol):
    def infer(self, job: RelayJob) -> int: ...
    def wait(self, job: RelayJob) -> int: ...
    def status(self, job: RelayJob) -> tuple[int, int]: ...
    def valid_bytes(self, job: RelayJob) -> tuple[int, int]: ...
    def argmax(self, tag: int) -> int | None: ...


@attrs.frozen
class ModelRule:
    tag: int
    next: RelayJob
    expect_bytes: int
    stop: tuple[int, ...]


@attrs.frozen
class ModelEvent:
    kind: Kind
    tag: int = 0
    rc: int = 0
    status: int = -1
    why: Why = Why.FIRED
    fired_tag: int = -1
    token: int = -1


class RelayModel:
    """The relay's rules in plain Python (module docstring)."""

    def __init__(self, rt: ModelRuntime, done_status: int = 3,
                 submitter_only: bool = False) -> None:
        self.rt = rt
        self.done_status = done_status
        #: ``calexec_relay_submitter_only``: inferred jobs are not tracked; track and
        #: register are refused (EARG)
        self.submitter_only = submitter_only
        self.fires: deque[RelayJob] = deque()
        self.in_flight: deque[RelayJob] = deque()
        self.rules: dict[int, ModelRule] = {}
        self.tokens: dict[int, int] = {}  # the successor's tag -> the token written into it
        self.wake_pending = False
        self.closed = False
        self.decided: deque[ModelEvent] = deque(maxlen=QUEUE)  # the last decisions

    def fire(self, job: RelayJob) -> Rc:
        if self.closed:
            return Rc.ECLOSED
        if len(self.fires) == QUEUE:
            return Rc.EFULL
        self.fires.append(job)
        return Rc.OK

    def track(self, job: RelayJob) -> Rc:
        if self.submitter_only:
            return Rc.EARG
        if self.closed:
            return Rc.ECLOSED
        if len(self.in_flight) == QUEUE:
            return Rc.EFULL
        self.in_flight.append(job)
        return Rc.OK

    def wake(self) -> Rc:
        if self.closed:
            return Rc.ECLOSED
        self.wake_pending = True
        return Rc.OK

    def submitter_wait(self) -> ModelEvent:
        if self.closed:
            return ModelEvent(Kind.CLOSED)
        if not self.fires:
            if self.wake_pending:
                self.wake_pending = False
                return ModelEvent(Kind.WAKE)
            return ModelEvent(Kind.TIMEOUT)
        job = self.fires.popleft()
        rc = self.rt.infer(job)
        why = Why.FIRED
        if rc == 0 and not self.submitter_only:
            if len(self.in_flight) < QUEUE:
                self.in_flight.append(job)
            else:
                why = Why.QUEUE_FULL
        return ModelEvent(Kind.INFERRED, tag=job.tag, rc=rc, why=why)

    def register(self, rule: ModelRule) -> Rc:
        if len(rule.stop) > MAX_STOP or self.submitter_only:
            return Rc.EARG
        if self.closed:
            return Rc.ECLOSED
        if rule.tag in self.rules:
            return Rc.EARG
        if len(self.rules) == RULES:
            return Rc.EFULL
        self.rules[rule.tag] = rule
        return Rc.OK

    def withdraw(self, tag: int) -> int:
        return 1 if self.rules.pop(tag, None) is not None else 0

    def completion_wait(self) -> ModelEvent:
        if self.closed:
            return ModelEvent(Kind.CLOSED)
        if not self.in_flight:
            return ModelEvent(Kind.TIMEOUT)
        job = self.in_flight[0]
        wait_rc = self.rt.wait(job)
        if wait_rc == 13:
            return ModelEvent(Kind.TIMEOUT, tag=job.tag, rc=wait_rc)
        self.in_flight.popleft()
        rule = self.rules.get(job.tag)
        status, why, token = -1, Why.NO_RULE, -1
        if wait_rc != 0:
            why = Why.WAIT_FAILED
        else:
            src, status = self.rt.status(job)
            if src != 0 or status != self.done_status:
                why = Why.NOT_DONE
            elif rule is not None:
                vrc, valid = self.rt.valid_bytes(job)
                argmax = self.rt.argmax(job.tag)
                if vrc != 0 or valid < rule.expect_bytes:
                    why = Why.SHORT
                elif argmax is None:
                    why = Why.NONFINITE
                else:
                    token = argmax
                    why = Why.STOP if token in rule.stop else Why.FIRED
        fired_tag = -1
        if rule is not None:
            if why == Why.FIRED:
                if len(self.fires) == QUEUE:
                    why = Why.QUEUE_FULL
                else:
                    self.tokens[rule.next.tag] = token
                    self.fires.append(rule.next)
                    fired_tag = rule.next.tag
            del self.rules[job.tag]
        event = ModelEvent(Kind.DONE, tag=job.tag, rc=wait_rc, status=status, why=why,
                           fired_tag=fired_tag, token=token)
        self.decided.append(event)
        return event

    def result(self, tag: int) -> ModelEvent:
        """``result_wait`` that never blocks: the decision on ``tag`` if kept, else CLOSED
        or TIMEOUT."""
        for event in reversed(self.decided):
            if event.tag == tag:
                return event
        return ModelEvent(Kind.CLOSED if self.closed else Kind.TIMEOUT, tag=tag)

    def close(self) -> list[int]:
        dropped = [job.tag for job in self.fires]
        self.fires.clear()
        self.rules.clear()
        self.closed = True
        return dropped[:QUEUE]
