"""DeviceExecutor, Phase A: one job in flight (spec §1, §4.2, §5, §6, §7, §9.1, §10.1).

Path of one job (docs/architecture.md tells the same story):

1. ``enqueue`` (request thread, §6.2): lifecycle Ready? -> §6.3 checks 1-6 (pure) -> exact
   submodel -> deadline/cancel -> admission: KV reserve (condition-variable wait) and token
   budget -> buffer lease -> copy inputs, SliceTensor, SetCsrByName (steps 7-8) -> submit
   queue. Any failure releases what was taken, in reverse order, and resolves the handle.
2. ``submit_one`` (submitter thread, §6.4): takes the next outcome from ``Dispatch``
   (machines/dispatch.py, the passive owner of everything ``submit_mu`` guards: the submit
   queue, armed and guessed jobs, permits, token budget, generation fence, slots the runtime
   still holds), re-checks cancel and the queue deadline, calls ``infer``. Failure: KV
   rollback, lease back, job Failed, no Wait (FI05). Success: KV txn Submitted, slot InFlight,
   handed to the completion queue.
3. ``complete_one`` (completion thread, §6.5): ``Completion`` (machines/completion.py) runs
   ``Wait`` with no lock held, ``GetStatus``, the rc/status double check, output size and
   finiteness, direct BF16->FP32 of the requested slice into the destination; ``JobOutcomes``
   (machines/outcomes.py) applies the end of the job: KV commit, UndoSlice, resolve, lease back,
   permit back. Failure after submit: no commit, sequence Unknown, slot quarantined, fault
   reported.
4. ``decode_stream`` (machines/stream.py): a sequence's decode loop with the next job armed
   (admitted and prepared up to Preparing, KV txn chained behind the running job) while the
   current one runs; a step writes the token into the armed job and the dispatch releases it to
   the submitter. Implicit pre-arms and greedy ahead steps (machines/autoarm.py) are the same
   jobs, armed without a stream; tests/test_differential.py proves they answer like the plain
   path.

Only the submitter calls ``infer`` and only the completion thread calls ``Wait`` (invariant 2);
with ``ExecutorConfig(threads=False)`` both are called by whoever drives ``submit_one`` and
``complete_one`` (stepped mode for deterministic tests). The runtime objects are duck-typed:
``calexec.drivers.calrt.runtime`` provides them; this module imports no cffi.

The device's own life (start, golden run, Failed, recovery, model switch, shutdown along the
lifecycle chart) is a component, ``DeviceLifecycle`` in machines/device_lifecycle.py, that this
executor owns (``self.life``) and hosts: it reaches the executor only through the members its
``LifecycleHost`` protocol lists, and the executor reads it only through its public names. The
executor's lifecycle API for embedders and the fault controller (``start``, ``state``,
``lifecycle``, ``failure``, ``recoveries``, ``goldens``, ``recover``, ``switch_model``,
``request_recovery``, ``shutdown``) delegates to it; everything else of the lifecycle is read
as ``executor.life.<name>``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import math
import numbers
import os
import threading
from collections import deque
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any, cast

import attrs
import numpy as np

from calexec.contracts import fields
from calexec.contracts.codes import CalrtCode
from calexec.contracts.errors import Category
from calexec.contracts.prepare import InferenceRequest, check_request
from calexec.contracts.status import Phase, Status, llama_decode_code
from calexec.contracts.types import SHA256_RE, EngineSlot, ModelGeneration, TaskKind
from calexec.machines import switch_check
from calexec.machines.api import (
    DowngradeRecord,
    ExecutorSnapshot,
    JobTrail,
    RecoveryRecord,
    ThreadFault,
)
from calexec.machines.autoarm import AutoArm
from calexec.machines.chart_names import (
    JOB_EV_ADMIT,
    JOB_EV_BEGIN_PREPARATION,
    JOB_EV_ENQUEUE,
    JOB_EV_INFER_ACCEPTED,
    LIFECYCLE_FAILED,
    LIFECYCLE_READY,
    LIFECYCLE_WARMING,
)
from calexec.machines.clock import SYSTEM, Clock
from calexec.machines.compiled import JOB, ChartRun
from calexec.machines.completion import Completion
from calexec.machines.device_api import RELAY_CLOSED, RELAY_INFERRED, SubmitRelay
from calexec.machines.device_lifecycle import DeviceLifecycle
from calexec.machines.dispatch import Arm, Dispatch, RelayOffer
from calexec.machines.faults import Decision, FaultController, FaultSink, RecoveryPolicy
from calexec.machines.generation import Generation
from calexec.machines.job import (
    SHUTDOWN_CALLED,
    InferenceResult,
    Job,
    JobHandle,
    advance,
    job_of,
)
from calexec.machines.kv import KvCoordinator
from calexec.machines.locks import LockOrder
from calexec.machines.outcomes import ARMING_WAIT_S, JobOutcomes
from calexec.machines.pool import BufferPool, BufferSlot
from calexec.machines.sequences import SequenceOwnership
from calexec.machines.tuning import HotPathTuning

if TYPE_CHECKING:
    from calexec.contracts.manifest import Manifest
    from calexec.machines.device_api import DeviceApi, KvManagerApi, RuntimeApi
    from calexec.machines.dispatch import Armer
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


def _int_at_least(low: int, high: float = math.inf) -> Callable[[Any, Any, Any], None]:
    """attrs validator: an int (not a bool) in ``low..high``, naming the field and value."""
    return fields.number(low, high, integral=True, owner="ExecutorConfig")


def _seconds(positive: bool) -> Callable[[Any, Any, Any], None]:
    """attrs validator: a finite number of seconds, > 0 when ``positive`` else >= 0; a NaN,
    an infinity or a negative value would turn a deadline computed from it into one that
    never passes or has always passed."""
    return fields.number(0, above=positive, owner="ExecutorConfig")


_flag = fields.flag("ExecutorConfig")


def _of_type(kind: type) -> Callable[[Any, Any, Any], None]:
    def check(instance: Any, attribute: Any, value: Any) -> None:
        if not isinstance(value, kind):
            raise TypeError(f"ExecutorConfig.{attribute.name}={value!r}: must be a "
                            f"{kind.__name__}, got {type(value).__name__}")
    return check


def _calbin_path(value: str | os.PathLike[str]) -> object:
    """``calbin_path`` converter: a ``pathlib.Path`` (any ``os.PathLike``) becomes its str
    (typed for the callers' sake: another value is passed on, and the validator names it)."""
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _token_ids(instance: Any, attribute: Any, value: Any) -> None:
    if not fields.token_ids(value):
        raise ValueError(f"ExecutorConfig.{attribute.name}={value!r}: must be a non-empty "
                         "tuple of token ids (ints >= 0)")


def _goldens(instance: Any, attribute: Any, value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"ExecutorConfig.goldens={value!r}: must be a dict of calbin sha256 -> "
                        f"tuple of token ids, got {type(value).__name__}")
    for sha, tokens in value.items():
        if not isinstance(sha, str) or not isinstance(tokens, tuple) or not all(
                map(fields.is_token_id, tokens)):
            raise ValueError(f"ExecutorConfig.goldens[{sha!r}]={tokens!r}: must map a calbin "
                             "sha256 (str) to a tuple of token ids (ints >= 0)")
        if not SHA256_RE.fullmatch(sha):  # the lifecycle looks the calbin's hex digest up: an
            # upper-case, prefixed or short key never matches, the override silently unused
            raise ValueError(f"ExecutorConfig.goldens[{sha!r}]: a calbin sha256 is 64 "
                             "lower-case hex digits (as `sha256sum` prints it and the goldens "
                             "file takes it)")


#: most buffer slots per task kind: each holds host copies of a submodel's inputs and outputs
#: (MiBs), and a few keep the device busy
MAX_SLOTS_PER_KIND = 64

@attrs.define
class ExecutorConfig:
    """Executor settings. Everything about the model (shapes, max_seq, tile D0) comes from the
    manifest; these are operational choices only."""

    calbin_path: str = attrs.field(converter=_calbin_path, validator=_of_type(str))
    device_config: str = attrs.field(default="", validator=_of_type(str))
    #: Phase A: 1 (default). Phase B: 2, each buffer slot fixed to PING or PONG and submitted
    #: with infer_with_fixed_task_type; enable only after `calexec accept --phase b` and
    #: `calexec conform` proved overlap and slot reuse. Back to 1 is configuration only.
    inflight_capacity: int = attrs.field(default=1, validator=_int_at_least(1, 2))
    #: Phase B automatic downgrade to capacity 1: this many failures after submit within
    #: the window (logged, counted in snapshot()["downgrades"]).
    downgrade_after_faults: int = attrs.field(default=2, validator=_int_at_least(1))
    downgrade_window_s: float = attrs.field(default=60.0, validator=_seconds(positive=True))
    #: buffer slots per task kind: one in flight + one being prepared keeps the device busy.
    slots_per_kind: int = attrs.field(default=2,
                                      validator=_int_at_least(1, MAX_SLOTS_PER_KIND))
    #: admission token budget: jobs admitted but not yet completed, in tokens.
    max_pending_tokens: int = attrs.field(default=1 << 20, validator=_int_at_least(1))
    #: §9.1 execution deadline: base + per token, measured from infer() success.
    execution_timeout_s: float = attrs.field(default=30.0, validator=_seconds(positive=True))
    execution_timeout_per_token_s: float = attrs.field(default=0.001,
                                                       validator=_seconds(positive=False))
    #: §9.1: after a failed Wait with the job still on the device, how long to wait for the
    #: device to let go of the buffers before admission is halted.
    timeout_grace_s: float = attrs.field(default=2.0, validator=_seconds(positive=False))
    #: False: stepped mode (no threads; the caller drives submit_one/complete_one).
    threads: bool = attrs.field(default=True, validator=_flag)
    #: record lock acquisition order (tests); strict raises on a violation.
    check_lock_order: bool = attrs.field(default=False, validator=_flag)
    strict_lock_order: bool = attrs.field(default=False, validator=_flag)
    #: the fixed golden run of §9.2 Warming: this prompt, then greedy decode steps
    golden_tokens: tuple[int, ...] = attrs.field(
        default=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17), validator=_token_ids)
    golden_decode_steps: int = attrs.field(default=2, validator=_int_at_least(0))
    golden_seq_id: int = attrs.field(default=0, validator=_int_at_least(0))
    #: deadline of each golden job (a golden that cannot finish fails the warm-up, never hangs)
    golden_timeout_s: float = attrs.field(default=10.0, validator=_seconds(positive=True))
    #: expected golden tokens per calbin sha256 for the prompt above, given by the operator;
    #: they take precedence over the goldens pinned next to the manifest (``Manifest.goldens``,
    #: written by ``calexec golden record``).
    goldens: dict[str, tuple[int, ...]] = attrs.field(factory=dict, validator=_goldens)
    #: §9.2: start or switch to a calbin with no pinned golden. Refused by default; when set,
    #: the first warm-up's tokens become the expected ones for this process (trust on first
    #: use), logged at WARNING and shown in ``snapshot()["golden"]``.
    allow_unpinned_golden: bool = attrs.field(default=False, validator=_flag)
    #: recovery thresholds and reset choice (calexec.machines.faults.RecoveryPolicy)
    recovery: RecoveryPolicy = attrs.field(factory=RecoveryPolicy,
                                       validator=_of_type(RecoveryPolicy))
    #: queue through recovery (Triton's DELAY policy): up to this many requests that arrive
    #: while the device drains/recovers/configures/warms wait for Ready within their
    #: deadline instead of an immediate UNAVAILABLE; 0 refuses them at once
    ready_queue_max: int = attrs.field(default=0, validator=_int_at_least(0))
    #: the path of each job (taken transitions, refused events and their guards) is kept for
    #: this many most recent jobs (``job_trail``); 0 keeps none
    job_trails_kept: int = attrs.field(default=1024, validator=_int_at_least(0))
    #: /ready and health(): a job still on the device this long past its request deadline
    #: means the device stalls (the execution deadline above is the hard bound)
    stall_after_s: float = attrs.field(default=1.0, validator=_seconds(positive=True))
    #: how long a recovery waits for request threads still preparing a job of the old
    #: generation to leave it (they end at once: admission is stopped and their waits woken)
    fence_grace_s: float = attrs.field(default=2.0, validator=_seconds(positive=True))
    #: implicit pre-arming for enqueue/decode_sync callers (machines/autoarm.py): while a
    #: sequence's decode job runs, the submitter arms the job the sequence's next token would
    #: need (only within its KV reservation, only with a free slot); any other request of it
    #: releases the guess first, and so does an admission short of a slot or token budget
    auto_prearm: bool = attrs.field(default=True, validator=_flag)
    #: the hot path's timing (arming delays, greedy ahead's yield, early wake-ups, a guess's
    #: expiry): machines/tuning.py; none of it changes an answer, only when work runs
    tuning: HotPathTuning = attrs.field(factory=HotPathTuning,
                                    validator=_of_type(HotPathTuning))
    #: the submitter waits in a native relay when the runtime offers one
    #: (``RuntimeApi.submit_relay``, docs/architecture.md "Native hand-offs"): a fired
    #: decode step (a pre-armed stream's, greedy ahead's, an adopted guess's) that the
    #: submitter would submit at once is given to ``infer`` from that wait, without a
    #: Python wake-up. Same decisions, same answers (tests/test_differential.py). Off by
    #: default: its gains at 2 ms are within one run's spread to the next
    #: (docs/benchmarks.md, stop 49)
    native_relay: bool = attrs.field(default=False, validator=_flag)


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


