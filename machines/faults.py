"""Fault controller: the §8 table's automatic actions, applied to every reported failure.

The executor reports every failure that concerns the device or the generation (every
failure after submit, runtime errors before it, golden mismatches, a device that never lets
go of a job). The controller looks the Status up row by row and decides:

=====================  ==========================================================================
category               decision
=====================  ==========================================================================
REQUEST_ARTIFACT       record the manifest difference; keep serving; no reset
LIFECYCLE              drain and rebuild the generation (generation+1), no reset
ARTIFACT               refuse the generation: roll back to the last known good calbin
COMPATIBILITY          stop: lifecycle Failed with the reason; no automatic retry
TRANSIENT              admission reduced while transient faults are recent; past
                       ``transient_threshold`` within ``transient_window_s``: drain and rebuild
DEVICE                 stop admission at once, quarantine, reset, rebuild; escalate to Failed
                       past ``max_recoveries`` within ``recovery_window_s``
PROGRAMMING            switch the feature off until the next generation
                       (``DeviceExecutor.disable_feature``: the Phase B fixed-engine path);
                       ``disabled_features`` records the phases; no reset
UNKNOWN, INTERNAL      the generation is tainted (NaN/Inf output, short output, golden
                       mismatch, unlisted codes): reset and rebuild, golden re-run (FI10)
CANCELLED, DEADLINE,   the request's own outcome: nothing to do
RESOURCE_EXHAUSTED,
INVALID_REQUEST,
UNAVAILABLE
=====================  ==========================================================================

Once the lifecycle ended (Failed, Stopped), or a STOP was decided, a report is part of the
incident that ended it: counted in ``reported()``, decided ``none``, logged at INFO (never a
second escalation: a hung job's ``device.hung`` after the ``execution.deadline`` that escalated).

The controller never blocks the reporting thread: a recovery runs on its own thread (or, in
stepped mode, waits for the test to call ``DeviceLifecycle.run_pending_recovery``). Every
decision is kept in ``decisions`` (bounded) for logs, metrics and tests. Thresholds are
``RecoveryPolicy`` fields with the defaults documented there.
"""

from __future__ import annotations

import enum
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import attrs

from calexec.contracts import fields
from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.machines.clock import SYSTEM
from calexec.machines.locks import FAULTS

if TYPE_CHECKING:
    from calexec.machines.job import Job

log = logging.getLogger("calexec.faults")


class Action(enum.Enum):
    NONE = "none"
    RECORD = "record"  # keep serving, remember (manifest difference)
    REDUCE_ADMISSION = "reduce_admission"  # transient below the threshold
    REBUILD = "rebuild"  # drain, generation+1 of the same calbin, no reset
    RESET_REBUILD = "reset_rebuild"  # drain, reset, generation+1, golden
    ROLLBACK = "rollback"  # drain, generation+1 of the last known good calbin
    DISABLE_FEATURE = "disable_feature"
    STOP = "stop"  # Failed, a person must act


def _policy_number(low: float, high: float = math.inf, *, integral: bool = False,
                   above: bool = False) -> Callable[[Any, Any, Any], None]:
    """attrs validator of a ``RecoveryPolicy`` field (``fields.number``). A NaN drain grace or
    window compares false with every time (a drain never ends, a window never holds a
    fault), a str fails deep in a recovery: refused when the policy is built."""
    return fields.number(low, high, integral=integral, above=above, owner="RecoveryPolicy")


#: the resets a recovery may use (``RecoveryPolicy.reset_kind``)
RESET_KINDS = ("reset", "reset_ccu", "reset_configuration", "none")


def _reset_kind(instance: Any, attribute: Any, value: Any) -> None:
    """attrs validator of ``RecoveryPolicy.reset_kind``: one of ``RESET_KINDS``, named as the
    other fields are (attrs' ``in_`` raised a ValueError whose text was a tuple of the
    message, the whole ``Attribute`` repr, the options and the value)."""
    if value in RESET_KINDS and isinstance(value, str):
        return
    error = ValueError if isinstance(value, str) else TypeError
    raise error(f"RecoveryPolicy.reset_kind={value!r}: expected one of "
                f"{', '.join(map(repr, RESET_KINDS))}")


