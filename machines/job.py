"""Jobs and their handles (spec §4.2 ``JobContext``, §6.1, §9.1).

A ``Job`` is the executor's ``JobContext``: the request, its lease and KV transaction, its
own ``JobTimings`` (S11: never a shared map), and a run of the declared ``JobChart``. The job
is the chart's guard provider. Exactly one thread owns a job at a time (request thread until
it is queued, then the submitter, then the completion thread); ownership moves with the
queues, so chart events need no per-job lock.

``JobHandle`` is what callers hold (semantics of concurrent.futures/trio, as design.md asks):
``wait_until(deadline)`` only observes and never cancels; ``cancel()`` is idempotent, only
records the request and returns whether it was recorded while the job could still be
affected; the owner thread acts on it at its next checkpoint (before admission, before
submit, after Wait). A cancel never frees device-held resources (§5.1-7).

Completion without a waiting thread (issue 25, docs/embedding.md): ``add_done_callback(fn)``
has concurrent.futures semantics: ``fn(handle)`` is called exactly once, by the thread that
resolves the job (the completion thread for a job that reached the device; the submitter, a
request thread, a recovery or shutdown for one that did not), or at once by the registering
thread when the job is already resolved. It may run while that thread holds executor locks,
so it must only hand the result on (``loop.call_soon_threadsafe``, ``queue.put_nowait``, an
event), never block nor call the executor. An exception it raises is logged (logger
``calexec.job``) and never reaches the executor's thread. ``as_future(loop)`` and
``await wait_async(deadline)`` are built on it with ``loop.call_soon_threadsafe``: no thread
waits for the job. Like ``wait_until`` they only observe: a deadline that passes or an
awaiting task that is cancelled never cancels the job (call ``cancel()`` to give it up); the
registration is removed then, so nothing of the loop stays referenced by the job.

``Job.resolve`` pays one attribute test for this when no callback is registered.
"""

from __future__ import annotations

import asyncio
import logging
import numbers
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypedDict

import attrs
import numpy as np

from calexec.contracts import fields
from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import JobTimings, SubmodelContract, TaskKind
from calexec.machines.chart_names import JOB_EV_CANCEL
from calexec.machines.clock import SYSTEM, Clock
from calexec.machines.compiled import JOB, GuardRejected

if TYPE_CHECKING:
    from calexec.machines.autoarm import AutoArm
    from calexec.machines.generation import Generation
    from calexec.machines.kv import KvTxn
    from calexec.machines.pool import BufferLease
    from calexec.machines.stream import DecodeStream

log = logging.getLogger("calexec.job")

#: Guards every job's done-callback list (``Job._callbacks``). A leaf: held only to swap or
#: append to a list, never while a callback runs or another lock is taken, so it cannot take
#: part in a deadlock; taken by ``Job.resolve`` only when a callback was registered.
_CALLBACKS_MU = threading.Lock()
#: orders a cancel against the completion thread's claim of the caller's row (``claim_row``)
_CANCEL_MU = threading.Lock()
#: ``Job._callbacks`` once the job's callbacks were run: later registrations run at once
_FIRED: tuple[()] = ()
#: a registered done callback: the handle it was registered on and the function
_Callback = tuple["JobHandle", Callable[["JobHandle"], object]]


def now_us() -> int:
    """The system clock's ``Clock.now_us()`` (jobs and the executor read their own clock)."""
    return time.monotonic_ns() // 1000


@attrs.frozen
class InferenceResult:
    """A delivered result: the requested logits slice as FP32 and the greedy token of it."""

    job_id: int
    seq_id: int
    generation: int
    kind: TaskKind
    logits: np.ndarray = attrs.field(eq=False, repr=False)
    argmax: int  # index within the requested slice (== token id when the slice starts at 0)
    kv_len: int  # committed sequence length after this job
    timings: JobTimings = attrs.field(eq=False)


class JobContext(TypedDict):
    """A job's ids, the context a Status about it carries (``Status.failure(..., **ctx)``)."""

    job_id: int
    seq_id: int
    generation: int


#: how every refusal names a shutdown that was called (``enqueue``, a stream's step, an
#: admission wait it ends, a job it cancels, ``recover``, ``switch_model``): one state, one text
SHUTDOWN_CALLED = "the executor is shutting down (shutdown() called)"


