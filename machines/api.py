"""The executor's public surface for an embedder, as typed protocols (issue 25; docs/embedding.md).

``InferenceExecutor`` lists exactly what a server of the embedder's own may call on a
``DeviceExecutor`` (machines/executor.py): ``start``, ``enqueue``, ``decode_sync``,
``decode_stream``, ``release_sequence``, ``health``, ``snapshot``, ``shutdown``, and the read-only
``state`` and ``failure``. ``CompletionHandle`` is what ``enqueue`` returns (``JobHandle``,
machines/job.py), ``DecodeSteps`` what ``decode_stream`` returns (``DecodeStream``,
machines/stream.py), ``ExecutorSnapshot`` the keys of ``snapshot()``. Anything else on those
classes (``_``-prefixed or not: ``submit_one``, ``recover``, ``switch_model``, ``gen``, ``kvc``,
``job_trail``, ...) is the executor's own, for its tools and tests, and may change.
``tests/test_embedding.py`` compares every member's signature with the classes', so a drift of
either side fails CI.

Errors are values. Every runtime, device, admission or request failure comes back as a
``Status`` (contracts/status.py: ``code``, ``category``, ``phase``, ``raw`` CalRT code, ``message``,
job context; ``http_status`` / ``grpc_code`` give the §8 service mapping, ``llama_decode_code``
the llama.cpp int). None of these methods raises for them. What does raise is a caller bug that
no Status can describe: building an ``InferenceRequest`` with wrong types (``TypeError`` /
``ValueError`` from its converters), calling ``start`` twice, and an exception the embedder's
own callback raises on its own thread (a done callback's exception is logged, never raised).

Threads (docs/architecture.md "Threads, locks and generations"):

* the **request thread** is whichever thread of the embedder calls a method; ``enqueue``,
  ``decode_stream`` and a stream's ``submit``/``step``/``close`` run admission on it and may block
  it, bounded by the request's deadline (KV or buffer slot short) or a short internal bound;
* ``calexec-submitter`` calls ``infer`` (and arms a stream's next job), ``calexec-completion``
  calls ``Wait``, post-processes and resolves the job, ``calexec-recovery`` (started on demand)
  rebuilds the device after a fault: none of them ever runs embedder code except the done
  callbacks (``CompletionHandle.add_done_callback``), which must not block;
* what may block an asyncio loop, and so belongs in a worker thread of the embedder's: ``start``
  (golden run), ``enqueue``, ``decode_stream``, a stream's ``submit``/``step``/``wait``/``close``,
  ``decode_sync``, ``release_sequence`` with ``wait_s > 0``, ``shutdown``, and ``wait_until``.
  ``health``, ``snapshot``, ``state``, ``cancel``, ``add_done_callback``, ``as_future`` and
  ``wait_async`` never block (they take an executor lock for a few microseconds at most).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection
from typing import Literal, NotRequired, Protocol, TypedDict, get_args, runtime_checkable

import numpy as np

from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import JobTimings
from calexec.machines.job import InferenceResult

#: The device lifecycle's states (machines/charts.py ``LifecycleChart``), what ``state`` reads.
#: Ready admits work; Draining/Recovering/Configuring/Warming are a recovery or model switch in
#: progress (requests get UNAVAILABLE: retry); Stopped is a clean shutdown's end (everything
#: drained, device closed); Failed is final (``failure`` says why: the process should exit so
#: its supervisor restarts it).
LifecycleState = Literal["Configuring", "Warming", "Ready", "Draining", "Recovering", "Failed",
                         "Stopped"]
LIFECYCLE_STATES: tuple[str, ...] = get_args(LifecycleState)


class DispatchSnapshot(TypedDict):
    """``Dispatch.snapshot()`` (machines/dispatch.py): the dispatch state's counts, read under
    its lock; ``ExecutorSnapshot.dispatch``."""

    queued: int  #: jobs waiting for the submitter
    inflight: int  #: jobs on the device
    pending_tokens: int  #: admission token budget in use
    armed: int  #: pre-armed jobs (streams' next steps and implicit pre-arms)
    auto_armed: int  #: implicit pre-arms holding a job
    guesses: int  #: implicit pre-arms (with or without a job)
    to_arm: int  #: streams waiting for their next job to be armed
    arm_later: int  #: arms put off by the arming delay
    arming: bool  #: the submitter is arming one now
    held_by_runtime: int  #: slots the runtime still holds after a failed job
    handing_off: int  #: jobs between the queue and ``infer``
    relayed: int  #: jobs handed to the native relay and not reported yet
    refusing: bool  #: queued work is refused (a drain, recovery or shutdown)


class RecoveryRecord(TypedDict):
    """One recovery or model switch (``DeviceExecutor.recoveries``, machines/
    device_lifecycle.py ``recover``)."""

    reason: str  #: the Status code that asked for it (``model.switch`` for a switch)
    reset: bool  #: whether a device reset was asked for
    from_generation: int | None
    #: the reset that ran (None: none); absent when the recovery stopped before that point
    reset_kind: NotRequired[str | None]
    #: codes of the generations refused on the way (absent when it stopped before configuring)
    refused: NotRequired[list[str]]
    ok: bool
    status: str  #: the outcome's Status code
    seconds: float
    to_generation: int | None
    lifecycle: str  #: the lifecycle state it ended in


class DowngradeRecord(TypedDict):
    """One Phase B downgrade to in-flight capacity 1 (``DeviceExecutor.downgrades``)."""

    at: float  #: the executor clock's ``monotonic()``
    reason: str  #: the Status code of the last failure after submit
    faults_in_window: int


class ThreadFault(TypedDict):
    """An exception an executor thread's barrier caught (``DeviceExecutor.thread_faults``)."""

    thread: str  #: ``calexec-submitter``, ``calexec-completion`` or ``calexec-recovery``
    error: str  #: ``TypeName: message``
    job: int | None  #: the job the thread held (None: none)
    at: float  #: the executor clock's ``monotonic()``