@attrs.define
class RecoveryPolicy:
    """Recovery thresholds (documented defaults)."""

    #: which reset a recovery uses: "reset" | "reset_ccu" | "reset_configuration" | "none".
    #: "none" means the runtime offers no safe reset: a hung device ends Failed and the
    #: embedding process exits for its supervisor (§9.1).
    reset_kind: str = attrs.field(default="reset", validator=_reset_kind)
    #: how long a drain waits for submitted jobs before the reset (or Failed); a recovery's
    #: drain ends sooner once all that is left is jobs declared hung (``device.hung``)
    drain_grace_s: float = attrs.field(default=5.0, validator=_policy_number(0))
    #: escalation: more recoveries than this within the window -> Failed
    max_recoveries: int = attrs.field(default=5, validator=_policy_number(0, integral=True))
    recovery_window_s: float = attrs.field(default=60.0, validator=_policy_number(0, above=True))
    #: transient faults (13, 17) within the window before a drain + rebuild
    transient_threshold: int = attrs.field(default=8, validator=_policy_number(1, integral=True))
    transient_window_s: float = attrs.field(default=10.0, validator=_policy_number(0, above=True))
    #: admission budget factor while transient faults are recent
    reduced_admission: float = attrs.field(default=0.5, validator=_policy_number(0, 1, above=True))
    #: infer() retries on a transient code (the runtime did not run the graph), with
    #: exponential backoff from backoff_base_s, capped at backoff_max_s, +/- jitter fraction
    submit_retries: int = attrs.field(default=2, validator=_policy_number(0, integral=True))
    #: retries of a KV reservation the KvManager refused while the host's books show the
    #: blocks free (``kv.refused``, §8 TRANSIENT), each after ``backoff``; then it waits
    #: for KV given back until its deadline (FI04)
    kv_refusal_retries: int = attrs.field(default=3, validator=_policy_number(0, integral=True))
    backoff_base_s: float = attrs.field(default=0.001, validator=_policy_number(0))
    backoff_max_s: float = attrs.field(default=0.02, validator=_policy_number(0))
    jitter: float = attrs.field(default=0.5, validator=_policy_number(0, 1))


_ACTIONS: dict[Category, Action] = {
    Category.REQUEST_ARTIFACT: Action.RECORD,
    Category.LIFECYCLE: Action.REBUILD,
    Category.ARTIFACT: Action.ROLLBACK,
    Category.COMPATIBILITY: Action.STOP,
    Category.TRANSIENT: Action.REDUCE_ADMISSION,
    Category.DEVICE: Action.RESET_REBUILD,
    Category.PROGRAMMING: Action.DISABLE_FEATURE,
    Category.UNKNOWN: Action.RESET_REBUILD,
    Category.INTERNAL: Action.RESET_REBUILD,
}


@attrs.frozen
class Decision:
    action: Action
    status: Status
    reason: str
    at: float = attrs.field(factory=time.monotonic)