class Job:
    """The executor's per-job context and JobChart guard provider."""

    __slots__ = ("job_id", "generation_id", "request", "kind", "submodel", "deadline",
                 "cancel_flag", "lease", "txn", "timings", "run", "wait_rc", "device_status",
                 "output_status", "result", "_done", "_on_cancel", "internal", "logits_out",
                 "_gen", "budget_taken", "permit_held", "clock", "on_resolved", "submitted_at", "uncounted",
                 "stream", "early_wake_s", "auto", "auto_next", "_callbacks", "row_claimed",
                 "relayed", "in_flight_marked", "refuse_wait", "cancel_why", "apart",
                 "__weakref__")

    def __init__(self, job_id: int, generation_id: int, request: InferenceRequest,
                 on_cancel: Callable[[], None], internal: bool = False,
                 clock: Clock = SYSTEM) -> None:
        self.clock = clock
        self.job_id = job_id
        self.generation_id = generation_id
        self.request = request
        self.kind: TaskKind = request.kind
        self.submodel: SubmodelContract | None = None
        self.deadline: float = request.deadline
        self.cancel_flag = False
        #: who cancelled it when not its caller (a shutdown: ``Dispatch.cancel_pending``);
        #: None: its caller (``cancel_message``)
        self.cancel_why: str | None = None
        #: the completion thread writes this job's result into the caller's row (``claim_row``)
        self.row_claimed = False
        #: the buffer slot and KV transaction, from admission until released
        self.lease: BufferLease | None = None
        self.txn: KvTxn | None = None
        self.timings = JobTimings(accepted_us=clock.now_us())
        self.run = JOB.run(self)
        self.wait_rc: int | None = None
        self.device_status: int | None = None
        self.output_status: Status | None = None
        self.result: InferenceResult | Status | None = None
        self._done = clock.event()
        self._on_cancel = on_cancel
        self.internal = internal
        self.logits_out: np.ndarray | None = None
        self._gen: weakref.ref[Generation] | None = None
        self.on_resolved: Callable[[Job], None] | None = None  # the executor's job trail
        self.budget_taken = False  # holds request.token_count of the admission budget
        self.submitted_at = 0.0  # Clock.monotonic() when infer() accepted it
        self.permit_held = False  # holds one in-flight permit (submitter -> release)
        #: taken for the submitter by the thread that queued it, for the native relay to
        #: infer (``Dispatch`` sets it under its lock; machines/executor.py ``_relay_fire``)
        self.relayed = False
        #: its slot is marked in flight (``BufferPool.mark_in_flight``) before infer
        self.in_flight_marked = False
        #: a failure of this job is not counted (a pre-arm attempt that found no free
        #: resource, or a pre-armed job released because its decode stream ended)
        self.uncounted = False
        #: the greedy-ahead decode stream this job belongs to (machines/stream.py): the
        #: completion thread fires the stream's next job with this job's argmax
        self.stream: DecodeStream | None = None
        #: a caller's wait wakes once this long after it began, before the job is expected
        #: to end, then waits on (0: no early wake; ``HotPathTuning.prewake_s``)
        self.early_wake_s = 0.0
        #: the AutoArm entry that armed this job for a caller not yet seen (machines/
        #: autoarm.py; submit_mu), and whether this job's successor may be armed so
        self.auto: AutoArm | None = None
        self.auto_next = False
        #: done callbacks (``JobHandle.add_done_callback``): None (none registered), a list
        #: of (handle, fn), or ``_FIRED`` once run; changed only under ``_CALLBACKS_MU``
        self._callbacks: list[_Callback] | tuple[()] | None = None
        #: the executor's ``refuse_on_worker_thread``: a wait for this job, not resolved yet,
        #: on the executor's own submitter or completion thread (a done callback) raises
        self.refuse_wait: Callable[[str, str], None] | None = None
        #: ``count_apart``'s sink: None while the job's transitions count as a client's
        self.apart: list[int] | None = None

    @property
    def gen(self) -> Generation | None:
        """The Generation the job was admitted into: its completion touches only that
        generation's pool and KV, even after a recovery opened a newer one (FI14). Held
        weakly: a live job's generation is always held by the executor (a recovery resolves
        every job of a generation before dropping it), and a finished job kept by a caller
        must not pin a whole generation's buffers."""
        return None if self._gen is None else self._gen()

    @gen.setter
    def gen(self, generation: Generation | None) -> None:
        self._gen = None if generation is None else weakref.ref(generation)

    def request_cancel(self) -> bool:
        """``JobHandle.cancel``: set the cancel flag once and tell the executor (its
        ``on_cancel``); False when the job was resolved or its row claimed (too late)."""
        if self.done:
            return False
        with _CANCEL_MU:
            if self.row_claimed:
                return False
            if self.cancel_flag:
                return True
            self.cancel_flag = True
        self._on_cancel()
        return True

    def cancel_message(self) -> str:
        """What the job's cancel answers: "cancel requested" (its caller's), or who else
        cancelled it (a shutdown said "cancel requested" too, a cancel nobody asked for)."""
        return self.cancel_why or "cancel requested"

    def claim_row(self) -> bool:
        """The completion thread is about to write this job's result into the caller's row
        (``logits_out``): from then on a cancel is too late, as after the job's resolve (the
        job completes and delivers what its row holds). False: cancelled already (the result
        is then checked into a row of its own and discarded, FI12)."""
        with _CANCEL_MU:
            if self.cancel_flag:
                return False
            self.row_claimed = True
            return True

    # ---- JobChart guards -------------------------------------------------------------------
    def not_cancelled(self) -> bool:
        return not self.cancel_flag

    def runtime_not_using_buffers(self) -> bool:
        lease = self.lease
        return lease is None or not lease.held or lease.slot.runtime_done()

    def runtime_finished_cleanly(self) -> bool:
        return self.wait_rc == 0 and self.device_status == DeviceJobStatus.DONE

    def output_validated(self) -> bool:
        return self.output_status is not None and self.output_status.ok

    # ---- resolution --------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._done.is_set()

    def count_apart(self, sink: list[int]) -> None:
        """Count this job's chart transitions apart from the clients' (``JOB.taken``, the live
        page's rates) until ``count_as_client``: into a list of its own, added to ``sink``
        when the job is resolved still apart (a golden job; an armed job nobody fired for a
        request: a guess, a stream's next step never asked for, released as Failed)."""
        self.run.tally = [0] * len(JOB.transitions)
        self.apart = sink

    def count_as_client(self) -> None:
        """(The job's owner.) The job is fired for a client's request: what it took so far
        (its admission, its preparation) and all it takes from now count as the clients'."""
        own, taken = self.run.tally, JOB.taken
        if own is not taken:
            self.run.tally = taken
            self.apart = None
            for i, n in enumerate(own):
                if n:
                    taken[i] += n

    def resolve(self, result: InferenceResult | Status) -> None:
        if isinstance(result, Status):
            result = result.with_context(job_id=self.job_id, seq_id=self.request.seq_id,
                                         generation=self.generation_id)
        self.result = result
        # The job's chart is final: drop the run's back-reference so a finished job is freed
        # by reference counting (a Job <-> ChartRun cycle would keep its result's logits
        # array alive until a full garbage collection; the acceptance soak saw RSS climb).
        self.run.model = None
        apart = self.apart
        if apart is not None:  # resolved unasked (its chart is final): counted apart
            self.apart = None
            for i, n in enumerate(self.run.tally):
                if n:
                    apart[i] += n
        if self.on_resolved is not None:
            self.on_resolved(self)
        self._done.set()
        if self._callbacks is not None:  # the only cost when nobody registered a callback
            self._run_callbacks()

    def _run_callbacks(self) -> None:
        """After ``_done`` is set: run the registered callbacks once (whoever swaps the list
        for ``_FIRED`` under the lock runs them; ``JobHandle.add_done_callback`` does the same
        when it finds the job resolved after appending)."""
        with _CALLBACKS_MU:
            callbacks, self._callbacks = self._callbacks, _FIRED
        if callbacks:
            _run(callbacks)

    def queued_parts(self) -> tuple[BufferLease, KvTxn, Generation]:
        """The slot lease, KV transaction and generation of a job that was queued: every
        queued, submitted or completing job holds all three. RuntimeError otherwise: a bug of
        the executor's, which its thread barrier turns into a fault like any other."""
        lease, txn, gen = self.lease, self.txn, self.gen
        if lease is None or txn is None or gen is None:
            raise RuntimeError(f"{self!r} has no buffer lease, KV transaction or generation")
        return lease, txn, gen

    def resolved_result(self) -> InferenceResult | Status:
        """``result`` once the job is resolved (``done``: never None then)."""
        result = self.result
        if result is None:
            return Status.internal("job_unresolved", Phase.WAIT, "the job has no result yet",
                                   **self.ctx())
        return result

    def ctx(self) -> JobContext:
        return {"job_id": self.job_id, "seq_id": self.request.seq_id,
                "generation": self.generation_id}

    def __repr__(self) -> str:
        return (f"Job(id={self.job_id}, seq={self.request.seq_id}, kind={self.kind.name}, "
                f"gen={self.generation_id}, state={self.run.state})")


