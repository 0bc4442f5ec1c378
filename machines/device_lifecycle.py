"""The device lifecycle: a component of ``DeviceExecutor`` (spec §9.1, §9.2; LifecycleChart).

``DeviceExecutor`` (machines/executor.py) is the job path: enqueue, the submitter, the
completion side. It owns one ``DeviceLifecycle`` (``executor.life``), built with the executor
as its host. The component is the device's life along the declared lifecycle chart: the
chart's guards, ``start`` (Configuring -> Warming -> golden -> Ready), the golden run,
``fail`` (-> Failed with a reason), recovery and model switch (Ready -> Draining ->
Recovering -> Configuring -> Warming -> Ready, or ``roll_back`` / Failed), the generation
fence, and ``shutdown`` (FI13: Draining -> Stopped, or Failed).

**What the lifecycle owns** (only this module writes it; the executor's public API delegates
here for embedders and the fault controller: ``state``, ``lifecycle``, ``start``,
``recover``, ``switch_model``, ``request_recovery``, ``shutdown``, ``failure``,
``recoveries``, ``goldens``; the rest is read as ``executor.life.<name>``):

* ``run``, the lifecycle chart's run, whose model is this object (its guards
  ``generation_advanced``, ``golden_passed``, ``all_submitted_drained``,
  ``reset_confirmed``, ``last_good_known`` are methods below), and ``mu`` (``lifecycle_mu``):
  every lifecycle event is sent under it together with the flags it changes;
* the admission gate: ``admitting`` (Ready and not draining) and ``stopping`` (shutdown
  began: for good). Written under ``mu``, read by the job path without a lock (bools);
* the queue through recovery (``ready_queue_max``): ``ready_cv`` (on ``mu``), the number of
  waiters, ``wait_for_ready`` (called by ``enqueue``) and ``ready_changed``;
* recovery: ``recovery_mu`` (one recovery, model switch or shutdown at a time), the thread
  that holds it in ``recover``, the decision the fault controller left
  (``request_recovery``), the ``calexec-recovery`` thread, ``recoveries`` (one record each);
* the generations' history: the ids handed out, the id of the newest one that reached Ready,
  the generations retired but kept until the device proves no stale DMA lands in them
  (``retired``), the calbin a refused switch rolls back to;
* the golden (§9.2): ``goldens`` (operator's, plus unpinned runs accepted in this process:
  ``unpinned_goldens``), ``pinned_goldens`` (the manifest's goldens file as a model switch
  last read it), ``golden_source``, whether the current generation's golden passed,
  ``good_calbins`` (calbins that reached Ready, newest last);
* the outcome: ``start_status`` and ``failure`` (why the lifecycle is Failed).

**What stays with the host** (the job path; the lifecycle reaches it only through
``LifecycleHost``, below, which lists every member it uses):

* ``device`` and ``gen`` (the current ``Generation``): every job uses them (``infer`` on the
  device; admission, the queue and completion against the generation), so the executor holds
  them as plain attributes for the hot path and embedders' wrappers. The lifecycle is their
  only writer: it opens the device and each generation, replaces and tears generations down,
  and closes the device;
* the job path's components: ``dispatch`` (refusal, fence, drain), ``outcomes`` (how jobs
  end), ``completion`` (jobs submitted, not completed); the ``calexec-submitter`` and
  ``calexec-completion`` threads (``start_threads``/``stop_threads``), their steps
  (``submit_one``/``complete_one``, which the lifecycle drives itself in stepped mode), the
  golden jobs (``enqueue_internal``), ``wake_waiters`` and ``thread_faults``;
* what both share: ``config``, ``runtime``, ``manifest``, ``clock``, ``locks``.

The executor reads the lifecycle only through public names (``run``, ``admitting``,
``stopping``, ``failure``, ...) and calls ``wait_for_ready``, ``ready_changed`` and ``fail``
(its thread barrier, when the fault sink itself raised). Lock ranks are unchanged
(machines/locks.py): ``recovery_mu`` -> ``lifecycle_mu`` -> the job path's locks.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import math
import numbers
import os
import shlex
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypedDict, runtime_checkable

import attrs
import numpy as np

from calexec.contracts import fields
from calexec.contracts.errors import Category
from calexec.contracts.goldens import GoldenFileError, Goldens, goldens_path, load_goldens
from calexec.contracts.goldens import lookup as lookup_golden
from calexec.contracts.manifest import default_manifest_path
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import EngineSlot, TaskKind
from calexec.machines import switch_check
from calexec.machines.api import RecoveryRecord, ThreadFault
from calexec.machines.chart_names import (
    LIFECYCLE_CONFIGURING,
    LIFECYCLE_DRAINING,
    LIFECYCLE_EV_CONFIGURED,
    LIFECYCLE_EV_DRAIN,
    LIFECYCLE_EV_FAIL,
    LIFECYCLE_EV_RECONFIGURE,
    LIFECYCLE_EV_RECOVER,
    LIFECYCLE_EV_ROLL_BACK,
    LIFECYCLE_EV_STOP,
    LIFECYCLE_EV_WARMED,
    LIFECYCLE_READY,
    LIFECYCLE_RECOVERING,
    LIFECYCLE_STOPPED,
    LIFECYCLE_WARMING,
)
from calexec.machines.compiled import LIFECYCLE
from calexec.machines.device_api import no_object
from calexec.machines.faults import Action, Decision
from calexec.machines.generation import Generation, open_generation
from calexec.machines.job import SHUTDOWN_CALLED, InferenceResult, Job, JobHandle
from calexec.machines.locks import LIFECYCLE as LIFECYCLE_RANK
from calexec.machines.locks import RECOVERY
from calexec.machines.served_files import ROLLBACK_CHANGED, ServedFiles

if TYPE_CHECKING:
    from calexec.contracts.manifest import Manifest
    from calexec.machines.clock import Clock
    from calexec.machines.completion import Completion
    from calexec.machines.device_api import DeviceApi, RuntimeApi
    from calexec.machines.dispatch import Dispatch
    from calexec.machines.executor import ExecutorConfig
    from calexec.machines.locks import LockOrder
    from calexec.machines.outcomes import JobOutcomes

log = logging.getLogger("calexec.executor")
#: recovery records a lifecycle keeps (``recoveries``): the newest; older ones are counted
#: (``recovery_totals``) but dropped, as the fault controller keeps its last 1000 decisions: a
#: record per recovery and model switch for the life of the process grew without bound
RECOVERY_RECORDS_KEPT = 1000


#: what a drained shutdown gives the executor's idle threads to end, at least (beyond its
#: grace only when the drain ended at its very end): the device is closed after they did
THREADS_EXIT_S = 1.0
#: a shutdown past its grace that finds ``recovery_mu`` held by no recovery's work (a thread
#: about to find the shutdown and return, or one that has just ended a recovery) waits this
#: long for it, beyond the grace: that holder makes no runtime call before it lets go
OWNERLESS_WAIT_S = 1.0

#: the grace of the shutdown that follows a ``start()`` raising (a KeyboardInterrupt in its
#: warm-up): a golden job on the device drains within it, as at any shutdown
INTERRUPTED_START_GRACE_S = 5.0

#: the lifecycles ``start`` ran in this process: a forked child marks each one
#: (``_forked_child``), whose threads and device stay with the parent
_STARTED: weakref.WeakSet[DeviceLifecycle] = weakref.WeakSet()


def _forked_child() -> None:
    """``os.register_at_fork(after_in_child=...)``: the child has none of the executor's
    threads (only the forking one is copied) and shares the parent's device handle, so its
    copy of a started executor admitted requests that never ran (a handle waited past the
    request's deadline, its job "Queued") and its ``shutdown`` waited out its grace and
    answered ``shutdown.not_drained``. Each copy now serves nothing, for good: admission
    closed, as after a ``shutdown``, and ``forked_from`` names the parent (no lock taken:
    the child runs one thread, and a lock another parent thread held stays held in it)."""
    for life in list(_STARTED):
        # (one whose device its shutdown or failed start closed has nothing left to copy)
        if life.started_in is not None and not life._device_closed:
            life.forked_from = life.started_in
            life.admitting = False
            life.stopping = True


if hasattr(os, "register_at_fork"):  # (POSIX)
    os.register_at_fork(after_in_child=_forked_child)


def _never_shut_down() -> None:
    """``atexit``: a ``ResourceWarning`` for each executor this process started and never
    shut down (an embedder's bug: dropped, or forgotten at exit), as Python warns of a file
    or subprocess left open. Its threads keep it alive, so it is never collected (no
    finalizer runs), and each one dropped left its threads running and its device open,
    silently, until the process ended (found at stop 67). Ignored by default, as Python's
    own: ``python -W default`` or ``-X dev`` shows them."""
    for life in list(_STARTED):
        if (life.started_in == os.getpid() and not life._device_closed
                and not life.shutdown_requested()):
            warnings.warn(
                f"a DeviceExecutor started in this process (lifecycle {life.run.state}) was "
                "never shut down: its threads ran and its device stayed open until the "
                "process ended; call executor.shutdown(grace) when done with it "
                "(docs/embedding.md section 6)", ResourceWarning, stacklevel=1)


atexit.register(_never_shut_down)


#: the lifecycle states a recovery or model switch passes through: a request arriving in one
#: of them may wait for Ready (``wait_for_ready``)
_RECOVERING = (LIFECYCLE_DRAINING, LIFECYCLE_RECOVERING, LIFECYCLE_CONFIGURING,
               LIFECYCLE_WARMING)


class _RecoveryProgress(TypedDict, total=False):
    """What ``_recover`` learns on its way, for the ``RecoveryRecord``."""

    reset_kind: str | None
    refused: list[str]


@runtime_checkable
class LifecycleHost(Protocol):
    """Everything ``DeviceLifecycle`` uses of the executor that owns it (``DeviceExecutor``
    satisfies it; tests/test_lifecycle_component.py checks that the lifecycle uses no other
    member and that the executor has every one)."""

    #: the executor's settings (device config, calbin, capacity, golden, recovery policy)
    config: ExecutorConfig
    #: the CalRT runtime (``open_device``)
    runtime: RuntimeApi
    #: the manifest every generation is resolved against (and its pinned goldens)
    manifest: Manifest
    clock: Clock
    #: the executor's ranked locks (``lifecycle_mu`` and ``recovery_mu`` are made from it)
    locks: LockOrder
    #: the dispatch state: refusal of queued work, the generation fence, the drain check
    dispatch: Dispatch
    #: how jobs end: a fenced armed job's release, held jobs reaped before the drain check
    outcomes: JobOutcomes
    #: the completion side: its length is the number of jobs submitted, not completed
    completion: Completion
    #: what the executor threads' barriers caught (the recovery thread's barrier appends)
    thread_faults: deque[ThreadFault]
    #: the open device (None before ``start``); the lifecycle opens, resets and closes it
    device: DeviceApi | None
    #: the current generation (None before the first and between two); the lifecycle sets it
    gen: Generation | None

    def enqueue_internal(self, request: InferenceRequest) -> JobHandle:
        """Queue a job of the golden run (admitted while Warming)."""
        ...

    def submit_one(self, block: bool = False) -> bool:
        """One submitter step (stepped mode: the lifecycle drives it)."""
        ...

    def complete_one(self, block: bool = False) -> bool:
        """One completion step (stepped mode: the lifecycle drives it)."""
        ...

    def start_threads(self) -> None:
        """Start ``calexec-submitter`` and ``calexec-completion`` (threads mode)."""
        ...

    def stop_threads(self, timeout: float = 5.0, deadline: float | None = None) -> None:
        """Stop them and wait at most ``timeout`` seconds in all for them to end (until
        ``deadline``, a ``Clock.monotonic()`` value, when given)."""
        ...

    def wake_waiters(self) -> None:
        """End every admission, lease and Ready wait so its owner looks again."""
        ...


class DeviceLifecycle:
    """Lifecycle chart owner: start, golden, failure, recovery, model switch, shutdown (a
    component of ``DeviceExecutor``, ``executor.life``; see the module docstring)."""

    def __init__(self, host: LifecycleHost) -> None:
        self._host = host
        config = host.config
        self.mu = host.locks.lock(LIFECYCLE_RANK)
        #: the lifecycle chart's run; this object answers its guards
        self.run = LIFECYCLE.run(self)
        #: Ready and not draining (written under ``mu``; read without a lock: a bool)
        self.admitting = False
        #: ``shutdown`` began: admission stops for good (written under ``mu``)
        self.stopping = False
        # requests waiting for Ready during a recovery (``mu``; ready_queue_max)
        self.ready_cv = host.clock.condition(self.mu, "ready_cv")
        self._ready_waiters = 0
        # recovery: one at a time, on its own thread (threads mode) or run by the caller
        self._recovery_mu = host.locks.lock(RECOVERY)
        #: thread ident running a recovery's work with recovery_mu held (``_recover_held``;
        #: written under ``mu``)
        self._recovery_owner: int | None = None
        #: the ``grace`` of a ``shutdown`` that answered ``shutdown.recovery_busy`` (``mu``):
        #: the recovery it interrupted completes that shutdown as it ends
        self._shutdown_owed: float | None = None
        #: the deadline of a golden job a shutdown's interrupt left on the device (``mu``)
        self._golden_left_until: float | None = None
        self._pending_recovery: Decision | None = None
        #: the generation the pending decision was made for (the one serving when asked)
        self._pending_gen: int | None = None
        #: the decision a recovery thread claimed (holding ``recovery_mu``) and has not yet
        #: moved the lifecycle to Draining for (``mu``): still a recovery under way
        self._claimed: Decision | None = None
        #: a fault calling for a reset (§8 DEVICE, UNKNOWN, INTERNAL) met while a recovery
        #: that asked for none (a model switch, a LIFECYCLE rebuild) is pending or drains
        #: (``mu``): that recovery resets the device before it tears the generation down;
        #: and one met by a golden job of a recovery's new generation (Configuring, Warming):
        #: the device is reset before the next generation (``_release_failed_generation``)
        self._reset_for: Status | None = None
        #: controller recoveries dropped: asked for a generation a model switch (or another
        #: recovery) had already replaced when their turn came (``run_pending_recovery``), or
        #: asked for once a shutdown began (``request_recovery``)
        self.dropped_recoveries = 0
        self._recovery_thread: threading.Thread | None = None
        #: the newest ``RECOVERY_RECORDS_KEPT`` records (until stop 72 every one, for the
        #: life of the process); ``recovery_totals`` counts them all
        self.recoveries: list[RecoveryRecord] = []
        #: every recovery and model switch recorded, by (reason code, ok)
        self.recovery_totals: dict[tuple[str, bool], int] = {}
        self._gen_ids = itertools.count(1)
        #: id of the newest generation that reached Ready
        self._served_gen_id = 0
        # released generations whose host memory the device may still write (kept until
        # Device.dma_quiescent() proves otherwise), and generations refused while their job
        # was still on the device (never torn down: §9.1)
        self._retired: deque[Generation] = deque()
        self._golden_ok = False
        self._rollback_path: str | None = None
        #: the last ``_configure_and_warm`` was refused by the device itself at its configure
        #: (§8 DEVICE: rc 24 map broken, 18 unavailable), not by a golden or the calbin
        self._configure_refused_by_device = False
        #: the recovery's thread is reporting the device's refusal of its configure
        #: (``_report_refused_configure``): a fault of the recovery under way
        self._reporting_refusal = False
        self.good_calbins: list[str] = []  # calbin paths that reached Ready, newest last
        #: what served from each of them, held open (a restore loads that, not what the
        #: path holds by now: machines/served_files.py)
        self._served_files = ServedFiles()
        self._restored_held = False  # (``_open``)
        self.goldens: dict[str, tuple[int, ...]] = dict(config.goldens)
        self.golden_source: str | None = None  # the current generation's: pinned|config|unpinned
        self.unpinned_goldens: set[str] = set()  # calbin sha256s accepted by allow_unpinned_golden
        #: the manifest's pinned goldens as the last ``switch_model`` read its goldens file
        #: (a pin recorded while serving counts at the next switch); None: the manifest's own
        self.pinned_goldens: Goldens | None = None
        self.start_status: Status | None = None
        #: ``start`` was called (under ``mu``): a second call raises before touching anything
        self._started = False
        #: ``start`` runs: a ``shutdown`` from another thread waits for it (bounded by its
        #: grace) instead of tearing down what start is building; ``_start_done`` wakes it
        self._start_running = False
        self._start_done = host.clock.event()
        #: ``shutdown`` was called: a ``start`` after it raises
        self._shutdown_called = False
        #: ident of the thread whose ``shutdown`` runs now (``mu``): a ``shutdown`` on another
        #: thread meanwhile waits for it (``_shutdown_done``) instead of taking it for a
        #: recovery that holds ``recovery_mu``
        self._shutdown_owner: int | None = None
        self._shutdown_done = host.clock.event()
        #: set when the golden job waited for now resolves, or by ``_interrupt`` (``mu``):
        #: a shutdown ends a golden wait at once, not at ``golden_timeout_s``
        self._golden_wake: threading.Event | None = None
        #: the sequences whose KV went with the last generation that served and was
        #: replaced (``KvCoordinator.gone_with_it``): each next generation is told (``_open``)
        self._kv_gone: dict[int, tuple[int, int]] = {}
        self._start_thread: int | None = None  # ident of the thread running ``start``
        #: the grace of a ``shutdown`` that answered ``shutdown.start_busy`` (``mu``): the
        #: start completes it as it ends (``_complete_start_owed``)
        self._start_owed: float | None = None
        self.failure: Status | None = None  # why the lifecycle is Failed
        #: the device was closed (by a failed start or a shutdown): never closed twice
        self._device_closed = False
        #: the pid of the process whose ``start`` ran (None before ``start``)
        self.started_in: int | None = None
        #: in a child forked after ``start``: the parent's pid (``_forked_child``); this copy
        #: of the executor serves nothing, and its ``shutdown`` stops nothing of the parent's
        self.forked_from: int | None = None

    # ---- lifecycle guards (LifecycleChart) ------------------------------------------------
    def generation_advanced(self) -> bool:
        """A fresh generation is open: its id is above every generation that served or was
        retired, its pool is mapped and its KV coordinator open (read from the objects, not
        from a flag set for this guard)."""
        gen = self._host.gen
        if gen is None or gen.closing or gen.released or not gen.pool.opened:
            return False
        return all(gen.id > old.id for old in self._retired) and gen.id > self._served_gen_id

    def golden_passed(self) -> bool:
        return self._golden_ok

    def never_opened(self) -> bool:
        """``start()`` never ran: no device is open and no generation exists (a shutdown
        before start has nothing to drain)."""
        host = self._host
        return not self._started and host.device is None and host.gen is None

    def all_submitted_drained(self) -> bool:
        host = self._host
        host.outcomes.reap_held(report=False)
        return host.dispatch.drained() and not len(host.completion)

    def reset_confirmed(self) -> bool:
        """The runtime no longer touches any old-generation buffer: every generation that
        served before is torn down (released after a drain, or after a confirmed reset) and
        no failed job is still held by the runtime."""
        host = self._host
        if host.gen is not None and host.gen.id == self._served_gen_id:
            return False  # the generation that served is still the current one
        if host.dispatch.held():
            return False
        return all(old.released for old in self._retired if old.id <= self._served_gen_id)

    def last_good_known(self) -> bool:
        return self._rollback_path is not None

    def forked_why(self) -> str | None:
        """In a child forked after ``start``: why this copy serves nothing (the parent's pid,
        this one's and what to do); None in the process that started it."""
        if self.forked_from is None:
            return None
        return (f"this executor was started in process {self.forked_from} and this is a child "
                f"forked from it (pid {os.getpid()}): its threads and device stay with that "
                "process; build and start a new DeviceExecutor in the child")

    def shutdown_requested(self) -> bool:
        """``shutdown()`` was called (or runs, from within a recovery): nothing is configured
        from then on."""
        return self._shutdown_called or self.stopping

    # ---- what the executor and its tests observe (read-only) -------------------------------
    @property
    def ready_waiters(self) -> int:
        """Requests waiting for Ready now (``ready_queue_max``)."""
        return self._ready_waiters

    @property
    def retired(self) -> tuple[Generation, ...]:
        """Generations retired and still kept: released ones until the device proves no stale
        DMA lands in them, and refused ones a job of which is still on the device."""
        return tuple(self._retired)

    @property
    def recovery_pending(self) -> bool:
        """The fault controller asked for a recovery that has not begun yet
        (``run_pending_recovery`` takes it; in threads mode the recovery thread does)."""
        return self._pending_recovery is not None

    def recovery_under_way(self) -> bool:
        """A recovery asked for from Ready has not reached its new generation yet: pending,
        or draining and resetting the old one (Draining, Recovering), or the device's refusal
        of its new generation's configure while that is reported. A fault met now belongs
        to the incident it covers (the fault controller counts it against no escalation
        budget). Read without ``mu``: a field and the chart's state."""
        return (self._asked() or self._reporting_refusal
                or self.run.state in (LIFECYCLE_DRAINING, LIFECYCLE_RECOVERING))

    def _asked(self) -> bool:
        """A recovery the controller asked for the current generation has not moved the
        lifecycle yet: pending, or claimed by the thread that runs it (read with or without
        ``mu``: a few fields). One pending for a generation since replaced (a model switch
        went live first) covers nothing: it is dropped when its turn comes."""
        gen = self._host.gen
        return self._claimed is not None or (
            self._pending_recovery is not None
            and (gen is None or gen.id == self._pending_gen))

    @property
    def recovery_active(self) -> bool:
        """A recovery the controller asked for is pending or its thread still runs."""
        thread = self._recovery_thread
        return self._pending_recovery is not None or (thread is not None and thread.is_alive())

    # ---- start: Configuring -> Warming -> Ready ----------------------------------------------
    def start(self) -> Status:
        """Open the device and generation 1, warm up with the golden run, go Ready.

        FI01: the manifest is resolved against ``GetAllModels`` before ``configure``; a
        mismatch refuses the generation and nothing is configured.

        Called once: a second call raises ``RuntimeError`` before it touches anything (it
        used to open a second device and configure a generation over the first one's
        handles, and only then raise from the chart, leaking the first device). A
        ``shutdown`` from another thread meanwhile waits for it (``_start_running``)."""
        with self.mu:
            if self._started:
                raise RuntimeError(
                    f"DeviceExecutor.start() called a second time (lifecycle "
                    f"{self.run.state}); start is called once: build a new DeviceExecutor "
                    "to start again")
            # ``_start_running`` first, then ``_shutdown_called``; shutdown writes the flag
            # first, then reads ``_start_running`` (no lock: no scheduling point added to its
            # path): one of the two sees the other (the GIL orders the four steps)
            self._start_thread = threading.get_ident()
            self._start_running = True
            if self.stopping or self.run.final or self._shutdown_called:
                self._start_running = False
                raise RuntimeError(
                    f"DeviceExecutor.start() called after shutdown() (lifecycle "
                    f"{self.run.state}); build a new DeviceExecutor to start again")
            self._started = True
            self.started_in = os.getpid()
            _STARTED.add(self)
        raised = False
        try:
            status = self._start_once()
        except BaseException:
            # (what ``_start_once``'s barrier does not take: a KeyboardInterrupt, a Ctrl-C or a
            # SIGTERM a command made one, landing in the warm-up; a SystemExit) the lifecycle
            # was left Configuring or Warming, the threads running and the device open, and
            # the caller, given no Status, shut nothing down: every calexec command but demo
            # called start() before the ``try`` that shuts down. Shut down below, then raise
            raised = True
            raise
        finally:
            owed = None
            self._start_running = False  # then wake a shutdown that saw it running
            if self._shutdown_called:
                # a shutdown that found it running under ``mu`` and answered start_busy left
                # its grace here first (its check and this take, both under ``mu``, follow
                # the flag's write: none is lost); no lock without a shutdown, so a start
                # adds no scheduling point
                with self.mu:
                    owed, self._start_owed = self._start_owed, None
                self._start_done.set()
            if raised:
                self._shut_down_raised_start(INTERRUPTED_START_GRACE_S if owed is None
                                             else owed)
        return status if owed is None else self._complete_start_owed(status, owed)

    def _shut_down_raised_start(self, grace: float) -> None:
        """(the start's thread, ``start`` raising) Shut the executor down with ``grace``
        unless its lifecycle already ended; a failure to is logged, never raised over the
        exception the start raises (a second Ctrl-C meanwhile still ends the wait)."""
        if self.run.final:
            return
        try:
            status = self.shutdown(grace)
        except Exception as exc:  # noqa: BLE001 - the start's own exception goes on
            log.error("start() raised; the shutdown after it raised %s: %s",
                      type(exc).__name__, exc)
            return
        log.info("start() raised before it returned a Status: the executor was shut down "
                 "(%s)", status)

    def _complete_start_owed(self, status: Status, grace: float) -> Status:
        """(the start's thread, the start ended) A ``shutdown`` answered
        ``shutdown.start_busy`` meanwhile, "nothing was torn down": complete it now with its
        grace, as a recovery completes the shutdown it outlived. Left to a later
        ``shutdown()``, a start that passed its golden run went Ready (admitting nothing),
        answered OK and kept the device open and the threads running; a failed one kept what
        its golden job held. A start that went Ready answers that it was interrupted (the
        executor serves nothing); a failed one answers its failure."""
        with self.mu:
            other = self._shutdown_owner is not None
        if other:  # (the shutdown that answered start_busy, returning now: its grace may be
            # 0, and this call answered ``shutdown.in_progress`` with nothing done)
            self._host.clock.wait_event(self._shutdown_done, OWNERLESS_WAIT_S)
        if not status.ok:
            self._wait_golden_left()
        done = self.shutdown(grace)
        log.info("the shutdown that found start() busy was completed as it ended: %s, "
                 "lifecycle %s", done.code, self.run.state)
        if not status.ok:
            return status
        return Status.unavailable(
            Phase.CONFIGURE, f"start() was interrupted by shutdown() from another thread, "
            f"which answered shutdown.start_busy; the start went Ready and then completed that "
            f"shutdown ({done.code}, lifecycle {self.run.state})")

    def _wait_golden_left(self) -> None:
        """(the start's thread, completing the shutdown it owes) Wait for the golden job the
        interrupt left on the device to end, bounded by its deadline (``golden_timeout_s``
        from its enqueue: what the start would have waited for it without the shutdown).
        The shutdown that answered ``shutdown.start_busy`` has returned, with its grace (often
        0): its drain, left to that grace, gave up at once, and the executor ended Failed with
        the device open and the generation's buffers mapped, however soon the device let go.
        Past the deadline nothing more is waited for: that shutdown's drain decides. The
        wait is the drain's own (``_drain``: it drives a stepped executor too)."""
        with self.mu:
            until = self._golden_left_until
        if until is not None:
            self._drain(0.0, deadline=until)

    def _start_once(self) -> Status:
        """``start`` after its once-only check (``_start_running`` meanwhile)."""
        host = self._host
        try:
            status = self._start()
        except Exception as exc:  # noqa: BLE001 - the barrier: start answers a Status
            # a runtime (a vendor shim) that raises instead of returning its code: the start
            # fails as any failed start does, Failed with what it could torn down, and
            # shutdown() answers this Status (not shutdown.not_drained from Configuring)
            status = Status.internal("start_exception", Phase.CONFIGURE,
                                     f"start raised {type(exc).__name__}: {exc}")
            log.error("start caught %s", status, exc_info=exc)
        if status.ok:
            status = self._go_ready()
        if not status.ok and self._shutdown_called:  # say why its golden run was refused
            status = Status.unavailable(
                status.phase or Phase.CONFIGURE,
                f"start() was interrupted by shutdown() from another thread ({status.code}: "
                f"{status.message})")
        if not status.ok:
            self.start_status = status
            # A start a shutdown interrupted in its warm-up is no verdict on the device: the
            # shutdown it returns to (waiting for it, or owed: ``_complete_start_owed``)
            # ends the lifecycle, Warming -> Stopped once nothing is left on the device (its
            # drain), else Failed with this Status, as a recovery stopped while warming, and
            # stops the threads and closes the device. Failed here, with the threads stopped,
            # a golden job the device still held (a SIGTERM during the warm-up) left the
            # executor Failed with the device open even once that job ended within its
            # deadline (and a job the submitter was still handing to the completion thread,
            # stopped meanwhile, was never completed)
            interrupted = self.stopping and self.run.state == LIFECYCLE_WARMING
            if not interrupted:
                self.fail(status)
            released = self._release_failed_generation()
            if interrupted:
                return status
            # drained: the idle threads end at once; a golden job still on the device keeps
            # the completion thread in its Wait() until the device answers (its execution
            # deadline), and waiting the default 5 s for it only held the start up (a
            # shutdown waiting for this start answered ``shutdown.start_busy``)
            host.stop_threads(THREADS_EXIT_S if released.ok else 0.0)
            if released.ok:
                self._close_device()  # else a job may still run: keep the device open
            return status
        self.start_status = Status.OK
        return Status.OK

    def _start(self) -> Status:
        """``start``'s steps: open the device, configure generation 1, warm up."""
        host = self._host
        rc, host.device = host.runtime.open_device(host.config.device_config)
        status = (Status.from_calrt(rc, Phase.CONFIGURE, "device open with device_config="
                                    f"{fields.shown(host.config.device_config, 300)} (the emulator's keys: "
                                    "docs/emulator.md)") if rc != 0 else
                  # (0 and no device broke the driver contract: said so, not an
                  # AttributeError from the first call on None)
                  no_object("open_device", Phase.CONFIGURE) if host.device is None else
                  self._enable_phase_b())
        if status.ok:
            status = self._open(host.config.calbin_path)
        if status.ok:
            status = self._advance(LIFECYCLE_EV_CONFIGURED)
        if status.ok:
            if host.config.threads:
                host.start_threads()
            status = self.warm_up()
        return status

    def _enable_phase_b(self) -> Status:
        """Phase B needs the runtime's parallel mode (§6.4); Phase A leaves it off."""
        if self._host.config.inflight_capacity != 2:
            return Status.OK
        rc = self._host.device.enable_parallel_mode(True)
        return Status.from_calrt(rc, Phase.CONFIGURE, "EnableParallelMode(true) for Phase B")

    def _open(self, calbin_path: str, restore: bool = False) -> Status:
        """Open generation+1 of ``calbin_path`` (Configuring). ``restore`` (a recovery, a
        roll back): what served from that path, held open if the path names another file by
        now, and refused (``calbin.changed``) unless its sha256 is what served."""
        host = self._host
        config = host.config
        gen_id = next(self._gen_ids)
        engines = ((EngineSlot.PING, EngineSlot.PONG) if config.inflight_capacity == 2
                   else (EngineSlot.AUTO,))
        load_from, served_sha = (self._served_files.source(calbin_path) if restore
                                 else (calbin_path, None))
        #: the last open loaded the file that served, held open, not what the path holds now
        self._restored_held = load_from != calbin_path
        gen = open_generation(host.device, host.manifest, calbin_path, gen_id,
                              config.slots_per_kind, host.locks, engines,
                              load_from=load_from if self._restored_held else None,
                              served_sha256=served_sha)
        if isinstance(gen, Status):
            return gen
        gen.kvc.on_busy = host.outcomes.release_armed_of  # armed jobs are guesses
        faults = host.outcomes.faults  # a KvManager refusal the books contradict is a fault
        gen.kvc.refusals_to(faults.report, faults.backoff, config.recovery.kv_refusal_retries)
        # the sequences whose KV went with the generations before (an embedder's decode on
        # one is told so)
        gen.kvc.carry_dropped(self._kv_gone)
        host.gen = gen
        self._golden_ok = False
        host.dispatch.refuse(None)  # the new generation's own golden jobs may queue
        return Status.OK

    def _advance(self, event: str) -> Status:
        """Send ``event`` (a step of a start or a recovery) unless the lifecycle went final
        meanwhile: OK when sent, else the failure that ended it. A start or a recovery works
        outside ``mu`` between its steps (fence, drain, reset, golden run), and the fault
        controller, told of a fault on the completion thread, may end the lifecycle Failed
        there (past ``max_recoveries``, e.g. the reset aborting a golden job the device never
        finished); the next step then raised IllegalTransition out of ``recover()`` ("event
        'roll_back' is not allowed in state 'Failed'") instead of answering a Status."""
        with self.mu:
            if self.run.final:
                return self._ended(event)
            self.run.send(event)
            return Status.OK

    def _ended(self, step: str) -> Status:
        """(under ``mu``, the lifecycle final) What ended it, for a step that can no longer
        be taken: its failure, else UNAVAILABLE naming the state and the step."""
        if self.failure is not None:
            return self.failure
        return Status.unavailable(Phase.RECOVERY,
                                  f"the lifecycle ended {self.run.state} before {step}")

    def _go_ready(self) -> Status:
        """Warming -> Ready, admission open (unless the lifecycle went final meanwhile)."""
        host = self._host
        with self.mu:
            if self.run.final:
                return self._ended(LIFECYCLE_EV_WARMED)
            self.run.send(LIFECYCLE_EV_WARMED)
            self._served_gen_id = host.gen.id
            host.dispatch.refuse(None)
            self.admitting = not self.stopping
            self.ready_cv.notify_all()  # requests queued through the recovery go on
        path = host.gen.calbin_path
        if path in self.good_calbins:
            self.good_calbins.remove(path)
        self.good_calbins.append(path)
        self._served_files.served(path, host.gen.sha256)
        return Status.OK

    def expected_golden(self, sha: str) -> tuple[tuple[int, ...] | None, str]:
        """(expected tokens or None, where they come from) for calbin ``sha``: the operator's
        ``goldens`` (``config.goldens``, or an unpinned run accepted in this process), else the
        golden pinned next to the manifest for this prompt and decode steps."""
        if sha in self.goldens:
            return tuple(self.goldens[sha]), ("unpinned" if sha in self.unpinned_goldens
                                              else "config")
        config, manifest = self._host.config, self._host.manifest
        goldens = (self.pinned_goldens if self.pinned_goldens is not None
                   else getattr(manifest, "goldens", {}))
        pinned = lookup_golden(goldens, sha, config.golden_tokens, config.golden_decode_steps)
        return (None, "unpinned") if pinned is None else (pinned.tokens, "pinned")

    def warm_up(self) -> Status:
        """§9.2 Warming: a fixed prefill + decode of the current generation through the real
        path, compared with the golden pinned for its calbin. No pinned golden: refused
        (ARTIFACT, before anything runs) unless ``allow_unpinned_golden``, which accepts the
        first run's tokens. OK: ``golden_passed`` holds for this generation."""
        host = self._host
        cfg = host.config
        sha = host.gen.sha256
        expected, source = self.expected_golden(sha)
        if expected is None and not cfg.allow_unpinned_golden:
            source = getattr(host.manifest, "source", "manifest")
            return Status.failure(
                "golden.unpinned", Category.ARTIFACT, Phase.GOLDEN,
                f"calbin {fields.shown(host.gen.calbin_path, 300)} (sha256 {sha}) has no pinned golden for "
                f"golden_tokens/golden_decode_steps={cfg.golden_decode_steps} in "
                f"{goldens_path(source)}; run `calexec golden record --calbin "
                f"{shlex.quote(str(host.gen.calbin_path))}{self._manifest_flag()}"
                f"{self._runtime_lib_flag()}` or set "
                "allow_unpinned_golden",
                generation=host.gen.id)
        tokens = self._run_golden()
        if isinstance(tokens, Status):
            return tokens
        if expected is None:
            log.warning("allow_unpinned_golden: calbin %r (sha256 %s) goes Ready on an unpinned "
                        "golden %s (first run trusted; §9.2 asks for a fixed golden)",
                        host.gen.calbin_path, sha, list(tokens))
            self.goldens[sha] = expected = tokens
            self.unpinned_goldens.add(sha)
        self.golden_source = source
        if tokens != tuple(expected):
            return Status.failure("golden.mismatch", Category.INTERNAL, Phase.GOLDEN,
                                  f"golden tokens {list(tokens)} != recorded {list(expected)}",
                                  generation=host.gen.id)
        status = host.gen.kvc.reset_sequence(cfg.golden_seq_id)
        self._golden_ok = status.ok
        return status

    def _run_golden(self) -> tuple[int, ...] | Status:
        cfg = self._host.config
        clock = self._host.clock
        seq = cfg.golden_seq_id
        status = self._host.gen.kvc.reset_sequence(seq)
        if not status.ok:  # named as the setting it comes from (the embedder never sent it)
            return attrs.evolve(status, message=f"golden run on ExecutorConfig.golden_seq_id="
                                                f"{seq}: {status.message}")
        prompt = np.asarray(cfg.golden_tokens, dtype=np.int32)
        out: list[int] = []
        request = InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=prompt,
                                   positions=np.arange(len(prompt), dtype=np.int32), past_len=0,
                                   deadline=clock.monotonic() + cfg.golden_timeout_s)
        for step in range(cfg.golden_decode_steps + 1):
            result = self._run_internal(request)
            if isinstance(result, Status):
                if result.category is Category.DEADLINE:
                    # the embedder never sent this job nor waited for it: name the warm-up and
                    # the setting its deadline comes from (it read "wait_until deadline passed")
                    what = "prefill" if step == 0 else f"decode step {step}"
                    return attrs.evolve(result, message=(
                        f"golden run ({what}) not finished within ExecutorConfig."
                        f"golden_timeout_s={cfg.golden_timeout_s:g}: raise it for a device this "
                        "slow (an emulated latency in device_config: calexec.drivers."
                        f"device_spec.with_emulated_latency moves it out); {result.message}"))
                return result
            out.append(result.argmax)
            past = result.kv_len
            request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                       tokens=np.asarray([result.argmax], dtype=np.int32),
                                       positions=np.asarray([past], dtype=np.int32),
                                       past_len=past,
                                       deadline=clock.monotonic() + cfg.golden_timeout_s)
        return tuple(out)

    def _run_internal(self, request: InferenceRequest) -> InferenceResult | Status:
        """One golden job, waited for until its deadline, or until a shutdown interrupts the
        start or recovery running it (``_interrupt``): a job still on the device then is
        left to it (its generation keeps its buffers: they are freed only once the device
        let go) and the golden run answers UNAVAILABLE at once. It waited for
        ``golden_timeout_s`` whatever the shutdown's grace, which then answered
        ``shutdown.recovery_busy`` (or ``start_busy``) with nothing torn down."""
        host = self._host
        handle = host.enqueue_internal(request)
        if not host.config.threads:
            while not handle.done:
                if not (host.submit_one() or host.complete_one()):
                    break
            return handle.wait_until(request.deadline)
        wake = host.clock.event()
        with self.mu:
            self._golden_wake = wake
            if self.stopping:
                wake.set()
        try:
            handle.add_done_callback(lambda _handle: wake.set())
            host.clock.wait_event(wake, host.clock.remaining(request.deadline))
        finally:
            with self.mu:
                self._golden_wake = None
        if handle.done or not self.stopping:
            return handle.wait_until(request.deadline)
        with self.mu:
            self._golden_left_until = request.deadline
        return Status.unavailable(
            Phase.GOLDEN, "the golden run was stopped by shutdown() with its job still on "
            f"the device (state {handle.state}); the job continues", job_id=handle.job_id,
            seq_id=request.seq_id, generation=host.gen.id if host.gen else None)

    def fail(self, status: Status) -> None:
        """Lifecycle -> Failed with ``status`` as the reason; queued work is refused. Logged
        once, by the call that moved it: a later call (the fault controller's STOP for a
        golden job's fault, then the start that golden job failed) finds it final already,
        and the lifecycle keeps the first reason."""
        with self.mu:
            self.admitting = False
            moved = not self.run.final
            if moved:
                self.run.send(LIFECYCLE_EV_FAIL)
                self.failure = status
            ended = self.run.state
            failure = self.failure if self.failure is not None else status
            self.ready_cv.notify_all()
        # a queued job never reached the device: it is refused as a request sent now is
        # (503 ``lifecycle.unavailable`` naming the failure). Refused with ``status`` itself,
        # each was answered the fault as its own (``execution.deadline`` raw 13 for a job
        # that never ran) and reported to the fault controller as one more fault
        self._stop_admission(Status.unavailable(
            Phase.RECOVERY, f"device lifecycle is {ended} after {failure}"))
        if moved:
            log.error("device lifecycle Failed: %s", status)
        else:
            log.debug("device lifecycle already %s; also: %s", self.run.state, status)

    # ---- the queue through recovery (ready_queue_max) ------------------------------------------
    def wait_for_ready(self, job: Job) -> Status | None:
        """Queue through recovery (Triton's DELAY policy): a request that arrives while the
        device drains, recovers, configures or warms up waits for Ready, bounded by its
        deadline and by ``ready_queue_max`` waiters. None when it may go on; else why not
        (UNAVAILABLE when the queue is full, the lifecycle Failed or the executor stops;
        DEADLINE when its deadline passed first; CANCELLED)."""
        clock = self._host.clock
        with self.ready_cv:
            state = self.run.state
            if state not in _RECOVERING and not (state == LIFECYCLE_READY and self._asked()):
                return None  # Ready (admits), or Created/Failed/Stopped: answered by the caller
            if self._ready_waiters >= self._host.config.ready_queue_max:
                return Status.unavailable(Phase.ADMISSION, f"device lifecycle is "
                                          f"{self.run.state} and {self._ready_waiters} "
                                          "requests already wait for Ready; retry later",
                                          **job.ctx())
            self._ready_waiters += 1
            try:
                while not self.admitting:
                    if self.stopping or self.run.final:
                        return None
                    if job.cancel_flag:
                        return Status.cancelled(Phase.ADMISSION, **job.ctx())
                    remaining = job.deadline - clock.monotonic()
                    if remaining <= 0:
                        return Status.deadline(Phase.ADMISSION, "deadline passed while the "
                                               f"device was {self.run.state}",
                                               **job.ctx())
                    clock.wait(self.ready_cv, remaining)
                return None
            finally:
                self._ready_waiters -= 1

    def ready_changed(self) -> None:
        """Ready, Failed, stopping or a cancel: wake the requests waiting for Ready."""
        with self.ready_cv:
            self.ready_cv.notify_all()

    # ---- recovery (§9.1, §9.2): Ready -> Draining -> Recovering -> Configuring -> Warming ------
    def request_recovery(self, decision: Decision) -> None:
        """Called by the fault controller; never blocks. Runs the recovery on its own thread
        (threads mode) or leaves it for ``run_pending_recovery`` (stepped mode)."""
        if decision.action is Action.STOP:
            self.fail(decision.status)  # (queued jobs refused as Failed, naming the fault)
            return
        with self.mu:
            if (decision.action is Action.RESET_REBUILD and not self.stopping and (
                    self._asked() or self.run.state in (LIFECYCLE_DRAINING,
                                                        LIFECYCLE_RECOVERING)
                    or (self._recovery_owner is not None
                        and self.run.state in (LIFECYCLE_CONFIGURING, LIFECYCLE_WARMING)))):
                # the recovery asked for or under way covers it, with the reset it calls for
                # (a model switch, or a rebuild asked for a LIFECYCLE fault, went on without
                # one: the next generation on a device never reset); a fault of a golden job
                # refuses that generation, and the device is reset before the next one
                # (``_release_failed_generation``: it was configured on a device never reset)
                self._reset_for = decision.status
            if self.run.state != LIFECYCLE_READY or self._asked():
                return  # already draining/recovering: one recovery covers it
            if self._shutdown_called:
                # asked once a shutdown began (it waits for the recovery before it, still
                # Ready): no recovery of a device about to be closed. Its thread took
                # ``recovery_mu`` before the shutdown and ran a whole drain, reset and golden
                # run (or, interrupted, a failed recovery), counted as a fault recovery
                self.admitting = False
                self.dropped_recoveries += 1
                log.warning("recovery dropped: asked for once shutdown() began (%s -> %s)",
                            decision.status, decision.action.value)
                return
            # (one asked for a generation since replaced is superseded: its thread, waiting
            # for ``recovery_mu``, runs this one instead)
            superseded = self._pending_recovery is not None
            self._pending_recovery = decision
            self._pending_gen = self._host.gen.id if self._host.gen is not None else None
            if decision.action is Action.RESET_REBUILD:
                # a model switch that takes the recovery lock first replaces this recovery
                # (dropped, stale, when its turn comes): it makes its reset. It drained and
                # rebuilt without one, and the device was never reset after the fault
                self._reset_for = decision.status
            self.admitting = False  # stop admission at once (§8 Device row)
        if self._host.config.threads and not superseded:
            self._recovery_thread = self._host.clock.start_thread(self._supervised_recovery,
                                                                  "calexec-recovery")

    def _supervised_recovery(self) -> None:
        """The recovery thread's barrier: an exception mid-recovery leaves the device in an
        unknown state, so the lifecycle ends Failed with the reason (never a dead thread
        with the lifecycle stuck in Draining or Recovering)."""
        try:
            self.run_pending_recovery()
        except Exception as exc:  # noqa: BLE001 - the barrier
            status = Status.internal("recovery_exception", Phase.RECOVERY,
                                     f"recovery raised {type(exc).__name__}: {exc}",
                                     **self._gctx())
            log.error("recovery thread caught %s", status, exc_info=exc)
            self._host.thread_faults.append({"thread": "calexec-recovery",
                                             "error": f"{type(exc).__name__}: {exc}",
                                             "job": None,
                                             "at": self._host.clock.monotonic()})
            self._stop_admission(status)
            self.fail(status)

    def run_pending_recovery(self) -> Status | None:
        """Run the recovery the controller asked for, if any (stepped mode calls this). It
        is claimed once this thread holds ``recovery_mu``, i.e. after the recovery, model
        switch or shutdown holding it now: a decision made for generation N that finds another
        generation serving then (a ``switch_model`` took the lock first and went live) is
        dropped, logged and counted (``dropped_recoveries``): it ran once more on the fresh
        generation, an extra drain, reset and golden run of a healthy device. None when
        nothing ran."""
        with self.mu:
            if self._pending_recovery is None:
                return None
        with self._recovery_mu:
            with self.mu:
                decision, self._pending_recovery = self._pending_recovery, None
                current = self._host.gen.id if self._host.gen is not None else None
                stale = (decision is not None and current is not None
                         and current != self._pending_gen)
                if decision is not None and not stale:
                    self._claimed = decision
                asked_for = self._pending_gen
            if decision is None:
                return None
            if stale:
                with self.mu:
                    self._reset_for = None  # a fault of the replaced generation
                self.dropped_recoveries += 1
                log.warning("recovery for generation %s dropped: generation %s serves since "
                            "(a model switch or another recovery replaced it); was: %s -> %s",
                            asked_for, current, decision.status, decision.action.value)
                return None
            try:
                return self._recover_held(
                    decision.status, reset=decision.action is Action.RESET_REBUILD,
                    calbin_path=(self._last_good_other() if decision.action is
                                 Action.ROLLBACK else None))
            finally:
                with self.mu:
                    self._claimed = None

    def switch_model(self, calbin_path: str | os.PathLike[str],
                     without_rollback: bool = False) -> Status:
        """Model switch through the lifecycle: the new calbin goes live only after its golden
        passes; otherwise the previous one is configured again and keeps serving. A path that
        is no path (None, an int; a ``pathlib.Path`` is taken as its str) is refused
        ``calbin.path_required`` before the lifecycle moves: the drain and teardown would run
        and the open of generation+1 raise, leaving no generation at all. A switch whose roll
        back could restore nothing (the calbin it rolls back to written over in place since
        it served) is refused ``calbin.rollback_changed`` before anything moves, unless
        ``without_rollback``: then it goes on, and a refusal of ``calbin_path`` ends the
        lifecycle Failed (``_rollback_lost``)."""
        if isinstance(calbin_path, os.PathLike):
            calbin_path = os.fspath(calbin_path)
        if not isinstance(calbin_path, str):
            return switch_check.refused("path_required", repr(calbin_path)[:200],
                                        "a calbin file path (a str) is required")
        self._refuse_within_recovery("switch_model")
        refused = self._reread_goldens()
        if refused is not None:
            return refused
        refused = self._rollback_lost(calbin_path)
        if refused is not None and not without_rollback:
            return refused
        if refused is not None:
            log.warning("switch to %s without a roll back, as asked: %s",
                        fields.shown(calbin_path, 300), refused.message)
        return self.recover(Status.failure("lifecycle.model_switch", Category.LIFECYCLE,
                                           Phase.RECOVERY, f"switch to {fields.shown(calbin_path, 300)}"),
                            reset=False, calbin_path=calbin_path)

    def _rollback_lost(self, target: str) -> Status | None:
        """(``switch_model``, before the lifecycle moves) The refusal of a switch to ``target``
        whose roll back could restore nothing: the calbin a refusal of ``target`` would roll
        back to (``_recover_held``'s choice: the last good other calbin, or the serving path
        itself when reloaded) was written over in place since it served (``cp`` over it),
        so its bytes are gone (``ServedFiles.changed``). Until stop 75 the switch went on and,
        were ``target`` refused, the roll back was refused ``calbin.changed`` and the
        lifecycle ended Failed, the model still on the device no longer served. Refused,
        nothing moves: the model that serves goes on serving."""
        gen = self._host.gen
        current = gen.calbin_path if gen is not None else None
        rollback = (target if target == current and target in self.good_calbins
                    else self._last_good_other(exclude=target) if target != current else None)
        if rollback is None:
            return None
        lost = self._served_files.changed(rollback)
        if lost is None:
            return None
        served, now = lost
        what = ("it" if rollback == target
                else f"the calbin it would roll back to, {fields.shown(rollback, 300)},")
        return Status.failure(
            ROLLBACK_CHANGED, Category.ARTIFACT, Phase.VALIDATE,
            f"switch to {fields.shown(target, 300)} refused, nothing moved, the model that "
            f"serves goes on: were it refused, {what} could not be restored: "
            f"{fields.shown(rollback, 300)} was written over in place since it served (sha256 "
            f"{served[:16]}..., the file now {now[:16]}...: a cp over it), so no copy of what "
            "served is left and the lifecycle would end Failed; write the new calbin to a new "
            "path, or to a new file renamed over the old one (mv), and restart the server "
            "with it; or switch anyway, with no roll back (a refusal then ends the lifecycle "
            "Failed): without_rollback (POST /admin/reload {\"calbin\": PATH, "
            "\"without_rollback\": true})")

    def _manifest_flag(self) -> str:
        """`` --manifest M`` when the manifest is not the packaged one: ``golden record``
        without it pins into the packaged manifest's file, which this executor does not read."""
        source = getattr(self._host.manifest, "source", None)
        if not isinstance(source, str) or not os.path.isfile(source):
            return ""
        if os.path.realpath(source) == os.path.realpath(default_manifest_path()):
            return ""
        return f" --manifest {shlex.quote(source)}"

    def _runtime_lib_flag(self) -> str:
        """`` --runtime-lib L`` when the runtime is a library loaded from a path (``--runtime-lib
        L`` or ``$CALEXEC_CALRT_LIB``), not the bundled emulator: the golden is what the
        runtime computes, and ``golden record`` without it pins the bundled emulator's."""
        path = getattr(self._host.runtime, "path", None)
        return f" --runtime-lib {shlex.quote(path)}" if isinstance(path, str) and path else ""

    def _reread_goldens(self) -> Status | None:
        """(``switch_model``, before the lifecycle moves) Read the manifest's goldens file
        again: the pin ``calexec golden record`` wrote while this executor served counts for
        the switch (the file was read once, with the manifest, so a recorded pin needed a
        restart while the refusal said to record it). Pins of the file win over those the
        manifest came with. A goldens file that no longer loads refuses the switch
        (``golden.file_invalid``, nothing moved); a manifest made in code (no file) keeps
        its own goldens."""
        manifest = self._host.manifest
        source = getattr(manifest, "source", None)
        if not isinstance(source, str) or not os.path.isfile(source):
            return None
        try:
            fresh = load_goldens(goldens_path(source))
        except GoldenFileError as exc:
            return Status.failure("golden.file_invalid", Category.ARTIFACT, Phase.VALIDATE,
                                  f"the goldens file does not load: {exc}; nothing was "
                                  "switched, the current model serves on")
        self.pinned_goldens = {**getattr(manifest, "goldens", {}), **fresh}
        return None

    def recover(self, reason: Status, reset: bool = True,
                calbin_path: str | None = None) -> Status:
        """Drain, optionally reset, tear down the generation, open generation+1 of
        ``calbin_path`` (default: the current calbin), run the golden, reopen admission."""
        self._refuse_within_recovery("recover")
        with self._recovery_mu:
            return self._recover_held(reason, reset, calbin_path)

    def _refuse_within_recovery(self, call: str) -> None:
        """RuntimeError naming ``call`` when this thread runs a recovery or model switch now
        (a done callback of a job that recovery resolved: a fenced one, or in stepped mode
        any job its drain completes): ``recovery_mu`` is not reentrant, and the call waited
        for it, on the thread holding it, for ever (the lifecycle stuck in Draining)."""
        if self._recovery_owner == threading.get_ident():
            raise RuntimeError(
                f"DeviceExecutor.{call}() called on the thread running a recovery or model "
                f"switch ({threading.current_thread().name}; from a done callback?): it would "
                "wait for itself; a done callback must only hand the result on "
                "(docs/embedding.md section 4)")

    def _recover_held(self, reason: Status, reset: bool, calbin_path: str | None) -> Status:
        """``recover`` with ``recovery_mu`` held by this thread."""
        host = self._host
        with self.mu:
            if self.stopping:  # shutdown ran first: nothing left to recover
                return Status.unavailable(Phase.RECOVERY, f"{SHUTDOWN_CALLED}; nothing was "
                                          "done")
            state = self.run.state
            if state != LIFECYCLE_READY:
                # Failed, Stopped, or a start still warming up: nothing is done, so no
                # recovery is recorded (it was, as a failed one, in ``recoveries`` and
                # calexec_recoveries_total)
                return Status.unavailable(Phase.RECOVERY, f"cannot recover from lifecycle "
                                          f"{state}: nothing was done", **self._gctx())
            self.run.send(LIFECYCLE_EV_DRAIN)
            self._claimed = None  # under way as Draining from here
            # (with the check of ``stopping``: a shutdown that finds no owner knows the
            # holder of recovery_mu does no recovery's work, ``_shutdown_once``)
            self._recovery_owner = threading.get_ident()
        try:
            t0 = host.clock.monotonic()
            from_generation = host.gen.id if host.gen else None
            progress: _RecoveryProgress = {}
            status = self._recover(reason, reset, calbin_path, progress)
        except BaseException:
            with self.mu:
                self._recovery_owner = None
                self._reset_for = None
            raise
        with self.mu:
            self._reset_for = None  # (met by this recovery, or too late for its reset)
        record: RecoveryRecord = {
            "reason": reason.code, "reset": reset, "from_generation": from_generation,
            **progress, "ok": status.ok, "status": status.code,
            "seconds": host.clock.monotonic() - t0,
            "to_generation": host.gen.id if host.gen else None, "lifecycle": self.run.state}
        self.recoveries.append(record)
        del self.recoveries[:-RECOVERY_RECORDS_KEPT]  # (a list still: embedders compare it)
        key = (record["reason"], record["ok"])
        self.recovery_totals[key] = self.recovery_totals.get(key, 0) + 1
        if calbin_path is None:  # (a model switch's outcome is its caller's to say)
            # the fault's WARNING line said the recovery began: this one says how it ended
            log.log(logging.INFO if status.ok else logging.WARNING,
                    "recovery after %s %s: generation %s -> %s, lifecycle %s, reset=%s, "
                    "%.3fs", reason.code, "done" if status.ok else f"failed ({status})",
                    from_generation, record["to_generation"], record["lifecycle"],
                    record.get("reset_kind"), record["seconds"])
        self._complete_owed_shutdown()
        return status

    def _complete_owed_shutdown(self) -> None:
        """(the recovery's thread, its work done, ``recovery_mu`` held) A ``shutdown`` that
        answered ``shutdown.recovery_busy`` meanwhile interrupted this recovery, which then
        stopped (nothing is configured once a shutdown was called): complete that shutdown
        now, with its grace. Left to a later ``shutdown()``, the lifecycle was ``Stopped``
        with the device open and the executor's threads running. Ends the recovery's
        ownership (under ``mu``, once no shutdown is owed: none is lost)."""
        while True:
            with self.mu:
                grace, self._shutdown_owed = self._shutdown_owed, None
                if grace is None:
                    self._recovery_owner = None
                    return
            status = self._shutdown(grace)
            log.info("the shutdown that found this recovery busy was completed as it ended: "
                     "%s, lifecycle %s", status.code, self.run.state)

    def _recover(self, reason: Status, reset: bool, calbin_path: str | None,
                 record: _RecoveryProgress) -> Status:
        host = self._host
        config = host.config
        policy = config.recovery
        # (Ready -> Draining already, by ``_recover_held``)
        unavailable = Status.unavailable(Phase.RECOVERY,
                                         f"device recovering after {reason.code}; retry later")
        self._stop_admission(unavailable)
        # fencing: no request thread works on the old generation past this point
        if not self._fence(host.gen, config.fence_grace_s):
            status = Status.internal("recovery.fence", Phase.RECOVERY,
                                     "request threads did not leave generation "
                                     f"{host.gen.id} within {config.fence_grace_s}s",
                                     **self._gctx())
            self.fail(status)
            return status
        drained = self._drain(policy.drain_grace_s, interruptible=True,
                              reset_follows=policy.reset_kind != "none")
        reset_done = False
        # A job still on the device after the drain grace needs the safe reset whatever the
        # cause of this recovery (§9.1: a model switch or a LIFECYCLE rebuild asks for none,
        # but a hung job would otherwise end it Failed).
        if not drained and policy.reset_kind != "none" and not self.stopping:
            status = self._reset(policy.reset_kind)  # aborts what the device still holds
            if not status.ok:
                self.fail(status)
                return status
            reset_done = True
            drained = self._drain(policy.drain_grace_s, interruptible=True)
        if not drained and self.stopping:
            return self._stopped_draining(reason, reset_done, record)
        if not drained:
            how = (f"after a device {policy.reset_kind}" if reset_done else
                   f"and no safe reset is configured (reset_kind={policy.reset_kind})")
            status = Status.failure("recovery.not_drained", Category.DEVICE, Phase.RECOVERY,
                                    f"submitted jobs did not finish within "
                                    f"{policy.drain_grace_s}s {how}; the process should exit "
                                    "for its supervisor", **self._gctx())
            self.fail(status)
            return status
        status = self._advance(LIFECYCLE_EV_RECOVER)
        if not status.ok:
            return status
        old = host.gen
        old.pool.quarantine_all()  # invariant 8: every old-generation slot
        with self.mu:
            met, self._reset_for = self._reset_for, None
        if met is not None and not reset and not reset_done:
            log.warning("%s met while the %s drained: the device is reset before generation %d "
                        "is torn down", met, reason.code, old.id)
            reset = True
        if reset and not reset_done:
            if policy.reset_kind == "none":
                # a device fault needs a reset the runtime cannot give safely: stop (§9.1)
                status = Status.failure("recovery.no_safe_reset", Category.DEVICE,
                                        Phase.RECOVERY, f"{(met or reason).code} needs a "
                                        "device reset "
                                        "and reset_kind=none; the process should exit for its "
                                        "supervisor", **self._gctx())
            else:
                status = self._reset(policy.reset_kind)
            if not status.ok:
                self.fail(status)
                return status
        record["reset_kind"] = policy.reset_kind if reset or reset_done else None
        self._kv_gone = old.kvc.gone_with_it()  # (``_open`` tells generation+1)
        status = old.release(host.device)
        self._retire(old)
        host.gen = None
        if not status.ok:
            self.fail(status)
            return status
        target = calbin_path or old.calbin_path
        # A shutdown requested by now ends the recovery here, the old generation torn down
        # and nothing configured (Recovering -> Stopped; Configuring -> Stopped if it came
        # between the two steps): the target was loaded, configured and mapped, its golden
        # refused (admission stopped) and the lifecycle went Warming -> Stopped, the
        # shutdown tearing it down again
        ended = self._stop_for_shutdown(f"before {fields.shown(target, 300)} was configured")
        if ended is None:
            status = self._advance(LIFECYCLE_EV_RECONFIGURE)
            if not status.ok:
                return status
            ended = self._stop_for_shutdown(f"before {fields.shown(target, 300)} was configured")
        if ended is not None:
            return ended
        # The other chance if this one is refused: a switch to another calbin rolls back to
        # the last good one (Triton keeps the old model on a failed reload); a recovery, or a
        # reload of the calbin that served, retries it; and a calbin that served is retried
        # again while its golden jobs meet device faults, within the escalation budget
        # (``_retry_golden``).
        switching = calbin_path is not None and calbin_path != old.calbin_path
        self._rollback_path = (self._last_good_other(exclude=target) if switching else
                               target if target in self.good_calbins else None)
        # a recovery restores what served (``_open``); a reload, of the serving path too,
        # loads what the path holds now: a new calbin
        status = self._configure_and_warm(target, restore=calbin_path is None)
        refused: list[str] = []
        first_refusal: Status | None = None
        # a switch's target whose golden job met a §8 TRANSIENT fault (13 timeout, 17 busy
        # past submit's retries: the device slow or busy, not the calbin) is configured
        # again, not rolled back (``_retry_transient_golden``); it was rolled back at one
        # such fault, the operator told to try a reload that would pass (until stop 73)
        target_runs = 1
        tried = target  # the calbin whose generation ``status`` answers for
        while not status.ok and not self.stopping and self.run.can(LIFECYCLE_EV_ROLL_BACK):
            refused.append(status.code)
            first_refusal = first_refusal or status
            if tried == target and target_runs > 1:
                first_refusal = status  # the target's last refusal is the one to tell
            again = (switching and tried == target
                     and self._retry_transient_golden(status, target_runs))
            released = self._release_failed_generation(record)
            if not released.ok:  # its job still runs on the device: §9.1, never torn down
                record["refused"] = refused
                self.fail(released)
                return released
            fallback = target if again else self._rollback_path
            why = (f"{first_refusal.code}: {first_refusal.message}" if first_refusal
                   else refused[0])
            refusal = (f"{fields.shown(target, 300)} was refused ({why}) and shutdown() began before "
                       f"{fields.shown(fallback, 300)} was configured again: no roll back, nothing configured")
            if self.shutdown_requested():
                # A shutdown began while the refused generation was torn down: nothing is
                # configured once it has (its golden run would be refused anyway, as a
                # recovery the controller asks for then is dropped). The roll back went on and
                # loaded, configured and mapped the fallback only for the shutdown to tear it
                # down. The lifecycle ends Stopped (from Warming: the refused generation's
                # golden; from Configuring: its configure), Failed if that cannot be.
                self._rollback_path = None
                ended = self._stop_for_shutdown(refusal=refusal)
                if ended is not None:
                    record["refused"] = refused
                    return ended
                status = Status.unavailable(Phase.RECOVERY, refusal)
                break
            advanced = self._advance(LIFECYCLE_EV_ROLL_BACK)
            if not advanced.ok:
                record["refused"] = refused
                return advanced
            if not again:  # (a retry of the target keeps the roll back for after it)
                self._rollback_path = None
            ended = self._stop_for_shutdown(refusal=refusal)  # (between the two steps)
            if ended is not None:
                record["refused"] = refused
                return ended
            if again:
                target_runs += 1
                log.warning("%s met by the golden run of %s: a transient fault (the device "
                            "busy or slow, not the calbin): its golden is run again (run %d "
                            "of at most %d)", status, fields.shown(target, 300), target_runs,
                            self._host.config.recovery.max_recoveries + 1)
            # (the target again is what the operator asked for: loaded from its path; a
            # roll back restores what served)
            status = self._configure_and_warm(fallback, restore=not again)
            tried = fallback
            if again:
                pass  # the target again: a refusal now is told as its own (above)
            elif self._retry_golden(status, refused[target_runs - 1:]):  # (its own count)
                # the fallback served, and a job of its golden met a fault (a NaN, a hung or
                # failed job): it is configured again as the fault controller's budget
                # allows (it escalates to Failed past max_recoveries), not Failed at the
                # second fault of one recovery
                self._rollback_path = fallback
            # (a reload of the serving path whose new file was refused, restored from the
            # file that served, held open: a roll back, not a retry of what was asked)
            if status.ok and (fallback != target or (calbin_path is not None
                                                     and self._restored_held)):
                record["refused"] = refused
                ready = self._go_ready()
                if not ready.ok:
                    return ready
                # the refusal's own message says why and what to do (a golden not pinned:
                # the `calexec golden record` to run; a golden that differs: its tokens);
                # the code alone left the operator of a reload nothing to act on
                why = (f"{first_refusal.code}: {first_refusal.message}" if first_refusal
                       else refused[0])
                why += self._refused_golden_advice(first_refusal, target_runs)
                return Status.failure("recovery.rolled_back", Category.ARTIFACT, Phase.RECOVERY,
                                      f"{fields.shown(target, 300)} was refused ({why}); {fields.shown(fallback, 300)} "
                                      "serves again", **self._gctx())
        record["refused"] = refused
        if (not status.ok and self.run.state == LIFECYCLE_CONFIGURING
                and self._host.gen is None and self.shutdown_requested()):
            # the calbin's configure was refused (nothing of it is left) with a shutdown
            # begun: no roll back, nothing configured, Configuring -> Stopped (it ended
            # Failed, an exit 3 as for a broken device, though nothing was left on it)
            fallback, self._rollback_path = self._rollback_path, None
            then = (f"before {fields.shown(fallback, 300)} was configured again: no roll back, nothing "
                    "configured" if fallback else "nothing configured")
            ended = self._stop_for_shutdown(refusal=(
                f"{fields.shown(target, 300)} was refused ({status.code}: {status.message}) and shutdown() "
                f"began {then}"))
            if ended is not None:
                return ended
        if not status.ok:
            # A shutdown stopped the golden run (its queued jobs are cancelled as any others,
            # FI13): no verdict on the calbin. With nothing left on the device the exit is
            # orderly, Warming -> Stopped (the shutdown then tears down as after a drain);
            # failing it made every drain that met a recovery an exit 3, as for a broken
            # device. A golden job the device still holds: Failed, as before.
            with self.mu:
                stopped = (self.stopping and self.run.state == LIFECYCLE_WARMING
                           and self.run.can(LIFECYCLE_EV_STOP))
                if stopped:
                    self.run.send(LIFECYCLE_EV_STOP)
                    self.ready_cv.notify_all()
            if stopped:
                log.info("recovery stopped by the shutdown while warming (%s): lifecycle "
                         "Stopped", status.code)
                return status
            if self.stopping and self.run.state == LIFECYCLE_WARMING:
                # say why, as an interrupted start does: the lifecycle's failure (what
                # ``calexec serve`` prints as it exits 3) read "wait.deadline: wait_until
                # deadline passed; the job continues", a DEADLINE naming no shutdown
                status = Status.unavailable(
                    status.phase or Phase.RECOVERY,
                    "the recovery was stopped by shutdown() while a golden job of its "
                    f"generation was still on the device ({status.code}: {status.message})",
                    **self._gctx())
            self.fail(status)
            return status
        return self._go_ready()

    def _stop_for_shutdown(self, before: str = "", refusal: str = "") -> Status | None:
        """(a recovery, its old or refused generation torn down, the next one not configured
        yet) A shutdown was requested: the recovery ends here, nothing configured (the
        lifecycle's ``stop`` from Recovering, Configuring or Warming, guarded by
        ``shutdown_requested`` and ``all_submitted_drained``), and the Status it answers says
        so (``refusal``: the refused calbin and the roll back not made; else ``before`` what
        it stopped). None when the lifecycle chart takes no ``stop`` now (its guards decide: no
        shutdown requested, or a job still on the device): the caller goes on as before."""
        with self.mu:
            if not self.run.can(LIFECYCLE_EV_STOP):
                return None
            state = self.run.state
            self.run.send(LIFECYCLE_EV_STOP)
            self.admitting = False
            self.ready_cv.notify_all()
        log.info("recovery stopped by shutdown() in %s, nothing configured: lifecycle "
                 "Stopped", state)
        return Status.unavailable(
            Phase.RECOVERY, refusal or f"shutdown() began once the recovery had torn the old "
            f"generation down, {before}: nothing configured, lifecycle Stopped")

    def _stopped_draining(self, reason: Status, reset_done: bool,
                          record: _RecoveryProgress) -> Status:
        """A shutdown interrupted this recovery in its drain of the old generation (its jobs
        still on the device): the recovery stops there, Draining, with neither a reset nor
        a teardown. The generation keeps its buffers, and the shutdown's own drain, within
        what is left of its grace, takes the jobs over: Stopped and the generation released
        once the device let go, else ``shutdown.not_drained`` with everything kept. (The
        drain went on for ``drain_grace_s`` whatever the shutdown's grace, which then
        answered ``shutdown.recovery_busy`` with nothing torn down.)"""
        host = self._host
        record["reset_kind"] = host.config.recovery.reset_kind if reset_done else None
        # the jobs submitted and not completed, and those the runtime still holds after a
        # failed Wait (in Phase B the completion thread goes on without them: "0 jobs on the
        # device" was said of a hung job until stop 71)
        on_device = len({id(job) for job in host.completion.jobs()}
                        | {id(entry.job) for entry in host.dispatch.held()})
        log.info("recovery after %s stopped by the shutdown while it drained generation %s "
                 "(%d jobs on the device)", reason.code, host.gen.id if host.gen else None,
                 on_device)
        return Status.unavailable(
            Phase.RECOVERY, f"the recovery after {reason.code} was stopped by shutdown() while "
            f"it drained generation {host.gen.id if host.gen else None} (jobs still on the "
            f"device: {on_device}); the shutdown's drain takes them over", **self._gctx())

    def _retry_golden(self, status: Status, refused: list[str]) -> bool:
        """Whether a generation of a calbin that served, refused with ``status`` (after
        ``refused``), is configured again: a job of its golden run met a fault on the device
        path (a NaN row, a CCU exception, a hung job, a failed CSR write: ``status.job_id``
        set; not a golden that ran and differs, not COMPATIBILITY), or the device itself
        refused its configure (§8 DEVICE, rc 24 map broken: reset, restart or escalate; the
        device is reset before the next attempt, ``_release_failed_generation``; it ended
        the lifecycle Failed at the second such refusal of one recovery, the budget unspent),
        at most ``RecoveryPolicy.max_recoveries`` attempts in one recovery, and only while the
        controller, told of every such fault, has not escalated (the lifecycle is not final)."""
        return (not status.ok
                and (status.job_id is not None or self._configure_refused_by_device)
                and status.category is not Category.COMPATIBILITY
                and status.code != "golden.mismatch" and not self.stopping
                and not self.run.final
                and len(refused) <= self._host.config.recovery.max_recoveries)

    @staticmethod
    def _refused_golden_advice(refusal: Status | None, runs: int) -> str:
        """What a ``recovery.rolled_back`` adds to the refusal of a switch's target: how many
        golden runs it had, and, for a fault a job of its golden met on the device (not a
        golden that ran and differs, nor a calbin the runtime could not load), that the fault
        may have been the device's, so that a retry of the reload may pass (the operator read
        only the fault, and could not tell it from a calbin that is wrong)."""
        said = f"; its golden ran {runs} times" if runs > 1 else ""
        if refusal is None or refusal.job_id is None or refusal.code == "golden.mismatch":
            return said
        if refusal.category is Category.TRANSIENT:
            return (f"{said}, each meeting a transient fault (the device busy or slow, not the "
                    "calbin): a retry of the reload may pass")
        return ("; a job of its golden run met that fault on the device, a fault of the calbin "
                "or of the device: if it was the device's, a retry of the reload may pass")

    def _retry_transient_golden(self, status: Status, runs: int) -> bool:
        """Whether a model switch's target, refused with ``status`` after ``runs`` golden
        runs, is configured and its golden run again rather than rolled back: a job of its
        golden met a §8 TRANSIENT fault (13 timeout, 17 busy once submit's own retries were
        spent: ``status.job_id`` set), which is the device's, not the calbin's (the Transient
        row retries the job), at most ``RecoveryPolicy.max_recoveries`` runs more, and only
        while no shutdown began and the controller has not ended the lifecycle. A fault the
        calbin may cause (an artifact code, a NaN row, a CCU exception, a golden that differs)
        still rolls back at once: a calbin that never served proved nothing yet."""
        return (not status.ok and status.job_id is not None
                and status.category is Category.TRANSIENT and not self.stopping
                and not self.run.final
                and runs <= self._host.config.recovery.max_recoveries)

    def _configure_and_warm(self, calbin_path: str, restore: bool = False) -> Status:
        """Configuring -> Warming -> (golden) with a fresh generation of ``calbin_path``
        (``restore``: of what served from it, ``_open``)."""
        status = self._open(calbin_path, restore)
        self._configure_refused_by_device = (not status.ok
                                             and status.category is Category.DEVICE)
        if not status.ok:
            self._host.gen = None
            if status.category is Category.DEVICE and self._recovery_owner is not None:
                # a recovery's configure refused by the device itself (§8: 24 map broken, 18
                # unavailable: reset, restart or escalate): the device is reset before the
                # next generation (``_release_failed_generation``; the roll-back configured
                # the next one on a device never reset)
                with self.mu:
                    self._reset_for = self._reset_for or status
                self._report_refused_configure(status)
            return status
        status = self._advance(LIFECYCLE_EV_CONFIGURED)
        return self.warm_up() if status.ok else status

    def _report_refused_configure(self, status: Status) -> None:
        """Tell the fault sink of a configure the device refused (no job carries it, so no
        one did: ``calexec_device_faults_total`` never counted it and the log had no fault
        line for it, where a golden job's device fault has both). It is part of the recovery
        under way (``recovery_under_way`` answers True while it is reported): the controller
        counts it against no escalation budget, the recovery's own bound on configures
        (``_retry_golden``: at most ``max_recoveries`` of them) stays the one that ends it
        Failed. Called without ``mu`` (the controller asks for the reset it calls for)."""
        self._reporting_refusal = True
        try:
            self._host.outcomes.faults.report(status)
        finally:
            self._reporting_refusal = False

    def _release_failed_generation(self, record: _RecoveryProgress | None = None) -> Status:
        """Tear down a generation refused while Configuring/Warming, or at a failed start,
        only once the runtime let go of it (§9.1): its golden jobs may still be on the
        device, so fence, drain, and reset if they do not finish. A job still on the device
        after that keeps the generation alive (buffers mapped, KvManager kept): the Status
        says so and the caller ends Failed for the supervisor instead of rolling back. A
        fault of its golden run that calls for a reset (``_reset_for``: a CCU exception, a
        NaN row) gets it before the generation is torn down and the next one configured
        (with ``reset_kind=none``: ``recovery.no_safe_reset``, as in ``_recover``); a reset
        made here is noted in ``record``."""
        host = self._host
        gen = host.gen
        policy = host.config.recovery
        if gen is None:  # its configure failed: nothing to tear down; a reset it called for
            return self._reset_after_refused_open(record)
        self._stop_admission(Status.unavailable(Phase.RECOVERY,
                                                f"generation {gen.id} refused; retry later"))
        fenced = self._fence(gen, host.config.fence_grace_s)
        # a start a shutdown interrupted (its golden job still on the device) waits only for
        # its queued jobs to be failed, and does not reset: the job is left to the device and
        # the generation kept, the shutdown's own drain (next, within what is left of its
        # grace) releases it once the device let go; a drain of ``drain_grace_s`` here made
        # the shutdown answer start_busy. A shutdown that interrupts a recovery in this drain
        # ends it the same way, and no reset follows (the drain went on for
        # ``drain_grace_s``, and the shutdown answered recovery_busy)
        interrupted = self.stopping
        drained = fenced and self._drain(policy.drain_grace_s, device_too=not interrupted,
                                         interruptible=True,
                                         reset_follows=policy.reset_kind != "none")
        with self.mu:
            met, self._reset_for = self._reset_for, None
        reset = Status.OK
        if fenced and not self.stopping and policy.reset_kind != "none" and (
                not drained or met is not None):
            if drained:
                log.warning("%s met by generation %d's golden run: the device is reset before "
                            "the next generation", met, gen.id)
            reset = self._reset(policy.reset_kind)
            if record is not None:
                record["reset_kind"] = policy.reset_kind
            drained = reset.ok and self._drain(policy.drain_grace_s, interruptible=True)
        elif drained and met is not None and not self.stopping:
            reset = Status.failure("recovery.no_safe_reset", Category.DEVICE, Phase.RECOVERY,
                                   f"{met.code} met by generation {gen.id}'s golden run needs "
                                   "a device reset and reset_kind=none; the process should "
                                   "exit for its supervisor", generation=gen.id)
        host.gen = None
        if not drained:
            self._retire(gen)  # kept, never released: the device may still use it
            how = ("shutdown() stopped its drain; its buffers stay mapped until the device "
                   "lets go" if self.stopping else
                   f"no reset freed it (reset_kind={policy.reset_kind}); its buffers stay "
                   "mapped; the process should exit for its supervisor (§9.1)")
            return Status.failure(
                "recovery.generation_on_device", Category.DEVICE, Phase.RECOVERY,
                f"generation {gen.id} was refused while a job of it is still on the device "
                f"and {how}", generation=gen.id)
        status = gen.release(host.device)
        self._retire(gen)
        return reset if not reset.ok else status

    def _reset_after_refused_open(self, record: _RecoveryProgress | None) -> Status:
        """A generation whose configure the device refused (``_configure_and_warm``: a
        DEVICE failure such as ``calrt.map_failed``, rc 24) has nothing to tear down, but
        the device gets the reset §8 calls for before the next generation is configured
        (``reset_kind=none``: ``recovery.no_safe_reset``, as for a fault of a golden job)."""
        with self.mu:
            met, self._reset_for = self._reset_for, None
        if met is None or self.stopping:
            return Status.OK
        policy = self._host.config.recovery
        if policy.reset_kind == "none":
            return Status.failure("recovery.no_safe_reset", Category.DEVICE, Phase.RECOVERY,
                                  f"{met.code} met while configuring a generation needs a "
                                  "device reset and reset_kind=none; the process should exit "
                                  "for its supervisor", **self._gctx())
        log.warning("%s met while configuring a generation: the device is reset before the "
                    "next one", met)
        status = self._reset(policy.reset_kind)
        if status.ok and record is not None:
            record["reset_kind"] = policy.reset_kind
        return status

    def _retire(self, gen: Generation) -> None:
        """Keep a retired generation's host storage until the device proves it writes none of
        it any more (a stale DMA after a reset lands there, FI14; never in reused memory).
        Proof is ``device.dma_quiescent()``; a runtime without it keeps them all (logged).
        A generation that was never released (its job still on the device) is kept as is.
        Discarded storage is dropped explicitly: slots and their chart runs form cycles."""
        if gen not in self._retired:
            self._retired.append(gen)
        self._discard_proven()

    def _discard_proven(self) -> None:
        released = [gen for gen in self._retired if gen.released]
        if not released or self._host.device is None:
            return
        probe = getattr(self._host.device, "dma_quiescent", None)
        proven = probe() if probe is not None else None
        if proven is None and len(released) > 4:
            log.warning("%d retired generations kept: the runtime offers no proof that no "
                        "stale DMA is pending (dma_quiescent)", len(released))
        if proven:
            for gen in released:
                self._retired.remove(gen)
                gen.discard()

    def _last_good_other(self, exclude: str | None = None) -> str | None:
        host = self._host
        exclude = exclude if exclude is not None else (host.gen.calbin_path if host.gen
                                                       else None)
        others = [p for p in self.good_calbins if p != exclude]
        return others[-1] if others else None

    def _reset(self, kind: str) -> Status:
        # the jobs it aborts end ``recovery.job_aborted`` (the completion side tells them)
        self._host.completion.device_reset(kind)
        rc = getattr(self._host.device, kind)()
        return Status.from_calrt(rc, Phase.RECOVERY, f"device {kind}", **self._gctx())

    def _gctx(self) -> dict[str, int]:
        host = self._host
        return {} if host.gen is None else {"generation": host.gen.id}

    def _stop_admission(self, status: Status) -> None:
        """No new admissions; waiters end; queued (not submitted) jobs fail with ``status``
        (UNAVAILABLE: the client retries after Retry-After; nothing is dropped silently)."""
        self.admitting = False
        self._refuse_queued(status)
        host = self._host
        if host.gen is not None:
            host.gen.kvc.wake()
            host.gen.pool.wake()

    def _refuse_queued(self, status: Status) -> None:
        host = self._host
        host.dispatch.refuse(status)
        if not host.config.threads:
            while host.dispatch.has_work() and host.submit_one():
                pass

    def _drain(self, grace: float, device_too: bool = True,
               interruptible: bool = False, deadline: float | None = None,
               reset_follows: bool = False) -> bool:
        """Wait until every queued job was failed or submitted and every submitted job
        returned from Wait (or the grace ends: bounded). ``device_too`` False: wait only for
        the queued ones (the submitter fails them at once once cancelled), then answer
        whether everything drained, never waiting for a job on the device.
        ``interruptible``: a recovery's drain, which a shutdown's interrupt (``stopping``)
        ends at once, undrained; the shutdown's own drain, within its grace, takes over.
        ``deadline`` (a ``Clock.monotonic()`` value): the end of a caller's grace, used as is
        instead of ``grace`` from now (what is left of a deadline, passed on as seconds and
        added to a later reading, ended later by however long the host kept the thread from
        that reading). ``reset_follows``: a recovery's drain before the reset it makes
        when undrained, which ends (undrained) once all that is left is jobs the executor
        declared hung (``device.hung`` reported): only that reset ends them, and waiting out
        the grace for them kept the device from serving ``drain_grace_s`` longer for
        nothing (5 s a hung job until stop 71)."""
        host = self._host
        clock = host.clock
        if deadline is None:
            deadline = clock.monotonic() + grace
        while True:
            if not host.config.threads:
                while host.submit_one() or host.complete_one():
                    pass
            if self.all_submitted_drained():
                return True
            if interruptible and self.stopping:
                return False
            if (reset_follows and not len(host.completion)
                    and host.dispatch.only_declared_hung()):
                return False
            if not device_too:
                queue = host.dispatch.snapshot()
                if not (queue["queued"] or queue["armed"] or queue["handing_off"]):
                    return False
            now = clock.monotonic()
            # past the grace, the completion thread still finishing jobs their callers
            # already have (a job resolves before its slot goes back: no device wait is
            # left) gets up to THREADS_EXIT_S more: a ``shutdown(0.0)`` right after the last
            # result, or right after ``start()`` (its last golden job), answered
            # ``shutdown.not_drained`` (Failed, the device left open) for that tail
            if now >= deadline and not (now < deadline + THREADS_EXIT_S
                                        and self._only_finishing()):
                return False
            clock.sleep(0.002)

    def _only_finishing(self) -> bool:
        """Nothing queued, armed or in flight, and every job the completion thread still
        holds is resolved: what is left is its tail (the lease back), no device wait."""
        host = self._host
        return host.dispatch.drained() and all(job.done for job in host.completion.jobs())

    def _fence(self, gen: Generation, grace: float) -> bool:
        """Close ``gen`` to request threads and wait (at most ``grace`` s) for those inside
        to leave. Their waits end at once: admission is stopped and they are woken."""
        host = self._host
        deadline = host.clock.monotonic() + grace
        # the jobs armed in it are guesses that will never be fired: released now, so the
        # drain that follows finds nothing armed (left to the submitter they delayed every
        # recovery by a drain poll when a guess was armed: the differential test)
        for job in host.dispatch.close(gen):
            host.outcomes.fail_before_submit(job, Status.unavailable(
                Phase.SUBMIT, f"generation {gen.id} retired before the job was fired; retry",
                **job.ctx()))
        gen.kvc.wake()
        gen.pool.wake()
        return host.dispatch.wait_left(gen, deadline)

    # ---- shutdown (FI13) ---------------------------------------------------------------------------
    def shutdown(self, grace: float = 10.0) -> Status:
        """Stop admission, cancel queued jobs, drain submitted ones within ``grace`` seconds,
        stop the threads, release the generation and the device. Ends Stopped when drained
        (FI13), Failed otherwise. Idempotent. Every wait comes out of the one ``grace`` (when
        all drained, the idle threads get at least ``THREADS_EXIT_S`` to end).

        A recovery or model switch in progress (the controller's thread, or a caller's
        ``recover``/``switch_model``) ends first: it gets half of ``grace`` to finish on its own
        (a switch then goes live and shutdown ends Stopped; one that tore its old generation
        down before or meanwhile configures nothing more and ends Stopped there, the chart's
        ``stop`` guarded by ``shutdown_requested``); then admission (golden runs
        included) stops and queued jobs are cancelled, so it ends quickly (Failed, if it had
        already torn the old generation down; a recovery still draining the old generation
        stops there, its jobs left to the shutdown's drain). Shutdown holds ``recovery_mu``
        from then on, so no recovery runs under its teardown (a later one finds the executor
        stopping and does nothing). If it still runs after ``grace`` nothing is torn down and
        ``shutdown.recovery_busy`` is returned; the recovery, interrupted, completes this
        shutdown (with ``grace``) as it ends (``_complete_owed_shutdown``); so does a
        ``start`` that outlived it (``shutdown.start_busy``, ``_complete_start_owed``).
        Another thread's shutdown in progress is waited
        for (bounded by ``grace``; else ``shutdown.in_progress``), then this call answers as
        one after it. A ``grace`` that is no finite number of seconds >= 0 (None, NaN, inf,
        a negative one) raises TypeError or ValueError naming it, changing nothing: until stop
        68 a negative grace was taken as 0, and ``shutdown(-1)`` (-1 meaning "no limit" to
        ``threading.Lock.acquire``) tore down at once the jobs it was meant to drain."""
        if isinstance(grace, bool) or not isinstance(grace, numbers.Real):
            raise TypeError(f"shutdown: grace={grace!r}: expected seconds (a float), got "
                            f"{type(grace).__name__}")
        # NaN: every bound compares false, a hung job is waited for without end; inf: the
        # thread waits overflow; 10**400: math.isfinite itself raised OverflowError
        if not math.isfinite(fields.to_float(grace)) or grace < 0:
            raise ValueError(f"shutdown: grace={grace!r}: expected a finite number of "
                             "seconds >= 0 (0: cancel what is left without waiting)")
        forked = self.forked_why()
        if forked is not None:  # the parent's device and threads: nothing here to stop
            return Status.unavailable(Phase.SHUTDOWN, f"{forked}; nothing was stopped (the "
                                      "parent's shutdown stops it)")
        if self._recovery_owner == threading.get_ident():
            return self._shutdown(grace)  # called from within a recovery: it holds the lock
        clock = self._host.clock
        start = clock.monotonic()
        end = start + max(grace, 0.0)

        def left(until: float) -> float:
            return max(0.0, until - clock.monotonic())

        # One shutdown at a time. Another thread's (a SIGTERM handler's beside a ``finally``)
        # is the same operation: wait for it, bounded by this call's grace, then answer as a
        # call after it does. It holds ``recovery_mu`` while it tears down, and this call took
        # that for a recovery: ``shutdown.recovery_busy``, "nothing was torn down", while the
        # other call was tearing everything down.
        me = threading.get_ident()
        while True:
            with self.mu:
                owner = self._shutdown_owner
                if owner is None:
                    self._shutdown_owner = me
                    self._shutdown_done.clear()
            if owner is None:
                try:
                    return self._shutdown_once(grace, end, left)
                finally:
                    with self.mu:
                        self._shutdown_owner = None
                    self._shutdown_done.set()
            if owner == me:  # (a done callback run by this very shutdown called it again)
                return self._shutdown_once(grace, end, left)
            if not clock.wait_event(self._shutdown_done, left(end)) and left(end) <= 0:
                return Status.failure(
                    "shutdown.in_progress", Category.LIFECYCLE, Phase.SHUTDOWN,
                    f"another thread's shutdown still runs after grace={grace}s (lifecycle "
                    f"{self.run.state}); it goes on and ends the lifecycle")

    def _shutdown_once(self, grace: float, end: float,
                       left: Callable[[float], float]) -> Status:
        """``shutdown`` on the one thread running it: a start or a recovery in progress ends
        first (bounded by what is left of ``grace``), then the teardown under
        ``recovery_mu``."""
        clock = self._host.clock
        halfway = clock.monotonic() + left(end) / 2
        # A start() running on another thread (a SIGTERM during the warm-up) ends first, as a
        # recovery does below: half of grace on its own, then interrupted (its golden run is
        # refused, so it ends Failed and tears down what it built). Tearing down beside it
        # raised AttributeError from a generation it had just released, or failed it
        # ``internal.start_exception``. A start() that begins after this raises.
        self._shutdown_called = True  # then ``_start_running``: see ``start``
        starting = self._start_running and self._start_thread != threading.get_ident()
        if starting and not clock.wait_event(self._start_done, left(halfway)):
            self._interrupt()
            if not clock.wait_event(self._start_done, left(end)):
                with self.mu:
                    busy = self._start_running
                    if busy:  # it completes this shutdown as it ends
                        self._start_owed = grace
                if busy:
                    return Status.failure(
                        "shutdown.start_busy", Category.LIFECYCLE, Phase.SHUTDOWN,
                        f"start() still ran after grace={grace}s; nothing was torn down "
                        "yet: interrupted, it completes this shutdown as it ends")
        recovery = self._recovery_thread
        if recovery is not None and recovery is not threading.current_thread():
            clock.join(recovery, left(halfway))
        if not self._recovery_mu.acquire(timeout=left(halfway)):
            self._interrupt()  # the recovery still runs: make it end
            if not self._recovery_mu.acquire(timeout=left(end)):
                with self.mu:
                    busy = self._recovery_owner is not None
                    if busy:  # it completes this shutdown as it ends
                        self._shutdown_owed = grace
                if busy:
                    return Status.failure(
                        "shutdown.recovery_busy", Category.LIFECYCLE, Phase.SHUTDOWN,
                        f"a recovery or model switch still runs after grace={grace}s; nothing "
                        "was torn down yet: interrupted, it configures nothing more and "
                        "completes this shutdown as it ends")
                # the holder does no recovery's work (it is about to find the shutdown, or
                # has just ended one): it only returns now
                if not self._recovery_mu.acquire(timeout=OWNERLESS_WAIT_S):
                    return Status.failure(
                        "shutdown.recovery_busy", Category.LIFECYCLE, Phase.SHUTDOWN,
                        f"the recovery lock was still held {OWNERLESS_WAIT_S}s after "
                        f"grace={grace}s; nothing was torn down")
        try:
            # what is left of grace: the wait for a start or recovery above came out of it
            # (the drain got the whole grace again, so shutdown(2.0) took 3 s)
            return self._shutdown(grace, end)
        finally:
            self._recovery_mu.release()

    def _interrupt(self) -> None:
        """Stop admission (golden runs included) and cancel queued jobs: what a recovery in
        progress waits for ends at once (a golden job's wait included, its job left on the
        device)."""
        with self.mu:
            self.stopping = True
            self.admitting = False
            wake = self._golden_wake
        if wake is not None:  # a golden job's wait ends now, its job left on the device
            wake.set()
        self._host.dispatch.cancel_pending()
        self._host.wake_waiters()

    def _shutdown(self, grace: float, until: float | None = None) -> Status:
        """The teardown; the fence, the drain and the threads' exit wait until ``until`` (a
        ``Clock.monotonic()`` value; default ``grace`` from now, what the caller gave, which
        the messages name). The caller's deadline itself, not what was left of it: passed on
        as seconds, it was added to a later reading here and again in the drain and the
        threads' join, each later by however long a loaded host kept the thread between the
        readings (``shutdown(2.0)`` gave waits deadlines 2.02-2.04 s after its start)."""
        host = self._host
        if until is None:
            until = host.clock.monotonic() + max(grace, 0.0)
        budget = max(0.0, until - host.clock.monotonic())
        with self.mu:
            already_final = self.run.final
            self.stopping = True
            self.admitting = False
            if self.never_opened() and self.run.state in (LIFECYCLE_CONFIGURING,
                                                          LIFECYCLE_STOPPED):
                if not already_final:
                    self.run.send(LIFECYCLE_EV_STOP)  # before start(): nothing to drain
                self.ready_cv.notify_all()
                return Status.OK
            if self.run.state == LIFECYCLE_READY:
                self.run.send(LIFECYCLE_EV_DRAIN)
            self.ready_cv.notify_all()
        if host.gen is not None:
            host.gen.kvc.close()
        host.dispatch.cancel_pending()
        host.wake_waiters()
        # no request thread works on the generation past this point: one still inside (an
        # enqueue or a stream's submit preparing its job in a buffer slot) keeps it from
        # being torn down (it was released under that thread, whose request then failed
        # ``internal.slot_dropped`` after the shutdown answered OK; a SetCSR on a destroyed
        # buffer). Woken, such a thread leaves at once: it gets at least THREADS_EXIT_S, as
        # the idle executor threads get to end, within ``fence_grace_s``
        fenced = host.gen is None or self._fence(
            host.gen, min(host.config.fence_grace_s, max(budget, THREADS_EXIT_S)))
        # (the lifecycle's failure names the thread; only this call, which keeps everything,
        # says it tore nothing down: a later shutdown that tears down answers the failure)
        fence_failure = None if fenced else Status.failure(
            "shutdown.not_drained", Category.DEVICE, Phase.SHUTDOWN,
            f"a request thread (an enqueue, decode_sync or a decode stream's submit in its "
            f"admission) still worked on generation {host.gen.id if host.gen else '-'} after "
            f"grace={grace}s")
        if not host.config.threads:
            while host.submit_one():
                pass
        drained = self._drain(0.0, deadline=until)
        # the threads' exit comes out of the same budget: a completion thread in a Wait() the
        # device never answers was joined 5 s more (shutdown(2.0) took 7 s); drained, the
        # idle threads end at once, and get THREADS_EXIT_S however little is left
        host.stop_threads(deadline=until if not drained else max(
            until, host.clock.monotonic() + THREADS_EXIT_S))
        with self.mu:
            if drained and fenced and self.run.can(LIFECYCLE_EV_STOP):
                self.run.send(LIFECYCLE_EV_STOP)
            elif not self.run.final:
                self.run.send(LIFECYCLE_EV_FAIL)
                # (a start this shutdown interrupted in its warm-up, a golden job still on
                # the device: its own Status says so, as it did when it failed itself)
                start = self.start_status
                self.failure = start if start is not None and not start.ok else (
                    fence_failure or Status.failure(
                        "shutdown.not_drained", Category.DEVICE, Phase.SHUTDOWN,
                        f"submitted work did not drain within grace={grace}s"))
        if host.device is None or self._device_closed:
            if self.run.state == LIFECYCLE_STOPPED:
                return Status.OK
            return self.failure or self.start_status or Status.OK
        if not fenced and fence_failure is not None:  # a request thread still writes the
            # generation's buffer slot
            return attrs.evolve(fence_failure, message=f"{fence_failure.message}; nothing "
                                "was torn down (a later shutdown tears down once it left)")
        if not drained:
            # the runtime may still DMA into our buffers: keep everything mapped and alive
            # (a recovery that a shutdown stopped may have ended Stopped before this drain)
            return self.failure or Status.failure(
                "shutdown.not_drained", Category.DEVICE, Phase.SHUTDOWN,
                f"submitted work did not drain within grace={grace}s")
        if host.gen is not None:
            host.gen.release(host.device)
            self._retire(host.gen)
            host.gen = None
        # Drained: a generation refused while its golden job was on the device (kept, never
        # released: no safe reset; or a start that failed so) is let go of by now; it was
        # never torn down and the device never closed (its engine threads and every kept
        # buffer lived on after a Failed lifecycle's shutdown, however often called)
        kept = self._release_kept()
        if not kept.ok:
            return self.failure or kept  # the runtime says it still uses one: keep it all
        self._close_device()
        return Status.OK if self.run.state == LIFECYCLE_STOPPED else self.failure

    def _release_kept(self) -> Status:
        """Tear down the retired generations kept unreleased (refused while a job of theirs
        was on the device), now that the drain found nothing on it; ``Generation.release``
        still refuses one whose slots the runtime says it uses."""
        host = self._host
        status = Status.OK
        for gen in [old for old in self._retired if not old.released]:
            released = gen.release(host.device)
            if gen.released:
                self._retire(gen)
            elif status.ok:
                status = released
        return status

    def _close_device(self) -> None:
        """Close the device once (a failed start or a shutdown): a second close of a
        vendor runtime's handle is undefined."""
        host = self._host
        if host.device is not None and not self._device_closed:
            self._device_closed = True
            host.device.close()
        self._served_files.close()  # (nothing is restored past the device's close)
