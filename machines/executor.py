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
4. ``decode_stream`` (machines/stream.py): a sequence's decode loop with the next job armed
   (admitted and prepared up to Preparing, KV txn chained behind the running job) while the
   current one runs; a step writes the token (``_fire``) and the submitter infers.

Only the submitter calls ``infer`` and only the completion thread calls ``Wait`` (invariant 2);
with ``ExecutorConfig(threads=False)`` both are called by whoever drives ``submit_one`` and
``complete_one`` (stepped mode for deterministic tests). The runtime objects are duck-typed:
``calexec.drivers.calrt.runtime`` provides them; this module imports no cffi.

The device's own life (start, golden run, Failed, recovery, model switch along the lifecycle
chart) is the ``DeviceLifecycle`` mixin in machines/device_lifecycle.py.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Protocol

import attrs
import numpy as np

from calexec.contracts.codes import CalrtCode, DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.prepare import (InferenceRequest, check_request, plan_slices,
                                       valid_logits_row)
from calexec.contracts.status import Phase, Status, llama_decode_code
from calexec.contracts.types import EngineSlot, ModelGeneration, TaskKind
from calexec.machines.autoarm import _ARMING_WAIT_S as _AUTO_ARMING_WAIT_S
from calexec.machines.autoarm import AutoArm
from calexec.machines.clock import SYSTEM, Clock
from calexec.machines.compiled import LIFECYCLE, GuardRejected
from calexec.machines.dispatch import Arm, Dispatch, Held
from calexec.machines.device_lifecycle import DeviceLifecycle
from calexec.machines.faults import Decision, FaultController, RecoveryPolicy
from calexec.machines.generation import Generation
from calexec.machines.job import InferenceResult, Job, JobHandle, job_of
from calexec.machines.kv import KvCoordinator
from calexec.machines.locks import COMPLETION, COUNTERS, RECOVERY, LockOrder
from calexec.machines.locks import LIFECYCLE as LIFECYCLE_RANK
from calexec.machines.pool import BufferPool
from calexec.machines.postprocess import bf16_all_finite, bf16_to_f32_into
from calexec.machines.sequences import SequenceOwnership
from calexec.machines.tuning import HotPathTuning
from calexec.machines.chart_names import (JOB_CANCEL_REQUESTED, JOB_COMPLETING, JOB_CREATED,
                                          JOB_EV_ADMIT, JOB_EV_BEGIN_PREPARATION, JOB_EV_CANCEL,
                                          JOB_EV_DELIVER, JOB_EV_ENQUEUE, JOB_EV_EXECUTION_TIMEOUT,
                                          JOB_EV_FAIL, JOB_EV_FAULT, JOB_EV_INFER_ACCEPTED,
                                          JOB_EV_WAIT_RETURNED, JOB_QUARANTINED, JOB_SUBMITTED,
                                          KV_RESERVED, LIFECYCLE_CONFIGURING, LIFECYCLE_DRAINING,
                                          LIFECYCLE_EV_DRAIN, LIFECYCLE_EV_FAIL, LIFECYCLE_EV_STOP,
                                          LIFECYCLE_FAILED, LIFECYCLE_READY, LIFECYCLE_RECOVERING,
                                          LIFECYCLE_STOPPED, LIFECYCLE_WARMING)

if TYPE_CHECKING:
    from calexec.machines.stream import DecodeStream

log = logging.getLogger("calexec.executor")


#: Features a §8 PROGRAMMING fault (27 unsupported, 29 wrong direction) switches off until the
#: next generation (``DeviceExecutor.disable_feature``). A PROGRAMMING fault elsewhere (plain
#: infer, Wait, CSRs, slices: all mandatory paths) has nothing optional to switch off: the job
#: fails, the fault is recorded, serving continues, no reset.
FEATURES: dict[str, str] = {
    "fixed_engine": "Phase B: infer_with_fixed_task_type on the PING/PONG slots; off: plain "
                    "infer() and in-flight capacity 1",
}


class FaultSink(Protocol):
    """Where the executor reports every failure after submit and every runtime failure.
    ``calexec.machines.faults.FaultController`` (the default) applies the §8 actions."""

    def report(self, status: Status, job: Job | None) -> None: ...


@attrs.define
class ExecutorConfig:
    """Executor settings. Everything about the model (shapes, max_seq, tile D0) comes from the
    manifest; these are operational choices only."""

    calbin_path: str
    device_config: str = ""
    #: Phase A: 1 (default). Phase B: 2, each buffer slot fixed to PING or PONG and submitted
    #: with infer_with_fixed_task_type; enable only after `calexec accept --phase b` and
    #: `calexec conform` proved overlap and slot reuse. Back to 1 is configuration only.
    inflight_capacity: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    #: Phase B automatic downgrade to capacity 1: this many failures after submit within
    #: the window (logged, counted in snapshot()["downgrades"]).
    downgrade_after_faults: int = attrs.field(default=2, validator=attrs.validators.ge(1))
    downgrade_window_s: float = 60.0
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
    #: the fixed golden run of §9.2 Warming: this prompt, then greedy decode steps
    golden_tokens: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17)
    golden_decode_steps: int = 2
    golden_seq_id: int = 0
    #: deadline of each golden job (a golden that cannot finish fails the warm-up, never hangs)
    golden_timeout_s: float = 10.0
    #: expected golden tokens per calbin sha256 for the prompt above, given by the operator;
    #: they take precedence over the goldens pinned next to the manifest (``Manifest.goldens``,
    #: written by ``calexec golden record``).
    goldens: dict[str, tuple[int, ...]] = attrs.field(factory=dict)
    #: §9.2: start or switch to a calbin with no pinned golden. Refused by default; when set,
    #: the first warm-up's tokens become the expected ones for this process (trust on first
    #: use), logged at WARNING and shown in ``snapshot()["golden"]``.
    allow_unpinned_golden: bool = False
    #: recovery thresholds and reset choice (calexec.machines.faults.RecoveryPolicy)
    recovery: RecoveryPolicy = attrs.field(factory=RecoveryPolicy)
    #: queue through recovery (Triton's DELAY policy): up to this many requests that arrive
    #: while the device drains/recovers/configures/warms wait for Ready within their
    #: deadline instead of an immediate UNAVAILABLE; 0 refuses them at once
    ready_queue_max: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    #: the path of each job (taken transitions, refused events and their guards) is kept for
    #: this many most recent jobs (``job_trail``); 0 keeps none
    job_trails_kept: int = attrs.field(default=1024, validator=attrs.validators.ge(0))
    #: /ready and health(): a job still on the device this long past its request deadline
    #: means the device stalls (the execution deadline above is the hard bound)
    stall_after_s: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    #: how long a recovery waits for request threads still preparing a job of the old
    #: generation to leave it (they end at once: admission is stopped and their waits woken)
    fence_grace_s: float = attrs.field(default=2.0, validator=attrs.validators.gt(0))
    #: implicit pre-arming for enqueue/decode_sync callers (machines/autoarm.py): while a
    #: sequence's decode job runs, the submitter arms the job the sequence's next token would
    #: need (only within its KV reservation, only with a free slot); any other request of it
    #: releases the guess first, and so does an admission short of a slot or token budget
    auto_prearm: bool = True
    #: the hot path's timing (arming delays, greedy ahead's yield, early wake-ups, a guess's
    #: expiry): machines/tuning.py; none of it changes an answer, only when work runs
    tuning: HotPathTuning = attrs.field(factory=HotPathTuning)


def _check_caller_arguments(request: InferenceRequest, logits_out: Any,
                             vocab: int) -> Status:
    """Arguments the caller hands to ``enqueue`` besides the §6.3 request checks: the deadline
    and the destination of the logits (its dtype, shape, size, contiguity, writability). A bad
    one fails that caller with INVALID_ARGUMENT, never the executor's threads."""
    if not math.isfinite(request.deadline):
        return Status.invalid(1, f"deadline={request.deadline}: must be a finite "
                                 "time.monotonic() value")
    if logits_out is None:
        return Status.OK
    if not isinstance(logits_out, np.ndarray):
        return Status.invalid(6, f"logits_out: expected a numpy float32 array, got "
                                 f"{type(logits_out).__name__}")
    _, count = request.logits_range(vocab)
    problems = []
    if logits_out.dtype != np.float32:
        problems.append(f"dtype {logits_out.dtype} (must be float32)")
    if logits_out.ndim != 1:
        problems.append(f"shape {logits_out.shape} (must be 1-D)")
    elif logits_out.shape[0] < count:
        problems.append(f"{logits_out.shape[0]} elements < the {count} requested")
    if not logits_out.flags.c_contiguous:
        problems.append("not C-contiguous")
    if not logits_out.flags.writeable:
        problems.append("read-only")
    if problems:
        return Status.invalid(6, "logits_out: " + "; ".join(problems))
    return Status.OK


_TRAIL_STEPS = 32  # a job takes at most ~8 transitions; refused events are few


class _NoRequest:
    """Stand-in request of a job refused because the caller passed no InferenceRequest."""

    seq_id = -1
    kind = TaskKind.DECODE
    deadline = 0.0
    token_count = 0


