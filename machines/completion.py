"""The completion side of the executor (§6.5, issue 25): what the ``calexec-completion``
thread does with each submitted job, in submission order.

``push`` (the submitter, after ``infer`` accepted a job) appends to the completion queue
(``completion_mu``, never held across Wait); ``complete_one`` takes the oldest and
``Wait``s for it with no lock held, bounded by the §9.1 execution deadline, asks
``GetStatus``, double-checks rc and status, checks the output (size FI09, finiteness FI10)
and converts the requested logits slice into the caller's array (``postprocess``), commits
the KV txn, undoes the slices, gives the permit and budget back before waking the caller,
fires a greedy-ahead stream's next step, resolves the job and returns its lease. Every failure
on the way goes to ``JobOutcomes`` (machines/outcomes.py): quarantine, KV Unknown, the fault
reported first; a job the runtime still runs after a failed Wait keeps its buffers and permit
(``hold``) until the runtime lets go.

It also keeps the moving average of decode jobs' device time (``decode_exec_us``), which the
submitter's early wake-up and the arming delays read.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from calexec.contracts.codes import CalrtCode, DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.prepare import valid_logits_row
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.machines.chart_names import (
    JOB_CANCEL_REQUESTED,
    JOB_COMPLETING,
    JOB_EV_CANCEL,
    JOB_EV_DELIVER,
    JOB_EV_EXECUTION_TIMEOUT,
    JOB_EV_FAIL,
    JOB_EV_FAULT,
    JOB_EV_WAIT_RETURNED,
    JOB_QUARANTINED,
    JOB_SUBMITTED,
)
from calexec.machines.clock import Clock
from calexec.machines.device_api import LogitsPostprocessor
from calexec.machines.dispatch import Dispatch
from calexec.machines.job import InferenceResult, Job, advance, job_of
from calexec.machines.locks import COMPLETION, LockOrder
from calexec.machines.outcomes import JobOutcomes
from calexec.machines.postprocess import (
    bf16_all_finite,
    bf16_first_nonfinite,
    bf16_to_f32_into,
)

if TYPE_CHECKING:
    from calexec.machines.executor import ExecutorConfig
    from calexec.machines.generation import Generation
    from calexec.machines.pool import BufferSlot


#: what a deferred conversion needs (``Completion.postprocess`` with ``defer``): the output's
#: BF16 array, the slice's base and length, the row the result's ``logits`` view, and the
#: argmax the check found
Deferred = tuple[np.ndarray, int, int, np.ndarray, int]


class Completion:
    """The completion queue and the completion of one job (see the module docstring)."""

    def __init__(self, config: ExecutorConfig, clock: Clock, locks: LockOrder,
                 dispatch: Dispatch, outcomes: JobOutcomes,
                 fused_logits: LogitsPostprocessor | None,
                 current: Callable[[], Generation | None]) -> None:
        self.config = config
        self.clock = clock
        self.locks = locks
        self.dispatch = dispatch
        self.outcomes = outcomes
        #: the runtime's fused output check and conversion (drivers/native), or None (numpy)
        self.fused_logits = fused_logits
        self._current = current  # the executor's current generation
        self.mu = locks.lock(COMPLETION)  # never held across Wait()
        self.cv = clock.condition(self.mu, "completion_cv")
        self._queue: deque[Job] = deque()
        self._stopping = False
        #: the job the completion thread waits for (``health`` reads it)
        self.waiting_on: Job | None = None
        #: threads that called Wait (invariant 2: one)
        self.wait_threads: set[str] = set()
        #: moving average of a decode job's device time (this thread writes, others read a
        #: float): the early wake-ups and the arming delays (issue 17)
        self.decode_exec_us = 0.0
        self._prewoken = 0  # the job the submitter last woke early for (``prewake_at``)
        self._backing_off = 0  # the job whose submit last found the runtime busy
        #: the last device reset the executor itself asked for (``device_reset``): its kind,
        #: and when (Clock.monotonic()) it was asked for
        self._reset: tuple[str, float] | None = None

    # ---- the queue ---------------------------------------------------------------------------
    def push(self, job: Job) -> None:
        """``infer`` accepted ``job``: it is the completion thread's now."""
        with self.cv:
            self._queue.append(job)
            self.cv.notify()

    def __len__(self) -> int:
        """Jobs submitted and not completed yet (no lock: a length)."""
        return len(self._queue)

    def head(self) -> Job | None:
        """The oldest submitted job (no lock: a deque read that may race a pop)."""
        try:
            return self._queue[0]
        except IndexError:
            return None

    def jobs(self) -> list[Job]:
        """Every submitted job not completed yet, oldest first."""
        with self.mu:
            return list(self._queue)

    def prewake_at(self, now: float, prewake_s: float) -> float | None:
        """When the submitter's idle wait should end early (the submitter calls this; no
        lock): the decode job on the device is expected to end ``prewake_s`` after that;
        once per job. None: nothing on the device, its end unknown or too near."""
        head = self.head()  # no completion_mu: a racy read of the oldest job
        if (head is None or head.job_id == self._prewoken or not head.submitted_at
                or head.kind != TaskKind.DECODE or self.decode_exec_us <= 0):
            return None
        early = head.submitted_at + self.decode_exec_us / 1e6 - prewake_s - now
        if early < prewake_s:
            return None
        self._prewoken = head.job_id
        return now + early

    def submit_backing_off(self, job: Job) -> None:
        """The submitter found the runtime busy for ``job`` and backs off before its retry:
        a completion thread yielding until ``job`` is on the device (greedy ahead's
        ``_until_submitted``) stops yielding and delivers the step before it."""
        with self.cv:
            self._backing_off = job.job_id
            self.cv.notify_all()

    def device_reset(self, kind: str) -> None:
        """The lifecycle is about to reset the device (``kind``: ``"reset"``, ...): a job
        submitted before now that the device then answers ABORTED was aborted by this
        executor (``Status.aborted_by_reset``), not an unknown outcome."""
        self._reset = (kind, self.clock.monotonic())

    def _aborted_by_reset(self, job: Job, device_status: int) -> str | None:
        """The kind of the executor's own reset that aborted ``job``, or None: the device
        answered ABORTED for a job accepted before the executor's last reset (a job accepted
        after it was aborted by something else: unknown)."""
        reset = self._reset
        if (device_status != DeviceJobStatus.ABORTED or reset is None
                or not 0 < job.submitted_at <= reset[1]):
            return None
        return reset[0]

    def stop(self, stopping: bool = True) -> None:
        """The threads are to stop (or start again): the idle wait ends."""
        with self.cv:
            self._stopping = stopping
            self.cv.notify_all()

    # ---- one job -----------------------------------------------------------------------------
    def complete_one(self, block: bool = False,
                     holding: Callable[[Job | None], None] = lambda job: None) -> bool:
        """Wait for the oldest submitted job and finish it. False when none is submitted.
        ``holding``: told the job before it is worked on and None after (the thread's
        barrier resolves that job if this raises)."""
        with self.cv:
            while not self._queue:
                if not block or self._stopping:
                    return False
                self.clock.wait(self.cv, None)  # idle: a submit or shutdown ends it
            job = self._queue[0]
        holding(job)
        try:
            self._complete(job)
        finally:
            with self.cv:
                if self._queue and self._queue[0] is job:
                    self._queue.popleft()
            self.waiting_on = None
        holding(None)
        return True

    def execution_deadline(self, job: Job) -> float:
        """The §9.1 execution deadline of a submitted ``job`` (Clock.monotonic())."""
        cfg = self.config
        return (job.submitted_at + cfg.execution_timeout_s
                + cfg.execution_timeout_per_token_s * job.request.token_count)

    def _complete(self, job: Job) -> None:
        lease, txn, gen = job.queued_parts()
        slot = lease.slot
        outbuf = slot.outbuf
        if outbuf is None:  # a leased slot keeps its buffers (BufferPool.close)
            raise RuntimeError(f"{job!r}: its leased {slot!r} has no output buffer")
        outcomes = self.outcomes
        # §5.2: no executor lock across Wait(). recovery_mu is exempt: only a recovery holds
        # it, and in stepped mode that recovery drives this very call (the job path never
        # takes recovery_mu, so holding it cannot block a job).
        held = [n for n in self.locks.held_by_current_thread() if n != "recovery_mu"]
        if self.locks.checking and held:
            self.locks.violations.append(f"Wait() called holding {tuple(held)}")
        self.wait_threads.add(threading.current_thread().name)
        t0 = self.clock.now_us()
        self.waiting_on = job
        # One Wait() bounded by the §9.1 execution deadline; no lock is held here.
        remaining_us = int((self.execution_deadline(job) - self.clock.monotonic()) * 1e6)
        rc = outbuf.wait(max(0, remaining_us))
        slot.runtime_answer = answer = outbuf.get_status()  # the runtime's answer, for guards
        device_status = answer[1]
        job.timings.completed_us = self.clock.now_us()
        job.timings.device_wait_ms = (job.timings.completed_us - t0) / 1000.0
        if job.kind == TaskKind.DECODE and rc == CalrtCode.SUCCESS:
            spent = job.timings.completed_us - job.timings.submitted_us
            self.decode_exec_us += (spent - self.decode_exec_us) * (
                0.25 if self.decode_exec_us else 1.0)
        job.wait_rc, job.device_status = rc, device_status
        if job.cancel_flag and job.run.state == JOB_SUBMITTED:
            job.run.send(JOB_EV_CANCEL)
        if rc != CalrtCode.SUCCESS and device_status in (DeviceJobStatus.PENDING,
                                                         DeviceJobStatus.RUNNING):
            self._runtime_still_holds(job, slot, rc)
            return
        target = job.run.send(JOB_EV_WAIT_RETURNED)
        if target == JOB_QUARANTINED:
            reset = self._aborted_by_reset(job, device_status) if rc == 0 else None
            status = (Status.from_calrt(rc, Phase.WAIT, "Wait", **job.ctx()) if rc != 0 else
                      Status.aborted_by_reset(reset, **job.ctx()) if reset is not None else
                      Status.from_device_status(device_status, **job.ctx()))
            if slot.runtime_let_go():
                outcomes.quarantine_after_submit(job, status, release_permit=True)
            else:
                # Wait() returned but GetStatus says the runtime still runs the job (its
                # answers disagree): as after a failed Wait (§9.1), its buffers and permit
                # stay with the runtime until it lets go or a reset aborts the job
                self._keep_until_let_go(job, slot, status)
            return
        t1 = self.clock.now_us()
        copy_ms = outbuf.copy_ms() if hasattr(outbuf, "copy_ms") else None
        if copy_ms is not None:  # measured by the device (the emulator); the host cannot
            job.timings.h2d_ms, job.timings.d2h_ms = copy_ms
        # greedy ahead fires the next step with this job's argmax: the fused pass then only
        # checks and finds the argmax (half the memory traffic), and the conversion into the
        # row follows after the firing, before the caller is woken (``_convert_deferred``)
        defer = job.stream is not None and self.fused_logits is not None
        result, deferred = self.postprocess(job, defer)
        job.timings.postprocess_ms = (self.clock.now_us() - t1) / 1000.0
        if isinstance(result, Status):
            job.output_status = result
            if target == JOB_COMPLETING:
                job.run.send(JOB_EV_FAULT)
            outcomes.quarantine_after_submit(job, result, release_permit=True)
            return
        # §6.5 order: KV commit -> reset slices -> deliver -> release the lease.
        job.output_status = Status.OK
        if not gen.kvc.settle(txn, "commit refused"):  # the chart's guard decides
            status = Status.internal("kv_commit_refused", Phase.OUTPUT_CHECK, "the KV "
                                     "transaction's guard refused the commit", **job.ctx())
            if target == JOB_COMPLETING:
                job.run.send(JOB_EV_FAULT)
            outcomes.quarantine_after_submit(job, status, release_permit=True, settled=True)
            return
        undo = slot.undo_slices()
        # Wait returned and GetStatus said done: the device is free, so the in-flight permit
        # and the token budget go back before the caller is woken (issue 17, A/B measured:
        # the caller's next job finds its permit free; the lease still goes back after)
        self.dispatch.release_budget(job)
        self.dispatch.release_permit(job)
        # delivered before greedy ahead fires and yields: the result is in the caller's row
        # already (postprocess), so a cancel that comes while this thread yields is too late
        # for this job (it completes, as a cancel after its resolve would) and stops the
        # stream's next one; decided after the yield, it discarded a result whose row was
        # written (found by the differential test's long run)
        if target == JOB_COMPLETING and not advance(job, JOB_EV_DELIVER):
            target = JOB_CANCEL_REQUESTED
        stream, job.stream = job.stream, None
        if stream is not None and target == JOB_COMPLETING:
            ran_us = job.timings.completed_us - job.timings.submitted_us
            tuning = self.config.tuning
            slow = self.config.threads and ran_us >= tuning.ahead_yield_min_us
            fired = stream.fire_ahead(  # greedy ahead (machines/stream.py)
                job, result, min(tuning.ahead_arm_delay_s, ran_us / 4e6) if slow else 0.0)
            if fired is not None and slow:
                self._until_submitted(job_of(fired))
        if deferred is not None:  # the row is written before anyone may read it
            result = self._convert_deferred(job, result, deferred)
        if isinstance(result, Status):  # (the conversion answered otherwise: not a result)
            outcomes.count(result)
            job.resolve(result)
        elif target != JOB_COMPLETING:  # cancelled after submit (FI12): result discarded
            if job.run.state == JOB_CANCEL_REQUESTED:
                job.run.send(JOB_EV_FAIL)
            outcomes.bump("cancelled")
            job.resolve(Status.cancelled(
                Phase.CANCEL, "cancelled after submit: Wait completed, result discarded",
                **job.ctx()))
        else:
            outcomes.bump("succeeded" if job.gen is self._current() else "stale_completions")
            job.resolve(result)
        gen.pool.device_done(lease)
        released = lease.release()
        self.dispatch.lease_returned()  # a pre-arm that missed a slot: tried again
        for problem in (undo, released):
            if not problem.ok:  # FI15: slot quarantined by the pool; the job's result stands
                outcomes.faults.report(problem.with_context(**job.ctx()), job)
                outcomes.check_pool(job)

    def _convert_deferred(self, job: Job, result: InferenceResult,
                          deferred: Deferred) -> InferenceResult | Status:
        """The conversion ``postprocess(job, defer=True)`` left: the checked BF16 slice into
        the result's row, the call the plain path makes, on the same bytes (the lease still
        holds the output), so it answers as the check did. Its time is added to the job's
        postprocess span. A different answer (only memory written behind the executor's back
        could give one) is an internal error of this job, never a result."""
        fused = self.fused_logits
        if fused is None:  # (set at construction: a deferral implies it)
            return Status.internal("postprocess", Phase.OUTPUT_CHECK, "no fused postprocess "
                                   "for a deferred conversion", **job.ctx())
        t0 = self.clock.now_us()
        src, base, count, dst, checked = deferred
        rc = fused(src, base, count, dst)
        job.timings.postprocess_ms += (self.clock.now_us() - t0) / 1000.0
        if rc != 0 or fused.argmax != checked:
            return Status.internal("output_changed", Phase.OUTPUT_CHECK,
                                   f"the logits slice converted after greedy ahead fired "
                                   f"answers rc={rc} argmax={fused.argmax}; its check answered "
                                   f"rc=0 argmax={checked}", **job.ctx())
        return result

    def _until_submitted(self, job: Job) -> None:
        """Greedy ahead: the completion thread just queued ``job`` (the next step of a
        stream) and gets out of the submitter's way, its own GIL-holding work (delivering the
        job before, which also wakes that job's caller) waiting until ``job`` is on the device
        or failed, bounded by ``tuning.ahead_yield_s`` (A/B measured, docs/benchmarks.md:
        without it the submitter's wake-up waited for the GIL behind that work). A submit
        that found the runtime busy and backs off (``submit_backing_off``) ends the yield:
        the submitter then sleeps, and the caller of the step before would wait with it."""
        end = self.clock.monotonic() + self.config.tuning.ahead_yield_s
        with self.cv:
            while not (job.done or job.submitted_at or self._stopping
                       or self._backing_off == job.job_id):
                remaining = end - self.clock.monotonic()
                if remaining <= 0:
                    return
                self.clock.wait(self.cv, remaining)

    def _runtime_still_holds(self, job: Job, slot: BufferSlot, rc: int) -> None:
        """Wait() failed (timeout, FI07) while the runtime still runs the job (§9.1).

        The job fails now (Quarantined: no logits, KV Unknown) but its buffers stay with the
        runtime: the slot is quarantined and its host storage stays mapped, and the in-flight
        permit stays held until the device lets go (``JobOutcomes.reap_held``). If it has not
        after ``timeout_grace_s``, ``device.hung`` is reported: the recovery resets the device
        (or, with no safe reset, the lifecycle ends Failed). At capacity 1, when the kept
        job's permit is the only one held, the completion thread waits that grace itself (no
        other job can be in flight meanwhile); otherwise (Phase B, or jobs submitted before a
        downgrade to capacity 1) it goes on at once and the submitter reaps (every 50 ms), so
        the other job's completion is never held up by one the device keeps (found by the
        explorer in Phase B, and after a downgrade)."""
        if self.clock.monotonic() >= self.execution_deadline(job):
            status = Status.failure("execution.deadline", Category.DEVICE, Phase.WAIT,
                                    "execution deadline passed; buffers kept until the device "
                                    "lets go or a reset", raw=rc, **job.ctx())
        else:
            status = Status.from_calrt(rc, Phase.WAIT, "Wait failed while the job is still on "
                                       "the device; buffers kept", **job.ctx())
        job.run.send(JOB_EV_EXECUTION_TIMEOUT)
        self._keep_until_let_go(job, slot, status)

    def _keep_until_let_go(self, job: Job, slot: BufferSlot, status: Status) -> None:
        """``job`` failed after submit (already Quarantined in its chart) while the runtime
        still runs it: KV Unknown with the sequence on the device, slot quarantined with its
        host storage mapped, and the in-flight permit moved to the dispatch's held entries,
        returned by ``JobOutcomes.reap_held`` once the runtime lets go (or a reset aborts the
        job); ``device.hung`` after ``timeout_grace_s``."""
        outcomes = self.outcomes
        outcomes.quarantine_after_submit(job, status, release_permit=False, on_device=True)
        outcomes.hold(job, slot)
        dispatch = self.dispatch
        if dispatch.capacity == 1 and dispatch.inflight == 1:
            # one job in flight at most, and the kept job's permit is the only one held (it
            # stays held): nothing else can be on the device or reach it meanwhile, so the
            # completion thread may as well wait the grace for the device to let go (a
            # prompt release of the sequence). Otherwise it must not (another job's
            # completion would wait behind it), and the submitter reaps it. The capacity
            # alone is not enough: a downgrade to 1 (this very failure may have caused it)
            # leaves a job submitted before it in flight (found by the explorer: PCT seed
            # 39106); the permits alone neither: at capacity 2 another job may be submitted
            # during the grace
            outbuf = slot.outbuf  # the slot is quarantined, so its buffers are kept
            if outbuf is not None:
                outbuf.wait(int(self.config.timeout_grace_s * 1e6))
        outcomes.reap_held()  # let go: permit back; still held after the grace: device.hung

    def postprocess(self, job: Job, defer: bool = False
                    ) -> tuple[InferenceResult | Status, Deferred | None]:
        """Output size (FI09), finiteness (FI10), then the direct conversion (§10.1) and the
        argmax: fused in one native pass when the runtime offers it (``fused_logits``,
        drivers/native; GIL released), else the numpy path. Same bits, same argmax.
        Returns the result (or the Status of a failed check) and None, or with ``defer``
        (fused only) what the conversion needs: the pass then checks and finds the argmax
        without writing the row, and ``_convert_deferred`` writes the result's ``logits``
        with it, which must happen before the job is resolved."""
        lease, txn, gen = job.queued_parts()
        request, slot, sm = job.request, lease.slot, job.submodel
        outbuf, host_output, scratch = slot.outbuf, slot.host_output, slot.scratch
        if sm is None or outbuf is None or host_output is None or scratch is None:
            return (Status.internal("slot_incomplete", Phase.OUTPUT_CHECK, f"{job!r}: no "
                                    "submodel, or its slot lost its buffers or storage",
                                    **job.ctx()), None)
        vocab = gen.contracts.vocab_size
        row = valid_logits_row(request.token_count, sm.logits_tile_d0)
        first, count = request.logits_range(vocab)
        base = row * vocab + first
        rc, valid_bytes = outbuf.valid_bytes()
        if rc != 0:
            return (Status.from_calrt(rc, Phase.OUTPUT_CHECK, "output valid bytes",
                                      **job.ctx()), None)
        if valid_bytes < sm.logits.byte_size:
            return (Status.internal("output_short", Phase.OUTPUT_CHECK,
                                    f"output {sm.logits.name!r} holds {valid_bytes} bytes, "
                                    f"contract ByteSize is {sm.logits.byte_size}",
                                    **job.ctx()), None)
        # the caller's array is written only by a job whose result it will take: a job
        # cancelled after submit (FI12: result discarded) is checked into a row of its own
        # (its KV commit still needs the output check). A cancel that comes after the claim
        # is too late: the job completes and delivers what the row holds (once, a cancel in
        # between discarded a result whose row was written; found by the explorer)
        dst = job.logits_out
        if dst is None or not job.claim_row():
            dst = np.empty(count, np.float32)
        fused = self.fused_logits
        if fused is not None:
            rc = fused.check(host_output, base, count, dst) if defer else fused(
                host_output, base, count, dst)
            if rc == fused.NONFINITE:  # dst may be partly written: not a result
                return (Status.internal("output_not_finite", Phase.OUTPUT_CHECK,
                                        f"NaN/Inf in logits row {row} [{first}, {first + count}) "
                                        f"at index {first + fused.first_nonfinite}",
                                        **job.ctx()), None)
            if rc != 0:  # §10.1 bounds or a short destination, refused before any access
                return (Status.internal("logits_slice", Phase.OUTPUT_CHECK,
                                        f"logits slice base={base} n={count} refused ({rc}: "
                                        f"{fused.RC_NAMES.get(rc)}) for an output of "
                                        f"{host_output.shape[0]} elements and a "
                                        f"destination of {dst.shape[0]}", **job.ctx()), None)
            argmax = fused.argmax
        else:
            src = host_output[base:base + count]
            if not bf16_all_finite(src, scratch):  # (the message as the fused pass's)
                return (Status.internal("output_not_finite", Phase.OUTPUT_CHECK,
                                        f"NaN/Inf in logits row {row} [{first}, {first + count}) "
                                        f"at index {first + bf16_first_nonfinite(src)}",
                                        **job.ctx()), None)
            bf16_to_f32_into(host_output, base, count, dst)
            argmax = int(np.argmax(dst[:count]))
        deferred = (host_output, base, count, dst, argmax) if defer and fused is not None else None
        return InferenceResult(job_id=job.job_id, seq_id=request.seq_id,
                               generation=job.generation_id, kind=job.kind, logits=dst[:count],
                               argmax=argmax, kv_len=txn.target_len,
                               timings=job.timings), deferred
