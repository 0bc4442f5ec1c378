"""DeviceExecutor, Phase A: one job in flight (spec §1, §4.2, §5, §6, §7, §9.1, §10.1).

Path of one job (docs/architecture.md tells the same story):

1. ``enqueue`` (request thread, §6.2): lifecycle Ready? -> §6.3 checks 1-6 (pure) -> exact
   submodel -> deadline/cancel -> admission: KV reserve (condition-variable wait) and token
   budget -> buffer lease -> copy inputs, SliceTensor, SetCsrByName (steps 7-8) -> submit
   queue. Any failure releases what was taken, in reverse order, and resolves the handle.
2. ``submit_one`` (submitter thread, §6.4): waits for an in-flight permit (capacity 1 in Phase
   A), re-checks cancel and the queue deadline, calls ``infer``. Failure: KV rollback, lease
   back, job Failed, no Wait (FI05). Success: KV txn Submitted, slot InFlight, completion queue.
3. ``complete_one`` (completion thread, §6.5): ``Wait`` with no lock held, ``GetStatus``, the
   rc/status double check, output size and finiteness, direct BF16->FP32 of the requested
   slice into the destination, KV commit, UndoSlice, resolve, lease back, permit back.
   Failure after submit: no commit, sequence Unknown, slot quarantined, fault reported.

Only the submitter calls ``infer`` and only the completion thread calls ``Wait`` (invariant 2);
with ``ExecutorConfig(threads=False)`` both are called by whoever drives ``submit_one`` and
``complete_one`` (stepped mode for deterministic tests). The runtime objects are duck-typed:
``calexec.drivers.runtime`` provides them; this module imports no cffi.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Protocol

import attrs
import numpy as np

from calexec.contracts.codes import CalrtCode, DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.prepare import (InferenceRequest, check_request, plan_slices,
                                       valid_logits_row)
from calexec.contracts.status import Phase, Status, llama_decode_code
from calexec.contracts.types import ModelGeneration, TaskKind
from calexec.machines.compiled import LIFECYCLE, GuardRejected
from calexec.machines.job import InferenceResult, Job, JobHandle, now_us
from calexec.machines.kv import KvCoordinator
from calexec.machines.locks import LIFECYCLE as LIFECYCLE_RANK
from calexec.machines.locks import SUBMIT, LockOrder
from calexec.machines.pool import BufferPool
from calexec.machines.postprocess import bf16_all_finite, bf16_to_f32_into

log = logging.getLogger("calexec.executor")


class FaultSink(Protocol):
    """Where the executor reports every failure after submit and every runtime failure.

    The recovery issue's fault controller implements it (drain, reset, generation+1)."""

    def report(self, status: Status, job: Job | None) -> None: ...


class RecordingFaultSink:
    """Default sink: keeps the reports (bounded) and counts them by category."""

    def __init__(self, keep: int = 1000) -> None:
        self.reports: deque[Status] = deque(maxlen=keep)
        self.by_category: dict[Category, int] = {}
        self._mu = threading.Lock()

    def report(self, status: Status, job: Job | None) -> None:
        with self._mu:
            self.reports.append(status)
            self.by_category[status.category] = self.by_category.get(status.category, 0) + 1


@attrs.define
class ExecutorConfig:
    """Executor settings. Everything about the model (shapes, max_seq, tile D0) comes from the
    manifest; these are operational choices only."""

    calbin_path: str
    device_config: str = ""
    #: Phase A: 1. Phase B (ping/pong) is a separate, validated mode.
    inflight_capacity: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    #: buffer slots per task kind: one in flight + one being prepared keeps the device busy.
    slots_per_kind: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    #: admission token budget: jobs admitted but not yet completed, in tokens.
    max_pending_tokens: int = attrs.field(default=1 << 20, validator=attrs.validators.ge(1))
    #: §9.1 execution deadline: base + per token, measured from infer() success.
    execution_timeout_s: float = 30.0
    execution_timeout_per_token_s: float = 0.001
    #: §9.1: after a failed Wait with the job still on the device, how long to wait for the
    #: device to let go of the buffers before admission is halted.
    timeout_grace_s: float = 2.0
    #: False: stepped mode (no threads; the caller drives submit_one/complete_one).
    threads: bool = True
    #: record lock acquisition order (tests); strict raises on a violation.
    check_lock_order: bool = False
    strict_lock_order: bool = False
    #: warm-up golden run at start (§9.2 Warming); tokens recorded on the first start.
    golden_tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)
    golden_decode_steps: int = 2
    golden_seq_id: int = 0
    #: expected golden output (greedy tokens); None: record the first warm-up's output.
    golden_expected: tuple[int, ...] | None = None