def _run(callbacks: Iterable[_Callback]) -> None:
    """Call each ``fn(handle)``; an exception is logged, never raised into the caller (an
    executor thread, most of the time). That includes a ``BaseException`` that is no
    ``Exception``: ``asyncio.CancelledError`` (a callback reading a cancelled future's
    ``result()``), ``SystemExit`` or ``KeyboardInterrupt`` raised by the callback would
    otherwise pass the executor thread's barrier, which catches ``Exception``, and end
    ``calexec-completion`` silently: every later job would wait for a thread that is gone.
    On the main thread (a callback run at once by ``add_done_callback`` on a job already
    resolved), ``KeyboardInterrupt`` and ``SystemExit`` are the embedder's own Ctrl-C or exit
    and are raised on, never swallowed."""
    for handle, fn in callbacks:
        try:
            fn(handle)
        except BaseException as exc:  # noqa: BLE001 - a callback's bug never reaches the executor
            if isinstance(exc, (KeyboardInterrupt, SystemExit)) and (
                    threading.current_thread() is threading.main_thread()):
                raise  # (a callback run at once on the embedder's main thread: its Ctrl-C)
            log.exception("done callback %r of job %d raised", fn, handle.job_id)


def _settle(future: asyncio.Future[InferenceResult | Status], job: Job) -> None:
    """On the loop's thread: hand the job's result to ``future`` unless it was cancelled."""
    if not future.done():
        future.set_result(job.resolved_result())