class FaultController:
    """Applies the §8 automatic actions for one executor (``attach`` wires it)."""

    def __init__(self, policy: RecoveryPolicy | None = None, seed: int | None = None) -> None:
        self.policy = policy or RecoveryPolicy()
        self.executor: FaultTarget | None = None
        self.decisions: deque[Decision] = deque(maxlen=1000)
        self.manifest_differences: deque[Status] = deque(maxlen=100)
        self.disabled_features: set[str] = set()
        #: every fault reported, by (category, code, raw CalRT code or None): ``reported()``
        self._by_kind: dict[tuple[str, str, int | None], int] = {}
        self._transients: deque[float] = deque()
        self._recoveries: deque[float] = deque()
        self._mu = threading.Lock()  # faults_mu (a leaf); ranked once attached
        self._clock = SYSTEM
        self._rng = random.Random(seed)
        self._fired_seen = 0  # the runtime's injected-fault count at the last report
        #: counted recovery decisions whose ``request_recovery`` has not returned yet
        #: (``faults_mu``): until it marks the recovery pending, the executor's
        #: ``recovery_under_way`` cannot tell, and a second fault of the same incident
        #: reported meanwhile counted against ``max_recoveries`` as well
        self._requesting = 0
        #: the jobs whose fault counted a recovery (``faults_mu``; the last 64, by job id): a
        #: second report of one of them (``device.hung`` after its ``execution.deadline``)
        #: is the same incident, whatever the lifecycle does meanwhile. A golden job of a
        #: recovery is reported while Configuring/Warming, where no recovery is "under way":
        #: both of its reports counted, one hung golden job spending two recoveries
        self._counted_jobs: deque[int] = deque(maxlen=64)
        #: a STOP was decided (``faults_mu``): the lifecycle ends Failed, for good. Every later
        #: report, also one made before that ``fail()`` returned, is decided ``none``
        self._stopped = False

    def attach(self, executor: FaultTarget) -> None:
        """Wire the controller to ``executor``: its clock, and a ranked leaf lock
        (``faults_mu``) from its lock order. A STOP decided for the executor attached before
        is that one's: the new one's faults are decided again (a controller kept across
        executors decided every fault of the next one ``none``, its hung jobs never reset)."""
        self.executor = executor
        self._stopped = False
        locks = getattr(executor, "locks", None)
        if locks is not None:
            self._mu = locks.lock(FAULTS)
            self._clock = locks.clock

    # ---- the table ------------------------------------------------------------------------
    def decide(self, status: Status, under_way: bool = False) -> Decision:
        """The decision for one failure (pure but for the sliding windows). ``under_way``: a
        recovery asked for from Ready has not reached its new generation yet (pending, or
        draining and resetting the old one): a fault met meanwhile (the second report of one
        hung job, ``execution.deadline`` then ``device.hung``; a job the recovery's reset
        aborted; the pool that fault left exhausted) belongs to the incident it covers and
        neither counts against ``max_recoveries`` nor escalates. Each counted as a recovery,
        a single hung job spent two, so ``max_recoveries=5`` ended the lifecycle Failed at
        the third hung job, after two recoveries. ``report`` also passes True while another
        report's counted decision is still being asked for (not pending yet), and for a
        second report of a job whose first one counted. A fault of a recovery's golden run
        (Configuring, Warming) still counts: each golden attempt is one (``_retry_golden``),
        its hung job's ``device.hung`` after its ``execution.deadline`` not a second."""
        now = self._clock.monotonic()
        category = status.category
        if category is None:  # OK: nothing happened
            return Decision(Action.NONE, status, "ok", now)
        action = _ACTIONS.get(category, Action.NONE)
        reason = f"{category.value}: {status.code}"
        if action is Action.RECORD:
            reason += ("; a manifest difference: the runtime refused what the manifest's checks "
                       "passed, compare the manifest with the calbin (the generation serves on, "
                       "no reset)")
        if action is Action.REDUCE_ADMISSION:
            window = self._transients
            window.append(now)
            while window and now - window[0] > self.policy.transient_window_s:
                window.popleft()
            if len(window) >= self.policy.transient_threshold:
                window.clear()
                action, reason = Action.REBUILD, (
                    f"{self.policy.transient_threshold} transient faults within "
                    f"{self.policy.transient_window_s}s (last: {status.code})")
        if action in (Action.REBUILD, Action.RESET_REBUILD, Action.ROLLBACK) and under_way:
            reason += " (a recovery is already under way: not counted)"
        elif action in (Action.REBUILD, Action.RESET_REBUILD, Action.ROLLBACK):
            recent = self._recoveries
            while recent and now - recent[0] > self.policy.recovery_window_s:
                recent.popleft()
            if len(recent) >= self.policy.max_recoveries:
                action, reason = Action.STOP, (
                    f"escalation: {len(recent)} recoveries within "
                    f"{self.policy.recovery_window_s}s; last fault {status.code}")
            else:
                recent.append(now)
        return Decision(action, status, reason, now)

    def report(self, status: Status, job: Job | None = None) -> None:
        """FaultSink: decide and act. Never blocks on a recovery."""
        if status.ok or status.category is None:
            return
        injected = self._injected()  # before the lock: it asks the runtime
        target = self.executor
        with self._mu:
            kind = (status.category.value, status.code, status.raw)
            self._by_kind[kind] = self._by_kind.get(kind, 0) + 1
            # (a read of the lifecycle without its lock: no lock is taken under faults_mu)
            job_id = job.job_id if job is not None else status.job_id
            counted = job_id is not None and job_id in self._counted_jobs
            final = target.lifecycle_final() if target is not None else None
            if final is None and self._stopped:
                final = "Failed"  # a STOP decided: its ``fail()`` may not have returned yet
            if final is not None:
                # the lifecycle ended (Failed, Stopped): nothing is left to drain, reset or
                # stop. A hung job's ``device.hung`` after the ``execution.deadline`` whose
                # escalation ended it Failed was decided again, escalated again and logged
                # as a second ``-> stop (escalation: ...)`` for one incident
                decision = Decision(Action.NONE, status, (
                    f"the lifecycle is already {final}: part of the incident that ended it; "
                    "not counted"), self._clock.monotonic())
                self.decisions.append(decision)
                log.info("%sfault %s: the lifecycle is already %s; nothing to do (not counted)",
                         "INJECTED " if injected else "", status, final)
                return
            under_way = counted or self._requesting > 0 or (
                target is not None and target.recovery_under_way())
            decision = self.decide(status, under_way)
            requesting = not under_way and decision.action in (
                Action.REBUILD, Action.RESET_REBUILD, Action.ROLLBACK)
            if requesting:
                self._requesting += 1
                if job_id is not None:
                    self._counted_jobs.append(job_id)
            self._stopped = self._stopped or decision.action is Action.STOP
            self.decisions.append(decision)
            if decision.action is Action.RECORD:
                self.manifest_differences.append(status)
            elif decision.action is Action.DISABLE_FEATURE:
                self.disabled_features.add(status.phase.value if status.phase else status.code)
        if decision.action is Action.DISABLE_FEATURE and self.executor is not None:
            self.executor.disable_feature(status, job)  # (it logs the feature switched off)
        if decision.action is Action.NONE:
            # nothing to act on (a job the recovery's own reset aborted, ``recovery.job_aborted``:
            # a knock-on), but counted in ``reported()`` (``calexec_device_faults_total``): its
            # one line, so the log accounts for every fault the metric counts (it had none)
            log.info("%sfault %s -> none (%s)", "INJECTED " if injected else "", status,
                     decision.reason)
        if decision.action in (Action.RECORD, Action.REDUCE_ADMISSION):
            # §8: the generation serves on, nothing drains or resets; the fault is still its
            # one line (docs/operations.md), or the manifest difference the row records and
            # the reduced admission were told to nobody but a Python deque and a factor
            log.warning("%sfault %s -> %s (%s)", "INJECTED " if injected else "", status,
                        decision.action.value, decision.reason)
        if decision.action not in (Action.NONE, Action.RECORD, Action.REDUCE_ADMISSION,
                                   Action.DISABLE_FEATURE):
            log.warning("%sfault %s -> %s (%s)", "INJECTED " if injected else "",
                        status, decision.action.value, decision.reason)
            try:
                if self.executor is not None:
                    self.executor.request_recovery(decision)
            finally:
                if requesting:  # it is pending now (or refused: not Ready): the lifecycle says
                    with self._mu:
                        self._requesting -= 1

    def reported(self) -> list[tuple[str, str, int | None, int]]:
        """Every fault reported so far, by kind: ``(category, code, raw, count)`` sorted, the
        raw CalRT code None when the Status has none. A fault the executor absorbed (a job
        resumed after its recovery) is counted here too, where no request failed for it."""
        with self._mu:
            return sorted(((category, code, raw, n) for (category, code, raw), n
                           in self._by_kind.items()), key=lambda k: (k[0], k[1], k[2] or -1))

    def _injected(self) -> bool:
        """The runtime's fault plan fired since the last look (the emulator counts the faults
        it injects; a vendor runtime answers None: never marked). Read outside ``faults_mu``:
        it calls into the runtime."""
        device = getattr(self.executor, "device", None)
        probe = getattr(device, "injected_faults_fired", None)
        fired: int | None = probe() if probe is not None else None
        if fired is None:
            return False
        moved, self._fired_seen = fired != self._fired_seen, fired
        return moved

    # ---- queries used by the executor -----------------------------------------------------------
    def admission_factor(self) -> float:
        """Budget factor: reduced while transient faults are recent (§8 'reduce admission')."""
        now = self._clock.monotonic()
        with self._mu:  # decide() trims the same window under this lock
            recent = bool(self._transients) and (
                now - self._transients[-1] <= self.policy.transient_window_s)
        return self.policy.reduced_admission if recent else 1.0

    def backoff(self, attempt: int) -> float:
        """Seconds before submit retry ``attempt`` (1-based): exponential, capped, jittered."""
        p = self.policy
        base = min(p.backoff_max_s, p.backoff_base_s * (2.0 ** (attempt - 1)))
        return max(0.0, base * (1.0 + p.jitter * (2.0 * self._rng.random() - 1.0)))

    def last(self) -> Decision | None:
        return self.decisions[-1] if self.decisions else None