#: One event of a job's chart path (``JobTrail.trail``): taken (``to`` the new state) or
#: refused (``to`` None, ``refused_by`` the guards); ``t`` the executor clock's
#: ``monotonic()``. Spelled as a call because ``from`` is a Python keyword.
TrailStep = TypedDict("TrailStep", {"event": str, "from": str, "to": str | None,
                                    "refused_by": list[str] | None, "t": float})


class JobTrail(TypedDict):
    """What happened to one recent job (``DeviceExecutor.job_trail``)."""

    job_id: int
    seq_id: int
    kind: str  #: ``TaskKind`` name
    generation: int | None
    state: str  #: the job chart's final state
    status: str  #: ``ok`` or the Status code
    trail: list[TrailStep]


class ExecutorSnapshot(TypedDict):
    """``snapshot()``: the executor's gauges and counters (for metrics). Each component's
    figures are read under that component's own lock, not the whole snapshot at one instant.
    What holds in every snapshot (docs/embedding.md, tests/test_leftovers_probe68.py):

    - ``dispatch`` is one moment of the dispatch: ``queued``, ``inflight``, ``pending_tokens``
      (equal to the top-level keys of those names) and ``auto_armed`` <= ``guesses``;
    - ``slots`` counts each buffer slot of the generation once: its values sum to the pool's
      size (``slots_per_kind`` per kind), whatever slots move meanwhile;
    - ``kv_blocks_reserved`` and ``kv_sequences`` are one moment of the KV coordinator, and
      ``kv_blocks_reserved`` <= ``kv_blocks_capacity`` (when there is one);
    - each counter (``submitted``, ``succeeded``, ...) never decreases from one snapshot to
      the next.

    Across components there is no such sum: ``inflight`` counts a job handed to the device
    before its buffer slot moves to ``InFlight`` in ``slots``; ``completing`` (the completion
    thread's) may still count a job the dispatch no longer does; counters and gauges are of
    different moments (``submitted`` minus the resolved counters is no gauge)."""

    lifecycle: str  #: one of ``LIFECYCLE_STATES``
    generation: int | None  #: the current model generation (None between generations)
    queued: int  #: jobs waiting for the submitter
    completing: int  #: jobs submitted and not completed yet
    inflight: int  #: jobs on the device
    inflight_capacity: int  #: 1 (Phase A) or 2 (Phase B, unless downgraded)
    disabled_features: list[str]  #: executor.FEATURES switched off until the next generation
    downgrades: int  #: Phase B -> capacity 1 downgrades so far
    pending_tokens: int  #: admission token budget in use
    auto_armed: int  #: implicit pre-arms holding a slot (machines/autoarm.py)
    #: the dispatch object's own snapshot (machines/dispatch.py: queued, armed, inflight,
    #: capacity, pending tokens, held, streams, guesses, arming), for tests and tools
    dispatch: DispatchSnapshot
    slots: dict[str, int] | None  #: buffer slots per chart state (None before start)
    recoveries: int  #: recoveries and model switches so far
    #: controller recoveries dropped: asked for a generation that a model switch (or another
    #: recovery) had replaced when their turn came (``DeviceLifecycle.run_pending_recovery``),
    #: or asked for once ``shutdown`` began (``DeviceLifecycle.request_recovery``)
    recoveries_dropped: int
    golden: str | None  #: where the generation's golden came from: pinned|config|unpinned
    allow_unpinned_golden: bool
    #: faults reported to the executor's ``FaultController`` by kind, ``(category, code, raw
    #: CalRT code or None, count)`` (``FaultController.reported``; empty with another sink)
    faults_reported: list[tuple[str, str, int | None, int]]
    thread_faults: int  #: exceptions the executor threads' barrier caught (each a fault)
    waiting_for_ready: int  #: requests queued through a recovery (ready_queue_max)
    retired_generations_kept: int  #: released generations whose host memory is still kept
    #: KV blocks the current generation's sequences hold reserved (0 between generations),
    #: and the KvManager's capacity in blocks (None when the runtime does not say or there
    #: is no generation): what a released sequence gives back
    kv_blocks_reserved: int
    kv_blocks_capacity: int | None
    #: the sequence ids holding KV (reserved or committed) in the current generation, sorted:
    #: an id the embedder released is not among them
    kv_sequences: list[int]
    # counters since start
    submitted: int
    succeeded: int
    failed: int
    quarantined: int
    cancelled: int
    stale_completions: int  #: succeeded after their generation was replaced
    submit_retries: int
    auto_prearmed: int
    auto_prearm_released: int
    relay_submitted: int  #: jobs given to infer from the submitter's native relay