class JobHandle:
    """The caller's view of one job."""

    __slots__ = ("_job",)

    def __init__(self, job: Job) -> None:
        self._job = job

    @property
    def job_id(self) -> int:
        return self._job.job_id

    @property
    def state(self) -> str:
        """The job's JobChart state (a snapshot)."""
        return self._job.run.state

    @property
    def timings(self) -> JobTimings:
        return self._job.timings

    @property
    def done(self) -> bool:
        return self._job.done

    @property
    def cancel_requested(self) -> bool:
        return self._job.cancel_flag

    def wait_until(self, deadline: float | None) -> InferenceResult | Status:
        """Block until the job is resolved or ``deadline`` (absolute ``time.monotonic()``;
        None waits without limit). Never cancels: on timeout the job keeps running and a
        ``wait.deadline`` Status is returned. Called on the executor's submitter or completion
        thread (a done callback) for a job not resolved yet, with a deadline still ahead, it
        raises RuntimeError naming the call and the thread (``refuse_on_worker_thread``): that
        thread stood still until the deadline, every other job behind it. A job resolved
        already, or a deadline passed (a look), answers as anywhere."""
        return self._wait("wait_until", _check_deadline("JobHandle.wait_until", deadline))

    def _wait(self, call: str, deadline: float | None,
              timeout_given: float | None = None) -> InferenceResult | Status:
        """The wait of ``call`` (``wait_until``, or ``result`` given ``timeout_given``
        seconds: its ``wait.deadline`` names that call and that timeout, not a deadline the
        caller never gave)."""
        job = self._job
        clock = job.clock
        if (job.refuse_wait is not None and not job._done.is_set()
                and (deadline is None or clock.remaining(deadline) > 0)):
            # a done callback waiting for a job that only the thread it runs on (or the
            # submitter, whose next step may be that very thread's) brings on: the completion
            # thread stood still, every job behind it, until the deadline. A job resolved
            # already, or a look (a deadline passed: nothing is waited for), answers as ever.
            job.refuse_wait(call, "JobHandle")
        early = self._job.early_wake_s
        if early > 0 and not self._job._done.is_set():
            # wake shortly before the job is expected to end, so the hand-off of its result
            # finds this thread warm (issue 17); bounded by the deadline like the wait itself
            if deadline is not None:
                early = min(early, clock.remaining(deadline))
            if clock.wait_event(self._job._done, early):
                return self._job.resolved_result()
        timeout = None if deadline is None else clock.remaining(deadline)
        if timeout is not None and timeout > threading.TIMEOUT_MAX:
            timeout = None  # beyond what a thread can wait (an infinite deadline): no limit
        if clock.wait_event(self._job._done, timeout):
            return self._job.resolved_result()
        what = (f"JobHandle.result(timeout={timeout_given!r}) timed out" if call == "result"
                else "wait_until deadline passed")
        return Status.deadline(Phase.WAIT, f"{what}; the job continues "
                                           f"(state {self._job.run.state})", **self._job.ctx())

    def result(self, timeout: float | None = None) -> InferenceResult | Status:
        """``wait_until`` with a relative timeout in seconds (None or ``math.inf``: no limit;
        0 or less: only looks, and so may a done callback). Timed out: a ``wait.deadline``
        naming ``result`` and the timeout given."""
        seconds = _check_deadline("JobHandle.result", timeout, "timeout")
        return self._wait("result", None if seconds is None else
                          self._job.clock.monotonic() + seconds, timeout)

    def cancel(self) -> bool:
        """Request cancellation. Idempotent. True when the request was recorded before the job
        was resolved (it may still complete: a submitted job is always waited for); False
        when it was resolved, or its result is being written into the caller's row already
        (``Job.claim_row``: it completes, as if the cancel came after its resolve)."""
        return self._job.request_cancel()

    # ---- completion without a waiting thread (issue 25) ------------------------------------
    def add_done_callback(self, fn: Callable[[JobHandle], object]) -> None:
        """Call ``fn(self)`` once when the job is resolved: by the thread that resolves it,
        or now by this thread when it already is. ``fn`` must not block nor call the executor
        (it may run while the resolving thread holds executor locks); an exception it raises
        is logged and ignored. Callbacks run in registration order. ``fn`` that is not
        callable raises TypeError naming it here, not later on the resolving thread."""
        if not callable(fn):
            raise TypeError(f"add_done_callback: fn={fn!r}: expected a callable taking the "
                            "handle")
        job = self._job
        with _CALLBACKS_MU:
            callbacks = job._callbacks
            if not isinstance(callbacks, tuple):  # not run yet (``_FIRED`` is the one tuple)
                if callbacks is None:
                    callbacks = job._callbacks = []
                callbacks.append((self, fn))
                if not job._done.is_set():
                    return  # ``Job.resolve`` sets _done first, then finds the list
                job._callbacks = _FIRED  # resolved meanwhile: whoever swaps runs them
        # resolved: run what this call swapped out (this ``fn`` last), or ``fn`` alone
        _run(callbacks if not isinstance(callbacks, tuple) else ((self, fn),))

    @property
    def pending_callbacks(self) -> int:
        """Done callbacks registered on this job and not run yet: 0 once they ran (the job
        keeps nothing of them then) or were removed (an ``as_future`` whose awaiter gave up).
        What the job still references of its awaiters, e.g. their event loops."""
        callbacks = self._job._callbacks
        return len(callbacks) if callbacks else 0

    def remove_done_callback(self, fn: Callable[[JobHandle], object]) -> int:
        """Unregister every not yet run registration of ``fn`` (compared with ``==``) on this
        job; returns how many were removed (0 once the callbacks ran)."""
        job = self._job
        with _CALLBACKS_MU:
            callbacks = job._callbacks
            if not callbacks:
                return 0
            kept = [entry for entry in callbacks if entry[1] != fn]
            removed = len(callbacks) - len(kept)
            job._callbacks = kept or None
        return removed

    def as_future(self, loop: asyncio.AbstractEventLoop | None = None
                  ) -> asyncio.Future[InferenceResult | Status]:
        """An ``asyncio.Future`` on ``loop`` (default: the running loop) that gets the job's
        result (an ``InferenceResult`` or a ``Status``; never an exception) when it is
        resolved. No thread waits: the resolving thread schedules the result on the loop with
        ``loop.call_soon_threadsafe``. Cancelling the future stops observing, never the job
        (``cancel()`` does that); the registration is removed then."""
        loop = asyncio.get_running_loop() if loop is None else loop
        future = loop.create_future()
        job = self._job
        if job._done.is_set():
            future.set_result(job.resolved_result())
            return future

        def resolved(_handle: JobHandle) -> None:  # the resolving thread
            try:
                loop.call_soon_threadsafe(_settle, future, job)
            except RuntimeError:
                if not loop.is_closed():
                    raise
                # the loop is closed: nobody awaits the result any more

        def unregister(done: asyncio.Future[InferenceResult | Status]) -> None:  # the loop's thread
            if done.cancelled():
                self.remove_done_callback(resolved)

        future.add_done_callback(unregister)
        self.add_done_callback(resolved)
        return future

    async def wait_async(self, deadline: float | None) -> InferenceResult | Status:
        """``wait_until`` for asyncio: the job's result, or once ``deadline`` (absolute, on the
        job's clock: ``time.monotonic()``; None waits without limit) has passed a
        ``wait.deadline`` Status. Parks no thread (``as_future``). Never cancels: on the
        deadline, or when the awaiting task is cancelled, the job keeps running and the
        registration is removed; a caller that gives the job up calls ``cancel()``."""
        deadline = _check_deadline("JobHandle.wait_async", deadline)
        job = self._job
        if job._done.is_set():
            return job.resolved_result()
        future = self.as_future()
        timeout = None if deadline is None else job.clock.remaining(deadline)
        # ``asyncio.wait``, not ``asyncio.wait_for``: Python 3.11's wait_for swallows a
        # cancellation of the awaiting task that comes once the result was scheduled on the
        # loop (it returns the result; the task runs on as if never cancelled: a handler
        # whose client left generated on, an ``asyncio.timeout`` did not fire). ``wait``
        # raises the CancelledError and leaves the future to us.
        try:
            await asyncio.wait((future,), timeout=timeout)
        finally:
            if not future.done():
                future.cancel()  # deadline or cancelled: unregister (``as_future``)
        if not future.cancelled():
            return future.result()
        if job._done.is_set():  # resolved as the deadline fell
            return job.resolved_result()
        return Status.deadline(Phase.WAIT, "wait_async deadline passed; the job continues "
                                           f"(state {job.run.state})", **job.ctx())

    def __repr__(self) -> str:
        return f"JobHandle({self._job!r})"


