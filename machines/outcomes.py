"""How a job ends when it does not deliver a result, and what the executor counts (issue 25).

Every failure path of a job lives here, each releasing what the job holds in reverse order
of taking it, exactly once:

- ``fail_early``: nothing acquired yet (validation, lifecycle, fence, budget): Created ->
  Failed.
- ``fail_before_submit``: slices undone, lease back, KV txn rolled back, budget back (§6.2);
  the fault reported unless it is the caller's (cancel, deadline, invalid, exhausted,
  unavailable). Also the release of an armed job nobody fired (``uncounted``: a guess).
- ``abandon_before_submit``: a preparation that raised (the barrier): each release on its own,
  INTERNAL.
- ``quarantine_after_submit``: §6.5 failure after submit: KV settled Unknown, slot
  quarantined, fault reported before the caller sees it, permit back unless the runtime
  still runs the job (``hold``: the dispatch keeps it until ``reap_held`` sees it let go).
- ``abandon_after_submit``: a thread raised holding a job at an unknown point.
- ``release_armed_of``/``reclaim_armed``: armed jobs are guesses; another request of their
  sequence, or one short of a slot or budget, releases them (never counted).

The object holds no job state of its own: the dispatch (``machines/dispatch.py``) owns
permits, budget and held slots; the generation owns KV and slots; the fault sink decides what
a reported fault does. It owns only the counters (``counters_mu``, a leaf lock) and the Phase B
downgrade window.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.api import DowngradeRecord, JobTrail, TrailStep
from calexec.machines.chart_names import (
    JOB_CANCEL_REQUESTED,
    JOB_CREATED,
    JOB_EV_CANCEL,
    JOB_EV_FAIL,
    KV_RESERVED,
)
from calexec.machines.clock import Clock
from calexec.machines.dispatch import Dispatch, Held
from calexec.machines.faults import FaultSink
from calexec.machines.job import Job, JobHandle
from calexec.machines.locks import COUNTERS, LockOrder

if TYPE_CHECKING:
    from calexec.machines.compiled import TrailEntry
    from calexec.machines.executor import ExecutorConfig
    from calexec.machines.generation import Generation
    from calexec.machines.pool import BufferSlot

log = logging.getLogger("calexec.executor")


def _rolled_back(status: Status) -> None:
    """A KV reservation's rollback before submit: a shrink the KvManager refused
    (``kv.apply_refused``) leaves the sequence its larger reservation until it is released
    (the books agree with the runtime: nothing leaks), said on a WARNING line, not dropped."""
    if not status.ok:
        log.warning("seq %s: a KV rollback before submit kept the larger reservation: %s",
                    "?" if status.seq_id is None else status.seq_id, status)

#: how long a caller waits for the submitter to finish arming the job it wants or releases (a
#: few hundred microseconds of work that never waits; the bound only guards a bug)
ARMING_WAIT_S = 1.0

#: the counters ``DeviceExecutor.snapshot()`` and the metrics read
COUNTER_NAMES = ("submitted", "succeeded", "failed", "quarantined", "cancelled",
                 "stale_completions", "submit_retries",
                 # implicit pre-arms (machines/autoarm.py): guesses taken by the request that
                 # came, and guesses released unused
                 "auto_prearmed", "auto_prearm_released",
                 # jobs the submitter gave to infer from its native relay (native_relay)
                 "relay_submitted")

#: what a job that never reached the device may fail with and not be a fault: it was refused or
#: released (a cancel, a deadline, an invalid request, KV or a slot short, the lifecycle not
#: admitting); anything else (a runtime call failing, §8) is reported to the fault controller
NOT_FAULTS = frozenset({Category.CANCELLED, Category.DEADLINE, Category.INVALID_REQUEST,
                        Category.RESOURCE_EXHAUSTED, Category.UNAVAILABLE})


def is_fault(status: Status) -> bool:
    """``status``, a job's failure before submit, is a fault (reported) rather than a refusal."""
    return status.category is not None and status.category not in NOT_FAULTS