class FaultTarget(Protocol):
    """What a fault sink may call on the executor it is attached to (``DeviceExecutor``).
    ``FaultController`` also reads, when present, its ``locks`` (a ``LockOrder``: the clock
    and a ranked ``faults_mu``) and its ``device`` (``injected_faults_fired``)."""

    def disable_feature(self, status: Status, job: Job | None = None) -> object:
        """§8 PROGRAMMING row: switch the feature ``status`` names off until the next
        generation."""
        ...

    def request_recovery(self, decision: Decision) -> None:
        """Drain and rebuild (or stop) as ``decision`` says; never blocks the caller."""
        ...

    def recovery_under_way(self) -> bool:
        """A recovery asked for from Ready has not reached its new generation yet (pending,
        Draining or Recovering); read without a lock, never blocks."""
        ...

    def lifecycle_final(self) -> str | None:
        """The lifecycle's final state (``"Failed"``, ``"Stopped"``) once it ended, else
        None; read without a lock, never blocks. A fault reported then is logged at INFO,
        counted in ``reported()`` and decided ``none``: nothing is left to act on."""
        ...


class FaultSink(Protocol):
    """Where an executor reports every failure after submit and every runtime failure, and
    what it asks of it: ``FaultController`` (the default) applies the §8 actions,
    ``RecordingFaultSink`` only records. An embedder's own sink implements all four; they are
    every method the executor calls on it."""

    def attach(self, executor: FaultTarget) -> None:
        """Called once by the executor that reports to this sink, before any report."""

    def report(self, status: Status, job: Job | None = None) -> None:
        """One failure (never blocks on a recovery)."""

    def admission_factor(self) -> float:
        """The share of ``max_pending_tokens`` admission may use now (1.0: all)."""

    def backoff(self, attempt: int) -> float:
        """Seconds before submit retry ``attempt`` (1-based) after a busy runtime."""


class RecordingFaultSink:
    """A passive sink: keeps the reports (bounded) and counts them by category, acts on
    nothing. For tests of the job path alone and for embedders with their own controller."""

    def __init__(self, keep: int = 1000) -> None:
        self.reports: deque[Status] = deque(maxlen=keep)
        self.by_category: dict[Category | None, int] = {}
        self._mu = threading.Lock()

    def attach(self, executor: FaultTarget) -> None:
        """Nothing to wire: it acts on nothing."""

    def admission_factor(self) -> float:
        return 1.0  # no admission reduction: nothing decides one

    def backoff(self, attempt: int) -> float:
        return 0.001  # a busy runtime is retried after a millisecond

    def report(self, status: Status, job: Job | None = None) -> None:
        with self._mu:
            self.reports.append(status)
            self.by_category[status.category] = self.by_category.get(status.category, 0) + 1


if TYPE_CHECKING:
    def _sinks(controller: FaultController, recording: RecordingFaultSink
               ) -> tuple[FaultSink, FaultSink]:
        """For mypy only: both sinks satisfy ``FaultSink``."""
        return controller, recording