def _check_deadline(call: str, value: object, name: str = "deadline") -> float | None:
    """A wait's ``deadline`` (or ``timeout``) is None or a number that is not NaN: a NaN
    compares false with every time, so the wait would end at once reporting a deadline that
    never was; a str would fail deep in the clock. Both are the caller's bug: ValueError or
    TypeError naming the call, the argument and its value. ``math.inf`` waits without limit.
    (A float that is no NaN, what every wait of the executor's own passes, returns at the
    first test: this runs on every caller's wait.) Returns the value as a float (None kept):
    an int beyond any float (``10**400``) is an infinity of its sign, a wait without limit or
    a look, where the clock's arithmetic raised ``OverflowError`` naming nothing."""
    if value is None or (type(value) is float and value == value):
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{call}: {name}={value!r}: expected seconds (a float) or None, got "
                        f"{type(value).__name__}")
    if value != value:
        raise ValueError(f"{call}: {name}=nan: expected a time.monotonic() value, math.inf "
                         "or None")
    return fields.to_float(value)


def job_of(handle: JobHandle) -> Job:
    """The job behind ``handle``, for the executor's own modules (the executor, its decode
    streams and guesses) and its test tools; an embedder holds the handle only."""
    return handle._job


def advance(job: Job, event: str) -> bool:
    """Send a forward event guarded by ``not_cancelled``; False when the job was cancelled
    (it is then in CancelRequested)."""
    try:
        job.run.send(event)
        return True
    except GuardRejected:
        job.run.send(JOB_EV_CANCEL)
        return False