@runtime_checkable
class CompletionHandle(Protocol):
    """One job (``JobHandle``). Resolved exactly once with an ``InferenceResult`` or a
    ``Status``; every method is safe from any thread."""

    @property
    def job_id(self) -> int: ...

    @property
    def state(self) -> str:
        """The job's chart state now (machines/charts.py ``JobChart``)."""
        ...

    @property
    def timings(self) -> JobTimings: ...

    @property
    def done(self) -> bool:
        """Resolved (the result is final)."""
        ...

    @property
    def cancel_requested(self) -> bool: ...

    def wait_until(self, deadline: float | None) -> InferenceResult | Status:
        """Block the calling thread until resolved or ``deadline`` (absolute
        ``time.monotonic()``); then a ``wait.deadline`` Status and the job keeps running. On
        the executor's own threads (a done callback) a wait for a job not resolved yet, its
        deadline ahead, raises RuntimeError naming the call and the thread."""
        ...

    def result(self, timeout: float | None = None) -> InferenceResult | Status:
        """``wait_until`` with a relative timeout."""
        ...

    def cancel(self) -> bool:
        """Ask for cancellation (idempotent, never blocks). True when recorded before the job
        was resolved; the job then ends CANCELLED at its owner's next checkpoint, and a job
        already on the device is still waited for (its result discarded, never written to
        ``logits_out`` afterwards)."""
        ...

    def add_done_callback(self, fn: Callable[[CompletionHandle], object]) -> None:
        """``fn(handle)`` once, on the thread that resolves the job (an executor thread,
        usually ``calexec-completion``), or at once on this thread when already resolved.
        ``fn`` must not block nor call the executor; its exceptions (``BaseException``
        included) are logged."""
        ...

    def remove_done_callback(self, fn: Callable[[CompletionHandle], object]) -> int:
        """Unregister ``fn`` if it has not run; how many registrations were removed."""
        ...

    def as_future(self, loop: asyncio.AbstractEventLoop | None = None
                  ) -> asyncio.Future[InferenceResult | Status]:
        """An asyncio future of the result on ``loop`` (default: the running one; call it on
        the loop's thread), set through ``loop.call_soon_threadsafe``: no thread waits.
        Cancelling it stops observing; it never cancels the job."""
        ...

    async def wait_async(self, deadline: float | None) -> InferenceResult | Status:
        """``wait_until`` without a thread: the result, or a ``wait.deadline`` Status once
        ``deadline`` passed. Neither the deadline nor cancelling the awaiting task cancels the
        job (``cancel()`` does); nothing stays registered afterwards."""
        ...