class DeviceExecutor:
    """The control core: owns the device, calbin, KvManager and buffer pool (invariant 1)."""

    def __init__(self, runtime: Any, manifest: Any, config: ExecutorConfig,
                 fault_sink: FaultSink | None = None) -> None:
        self.runtime = runtime
        self.manifest = manifest
        self.config = config
        self.faults = fault_sink or RecordingFaultSink()
        self.locks = LockOrder(checking=config.check_lock_order, strict=config.strict_lock_order)
        self.lifecycle_mu = self.locks.lock(LIFECYCLE_RANK)
        self.submit_mu = self.locks.lock(SUBMIT)
        self._submit_cv = threading.Condition(self.submit_mu)
        self._submit_q: deque[Job] = deque()
        self._inflight = 0  # guarded by submit_mu
        # quarantined slots whose job failed Wait while still on the device (submit_mu)
        self._held_by_runtime: list = []
        self._completion_mu = threading.Lock()  # completion_mu: never held across Wait()
        self._completion_cv = threading.Condition(self._completion_mu)
        self._completion_q: deque[Job] = deque()
        self._pending_tokens = 0  # guarded by submit_mu
        self._job_ids = itertools.count(1)
        self._gen_ids = itertools.count(1)
        self.lifecycle = LIFECYCLE.run(self)
        self.generation: ModelGeneration | None = None
        self.device = self.calbin = self.kv = None
        self.pool: BufferPool | None = None
        self.kvc: KvCoordinator | None = None
        self._models: dict[TaskKind, Any] = {}
        self._threads: list[threading.Thread] = []
        self._stopping = False
        self._halted: Status | None = None  # set when the device is unusable (guarded by submit_mu)
        self._golden_ok = False
        self.golden_output: tuple[int, ...] | None = config.golden_expected
        self.start_status: Status | None = None
        # Observability (§10.3): counters read by metrics; thread identity of runtime calls
        # (invariant 2) recorded when lock-order checking is on.
        self.counters = {"submitted": 0, "succeeded": 0, "failed": 0, "quarantined": 0,
                         "cancelled": 0}
        self.infer_threads: set[str] = set()
        self.wait_threads: set[str] = set()

    # ---- lifecycle guards (LifecycleChart) ------------------------------------------------
    def generation_advanced(self) -> bool:
        return self.generation is not None and self.pool is not None and self.kvc is not None

    def golden_passed(self) -> bool:
        return self._golden_ok

    def all_submitted_drained(self) -> bool:
        self._reap_held()
        with self.submit_mu:
            return self._inflight == 0 and not self._completion_q

    def reset_confirmed(self) -> bool:
        return False  # reset-based recovery is the recovery controller's (issue 5)

    @property
    def state(self) -> str:
        return self.lifecycle.state

    # ---- start: Configuring -> Warming -> Ready ----------------------------------------------
    def start(self) -> Status:
        """Open the device and generation 1, warm up with the golden run, go Ready.

        FI01: the manifest is resolved against ``GetAllModels`` before ``configure``; a
        mismatch refuses the generation and nothing is configured."""
        status = self._open_generation()
        if status.ok:
            self.lifecycle.send("configured")
            if self.config.threads:
                self._start_threads()
            status = self._warm_up()
        if not status.ok:
            self.start_status = status
            self.faults.report(status, None)
            self._teardown_after_failed_start()
            with self.lifecycle_mu:
                self.lifecycle.send("fail")
            return status
        with self.lifecycle_mu:
            self.lifecycle.send("warmed")
        self.start_status = Status.OK
        return Status.OK

    def _open_generation(self) -> Status:
        cfg = self.config
        gen_id = next(self._gen_ids)
        rc, self.device = self.runtime.open_device(cfg.device_config)
        if rc != 0:
            return Status.from_calrt(rc, Phase.CONFIGURE, "device open", generation=gen_id)
        rc, self.calbin = self.device.load_calbin(cfg.calbin_path)
        if rc != 0:
            return Status.from_calrt(rc, Phase.CONFIGURE, f"calbin load {cfg.calbin_path!r}",
                                     generation=gen_id)
        rc, models = self.calbin.models()
        if rc != 0:
            return Status.from_calrt(rc, Phase.LOOKUP, "GetAllModels", generation=gen_id)
        generation = self.manifest.resolve([m.info for m in models], generation_id=gen_id,
                                           calbin_sha256=self.calbin.sha256)
        if isinstance(generation, Status):
            return generation
        by_name = {m.info.name: m for m in models}
        self._models = {kind: by_name[sub.exact_name] for kind, sub in generation.submodels.items()}
        rc = self.device.configure(self.calbin)
        if rc != 0:
            return Status.from_calrt(rc, Phase.CONFIGURE, "configure", generation=gen_id)
        rc, self.kv = self.device.create_kv(self.calbin)
        if rc != 0:
            return Status.from_calrt(rc, Phase.CONFIGURE, "KvManager create", generation=gen_id)
        pool = BufferPool(generation, self._models,
                          {kind: cfg.slots_per_kind for kind in generation.submodels}, self.locks)
        status = pool.open()
        if not status.ok:
            return status
        self.pool = pool
        self.kvc = KvCoordinator(self.kv, gen_id, self.locks)
        self.generation = generation
        return Status.OK

    def _warm_up(self) -> Status:
        """§9.2 Warming: a fixed prefill + decode through the real path; compare the greedy
        tokens with the recorded golden (recorded on the first start when none is given)."""
        cfg = self.config
        tokens = self._run_golden()
        if isinstance(tokens, Status):
            return tokens
        if self.golden_output is None:
            self.golden_output = tokens
        if tokens != self.golden_output:
            return Status.failure("golden.mismatch", Category.UNKNOWN, Phase.GOLDEN,
                                  f"golden tokens {list(tokens)} != recorded "
                                  f"{list(self.golden_output)}",
                                  generation=self.generation.generation_id)
        status = self.kvc.reset_sequence(cfg.golden_seq_id)
        self._golden_ok = status.ok
        return status

    def _run_golden(self) -> "tuple[int, ...] | Status":
        cfg = self.config
        seq = cfg.golden_seq_id
        status = self.kvc.reset_sequence(seq)
        if not status.ok:
            return status
        prompt = np.asarray(cfg.golden_tokens, dtype=np.int32)
        out: list[int] = []
        request = InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=prompt,
                                   positions=np.arange(len(prompt), dtype=np.int32), past_len=0,
                                   deadline=time.monotonic() + 60.0)
        for step in range(cfg.golden_decode_steps + 1):
            result = self._run_internal(request)
            if isinstance(result, Status):
                return result
            out.append(result.argmax)
            past = result.kv_len
            request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                       tokens=np.asarray([result.argmax], dtype=np.int32),
                                       positions=np.asarray([past], dtype=np.int32),
                                       past_len=past, deadline=time.monotonic() + 60.0)
        return tuple(out)

    def _run_internal(self, request: InferenceRequest) -> "InferenceResult | Status":
        handle = self._enqueue(request, internal=True)
        if not self.config.threads:
            while not handle.done:
                if not (self.submit_one() or self.complete_one()):
                    break
        return handle.wait_until(request.deadline)

    def _teardown_after_failed_start(self) -> None:
        self._stop_threads()
        if self.pool is not None:
            self.pool.close()
        for name, obj, fn in (("kv", self.kv, "destroy"), ("calbin", self.calbin, "unload"),
                              ("device", self.device, "close")):
            if obj is not None:
                getattr(obj, fn)()

    # ---- enqueue (§6.2) -------------------------------------------------------------------------
    def enqueue(self, request: InferenceRequest, logits_out: np.ndarray | None = None,
                on_created: Callable[[JobHandle], None] | None = None) -> JobHandle:
        """Validate, admit, lease, prepare and queue one job. Never raises for a bad request or
        a runtime error: the returned handle is then already resolved with the Status.

        Admission may block the calling thread (KV or buffer wait, bounded by the request's
        deadline). ``on_created`` receives the handle before admission starts, so another
        thread (e.g. a client-disconnect handler) can cancel a job that is still waiting.
        ``logits_out``: a contiguous float32 array receiving the requested logits slice
        (zero allocations per token); None allocates one per job."""
        return self._enqueue(request, internal=False, logits_out=logits_out,
                             on_created=on_created)

    def _enqueue(self, request: InferenceRequest, internal: bool,
                 logits_out: np.ndarray | None = None,
                 on_created: Callable[[JobHandle], None] | None = None) -> JobHandle:
        job = Job(next(self._job_ids), self.generation.generation_id if self.generation else 0,
                  request, self._wake_waiters, internal=internal)
        job.logits_out = logits_out
        handle = JobHandle(job)
        if on_created is not None:
            on_created(handle)
        with self.lifecycle_mu:
            state = self.lifecycle.state
        if not (state == "Ready" or (internal and state == "Warming")) or self._stopping:
            return self._fail_early(job, Status.unavailable(
                Phase.ADMISSION, f"device lifecycle is {state}; not admitting", **job.ctx()))
        generation = self.generation
        status = check_request(request, generation)
        if not status.ok:
            return self._fail_early(job, status)
        job.submodel = generation.submodels[request.kind]
        stop = self._stop_reason(job)
        if stop() is not None:
            return self._fail_early(job, stop())
        # Admission: token budget, then KV (both released on every failure below).
        tokens = request.token_count
        with self.submit_mu:
            if (self._pending_tokens + tokens > self.config.max_pending_tokens
                    and not job.internal):
                return self._fail_early(job, Status.exhausted(
                    "queue", Phase.ADMISSION, f"token budget: {self._pending_tokens} pending + "
                    f"{tokens} > max_pending_tokens={self.config.max_pending_tokens}",
                    **job.ctx()))
            self._pending_tokens += tokens
        txn = self.kvc.reserve(request.seq_id, request.past_len, tokens, job.deadline, stop)
        if isinstance(txn, Status):
            self._release_budget(job)
            return self._fail_early(job, txn.with_context(job_id=job.job_id))
        job.txn = txn
        if not self._advance(job, "admit"):
            return self._fail_before_submit(job, Status.cancelled(Phase.ADMISSION, **job.ctx()))
        job.timings.admitted_us = now_us()
        lease = self.pool.acquire(request.kind, job.deadline, owner=job.job_id, stop=stop)
        if isinstance(lease, Status):
            return self._fail_before_submit(job, lease.with_context(**job.ctx()))
        job.lease = lease
        if not self._advance(job, "begin_preparation"):
            return self._fail_before_submit(job, Status.cancelled(Phase.PREPARE, **job.ctx()))
        status = self._prepare(job)
        if not status.ok:
            return self._fail_before_submit(job, status.with_context(**job.ctx()))
        if not self._advance(job, "enqueue"):
            return self._fail_before_submit(job, Status.cancelled(Phase.PREPARE, **job.ctx()))
        job.timings.queued_us = now_us()
        with self._submit_cv:
            self._submit_q.append(job)
            self._submit_cv.notify_all()
        return handle

    def _prepare(self, job: Job) -> Status:
        """Copy inputs into the leased host storage, slice, set CSRs (§6.3 steps 7-8)."""
        request, slot, sm = job.request, job.lease.slot, job.submodel
        n = request.token_count
        if request.kind == TaskKind.PREFILL_EMBEDS:
            flat = request.embeddings.reshape(-1)
            slot.host_input[: flat.shape[0]] = flat
        else:
            slot.host_input[:n] = request.tokens
        slot.host_position[:n] = request.positions
        for planned in plan_slices(request, sm):
            status = slot.slice_input(planned)
            if not status.ok:
                return status
        for name, value in ((sm.csr_cur_seq, n), (sm.csr_total_seq, request.past_len + n)):
            status = Status.from_csr(slot.inbuf.set_csr(name, value), name, value)
            if not status.ok:
                return status
        return Status.OK

    def _stop_reason(self, job: Job) -> Callable[[], Status | None]:
        def stop() -> Status | None:
            if job.cancel_flag:
                return Status.cancelled(Phase.ADMISSION, **job.ctx())
            if self._stopping and not job.internal:
                return Status.unavailable(Phase.SHUTDOWN, "executor is shutting down",
                                          **job.ctx())
            if time.monotonic() >= job.deadline:
                return Status.deadline(Phase.ADMISSION, "admission deadline passed", **job.ctx())
            return None
        return stop

    def _wake_waiters(self) -> None:
        """A cancel was recorded: end admission/lease waits so the owner sees it."""
        if self.kvc is not None:
            self.kvc.wake()
        if self.pool is not None:
            self.pool.wake()
        with self._submit_cv:
            self._submit_cv.notify_all()

    def _advance(self, job: Job, event: str) -> bool:
        """Send a forward event guarded by ``not_cancelled``; False when the job was cancelled
        (it is then in CancelRequested)."""
        try:
            job.run.send(event)
            return True
        except GuardRejected:
            job.run.send("cancel")
            return False

    # ---- failure paths ------------------------------------------------------------------------
    def _fail_early(self, job: Job, status: Status) -> JobHandle:
        """Nothing acquired yet: Created -> Failed."""
        if job.cancel_flag and job.run.state == "Created":
            job.run.send("cancel")
        job.run.send("fail")
        self._count(status)
        job.resolve(status)
        return JobHandle(job)

    def _fail_before_submit(self, job: Job, status: Status) -> JobHandle:
        """Release in reverse order: slices, lease, KV txn, token budget (§6.2)."""
        if job.lease is not None:
            job.lease.slot.undo_slices()
            job.lease.release()
        if job.txn is not None and job.txn.run.state == "Reserved":
            self.kvc.rollback(job.txn)
        self._release_budget(job)
        if job.cancel_flag and job.run.state not in ("CancelRequested",):
            job.run.send("cancel")
        job.run.send("fail")
        self._count(status)
        job.resolve(status)
        if not job.internal and status.category not in (Category.CANCELLED, Category.DEADLINE,
                                                        Category.INVALID_REQUEST,
                                                        Category.RESOURCE_EXHAUSTED):
            self.faults.report(status, job)
        return JobHandle(job)

    def _release_budget(self, job: Job) -> None:
        with self.submit_mu:
            self._pending_tokens -= job.request.token_count

    def _count(self, status: Status) -> None:
        key = "cancelled" if status.category == Category.CANCELLED else "failed"
        self.counters[key] += 1

    # ---- submitter (§6.4) ----------------------------------------------------------------------
    def submit_one(self, block: bool = False) -> bool:
        """Take the next queued job and submit it. Returns False when there was nothing to do
        (empty queue, or no in-flight permit and ``block`` is False)."""
        with self._submit_cv:
            while True:
                if self._submit_q and (self._inflight < self.config.inflight_capacity
                                       or self._submit_q[0].cancel_flag
                                       or self._halted is not None):
                    job = self._submit_q.popleft()
                    break
                if not block or (self._stopping_threads and not self._submit_q):
                    return False
                if self._held_by_runtime:
                    # A failed Wait left buffers with the runtime: nobody signals when it lets
                    # go, so re-check on a short timer (only in this degraded state).
                    self._submit_cv.wait(0.05)
                    self._submit_cv.release()
                    try:
                        self._reap_held()
                    finally:
                        self._submit_cv.acquire()
                else:
                    self._submit_cv.wait()
            halted = self._halted
            if halted is not None:
                status = halted.with_context(**job.ctx())
            elif job.cancel_flag:
                status = Status.cancelled(Phase.SUBMIT, **job.ctx())
            elif time.monotonic() >= job.deadline:
                status = Status.deadline(Phase.SUBMIT, "queue deadline passed before infer()",
                                         **job.ctx())
            else:
                status = None
                self._inflight += 1
        if status is not None:
            self._fail_before_submit(job, status)
            return True
        self._submit(job)
        return True

    def _submit(self, job: Job) -> None:
        slot = job.lease.slot
        self.pool.mark_in_flight(job.lease)
        self.infer_threads.add(threading.current_thread().name)
        rc = self.device.infer(slot.model, self.kv, job.request.seq_id, slot.inbuf, slot.outbuf)
        if rc != CalrtCode.SUCCESS:
            # FI05: the runtime did not take the job: software rollback, no Wait.
            self.pool.device_done(job.lease)
            self._release_permit()
            status = Status.from_calrt(rc, Phase.SUBMIT, "infer", **job.ctx())
            self._fail_before_submit(job, status)
            return
        job.timings.submitted_us = now_us()
        job.run.send("infer_accepted")
        self.kvc.mark_submitted(job.txn)
        self.counters["submitted"] += 1
        with self._completion_cv:
            self._completion_q.append(job)
            self._completion_cv.notify()

    def _release_permit(self) -> None:
        with self._submit_cv:
            self._inflight -= 1
            self._submit_cv.notify_all()

    # ---- completion (§6.5) -----------------------------------------------------------------------
    def complete_one(self, block: bool = False) -> bool:
        """Wait for the oldest submitted job and finish it. False when none is submitted."""
        with self._completion_cv:
            while not self._completion_q:
                if not block or self._stopping_threads:
                    return False
                self._completion_cv.wait()
            job = self._completion_q[0]
        self._complete(job)
        with self._completion_cv:
            self._completion_q.popleft()
        return True

    def _execution_deadline(self, job: Job) -> float:
        cfg = self.config
        return (job.timings.submitted_us / 1e6 + cfg.execution_timeout_s
                + cfg.execution_timeout_per_token_s * job.request.token_count)

    def _complete(self, job: Job) -> None:
        slot = job.lease.slot
        outbuf = slot.outbuf
        if self.locks.checking and self.locks.held_by_current_thread():
            self.locks.violations.append(
                f"Wait() called holding {self.locks.held_by_current_thread()}")
        self.wait_threads.add(threading.current_thread().name)
        t0 = now_us()
        # One Wait() bounded by the §9.1 execution deadline; no lock is held here.
        remaining_us = int((self._execution_deadline(job) - time.monotonic()) * 1e6)
        rc = outbuf.wait(max(0, remaining_us))
        _, device_status = outbuf.get_status()
        job.timings.completed_us = now_us()
        job.timings.device_wait_ms = (job.timings.completed_us - t0) / 1000.0
        job.wait_rc, job.device_status = rc, device_status
        if job.cancel_flag and job.run.state == "Submitted":
            job.run.send("cancel")
        if rc != CalrtCode.SUCCESS and device_status in (DeviceJobStatus.PENDING,
                                                         DeviceJobStatus.RUNNING):
            self._runtime_still_holds(job, slot, rc)
            return
        target = job.run.send("wait_returned")
        if target == "Quarantined":
            status = (Status.from_calrt(rc, Phase.WAIT, "Wait", **job.ctx()) if rc != 0 else
                      Status.from_device_status(device_status, **job.ctx()))
            self._quarantine_after_submit(job, status, release_permit=slot.runtime_done())
            return
        t1 = now_us()
        result = self._postprocess(job)
        job.timings.postprocess_ms = (now_us() - t1) / 1000.0
        if isinstance(result, Status):
            job.output_status = result
            if target == "Completing":
                job.run.send("fault")
            self._quarantine_after_submit(job, result, release_permit=True)
            return
        # §6.5 order: KV commit -> reset slices -> deliver -> release the lease.
        job.output_status = Status.OK
        job.txn.device_finished = job.txn.output_valid = True
        self.kvc.commit(job.txn)
        undo = slot.undo_slices()
        if target == "Completing" and not self._advance(job, "deliver"):
            target = "CancelRequested"
        if target != "Completing":  # cancelled after submit (FI12): result discarded
            if job.run.state == "CancelRequested":
                job.run.send("fail")
            self.counters["cancelled"] += 1
            job.resolve(Status.cancelled(
                Phase.CANCEL, "cancelled after submit: Wait completed, result discarded",
                **job.ctx()))
        else:
            self.counters["succeeded"] += 1
            job.resolve(result)
        self.pool.device_done(job.lease)
        released = job.lease.release()
        self._release_budget(job)
        self._release_permit()
        for problem in (undo, released):
            if not problem.ok:  # FI15: slot quarantined by the pool; the job's result stands
                self.faults.report(problem.with_context(**job.ctx()), job)

    def _runtime_still_holds(self, job: Job, slot, rc: int) -> None:
        """Wait() failed (timeout, FI07) while the runtime still runs the job (§9.1).

        The job fails now (Quarantined: no logits, KV Unknown) but its buffers stay with the
        runtime: the slot is quarantined and its host storage stays mapped. The completion
        thread then waits a grace period for the device to let go; only then is the in-flight
        permit returned. A device that never lets go halts admission (Phase A has no safe
        reset of its own; the recovery controller resets and opens generation+1)."""
        if time.monotonic() >= self._execution_deadline(job):
            status = Status.failure("execution.deadline", Category.DEVICE, Phase.WAIT,
                                    "execution deadline passed; buffers kept until the device "
                                    "lets go or a reset", raw=rc, **job.ctx())
        else:
            status = Status.from_calrt(rc, Phase.WAIT, "Wait failed while the job is still on "
                                       "the device; buffers kept", **job.ctx())
        job.run.send("execution_timeout")
        self._quarantine_after_submit(job, status, release_permit=False)
        with self._submit_cv:
            self._held_by_runtime.append(slot)
        slot.outbuf.wait(int(self.config.timeout_grace_s * 1e6))
        if not self._reap_held():
            self._halt(Status.failure("device.hung", Category.DEVICE, Phase.WAIT,
                                      f"job {job.job_id} still on the device after the "
                                      f"{self.config.timeout_grace_s}s grace; admission halted",
                                      **job.ctx()))

    def _reap_held(self) -> bool:
        """Return the permits of quarantined slots the runtime has let go of since a failed
        Wait; True when the runtime holds none any more."""
        with self._submit_cv:
            still = [slot for slot in self._held_by_runtime if not slot.runtime_done()]
            freed = len(self._held_by_runtime) - len(still)
            self._held_by_runtime = still
            self._inflight -= freed
            if freed:
                self._submit_cv.notify_all()
            return not still

    def _halt(self, status: Status) -> None:
        """Stop admitting and fail everything queued with ``status`` (device unusable)."""
        with self.lifecycle_mu:
            if not self.lifecycle.final:
                if self.lifecycle.state == "Ready":
                    self.lifecycle.send("drain")
                self.lifecycle.send("fail")
        with self._submit_cv:
            self._halted = status
            self._submit_cv.notify_all()
        self._wake_waiters()
        self.faults.report(status, None)

    def _postprocess(self, job: Job) -> "InferenceResult | Status":
        """Output size (FI09), finiteness (FI10), then the direct conversion (§10.1)."""
        request, slot, sm = job.request, job.lease.slot, job.submodel
        vocab = self.generation.vocab_size
        row = valid_logits_row(request.token_count, sm.logits_tile_d0)
        first, count = request.logits_range(vocab)
        base = row * vocab + first
        rc, valid_bytes = slot.outbuf.valid_bytes()
        if rc != 0:
            return Status.from_calrt(rc, Phase.OUTPUT_CHECK, "output valid bytes", **job.ctx())
        if valid_bytes < sm.logits.byte_size:
            return Status.internal("output_short", Phase.OUTPUT_CHECK,
                                   f"output {sm.logits.name!r} holds {valid_bytes} bytes, "
                                   f"contract ByteSize is {sm.logits.byte_size}", **job.ctx())
        src = slot.host_output[base:base + count]
        if not bf16_all_finite(src, slot.scratch):
            return Status.internal("output_not_finite", Phase.OUTPUT_CHECK,
                                   f"NaN/Inf in logits row {row} [{first}, {first + count})",
                                   **job.ctx())
        dst = job.logits_out if job.logits_out is not None else np.empty(count, np.float32)
        bf16_to_f32_into(slot.host_output, base, count, dst)
        return InferenceResult(job_id=job.job_id, seq_id=request.seq_id,
                               generation=job.generation_id, kind=job.kind, logits=dst[:count],
                               argmax=int(np.argmax(dst[:count])), kv_len=job.txn.target_len,
                               timings=job.timings)

    def _quarantine_after_submit(self, job: Job, status: Status, release_permit: bool) -> None:
        """§6.5 failure after submit: no commit, sequence Unknown, slot quarantined, report."""
        self.kvc.mark_unknown(job.txn, status.code)
        self.pool.quarantine(job.lease, status.code)
        self._release_budget(job)
        if release_permit:
            self._release_permit()
        if job.run.state == "CancelRequested":
            job.run.send("execution_timeout" if not release_permit else "wait_returned")
        self.counters["quarantined"] += 1
        job.resolve(status)
        self.faults.report(status, job)

    # ---- threads ---------------------------------------------------------------------------------
    _stopping_threads = False

    def _start_threads(self) -> None:
        self._stopping_threads = False
        for name, step in (("calexec-submitter", self.submit_one),
                           ("calexec-completion", self.complete_one)):
            thread = threading.Thread(target=self._loop, args=(step,), name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _loop(self, step: Callable[..., bool]) -> None:
        while step(block=True):
            pass

    def _stop_threads(self) -> None:
        self._stopping_threads = True
        with self._submit_cv:
            self._submit_cv.notify_all()
        with self._completion_cv:
            self._completion_cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads = [t for t in self._threads if t.is_alive()]

    # ---- shutdown (FI13) ---------------------------------------------------------------------------
    def shutdown(self, grace: float = 10.0) -> Status:
        """Stop admission, cancel queued jobs, drain submitted ones within ``grace`` seconds,
        stop the threads, release the generation. Stopped when drained, Failed otherwise."""
        with self.lifecycle_mu:
            if self.lifecycle.final:
                return Status.OK if self.lifecycle.state == "Stopped" else self.start_status
            self._stopping = True
            if self.lifecycle.state == "Ready":
                self.lifecycle.send("drain")
        if self.kvc is not None:
            self.kvc.close()
        with self._submit_cv:
            for job in self._submit_q:
                job.cancel_flag = True
            self._submit_cv.notify_all()
        self._wake_waiters()
        deadline = time.monotonic() + grace
        if not self.config.threads:
            while self.submit_one() or self.complete_one():
                pass
        while time.monotonic() < deadline and not (self.all_submitted_drained()
                                                   and not self._submit_q):
            time.sleep(0.005)
        drained = self.all_submitted_drained() and not self._submit_q
        self._stop_threads()
        with self.lifecycle_mu:
            if drained and self.lifecycle.can("stop"):
                self.lifecycle.send("stop")
            elif not self.lifecycle.final:
                self.lifecycle.send("fail")
        if not drained:
            return Status.failure("shutdown.not_drained", Category.DEVICE, Phase.SHUTDOWN,
                                  f"submitted work did not drain within grace={grace}s")
        self.pool.close()
        self.kv.destroy()
        self.calbin.unload()
        self.device.close()
        return Status.OK

    # ---- synchronous compatibility entry (§6.1) -------------------------------------------------
    def decode_sync(self, request: InferenceRequest) -> tuple[int, "InferenceResult | Status"]:
        """``llama_decode``-style: (int code, result or Status). Logs every failure with
        job_id, seq_id, generation, raw CalRT code and phase."""
        handle = self.enqueue(request)
        if not self.config.threads:
            while not handle.done and (self.submit_one() or self.complete_one()):
                pass
        result = handle.wait_until(request.deadline)
        if isinstance(result, Status):
            code = llama_decode_code(result)
            log.warning("decode_sync failed: code=%d job_id=%s seq_id=%s generation=%s raw=%s "
                        "phase=%s status=%s", code, result.job_id, result.seq_id,
                        result.generation, result.raw,
                        None if result.phase is None else result.phase.value, result)
            return code, result
        return 0, result

    # ---- observability ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        with self.submit_mu:
            queued, inflight, pending = len(self._submit_q), self._inflight, self._pending_tokens
        return {
            "lifecycle": self.lifecycle.state,
            "generation": None if self.generation is None else self.generation.generation_id,
            "queued": queued,
            "inflight": inflight,
            "pending_tokens": pending,
            "slots": None if self.pool is None else self.pool.counts(),
            **self.counters,
        }