def _check_stream_arguments(*, max_len: object, max_steps: object, stop_tokens: object,
                            greedy_ahead: object) -> None:
    """``decode_stream``'s settings, checked before anything of the sequence is touched: a
    TypeError or ValueError naming the argument and its value (the request fields, seq_id,
    past_len and request_id, are named by ``InferenceRequest``'s converters the same way).
    Before, a str ``stop_tokens`` raised ``invalid literal for int()``, None ``'NoneType'
    object is not iterable``, a str ``max_len`` a comparison error, and a ``max_len`` of 0 or
    less was taken (every step ahead refused), a negative ``max_steps`` too (as 0)."""
    for name, value in (("max_len", max_len), ("max_steps", max_steps)):
        if value is not None and not fields.is_int(value):
            raise TypeError(f"decode_stream: {name}={value!r}: expected an int or None")
    if max_len is not None and max_len < 1:  # type: ignore[operator]  # an int: checked above
        raise ValueError(f"decode_stream: max_len={max_len!r}: must be >= 1 (the prompt plus "
                         "the tokens to generate)")
    if max_steps is not None and max_steps < 0:  # type: ignore[operator]  # an int: checked
        raise ValueError(f"decode_stream: max_steps={max_steps!r}: must be >= 0 (the jobs "
                         "greedy ahead may fire; 0: none)")
    if not isinstance(greedy_ahead, bool):
        raise TypeError(f"decode_stream: greedy_ahead={greedy_ahead!r}: expected True or False")
    if isinstance(stop_tokens, (str, bytes)) or not isinstance(stop_tokens, Collection) or not all(
            map(fields.is_int, stop_tokens)):
        raise TypeError(f"decode_stream: stop_tokens={stop_tokens!r}: expected a collection of "
                        "token ids (ints)")


def _check_construction(runtime: object, manifest: object, config: object) -> None:
    """``DeviceExecutor``'s arguments, checked when it is built: a TypeError naming the one
    that is not what it takes. Before, a dict config raised ``'dict' object has no attribute
    'tuning'``, and a manifest path (a str) or a None runtime were taken, so ``start()``
    raised an AttributeError from deep inside and left the lifecycle ``Configuring`` (a
    later ``shutdown()`` then answered ``shutdown.not_drained``)."""
    from calexec.contracts.manifest import Manifest

    if not isinstance(config, ExecutorConfig):
        hint = " (build one: ExecutorConfig(**settings))" if isinstance(config, dict) else ""
        raise TypeError(f"DeviceExecutor: config={config!r:.200}: expected an ExecutorConfig, "
                        f"got {type(config).__name__}{hint}")
    if not isinstance(manifest, Manifest):
        raise TypeError(f"DeviceExecutor: manifest={manifest!r:.200}: expected a Manifest "
                        f"(load_manifest(path)), got {type(manifest).__name__}")
    if runtime is None or isinstance(runtime, type) or not callable(
            getattr(runtime, "open_device", None)):
        raise TypeError(f"DeviceExecutor: runtime={runtime!r:.200}: expected a loaded runtime "
                        "(CalRT.load(), or a shim with the same methods)")


_TRAIL_STEPS = 32  # a job takes at most ~8 transitions; refused events are few


class _NoRequest:
    """Stand-in request of a job refused because the caller passed no InferenceRequest."""

    seq_id = -1
    kind = TaskKind.DECODE
    deadline = 0.0
    token_count = 0


_NO_REQUEST = _NoRequest()