@runtime_checkable
class DecodeSteps(Protocol):
    """One sequence's decode loop with the next job pre-armed (``DecodeStream``). One caller
    steps it; only ``cancel`` may come from another thread. A failed step closes it."""

    seq_id: int
    #: the committed length the next step starts from
    past_len: int
    #: absolute ``time.monotonic()`` deadline of every step
    deadline: float
    #: why the stream closed (None: open)
    status: Status | None
    steps: int
    prearmed_steps: int
    ahead_steps: int

    @property
    def closed(self) -> bool: ...

    @property
    def quiet(self) -> bool:
        """Nothing of the stream is on its way to the device or on it (after ``close(wait=
        False)``: the discarded step fired ahead has ended, so the sequence may be released)."""
        ...

    def step(self, token: int) -> InferenceResult | Status:
        """``submit(token)`` then ``wait()`` (blocks the calling thread)."""
        ...

    def submit(self, token: int) -> CompletionHandle | Status:
        """Queue the next decode job with ``token`` (with ``greedy_ahead``: must be the last
        result's argmax, already fired). May block for admission (bounded by the deadline)
        when nothing was armed. A Status when the stream is closed or the token is invalid."""
        ...

    def submit_nowait(self, token: int) -> CompletionHandle | Status | None:
        """``submit`` without blocking, for an event loop: the handle when the step fired
        ahead or the pre-armed job took ``token``, the Status of a closed stream, or None when
        ``submit`` would wait or admit (then nothing changed: call ``submit`` on a worker
        thread)."""
        ...

    def wait(self) -> InferenceResult | Status:
        """The result of the last ``submit`` (blocks until resolved or the deadline, then
        cancels the job, waits (bounded) for it to end, so the sequence may be released, and
        closes); advances ``past_len``. Returns at once once the handle is
        done, so an asyncio caller awaits ``handle.wait_async(stream.deadline)`` first."""
        ...

    def cancel(self) -> bool:
        """Cancel the job in flight and the armed one (any thread, never blocks), and a step
        that ``submit`` is admitting (waiting for KV, a buffer slot or Ready: it answers
        CANCELLED at once)."""
        ...

    def close(self, wait: bool = True) -> Status:
        """Release the armed job; with ``wait``, also wait (bounded) for a step fired ahead and
        never taken, so the sequence may be released once it returns."""
        ...


