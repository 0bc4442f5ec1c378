"""A pre-armed decode stream: one sequence's greedy/sampled decode loop with the next job
admitted and prepared while the current one runs on the device (issue 17).

``DeviceExecutor.decode_stream(seq_id, past_len, deadline, logits_out, ...)`` returns a
``DecodeStream``. Each ``step(token)`` (or ``submit(token)`` then ``wait()``) hands the one
thing that depends on the previous job's result, the token id, to a job that was armed
beforehand: token budget taken, KV txn opened (``KvCoordinator.reserve_next``: chained
behind the job on the device, within the sequence's reservation), buffer slot leased, chart
Created -> Admitted -> Preparing, inputs copied, slices and both CSRs set for the known
sequence length. ``_fire`` writes the token into the slot and the request, sends the chart to
Queued and wakes the submitter, which infers (invariant 2: only the submitter infers, only the
completion thread Waits; the stream adds no thread). Job N+1 is armed by the submitter, after
it submitted job N and while it has nothing else to submit (``arm_next``): N is on the device
then, the caller is waiting and the completion thread is in ``Wait`` with the GIL released, so
the arming contends with nothing on the critical path. Should the step come before the arming
(a fast device), the caller admits the job itself; should the arming find no free slot (the
slot of job N-1 not given back yet), it is tried again when a lease comes back.

Arming never waits: when no slot is free, the budget is spent or the next token would need KV
beyond the reservation, nothing is armed (the attempt is not counted as a failure) and the
next ``submit`` admits its job the ordinary way (blocking, bounded by the deadline), so a
stream never holds more than one extra slot and never starves another request of one. An
arming that a runtime call refused (a fault with its raw CalRT code, ``_runtime_refused``: a
CSR write answering 4) is no miss: the step it was armed for answers that fault, reported to
the fault controller and counted then, as ``enqueue`` of that step meets it
(``_arm_fault_answer``).

Release exactly once: a pre-armed job sits in the executor's ``_armed`` list; whoever removes
it under ``submit_mu`` owns it: ``_fire`` (the token came), ``_disarm`` (the stream closed:
lease back, KV txn rolled back, budget back, chart Failed), or the submitter (the job was
cancelled, its deadline passed, its generation is closing or the executor refuses work: the
same release, and its handle resolves with why). A generation's fence wakes the submitter,
and the drain waits for ``_armed`` to empty, so a pre-armed job of generation N never reaches
generation N+1 and never outlives its generation's teardown.

Greedy ahead (``greedy_ahead=True``): when a job of the stream completes while its caller
waits for it, the completion thread itself fires the armed next job with the job's argmax
(unless it is one of ``stop_tokens``, ``max_steps`` jobs were fired, or ``max_len`` is
reached), after the job's KV commit, permit release and deliver transition and before its
caller is woken.
The caller then waits only for the device: its own wake-up and token choice leave the critical
path (two wake-ups per token remain on it, the completion thread's and the submitter's, where
an ``enqueue`` caller has three). The caller's loop is unchanged: ``step(result.argmax)``
(plus the slice's start with ``want_logits``) adopts the job already fired with that token;
another token is refused (the stream already decoded the argmax). A job is fired ahead only
while its caller has asked for the one before it, so the fired-ahead job is at most one step
ahead. With ``logits_out`` given, a step fired
ahead writes one of two rows of the stream's own (each faulted in when the first step that
writes it is armed, off the critical path), and ``wait()`` copies the row of the step the
caller takes into ``logits_out``: the caller's array is written only by steps the caller took,
after their Wait succeeded, and holds what a plain decode would have written (a result's logits
stay valid until the next step's ``wait()``, as without greedy ahead). A step fired ahead that
the caller never takes (it stopped on a stop string, or closed) is cancelled and waited for by
``close()`` (``close(wait=False)``: not waited for; ``quiet`` says when it ended): at most one
wasted device step per stream, whose KV the next job at that position rewrites.

A step is answered as the same token sent with ``enqueue`` at that moment (docs/embedding.md
§3): the armed job and the step fired ahead are guesses made earlier. A token that comes
after the stream's deadline releases them (the step is refused at admission, as a late
``enqueue``), and a step fired ahead whose generation was replaced since (a model switch, a
recovery) is discarded unless it failed on the device itself (``_outlived``): the step is
admitted in the new generation.

The stream closes itself on any failed step (the pre-armed job behind it is released: its KV
txn was chained to a job that did not commit). ``close()`` (also the context manager's exit)
releases the armed job; ``cancel()`` also cancels the job in flight (thread-safe: a client
disconnect handler may call it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, SupportsInt

import attrs
import numpy as np

from calexec.contracts import fields
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import S32_MAX, TaskKind
from calexec.machines.dispatch import Arm
from calexec.machines.job import InferenceResult, Job, JobHandle, job_of
from calexec.machines.outcomes import is_fault

if TYPE_CHECKING:
    from calexec.machines.executor import DeviceExecutor
    from calexec.machines.kv import KvTxn

_SUBMIT_BEFORE_WAIT = ("decode stream: submit() before the previous step's wait(); one job of "
                       "a sequence at a time")

log = logging.getLogger("calexec.stream")

#: how long ``close()`` waits for the submitter to finish arming the stream's next job (it is
#: a few hundred microseconds of work that never waits; the bound only guards a bug)
_CLOSE_WAIT_S = 2.0
#: how long ``close()`` waits (at most) for a job fired ahead and never taken to end after its
#: cancel, so the sequence is quiescent when it returns: past the stream's deadline too (bounded
#: by the stream's deadline, a close after it waited not at all, and the release that follows
#: answered ``kv.sequence_busy`` where a stream without greedy ahead leaves the sequence free)
_AHEAD_WAIT_S = 10.0


def _is_token(token: object, vocab: int) -> bool:
    return fields.is_token_id(token) and token < vocab


def _runtime_refused(status: Status) -> bool:
    """An arming failed by the runtime (a fault with its raw CalRT code: a CSR write, a slice,
    a map refused), not a miss (no slot, budget or KV; released; the lifecycle not admitting),
    nor a failure the arming's own barrier reported already (an exception: no raw code)."""
    return is_fault(status) and status.raw is not None