class DeviceExecutor(SequenceOwnership):
    """The control core: owns the device, calbin, KvManager and buffer pool (invariant 1).

    This class is the job path; the device lifecycle (start, golden, recovery, model switch,
    shutdown) is its ``DeviceLifecycle`` component, ``self.life`` (machines/device_lifecycle.py),
    for which it is the ``LifecycleHost``."""

    def __init__(self, runtime: RuntimeApi, manifest: Manifest, config: ExecutorConfig,
                 fault_sink: FaultSink | None = None, clock: Clock = SYSTEM) -> None:
        _check_construction(runtime, manifest, config)
        self.runtime = runtime
        self.manifest = manifest
        self.config = config
        self._tuning = config.tuning
        self.clock = clock
        self.faults = fault_sink or FaultController(config.recovery)
        self.faults.attach(self)
        self.locks = LockOrder(checking=config.check_lock_order, strict=config.strict_lock_order,
                               clock=clock)
        # the runtime objects every job uses; the lifecycle opens, replaces and closes them
        self.device: DeviceApi | None = None
        self.gen: Generation | None = None
        # supervision: what each executor thread's barrier caught (the recovery thread's too)
        self.thread_faults: deque[ThreadFault] = deque(maxlen=100)
        # the device's life along the lifecycle chart (its run, lifecycle_mu, the admission
        # gate, the ready queue, recovery, goldens, retired generations, shutdown): one owner,
        # machines/device_lifecycle.py; it reaches this executor as its ``LifecycleHost``
        self.life = DeviceLifecycle(self)
        # the dispatch state (submit queue, armed jobs and what to arm, permits, budget,
        # generation fence, refusal, slots held by the runtime): one owner, machines/dispatch.py
        self.dispatch = Dispatch(self.locks, clock, config.inflight_capacity)
        self.submit_mu = self.dispatch.mu
        # how jobs end when they do not deliver, and the counters: machines/outcomes.py
        self.outcomes = JobOutcomes(config, clock, self.locks, self.dispatch, self.faults,
                                    lambda: self.gen)
        # the job chart's transitions of the jobs no client asked for (``Job.count_apart``):
        # JOB.taken, the live page's rates, counts the clients' jobs only
        self._apart_taken = [0] * len(JOB.transitions)
        # the completion queue and thread's work (§6.5): machines/completion.py. It keeps the
        # moving average of decode jobs' device time that the early wake-ups (issue 17) read:
        # a thread that slept through a decode job's device time wakes tuning.prewake_s
        # before the job is expected to end (the submitter's idle wait,
        # ``Completion.prewake_at``, once per job on the device, and a caller's
        # ``JobHandle.wait_until``, ``Job.early_wake_s``)
        self.completion = Completion(
            config, clock, self.locks, self.dispatch, self.outcomes,
            getattr(runtime, "logits_postprocessor", lambda: None)(), lambda: self.gen)
        self._last_submit_seq: int | None = None  # the submitter's own (no lock)
        self._features_off: dict[str, int] = {}  # FEATURES name -> generation it went off in
        self._job_ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        # supervision: what each executor thread holds now
        self._holding: dict[str, Job | None] = {}
        # what the completion side tells the barrier it holds (made once: complete_one is
        # called per job)
        self._completion_holds = functools.partial(self._holding.__setitem__,
                                                   "calexec-completion")
        # thread identity of runtime calls (invariant 2); Wait's: ``completion.wait_threads``
        self.infer_threads: set[str] = set()
        # the submitter's native relay while the threads run (``native_relay``), and what a
        # thread that fires a job needs to hand it to the relay itself
        self._relay: SubmitRelay | None = None
        self._relay_open = False  # the submitter waits in it (False once it closed)
        self._relay_offer = RelayOffer(self._unsubmittable, self._effective_capacity,
                                       self._relay_eligible)

    # ---- the lifecycle (machines/device_lifecycle.py): what embedders and tools call here --------
    @property
    def lifecycle(self) -> ChartRun:
        """The lifecycle chart's run (``lifecycle.state``, ``lifecycle.final``)."""
        return self.life.run

    @property
    def state(self) -> str:
        """The lifecycle state now (machines/api.py ``LIFECYCLE_STATES``)."""
        return self.life.run.state

    @property
    def failure(self) -> Status | None:
        """Why the lifecycle is Failed (None otherwise)."""
        return self.life.failure

    @property
    def recoveries(self) -> list[RecoveryRecord]:
        """One record per recovery or model switch: reason, reset, generations, outcome; the
        newest ``device_lifecycle.RECOVERY_RECORDS_KEPT`` (``recovery_totals`` counts all)."""
        return self.life.recoveries

    @property
    def recovery_totals(self) -> dict[tuple[str, bool], int]:
        """Every recovery and model switch recorded, by (reason code, ok): the counts of
        ``recoveries``, older records dropped included."""
        return dict(self.life.recovery_totals)

    @property
    def goldens(self) -> dict[str, tuple[int, ...]]:
        """Expected golden tokens per calbin sha256: the operator's (``config.goldens``) and
        unpinned runs accepted in this process; the lifecycle's own dict."""
        return self.life.goldens

    def start(self) -> Status:
        """Open the device and generation 1, warm up with the golden run, go Ready
        (``DeviceLifecycle.start``)."""
        return self.life.start()

    def request_recovery(self, decision: Decision) -> None:
        """Called by the fault controller; never blocks (``DeviceLifecycle.request_recovery``)."""
        self.life.request_recovery(decision)

    def recovery_under_way(self) -> bool:
        """Asked by the fault controller (``DeviceLifecycle.recovery_under_way``)."""
        return self.life.recovery_under_way()

    def lifecycle_final(self) -> str | None:
        """Asked by the fault controller: ``"Failed"``/``"Stopped"`` once the lifecycle
        ended, else None (read without the lifecycle's lock)."""
        run = self.life.run
        return run.state if run.final else None

    def recover(self, reason: Status, reset: bool = True,
                calbin_path: str | None = None) -> Status:
        """Drain, optionally reset, replace the generation, golden, reopen admission
        (``DeviceLifecycle.recover``). Called on the submitter or completion thread (a done
        callback) it raises RuntimeError, changing nothing (``refuse_on_worker_thread``)."""
        self.refuse_on_worker_thread("recover")
        return self.life.recover(reason, reset, calbin_path)

    def switch_model(self, calbin_path: str | os.PathLike[str],
                     without_rollback: bool = False) -> Status:
        """Model switch through the lifecycle; a refused calbin rolls back
        (``DeviceLifecycle.switch_model``; ``without_rollback``: also when the calbin it rolls
        back to was written over in place, a refusal then ending it Failed). Called on the
        submitter or completion thread (a done callback) it raises RuntimeError, changing
        nothing (``refuse_on_worker_thread``)."""
        self.refuse_on_worker_thread("switch_model")
        return self.life.switch_model(calbin_path, without_rollback)

    def check_calbin(self, calbin_path: object, max_bytes: int | None = None,
                     hash_pin: bool = True) -> Status:
        """Whether ``switch_model(calbin_path)`` can start: the file, the runtime's host-side
        read of it and the manifest, checked without touching the device or the lifecycle
        (``Status.OK``, or a 400 ``calbin.<reason>`` failure naming the path; never raises;
        machines/switch_check.py). The admin reload calls it before any drain. ``hash_pin``
        False: the manifest's sha256 pin is left to the load that follows (``calexec serve
        --calbin`` before ``start``: the file is then not read whole twice)."""
        return switch_check.check_calbin(self.runtime, self.manifest, calbin_path, max_bytes,
                                         hash_pin)

    def shutdown(self, grace: float = 10.0) -> Status:
        """Stop admission, cancel queued jobs, drain submitted ones within ``grace`` seconds,
        stop the threads, release the generation and the device: Stopped when drained (FI13),
        Failed otherwise; idempotent (``DeviceLifecycle.shutdown``). Called on the submitter
        or completion thread (a done callback) it raises RuntimeError, changing nothing
        (``refuse_on_worker_thread``)."""
        self.refuse_on_worker_thread("shutdown")
        return self.life.shutdown(grace)

    # ---- observability: what the components count ----------------------------------------------
    @property
    def counters(self) -> dict[str, int]:
        """Jobs submitted, succeeded, failed, quarantined, cancelled, ... (§10.3; the
        components bump them under ``counters_mu``)."""
        return self.outcomes.counters

    @property
    def downgrades(self) -> list[DowngradeRecord]:
        """Phase B downgrades to capacity 1: when and why."""
        return self.outcomes.downgrades

    @property
    def wait_threads(self) -> set[str]:
        """Names of the threads that called Wait (invariant 2: the completion thread)."""
        return self.completion.wait_threads

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
    def kv(self) -> KvManagerApi | None:
        return None if self.gen is None else self.gen.kv

    # ---- sequence ownership (machines/sequences.py) ---------------------------------------------
    def release_sequence(self, seq_id: int, wait_s: float = 0.0) -> Status:
        """``SequenceOwnership.release_sequence``. Called on the submitter or completion
        thread (a done callback) with ``wait_s`` > 0 it raises RuntimeError naming it
        (``refuse_on_worker_thread``): its wait for the device to let go of a failed job is
        ended by that very thread, which stood still for all of ``wait_s`` (every job behind
        it), and the release then answered ``kv.sequence_on_device`` though the device had
        let go. With ``wait_s`` 0 (no wait) it answers there as anywhere."""
        # (a float is tested without the ABC's isinstance: 6 of a server request's Python
        # calls; issue 28, stop 75)
        if (wait_s > 0 if type(wait_s) is float else isinstance(wait_s, numbers.Real)
                and not isinstance(wait_s, bool) and wait_s > 0):
            self.refuse_on_worker_thread("release_sequence")
        forked = self.life.forked_why()
        if forked is not None:  # the KvManager is the parent's
            return Status.unavailable(Phase.ADMISSION, f"release_sequence: {forked}; nothing "
                                      "was released")
        return super().release_sequence(seq_id, wait_s)

    def _before_release(self, seq_id: int, wait_s: float) -> None:
        """``release_sequence``: a step an open greedy stream of ``seq_id`` fired ahead and
        its caller never took is discarded, and waited for (at most ``wait_s``, at least about
        1 s, as ``decode_stream`` waits for it) until it left the device, as a request of the
        sequence does. Without greedy ahead nothing of the stream runs once its caller took
        its step (its armed next job is a guess, released), and the release answered OK; with
        it, the step fired ahead still ran and the release answered ``kv.sequence_busy``."""
        self.outcomes.release_armed_of(
            seq_id, ahead_until=self.clock.monotonic() + max(wait_s, ARMING_WAIT_S))

    # ---- enqueue (§6.2) -------------------------------------------------------------------------
    def enqueue(self, request: InferenceRequest, logits_out: np.ndarray | None = None,
                on_created: Callable[[JobHandle], None] | None = None) -> JobHandle:
        """Validate, admit, lease, prepare and queue one job. Never raises for a bad request or
        a runtime error: the returned handle is then already resolved with the Status.

        Admission may block the calling thread (KV or buffer wait, bounded by the request's
        deadline). ``on_created`` receives the handle before admission starts, so another
        thread (e.g. a client-disconnect handler) can cancel a job that is still waiting.
        ``logits_out``: a contiguous float32 array receiving the requested logits slice
        (zero allocations per token); None allocates one per job. An ``on_created`` that is
        not callable raises TypeError naming it, before anything is created. Called on the
        submitter or completion thread (a done callback) it raises RuntimeError
        (``refuse_on_worker_thread``): an admission that waits there holds every other job."""
        self.refuse_on_worker_thread("enqueue")
        if on_created is not None and not callable(on_created):
            raise TypeError(f"enqueue: on_created={on_created!r:.200}: expected a callable "
                            "taking the handle, or None")
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
            job = Job(next(self._job_ids), 0, _NO_REQUEST, self.wake_waiters)
            return self.outcomes.fail_early(job, Status.invalid(
                4, f"request: expected an InferenceRequest, got {type(request).__name__}"))
        gen = self.gen
        job = Job(next(self._job_ids), gen.id if gen is not None else 0, request,
                  self.wake_waiters, internal=internal, clock=self.clock)
        job.gen = gen
        job.logits_out = logits_out
        if self.config.threads:  # a done callback's wait for it is refused (``JobHandle``)
            job.refuse_wait = self.refuse_on_worker_thread
        if request.kind == TaskKind.DECODE:
            job.early_wake_s = self._early_wake_s()
        job.uncounted = arm is not None and not arm.blocking  # a pre-arm attempt may miss
        if internal or arm is not None:  # a golden job; an armed one, a client's once fired
            job.count_apart(self._apart_taken)
        job.auto_next = (arm is None and not internal and self.config.auto_prearm
                         and request.kind == TaskKind.DECODE and len(request.seq_ids) == 1
                         and isinstance(request.positions, np.ndarray))
        if self.config.job_trails_kept:
            job.run.keep_trail(deque(maxlen=_TRAIL_STEPS), self.clock.monotonic)
            job.on_resolved = self.outcomes.keep_trail
        handle = JobHandle(job)
        if on_created is not None:
            try:
                on_created(handle)
            except BaseException as exc:  # the caller's callback: it raises to the caller, its
                self.outcomes.fail_early(job, Status.internal(  # job resolved first (it stayed
                    "on_created_raised", Phase.ADMISSION, f"on_created raised "  # Created)
                    f"{type(exc).__name__}: {exc}", **job.ctx()))
                raise
        # queue through recovery: a caller's request waits for Ready; a pre-arm never waits
        # (the submitter arms: the recovery's golden run needs the submitter)
        life = self.life
        if (not internal and not life.admitting and self.config.ready_queue_max
                and (arm is None or arm.blocking)):
            waited = life.wait_for_ready(job)
            if waited is not None:
                return self.outcomes.fail_early(job, waited)
            gen = self.gen
            job.gen, job.generation_id = gen, gen.id if gen is not None else 0
        if not (life.admitting or (internal and life.run.state == LIFECYCLE_WARMING)) \
                or life.stopping or gen is None:
            return self.outcomes.fail_early(job, self._not_admitting(**job.ctx()))
        generation = gen.contracts
        status = check_request(request, generation)
        if status.ok:
            status = _check_caller_arguments(request, logits_out, generation.vocab_size)
        if not status.ok:
            return self.outcomes.fail_early(job, status.with_context(**job.ctx()))
        job.submodel = generation.submodels[request.kind]
        if arm is None and not internal:  # a greedy stream's step fired ahead on this
            # sequence is discarded: let it leave the device first (bounded by this request's
            # deadline), outside the fence, so a recovery never waits for this thread here
            self.outcomes.release_armed_of(request.seq_id, ahead_until=request.deadline)
        # Fencing: from here until the job is queued (or failed) this thread works on ``gen``;
        # a recovery closes the generation and waits for it to leave before tearing it down.
        if not self.dispatch.enter(gen, self.gen):
            return self.outcomes.fail_early(job, Status.unavailable(
                Phase.ADMISSION, f"generation {gen.id} is closing; retry later", **job.ctx()))
        try:
            return self._admit_and_queue(job, handle, gen, arm)
        except Exception as exc:  # barrier: a bug here fails this job, never leaks or hangs
            log.exception("enqueue of job %d raised", job.job_id)
            return self.outcomes.abandon_before_submit(job, exc, "enqueue")
        finally:
            self.dispatch.exit(gen)

    def _not_admitting(self, **ctx: int) -> Status:
        """The ``lifecycle.unavailable`` of a request (or a decode stream) the lifecycle does
        not admit: a shutdown is named (it stops admission with the lifecycle still Ready or
        Draining), so a caller does not retry a device that only drains, and so is a
        ``start()`` never called (the lifecycle's Configuring read as a device configuring);
        else the state."""
        life = self.life
        why = (life.forked_why() or SHUTDOWN_CALLED if life.stopping
               else f"start() was not called yet (device lifecycle {life.run.state})"
               if life.never_opened() else f"device lifecycle is {life.run.state}")
        return Status.unavailable(Phase.ADMISSION, f"{why}; not admitting", **ctx)

    def _admits_no_stream(self, seq_id: int) -> Status | None:
        """Why a ``decode_stream`` opened now could never take a step: ``start()`` not called
        yet, a shutdown begun, or the lifecycle final (Failed, Stopped). What ``enqueue``
        answers then (its handle resolved at once), for the stream returned closed. None
        otherwise: through a start or a recovery the stream stays open, its steps admitted
        as ``enqueue`` admits requests then."""
        life = self.life
        if not (life.stopping or life.run.final or life.never_opened()):
            return None
        return self._not_admitting(seq_id=seq_id)

    def enqueue_internal(self, request: InferenceRequest) -> JobHandle:
        """A job of the executor's own (the lifecycle's golden run): admitted while Warming,
        never queued for Ready, never pre-armed; resolved like any other."""
        return self._enqueue(request, internal=True)

    def _admit_and_queue(self, job: Job, handle: JobHandle, gen: Generation,
                         arm: Arm | None = None) -> JobHandle:
        request = job.request
        stop = self._stop_reason(job)
        if stop() is not None:
            return self.outcomes.fail_early(job, stop())
        # Admission: token budget, then KV (both released on every failure below).
        tokens = request.token_count
        budget = self._token_budget()
        speculative = arm is not None and not arm.blocking  # a pre-arm: may find nothing free
        dispatch = self.dispatch
        if (dispatch.anything_armed and not speculative and not job.internal
                and dispatch.over_budget(tokens, budget)):
            self.outcomes.reclaim_armed()  # a pre-armed job never keeps budget from a request
        if not dispatch.take_budget(job, budget):
            return self.outcomes.fail_early(job, Status.exhausted(
                "queue", Phase.ADMISSION, f"token budget: {dispatch.pending_tokens} pending + "
                f"{tokens} > {budget} (max_pending_tokens="
                f"{self.config.max_pending_tokens}, reduced after transient faults)",
                **job.ctx()))
        # a pre-arm never waits: KV within the sequence's reservation, a slot free now
        wait_until = job.deadline if arm is None or arm.blocking else 0.0
        if (arm is not None and arm.prev_txn is not None
                and arm.prev_txn.generation_id != gen.id):  # never chained across generations
            self.dispatch.release_budget(job)
            return self.outcomes.fail_early(job, Status.unavailable(
                Phase.ADMISSION, f"generation {arm.prev_txn.generation_id} of the job before "
                f"was retired; retry", **job.ctx()))
        txn = (gen.kvc.reserve_next(arm.prev_txn, tokens)
               if arm is not None and arm.prev_txn is not None else
               gen.kvc.reserve(request.seq_id, request.past_len, tokens, wait_until, stop,
                               reserve_len=request.kv_reserve_len, speculative=speculative))
        if isinstance(txn, Status):
            self.dispatch.release_budget(job)
            return self.outcomes.fail_early(job, txn.with_context(job_id=job.job_id))
        job.txn = txn
        if not advance(job, JOB_EV_ADMIT):
            return self.outcomes.fail_before_submit(
                job, Status.cancelled(Phase.ADMISSION, **job.ctx()))
        job.timings.admitted_us = self.clock.now_us()
        lease = None
        if dispatch.anything_armed and not speculative:  # never a slot kept from a request
            lease = gen.pool.acquire(request.kind, 0.0, owner=job.job_id, stop=stop)
            if isinstance(lease, Status) and lease.category == Category.RESOURCE_EXHAUSTED:
                self.outcomes.reclaim_armed()
                lease = None
        if lease is None:  # a pre-arm never takes a slot a request is waiting for
            lease = gen.pool.acquire(request.kind, wait_until, owner=job.job_id, stop=stop,
                                     speculative=speculative)
        if isinstance(lease, Status):
            return self.outcomes.fail_before_submit(job, lease.with_context(**job.ctx()))
        job.lease = lease
        if not advance(job, JOB_EV_BEGIN_PREPARATION):
            return self.outcomes.fail_before_submit(
                job, Status.cancelled(Phase.PREPARE, **job.ctx()))
        status = lease.slot.prepare(request)
        if not status.ok:
            return self.outcomes.fail_before_submit(job, status.with_context(**job.ctx()))
        if arm is not None:  # pre-armed: Preparing until its token comes (``fire``); a
            # guess until it is fired: its release counts nothing
            # (blocking: the caller's own step, fired next: never reclaimed as a guess)
            if not dispatch.arm(job, self.gen, notify=arm.notify, for_caller=arm.blocking):
                return self.outcomes.fail_before_submit(job, Status.unavailable(
                    Phase.PREPARE, f"generation {gen.id} retired while the job was armed; "
                    "retry", **job.ctx()))
            return handle
        if not advance(job, JOB_EV_ENQUEUE):
            return self.outcomes.fail_before_submit(
                job, Status.cancelled(Phase.PREPARE, **job.ctx()))
        job.timings.queued_us = self.clock.now_us()
        if not dispatch.queue(job, self.gen):  # fencing: never into another generation's queue
            return self.outcomes.fail_before_submit(job, self._not_admitting(**job.ctx())
                                                    if self.life.stopping else
                                                    Status.unavailable(
                Phase.SUBMIT, f"generation {gen.id} retired before the job was queued; retry",
                **job.ctx()))
        return handle

    def _early_wake_s(self) -> float:
        """How long after it begins a caller's wait for a decode job wakes early (0: not)."""
        tuning = self._tuning
        if tuning.prewake_s > 0 and self.completion.decode_exec_us >= tuning.prewake_min_us:
            return self.completion.decode_exec_us / 1e6 - tuning.prewake_s
        return 0.0

    def _token_budget(self) -> int:
        factor = self.faults.admission_factor()
        return int(self.config.max_pending_tokens * factor)

    def _stop_reason(self, job: Job) -> Callable[[], Status | None]:
        gen = job.gen
        life = self.life

        def stop() -> Status | None:
            if job.cancel_flag:
                return Status.cancelled(Phase.ADMISSION, **job.ctx())
            # a golden job (internal) is admitted while admission is closed (Warming), but
            # not once a shutdown stops: its wait would outlive the shutdown's grace
            # named as ``enqueue`` names it: a shutdown (never "retry later": the
            # executor stops), a generation a recovery closes, or the lifecycle's state
            if life.stopping or (not job.internal and not life.admitting):
                return self._not_admitting(**job.ctx())
            if gen is not None and gen.closing:
                return Status.unavailable(Phase.ADMISSION, f"generation {gen.id} is closing; "
                                          "retry later", **job.ctx())
            if self.clock.monotonic() >= job.deadline:
                return Status.deadline(Phase.ADMISSION, "admission deadline passed", **job.ctx())
            return None
        return stop

    def internal_job_transitions(self) -> tuple[int, ...]:
        """Per job chart transition id, the times this executor's jobs no client asked for
        took it: golden jobs, and armed jobs (auto pre-arm guesses, decode streams' next
        steps) resolved before being fired for a request (released: ``fail``). ``JOB.taken``
        (the live page's rates) counts none of these."""
        return tuple(self._apart_taken)

    def job_trail(self, job_id: int) -> JobTrail | None:
        """What happened to one recent job (``JobOutcomes.job_trail``): its chart path, final
        state and status code; None when not kept (still running, or older than
        ``job_trails_kept`` jobs)."""
        return self.outcomes.job_trail(job_id)

    def wake_waiters(self) -> None:
        """A cancel was recorded: end admission/lease/Ready waits so the owner sees it."""
        self.life.ready_changed()
        if self.kvc is not None:
            self.kvc.wake()
        if self.pool is not None:
            self.pool.wake()
        self.dispatch.wake()

    # ---- failure paths ------------------------------------------------------------------------
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
            self.outcomes.reap_held()
        # the dispatch looks again by itself after a wait, reading the capacity and the
        # early wake-up (``Completion.prewake_at``, lock-free) each time; it returns ``woke``
        # only when slots the runtime holds need reaping outside its lock
        wake_at = self._prewake_at if block and self._tuning.prewake_s > 0 else None
        relay = self._relay if block and self._relay_open else None
        while True:
            step = dispatch.next_for_submitter(self._unsubmittable, self._effective_capacity,
                                               block, wake_at, relay_idle=relay is not None)
            if not step.woke:
                break
            if dispatch.any_held:  # nobody signals when the runtime lets go: re-check
                self.outcomes.reap_held()
        if step.idle_for is not None and relay is not None:
            self._relay_wait(relay, step.idle_for)
            return True
        if step.arm is not None:
            try:
                step.arm.arm_next()  # it never raises: a failed arm leaves nothing armed
            finally:
                dispatch.done_arming()
            return True
        if step.fail:
            for _ in range(step.guesses):
                self.outcomes.bump("auto_prearm_released")
            try:
                for job, status in step.fail:
                    self._holding["calexec-submitter"] = job
                    self.outcomes.fail_before_submit(job, status)
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
        self._after_submit_step(job)
        return True

    def _after_submit_step(self, job: Job) -> None:
        """(The submitter.) ``job`` was submitted (or failed): arm the guess of its
        successor when its sequence's job before was submitted just before it."""
        seq, self._last_submit_seq = self._last_submit_seq, job.request.seq_id
        if job.auto_next and job.submitted_at and seq == job.request.seq_id:
            self._auto_after_submit(job)

    # ---- the native relay (``native_relay``; machines/device_api.py ``SubmitRelay``) ----------
    @property
    def relay_active(self) -> bool:
        """The submitter waits in a native relay now (``native_relay``, threads running)."""
        return self._relay is not None and self._relay_open

    def _relay_eligible(self, job: Job) -> bool:
        """Whether ``job``'s infer is the relay's plain ``infer`` (``_infer``'s choice)."""
        lease = job.lease
        return lease is not None and self._plain_infer(lease.slot)

    def _relay_fire(self, job: Job) -> None:
        """(The thread that fired ``job``, after the dispatch took it for the submitter:
        ``job.relayed``.) Its slot goes in flight and the relay's submitter infers it; a
        relay that refuses it (closed, full, or its fire raised: logged) leaves it to the
        submitter's Python (``Dispatch.relay_refused``), and the job is fired all the same:
        its caller keeps its handle. (A fire that raised raised on to the caller, which took
        the job for not fired while the submitter ran it: the step raised, or was admitted
        again, ``kv.sequence_busy``.)"""
        gen, lease, relay = job.gen, job.lease, self._relay
        fired = False
        try:
            if gen is None or lease is None:  # (a relayed job is queued: it holds both)
                raise RuntimeError(f"{job!r} was taken for the relay without its generation "
                                   "or lease")
            if not job.in_flight_marked:
                gen.pool.mark_in_flight(lease)
                job.in_flight_marked = True
            slot = lease.slot
            try:
                fired = relay is not None and relay.fire(
                    job.job_id, self.device, slot.model, gen.kv, job.request.seq_id,
                    slot.inbuf, slot.outbuf)
            except Exception:  # noqa: BLE001 - refused: the submitter's Python submits it
                log.exception("the submit relay's fire of job %d raised; the submitter "
                              "submits it", job.job_id)
        finally:
            if not fired:  # the submitter's Python submits it (it raises on, if this did)
                self.dispatch.relay_refused(job)

    def _relay_wait(self, relay: SubmitRelay, timeout_s: float) -> None:
        """The submitter's idle wait in the relay; a job it inferred meanwhile gets what
        follows infer here, exactly as ``_submit`` applies it."""
        kind, tag, rc = relay.wait(timeout_s)
        if kind == RELAY_CLOSED:
            self._relay_open = False
        if kind == RELAY_INFERRED:
            job = self.dispatch.take_relayed(tag)
            if job is None:
                raise RuntimeError(f"the submit relay reported job {tag}, which was not "
                                   "taken for it")
            self.infer_threads.add(threading.current_thread().name)
            self.outcomes.bump("relay_submitted")
            self._holding["calexec-submitter"] = job
            try:
                self._after_infer(job, rc)
            finally:
                self.dispatch.handed_off(1)
            self._holding["calexec-submitter"] = None
            self._after_submit_step(job)
        if self.dispatch.any_held:  # nobody signals when the runtime lets go: re-check
            self.outcomes.reap_held()

    def _open_relay(self) -> None:
        """``start_threads``: the submitter waits in a native relay from now on, when asked
        for (``native_relay``) and the runtime offers one for this executor's clock."""
        if not (self.config.native_relay and self.config.threads) or self._relay is not None:
            return
        make = getattr(self.runtime, "submit_relay", None)
        relay = make(self.clock) if make is not None else None
        if relay is None:
            log.info("native_relay: the runtime offers no submit relay for this clock; the "
                     "submitter waits in Python")
            return
        self._relay, self._relay_open = relay, True
        self.dispatch.relay_wake = relay.wake
        if self.config.inflight_capacity == 2:
            # Phase B's slots are PING/PONG: their jobs go to infer_with_fixed_task_type,
            # which the relay never calls (``_relay_eligible``); nothing said so, and
            # ``serve --native-relay --inflight-capacity 2`` (or a bench's) ran with
            # ``relay_submitted`` 0 for good, as if the relay had been asked for and used
            log.info("native_relay with inflight_capacity=2 (Phase B): the submitter waits in "
                     "the relay, but Phase B's jobs go to infer_with_fixed_task_type, which the "
                     "relay does not call: none is inferred from it (relay_submitted, "
                     "calexec_relay_submitted_total, stay 0) while fixed_engine is on")

    def _close_relay(self, threads_gone: bool) -> None:
        """``stop_threads``: close the relay; a job fired into it and never given to infer
        fails as a job the submitter could not submit (its slot was never on the device).
        The relay is freed only once no thread can be in it."""
        relay = self._relay
        if relay is None:
            return
        self.dispatch.relay_wake = None
        self._relay_open = False
        for tag in relay.close():
            job = self.dispatch.take_relayed(tag)
            if job is None:
                continue
            try:
                self._not_submitted(job, Status.cancelled(
                    Phase.SUBMIT, "the executor's threads stopped before the job was "
                    "submitted", **job.ctx()))
            finally:
                self.dispatch.handed_off(1)
        if threads_gone:
            relay.free()
            self._relay = None

    # ---- implicit pre-arms (machines/autoarm.py) ------------------------------------------------
    def _auto_after_submit(self, job: Job) -> None:
        """Job ``job`` (a decode of a sequence whose job before was submitted just before
        it) is on the device: queue the guess of its successor for the submitter."""
        if (self.dispatch.guess(job.request.seq_id) is None and self.life.admitting
                and not self._stopping_threads and job.gen is self.gen
                and (self.completion.decode_exec_us >= self._tuning.auto_prearm_min_us
                     or not self.config.threads)):
            delay = self.arm_delay_s()
            self.dispatch.add_guess(AutoArm(self, job),
                                    self.clock.monotonic() + delay if delay > 0 else 0.0)

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
                                           self.clock.monotonic() + ARMING_WAIT_S)
        if job is None:
            return None
        gen = job.gen
        # fencing as on the ordinary path: until the job is queued or released, a recovery
        # waits for this thread to leave the generation
        if gen is None or not dispatch.enter(gen, self.gen):
            self.outcomes.release_guesses([job], "released: its generation is closing")
            return None
        try:
            # The guess is adopted only by the request the plain path would admit: anything
            # else is released and admitted the ordinary way, which answers exactly as
            # without guesses (the checks in the plain path's order: lifecycle, §6.3 and
            # caller checks, deadline, token budget, then KV: the job before committed and
            # the sequence is not Unknown, else kv.sequence_busy / kv.sequence_unknown).
            ok = (self.life.admitting and not self.life.stopping
                  and entry.matches(job, request, logits_out)
                  and self.clock.monotonic() < request.deadline)  # else: admission answers
            if ok:
                ok = (check_request(request, gen.contracts).ok and _check_caller_arguments(
                    request, logits_out, gen.contracts.vocab_size).ok)
            # the guess already holds the request's one token of budget
            ok = ok and not dispatch.over_budget(0, self._token_budget())
            ok = ok and gen.kvc.is_open(job.txn)
            if not ok:
                self.outcomes.release_guesses([job], "released: another request came")
                return None
            job.request = request
            job.deadline = request.deadline
            job.uncounted = False
            job.count_as_client()
            job.auto_next = True
            job.early_wake_s = self._early_wake_s()  # as of now, not of the arming
            self.outcomes.bump("auto_prearmed")
            handle = JobHandle(job)
            if on_created is not None:
                try:
                    on_created(handle)
                except BaseException as exc:  # the caller's callback: it raises to the caller,
                    self.outcomes.fail_before_submit(job, Status.internal(  # as the plain path
                        "on_created_raised", Phase.ADMISSION, f"on_created raised "
                        f"{type(exc).__name__}: {exc}", **job.ctx()))
                    raise
            status = dispatch.queue_fired(job, int(request.tokens[0]), self.gen,
                                          self._relay_offer if self._relay_open else None)
            if status is not None:
                return self.outcomes.fail_before_submit(job, status)
            if job.relayed:
                self._relay_fire(job)
            return handle
        finally:
            dispatch.exit(gen)

    def _prewake_at(self, now: float) -> float | None:
        """When the submitter's idle wait ends early (``Completion.prewake_at``; no lock)."""
        return self.completion.prewake_at(now, self._tuning.prewake_s)

    def _unsubmittable(self, job: Job, now: float) -> Status | None:
        """Why a queued or armed job can no longer be submitted, or None (a pure check,
        called by the dispatch under its lock)."""
        refusal = self.dispatch.refusal
        if refusal is not None:
            return refusal.with_context(**job.ctx())
        if job.cancel_flag:
            return Status.cancelled(Phase.SUBMIT, job.cancel_message(), **job.ctx())
        if now >= job.deadline:
            return Status.deadline(Phase.SUBMIT, "queue deadline passed before infer()",
                                   **job.ctx())
        gen = job.gen
        # ``gen.closing`` alone decides; ``gen is None`` and ``gen is not self.gen`` are kept
        # as a guard and never change the answer (a hand mutant dropping them survives every
        # test, and must): (1) a queued or armed job holds a generation (``_enqueue`` refuses
        # with none before a job can be queued or armed), and (2) a generation stops being
        # ``self.gen`` only after it was closed: every path that replaces or clears the
        # executor's generation (a recovery, a model switch and its roll back, a refused
        # generation, a failed start, a shutdown) first fences it (``Dispatch.close``, under
        # this lock) or releases it (``Generation.release``), both setting ``closing``, which
        # is never cleared; a generation that never became current holds no job. The
        # invariant (2) is checked at every runtime call of those paths by
        # tests/test_core_probe60.py::test_a_generation_that_is_not_the_current_one_is_always_closing.
        if gen is None or gen is not self.gen or gen.closing:
            return Status.unavailable(Phase.SUBMIT, f"generation {job.generation_id} retired "
                                      "before submit; retry", **job.ctx())
        return None

    # ---- armed jobs: what DecodeStream and AutoArm use (not an embedder's API) --------------
    def admit_armed(self, request: InferenceRequest, logits_out: np.ndarray | None,
                    arm: Arm) -> Job:
        """Admit and prepare ``request``'s job up to Preparing and keep it armed (``arm``:
        chained behind its predecessor's KV txn, waiting or not; ``arm.on_created`` as
        ``enqueue``'s): the ordinary admission path stopping before Queued. The job
        (resolved with why when nothing was armed)."""
        return job_of(self._enqueue(request, internal=False, logits_out=logits_out, arm=arm,
                                    on_created=arm.on_created))

    def step_refused(self, seq_id: int) -> Status:
        """Why a stream's step finds no generation to check its token against (shut down,
        or between two generations): what ``enqueue`` answers then, naming ``seq_id``."""
        return self._not_admitting(seq_id=seq_id)

    @property
    def expected_decode_s(self) -> float:
        """A decode job's device time as the completion thread measures it (moving
        average; 0 before the first)."""
        return self.completion.decode_exec_us / 1e6

    def fire_armed(self, job: Job, token: int, rearm: Armer | None = None,
                   arm_delay_s: float = 0.0) -> JobHandle | None:
        """A pre-armed decode job gets its token and joins the submit queue: the token id is
        written into the leased slot's input and the request, the chart goes Preparing ->
        Queued, the submitter is woken (``Dispatch.fire``). ``rearm``: the armer whose next
        job the submitter arms ``arm_delay_s`` from now. None when the job was not armed any
        more: someone released it (cancelled, expired, fenced, reclaimed for a request short
        of a slot or budget); it was a guess, and the caller admits its step the ordinary
        way.

        Once a shutdown has begun (``stopping``) the job is released and None returned: the
        token came after the shutdown, and the step is answered as an ``enqueue`` then is
        (``lifecycle.unavailable`` naming the shutdown), whether or not its job was still
        armed. (Fired, a job the shutdown's cancel had flagged answered ``request.cancelled``;
        released first, the same step answered ``lifecycle.unavailable``: the submitter's
        timing chose.) A token that came before is queued, and the shutdown cancels it as it
        cancels a queued ``enqueue``: ``request.cancelled``, naming the shutdown."""
        if self.life.stopping:
            self.release_armed(job, self._not_admitting(**job.ctx()))
            return None
        at = self.clock.monotonic() + arm_delay_s if arm_delay_s > 0 else 0.0
        owned, status = self.dispatch.fire(job, token, self.gen, rearm, at,
                                           self._relay_offer if self._relay_open else None)
        if not owned:
            return None
        if status is not None:
            return self.outcomes.fail_before_submit(job, status)
        handle = JobHandle(job)
        if job.relayed:
            self._relay_fire(job)
        return handle

    def release_armed(self, job: Job, status: Status) -> bool:
        """Release a pre-armed job that will not get a token (its stream closed): lease,
        KV txn rolled back, budget, chart Failed, exactly once (False when someone else
        owned it already). Not counted: nobody asked for it."""
        if not self.dispatch.take_armed(job):
            return False
        self.outcomes.fail_before_submit(job, status.with_context(**job.ctx()))
        return True

    def armed_step_failed(self, status: Status) -> None:
        """A decode stream's step whose job, armed before its token came, failed its
        preparation with a fault (a runtime call refused it: ``outcomes.is_fault``): counted
        and reported once the step is asked for, as the plain path's admission of that step
        counts and reports it (the arming, a guess nobody asked for yet, did neither)."""
        self.outcomes.count(status)
        self.faults.report(status)

    def arm_delay_s(self) -> float:
        """How long after a step's infer the submitter arms the next one: ``tuning.
        arm_delay_s``, at most a quarter of a decode job's expected device time."""
        return (min(self._tuning.arm_delay_s, self.completion.decode_exec_us / 4e6)
                if self.config.threads else 0.0)

    def _submit(self, job: Job) -> None:
        gen, slot = job.gen, job.lease.slot
        if not job.in_flight_marked:  # (a job the relay refused was marked already)
            gen.pool.mark_in_flight(job.lease)
            job.in_flight_marked = True
        self.infer_threads.add(threading.current_thread().name)
        self._after_infer(job, self._infer(gen, slot, job.request.seq_id))

    def _after_infer(self, job: Job, rc: int) -> None:
        """What follows the first ``infer`` of ``job`` (the submitter's, in Python or in its
        relay): the §8 retries of a busy device, the rollback of a refused job, or the job
        on the device (Submitted, KV submitted, the completion queue)."""
        gen, slot = job.gen, job.lease.slot
        attempt = 0
        while rc == CalrtCode.DEVICE_BUSY and attempt < self.config.recovery.submit_retries:
            # §8 Transient row: the runtime did not run the graph; bounded retry with backoff.
            attempt += 1
            self.outcomes.bump("submit_retries")
            self.completion.submit_backing_off(job)
            self.clock.sleep(self.faults.backoff(attempt))
            rc = self._infer(gen, slot, job.request.seq_id)
        if rc != CalrtCode.SUCCESS:
            # FI05: the runtime did not take the job: software rollback, no Wait.
            self._not_submitted(job, Status.from_calrt(rc, Phase.SUBMIT, "infer",
                                                       **job.ctx()))
            return
        job.timings.submitted_us = self.clock.now_us()
        job.submitted_at = self.clock.monotonic()  # the §9.1 execution deadline's start
        job.run.send(JOB_EV_INFER_ACCEPTED)
        gen.kvc.mark_submitted(job.txn, evidence=job)
        self.outcomes.bump("submitted")
        self.completion.push(job)

    def _not_submitted(self, job: Job, status: Status) -> None:
        """A job the submitter took whose infer never started it (refused, or never given
        to infer): its slot back from in flight, its permit, then failed with ``status``."""
        job.gen.pool.device_done(job.lease)
        self.dispatch.release_permit(job)
        self.outcomes.fail_before_submit(job, status)

    def _plain_infer(self, slot: BufferSlot) -> bool:
        """Whether ``slot``'s jobs go to plain ``infer()`` (not Phase B's fixed engine)."""
        return slot.engine == EngineSlot.AUTO or self.feature_disabled("fixed_engine")

    def _infer(self, gen: Generation, slot: BufferSlot, seq_id: int) -> int:
        """Phase A: infer(); Phase B: infer_with_fixed_task_type on the slot's PING/PONG
        (plain infer() while ``fixed_engine`` is switched off)."""
        device: DeviceApi = self.device
        if self._plain_infer(slot):
            return device.infer(slot.model, gen.kv, seq_id, slot.inbuf, slot.outbuf)
        return device.infer_with_fixed_task_type(slot.model, gen.kv, seq_id, slot.inbuf,
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

    # ---- completion (§6.5) -----------------------------------------------------------------------
    def complete_one(self, block: bool = False) -> bool:
        """Wait for the oldest submitted job and finish it (``Completion.complete_one``).
        False when none is submitted."""
        # the thread's barrier resolves the job it holds if this raises
        return self.completion.complete_one(
            block, self._completion_holds)

    def let_end(self, handle: JobHandle, until: float) -> None:
        """Let the job of ``handle`` (cancelled, never taken: a step a greedy stream fired
        ahead) end, so the KV txn it holds is settled when this returns. Threaded: wait for
        it, until ``until`` (``Clock.monotonic()``); not on the executor's own threads (only
        they end it). Stepped (``threads=False``): while it is still queued, this thread
        runs ``submit_one``, which fails a cancelled queued job before it submits anything
        (no device call, no wait); one already submitted ends only when the caller drives
        ``complete_one`` (a Wait on the device, which a stepped device answers only when
        the test moves it): docs/embedding.md §3. Not from inside a step of this executor
        (a done callback), which it would re-enter. (Until stop 62 a stepped executor did
        nothing: the discarded step stayed queued with the sequence's KV txn open, and
        ``release_sequence``, a request of the sequence or a greedy stream's ``close()``
        then release answered ``kv.sequence_busy`` where the plain path, with no step fired
        ahead, answers ``OK``.)"""
        if handle.done or self.on_worker_thread():
            return
        if self.config.threads:
            handle.wait_until(until)
            return
        if any(job is not None for job in self._holding.values()):
            return  # inside a step of this executor (a done callback): never re-entered
        job = job_of(handle)
        while not handle.done and not job.submitted_at and self.submit_one():
            pass

    @property
    def completing(self) -> int:
        """Jobs submitted and not completed yet (no lock: a length)."""
        return len(self.completion)

    def execution_deadline(self, job: Job) -> float:
        """The §9.1 execution deadline of a submitted ``job`` (Clock.monotonic())."""
        return self.completion.execution_deadline(job)

    def cancelled_job_bound(self, handle: JobHandle) -> float:
        """By when (Clock.monotonic()) the cancelled job of ``handle`` is resolved, whatever
        the device does: a submitted job by its §9.1 execution deadline (the completion
        thread's Wait is bounded by it), one not submitted yet by the deadline it would have
        if infer() accepted it now; plus ``timeout_grace_s`` for the completion thread to end
        it. ``decode_sync`` waits this long for the job it cancelled at the caller's deadline."""
        job = job_of(handle)
        submitted = job.submitted_at  # 0.0 until infer() accepted it
        end = self.completion.execution_deadline(job)  # the one formula (§9.1)
        if not submitted:  # (submitted meanwhile: a later bound, still a bound)
            end += self.clock.monotonic()
        return end + self.config.timeout_grace_s

    # ---- threads ---------------------------------------------------------------------------------
    _stopping_threads = False

    def start_threads(self) -> None:
        self._stopping_threads = False
        self.dispatch.stop(False)
        self.completion.stop(False)
        self._open_relay()
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
        phase = Phase.SUBMIT if "submit" in name else Phase.WAIT
        message = f"{name} raised {type(exc).__name__}: {exc}"
        status = (Status.internal("thread_exception", phase, message) if job is None else
                  Status.internal("thread_exception", phase, message, **job.ctx()))
        log.error("executor thread %s caught %s (job %s); reported as a fault", name,
                  status, None if job is None else job.job_id, exc_info=exc)
        self.thread_faults.append({"thread": name, "error": f"{type(exc).__name__}: {exc}",
                                   "job": None if job is None else job.job_id,
                                   "at": self.clock.monotonic()})
        abandon = job is not None and not job.done
        if abandon:
            self.outcomes.abandon_after_submit(job, status)
        try:  # first the controller: admission stops before the caller sees the failure
            self.faults.report(status, job)
        except Exception:  # noqa: BLE001 - a failing fault sink must not kill the barrier
            log.exception("fault sink raised while reporting %s", status)
            self.life.fail(status)
        if abandon:
            self.outcomes.count(status)
            job.resolve(status)

    def on_worker_thread(self) -> bool:
        """The calling thread is this executor's submitter or completion thread (a done
        callback runs there): it must not wait for what only that thread does."""
        return threading.current_thread() in self._threads  # a list of two: identity

    def threads_alive(self) -> dict[str, bool]:
        return {t.name: t.is_alive() for t in self._threads}

    def health(self) -> list[str]:
        """Why the executor cannot serve now (empty: it can). Part of readiness: a dead
        executor thread, a job on the device past its deadline, buffers the device has not
        let go of, a lifecycle that is not Ready."""
        reasons = []
        life = self.life
        state = life.run.state
        forked = life.forked_why()
        if forked is not None:
            return [forked]
        if state != LIFECYCLE_READY or not life.admitting:
            reasons.append(f"lifecycle is {state}" + ("" if life.admitting else
                                                     ", not admitting"))
            if life.failure is not None and state == LIFECYCLE_FAILED:
                reasons.append(f"failed: {life.failure}")
        if self.config.threads and not life.stopping:
            for name, alive in self.threads_alive().items():
                if not alive:
                    reasons.append(f"executor thread {name} is not running")
        job = self.completion.waiting_on
        if job is not None and not job.done:
            now = self.clock.monotonic()
            execution = self.completion.execution_deadline(job)
            stalled = job.deadline + self.config.stall_after_s
            # named after the deadline that passed: a job hung past its execution deadline
            # is usually well within its request's deadline (it read "-18.989s past its
            # deadline")
            if execution <= stalled and now >= execution:
                reasons.append(f"job {job.job_id} (seq {job.request.seq_id}) is on the device "
                               f"{now - execution:.3f}s past its execution deadline "
                               f"(submitted {now - job.submitted_at:.3f}s ago)")
            elif now >= stalled:
                reasons.append(f"job {job.job_id} (seq {job.request.seq_id}) is on the device "
                               f"{now - job.deadline:.3f}s past its deadline")
        held = len(self.dispatch.held())
        if held:
            reasons.append(f"the device has not let go of {held} failed job(s)")
        return reasons

    def refuse_on_worker_thread(self, call: str, owner: str = "DeviceExecutor") -> None:
        """RuntimeError naming ``call`` and the thread when the calling thread is this
        executor's submitter or completion thread, i.e. a done callback called the executor
        (docs/embedding.md section 4 forbids it). ``shutdown`` there stopped admission, then
        failed to join its own thread ("cannot join current thread") and left the lifecycle
        Draining; ``decode_sync`` there waited for a job only that same thread can complete,
        stalling every other job until the deadline; ``enqueue`` there stalled them the same
        way whenever its admission waited for KV or a buffer; ``recover`` and ``switch_model``
        there drained a generation whose job that very thread holds, for ``drain_grace_s``
        twice around a reset, and ended the lifecycle Failed (``recovery.not_drained``). Each
        is refused before anything changes. A decode stream's ``submit`` and ``wait``
        (``owner`` ``DecodeSteps``) are refused the same way: a step there waited for a job
        only that thread completes, past the stream's deadline, and every other job with it;
        and so are a handle's ``wait_until`` and ``result`` (``owner`` ``JobHandle``, through
        ``Job.refuse_wait``) for a job not resolved yet."""
        if self.on_worker_thread():
            current = threading.current_thread()
            raise RuntimeError(
                f"{owner}.{call}() called on the executor's own thread {current.name} "
                "(from a done callback?): it could wait for that thread itself; a done "
                "callback must only hand the result on (loop.call_soon_threadsafe, "
                "queue.put_nowait) and call the executor from a thread of yours")

    def stop_threads(self, timeout: float = 5.0, deadline: float | None = None) -> None:
        """Stop the submitter and completion threads, waiting at most ``timeout`` seconds in
        all for them to end (a completion thread in a Wait() the device never answers does
        not end: it is left, a daemon, and the relay stays open for it). ``deadline`` (a
        ``Clock.monotonic()`` value), when given, ends the wait instead: a shutdown's own,
        not what was left of it (seconds added to a later reading end later)."""
        self._stopping_threads = True
        self.dispatch.stop()
        self.completion.stop()
        until = self.clock.monotonic() + max(0.0, timeout) if deadline is None else deadline
        for thread in self._threads:
            self.clock.join(thread, until - self.clock.monotonic())
        self._threads = [t for t in self._threads if t.is_alive()]
        self._close_relay(threads_gone=not self._threads)

    # ---- synchronous compatibility entry (§6.1) -------------------------------------------------
    def decode_sync(self, request: InferenceRequest, logits_out: np.ndarray | None = None
                    ) -> tuple[int, InferenceResult | Status]:
        """``llama_decode``-style: (int code, result or Status). Logs every failure with
        job_id, seq_id, generation, raw CalRT code and phase. ``logits_out`` as for
        ``enqueue`` (a llama context's own logits row: no allocation per token). Called on
        the submitter or completion thread (a done callback) it raises RuntimeError
        (``refuse_on_worker_thread``)."""
        self.refuse_on_worker_thread("decode_sync")
        handle = self.enqueue(request, logits_out=logits_out)
        if not self.config.threads:
            while not handle.done and (self.submit_one() or self.complete_one()):
                pass
        # a refused request (not an InferenceRequest, a NaN deadline) is resolved already
        result = handle.wait_until(None if handle.done else request.deadline)
        if not handle.done and isinstance(result, Status):  # the caller gets an error now:
            handle.cancel()  # nobody takes this result: it must not write logits_out (FI12)
            # The caller has no handle to wait on: wait (bounded) here for the cancelled job
            # to resolve, so that once decode_sync returns its sequence may be released and
            # its logits_out reused (docs/embedding.md section 3).
            if self.config.threads:
                handle.wait_until(self.cancelled_job_bound(handle))
            else:
                while not handle.done and (self.submit_one() or self.complete_one()):
                    pass
            result = Status.deadline(
                Phase.WAIT, "decode_sync deadline passed; the job was cancelled"
                + ("" if handle.done else f" and is still on its way (state {handle.state})"),
                job_id=result.job_id, seq_id=result.seq_id, generation=result.generation)
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
                      stop_tokens: Collection[int] = (), max_steps: int | None = None
                      ) -> DecodeStream:
        """Decode steps of ``seq_id`` from ``past_len`` (its committed length) with the next
        job pre-armed while the current one runs: ``stream.step(token)`` per token. Every job
        has ``deadline`` (absolute ``time.monotonic()``); ``max_len``: the stream never arms
        a job beyond this sequence length (prompt + max_tokens). The first job is armed now
        if its resources are free. ``greedy_ahead``: the completion thread fires each next job
        with the argmax of the one before (not after one of ``stop_tokens``, nor beyond
        ``max_steps`` jobs); the caller still calls ``step(result.argmax)``. See
        machines/stream.py."""
        from calexec.machines.stream import DecodeStream
        _check_stream_arguments(max_len=max_len, max_steps=max_steps, stop_tokens=stop_tokens,
                                greedy_ahead=greedy_ahead)
        # the stream arms its own; a step an earlier greedy stream fired ahead leaves first
        self.outcomes.release_armed_of(seq_id, ahead_until=self.clock.monotonic() + 1.0)
        stream = DecodeStream(self, seq_id, past_len, deadline, logits_out, want_logits,
                              max_len, request_id, greedy_ahead, stop_tokens, max_steps,
                              refused=self._admits_no_stream(seq_id))
        if not stream.closed:
            self.dispatch.open_stream(seq_id, stream)  # (``_drop_armed``: its step ahead)
        return stream

    # ---- observability ---------------------------------------------------------------------------
    def snapshot(self) -> ExecutorSnapshot:
        dispatch = self.dispatch.snapshot()
        gen = self.gen  # (read once: the generation, its slots and its KV are of one generation)
        pool = None if gen is None else gen.pool
        kvc = None if gen is None else gen.kvc
        kv_blocks, kv_seqs = (0, []) if kvc is None else kvc.usage()
        return cast(ExecutorSnapshot, {
            "lifecycle": self.life.run.state,
            "generation": None if gen is None else gen.id,
            "queued": dispatch["queued"],
            "completing": len(self.completion),  # submitted, not completed yet
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
            "recoveries": sum(self.life.recovery_totals.values()),
            "recoveries_dropped": self.life.dropped_recoveries,
            "golden": self.life.golden_source,
            "allow_unpinned_golden": self.config.allow_unpinned_golden,
            "faults_reported": (self.faults.reported() if isinstance(self.faults, FaultController)
                                else []),
            "thread_faults": len(self.thread_faults),
            "waiting_for_ready": self.life.ready_waiters,
            "retired_generations_kept": len(self.life.retired),
            "kv_blocks_reserved": kv_blocks,
            "kv_blocks_capacity": None if kvc is None else kvc.capacity_blocks(),
            "kv_sequences": kv_seqs,
            **self.counters,
        })