class JobOutcomes:
    """The failure paths of jobs and the executor's counters (see the module docstring)."""

    def __init__(self, config: ExecutorConfig, clock: Clock, locks: LockOrder,
                 dispatch: Dispatch, faults: FaultSink,
                 current: Callable[[], Generation | None]) -> None:
        self.config = config
        self.clock = clock
        self.dispatch = dispatch
        self.faults = faults
        self._current = current  # the executor's current generation
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        self.counters_mu = locks.lock(COUNTERS)
        #: Phase B downgrades (``downgrade``): when and why
        self.downgrades: list[DowngradeRecord] = []
        self._phase_b_faults: deque[float] = deque()
        #: recent jobs' chart paths (``keep_trail``; counters_mu), newest last
        self._trails: OrderedDict[int, tuple[JobTrail, deque[TrailEntry] | None]] = OrderedDict()

    # ---- counters ----------------------------------------------------------------------------
    def bump(self, key: str) -> None:
        with self.counters_mu:  # leaf lock: counters are bumped from several threads
            self.counters[key] += 1

    def count(self, status: Status) -> None:
        self.bump("cancelled" if status.category == Category.CANCELLED else "failed")

    # ---- what happened to a job ----------------------------------------------------------------
    def keep_trail(self, job: Job) -> None:
        """A job resolved (``Job.on_resolved``): keep its path (bounded, newest last)."""
        result = job.result
        record: JobTrail = {
            "job_id": job.job_id, "seq_id": job.request.seq_id, "kind": job.kind.name,
            "generation": job.generation_id, "state": job.run.state,
            "status": "ok" if not isinstance(result, Status) else result.code, "trail": []}
        trails = self._trails
        with self.counters_mu:
            trails[job.job_id] = (record, job.run.trail)
            while len(trails) > self.config.job_trails_kept:
                trails.popitem(last=False)

    def job_trail(self, job_id: int) -> JobTrail | None:
        """What happened to one recent job: its chart path as a list of steps ``{event,
        from, to, refused_by, t}`` (``to`` None and ``refused_by`` the guards when an event
        was refused), its final state and status code; None when not kept (still running,
        or older than ``job_trails_kept`` jobs)."""
        with self.counters_mu:
            kept = self._trails.get(job_id)
            if kept is None:
                return None
            record, trail = kept
            steps = list(trail or ())
        out = record.copy()
        out["trail"] = [TrailStep({"event": e, "from": s, "to": t,
                                   "refused_by": list(g) if g else None, "t": at})
                        for e, s, t, g, at in steps]
        return out

    # ---- before submit -----------------------------------------------------------------------
    def fail_early(self, job: Job, status: Status) -> JobHandle:
        """Nothing acquired yet: Created -> Failed."""
        if job.cancel_flag and job.run.state == JOB_CREATED:
            job.run.send(JOB_EV_CANCEL)
        job.run.send(JOB_EV_FAIL)
        if not job.uncounted:
            self.count(status)
        job.resolve(status)
        return JobHandle(job)

    def fail_before_submit(self, job: Job, status: Status) -> JobHandle:
        """Release in reverse order: slices, lease, KV txn, token budget (§6.2). A job of a
        generation already torn down touches none of its runtime objects."""
        gen = job.gen
        live = gen is not None and not gen.released
        if job.lease is not None:
            if live:
                job.lease.slot.undo_slices()
            job.lease.release()
        if live and gen is not None and job.txn is not None and job.txn.run.state == KV_RESERVED:
            _rolled_back(gen.kvc.rollback(job.txn))
        self.dispatch.release_budget(job)
        if job.cancel_flag and job.run.state not in (JOB_CANCEL_REQUESTED,):
            job.run.send(JOB_EV_CANCEL)
        job.run.send(JOB_EV_FAIL)
        if not job.uncounted:
            self.count(status)
        # a guess nobody asked for is not reported either: the request, if it comes, is
        # admitted the ordinary way and meets the same fault (plain path: reported once).
        # A golden job's is (a recovery's golden run meeting a refused CSR write): its fault
        # on the device was, and the one before submit had no line and no count
        if not job.uncounted and is_fault(status):
            self.faults.report(status, job)  # first: admission stops before the caller sees it
        job.resolve(status)
        self.dispatch.released(job)  # an armed job taken by this thread: its sequence is free
        return JobHandle(job)

    def abandon_before_submit(self, job: Job, exc: BaseException, where: str) -> JobHandle:
        """The barrier's path for a job whose preparation raised: release what it holds (each
        step on its own: one failing does not stop the others), resolve it INTERNAL, report."""
        status = Status.internal("unexpected_exception", Phase.ADMISSION,
                                 f"{where} raised {type(exc).__name__}: {exc}", **job.ctx())
        lease, job.lease = job.lease, None
        gen, txn = job.gen, job.txn

        def undo_slices() -> None:
            if lease is not None:
                lease.slot.undo_slices()

        def quarantine() -> None:
            if lease is not None and gen is not None:
                gen.pool.quarantine(lease, status.code)

        def rollback() -> None:
            if txn is not None and txn.run.state == KV_RESERVED and gen is not None:
                _rolled_back(gen.kvc.rollback(txn))

        for step in (undo_slices, quarantine, rollback):
            try:
                step()
            except Exception:  # noqa: BLE001 - best effort; the fault below rebuilds
                log.exception("releasing job %d after %s raised", job.job_id, where)
        if job.budget_taken:
            self.dispatch.release_budget(job)
        try:
            if job.cancel_flag and job.run.can(JOB_EV_CANCEL):
                job.run.send(JOB_EV_CANCEL)
            job.run.send(JOB_EV_FAIL)
        except Exception:  # noqa: BLE001 - the chart refused: the job is resolved regardless
            log.exception("job %d: chart refused fail after %s", job.job_id, where)
        self.count(status)
        self.faults.report(status, job)
        job.resolve(status)
        self.dispatch.released(job)
        return JobHandle(job)

    # ---- armed jobs: guesses, released for a request -----------------------------------------
    def release_guesses(self, jobs: list[Job], why: str) -> None:
        for job in jobs:  # uncounted: nobody asked for it
            self.bump("auto_prearm_released")
            self.fail_before_submit(job, Status.cancelled(Phase.CANCEL, f"auto pre-arm {why}",
                                                          **job.ctx()))

    def release_armed_of(self, seq_id: int, ahead_until: float = 0.0) -> None:
        """``KvCoordinator.on_busy``: an operation on ``seq_id`` is coming (a reserve, reset
        or truncation); release what was armed for it first (its guess, a decode stream's
        next step, an arming in progress): an armed job is a guess and never makes a
        sequence busy for a request, as the plain path has none. A stream whose next step was
        released admits that step the ordinary way; its step fired ahead and not taken was
        computed on the sequence as it was, so it is discarded (the caller's step runs again,
        after that request). A caller's own step about to be fired is not a guess and stays
        (``Dispatch.arm(for_caller=True)``).

        Then it waits (bounded) for the armed jobs of ``seq_id`` that other threads took and
        are releasing right now (a reclaim, the submitter failing an expired or refused one,
        a closing stream): until each is resolved its KV txn still holds the sequence. A
        caller whose armed job was taken (a stream's step, a request whose guess expired)
        learns it at once, before that release ends; without this wait its reserve would
        answer ``kv.sequence_busy`` on its own sequence, where the plain path admits it.

        ``ahead_until`` (``Clock.monotonic()``; 0: not at all): wait, last and at most until
        then, for the step fired ahead and discarded to leave the device
        (``DecodeStream.wait_discarded``). A caller's request (``DeviceExecutor.enqueue``,
        before it enters the generation's fence, so a recovery never waits for it) and
        ``decode_stream`` ask for it: without it a plain request of a greedy stream's sequence
        answered ``kv.sequence_busy`` while that step ran, and so did the stream's own next
        step, both admitted without greedy ahead. (``on_busy``, inside the fence, does not.)"""
        dispatch = self.dispatch
        if not dispatch.anything_for(seq_id):  # (unlocked hint: the common case, nothing)
            return
        end = self.clock.monotonic() + ARMING_WAIT_S
        guess, streams, stream = dispatch.take_armed_of(seq_id, end)
        ahead = None if stream is None else stream.discard_ahead()
        if ahead is not None:
            ahead.cancel()
        if guess is not None:
            self.release_guesses([guess], f"released: seq {seq_id} used otherwise")
        for job in streams:
            self.fail_before_submit(job, Status.cancelled(
                Phase.CANCEL, f"pre-armed job released: seq {seq_id} used otherwise",
                **job.ctx()))
        if not dispatch.wait_releases(seq_id, end):
            log.warning("seq %d: an armed job of it still being released after %.1fs",
                        seq_id, ARMING_WAIT_S)
        if ahead is not None and stream is not None and ahead_until > 0.0:
            stream.wait_discarded(ahead, ahead_until)  # on the device, cancelled: let it end

    def reclaim_armed(self) -> None:
        """An admission is short of a slot or of token budget: release every pre-armed job
        not fired yet (the implicit pre-arms and the decode streams' next steps). They are
        guesses: the step that would have taken one is admitted the ordinary way instead, so
        a pre-arm changes when admission work runs, never who gets a slot first."""
        guesses, streams = self.dispatch.reclaim(self.clock.monotonic() + ARMING_WAIT_S)
        self.release_guesses(guesses, "released: its resources were needed")
        for job in streams:
            job.uncounted = True
            self.fail_before_submit(job, Status.cancelled(
                Phase.CANCEL, "pre-armed job released: its resources were needed",
                **job.ctx()))

    # ---- after submit ------------------------------------------------------------------------
    def quarantine_after_submit(self, job: Job, status: Status, release_permit: bool,
                                on_device: bool = False, settled: bool = False) -> None:
        """§6.5 failure after submit: the KV txn is settled by its chart (the commit guard
        reads the runtime's answers and the output check: here it refuses, so the sequence
        is Unknown), slot quarantined, report. ``on_device``: the runtime still runs the job;
        its sequence cannot be reset until the runtime lets go (``reap_held``)."""
        lease, txn, gen = job.queued_parts()
        if not settled:
            gen.kvc.settle(txn, status.code, on_device=on_device)
        gen.pool.quarantine(lease, status.code)
        self.dispatch.release_budget(job)
        self.bump("quarantined")
        # a job the executor's own reset aborted (``recovery.job_aborted``, UNAVAILABLE) is
        # a knock-on of the recovery, not a Phase B failure: two jobs on the device at one
        # recovery's reset downgraded Phase B for good
        if self.config.inflight_capacity == 2 and status.category is not Category.UNAVAILABLE:
            self.downgrade(status)
        # first the controller: admission stops before the next job gets the permit and
        # before the caller sees the failure
        self.faults.report(status, job)
        self.check_pool(job)
        if release_permit:
            self.dispatch.release_permit(job)
        elif on_device:
            job.permit_held = False  # the dispatch's held entry owns the permit now
        job.resolve(status)

    def abandon_after_submit(self, job: Job, status: Status) -> None:
        """A thread raised holding ``job`` at an unknown point: assume the runtime may still
        use its buffers (slot quarantined, KV Unknown, permit held until the runtime lets go,
        like a failed Wait). The caller resolves the job once the fault is reported."""
        lease, txn, gen = job.lease, job.txn, job.gen
        submitted = job.timings.submitted_us > 0
        on_device = submitted and job.wait_rc is None

        def mark_unknown() -> None:
            if txn is not None and not txn.run.final and gen is not None:
                gen.kvc.mark_unknown(txn, status.code, on_device=on_device)

        def quarantine() -> None:
            if lease is not None and lease.held and gen is not None:
                gen.pool.quarantine(lease, status.code)

        for step in (mark_unknown, quarantine):
            try:
                step()
            except Exception:  # noqa: BLE001 - best effort; the recovery rebuilds
                log.exception("abandoning job %d", job.job_id)
        self.dispatch.release_budget(job)
        if job.permit_held:
            if submitted and job.wait_rc is None and lease is not None:
                # the runtime may still run it: the permit goes back when it lets go
                job.permit_held = False
                self.hold(job, lease.slot)
            else:
                self.dispatch.release_permit(job)

    def hold(self, job: Job, slot: BufferSlot) -> None:
        """The runtime keeps ``job``'s buffers and permit after a failed Wait: reaped when it
        lets go, reported hung after the grace (``reap_held``)."""
        gen = job.queued_parts()[2]
        self.dispatch.hold(Held(slot, gen.kvc, job.request.seq_id, job,
                                self.clock.monotonic() + self.config.timeout_grace_s))

    def reap_held(self, report: bool = True) -> bool:
        """Return the permits of quarantined slots the runtime has let go of since a failed
        Wait (and tell their KV coordinators: a sequence reset may go on); report
        ``device.hung`` once for a slot still held after its grace (§9.1: the recovery resets
        the device, or with no safe reset the lifecycle ends Failed for the supervisor).
        True when the runtime holds none any more. ``report=False``: a lifecycle guard asks
        (no fault is reported from inside a lifecycle transition)."""
        held = self.dispatch.held()
        if not held:
            return True
        # GetStatus outside submit_mu (§5.2: no runtime call under the queue locks)
        let_go = [entry for entry in held if entry.slot.runtime_let_go()]
        freed, hung, none_left = self.dispatch.reaped(let_go, self.clock.monotonic(), report)
        for entry in freed:  # admission_mu ranks above submit_mu: after releasing it
            entry.kvc.device_let_go(entry.seq_id)
        for entry in hung:
            job = entry.job
            self.faults.report(Status.failure(
                "device.hung", Category.DEVICE, Phase.WAIT,
                f"job {job.job_id} still on the device after the "
                f"{self.config.timeout_grace_s}s grace", **job.ctx()), job)
        return none_left

    def check_pool(self, job: Job) -> None:
        """Quarantined slots come back only through a reset (invariant 8). When a task kind
        has none left, the generation cannot serve that kind: ask for reset + generation+1
        (a transient fault would otherwise leave the executor Ready but unable to serve)."""
        gen = job.gen
        if gen is not None and gen is self._current() and gen.pool.usable(job.kind) == 0:
            self.faults.report(Status.failure(
                "pool.exhausted", Category.DEVICE, Phase.RELEASE,
                f"every {job.kind.name} buffer slot of generation {gen.id} is quarantined; "
                "a reset and generation+1 rebuild the pool", generation=gen.id), job)

    def downgrade(self, status: Status) -> None:
        """Phase B -> capacity 1 after ``downgrade_after_faults`` failures after submit within
        the window: the ping/pong slots stay, only one job is in flight again."""
        now = self.clock.monotonic()
        window = self._phase_b_faults
        window.append(now)
        while window and now - window[0] > self.config.downgrade_window_s:
            window.popleft()
        if self.dispatch.capacity == 2 and len(window) >= self.config.downgrade_after_faults:
            self.dispatch.set_capacity(1)
            self.downgrades.append({"at": now, "reason": status.code,
                                    "faults_in_window": len(window)})
            log.warning("Phase B downgraded to in-flight capacity 1 after %d failures after "
                        "submit within %.0fs (last: %s)", len(window),
                        self.config.downgrade_window_s, status)