def _position(past: object) -> np.ndarray:
    """The int32 ``positions`` of a decode step at ``past``, for the request that checks
    ``past``. A ``past_len`` no s32 holds (``decode_stream(seq, 2**31, ...)``) is clipped:
    §6.3 step 2 refuses it (beyond u32, or beyond ``max_seq`` <= S32_MAX) before positions
    are read, so the stream answers ``request.invalid`` naming ``past_len``. One that is no
    int (None, a str) is left to ``InferenceRequest``'s converter, whose TypeError names
    ``past_len``. (``np.full`` raised OverflowError, or for None a TypeError naming nothing,
    out of ``decode_stream`` and ``submit``.)"""
    if not fields.is_int(past):
        return np.zeros(1, np.int32)
    return np.full(1, min(max(int(past), -S32_MAX - 1), S32_MAX), np.int32)


class DecodeStream:
    """Decode steps of one sequence with the next step pre-armed. Not thread-safe except
    ``cancel``: one caller steps it."""

    def __init__(self, ex: DeviceExecutor, seq_id: int, past_len: int, deadline: float,
                 logits_out: np.ndarray | None = None,
                 want_logits: tuple[int, int] | None = None,
                 max_len: int | None = None, request_id: int = 0,
                 greedy_ahead: bool = False, stop_tokens: Collection[SupportsInt] = (),
                 max_steps: int | None = None, refused: Status | None = None) -> None:
        self.ex = ex
        self.seq_id = seq_id
        self.past_len = past_len  # committed length the next job starts from
        self.deadline = deadline
        self.logits_out = logits_out
        self.want_logits = want_logits
        self.max_len = max_len
        self.request_id = request_id
        self.status: Status | None = None  # why the stream closed (None: open)
        self._cancelled = False  # cancel() was called (any thread): later steps are cancelled
        self._armed: Job | None = None
        #: the fault that failed the arming of the next step (a runtime call refused its
        #: preparation; ``_runtime_refused``), answered by that step (``_arm_fault_answer``)
        self._arm_fault: Status | None = None
        self._current: JobHandle | None = None
        #: the step's job while ``submit`` admits it afresh (it may wait for KV, a slot or
        #: Ready): ``cancel`` (any thread) reaches it there too (``_admitting_created``)
        self._admitting: JobHandle | None = None
        self.prearmed_steps = 0  # steps whose job was armed before the token came
        self.steps = 0
        # greedy ahead (see the module docstring)
        self.greedy_ahead = bool(greedy_ahead)
        self.stop_tokens = frozenset(int(t) for t in stop_tokens)
        self.max_steps = max_steps
        self.ahead_steps = 0  # steps fired by the completion thread with the argmax
        #: (token, handle) of the job the completion thread fired ahead, not yet taken by the
        #: caller; handle None while the firing runs (submit_mu guards it)
        self._ahead: tuple[int, JobHandle | None] | None = None
        #: the step fired ahead that ``close()`` cancelled (never taken), until it ends
        self._discarded: JobHandle | None = None
        # Steps fired ahead write rows of the stream's own, never the caller's array: a step
        # the caller never takes must not overwrite it (issue 24). ``wait()`` copies a taken
        # step's row into ``logits_out``, so the caller's array holds what a plain decode
        # would have written. Two rows: step k+2 (fired when k+1 completes, after the
        # caller took k) reuses step k's. Each is touched when the first step that writes it
        # is armed (by the submitter, while the step before runs): a fresh row's page faults
        # never land in a step's postprocess.
        self._rows: tuple[np.ndarray, np.ndarray] | None = (
            (np.empty_like(logits_out), np.empty_like(logits_out))
            if self.greedy_ahead and logits_out is not None else None)
        self._row0 = past_len
        self._fresh = [self._rows is not None] * 2
        # guarded by the dispatch lock (``ex.dispatch.cv``): the submitter arms the next job
        # after the one just fired (``arm_next``: its KV txn and the next position)
        self._next: tuple[KvTxn | None, int] = (None, past_len)
        if refused is not None:
            # the executor admits no step of it (start() not called, a shutdown begun, the
            # lifecycle final): returned closed, as ``enqueue`` returns its handle resolved
            # then, ``status`` saying why (it was returned open, and only its first submit
            # answered, naming neither the shutdown nor the missing start)
            self.status = refused
            return
        job = self._arm_job(None, past_len, blocking=False, notify=True)
        if isinstance(job, Job):
            self._armed = job
        elif _runtime_refused(job):
            self._arm_fault = job
        elif job.code == "request.invalid" and not self._beyond_max_len(past_len):
            # the first step's request fails the §6.3 checks (a negative seq_id, a past_len
            # beyond max_seq, a NaN deadline): so would every step's, and the caller learns
            # it now, not at its first submit (which answers this status)
            self.status = job

    # ---- the caller's API ------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self.status is not None

    # state reads (tests, the explorer, a debugger): each a snapshot under the dispatch lock
    @property
    def armed(self) -> Job | None:
        """The job armed for the next step (None: none now)."""
        with self.ex.dispatch.cv:
            return self._armed

    @property
    def ahead(self) -> tuple[int, JobHandle | None] | None:
        """(token, handle) of the step the completion thread fired ahead and the caller has
        not taken (handle None while the firing runs); None: none."""
        with self.ex.dispatch.cv:
            return self._ahead

    @property
    def current(self) -> JobHandle | None:
        """The step submitted last and not waited for yet."""
        return self._current

    @property
    def arming(self) -> bool:
        """The submitter is arming this stream's next job right now."""
        with self.ex.dispatch.cv:
            return self.ex.dispatch.arming(self)

    def step(self, token: int) -> InferenceResult | Status:
        """Submit ``token`` as the next decode job and wait for its result (bounded by the
        stream's deadline). A Status closes the stream."""
        handle = self.submit(token)
        if isinstance(handle, Status):
            return handle
        return self.wait()

    def submit(self, token: int) -> JobHandle | Status:
        """Hand ``token`` to the pre-armed job (or admit one now) and queue it; the submitter
        arms the job after it once it has nothing to submit. Returns the job's handle
        (``wait`` resolves it) or, when the stream is closed or the token is invalid, a
        Status (the stream is then closed). Called on the executor's submitter or completion
        thread (a done callback) it raises RuntimeError naming it, before anything changes:
        its admission, and its ``wait``, would wait for the thread it runs on."""
        self.ex.refuse_on_worker_thread("submit", "DecodeSteps")
        refused = self._refused()
        if refused is not None:
            return refused
        ex, vocab = self.ex, self._vocab()
        if vocab == 0:  # no generation (shut down, or between two): the token cannot be
            # checked, and the request is not the caller's fault (503, not 400); answered as
            # ``enqueue`` answers then (it read "device lifecycle is Stopped: no model
            # generation is loaded" where ``enqueue`` names the shutdown)
            return self._close(ex.step_refused(self.seq_id))
        if not _is_token(token, vocab):
            problem = ("outside [0, vocab_size=" f"{vocab})" if fields.is_int(token) else
                       f"not a token id (an int), got {type(token).__name__}")
            return self._close(Status.invalid(6, f"token={token!r}: {problem}"))
        if self._cancelled:  # a caller that gave up: the step is what the plain path
            return self._cancelled_step(int(token))  # answers a cancelled request
        dispatch = ex.dispatch
        with dispatch.cv:
            # fired ahead by the completion thread (greedy_ahead), else the armed job
            # a token that came once the stream's deadline passed: the plain path's request
            # is refused at its admission (``admission.deadline``); the armed job, fired, was
            # refused at submit (``submit.deadline``), the step fired ahead answered its
            # result: both are guesses the plain path never made, released for the admission
            late = ex.clock.monotonic() >= self.deadline
            ahead, job, discarded = self._take_ahead(), None, None
            if ahead is not None and (late or self._outlived(ahead[1])):
                # fired before its deadline passed or its generation was replaced (a model
                # switch, a recovery): the step is admitted now, as on the plain path
                discarded, ahead = ahead[1], None
                self._discarded = discarded  # (``quiet``, ``close()``: until it ends)
            if ahead is None:
                job, self._armed = self._armed, None
                if job is None:  # not picked up yet (or no slot): arm it here, or take the
                    dispatch.unschedule(self)  # one the submitter is arming right now
                    self._wait_submitter(lambda: not dispatch.arming(self), self.deadline)
                    job, self._armed = self._armed, None
            fault = None
            if ahead is None and job is None:  # (a fault of this step's arming, if any)
                fault, self._arm_fault = self._arm_fault, None
        if ahead is not None:
            return self._adopt(ahead, int(token))
        if discarded is not None:
            discarded.cancel()
        if job is None and fault is not None and not late:
            refusal = self._arm_fault_answer(fault)
            if refusal is not None:
                return refusal
        if late and job is not None and ex.release_armed(job, Status.deadline(
                Phase.SUBMIT, "the step's token came after its deadline", **job.ctx())):
            job = None
        # the armed job is a guess: released meanwhile (reclaimed for a request short of a
        # slot or budget, cancelled, expired, fenced), the step is admitted the ordinary way
        handle = None if job is None else self._fire_step(job, int(token))
        if handle is not None:
            self.prearmed_steps += 1
        else:  # nothing armed (no free resource then): admit it now, blocking
            try:
                fresh = self._arm_job(None, self.past_len, blocking=True,
                                      on_created=self._admitting_created)
                if isinstance(fresh, Status):
                    return self._close(fresh)
                handle = self._fire_step(fresh, int(token))
            finally:
                self._admitting = None
            if handle is None:  # released before it was queued: that is the step's answer,
                # once its releaser (a close of the generation, a cancel) resolved it: the
                # release takes the job first and resolves it after (read at once, it was
                # internal.job_unresolved, found by CI under a drain with no grace)
                answer = JobHandle(fresh).wait_until(self.deadline)
                return self._close(answer if isinstance(answer, Status) else Status.internal(
                    "prearm", Phase.PREPARE, "pre-armed job resolved before its token"))
        self._current = handle
        self.steps += 1
        return handle

    def submit_nowait(self, token: int) -> JobHandle | Status | None:
        """``submit`` for a caller that must not block (an event loop), when it can answer at
        once: the stream's Status when it is closed, the step fired ahead with ``token``
        (greedy_ahead) taken, or the pre-armed job fired with ``token``. None when ``submit``
        would have to wait or admit (nothing armed yet, the submitter or the completion thread
        arming or firing right now, a fired-ahead argmax that is not ``token``, an invalid
        token, a cancelled stream, the stream's deadline passed, a pre-armed guess released
        meanwhile, a step fired ahead before its generation was replaced): this call then
        changed nothing ``submit`` reads, and ``submit(token)`` on a thread that may block
        takes the step, exactly as it would have from the start."""
        refused = self._refused()
        if refused is not None:
            return refused
        vocab = self._vocab()
        if (self._cancelled or not _is_token(token, vocab)
                or self.ex.clock.monotonic() >= self.deadline):
            return None
        token = int(token)
        ready = self._take_ready(token)
        if ready is None:
            return None
        if isinstance(ready, tuple):
            return self._adopt(ready, token)
        handle = self._fire_step(ready, token)
        if handle is None:  # a guess released meanwhile: ``submit`` admits the step
            return None
        self.prearmed_steps += 1
        self._current = handle
        self.steps += 1
        return handle

    def _take_ready(self, token: int) -> tuple[int, JobHandle] | Job | None:
        """(``submit_nowait``) Under the dispatch lock, take what the step can go on without
        waiting: the step fired ahead with ``token``, else the pre-armed job; None (nothing
        taken) when neither is there, the firing is still in progress, or the step fired ahead
        has another token."""
        with self.ex.dispatch.cv:
            ahead = self._ahead
            if ahead is not None:
                fired, handle = ahead
                if handle is None or fired != token or self._outlived(handle):
                    return None  # firing now, a mismatch (closes), a generation replaced
                self._ahead = None
                return fired, handle
            job, self._armed = self._armed, None
            return job

    def _refused(self) -> Status | None:
        """What ``submit`` answers before looking at the token: the closed stream's Status, or
        a step submitted before the previous one was waited for."""
        if self.status is not None:
            return self.status
        if self._current is not None:
            return Status.invalid(4, _SUBMIT_BEFORE_WAIT)
        return None

    def _vocab(self) -> int:
        gen = self.ex.gen
        return gen.contracts.vocab_size if gen is not None else 0

    def _cancelled_step(self, token: int) -> JobHandle:
        """The step of a cancelled stream: the request goes the ordinary way, cancelled as it
        is created (its answer: CANCELLED, or whatever the plain path answers first, e.g.
        UNAVAILABLE while a recovery runs); the stream closes when it is waited for."""
        request = InferenceRequest(
            seq_id=self.seq_id, kind=TaskKind.DECODE, tokens=np.asarray([token], np.int32),
            positions=_position(self.past_len), past_len=self.past_len,
            deadline=self.deadline, want_logits=self.want_logits, request_id=self.request_id)

        def cancel(created: JobHandle) -> None:
            created.cancel()

        handle = self.ex.enqueue(request, logits_out=self.logits_out, on_created=cancel)
        self._current = handle
        return handle

    def _fire_step(self, job: Job, token: int) -> JobHandle | None:
        return self._fire(job, token, self.ex.arm_delay_s())

    def _fire(self, job: Job, token: int, arm_delay_s: float) -> JobHandle | None:
        """Fire ``job`` with ``token`` (``DeviceExecutor.fire_armed``); the submitter arms
        the step after it ``arm_delay_s`` later unless that is beyond ``max_len``."""
        past = job.request.past_len
        more = self.max_len is None or past + 2 <= self.max_len
        with self.ex.dispatch.cv:  # read by the submitter when it arms the step after it
            self._next = (job.txn, past + 1)
        return self.ex.fire_armed(job, token, self if more else None, arm_delay_s)

    def wait(self) -> InferenceResult | Status:
        """The result of the step submitted last (bounded by the stream's deadline). Called
        on the executor's submitter or completion thread (a done callback) while that step is
        not resolved, it raises RuntimeError naming it, before anything changes: only that
        thread could resolve it (it waited out the deadline, then ``cancelled_job_bound``,
        with every other job stalled behind it). A resolved step is taken there as anywhere."""
        handle = self._current
        if handle is None:
            return self.status or Status.invalid(4, "decode stream: wait() without submit()")
        ex = self.ex
        if not handle.done:
            ex.refuse_on_worker_thread("wait", "DecodeSteps")
        if not ex.config.threads:  # stepped mode: drive the executor like decode_sync
            while not handle.done and (ex.submit_one() or ex.complete_one()):
                pass
        result = handle.wait_until(self.deadline)
        # (a Status until the handle is done: wait_until returns a result only once it is)
        if isinstance(result, Status) and not handle.done:  # the stream's deadline passed
            handle.cancel()  # with the job still running: its result is nobody's (it must
            # not write logits_out later). As decode_sync does, wait (bounded: by then the
            # executor resolved it whatever the device does) for it to end, so that once this
            # returns the sequence may be released: a caller of step() holds no handle to
            # wait on (release_sequence answered kv.sequence_busy, "a bug in the order")
            if ex.config.threads:
                handle.wait_until(ex.cancelled_job_bound(handle))
            else:
                while not handle.done and (ex.submit_one() or ex.complete_one()):
                    pass
            if not handle.done:  # still on its way: ``quiet`` says so until it ends
                with ex.dispatch.cv:
                    self._discarded = handle
            return self._close(result)
        self._current = None
        if isinstance(result, Status):
            return self._close(result)
        self.past_len = result.kv_len
        out = self.logits_out
        if (out is not None and self._rows is not None
                and not np.may_share_memory(result.logits, out)):
            # a step fired ahead, now taken: its logits reach the caller's array only now
            count = result.logits.shape[0]
            np.copyto(out[:count], result.logits)
            result = attrs.evolve(result, logits=out[:count])
        return result

    def cancel(self) -> bool:
        """Cancel the job in flight and the armed one (from any thread); the stream closes at
        its owner's next call (a later ``submit`` answers CANCELLED, as a server answers
        every job of a request its client gave up). A ``submit`` admitting its step (waiting
        for KV, a buffer slot or Ready) ends CANCELLED at once. True when something was still
        running."""
        self._cancelled = True
        cancelled = False
        ahead = self._ahead
        for handle in (self._current, None if self._armed is None else JobHandle(self._armed),
                       None if ahead is None else ahead[1], self._admitting):
            if handle is not None:
                cancelled |= handle.cancel()
        return cancelled

    def close(self, wait: bool = True) -> Status:
        """Release the armed job (not counted as a failure: the stream ended); the job in
        flight, if any, still completes (wait for it first to keep its result). A step fired
        ahead that the caller never took is cancelled; with ``wait`` (the default) close()
        also waits for it to end (bounded), so the sequence is free once it returns. With
        ``wait=False`` it returns at once: ``quiet`` tells when the discarded step has ended
        (and a ``submit`` admitting its step on another thread, which ends CANCELLED as with
        ``cancel()``, and is waited for the same way)
        (a server answers its client first and releases the sequence in the background).
        Called on the executor's submitter or completion thread (a done callback), it never
        waits, as with ``wait=False``: only that thread could end what it would wait for."""
        return self._close(Status.cancelled(Phase.CANCEL, "decode stream closed"), wait=wait)

    @property
    def quiet(self) -> bool:
        """No job of this stream is left on its way to the device or on it: nothing armed,
        no arming in progress, the step fired ahead (if any) resolved, and no ``submit``
        still admitting its step (closed from another thread). (The step the
        caller submitted last is the caller's to wait for.)"""
        with self.ex.dispatch.cv:
            ahead = self._discarded
            admitting = self._admitting
            return (self._armed is None and not self.ex.dispatch.arming(self)
                    and (ahead is None or ahead.done)
                    and (admitting is None or admitting.done))

    def __enter__(self) -> DecodeStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- arming ----------------------------------------------------------------------------
    def _close(self, status: Status, wait: bool = True) -> Status:
        ex = self.ex
        dispatch = ex.dispatch
        # On the executor's own thread (a done callback closing the stream) nothing below is
        # waited for, as with ``wait=False``: the step fired ahead ends only once that very
        # thread completes it (the completion thread stood still for the whole bound, 10 s,
        # every other job behind it); ``quiet`` tells when it ended.
        waits = ex.config.threads and not ex.on_worker_thread()
        with dispatch.cv:  # the submitter reads status when it finishes arming
            if self.status is None:
                self.status = status
            dispatch.close_stream_locked(self.seq_id, self)
            dispatch.unschedule(self)
            # the submitter may be arming the next job right now: it releases that job itself
            # on seeing the stream closed; wait for it (bounded), so that once close() returns
            # the sequence is free (a reset or the next request may follow at once)
            if not self._wait_submitter(lambda: not dispatch.arming(self),
                                        ex.clock.monotonic() + _CLOSE_WAIT_S):
                log.warning("decode stream of seq %d: the submitter still arms its next job "
                            "after %.1fs; it releases it when done", self.seq_id, _CLOSE_WAIT_S)
            job, self._armed = self._armed, None
            ahead = self._take_ahead()
            admitting = self._admitting
        if admitting is not None and not admitting.done:
            # a ``submit`` admitting its step on its owner's thread (waiting for KV, a slot or
            # Ready), closed from another (a disconnect handler's): it waited on until the
            # stream's deadline, holding the sequence, while close() had returned and
            # ``release_sequence`` answered ``kv.sequence_busy``. Cancelled, as ``cancel()``
            # does, it ends CANCELLED at once; wait (bounded) for that, so that once close()
            # returns the sequence is free
            admitting.cancel()
            if waits and wait:
                admitting.wait_until(ex.clock.monotonic() + _CLOSE_WAIT_S)
        if job is not None and not ex.release_armed(job, Status.cancelled(
                Phase.CANCEL, f"decode stream of seq {self.seq_id} closed: {status.code}")
        ) and waits:
            # the submitter took it first (cancelled, expired, fenced) and releases it now:
            # wait (bounded) for the end of that release, which resolves the job last, so
            # that once close() returns the sequence is free
            JobHandle(job).wait_until(ex.clock.monotonic() + _CLOSE_WAIT_S)
        if ahead is not None:  # fired ahead, never taken: cancel it and let it end (bounded;
            handle = ahead[1]  # stepped mode: failed here while queued, ``let_end``)
            handle.cancel()
            self._discarded = handle
            if wait:
                ex.let_end(handle, ex.clock.monotonic() + _AHEAD_WAIT_S)
        elif wait and self._discarded is not None:
            # an earlier close(wait=False) left it: a later close() waits as promised
            ex.let_end(self._discarded, ex.clock.monotonic() + _AHEAD_WAIT_S)
        return status

    # ---- greedy ahead ----------------------------------------------------------------------
    def _wait_submitter(self, done: Callable[[], bool], end: float) -> bool:
        """The dispatch lock held: wait until ``done()`` (the submitter notifies when it
        finishes an arming, the completion thread when it finishes firing ahead), bounded by
        ``end`` (``Clock.monotonic()``). False when ``end`` came first."""
        ex = self.ex
        while not done():
            remaining = end - ex.clock.monotonic()
            if remaining <= 0:
                return False
            ex.clock.wait(ex.dispatch.cv, remaining)
        return True

    def discard_ahead(self) -> JobHandle | None:
        """(For the executor.) Another request, reset or truncation of the sequence is
        coming (``DeviceExecutor._drop_armed``): the step fired ahead, not taken yet, is
        discarded (the caller's step is admitted again, after that request, as the plain
        path runs it), and so is the fault an arming of the next step met (``_arm_fault``):
        that step too is admitted after the request, whose change of the sequence its plain
        admission meets first (a KV check refuses it before any runtime call). Its handle,
        for the caller to cancel; None when there is none."""
        with self.ex.dispatch.cv:
            self._arm_fault = None
            ahead = self._take_ahead()
            if ahead is None:
                return None
            self._discarded = ahead[1]
            return ahead[1]

    def wait_discarded(self, handle: JobHandle, until: float) -> None:
        """(For the executor, after ``discard_ahead`` and its cancel, on the thread whose
        request of the sequence is coming.) Wait for the discarded step to end, until
        ``until`` (``Clock.monotonic()``) and bounded as ``close()`` waits for it: until it
        ends its KV txn holds the sequence, and that request (or the caller's own next step,
        admitted again) answered ``kv.sequence_busy`` where the plain path, with no step fired
        ahead, admits it. Not on the executor's own threads (only the completion thread
        resolves it); in stepped mode this thread fails it while it is still queued
        (``DeviceExecutor.let_end``; until stop 62 nothing did, and the release or request
        answered ``kv.sequence_busy``)."""
        ex = self.ex
        ex.let_end(handle, min(until, ex.clock.monotonic() + _AHEAD_WAIT_S))

    def _take_ahead(self) -> tuple[int, JobHandle] | None:
        """The job fired ahead (submit_mu held), once its firing finished (bounded by the
        deadline); None when there is none."""
        self._wait_submitter(lambda: self._ahead is None or self._ahead[1] is not None,
                             self.deadline)
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        fired, handle = ahead
        return None if handle is None else (fired, handle)

    def _outlived(self, handle: JobHandle) -> bool:
        """(The dispatch lock held.) The step fired ahead outlived its generation: that
        generation is no longer the serving one, or is being replaced (a model switch, a
        recovery: admission stopped, or the generation fenced), or a shutdown began, and the
        step did not fail on the device (its own fault, which the plain path's step meets
        too). Its answer, the old generation's result or the refusal of a job the switch
        found queued (``lifecycle.unavailable`` "device recovering after
        lifecycle.model_switch" long after the switch ended), is not what the caller's step
        gets on the plain path, where it is sent now: the step is admitted now instead
        (``kv.past_len_beyond_committed``, "prefill it again", once the new generation
        serves; ``lifecycle.unavailable`` while it is not)."""
        job = job_of(handle)
        gen, ex = job.gen, self.ex
        if (gen is not None and gen is ex.gen and not gen.closing and ex.life.admitting
                and not ex.life.stopping):
            return False
        return not (job.submitted_at > 0 and job.done and isinstance(job.result, Status))

    def _adopt(self, ahead: tuple[int, JobHandle], token: int) -> JobHandle | Status:
        """The caller's step takes the job the completion thread fired with ``ahead[0]``."""
        fired, handle = ahead
        if fired != token:
            handle.cancel()
            with self.ex.dispatch.cv:  # close() cancels and waits for it
                self._ahead = ahead
            return self._close(Status.invalid(
                6, f"token={token}: this greedy_ahead decode stream already decoded the "
                   f"argmax {fired} at this position; step() takes result.argmax"))
        self._current = handle
        self.steps += 1
        self.prearmed_steps += 1
        self.ahead_steps += 1
        return handle

    def fire_ahead(self, job: Job, result: InferenceResult, arm_delay_s: float = 0.0
                   ) -> JobHandle | None:
        """On the completion thread, after ``job``'s KV commit, permit release and deliver
        transition and before its caller is woken: fire the armed next job with ``job``'s argmax when the
        caller waits for ``job`` and the stream may go on. Never raises; returns the fired
        job's handle (None: nothing fired)."""
        ex = self.ex
        # the argmax is within the requested logits slice: the token id is offset by its start
        token = int(result.argmax) + (self.want_logits[0] if self.want_logits else 0)
        dispatch = ex.dispatch
        with dispatch.cv:
            current = self._current
            if (self.status is not None or self._ahead is not None or self._armed is None
                    or current is None or job_of(current) is not job
                    or token in self.stop_tokens
                    or (self.max_steps is not None and self.steps >= self.max_steps)):
                return None
            armed, self._armed = self._armed, None
            self._ahead = (token, None)  # a concurrent submit()/close() waits for the firing
        handle = None
        try:
            if self._rows is not None:  # not taken yet: never the caller's array
                armed.logits_out = self._rows[(armed.request.past_len - self._row0) % 2]
            handle = self._fire(armed, token, arm_delay_s)
        except Exception:  # noqa: BLE001 - the caller fires the next step itself instead
            log.exception("firing the next job of seq %d ahead raised", self.seq_id)
        finally:
            with dispatch.cv:
                self._ahead = None if handle is None else (token, handle)
                dispatch.cv.notify_all()  # a submit()/close() waiting for the firing
        if handle is None:  # (released by someone else meanwhile: nothing to do)
            ex.release_armed(armed, Status.internal("fire_ahead", Phase.PREPARE,
                                                    "firing the next job ahead raised",
                                                    seq_id=self.seq_id))
        return handle

    def arm_next(self) -> None:
        """(For the submitter, with nothing to submit: ``DeviceExecutor.submit_one``.) Arm
        the job after the one just fired (``_next``: its KV txn and the next position), while
        that one is on the device. Never raises and never waits. The dispatch says this
        stream is arming until this returns, after a job armed for a stream that closed
        meanwhile was released, so ``close()`` (which waits for it) returns with the
        sequence free."""
        ex, job, drop, later = self.ex, None, None, False
        dispatch = ex.dispatch
        try:
            with dispatch.cv:
                prev_txn, past = self._next
                still_open = self.status is None
            if still_open:
                job = self._arm_job(prev_txn, past, blocking=False)
        except Exception:  # noqa: BLE001 - a failed pre-arm only means nothing is armed
            log.exception("pre-arming the next job of seq %d raised", self.seq_id)
        with dispatch.cv:
            if isinstance(job, Job):
                if self.status is None:
                    self._armed = job
                else:
                    drop = job  # the stream closed meanwhile
            elif isinstance(job, Status) and job.code == "buffer.full" and self.status is None:
                later = True
            elif isinstance(job, Status) and _runtime_refused(job) and self.status is None:
                self._arm_fault = job  # the next step answers it (``_arm_fault_answer``)
        if later:
            dispatch.arm_later(self)  # again when a lease comes back
        if drop is not None:
            ex.release_armed(drop, Status.cancelled(Phase.CANCEL, "decode stream closed"))

    def _admitting_created(self, handle: JobHandle) -> None:
        """(``submit``'s own admission, on the owner's thread, before it may wait.) Keep the
        step's handle for ``cancel``; a cancel that came first cancels it now. (``cancel``
        sets the flag before it reads the handle, and this keeps the handle before it reads
        the flag: one of the two sees the other.)"""
        self._admitting = handle
        if self._cancelled or self.status is not None:  # cancelled, or closed (``_close``)
            handle.cancel()

    def _arm_fault_answer(self, fault: Status) -> Status | None:
        """The step whose pre-armed job failed its preparation with ``fault`` (a runtime call
        refused it, e.g. a CSR write answering 4) is answered that failure, reported and
        counted now (``DeviceExecutor.armed_step_failed``): the plain path's admission of this
        step met it, so the fault controller acts on it (§8) and the caller gets it. It used
        to be dropped as a missed guess and the step admitted again, which a fault that does
        not recur let through: no log line, no ``calexec_device_faults_total``, no rollback,
        and a 200 where the plain path answered 500 ``calrt.csr_failed``. None when the
        generation it met is no longer the current one (a recovery or switch since) or is
        being replaced, or admission is stopped (a recovery decided, a shutdown begun): the
        step is then admitted the ordinary way, as the plain path admits it (which stops at
        the lifecycle, before any runtime call: 503 while a recovery is decided and not
        begun, where this answered the arming's 500)."""
        ex = self.ex
        gen = ex.gen
        if (gen is None or fault.generation != gen.id or gen.closing
                or not ex.life.admitting or ex.life.stopping):
            return None
        ex.armed_step_failed(fault)
        return self._close(fault)

    def _beyond_max_len(self, past: int) -> bool:
        """A step at ``past`` is beyond what the stream arms ahead (``max_len``)."""
        return self.max_len is not None and past + 1 > self.max_len

    def _arm_job(self, prev_txn: KvTxn | None, past: int, blocking: bool,
                 notify: bool = False,
                 on_created: Callable[[JobHandle], None] | None = None) -> Job | Status:
        if not blocking and self._beyond_max_len(past):
            # max_len bounds what the stream arms ahead; the caller's own step (blocking) is
            # a request like any other, answered by the plain path's checks
            return Status.invalid(2, f"decode stream: past_len={past} + 1 > max_len="
                                     f"{self.max_len}")
        request = InferenceRequest(
            seq_id=self.seq_id, kind=TaskKind.DECODE, tokens=np.zeros(1, np.int32),
            positions=_position(past), past_len=past, deadline=self.deadline,
            want_logits=self.want_logits, request_id=self.request_id)
        parity = (past - self._row0) % 2
        rows = self._rows  # (_fresh is only ever True with rows)
        if past != self._row0 and rows is not None and self._fresh[parity]:  # a step that
            rows[parity].fill(0.0)  # may be fired ahead; arming runs off the critical path
            self._fresh[parity] = False
        job = self.ex.admit_armed(request, self.logits_out,
                                  Arm(prev_txn, blocking, notify, on_created))
        if job.done:
            return job.result if isinstance(job.result, Status) else Status.internal(
                "prearm", Phase.PREPARE, "pre-armed job resolved before its token")
        if self.greedy_ahead:
            job.stream = self
        return job