_NO_REQUEST = _NoRequest()


class DeviceExecutor(DeviceLifecycle, SequenceOwnership):
    """The control core: owns the device, calbin, KvManager and buffer pool (invariant 1).

    This class is the job path; the device lifecycle (start, golden, recovery, model switch)
    is the ``DeviceLifecycle`` mixin in machines/device_lifecycle.py."""

    def __init__(self, runtime: Any, manifest: Any, config: ExecutorConfig,
                 fault_sink: FaultSink | None = None, clock: Clock = SYSTEM) -> None:
        self.runtime = runtime
        self.manifest = manifest
        self.config = config
        self._tuning = config.tuning
        self.clock = clock
        self.faults = fault_sink or FaultController(config.recovery)
        self._fused_logits = getattr(runtime, "logits_postprocessor", lambda: None)()
        if hasattr(self.faults, "attach"):
            self.faults.attach(self)
        self.locks = LockOrder(checking=config.check_lock_order, strict=config.strict_lock_order,
                               clock=clock)
        self.lifecycle_mu = self.locks.lock(LIFECYCLE_RANK)
        # the dispatch state (submit queue, armed jobs and what to arm, permits, budget,
        # generation fence, refusal, slots held by the runtime): one owner, machines/dispatch.py
        self.dispatch = Dispatch(self.locks, clock, config.inflight_capacity)
        self.submit_mu = self.dispatch.mu
        # requests waiting for Ready during a recovery (lifecycle_mu; ready_queue_max)
        self._ready_cv = clock.condition(self.lifecycle_mu)
        self._ready_waiters = 0
        self._last_submit_seq: int | None = None  # the submitter's own (no lock)
        self._features_off: dict[str, int] = {}  # FEATURES name -> generation it went off in
        self.downgrades: list[dict[str, Any]] = []
        self._phase_b_faults: deque[float] = deque()
        # Early wake-ups (issue 17): a thread that slept through a decode job's device time
        # wakes tuning.prewake_s before the job is expected to end, so the hand-off that follows
        # finds it (and its CPU) warm: the submitter's idle wait (``_prewake_in``, once per
        # job on the device) and a caller's ``JobHandle.wait_until`` (``Job.early_wake_s``).
        # The expectation is the moving average of decode jobs' device time (completion
        # thread writes, others read a float).
        self._decode_exec_us = 0.0
        self._prewoken = 0  # job id the submitter last woke early for (its own)
        self._completion_mu = self.locks.lock(COMPLETION)  # never held across Wait()
        self._completion_cv = clock.condition(self._completion_mu)
        self._completion_q: deque[Job] = deque()
        self._job_ids = itertools.count(1)
        self._gen_ids = itertools.count(1)
        self.lifecycle = LIFECYCLE.run(self)
        self.device: Any = None
        self.gen: Generation | None = None
        # released generations whose host memory the device may still write (kept until
        # Device.dma_quiescent() proves otherwise), and generations refused while their job
        # was still on the device (never torn down: §9.1)
        self._retired: deque[Generation] = deque()
        self._threads: list[threading.Thread] = []
        # supervision: what each executor thread holds now, and what its barrier caught
        self._holding: dict[str, Job | None] = {}
        self.thread_faults: deque[dict[str, Any]] = deque(maxlen=100)
        self._waiting_on: Job | None = None  # the job the completion thread waits for
        self._stopping = False
        self._admitting = False  # Ready and not draining (read without a lock: a bool)
        self._golden_ok = False
        self._rollback_path: str | None = None
        self.good_calbins: list[str] = []  # calbin paths that reached Ready, newest last
        self.goldens: dict[str, tuple[int, ...]] = dict(config.goldens)
        self.golden_source: str | None = None  # the current generation's: pinned|config|unpinned
        self.unpinned_goldens: set[str] = set()  # calbin sha256s accepted by allow_unpinned_golden
        self.start_status: Status | None = None
        self.failure: Status | None = None  # why the lifecycle is Failed
        # recovery: one at a time, on its own thread (threads mode) or run by the caller
        self._recovery_mu = self.locks.lock(RECOVERY)
        self._recovery_owner: int | None = None  # thread ident holding recovery_mu in recover()
        self._pending_recovery: Decision | None = None
        self._recovery_thread: threading.Thread | None = None
        self.recoveries: list[dict[str, Any]] = []
        # Observability (§10.3): counters read by metrics; thread identity of runtime calls
        # (invariant 2).
        self.counters = {"submitted": 0, "succeeded": 0, "failed": 0, "quarantined": 0,
                         "cancelled": 0, "stale_completions": 0, "submit_retries": 0,
                         # implicit pre-arms (machines/autoarm.py): guesses taken by the
                         # request that came, and guesses released unused
                         "auto_prearmed": 0, "auto_prearm_released": 0}
        self._counters_mu = self.locks.lock(COUNTERS)
        self._trails: OrderedDict[int, dict[str, Any]] = OrderedDict()  # counters_mu
        self.infer_threads: set[str] = set()
        self.wait_threads: set[str] = set()

    # ---- the current generation's parts (None before start) ----------------------------------
    @property
    def generation(self) -> ModelGeneration | None:
        return None if self.gen is None else self.gen.contracts

    @property
    def pool(self) -> BufferPool | None:
        return None if self.gen is None else self.gen.pool

    @property
    def kvc(self) -> KvCoordinator | None:
        return None if self.gen is None else self.gen.kvc

    @property
    def kv(self) -> Any:
        return None if self.gen is None else self.gen.kv

    @property
    def _models(self) -> dict[TaskKind, Any]:
        return {} if self.gen is None else self.gen.models

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
        if self.dispatch.any_guess and isinstance(request, InferenceRequest):
            handle = self._auto_take(request, logits_out, on_created)
            if handle is not None:
                return handle
        return self._enqueue(request, internal=False, logits_out=logits_out,
                             on_created=on_created)

    def _enqueue(self, request: InferenceRequest, internal: bool,
                 logits_out: np.ndarray | None = None,
                 on_created: Callable[[JobHandle], None] | None = None,
                 arm: Arm | None = None) -> JobHandle:
        if not isinstance(request, InferenceRequest):
            job = Job(next(self._job_ids), 0, _NO_REQUEST, self._wake_waiters)
            return self._fail_early(job, Status.invalid(
                4, f"request: expected an InferenceRequest, got {type(request).__name__}"))
        gen = self.gen
        job = Job(next(self._job_ids), gen.id if gen is not None else 0, request,
                  self._wake_waiters, internal=internal, clock=self.clock)
        job.gen = gen
        job.logits_out = logits_out
        if request.kind == TaskKind.DECODE:
            job.early_wake_s = self._early_wake_s()
        job.uncounted = arm is not None and not arm.blocking  # a pre-arm attempt may miss
        job.auto_next = (arm is None and not internal and self.config.auto_prearm
                         and request.kind == TaskKind.DECODE and len(request.seq_ids) == 1
                         and isinstance(request.positions, np.ndarray))
        if self.config.job_trails_kept:
            job.run.trail = deque(maxlen=_TRAIL_STEPS)
            job.on_resolved = self._keep_trail
        handle = JobHandle(job)
        if on_created is not None:
            on_created(handle)
        # queue through recovery: a caller's request waits for Ready; a pre-arm never waits
        # (the submitter arms: the recovery's golden run needs the submitter)
        if (not internal and not self._admitting and self.config.ready_queue_max
                and (arm is None or arm.blocking)):
            waited = self._wait_for_ready(job)
            if waited is not None:
                return self._fail_early(job, waited)
            gen = self.gen
            job.gen, job.generation_id = gen, gen.id if gen is not None else 0
        if not (self._admitting or (internal and self.lifecycle.state == LIFECYCLE_WARMING)) \
                or self._stopping or gen is None:
            return self._fail_early(job, Status.unavailable(
                Phase.ADMISSION, f"device lifecycle is {self.lifecycle.state}; not admitting",
                **job.ctx()))
        generation = gen.contracts
        status = check_request(request, generation)
        if status.ok:
            status = _check_caller_arguments(request, logits_out, generation.vocab_size)
        if not status.ok:
            return self._fail_early(job, status.with_context(**job.ctx()))
        job.submodel = generation.submodels[request.kind]
        # Fencing: from here until the job is queued (or failed) this thread works on ``gen``;
        # a recovery closes the generation and waits for it to leave before tearing it down.
        if not self.dispatch.enter(gen, self.gen):
            return self._fail_early(job, Status.unavailable(
                Phase.ADMISSION, f"generation {gen.id} is closing; retry later", **job.ctx()))
        try:
            return self._admit_and_queue(job, handle, gen, arm)
        except Exception as exc:  # barrier: a bug here fails this job, never leaks or hangs
            log.exception("enqueue of job %d raised", job.job_id)
            return self._abandon_before_submit(job, exc, "enqueue")
        finally:
            self.dispatch.exit(gen)

    def _admit_and_queue(self, job: Job, handle: JobHandle, gen: Generation,
                         arm: Arm | None = None) -> JobHandle:
        request = job.request
        stop = self._stop_reason(job)
        if stop() is not None:
            return self._fail_early(job, stop())
        # Admission: token budget, then KV (both released on every failure below).
        tokens = request.token_count
        budget = self._token_budget()
        speculative = arm is not None and not arm.blocking  # a pre-arm: may find nothing free
        dispatch = self.dispatch
        if (dispatch.anything_armed and not speculative and not job.internal
                and dispatch.over_budget(tokens, budget)):
            self._reclaim_armed()  # a pre-armed job never keeps budget from a request
        if not dispatch.take_budget(job, budget):
            return self._fail_early(job, Status.exhausted(
                "queue", Phase.ADMISSION, f"token budget: {dispatch.pending_tokens} pending + "
                f"{tokens} > {budget} (max_pending_tokens="
                f"{self.config.max_pending_tokens}, reduced after transient faults)",
                **job.ctx()))
        # a pre-arm never waits: KV within the sequence's reservation, a slot free now
        wait_until = job.deadline if arm is None or arm.blocking else 0.0
        if (arm is not None and arm.prev_txn is not None
                and arm.prev_txn.generation_id != gen.id):  # never chained across generations
            self._release_budget(job)
            return self._fail_early(job, Status.unavailable(
                Phase.ADMISSION, f"generation {arm.prev_txn.generation_id} of the job before "
                f"was retired; retry", **job.ctx()))
        txn = (gen.kvc.reserve_next(arm.prev_txn, tokens)
               if arm is not None and arm.prev_txn is not None else
               gen.kvc.reserve(request.seq_id, request.past_len, tokens, wait_until, stop,
                               reserve_len=request.kv_reserve_len))
        if isinstance(txn, Status):
            self._release_budget(job)
            return self._fail_early(job, txn.with_context(job_id=job.job_id))
        job.txn = txn
        if not self._advance(job, JOB_EV_ADMIT):
            return self._fail_before_submit(job, Status.cancelled(Phase.ADMISSION, **job.ctx()))
        job.timings.admitted_us = self.clock.now_us()
        lease = None
        if dispatch.anything_armed and not speculative:  # never a slot kept from a request
            lease = gen.pool.acquire(request.kind, 0.0, owner=job.job_id, stop=stop)
            if isinstance(lease, Status) and lease.category == Category.RESOURCE_EXHAUSTED:
                self._reclaim_armed()
                lease = None
        if lease is None:  # a pre-arm never takes a slot a request is waiting for
            lease = gen.pool.acquire(request.kind, wait_until, owner=job.job_id, stop=stop,
                                     speculative=speculative)
        if isinstance(lease, Status):
            return self._fail_before_submit(job, lease.with_context(**job.ctx()))
        job.lease = lease
        if not self._advance(job, JOB_EV_BEGIN_PREPARATION):
            return self._fail_before_submit(job, Status.cancelled(Phase.PREPARE, **job.ctx()))
        status = self._prepare(job)
        if not status.ok:
            return self._fail_before_submit(job, status.with_context(**job.ctx()))
        if arm is not None:  # pre-armed: Preparing until its token comes (``fire``); a
            # guess until it is fired: its release counts nothing
            # (blocking: the caller's own step, fired next: never reclaimed as a guess)
            if not dispatch.arm(job, self.gen, notify=arm.notify, for_caller=arm.blocking):
                return self._fail_before_submit(job, Status.unavailable(
                    Phase.PREPARE, f"generation {gen.id} retired while the job was armed; "
                    "retry", **job.ctx()))
            return handle
        if not self._advance(job, JOB_EV_ENQUEUE):
            return self._fail_before_submit(job, Status.cancelled(Phase.PREPARE, **job.ctx()))
        job.timings.queued_us = self.clock.now_us()
        if not dispatch.queue(job, self.gen):  # fencing: never into another generation's queue
            return self._fail_before_submit(job, Status.unavailable(
                Phase.SUBMIT, f"generation {gen.id} retired before the job was queued; retry",
                **job.ctx()))
        return handle

    def _arm_delay_s(self) -> float:
        """``tuning.arm_delay_s``, at most a quarter of a decode job's expected device time."""
        return (min(self._tuning.arm_delay_s, self._decode_exec_us / 4e6)
                if self.config.threads else 0.0)

    def _early_wake_s(self) -> float:
        """How long after it begins a caller's wait for a decode job wakes early (0: not)."""
        tuning = self._tuning
        if tuning.prewake_s > 0 and self._decode_exec_us >= tuning.prewake_min_us:
            return self._decode_exec_us / 1e6 - tuning.prewake_s
        return 0.0

    def _fence(self, gen: Generation, grace: float) -> bool:
        """Close ``gen`` to request threads and wait (at most ``grace`` s) for those inside
        to leave. Their waits end at once: admission is stopped and they are woken."""
        deadline = self.clock.monotonic() + grace
        # the jobs armed in it are guesses that will never be fired: released now, so the
        # drain that follows finds nothing armed (left to the submitter they delayed every
        # recovery by a drain poll when a guess was armed: the differential test)
        for job in self.dispatch.close(gen):
            self._fail_before_submit(job, Status.unavailable(
                Phase.SUBMIT, f"generation {gen.id} retired before the job was fired; retry",
                **job.ctx()))
        gen.kvc.wake()
        gen.pool.wake()
        return self.dispatch.wait_left(gen, deadline)

    def _token_budget(self) -> int:
        factor = getattr(self.faults, "admission_factor", lambda: 1.0)()
        return int(self.config.max_pending_tokens * factor)

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
        gen = job.gen

        def stop() -> Status | None:
            if job.cancel_flag:
                return Status.cancelled(Phase.ADMISSION, **job.ctx())
            if (not job.internal and (self._stopping or not self._admitting)) or (
                    gen is not None and gen.closing):
                return Status.unavailable(Phase.ADMISSION, "executor is shutting down or "
                                          "recovering; retry later", **job.ctx())
            if self.clock.monotonic() >= job.deadline:
                return Status.deadline(Phase.ADMISSION, "admission deadline passed", **job.ctx())
            return None
        return stop

    def _keep_trail(self, job: Job) -> None:
        """A job resolved: keep its path (bounded, newest last) for ``job_trail``."""
        result = job.result
        record = {"job_id": job.job_id, "seq_id": job.request.seq_id, "kind": job.kind.name,
                  "generation": job.generation_id, "state": job.run.state,
                  "status": "ok" if not isinstance(result, Status) else result.code,
                  "trail": job.run.trail}
        trails = self._trails
        with self._counters_mu:
            trails[job.job_id] = record
            while len(trails) > self.config.job_trails_kept:
                trails.popitem(last=False)

    def job_trail(self, job_id: int) -> dict[str, Any] | None:
        """What happened to one recent job: its chart path as a list of steps ``{event,
        from, to, refused_by, t}`` (``to`` None and ``refused_by`` the guards when an event
        was refused), its final state and status code; None when not kept (still running,
        or older than ``job_trails_kept`` jobs)."""
        with self._counters_mu:
            record = self._trails.get(job_id)
            if record is None:
                return None
            steps = list(record["trail"])
        out = {key: value for key, value in record.items() if key != "trail"}
        out["trail"] = [{"event": e, "from": s, "to": t, "refused_by": list(g) if g else None,
                         "t": at} for e, s, t, g, at in steps]
        return out

    def _wait_for_ready(self, job: Job) -> Status | None:
        """Queue through recovery (Triton's DELAY policy): a request that arrives while the
        device drains, recovers, configures or warms up waits for Ready, bounded by its
        deadline and by ``ready_queue_max`` waiters. None when it may go on; else why not
        (UNAVAILABLE when the queue is full, the lifecycle Failed or the executor stops;
        DEADLINE when its deadline passed first; CANCELLED)."""
        with self._ready_cv:
            state = self.lifecycle.state
            if state not in (LIFECYCLE_DRAINING, LIFECYCLE_RECOVERING, LIFECYCLE_CONFIGURING,
                             LIFECYCLE_WARMING) and not (
                    state == LIFECYCLE_READY and self._pending_recovery is not None):
                return None  # Ready (admits), or Created/Failed/Stopped: answered by the caller
            if self._ready_waiters >= self.config.ready_queue_max:
                return Status.unavailable(Phase.ADMISSION, f"device lifecycle is "
                                          f"{self.lifecycle.state} and {self._ready_waiters} "
                                          "requests already wait for Ready; retry later",
                                          **job.ctx())
            self._ready_waiters += 1
            try:
                while not self._admitting:
                    if self._stopping or self.lifecycle.final:
                        return None
                    if job.cancel_flag:
                        return Status.cancelled(Phase.ADMISSION, **job.ctx())
                    remaining = job.deadline - self.clock.monotonic()
                    if remaining <= 0:
                        return Status.deadline(Phase.ADMISSION, "deadline passed while the "
                                               f"device was {self.lifecycle.state}",
                                               **job.ctx())
                    self.clock.wait(self._ready_cv, remaining)
                return None
            finally:
                self._ready_waiters -= 1

    def _ready_changed(self) -> None:
        """Ready, Failed or stopping: wake the requests waiting for Ready."""
        with self._ready_cv:
            self._ready_cv.notify_all()

    def _wake_waiters(self) -> None:
        """A cancel was recorded: end admission/lease waits so the owner sees it."""
        self._ready_changed()
        if self.kvc is not None:
            self.kvc.wake()
        if self.pool is not None:
            self.pool.wake()
        self.dispatch.wake()

    def _advance(self, job: Job, event: str) -> bool:
        """Send a forward event guarded by ``not_cancelled``; False when the job was cancelled
        (it is then in CancelRequested)."""
        try:
            job.run.send(event)
            return True
        except GuardRejected:
            job.run.send(JOB_EV_CANCEL)
            return False

    def _downgrade(self, status: Status) -> None:
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

    # ---- failure paths ------------------------------------------------------------------------
    def _fail_early(self, job: Job, status: Status) -> JobHandle:
        """Nothing acquired yet: Created -> Failed."""
        if job.cancel_flag and job.run.state == JOB_CREATED:
            job.run.send(JOB_EV_CANCEL)
        job.run.send(JOB_EV_FAIL)
        if not job.uncounted:
            self._count(status)
        job.resolve(status)
        return JobHandle(job)

    def _fail_before_submit(self, job: Job, status: Status) -> JobHandle:
        """Release in reverse order: slices, lease, KV txn, token budget (§6.2). A job of a
        generation already torn down touches none of its runtime objects."""
        gen = job.gen
        live = gen is not None and not gen.released
        if job.lease is not None:
            if live:
                job.lease.slot.undo_slices()
            job.lease.release()
        if live and job.txn is not None and job.txn.run.state == KV_RESERVED:
            gen.kvc.rollback(job.txn)
        self._release_budget(job)
        if job.cancel_flag and job.run.state not in (JOB_CANCEL_REQUESTED,):
            job.run.send(JOB_EV_CANCEL)
        job.run.send(JOB_EV_FAIL)
        if not job.uncounted:
            self._count(status)
        # a guess nobody asked for is not reported either: the request, if it comes, is
        # admitted the ordinary way and meets the same fault (plain path: reported once)
        if not job.internal and not job.uncounted and status.category not in (
                Category.CANCELLED, Category.DEADLINE, Category.INVALID_REQUEST,
                Category.RESOURCE_EXHAUSTED, Category.UNAVAILABLE):
            self.faults.report(status, job)  # first: admission stops before the caller sees it
        job.resolve(status)
        return JobHandle(job)

    def _abandon_before_submit(self, job: Job, exc: BaseException, where: str) -> JobHandle:
        """The barrier's path for a job whose preparation raised: release what it holds (each
        step on its own: one failing does not stop the others), resolve it INTERNAL, report."""
        status = Status.internal("unexpected_exception", Phase.ADMISSION,
                                 f"{where} raised {type(exc).__name__}: {exc}", **job.ctx())
        lease, job.lease = job.lease, None
        for step in (lambda: lease is not None and lease.slot.undo_slices(),
                     lambda: lease is not None and job.gen.pool.quarantine(lease, status.code),
                     lambda: job.txn is not None and job.txn.run.state == KV_RESERVED
                     and job.gen.kvc.rollback(job.txn)):
            try:
                step()
            except Exception:  # noqa: BLE001 - best effort; the fault below rebuilds
                log.exception("releasing job %d after %s raised", job.job_id, where)
        if job.budget_taken:
            self._release_budget(job)
        try:
            if job.cancel_flag and job.run.can(JOB_EV_CANCEL):
                job.run.send(JOB_EV_CANCEL)
            job.run.send(JOB_EV_FAIL)
        except Exception:  # noqa: BLE001 - the chart refused: the job is resolved regardless
            log.exception("job %d: chart refused fail after %s", job.job_id, where)
        self._count(status)
        self.faults.report(status, job)
        job.resolve(status)
        return JobHandle(job)

    def _release_budget(self, job: Job) -> None:
        self.dispatch.release_budget(job)

    def _bump(self, key: str) -> None:
        with self._counters_mu:  # leaf lock: counters are bumped from several threads
            self.counters[key] += 1

    def _count(self, status: Status) -> None:
        key = "cancelled" if status.category == Category.CANCELLED else "failed"
        self._bump(key)

    # ---- submitter (§6.4) ----------------------------------------------------------------------
    def submit_one(self, block: bool = False) -> bool:
        """Submit the next queued job, or fail every queued job that can no longer be
        submitted (cancelled, past its queue deadline, refused, of a retired generation) as
        soon as that is so, wherever it stands in the queue (§9.1 queue deadline), or arm a
        stream's next step or a guess. Returns False when there was nothing to do (and
        ``block`` is False, or the threads stop). The dispatch decides
        (``Dispatch.next_for_submitter``); this thread acts on its answer.

        The blocking wait is bounded by the earliest queued deadline; with an empty queue it
        is the submitter's idle wait, ended by a new job or by shutdown (shutdown-only)."""
        dispatch = self.dispatch
        if dispatch.any_held and not block:  # stepped: nobody else reaps them
            self._reap_held()
        while True:
            prewake = (self._prewake_at(self.clock.monotonic())
                       if block and self._tuning.prewake_s > 0 else None)
            step = dispatch.next_for_submitter(self._unsubmittable, self._effective_capacity(),
                                               block, prewake)
            if not step.woke:
                break
            if dispatch.any_held:  # nobody signals when the runtime lets go: re-check
                self._reap_held()
        if step.arm is not None:
            try:
                step.arm.arm_next()  # it never raises: a failed arm leaves nothing armed
            finally:
                dispatch.done_arming()
            return True
        if step.fail:
            for _ in range(step.guesses):
                self._bump("auto_prearm_released")
            try:
                for job, status in step.fail:
                    self._holding["calexec-submitter"] = job
                    self._fail_before_submit(job, status)
            finally:
                dispatch.handed_off(len(step.fail))
            self._holding["calexec-submitter"] = None
            return True
        job = step.submit
        if job is None:
            return False
        self._holding["calexec-submitter"] = job  # the barrier resolves it if _submit raises
        try:
            self._submit(job)
        finally:
            dispatch.handed_off(1)
        self._holding["calexec-submitter"] = None
        seq, self._last_submit_seq = self._last_submit_seq, job.request.seq_id
        if job.auto_next and job.submitted_at and seq == job.request.seq_id:
            self._auto_after_submit(job)
        return True

    # ---- implicit pre-arms (machines/autoarm.py) ------------------------------------------------
    def _auto_after_submit(self, job: Job) -> None:
        """Job ``job`` (a decode of a sequence whose job before was submitted just before
        it) is on the device: queue the guess of its successor for the submitter."""
        if (self.dispatch.guess(job.request.seq_id) is None and self._admitting
                and not self._stopping_threads and job.gen is self.gen
                and (self._decode_exec_us >= self._tuning.auto_prearm_min_us
                     or not self.config.threads)):
            delay = self._arm_delay_s()
            self.dispatch.add_guess(AutoArm(self, job),
                                    self.clock.monotonic() + delay if delay > 0 else 0.0)

    def _auto_release(self, jobs: list[Job], why: str) -> None:
        for job in jobs:  # uncounted: nobody asked for it
            self._bump("auto_prearm_released")
            self._fail_before_submit(job, Status.cancelled(Phase.CANCEL, f"auto pre-arm {why}",
                                                           **job.ctx()))

    def _drop_armed(self, seq_id: int) -> None:
        """``KvCoordinator.on_busy``: an operation on ``seq_id`` is coming (a reserve, reset
        or truncation); release what was armed for it first (its guess, a decode stream's
        next step, an arming in progress): an armed job is a guess and never makes a
        sequence busy for a request, as the plain path has none. A stream whose next step was
        released admits that step the ordinary way; its step fired ahead and not taken was
        computed on the sequence as it was, so it is discarded (the caller's step runs again,
        after that request)."""
        dispatch = self.dispatch
        if not dispatch.anything_for(seq_id):  # (unlocked hint: the common case, nothing)
            return
        guess, streams, stream = dispatch.take_armed_of(
            seq_id, self.clock.monotonic() + _AUTO_ARMING_WAIT_S)
        ahead = None if stream is None else stream.discard_ahead()
        if ahead is not None:
            ahead.cancel()
        if guess is not None:
            self._auto_release([guess], f"released: seq {seq_id} used otherwise")
        for job in streams:
            self._fail_before_submit(job, Status.cancelled(
                Phase.CANCEL, f"pre-armed job released: seq {seq_id} used otherwise",
                **job.ctx()))

    def _reclaim_armed(self) -> None:
        """An admission is short of a slot or of token budget: release every pre-armed job
        not fired yet (the implicit pre-arms and the decode streams' next steps). They are
        guesses: the step that would have taken one is admitted the ordinary way instead, so
        a pre-arm changes when admission work runs, never who gets a slot first."""
        guesses, streams = self.dispatch.reclaim(self.clock.monotonic() + _AUTO_ARMING_WAIT_S)
        self._auto_release(guesses, "released: its resources were needed")
        for job in streams:
            job.uncounted = True
            self._fail_before_submit(job, Status.cancelled(
                Phase.CANCEL, "pre-armed job released: its resources were needed",
                **job.ctx()))

    def _auto_take(self, request: InferenceRequest, logits_out: Any,
                   on_created: Callable[[JobHandle], None] | None) -> JobHandle | None:
        """``enqueue``: the job armed for ``request``'s sequence, fired with its token when
        ``request`` is what was guessed; else the guess is released and None returned (the
        request is admitted the ordinary way)."""
        seq_ids = request.seq_ids
        dispatch = self.dispatch
        if len(seq_ids) != 1 or dispatch.guess(seq_ids[0]) is None:
            return None  # (unlocked test: a guess missed here is released by reserve's hook)
        entry, job = dispatch.detach_guess(seq_ids[0],
                                           self.clock.monotonic() + _AUTO_ARMING_WAIT_S)
        if job is None:
            return None
        gen = job.gen
        # fencing as on the ordinary path: until the job is queued or released, a recovery
        # waits for this thread to leave the generation
        if gen is None or not dispatch.enter(gen, self.gen):
            self._auto_release([job], "released: its generation is closing")
            return None
        try:
            # The guess is adopted only by the request the plain path would admit: anything
            # else is released and admitted the ordinary way, which answers exactly as
            # without guesses (the checks in the plain path's order: lifecycle, §6.3 and
            # caller checks, deadline, token budget, then KV: the job before committed and
            # the sequence is not Unknown, else kv.sequence_busy / kv.sequence_unknown).
            ok = (self._admitting and not self._stopping
                  and entry.matches(job, request, logits_out)
                  and self.clock.monotonic() < request.deadline)  # else: admission answers
            if ok:
                ok = (check_request(request, gen.contracts).ok and _check_caller_arguments(
                    request, logits_out, gen.contracts.vocab_size).ok)
            # the guess already holds the request's one token of budget
            ok = ok and not dispatch.over_budget(0, self._token_budget())
            ok = ok and gen.kvc.is_open(job.txn)
            if not ok:
                self._auto_release([job], "released: another request came")
                return None
            job.request = request
            job.deadline = request.deadline
            job.uncounted = False
            job.auto_next = True
            job.early_wake_s = self._early_wake_s()  # as of now, not of the arming
            self._bump("auto_prearmed")
            handle = JobHandle(job)
            if on_created is not None:
                try:
                    on_created(handle)
                except BaseException as exc:  # the caller's callback: it raises to the caller,
                    self._fail_before_submit(job, Status.internal(  # as on the ordinary path
                        "on_created_raised", Phase.ADMISSION, f"on_created raised "
                        f"{type(exc).__name__}: {exc}", **job.ctx()))
                    raise
            status = dispatch.queue_fired(job, int(request.tokens[0]), self.gen)
            if status is not None:
                return self._fail_before_submit(job, status)
            return handle
        finally:
            dispatch.exit(gen)

    def _prewake_at(self, now: float) -> float | None:
        """When the submitter's idle wait should end early (the submitter's own; no lock):
        the decode job on the device is expected to end ``tuning.prewake_s`` after that;
        once per job. None: nothing on the device, its end unknown or too near."""
        try:  # a deque read: no completion_mu here (the completion thread may pop it
            head = self._completion_q[0]  # between a length check and the index)
        except IndexError:
            head = None
        if (head is None or head.job_id == self._prewoken or not head.submitted_at
                or head.kind != TaskKind.DECODE or self._decode_exec_us <= 0):
            return None
        prewake = self._tuning.prewake_s
        early = head.submitted_at + self._decode_exec_us / 1e6 - prewake - now
        if early < prewake:
            return None
        self._prewoken = head.job_id
        return now + early

    def _unsubmittable(self, job: Job, now: float) -> Status | None:
        """Why a queued or armed job can no longer be submitted, or None (a pure check,
        called by the dispatch under its lock)."""
        refusal = self.dispatch.refusal
        if refusal is not None:
            return refusal.with_context(**job.ctx())
        if job.cancel_flag:
            return Status.cancelled(Phase.SUBMIT, **job.ctx())
        if now >= job.deadline:
            return Status.deadline(Phase.SUBMIT, "queue deadline passed before infer()",
                                   **job.ctx())
        gen = job.gen
        if gen is None or gen is not self.gen or gen.closing:
            return Status.unavailable(Phase.SUBMIT, f"generation {job.generation_id} retired "
                                      "before submit; retry", **job.ctx())
        return None

    # ---- armed jobs: what DecodeStream and AutoArm use (not an embedder's API) --------------
    def admit_armed(self, request: InferenceRequest, logits_out: np.ndarray | None,
                    arm: Arm) -> Job:
        """Admit and prepare ``request``'s job up to Preparing and keep it armed (``arm``:
        chained behind its predecessor's KV txn, waiting or not): the ordinary admission
        path stopping before Queued. The job (resolved with why when nothing was armed)."""
        return job_of(self._enqueue(request, internal=False, logits_out=logits_out, arm=arm))

    @property
    def expected_decode_s(self) -> float:
        """A decode job's device time as the completion thread measures it (moving
        average; 0 before the first)."""
        return self._decode_exec_us / 1e6

    def fire_armed(self, job: Job, token: int, rearm: Any = None,
                   arm_delay_s: float = 0.0) -> JobHandle | None:
        """A pre-armed decode job gets its token and joins the submit queue: the token id is
        written into the leased slot's input and the request, the chart goes Preparing ->
        Queued, the submitter is woken (``Dispatch.fire``). ``rearm``: the armer whose next
        job the submitter arms ``arm_delay_s`` from now. None when the job was not armed any
        more: someone released it (cancelled, expired, fenced, reclaimed for a request short
        of a slot or budget); it was a guess, and the caller admits its step the ordinary
        way."""
        at = self.clock.monotonic() + arm_delay_s if arm_delay_s > 0 else 0.0
        owned, status = self.dispatch.fire(job, token, self.gen, rearm, at)
        if not owned:
            return None
        if status is not None:
            return self._fail_before_submit(job, status)
        return JobHandle(job)

    def release_armed(self, job: Job, status: Status) -> bool:
        """Release a pre-armed job that will not get a token (its stream closed): lease,
        KV txn rolled back, budget, chart Failed, exactly once (False when someone else
        owned it already). Not counted: nobody asked for it."""
        if not self.dispatch.take_armed(job):
            return False
        self._fail_before_submit(job, status.with_context(**job.ctx()))
        return True

    def arm_delay_s(self) -> float:
        """How long after a step's infer the submitter arms the next one (``_arm_delay_s``)."""
        return self._arm_delay_s()

    def _submit(self, job: Job) -> None:
        gen, slot = job.gen, job.lease.slot
        gen.pool.mark_in_flight(job.lease)
        self.infer_threads.add(threading.current_thread().name)
        rc = self._infer(gen, slot, job.request.seq_id)
        attempt = 0
        while rc == CalrtCode.DEVICE_BUSY and attempt < self.config.recovery.submit_retries:
            # §8 Transient row: the runtime did not run the graph; bounded retry with backoff.
            attempt += 1
            self._bump("submit_retries")
            self.clock.sleep(getattr(self.faults, "backoff", lambda a: 0.001)(attempt))
            rc = self._infer(gen, slot, job.request.seq_id)
        if rc != CalrtCode.SUCCESS:
            # FI05: the runtime did not take the job: software rollback, no Wait.
            gen.pool.device_done(job.lease)
            self._release_permit(job)
            status = Status.from_calrt(rc, Phase.SUBMIT, "infer", **job.ctx())
            self._fail_before_submit(job, status)
            return
        job.timings.submitted_us = self.clock.now_us()
        job.submitted_at = self.clock.monotonic()  # the §9.1 execution deadline's start
        job.run.send(JOB_EV_INFER_ACCEPTED)
        gen.kvc.mark_submitted(job.txn, evidence=job)
        self._bump("submitted")
        with self._completion_cv:
            self._completion_q.append(job)
            self._completion_cv.notify()

    def _infer(self, gen: Generation, slot, seq_id: int) -> int:
        """Phase A: infer(); Phase B: infer_with_fixed_task_type on the slot's PING/PONG
        (plain infer() while ``fixed_engine`` is switched off)."""
        if slot.engine == EngineSlot.AUTO or self.feature_disabled("fixed_engine"):
            return self.device.infer(slot.model, gen.kv, seq_id, slot.inbuf, slot.outbuf)
        return self.device.infer_with_fixed_task_type(slot.model, gen.kv, seq_id, slot.inbuf,
                                                      slot.outbuf, int(slot.engine))

    # ---- §8 PROGRAMMING: switch the feature off until the next generation ------------------------
    def feature_disabled(self, name: str) -> bool:
        """Whether FEATURES ``name`` is off for the current generation."""
        gen = self.gen
        return gen is not None and self._features_off.get(name) == gen.id

    def _effective_capacity(self) -> int:
        if self._features_off and self.feature_disabled("fixed_engine"):
            return 1
        return self.dispatch.capacity

    def disable_feature(self, status: Status, job: Job | None = None) -> str | None:
        """Called by the fault controller for a PROGRAMMING fault: switch off the feature the
        failed call used, for this generation (generation+1 turns it on again). Returns the
        feature, or None when the call was on a mandatory path (nothing to switch off)."""
        gen = self.gen
        # Phase B slots are all PING/PONG (``_open``): an infer failure there came from
        # infer_with_fixed_task_type unless that path is already off
        feature = ("fixed_engine" if status.phase is Phase.SUBMIT
                   and self.config.inflight_capacity == 2
                   and not self.feature_disabled("fixed_engine") else None)
        if feature is None or gen is None:
            log.warning("PROGRAMMING fault %s on a mandatory path: nothing to switch off", status)
            return None
        # one dict store (atomic); no lock: it only lowers the capacity, so no waiter needs waking
        self._features_off[feature] = gen.id
        log.warning("feature %s switched off until generation %d (%s): %s", feature, gen.id + 1,
                    FEATURES[feature], status)
        return feature

    def _release_permit(self, job: Job) -> None:
        self.dispatch.release_permit(job)

    # ---- completion (§6.5) -----------------------------------------------------------------------
    def complete_one(self, block: bool = False) -> bool:
        """Wait for the oldest submitted job and finish it. False when none is submitted."""
        with self._completion_cv:
            while not self._completion_q:
                if not block or self._stopping_threads:
                    return False
                self.clock.wait(self._completion_cv, None)  # idle: a submit or shutdown ends it
            job = self._completion_q[0]
        self._holding["calexec-completion"] = job  # the barrier resolves it if _complete raises
        try:
            self._complete(job)
        finally:
            with self._completion_cv:
                if self._completion_q and self._completion_q[0] is job:
                    self._completion_q.popleft()
            self._waiting_on = None
        self._holding["calexec-completion"] = None
        return True

    @property
    def stopping(self) -> bool:
        """``shutdown`` began (admission stopped for good)."""
        return self._stopping

    @property
    def completing(self) -> int:
        """Jobs submitted and not completed yet (no lock: a length)."""
        return len(self._completion_q)

    def execution_deadline(self, job: Job) -> float:
        """The §9.1 execution deadline of a submitted ``job`` (Clock.monotonic())."""
        return self._execution_deadline(job)

    def _execution_deadline(self, job: Job) -> float:
        cfg = self.config
        return (job.submitted_at + cfg.execution_timeout_s
                + cfg.execution_timeout_per_token_s * job.request.token_count)

    def _complete(self, job: Job) -> None:
        slot = job.lease.slot
        outbuf = slot.outbuf
        # §5.2: no executor lock across Wait(). recovery_mu is exempt: only a recovery holds
        # it, and in stepped mode that recovery drives this very call (the job path never
        # takes recovery_mu, so holding it cannot block a job).
        held = [n for n in self.locks.held_by_current_thread() if n != "recovery_mu"]
        if self.locks.checking and held:
            self.locks.violations.append(f"Wait() called holding {tuple(held)}")
        self.wait_threads.add(threading.current_thread().name)
        t0 = self.clock.now_us()
        self._waiting_on = job
        # One Wait() bounded by the §9.1 execution deadline; no lock is held here.
        remaining_us = int((self._execution_deadline(job) - self.clock.monotonic()) * 1e6)
        rc = outbuf.wait(max(0, remaining_us))
        slot.runtime_answer = answer = outbuf.get_status()  # the runtime's answer, for guards
        device_status = answer[1]
        job.timings.completed_us = self.clock.now_us()
        job.timings.device_wait_ms = (job.timings.completed_us - t0) / 1000.0
        if job.kind == TaskKind.DECODE and rc == CalrtCode.SUCCESS:
            spent = job.timings.completed_us - job.timings.submitted_us
            self._decode_exec_us += (spent - self._decode_exec_us) * (
                0.25 if self._decode_exec_us else 1.0)
        job.wait_rc, job.device_status = rc, device_status
        if job.cancel_flag and job.run.state == JOB_SUBMITTED:
            job.run.send(JOB_EV_CANCEL)
        if rc != CalrtCode.SUCCESS and device_status in (DeviceJobStatus.PENDING,
                                                         DeviceJobStatus.RUNNING):
            self._runtime_still_holds(job, slot, rc)
            return
        target = job.run.send(JOB_EV_WAIT_RETURNED)
        if target == JOB_QUARANTINED:
            status = (Status.from_calrt(rc, Phase.WAIT, "Wait", **job.ctx()) if rc != 0 else
                      Status.from_device_status(device_status, **job.ctx()))
            self._quarantine_after_submit(job, status, release_permit=slot.runtime_let_go())
            return
        t1 = self.clock.now_us()
        copy_ms = outbuf.copy_ms() if hasattr(outbuf, "copy_ms") else None
        if copy_ms is not None:  # measured by the device (the emulator); the host cannot
            job.timings.h2d_ms, job.timings.d2h_ms = copy_ms
        result = self._postprocess(job)
        job.timings.postprocess_ms = (self.clock.now_us() - t1) / 1000.0
        if isinstance(result, Status):
            job.output_status = result
            if target == JOB_COMPLETING:
                job.run.send(JOB_EV_FAULT)
            self._quarantine_after_submit(job, result, release_permit=True)
            return
        # §6.5 order: KV commit -> reset slices -> deliver -> release the lease.
        job.output_status = Status.OK
        if not job.gen.kvc.settle(job.txn, "commit refused"):  # the chart's guard decides
            status = Status.internal("kv_commit_refused", Phase.OUTPUT_CHECK, "the KV "
                                     "transaction's guard refused the commit", **job.ctx())
            if target == JOB_COMPLETING:
                job.run.send(JOB_EV_FAULT)
            self._quarantine_after_submit(job, status, release_permit=True, settled=True)
            return
        undo = slot.undo_slices()
        # Wait returned and GetStatus said done: the device is free, so the in-flight permit
        # and the token budget go back before the caller is woken (issue 17, A/B measured:
        # the caller's next job finds its permit free; the lease still goes back after)
        self._release_budget(job)
        self._release_permit(job)
        stream, job.stream = job.stream, None
        if stream is not None and target == JOB_COMPLETING and not job.cancel_flag:
            ran_us = job.timings.completed_us - job.timings.submitted_us
            tuning = self._tuning
            slow = self.config.threads and ran_us >= tuning.ahead_yield_min_us
            fired = stream.fire_ahead(  # greedy ahead (machines/stream.py)
                job, result, min(tuning.ahead_arm_delay_s, ran_us / 4e6) if slow else 0.0)
            if fired is not None and slow:
                self._until_submitted(job_of(fired))
        if target == JOB_COMPLETING and not self._advance(job, JOB_EV_DELIVER):
            target = JOB_CANCEL_REQUESTED
        if target != JOB_COMPLETING:  # cancelled after submit (FI12): result discarded
            if job.run.state == JOB_CANCEL_REQUESTED:
                job.run.send(JOB_EV_FAIL)
            self._bump("cancelled")
            job.resolve(Status.cancelled(
                Phase.CANCEL, "cancelled after submit: Wait completed, result discarded",
                **job.ctx()))
        else:
            self._bump("succeeded" if job.gen is self.gen else "stale_completions")
            job.resolve(result)
        job.gen.pool.device_done(job.lease)
        released = job.lease.release()
        self.dispatch.lease_returned()  # a pre-arm that missed a slot: tried again
        for problem in (undo, released):
            if not problem.ok:  # FI15: slot quarantined by the pool; the job's result stands
                self.faults.report(problem.with_context(**job.ctx()), job)
                self._check_pool(job)

    def _until_submitted(self, job: Job) -> None:
        """Greedy ahead: the completion thread just queued ``job`` (the next step of a
        stream) and gets out of the submitter's way, its own GIL-holding work (delivering the
        job before, which also wakes that job's caller) waiting until ``job`` is on the device
        or failed, bounded by ``tuning.ahead_yield_s`` (A/B measured, docs/benchmarks.md: without
        it the submitter's wake-up waited for the GIL behind that work)."""
        end = self.clock.monotonic() + self._tuning.ahead_yield_s
        with self._completion_cv:
            while not (job.done or job.submitted_at or self._stopping_threads):
                remaining = end - self.clock.monotonic()
                if remaining <= 0:
                    return
                self.clock.wait(self._completion_cv, remaining)

    def _runtime_still_holds(self, job: Job, slot, rc: int) -> None:
        """Wait() failed (timeout, FI07) while the runtime still runs the job (§9.1).

        The job fails now (Quarantined: no logits, KV Unknown) but its buffers stay with the
        runtime: the slot is quarantined and its host storage stays mapped, and the in-flight
        permit stays held until the device lets go (``_reap_held``). If it has not after
        ``timeout_grace_s``, ``device.hung`` is reported: the recovery resets the device (or,
        with no safe reset, the lifecycle ends Failed). In Phase A the completion thread waits
        that grace itself (no other job can be in flight meanwhile); in Phase B it goes on at
        once and the submitter reaps (every 50 ms), so the other job's completion is never
        held up by one the device keeps (found by the explorer in Phase B)."""
        if self.clock.monotonic() >= self._execution_deadline(job):
            status = Status.failure("execution.deadline", Category.DEVICE, Phase.WAIT,
                                    "execution deadline passed; buffers kept until the device "
                                    "lets go or a reset", raw=rc, **job.ctx())
        else:
            status = Status.from_calrt(rc, Phase.WAIT, "Wait failed while the job is still on "
                                       "the device; buffers kept", **job.ctx())
        job.run.send(JOB_EV_EXECUTION_TIMEOUT)
        self._quarantine_after_submit(job, status, release_permit=False, on_device=True)
        self._hold(job, slot)
        if self._effective_capacity() == 1:
            # nothing else can be on the device while this job keeps its permit: the
            # completion thread may as well wait the grace for the device to let go (a
            # prompt release of the sequence); with two in flight it must not (the other
            # job's completion would wait behind it), and the submitter reaps it
            slot.outbuf.wait(int(self.config.timeout_grace_s * 1e6))
        self._reap_held()  # let go: permit back; still held after the grace: device.hung

    def _hold(self, job: Job, slot) -> None:
        """The runtime keeps ``job``'s buffers and permit after a failed Wait: reaped when it
        lets go, reported hung after the grace (``_reap_held``)."""
        self.dispatch.hold(Held(slot, job.gen.kvc, job.request.seq_id, job,
                                self.clock.monotonic() + self.config.timeout_grace_s))

    def _reap_held(self, report: bool = True) -> bool:
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

    def _postprocess(self, job: Job) -> "InferenceResult | Status":
        """Output size (FI09), finiteness (FI10), then the direct conversion (§10.1) and the
        argmax: fused in one native pass when the runtime offers it (``self._fused_logits``,
        drivers/native.py; GIL released), else the numpy path. Same bits, same argmax."""
        request, slot, sm = job.request, job.lease.slot, job.submodel
        vocab = job.gen.contracts.vocab_size
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
        # the caller's array is written only by a job whose result it will take: a job
        # cancelled after submit (FI12: result discarded) is checked into a row of its own
        # (its KV commit still needs the output check). A cancel that comes after this line
        # finds the caller's row written, but its result is discarded all the same.
        dst = job.logits_out
        if dst is None or job.cancel_flag:
            dst = np.empty(count, np.float32)
        fused = self._fused_logits
        if fused is not None:
            rc = fused(slot.host_output, base, count, dst)
            if rc == fused.NONFINITE:  # dst is partly written: not a result
                return Status.internal("output_not_finite", Phase.OUTPUT_CHECK,
                                       f"NaN/Inf in logits row {row} [{first}, {first + count}) "
                                       f"at index {first + fused.first_nonfinite}", **job.ctx())
            if rc != 0:  # §10.1 bounds or a short destination, refused before any access
                return Status.internal("logits_slice", Phase.OUTPUT_CHECK,
                                       f"logits slice base={base} n={count} refused ({rc}: "
                                       f"{fused.RC_NAMES.get(rc)}) for an output of "
                                       f"{slot.host_output.shape[0]} elements and a "
                                       f"destination of {dst.shape[0]}", **job.ctx())
            argmax = fused.argmax
        else:
            src = slot.host_output[base:base + count]
            if not bf16_all_finite(src, slot.scratch):
                return Status.internal("output_not_finite", Phase.OUTPUT_CHECK,
                                       f"NaN/Inf in logits row {row} [{first}, {first + count})",
                                       **job.ctx())
            bf16_to_f32_into(slot.host_output, base, count, dst)
            argmax = int(np.argmax(dst[:count]))
        return InferenceResult(job_id=job.job_id, seq_id=request.seq_id,
                               generation=job.generation_id, kind=job.kind, logits=dst[:count],
                               argmax=argmax, kv_len=job.txn.target_len,
                               timings=job.timings)

    def _quarantine_after_submit(self, job: Job, status: Status, release_permit: bool,
                                 on_device: bool = False, settled: bool = False) -> None:
        """§6.5 failure after submit: the KV txn is settled by its chart (the commit guard
        reads the runtime's answers and the output check: here it refuses, so the sequence
        is Unknown), slot quarantined, report. ``on_device``: the runtime still runs the job;
        its sequence cannot be reset until the runtime lets go (``_reap_held``)."""
        if not settled:
            job.gen.kvc.settle(job.txn, status.code, on_device=on_device)
        job.gen.pool.quarantine(job.lease, status.code)
        self._release_budget(job)
        self._bump("quarantined")
        if self.config.inflight_capacity == 2:
            self._downgrade(status)
        # first the controller: admission stops before the next job gets the permit and
        # before the caller sees the failure
        self.faults.report(status, job)
        self._check_pool(job)
        if release_permit:
            self._release_permit(job)
        elif on_device:
            job.permit_held = False  # the dispatch's held entry owns the permit now
        job.resolve(status)

    def _check_pool(self, job: Job) -> None:
        """Quarantined slots come back only through a reset (invariant 8). When a task kind
        has none left, the generation cannot serve that kind: ask for reset + generation+1
        (a transient fault would otherwise leave the executor Ready but unable to serve)."""
        gen = job.gen
        if gen is not None and gen is self.gen and gen.pool.usable(job.kind) == 0:
            self.faults.report(Status.failure(
                "pool.exhausted", Category.DEVICE, Phase.RELEASE,
                f"every {job.kind.name} buffer slot of generation {gen.id} is quarantined; "
                "a reset and generation+1 rebuild the pool", generation=gen.id), job)

    # ---- threads ---------------------------------------------------------------------------------
    _stopping_threads = False

    def _start_threads(self) -> None:
        self._stopping_threads = False
        self.dispatch.stop(False)
        for name, step in (("calexec-submitter", self.submit_one),
                           ("calexec-completion", self.complete_one)):
            self._holding[name] = None
            self._threads.append(self.clock.start_thread(self._loop, name, (name, step)))

    def _loop(self, name: str, step: Callable[..., bool]) -> None:
        """The barrier every executor thread runs under: an unexpected exception is an
        INTERNAL fault (the job the thread held is resolved with it, the fault controller
        rebuilds the generation), never a dead thread."""
        while True:
            try:
                if not step(block=True):
                    return
            except Exception as exc:  # noqa: BLE001 - the barrier
                self._thread_fault(name, exc)
                if self._stopping_threads:
                    return

    def _thread_fault(self, name: str, exc: BaseException) -> None:
        job = self._holding.get(name)
        self._holding[name] = None
        status = Status.internal("thread_exception", Phase.SUBMIT if "submit" in name
                                 else Phase.WAIT, f"{name} raised {type(exc).__name__}: {exc}",
                                 **(job.ctx() if job is not None else {}))
        log.error("executor thread %s caught %s (job %s); reported as a fault", name,
                  status, None if job is None else job.job_id, exc_info=exc)
        self.thread_faults.append({"thread": name, "error": f"{type(exc).__name__}: {exc}",
                                   "job": None if job is None else job.job_id,
                                   "at": self.clock.monotonic()})
        abandon = job is not None and not job.done
        if abandon:
            self._abandon_after_submit(job, status)
        try:  # first the controller: admission stops before the caller sees the failure
            self.faults.report(status, job)
        except Exception:  # noqa: BLE001 - a failing fault sink must not kill the barrier
            log.exception("fault sink raised while reporting %s", status)
            self._fail(status)
        if abandon:
            self._count(status)
            job.resolve(status)

    def _abandon_after_submit(self, job: Job, status: Status) -> None:
        """A thread raised holding ``job`` at an unknown point: assume the runtime may still
        use its buffers (slot quarantined, KV Unknown, permit held until the runtime lets go,
        like a failed Wait). The caller resolves the job once the fault is reported."""
        lease = job.lease
        submitted = job.timings.submitted_us > 0
        on_device = submitted and job.wait_rc is None
        for step in (lambda: job.txn is not None and not job.txn.run.final
                     and job.gen.kvc.mark_unknown(job.txn, status.code, on_device=on_device),
                     lambda: lease is not None and lease.held
                     and job.gen.pool.quarantine(lease, status.code)):
            try:
                step()
            except Exception:  # noqa: BLE001 - best effort; the recovery rebuilds
                log.exception("abandoning job %d", job.job_id)
        self._release_budget(job)
        if job.permit_held:
            if submitted and job.wait_rc is None and lease is not None:
                # the runtime may still run it: the permit goes back when it lets go
                job.permit_held = False
                self._hold(job, lease.slot)
            else:
                self._release_permit(job)

    def threads_alive(self) -> dict[str, bool]:
        return {t.name: t.is_alive() for t in self._threads}

    def health(self) -> list[str]:
        """Why the executor cannot serve now (empty: it can). Part of readiness: a dead
        executor thread, a job on the device past its deadline, buffers the device has not
        let go of, a lifecycle that is not Ready."""
        reasons = []
        state = self.lifecycle.state
        if state != LIFECYCLE_READY or not self._admitting:
            reasons.append(f"lifecycle is {state}" + ("" if self._admitting else
                                                     ", not admitting"))
            if self.failure is not None and state == LIFECYCLE_FAILED:
                reasons.append(f"failed: {self.failure}")
        if self.config.threads and not self._stopping:
            for name, alive in self.threads_alive().items():
                if not alive:
                    reasons.append(f"executor thread {name} is not running")
        job = self._waiting_on
        if job is not None and not job.done:
            now = self.clock.monotonic()
            late = now - min(self._execution_deadline(job),
                             job.deadline + self.config.stall_after_s)
            if late >= 0:
                reasons.append(f"job {job.job_id} (seq {job.request.seq_id}) is on the device "
                               f"{now - job.deadline:.3f}s past its deadline")
        held = len(self.dispatch.held())
        if held:
            reasons.append(f"the device has not let go of {held} failed job(s)")
        return reasons

    def _stop_threads(self) -> None:
        self._stopping_threads = True
        self.dispatch.stop()
        with self._completion_cv:
            self._completion_cv.notify_all()
        for thread in self._threads:
            thread.join(timeout=5.0)
        self._threads = [t for t in self._threads if t.is_alive()]

    # ---- shutdown (FI13) ---------------------------------------------------------------------------
    def shutdown(self, grace: float = 10.0) -> Status:
        """Stop admission, cancel queued jobs, drain submitted ones within ``grace`` seconds,
        stop the threads, release the generation and the device. Ends Stopped when drained
        (FI13), Failed otherwise. Idempotent.

        A recovery or model switch in progress (the controller's thread, or a caller's
        ``recover``/``switch_model``) ends first: it gets half of ``grace`` to finish on its own
        (a switch then goes live and shutdown ends Stopped); then admission (golden runs
        included) stops and queued jobs are cancelled, so it ends quickly (Failed, if it had
        already torn the old generation down). Shutdown holds ``recovery_mu`` from then on,
        so no recovery runs under its teardown (a later one finds the executor stopping and
        does nothing). If it still runs after ``grace`` nothing is torn down and
        ``shutdown.recovery_busy`` is returned."""
        if self._recovery_owner == threading.get_ident():
            return self._shutdown(grace)  # called from within a recovery: it holds the lock
        start = self.clock.monotonic()
        end, left = start + max(grace, 0.0), lambda until: max(0.0, until - self.clock.monotonic())
        halfway = start + max(grace, 0.0) / 2
        recovery = self._recovery_thread
        if recovery is not None and recovery is not threading.current_thread():
            recovery.join(left(halfway))
        if not self._recovery_mu.acquire(timeout=left(halfway)):
            self._interrupt()  # the recovery still runs: make it end
            if not self._recovery_mu.acquire(timeout=left(end)):
                return Status.failure(
                    "shutdown.recovery_busy", Category.LIFECYCLE, Phase.SHUTDOWN,
                    f"a recovery or model switch still runs after grace={grace}s; nothing "
                    "was torn down")
        try:
            return self._shutdown(grace)
        finally:
            self._recovery_mu.release()

    def _interrupt(self) -> None:
        """Stop admission (golden runs included) and cancel queued jobs: what a recovery in
        progress waits for ends at once."""
        with self.lifecycle_mu:
            self._stopping = True
            self._admitting = False
        self.dispatch.cancel_pending()
        self._wake_waiters()

    def _shutdown(self, grace: float) -> Status:
        with self.lifecycle_mu:
            already_final = self.lifecycle.final
            self._stopping = True
            self._admitting = False
            if self.lifecycle.state == LIFECYCLE_READY:
                self.lifecycle.send(LIFECYCLE_EV_DRAIN)
            self._ready_cv.notify_all()
        if self.gen is not None:
            self.gen.kvc.close()
        self.dispatch.cancel_pending()
        self._wake_waiters()
        if self.gen is not None:  # no request thread works on it past this point
            self._fence(self.gen, min(grace, self.config.fence_grace_s))
        if not self.config.threads:
            while self.submit_one():
                pass
        drained = self._drain(grace)
        self._stop_threads()
        with self.lifecycle_mu:
            if drained and self.lifecycle.can(LIFECYCLE_EV_STOP):
                self.lifecycle.send(LIFECYCLE_EV_STOP)
            elif not self.lifecycle.final:
                self.lifecycle.send(LIFECYCLE_EV_FAIL)
                self.failure = Status.failure(
                    "shutdown.not_drained", Category.DEVICE, Phase.SHUTDOWN,
                    f"submitted work did not drain within grace={grace}s")
        if self.device is None or (already_final and self.gen is None):
            return self.failure or self.start_status or Status.OK
        if not drained:
            # the runtime may still DMA into our buffers: keep everything mapped and alive
            return self.failure
        if self.gen is not None:
            self.gen.release(self.device)
            self._retire(self.gen)
            self.gen = None
        self.device.close()
        return Status.OK if self.lifecycle.state == LIFECYCLE_STOPPED else self.failure

    # ---- synchronous compatibility entry (§6.1) -------------------------------------------------
    def decode_sync(self, request: InferenceRequest, logits_out: np.ndarray | None = None
                    ) -> tuple[int, "InferenceResult | Status"]:
        """``llama_decode``-style: (int code, result or Status). Logs every failure with
        job_id, seq_id, generation, raw CalRT code and phase. ``logits_out`` as for
        ``enqueue`` (a llama context's own logits row: no allocation per token)."""
        handle = self.enqueue(request, logits_out=logits_out)
        if not self.config.threads:
            while not handle.done and (self.submit_one() or self.complete_one()):
                pass
        result = handle.wait_until(request.deadline)
        if not handle.done:  # the caller gets an error now: nobody takes this result, so
            handle.cancel()  # the job must not write its logits_out later (FI12)
        if isinstance(result, Status):
            code = llama_decode_code(result)
            log.warning("decode_sync failed: code=%d job_id=%s seq_id=%s generation=%s raw=%s "
                        "phase=%s status=%s", code, result.job_id, result.seq_id,
                        result.generation, result.raw,
                        None if result.phase is None else result.phase.value, result)
            return code, result
        return 0, result

    # ---- pre-armed decode stream (machines/stream.py) ------------------------------------------
    def decode_stream(self, seq_id: int, past_len: int, deadline: float,
                      logits_out: np.ndarray | None = None,
                      want_logits: tuple[int, int] | None = None, max_len: int | None = None,
                      request_id: int = 0, greedy_ahead: bool = False,
                      stop_tokens: Any = (), max_steps: int | None = None) -> "DecodeStream":
        """Decode steps of ``seq_id`` from ``past_len`` (its committed length) with the next
        job pre-armed while the current one runs: ``stream.step(token)`` per token. Every job
        has ``deadline`` (absolute ``time.monotonic()``); ``max_len``: the stream never arms
        a job beyond this sequence length (prompt + max_tokens). The first job is armed now
        if its resources are free. ``greedy_ahead``: the completion thread fires each next job
        with the argmax of the one before (not after one of ``stop_tokens``, nor beyond
        ``max_steps`` jobs); the caller still calls ``step(result.argmax)``. See
        machines/stream.py."""
        from calexec.machines.stream import DecodeStream
        self._drop_armed(seq_id)  # the stream arms its own
        stream = DecodeStream(self, seq_id, past_len, deadline, logits_out, want_logits,
                              max_len, request_id, greedy_ahead, stop_tokens, max_steps)
        if not stream.closed:
            self.dispatch.open_stream(seq_id, stream)  # (``_drop_armed``: its step ahead)
        return stream

    # ---- observability ---------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        dispatch = self.dispatch.snapshot()
        pool = self.pool
        return {
            "lifecycle": self.lifecycle.state,
            "generation": None if self.gen is None else self.gen.id,
            "queued": dispatch["queued"],
            "completing": len(self._completion_q),  # submitted, not completed yet
            "inflight": dispatch["inflight"],
            "inflight_capacity": self._effective_capacity(),
            "disabled_features": sorted(f for f in self._features_off if self.feature_disabled(f)),
            "downgrades": len(self.downgrades),
            "pending_tokens": dispatch["pending_tokens"],
            # implicit pre-arms holding a slot and a token of budget (machines/autoarm.py)
            "auto_armed": dispatch["auto_armed"],
            # the dispatch state (machines/dispatch.py), for tests and the explorer
            "dispatch": dispatch,
            "slots": None if pool is None else pool.counts(),
            "recoveries": len(self.recoveries),
            "golden": self.golden_source,
            "allow_unpinned_golden": self.config.allow_unpinned_golden,
            "thread_faults": len(self.thread_faults),
            "waiting_for_ready": self._ready_waiters,
            "retired_generations_kept": len(self._retired),
            **self.counters,
        }