@runtime_checkable
class InferenceExecutor(Protocol):
    """What an embedding server uses of ``DeviceExecutor`` (see the module docstring for the
    error and thread rules; docs/embedding.md for the walk-through)."""

    @property
    def state(self) -> str:
        """The lifecycle state now, one of ``LIFECYCLE_STATES``."""
        ...

    @property
    def failure(self) -> Status | None:
        """Why the lifecycle is Failed (None otherwise)."""
        ...

    def start(self) -> Status:
        """Open the device, configure generation 1, run the golden warm-up, go Ready (blocks
        the caller for the warm-up). Call once. Not OK: the executor is Failed and only
        ``shutdown`` is left."""
        ...

    def enqueue(self, request: InferenceRequest, logits_out: np.ndarray | None = None,
                on_created: Callable[[CompletionHandle], None] | None = None
                ) -> CompletionHandle:
        """Admit, prepare and queue one job on the calling thread; return its handle. A
        refused request (validation, not Ready, deadline, KV/queue full) comes back as an
        already resolved handle. Blocks while KV or a buffer slot is short, bounded by the
        request's deadline. ``on_created`` gets the handle before admission may wait (to
        cancel it from elsewhere). ``logits_out``: a contiguous float32 row of at least the
        requested logits, written by the completion thread (None: one allocated per job)."""
        ...

    def decode_sync(self, request: InferenceRequest, logits_out: np.ndarray | None = None
                    ) -> tuple[int, InferenceResult | Status]:
        """``llama_decode``-style: enqueue and block until resolved or the request's deadline
        (then the job is cancelled and waited for, bounded, so that its sequence may be
        released on return). ``(0, result)`` or ``(llama_decode_code(status), status)``."""
        ...

    def decode_stream(self, seq_id: int, past_len: int, deadline: float,
                      logits_out: np.ndarray | None = None,
                      want_logits: tuple[int, int] | None = None, max_len: int | None = None,
                      request_id: int = 0, greedy_ahead: bool = False,
                      stop_tokens: Collection[int] = (), max_steps: int | None = None
                      ) -> DecodeSteps:
        """Decode steps of ``seq_id`` from its committed length ``past_len`` with the next job
        pre-armed (machines/stream.py). ``greedy_ahead``: the completion thread fires each
        next step with the argmax (not after one of ``stop_tokens``, nor beyond ``max_steps``
        or ``max_len``). Arms its first job now without waiting for resources."""
        ...

    def release_sequence(self, seq_id: int, wait_s: float = 0.0) -> Status:
        """Give back the KV of ``seq_id`` (the embedder owns the ids, and must not use
        ``ExecutorConfig.golden_seq_id``) once its last job is resolved and its stream closed.
        OK (also when its generation was retired: the KV died with it), or
        ``kv.sequence_on_device`` (UNAVAILABLE: the device still runs a failed job of it after
        ``wait_s``: retry), ``kv.sequence_busy`` (INVALID_REQUEST: a job of it is still open or
        armed: a bug of the caller's order), or the KvManager release's own CalRT failure.
        An id that cannot be released is withheld by the caller, never reused. Blocks up to
        ``wait_s``."""
        ...

    def health(self) -> list[str]:
        """Why the executor cannot serve now; empty means ready (a readiness probe)."""
        ...

    def snapshot(self) -> ExecutorSnapshot:
        """Gauges and counters (never blocks)."""
        ...

    def shutdown(self, grace: float = 10.0) -> Status:
        """Stop admission, cancel queued and armed jobs, drain submitted ones within ``grace``
        seconds, stop the threads, release the device. OK and ``state`` Stopped when drained;
        ``shutdown.not_drained`` (Failed: the device kept a job, its buffers stay mapped) or
        ``shutdown.recovery_busy`` (a recovery outlived ``grace``; nothing torn down yet: the
        recovery, interrupted, completes this shutdown as it ends) or
        ``shutdown.start_busy`` (a ``start`` on another thread outlived it; interrupted, it
        completes this shutdown as it ends) or
        ``shutdown.in_progress`` (another thread's ``shutdown`` outlived it) or the
        ``failure`` of an executor already Failed. Idempotent; blocks up to about ``grace``
        plus the threads' joins. Called on the executor's submitter or completion thread (a
        done callback) it raises RuntimeError, changing nothing."""
        ...
