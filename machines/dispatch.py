"""The executor's dispatch state, with one owner (issue 25).

Everything the executor's ``submit_mu`` guards lives here: the submit queue, the jobs armed
ahead of their request (a decode stream's next step, an implicit pre-arm) and the queue of
what the submitter arms next, the in-flight permits, the token budget, the generation fence
(``Generation.users``/``closing``), the refusal that fails queued work during a recovery, the
slots the runtime still holds after a failed Wait, and the open decode streams and guesses by
sequence. Like vLLM's scheduler owns its queues and KV accounting, this object owns that state;
the executor's threads, ``DecodeStream``, ``AutoArm`` and the lifecycle change it only through
the methods below.

The object is **passive**: a method takes facts (now, the current generation, the capacity,
a budget) and returns an outcome (``SubmitterStep``: submit this job, fail these, arm that
step, nothing to do; the jobs a fence or a reclaim took, for the caller to release). It never
calls back into the executor, a stream or the lifecycle, never calls the runtime, and holds
its lock only inside its own methods (the one wait it does, ``next_for_submitter``'s, is on
its own condition). Whoever removes a job from ``armed`` owns it (``take_armed``,
``take_armed_of``, ``close``, ``reclaim``, ``next_for_submitter``): it is released exactly
once. ``snapshot()`` is its one read for tests and the explorer.

Releasing: from the moment a job leaves ``armed`` until it is queued or resolved, its owner
is releasing it (lease, KV txn rollback, budget) outside this lock, and its KV txn still
holds its sequence. Such jobs are kept in ``_releasing`` (with the owner's thread) until
``released`` (the end of ``JobOutcomes.fail_before_submit``, after the job is resolved) or
queued, and ``wait_releases`` waits for those of a sequence that other threads have under
way: ``JobOutcomes.release_armed_of`` (the KV coordinator's ``on_busy``) waits for them before
a reserve, reset or truncation looks at the sequence. Otherwise a stream's step whose armed job another thread
took would meet that job's half-released txn and answer ``kv.sequence_busy``, where the plain
path (no armed job) admits it (CI's bench faults: HTTP 400 on the client's own sequence).

Lock rank: ``submit_mu`` (machines/locks.py). The caller never holds it when calling a method
here, except through ``cv`` (``with dispatch.cv:``), which streams use for their own fields
(they live under the same lock, so an armed job and its stream change together); methods
ending in ``_locked`` expect it held.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypedDict

import attrs

from calexec.contracts.status import Phase, Status
from calexec.machines.api import DispatchSnapshot
from calexec.machines.chart_names import JOB_EV_CANCEL, JOB_EV_ENQUEUE
from calexec.machines.clock import Clock
from calexec.machines.compiled import GuardRejected
from calexec.machines.job import SHUTDOWN_CALLED
from calexec.machines.locks import SUBMIT, LockOrder

if TYPE_CHECKING:
    from calexec.machines.autoarm import AutoArm
    from calexec.machines.generation import Generation
    from calexec.machines.job import Job, JobHandle
    from calexec.machines.kv import KvCoordinator, KvTxn
    from calexec.machines.pool import BufferSlot
    from calexec.machines.stream import DecodeStream


class DispatchPeek(TypedDict):
    """``Dispatch.peek()``: counts and copies of the dispatch state, read without the lock."""

    queued: int
    inflight: int
    pending_tokens: int
    armed: list[Job]
    guesses: list[AutoArm]
    held: list[Held]
    to_arm: int
    handing_off: int


class Armer(Protocol):
    """What the submitter arms when it has nothing to submit: a decode stream's next step
    (machines/stream.py) or an implicit pre-arm (machines/autoarm.py)."""

    seq_id: int

    def arm_next(self) -> None:
        """Arm now, on the submitter thread: never raises, never waits."""


@attrs.frozen
class Arm:
    """How ``DeviceExecutor.admit_armed`` admits a pre-armed job: chained behind ``prev_txn``
    (None: an ordinary reserve), waiting for resources (``blocking``: the caller's own step,
    whose token is on its way: a request, never a guess) or not."""

    prev_txn: KvTxn | None
    blocking: bool
    #: wake the submitter once armed, so its idle wait counts the armed job's deadline (not
    #: needed when the submitter arms it itself)
    notify: bool = False
    #: as ``enqueue``'s: given the job's handle before admission starts (a decode stream's own
    #: step, whose ``cancel`` then reaches a wait for KV, a slot or Ready)
    on_created: Callable[[JobHandle], None] | None = None


@attrs.define(eq=False)
class Held:
    """A quarantined slot the runtime still holds after a failed Wait (§9.1), with the
    in-flight permit of its job (``DeviceExecutor._reap_held``)."""

    slot: BufferSlot
    kvc: KvCoordinator
    seq_id: int
    job: Job
    grace_end: float  # ``device.hung`` is reported once after this (Clock.monotonic())
    reported: bool = False


@attrs.frozen
class SubmitterStep:
    """What the submitter does next (``Dispatch.next_for_submitter``)."""

    #: jobs that can no longer be submitted (queued or armed), with why; the submitter fails
    #: them (``guesses``: how many were implicit pre-arms, for the counter)
    fail: tuple[tuple[Job, Status], ...] = ()
    guesses: int = 0
    #: the job to submit (its permit taken)
    submit: Job | None = None
    #: the stream or guess to arm now
    arm: Armer | None = None
    #: nothing to do: the call returned after waiting (True) or at once (False, idle)
    woke: bool = False
    #: nothing to do, asked with ``relay_idle``: the submitter waits in its native relay
    #: this long at most (``SubmitRelay.wait``); the wait the plain path takes on the
    #: condition, with the same bound
    idle_for: float | None = None

    @property
    def idle(self) -> bool:
        return not (self.fail or self.submit is not None or self.arm is not None or self.woke
                    or self.idle_for is not None)


@attrs.frozen
class RelayOffer:
    """What ``fire`` and ``queue_fired`` need to hand a job to the submitter's native relay
    themselves (``SubmitRelay``): the submitter's own checks (``next_for_submitter``'s
    ``unsubmittable`` and ``capacity``) and whether this job's infer is the relay's plain
    ``infer`` (not Phase B's fixed engine)."""

    unsubmittable: Callable[[Job, float], Status | None]
    capacity: Callable[[], int]
    eligible: Callable[[Job], bool]


#: the submitter re-checks slots held by the runtime this often (nobody signals a let-go)
HELD_RECHECK_S = 0.05
#: the longest single wait of the submitter in its native relay (the plain path's idle wait
#: is shutdown-only; a native wait is bounded, and simply taken again)
RELAY_IDLE_MAX_S = 1.0


class Dispatch:
    """The dispatch state of one executor (see the module docstring)."""

    def __init__(self, locks: LockOrder, clock: Clock, capacity: int) -> None:
        self.clock = clock
        self.mu = locks.lock(SUBMIT)
        #: the dispatch condition (``mu``): streams guard their own fields with it
        self.cv = clock.condition(self.mu, "submit_cv")
        self._queue: deque[Job] = deque()
        self._armed: list[Job] = []
        #: armed jobs that are their caller's step, not a guess (admitted with their token on
        #: the way: ``arm(..., for_caller=True)``): never reclaimed nor taken for another
        #: request of the sequence, exactly as the plain path never takes a queued job back
        self._for_caller: set[Job] = set()
        self._to_arm: deque[tuple[float, Armer]] = deque()  # (arm at, armer), in order
        self._arm_later: list[Armer] = []  # found no free slot: again when a lease is back
        self._arming: Armer | None = None
        #: armed jobs taken out of ``_armed`` and being released by their owner (job, the
        #: owner's thread ident), until queued or resolved (module docstring: Releasing)
        self._releasing: list[tuple[Job, int]] = []
        self._streams: dict[int, DecodeStream] = {}  # seq id -> its open decode stream
        self._guesses: dict[int, AutoArm] = {}  # seq id -> its AutoArm
        self._inflight = 0
        self.capacity = capacity  # effective; a Phase B downgrade lowers it
        self._pending_tokens = 0
        self._held: list[Held] = []
        self._handing_off = 0  # popped by the submitter, not yet failed/submitted
        self._refusal: Status | None = None
        self._stopping = False  # the executor's threads are to stop (``stop``)
        #: the submitter waits in a native relay (``SubmitRelay``): whatever wakes it wakes
        #: that wait too (``_notify``); set by the executor while its relay is open
        self.relay_wake: Callable[[], object] | None = None
        #: the submitter was told to wait in its relay (``idle_for``) and not woken since:
        #: only then does a notification call ``relay_wake`` (one native call per wait,
        #: none while the submitter runs Python, which looks at the state itself before it
        #: waits again)
        self._relay_waiting = False
        #: jobs taken for the submitter by the thread that queued them, to be inferred by
        #: the relay (job id -> job), until the submitter reports them (``take_relayed``)
        self._relayed: dict[int, Job] = {}
        #: jobs taken for the relay that it refused (closed): the submitter submits them
        #: itself, first (their permits are held, their slots marked in flight)
        self._refused_by_relay: deque[Job] = deque()

    # ---- reads -------------------------------------------------------------------------------
    @property
    def pending_tokens(self) -> int:
        return self._pending_tokens

    @property
    def inflight(self) -> int:
        return self._inflight

    @property
    def anything_armed(self) -> bool:
        """Cheap, unlocked: is any job armed ahead of its request (a hint, then locked)."""
        return bool(self._armed)

    @property
    def any_guess(self) -> bool:
        """Cheap, unlocked: is there any implicit pre-arm (a hint, then locked)."""
        return bool(self._guesses)

    @property
    def any_held(self) -> bool:
        """Cheap, unlocked: does the runtime hold a slot after a failed Wait."""
        return bool(self._held)

    def anything_for(self, seq_id: int) -> bool:
        """Cheap, unlocked hint: might anything be armed, be arming or be fired ahead for
        ``seq_id`` (then ``take_armed_of``, locked, says what)."""
        return bool(self._armed or self._to_arm or self._arming is not None
                    or self._releasing or seq_id in self._guesses or seq_id in self._streams)

    def has_work(self) -> bool:
        """Something queued or armed (stepped mode drives the submitter until not)."""
        return bool(self._queue or self._armed)

    def drained(self) -> bool:
        """Nothing queued, armed, handed off or in flight (the lifecycle's drain)."""
        with self.mu:
            return (self._inflight == 0 and self._handing_off == 0 and not self._queue
                    and not self._armed)

    def only_declared_hung(self) -> bool:
        """Nothing queued, armed, handed off or relayed, and every job in flight is one the
        runtime still holds after a failed Wait whose ``device.hung`` was reported (past its
        grace): no Wait will end them, only a reset. (A recovery's drain stops waiting
        then: ``DeviceLifecycle._drain``.)"""
        with self.mu:
            return (bool(self._held) and self._inflight == len(self._held)
                    and self._handing_off == 0 and not self._queue and not self._armed
                    and not self._relayed and all(entry.reported for entry in self._held))

    def snapshot(self) -> DispatchSnapshot:
        with self.mu:
            return {"queued": len(self._queue), "inflight": self._inflight,
                    "pending_tokens": self._pending_tokens, "armed": len(self._armed),
                    "auto_armed": sum(1 for e in self._guesses.values() if e.job is not None),
                    "guesses": len(self._guesses), "to_arm": len(self._to_arm),
                    "arm_later": len(self._arm_later), "arming": self._arming is not None,
                    "held_by_runtime": len(self._held), "handing_off": self._handing_off,
                    "relayed": len(self._relayed), "refusing": self._refusal is not None}

    def peek(self) -> DispatchPeek:
        """The state without the lock, for a checker that runs only while no other thread
        can change it (the explorer, when every thread waits): counts and copies."""
        return {"queued": len(self._queue), "inflight": self._inflight,
                "pending_tokens": self._pending_tokens, "armed": list(self._armed),
                "guesses": list(self._guesses.values()), "held": list(self._held),
                "to_arm": len(self._to_arm), "handing_off": self._handing_off}

    def armed_jobs(self) -> list[Job]:
        """The jobs armed now (a copy; tests and the explorer's checks)."""
        with self.mu:
            return list(self._armed)

    def guess(self, seq_id: int) -> AutoArm | None:
        """The implicit pre-arm of ``seq_id`` (None: none)."""
        return self._guesses.get(seq_id)

    def guesses(self) -> list[AutoArm]:
        with self.mu:
            return list(self._guesses.values())

    def held(self) -> list[Held]:
        with self.mu:
            return list(self._held)

    # ---- waking ------------------------------------------------------------------------------
    def wake(self) -> None:
        """Wake every wait on the dispatch condition (a cancel, a shutdown, a lease back)."""
        with self.cv:
            self._notify()

    def _notify(self) -> None:
        """(cv held) Wake the waits on the condition and the submitter's relay wait: there
        may be work for the submitter."""
        self.cv.notify_all()
        relay_wake = self.relay_wake
        if relay_wake is not None and self._relay_waiting:
            self._relay_waiting = False
            relay_wake()

    # ---- the token budget ----------------------------------------------------------------------
    def take_budget(self, job: Job, budget: int) -> bool:
        """Take ``job``'s tokens of the admission budget; False when it would exceed
        ``budget`` (an internal job, the golden, always gets them)."""
        tokens = job.request.token_count
        with self.mu:
            if self._pending_tokens + tokens > budget and not job.internal:
                return False
            self._pending_tokens += tokens
            job.budget_taken = True
            return True

    def over_budget(self, tokens: int, budget: int) -> bool:
        return self._pending_tokens + tokens > budget

    def release_budget(self, job: Job) -> None:
        with self.mu:
            if job.budget_taken:
                job.budget_taken = False
                self._pending_tokens -= job.request.token_count

    # ---- generation fence ----------------------------------------------------------------------
    def enter(self, gen: Generation, current: Generation | None) -> bool:
        """A request thread starts working on ``gen`` (False: it is closing or retired)."""
        with self.mu:
            if gen.closing or gen is not current:
                return False
            gen.users += 1
            return True

    def exit(self, gen: Generation) -> None:
        with self.cv:
            gen.users -= 1
            if gen.closing and gen.users == 0:
                self.cv.notify_all()

    def close(self, gen: Generation) -> list[Job]:
        """Close ``gen`` to request threads and take the jobs armed in it (guesses that will
        never be fired: the caller releases them at once, so a drain finds nothing armed).
        Their guesses leave the table."""
        with self.cv:
            gen.closing = True
            armed = [job for job in self._armed if job.gen is gen]
            for job in armed:
                self._unarm_locked(job)
                if job.auto is not None:
                    self._forget_guess_locked(job.auto)
            self._notify()
        return armed

    def wait_left(self, gen: Generation, deadline: float) -> bool:
        """Wait (bounded) until no request thread works on ``gen`` any more."""
        with self.cv:
            while gen.users:
                remaining = deadline - self.clock.monotonic()
                if remaining <= 0:
                    return False
                self.clock.wait(self.cv, remaining)
        return True

    # ---- refusal (a recovery, Failed, shutdown) --------------------------------------------------
    def refuse(self, status: Status | None) -> None:
        """Queued and armed jobs fail with ``status`` (None: admission may queue again)."""
        with self.cv:
            self._refusal = status
            self._notify()

    def cancel_pending(self) -> None:
        """Shutdown: every queued and armed job is cancelled (the submitter releases them)."""
        with self.cv:
            for job in (*self._queue, *self._armed):
                if not job.cancel_flag:  # (its caller's cancel came first: its own words)
                    job.cancel_why = f"{SHUTDOWN_CALLED}: cancelled before it was submitted"
                job.cancel_flag = True
            self._notify()

    # ---- the queue ------------------------------------------------------------------------------
    def queue(self, job: Job, current: Generation | None) -> bool:
        """Push ``job`` for the submitter; False when its generation closed or was replaced
        (fencing: never into another generation's queue; the caller releases it)."""
        with self.cv:
            gen = job.gen
            if gen is None or gen.closing or gen is not current:
                return False
            self._queue.append(job)
            self._notify()
            return True

    # ---- armed jobs -----------------------------------------------------------------------------
    def arm(self, job: Job, current: Generation | None, notify: bool = False,
            for_caller: bool = False) -> bool:
        """Keep ``job`` (prepared up to Preparing) until its token comes; False when its
        generation closed or was replaced. ``notify``: wake the submitter, whose wait then
        ends at this job's deadline. ``for_caller``: the job is a caller's own step about to
        be fired, not a guess (``reclaim`` and ``take_armed_of`` leave it; a fence, a cancel,
        its deadline and a refusal release it as they release a queued job)."""
        with self.cv:
            gen = job.gen
            if gen is None or gen.closing or gen is not current:
                return False
            self._armed.append(job)
            if for_caller:
                self._for_caller.add(job)
            if notify:
                self._notify()
            return True

    def fire(self, job: Job, token: int, current: Generation | None,
             rearm: Armer | None = None, at: float = 0.0, relay: RelayOffer | None = None
             ) -> tuple[bool, Status | None]:
        """A pre-armed job gets its token and is queued, atomically (``queue_fired``):
        (False, None) when it was not armed any more (someone else owns it); (True, a
        Status) when it is owned but could not be queued (the caller releases it); (True,
        None) when queued, and then ``rearm`` is armed by the submitter from ``at``.
        ``relay``: the submitter waits in a native relay; when the job is what the submitter
        would submit next at once, it is taken for it here (``job.relayed``: the caller
        hands it to the relay, ``_take_for_relay_locked``)."""
        with self.cv:
            if not self._take_armed_locked(job):
                return False, None
            status = self._queue_fired_locked(job, token, current, relay)
            if status is None and rearm is not None:
                self._to_arm.append((at, rearm))
            return True, status

    def queue_fired(self, job: Job, token: int, current: Generation | None,
                    relay: RelayOffer | None = None) -> Status | None:
        """``job`` (owned by the caller: an adopted guess) gets its token and is queued; a
        Status when it could not be (the caller releases it). ``relay`` as for ``fire``."""
        with self.cv:
            return self._queue_fired_locked(job, token, current, relay)

    def _queue_fired_locked(self, job: Job, token: int, current: Generation | None,
                            relay: RelayOffer | None = None) -> Status | None:
        """Write ``token`` into the job's slot and request, Preparing -> Queued, stamp its
        timings, queue it, wake the submitter. A Status: not queued (fenced or cancelled)."""
        gen = job.gen
        job.uncounted = False  # a request now: its answer counts
        job.count_as_client()  # and its chart's transitions are the client's
        if gen is None or gen.closing or gen is not current:  # fencing: never into another
            return Status.unavailable(Phase.SUBMIT, f"generation {job.generation_id} retired "
                                      "before the job was queued; retry", **job.ctx())
        tokens, lease = job.request.tokens, job.lease
        host_input = None if lease is None else lease.slot.host_input
        if tokens is None or host_input is None:  # an armed decode job holds both
            return Status.internal("armed_job_incomplete", Phase.PREPARE, "an armed job "
                                   "without its tokens or buffer slot", **job.ctx())
        tokens[0] = token
        host_input[0] = token
        try:
            job.run.send(JOB_EV_ENQUEUE)
        except GuardRejected:
            job.run.send(JOB_EV_CANCEL)
            return Status.cancelled(Phase.PREPARE, job.cancel_message(), **job.ctx())
        # the request exists from now: its admission ran ahead (S11, §9.1: the job's
        # timings are the request's, not the guess's)
        timings = job.timings
        timings.accepted_us = timings.admitted_us = timings.queued_us = self.clock.now_us()
        self._released_locked(job)  # queued: a request's job now, no release under way
        self._queue.append(job)
        if relay is not None and self._take_for_relay_locked(job, relay):
            # the relay's fire wakes the submitter in C, and it looks again after reporting
            # the job: a wake of its relay wait now would only bring it back to Python
            # before the job is there
            self._relay_waiting = False
            self.cv.notify_all()
            return None
        self._notify()
        return None

    def _take_for_relay_locked(self, job: Job, relay: RelayOffer) -> bool:
        """``job`` was just queued: if the submitter's next look (``_next_locked``) would
        submit exactly it, at once, take it for the submitter now, as that look would (its
        permit, the hand-off), so that the native relay infers it without a Python wake-up.
        The same decision, made on this thread: no job ended to fail first, ``job`` alone in
        the queue, a permit free, nothing held by the runtime, not stopping."""
        if (self._stopping or self._held or len(self._queue) != 1
                or self._inflight >= relay.capacity() or not relay.eligible(job)):
            return False
        now = self.clock.monotonic()
        if any(relay.unsubmittable(other, now) is not None
               for other in (*self._queue, *self._armed)):
            return False
        self._queue.popleft()
        self._inflight += 1
        job.permit_held = True
        self._handing_off += 1
        job.relayed = True
        self._relayed[job.job_id] = job
        return True

    def take_relayed(self, tag: int) -> Job | None:
        """The submitter's relay reported the job with id ``tag`` (inferred, or dropped at
        its close): it is the submitter's again, to apply what follows infer (None: no
        such job was taken for the relay)."""
        with self.mu:
            return self._relayed.pop(tag, None)

    def relay_refused(self, job: Job) -> None:
        """The relay did not take ``job`` (closed, full, or its fire raised): the submitter
        submits it itself, before anything else (its permit and hand-off stay counted). Taking
        the job for the relay left the submitter's relay wait to the fire, which woke nobody
        in C: the wait is woken here (else the job waited out the submitter's idle wait)."""
        with self.cv:
            if self._relayed.pop(job.job_id, None) is job:
                self._refused_by_relay.append(job)
            self._relay_waiting = self.relay_wake is not None
            self._notify()

    def take_armed(self, job: Job) -> bool:
        """Take ``job`` out of the armed jobs: True, the caller owns it now; False, someone
        else did (fired, released, reclaimed)."""
        with self.mu:
            return self._take_armed_locked(job)

    def _unarm_locked(self, job: Job) -> None:
        self._armed.remove(job)
        self._for_caller.discard(job)
        # its owner (this thread) releases it or queues it next: until then the sequence's
        # operations wait for it (``take_armed_of``); entries resolved meanwhile are dropped
        releasing = self._releasing
        if releasing:
            releasing[:] = [entry for entry in releasing if not entry[0].done]
        releasing.append((job, threading.get_ident()))

    def _released_locked(self, job: Job) -> None:
        if self._releasing:
            self._releasing[:] = [entry for entry in self._releasing
                                  if entry[0] is not job and not entry[0].done]

    def _take_armed_locked(self, job: Job) -> bool:
        if job in self._armed:
            self._unarm_locked(job)
            return True
        return False

    def reclaim(self, end: float) -> tuple[list[Job], list[Job]]:
        """A request is short of a slot or of token budget: take every armed job not fired
        yet, (guesses, streams' next steps), for the caller to release."""
        with self.cv:
            guesses = [job for entry in list(self._guesses.values())
                       if (job := self._detach_guess_locked(entry, end)) is not None]
            streams = [job for job in self._armed
                       if job.auto is None and job not in self._for_caller]
            for job in streams:
                self._unarm_locked(job)
        return guesses, streams

    def take_armed_of(self, seq_id: int, end: float
                      ) -> tuple[Job | None, list[Job], DecodeStream | None]:
        """Another request, reset or truncation of ``seq_id`` is coming: take what was armed
        for it (its guess, a stream's next step; after an arming in progress ends, bounded by
        ``end``) and stop arming it; returns (guess job, stream jobs, the open stream) for the
        caller to release (and to discard the stream's step fired ahead), and then to wait
        for the releases other threads have under way (``wait_releases``)."""
        with self.cv:
            entry = self._guesses.get(seq_id)
            guess = None if entry is None else self._detach_guess_locked(entry, end)
            while self._arming is not None and self._arming.seq_id == seq_id:
                remaining = end - self.clock.monotonic()
                if remaining <= 0:
                    break
                self.clock.wait(self.cv, remaining)
            self._to_arm = deque(item for item in self._to_arm if item[1].seq_id != seq_id)
            self._arm_later = [armer for armer in self._arm_later if armer.seq_id != seq_id]
            streams = [job for job in self._armed if job.auto is None
                       and job.request.seq_id == seq_id and job not in self._for_caller]
            for job in streams:
                self._unarm_locked(job)
            return guess, streams, self._streams.get(seq_id)

    def released(self, job: Job) -> None:
        """``job``'s owner finished releasing it (it is resolved): the sequence's operations
        waiting for it (``wait_releases``) go on."""
        if not self._releasing:  # (unlocked hint: the common case, nothing under way)
            return
        with self.cv:
            self._released_locked(job)
            self.cv.notify_all()

    def wait_releases(self, seq_id: int, end: float) -> bool:
        """Wait (bounded by ``end``) until no other thread is releasing an armed job of
        ``seq_id`` (module docstring: Releasing); False when ``end`` came first."""
        me = threading.get_ident()
        with self.cv:
            while True:
                releasing = self._releasing
                releasing[:] = [entry for entry in releasing if not entry[0].done]
                if not any(owner != me and job.request.seq_id == seq_id
                           for job, owner in releasing):
                    return True
                remaining = end - self.clock.monotonic()
                if remaining <= 0:
                    return False
                self.clock.wait(self.cv, remaining)

    # ---- what the submitter arms -------------------------------------------------------------------
    def schedule_arm(self, armer: Armer, at: float) -> None:
        """``armer`` is armed by the submitter from ``at`` (Clock.monotonic(); 0: at once)."""
        with self.cv:
            self._to_arm.append((at, armer))

    def arm_later(self, armer: Armer) -> None:
        """``armer``'s arming found no free slot: armed again when a lease comes back."""
        with self.mu:
            self._arm_later.append(armer)

    def lease_returned(self) -> None:
        """A slot came back: the armings that missed one are tried again."""
        if not self._arm_later:
            return
        with self.cv:
            self._to_arm.extend((0.0, armer) for armer in self._arm_later)
            self._arm_later.clear()
            self._notify()

    def unschedule(self, armer: Armer) -> None:
        """``armer`` is not to be armed any more (cv held by the caller)."""
        self._to_arm = deque(item for item in self._to_arm if item[1] is not armer)
        while armer in self._arm_later:
            self._arm_later.remove(armer)

    def scheduled(self, armer: Armer) -> bool:
        """Is ``armer`` waiting to be armed (now or when a lease comes back)."""
        with self.mu:
            return (any(item[1] is armer for item in self._to_arm)
                    or armer in self._arm_later)

    def arming(self, armer: Armer) -> bool:
        """Is the submitter arming ``armer`` right now (cv held by the caller)."""
        return self._arming is armer

    def done_arming(self) -> None:
        """The submitter finished the arming ``next_for_submitter`` handed it."""
        with self.cv:
            self._arming = None
            self.cv.notify_all()

    # ---- decode streams and guesses by sequence --------------------------------------------------
    def open_stream(self, seq_id: int, stream: DecodeStream) -> None:
        with self.mu:
            self._streams[seq_id] = stream

    def close_stream_locked(self, seq_id: int, stream: DecodeStream) -> None:
        """cv held: ``stream`` of ``seq_id`` closed."""
        if self._streams.get(seq_id) is stream:
            del self._streams[seq_id]

    def add_guess(self, entry: AutoArm, at: float) -> bool:
        """Keep ``entry`` (an AutoArm) as ``entry.seq_id``'s guess, armed from ``at``; False
        when the sequence has one already."""
        with self.cv:
            if entry.seq_id in self._guesses:
                return False
            self._guesses[entry.seq_id] = entry
            self._to_arm.append((at, entry))
            return True

    def guess_armed_locked(self, entry: AutoArm, job: Job) -> bool:
        """cv held: the submitter armed ``job`` for ``entry``; False when the guess was
        dropped meanwhile (the caller releases the job)."""
        if self._guesses.get(entry.seq_id) is not entry:
            return False
        entry.job = job
        job.uncounted = True  # nobody asked for it: its release is no failure
        job.auto = entry
        return True

    def forget_guess_locked(self, entry: AutoArm) -> None:
        """cv held: ``entry`` leaves the table (its job, if any, is released by whoever
        holds it)."""
        self._forget_guess_locked(entry)

    def _forget_guess_locked(self, entry: AutoArm) -> None:
        entry.dropped = True
        entry.job = None
        if self._guesses.get(entry.seq_id) is entry:
            del self._guesses[entry.seq_id]

    def detach_guess(self, seq_id: int, end: float) -> tuple[AutoArm | None, Job | None]:
        """A request of ``seq_id`` came: take its guess out of the table and own its armed
        job (None: none armed, or already released); waits (bounded by ``end``) for an
        arming of it in progress. Returns (entry, job)."""
        with self.cv:
            entry = self._guesses.get(seq_id)
            if entry is None:
                return None, None
            return entry, self._detach_guess_locked(entry, end)

    def _detach_guess_locked(self, entry: AutoArm, end: float) -> Job | None:
        self._to_arm = deque(item for item in self._to_arm if item[1] is not entry)
        while self._arming is entry:
            remaining = end - self.clock.monotonic()
            if remaining <= 0:
                break
            self.clock.wait(self.cv, remaining)
        job = entry.job
        self._forget_guess_locked(entry)  # an arming still running drops its job itself
        if job is None or job not in self._armed:
            return None
        self._unarm_locked(job)
        job.auto = None
        return job

    # ---- the submitter --------------------------------------------------------------------------
    def stop(self, stopping: bool = True) -> None:
        """The executor's threads are to stop (shutdown), or run again (start): read under
        the lock by ``next_for_submitter``, so a stop never slips between its check and its
        wait."""
        with self.cv:
            self._stopping = stopping
            self._notify()

    def next_for_submitter(self, unsubmittable: Callable[[Job, float], Status | None],
                           capacity: int | Callable[[], int], block: bool,
                           wake_at: float | None | Callable[[float], float | None],
                           relay_idle: bool = False) -> SubmitterStep:
        """The submitter's next step. ``unsubmittable(job, now)`` says why a queued or armed
        job can no longer be submitted (a pure check of the job and the executor's facts: it
        must not take a lock); ``capacity`` (the in-flight bound) and ``wake_at`` (when an
        idle wait should end early, Clock.monotonic(); None: no early end) are values or
        lock-free callables read each time they are needed (``wake_at(now)`` only right
        before a wait). With ``block``, and nothing to do, waits on the condition until the
        earliest deadline (of a queued or armed job, of an arming, ``wake_at``, the held-slot
        re-check) and looks again under the same lock, so a wake-up goes straight to the job
        that caused it; it returns ``woke`` only when slots the runtime holds need a re-check
        outside the lock (``JobOutcomes.reap_held``) or, with non-callable ``capacity`` and
        ``wake_at`` (fixed for one call), after one wait: the caller acts and asks again.
        ``relay_idle`` (with ``block``): instead of that wait, return ``idle_for``, its bound,
        for the submitter to wait in its native relay (``SubmitRelay.wait``); it also waits
        there while jobs taken for the relay are not reported yet."""
        fixed = not callable(capacity) and not callable(wake_at)
        with self.cv:
            while True:
                step = self._next_locked(unsubmittable, capacity, block, wake_at, relay_idle)
                if step is not None:
                    return step
                if fixed or self._held:
                    return SubmitterStep(woke=True)

    def _next_locked(self, unsubmittable: Callable[[Job, float], Status | None],
                     capacity: int | Callable[[], int], block: bool,
                     wake_at: float | None | Callable[[float], float | None],
                     relay_idle: bool = False) -> SubmitterStep | None:
        """One look of ``next_for_submitter`` (lock held): a step, or None after a wait."""
        self._relay_waiting = False  # the submitter looks now (any wake was for this look)
        if self._refused_by_relay:  # taken for the relay, which was closed: submit them
            return SubmitterStep(submit=self._refused_by_relay.popleft())
        stopping = self._stopping
        now = self.clock.monotonic()
        ended = [(job, status) for job in self._queue
                 if (status := unsubmittable(job, now)) is not None]
        for job, _ in ended:
            self._queue.remove(job)
        guesses = 0
        if self._armed:  # armed jobs cancelled, expired or fenced: released too
            armed = [(job, status) for job in self._armed
                     if (status := unsubmittable(job, now)) is not None]
            for job, _ in armed:
                self._unarm_locked(job)
                if job.auto is not None:  # an implicit pre-arm: its entry goes too
                    self._forget_guess_locked(job.auto)
                    guesses += 1
            ended += armed
        if ended:
            self._handing_off += len(ended)
            return SubmitterStep(fail=tuple(ended), guesses=guesses)
        if self._queue and self._inflight < (capacity() if callable(capacity)
                                             else capacity):
            job = self._queue.popleft()
            self._inflight += 1
            job.permit_held = True
            self._handing_off += 1
            return SubmitterStep(submit=job)
        arm_in = None
        if self._to_arm:  # nothing to submit now: arm a stream's next job or a guess
            at, armer = self._to_arm[0]
            arm_in = at - now
            if arm_in <= 0 or not block or stopping:
                self._to_arm.popleft()
                self._arming = armer
                return SubmitterStep(arm=armer)
        if not block or (stopping and not self._queue and not self._relayed):
            return SubmitterStep()
        timeout = (min(j.deadline for j in (*self._queue, *self._armed)) - now
                   if self._queue or self._armed else None)
        wake = wake_at(now) if callable(wake_at) else wake_at
        for bound in (arm_in, None if wake is None else wake - now,
                      HELD_RECHECK_S if self._held else None):
            if bound is not None:
                timeout = bound if timeout is None else min(timeout, bound)
        if relay_idle:
            self._relay_waiting = True  # from now on a notification wakes its relay wait
            return SubmitterStep(idle_for=RELAY_IDLE_MAX_S if timeout is None
                                 else min(max(timeout, 0.0), RELAY_IDLE_MAX_S))
        self.clock.wait(self.cv, None if timeout is None else max(timeout, 0))
        return None

    def handed_off(self, count: int) -> None:
        """The submitter failed or submitted ``count`` jobs it popped."""
        with self.cv:
            self._handing_off -= count
            self.cv.notify_all()

    def release_permit(self, job: Job) -> None:
        with self.cv:
            if job.permit_held:
                job.permit_held = False
                self._inflight -= 1
                if self._queue:  # only a queued job waits for a permit (issue 17: the idle
                    self._notify()  # submitter is not woken for nothing)

    def set_capacity(self, capacity: int) -> None:
        with self.cv:
            self.capacity = capacity

    # ---- slots the runtime still holds after a failed Wait ---------------------------------------
    def hold(self, entry: Held) -> None:
        """The runtime keeps ``entry.job``'s buffers and permit (the permit moves to the
        entry)."""
        entry.job.permit_held = False
        with self.cv:
            self._held.append(entry)
            self._notify()  # the submitter's wait now re-checks every HELD_RECHECK_S

    def reaped(self, let_go: list[Held], now: float, report: bool
               ) -> tuple[list[Held], list[Held], bool]:
        """``let_go``: entries whose slot the runtime let go of (asked outside the lock).
        Their permits come back. Returns (freed, newly hung past their grace (when
        ``report``), none held any more)."""
        with self.cv:
            freed = [entry for entry in let_go if entry in self._held]  # not reaped before
            for entry in freed:
                self._held.remove(entry)
            self._inflight -= len(freed)
            if freed:
                self._notify()
            hung = [] if not report else [entry for entry in self._held
                                          if not entry.reported and now >= entry.grace_end]
            for entry in hung:
                entry.reported = True
            return freed, hung, not self._held

    @property
    def refusal(self) -> Status | None:
        """Why queued work is failed now (None: it is not); read under cv by the check."""
        return self._refusal
