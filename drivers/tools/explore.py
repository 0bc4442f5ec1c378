"""Interleaving explorer: the executor's real code on real threads, one thread at a time, under a
controlled scheduler and a virtual clock (issue 14, test support; see docs/testing.md).

How it works (after AWS Shuttle and loom, kept small):

- ``VirtualClock`` is the executor's ``Clock`` (``DeviceExecutor(..., clock=...)``): every lock
  (``Clock.lock``, used by ``LockOrder``), condition, event and thread the executor, the KV
  coordinator, the buffer pool and the jobs make is a controlled one. Exactly one controlled
  thread runs at a time; every other one is parked on its own semaphore. Every lock acquire,
  condition wait, event set/wait, thread start and join, sleep and runtime call (``infer``,
  ``Wait``, ``GetStatus``, resets) is a *scheduling point*: the running thread asks the
  ``Scheduler`` which runnable thread goes next and hands over if it is another one (clock
  reads only with ``VirtualClock.clock_points``: under autojump they add no behaviour).
- Time is virtual and moves only when no thread can run (trio's ``autojump``): to the
  earliest deadline of a timed wait. Deadlines, backoff, drain graces and execution timeouts
  are explored without sleeping.
- The device is the bundled emulator in stepped mode. ``Wait`` polls ``GetStatus`` and blocks
  virtually until the job's status changes or its timeout passes; "run the next stage of
  engine e" is one of the scheduler's choices, and so is "let time pass" while the device
  could still progress (a slow device: execution timeouts).
- Choices come from a chooser: ``PriorityTapeChooser`` (a list of integers drawn by
  hypothesis, used as priority change points, so a failure shrinks to a short schedule; 0 =
  the default), ``PCTChooser`` (seeded random priorities with d-1 priority change points, as
  Shuttle's and Coyote's PCT), ``TapeChooser`` (plain option indices) or a recorded choice
  list (``replay``). Every choice with more than one option is recorded; a failure prints the
  seed, the script and the choices that replay it exactly; ``shrink`` makes a PCT failure
  smaller.
- Checked at every scheduling point: the lock order (``LockOrder.violations``), no executor
  thread caught an exception (``thread_faults``), the in-flight bound; whenever no thread can
  run: §5.1 invariants 5, 6, 7, 8, leased slots/tokens/permits back to zero when idle, host
  memory never dropped while a stale DMA is pending, the lifecycle not wedged, executor
  threads alive; at every time jump: no handle unresolved past its bound (queued: its
  deadline; submitted: its execution deadline; + ``slack``); when nothing can happen any more:
  deadlock (a thread blocked for good that is not an idle executor loop, or queued work no
  thread will take); a thread that raised.

Not controlled (they never block across a scheduling point): the KV coordinator's
``_kv_call_mu`` and the fault controller's ``_mu`` (leaf ``threading.Lock``s held only around
runtime/pure calls), logging's locks. A controlled thread that blocks in anything else is
reported by a real-time watchdog with its stack.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import queue
import random
import re
import sys
import tempfile
import threading
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from calexec import cliargs
from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.machines.clock import Clock
from calexec.machines.job import JobHandle, job_of

if TYPE_CHECKING:
    from calexec.drivers.calrt.runtime import CalRT, Emulator, KvManager
    from calexec.machines.device_api import RuntimeApi
    from calexec.machines.executor import DeviceExecutor

#: the environment variable giving the real-time watchdog's seconds without any scheduling
#: point (default 60), read at each run: a finite number > 0
WATCHDOG_ENV = "CALEXEC_EXPLORE_WATCHDOG_S"
#: a test sets this instead of the environment (None: the environment's, or 60)
WATCHDOG_S: float | None = None
#: how a watchdog failure says to give a wait meant to be that long more time
WATCHDOG_RAISE = (f"if the call is meant to take that long, raise the bound: "
                  f"explore_threads(..., watchdog_s=120) (replay_threads too) or "
                  f"{WATCHDOG_ENV}=120")


def watchdog_s(given: float | None = None) -> float:
    """The watchdog's seconds: ``given`` (a caller's ``watchdog_s=``) when not None, else
    ``WATCHDOG_S`` when set, else ``$CALEXEC_EXPLORE_WATCHDOG_S``
    (unset or empty: 60). A value that is no finite number of seconds > 0 is a ``ValueError``
    naming the variable (or ``watchdog_s``) and its value, before a schedule runs: read at
    import, ``5s`` failed
    every import of the explorer with ``could not convert string to float: '5s'``, ``0`` or
    ``-1`` failed every schedule blaming its first thread ("did not reach a scheduling point
    within 0.0s real time ... an uncontrolled blocking call?") and ``inf`` raised an
    ``OverflowError`` from the scheduler."""
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, (int, float)):
            raise TypeError(f"watchdog_s={given!r}: the real seconds a schedule may go "
                            f"without any scheduling point, a number > 0 (or None: "
                            f"${WATCHDOG_ENV}, else 60)")
        if not (math.isfinite(given) and given > 0) or given > threading.TIMEOUT_MAX:
            raise ValueError(f"watchdog_s={given!r}: the real seconds a schedule may go "
                             f"without any scheduling point, finite and > 0 (e.g. 120)")
        return float(given)
    if WATCHDOG_S is not None:
        return WATCHDOG_S
    text = os.environ.get(WATCHDOG_ENV, "").strip()
    if not text:
        return 60.0
    given_text = cliargs.ascii_number(text)  # (float() also reads "1_0" and "٣")
    value = math.nan if given_text is None else given_text
    if not (math.isfinite(value) and value > 0) or value > threading.TIMEOUT_MAX:
        raise ValueError(f"{WATCHDOG_ENV}={text!r}: the explorer's real-time watchdog, the "
                         f"seconds a schedule may go without any scheduling point before it "
                         f"fails: give a finite number of seconds > 0 (e.g. 120), or unset it "
                         f"for 60")
    return value
#: the environment variable naming the directory a failure's replay file is written in (made
#: when missing); unset or empty: the temporary directory ($TMPDIR, else /tmp)
REPLAY_DIR_ENV = "CALEXEC_EXPLORE_REPLAY_DIR"


def replay_dir() -> str:
    """The directory a failure's replay file is written in: ``$CALEXEC_EXPLORE_REPLAY_DIR``,
    else the temporary directory. Read at each failure (a test suite points it at its own
    temporary directory: the failures its tests expect left a file in /tmp each)."""
    return os.environ.get(REPLAY_DIR_ENV) or tempfile.gettempdir()
_PENDING = (int(DeviceJobStatus.PENDING), int(DeviceJobStatus.RUNNING))


class _Abort(BaseException):
    """Raised in a parked thread when the exploration is torn down (never caught by the
    executor's barriers, which catch Exception)."""


class ExplorationFailure(AssertionError):
    """A schedule broke a rule; ``replay_info`` holds what replays it."""

    def __init__(self, message: str, replay_info: dict) -> None:
        super().__init__(message)
        self.replay_info = replay_info


# ---- choosers ----------------------------------------------------------------------------------
class TapeChooser:
    """Choice i (at the i-th point with more than one option) is ``tape[i] % n``; 0 once the
    tape ends. Option 0 is always the default: the running thread goes on, or, when no thread
    can run, the device steps. A shrunk tape is a schedule with fewer preemptions."""

    def __init__(self, tape: Sequence[int] = ()) -> None:
        self.tape = list(tape)
        self.i = 0

    def extend(self, tape: Sequence[int]) -> None:
        self.tape = self.tape[:self.i] + list(tape)

    def choose(self, options: list, sched: Scheduler) -> int:
        value = self.tape[self.i] if self.i < len(self.tape) else 0
        self.i += 1
        return value % len(options)


class PriorityTapeChooser(TapeChooser):
    """The tape as PCT change points (for hypothesis): threads have priorities, the newest
    thread first; option 0 is the highest-priority runnable thread (device steps come after
    every thread, a time jump last). A tape value v > 0 picks the v-th option in priority
    order instead and drops the thread it preempted below all others, so one value starves
    a thread for as long as others can run (a PCT priority change point). A shrunk tape is a
    schedule with fewer change points."""

    def __init__(self, tape: Sequence[int] = ()) -> None:
        super().__init__(tape)
        self.prio: dict[str, float] = {}
        self.top = 0.0
        self.low = 0.0

    def _key(self, option) -> tuple:
        if isinstance(option, CThread):
            if option.label not in self.prio:
                self.top += 1.0
                self.prio[option.label] = self.top
            return (0, -self.prio[option.label])
        return (1 if option != "jump" else 2, option)

    def choose(self, options: list, sched: Scheduler) -> int:
        order = sorted(range(len(options)), key=lambda i: self._key(options[i]))
        value = self.tape[self.i] if self.i < len(self.tape) else 0
        self.i += 1
        pick = order[value % len(options)]
        first = options[order[0]]
        if pick != order[0] and isinstance(first, CThread):
            self.low += 1e-3  # as PCT: below the undemoted, above earlier victims
            self.prio[first.label] = self.low - 1e6
        return pick


class ReplayChooser(TapeChooser):
    """Replays recorded choice indices exactly (0 after the end). A choice past the options
    of its point raises in the thread at that point; ``diverged`` keeps the first such
    message (None while the replay fits), for a caller to tell it from the code's failure."""

    diverged: str | None = None

    def choose(self, options: list, sched: Scheduler) -> int:
        value = self.tape[self.i] if self.i < len(self.tape) else 0
        self.i += 1
        if value >= len(options):
            where = f"choice {self.i - 1} picks index {value} of {len(options)} options"
            if self.diverged is None:
                self.diverged = where
            raise RuntimeError(f"replay diverged: {where} {options}")
        return value


class PCTChooser:
    """Probabilistic concurrency testing (Burckhardt et al., ASPLOS 2010; Shuttle's and
    Coyote's PCT): each thread (and each device engine) gets a random priority when first
    seen; the highest-priority runnable one runs; at ``depth - 1`` random change points the
    running one drops below all undemoted ones, change point ``k_j`` to priority ``j``, the
    points drawn in random order (Burckhardt et al.: which victim ends lowest is random, not
    the first in time; until stop 59 it was, so a second victim always ran on and no seed
    scheduled ``a1 b1 a2``, two preemptions between two threads). When no thread can run but
    the device could, time is let pass instead with probability ``p_jump`` (a slow
    device)."""

    def __init__(self, seed: int, depth: int = 3, steps: int = 400, p_jump: float = 0.08) -> None:
        self.rng = random.Random(seed)
        self.depth = depth
        # change point (choice index) -> its priority rank j (1: the lowest), in draw order
        self.change = {point: rank for rank, point in enumerate(
            self.rng.sample(range(1, max(steps, depth + 1)), max(0, depth - 1)), start=1)}
        self.prio: dict[str, float] = {}
        self.p_jump = p_jump
        self.i = 0
        self.offset = 0  # change points count from here; the Explorer moves it past start
        self.params = [seed, depth, steps, p_jump]

    def begin(self) -> None:
        """The scenario starts: change points are placed over the choices from here."""
        self.offset = self.i

    def choose(self, options: list, sched: Scheduler) -> int:
        self.i += 1
        rank = self.change.get(self.i - self.offset)
        if rank is not None and sched.running is not None:
            # change point k_j gives priority j/1000: below every undemoted thread (> 1)
            self.prio[sched.running.label] = rank * 1e-3
        if options[-1] == "jump" and self.rng.random() < self.p_jump:
            return len(options) - 1
        best, best_p = 0, None
        for index, option in enumerate(options):
            label = option if isinstance(option, str) else option.label
            if label == "jump":
                continue
            if label not in self.prio:
                self.prio[label] = self.rng.random() + 1.0
            if best_p is None or self.prio[label] > best_p:
                best, best_p = index, self.prio[label]
        return best


# ---- controlled threads and primitives ---------------------------------------------------------
class CThread(threading.Thread):
    """A real thread that runs only when the scheduler hands it the baton."""

    def __init__(self, sched: Scheduler, target: Callable, name: str, args: tuple = ()) -> None:
        super().__init__(name=name, daemon=True)
        self.sched = sched
        self._fn, self._fn_args = target, args
        self.sem = threading.Semaphore(0)
        self.label = f"{name}#{len(sched.threads)}"
        self.pred: Callable[[], bool] | None = None
        self.deadline: float | None = None
        self.what = "start"
        self.finished = False
        self.error: BaseException | None = None

    def enabled(self, now: float) -> bool:
        if self.finished:
            return False
        if self.pred is None:
            return True
        return self.pred() or (self.deadline is not None and now >= self.deadline)

    def run(self) -> None:
        self.sem.acquire()
        sched = self.sched
        try:
            if not sched.aborting:
                self._fn(*self._fn_args)
        except _Abort:
            pass
        except BaseException as exc:  # noqa: BLE001 - reported as a failure of the schedule
            self.error = exc
            sched.fail(f"thread {self.name} raised {type(exc).__name__}: {exc}\n"
                       + "".join(traceback.format_exception(exc))[-3000:])
        finally:
            self.finished = True
            self.pred = None
            sched.exit_thread(self)

    # threading.Thread API seen by the executor
    def join(self, timeout: float | None = None) -> None:
        sched = self.sched
        if sched.me() is None:
            sched.foreign("a thread's join")
            if not self.finished:
                # (no thread runs until the scenario returns: a join without a timeout hung
                # for ever, before the watchdog, one with a timeout waited it out in real time)
                sched.cannot_wait(f"joined thread {self.name}")
            return super().join(timeout)
        _as_threading(timeout, nan_ok=False)
        sched.point("join")
        deadline = None if timeout is None else sched.now + timeout
        sched.block(lambda: self.finished, deadline, f"join {self.name}")

    def is_alive(self) -> bool:
        return not self.finished


def _as_threading(timeout: float | None, *, nan_ok: bool = True) -> None:
    """Raise what ``threading`` (and ``time.sleep``) raise for a timeout no real thread can
    wait: beyond ``threading.TIMEOUT_MAX`` (an infinity) ``OverflowError``; NaN, where the
    real call refuses it (a lock's ``acquire``, a ``join``), ``ValueError``. Virtual time would
    take them, and the explorer would pass code the real clock fails at its first wait."""
    if timeout is None:
        return
    if not nan_ok and timeout != timeout:
        raise ValueError("Invalid value NaN (not a number)")
    if timeout > threading.TIMEOUT_MAX:
        raise OverflowError("timestamp out of range for platform time_t")


def _lock_timeout(blocking: bool, timeout: float | None) -> None:
    """Refuse the ``acquire(blocking, timeout)`` arguments ``threading.Lock`` and ``RLock``
    refuse, with their exceptions (a timeout given to a non-blocking call, a negative one
    other than -1, a NaN)."""
    if timeout is not None and timeout != -1:
        if not blocking:
            raise ValueError("can't specify a timeout for a non-blocking call")
        if timeout < 0:
            raise ValueError("timeout value must be positive")
        _as_threading(timeout, nan_ok=False)


class CLock:
    """A non-reentrant lock; acquire is a scheduling point, blocking is virtual."""

    __slots__ = ("sched", "owner")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        #: the holding thread, ``Scheduler.OUTSIDE`` (held outside the controlled world), or None
        self.owner: object = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        sched = self.sched
        me = sched.me()
        if me is None:  # outside the controlled world (setup, a check, teardown): never blocks
            sched.foreign("a lock")
            if self.owner is None:
                self.owner = sched.OUTSIDE
                return True
            if sched.aborting:
                raise _Abort()
            if not blocking:
                return False
            holder = (f"thread {self.owner.name}" if isinstance(self.owner, CThread)
                      else "code outside the controlled threads")
            raise RuntimeError(
                f"a controlled lock held by {holder} was waited for outside the controlled "
                f"threads (by a check, invariant or final check, or a thread not started by "
                f"clock.start_thread): with the controlled threads stopped it would wait for "
                f"ever; a check can take it with acquire(blocking=False) and skip when held")
        _lock_timeout(blocking, timeout)
        sched.point("acquire")
        if self.owner is None:
            self.owner = me
            return True
        if self.owner is me and blocking and (timeout is None or timeout < 0):
            # (it would wait for ever; a try or a timed acquire answers False, as threading's)
            sched.fail(f"thread {me.name} re-acquired a non-reentrant lock it holds")
            raise _Abort()
        if not blocking:
            return False
        deadline = None if timeout is None or timeout < 0 else sched.now + timeout
        if sched.block(lambda: self.owner is None, deadline, "lock"):
            self.owner = me
            return True
        return False

    def release(self) -> None:
        if self.owner is None:
            if self.sched.aborting:  # a wait unwound by the teardown did not re-acquire
                return
            raise RuntimeError("release of an unlocked lock")
        self.owner = None

    def locked(self) -> bool:
        return self.owner is not None

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class CCondition:
    """A condition over a (ranked) controlled lock; notify marks waiters, wait is virtual."""

    def __init__(self, sched: Scheduler, lock) -> None:
        self.sched = sched
        self._lock = lock
        self._waiters: list[list[bool]] = []

    def acquire(self, *args) -> bool:
        return self._lock.acquire(*args)

    def release(self) -> None:
        self._lock.release()

    def __enter__(self):
        self._lock.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self._lock.release()

    def wait(self, timeout: float | None = None) -> bool:
        sched = self.sched
        outside = sched.me() is None
        if outside:
            sched.foreign("a condition")
        self._owned("wait")
        if outside:
            sched.cannot_wait("waited on a condition")
        token = [False]
        _as_threading(timeout)
        self._waiters.append(token)
        reentrant = isinstance(self._lock, CRLock)  # (every level released, as threading's)
        saved = self._lock.release_save() if reentrant else 0
        if not reentrant:
            self._lock.release()
        try:
            deadline = None if timeout is None else sched.now + max(0.0, timeout)
            got = sched.block(lambda: token[0], deadline, "cond")
        finally:
            if not token[0] and token in self._waiters:
                self._waiters.remove(token)
            if reentrant:
                self._lock.acquire_restore(saved)
            else:
                self._lock.acquire()
        return got

    def wait_for(self, predicate: Callable[[], Any], timeout: float | None = None) -> Any:
        """``threading.Condition.wait_for``: wait until ``predicate()`` is true or ``timeout``
        (virtual seconds) has passed; the predicate's last value."""
        end = None if timeout is None else self.sched.now + timeout
        result = predicate()
        while not result:
            remaining = None if end is None else end - self.sched.now
            if remaining is not None and remaining <= 0:
                break
            self.wait(remaining)
            result = predicate()
        return result

    def _owned(self, what: str) -> None:
        """Raise what ``threading.Condition`` raises when its lock is not held (its
        ``_is_owned`` on a ``Lock``: the lock is free): the explorer would pass code whose
        ``notify`` outside ``with cond:`` fails on the real clock at its first call."""
        held = (self._lock.is_owned() if isinstance(self._lock, CRLock)
                else self._lock.locked())
        if not held:
            raise RuntimeError(f"cannot {what} on un-acquired lock")

    def notify(self, n: int = 1) -> None:
        self._owned("notify")
        for token in self._waiters[:n]:
            token[0] = True
        del self._waiters[:n]

    def notify_all(self) -> None:
        self._owned("notify")
        self.notify(len(self._waiters))


class CEvent:
    __slots__ = ("sched", "flag")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.flag = False

    def is_set(self) -> bool:
        return self.flag

    def set(self) -> None:
        if self.sched.me() is not None:
            self.sched.point("event.set")
        else:
            self.sched.foreign("an event")
        self.flag = True

    def clear(self) -> None:
        self.flag = False

    def wait(self, timeout: float | None = None) -> bool:
        sched = self.sched
        if sched.me() is None:
            sched.foreign("an event")
            if not self.flag and (timeout is None or timeout > 0):
                sched.cannot_wait("waited for an event no thread has set yet")
            return self.flag
        _as_threading(timeout)
        sched.point("event.wait")
        if self.flag:
            return True
        deadline = None if timeout is None else sched.now + max(0.0, timeout)
        return sched.block(lambda: self.flag, deadline, "event")


class CRLock:
    """A reentrant lock (``threading.RLock``): its holder may take it again, and must release
    it as often; acquire is a scheduling point, blocking is virtual. A ``CCondition`` over it
    releases every level while it waits and takes them all back, as ``threading``'s."""

    __slots__ = ("sched", "owner", "count")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        #: the holding thread, ``Scheduler.OUTSIDE`` (held outside the controlled world), or None
        self.owner: object = None
        self.count = 0

    def _me(self) -> object:
        return self.sched.me() or self.sched.OUTSIDE

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        sched = self.sched
        me = sched.me()
        if me is None:  # outside the controlled world: never blocks (as CLock)
            sched.foreign("a reentrant lock")
            if self.owner is None or self.owner is sched.OUTSIDE:
                self.owner = sched.OUTSIDE
                self.count += 1
                return True
            if sched.aborting:
                raise _Abort()
            if not blocking:
                return False
            raise RuntimeError(
                f"a controlled reentrant lock held by thread {getattr(self.owner, 'name', '?')} "
                f"was waited for outside the controlled threads (by a check, invariant or final "
                f"check, or a thread not started by clock.start_thread): with the controlled "
                f"threads stopped it would wait for ever; a check can take it with "
                f"acquire(blocking=False) and skip when held")
        _lock_timeout(blocking, timeout)
        if self.owner is me:  # (its holder: never blocks, no other thread can interleave)
            self.count += 1
            return True
        sched.point("rlock.acquire")
        if self.owner is None:
            self.owner, self.count = me, 1
            return True
        if not blocking:
            return False
        deadline = None if timeout is None or timeout < 0 else sched.now + timeout
        if sched.block(lambda: self.owner is None, deadline, "rlock"):
            self.owner, self.count = me, 1
            return True
        return False

    def release(self) -> None:
        mine = self.owner is not None and self.owner is self._me()
        if not mine and self.sched.aborting:  # (a wait unwound by the teardown)
            return
        if not mine:
            raise RuntimeError("cannot release un-acquired lock")
        self.count -= 1
        if self.count == 0:
            self.owner = None

    def is_owned(self) -> bool:
        """Whether the calling thread holds it (``threading.Condition`` asks an RLock so)."""
        return self.owner is not None and self.owner is self._me()

    def release_save(self) -> int:
        """Release every level (a condition's wait); what ``acquire_restore`` takes back."""
        count, self.owner, self.count = self.count, None, 0
        return count

    def acquire_restore(self, count: int) -> None:
        self.acquire()
        self.count = count

    __enter__ = acquire

    def __exit__(self, *exc) -> None:
        self.release()


class CSemaphore:
    """``threading.Semaphore`` (``bounded``: ``BoundedSemaphore``, whose release above the
    initial value is a ``ValueError``); acquire and release are scheduling points, blocking
    is virtual."""

    __slots__ = ("sched", "value", "initial", "bounded")

    def __init__(self, sched: Scheduler, value: int = 1, bounded: bool = False) -> None:
        if value < 0:
            raise ValueError("semaphore initial value must be >= 0")
        self.sched, self.value, self.initial, self.bounded = sched, value, value, bounded

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        if not blocking and timeout is not None:
            raise ValueError("can't specify timeout for non-blocking acquire")
        sched = self.sched
        if sched.me() is None:
            sched.foreign("a semaphore")
            if self.value > 0:
                self.value -= 1
                return True
            if not blocking or (timeout is not None and timeout <= 0) or sched.aborting:
                return False
            sched.cannot_wait("acquired a semaphore no thread has released yet")
            raise RuntimeError("a controlled semaphore at 0 was acquired outside the "
                               "controlled threads: nothing would release it")
        _as_threading(timeout)
        sched.point("semaphore.acquire")
        if self.value <= 0:
            if not blocking:
                return False
            deadline = None if timeout is None else sched.now + max(0.0, timeout)
            if not sched.block(lambda: self.value > 0, deadline, "semaphore"):
                return False
        self.value -= 1
        return True

    def release(self, n: int = 1) -> None:
        if n < 1:
            raise ValueError("n must be one or more")
        if self.sched.me() is not None:
            self.sched.point("semaphore.release")
        else:
            self.sched.foreign("a semaphore")
        if self.bounded and self.value + n > self.initial:
            raise ValueError("Semaphore released too many times")
        self.value += n

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class CQueue:
    """``queue.Queue`` (FIFO, ``maxsize`` <= 0: unbounded): ``put``, ``get`` (and their
    ``_nowait``), ``qsize``, ``empty``, ``full``, ``task_done``, ``join``, raising
    ``queue.Full``/``queue.Empty`` as it does; every put, get and join is a scheduling
    point, a wait is virtual (a timeout costs no real time)."""

    def __init__(self, sched: Scheduler, maxsize: int = 0) -> None:
        self.sched, self.maxsize = sched, maxsize
        self.items: deque[Any] = deque()
        self.unfinished = 0

    def qsize(self) -> int:
        return len(self.items)

    def empty(self) -> bool:
        return not self.items

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self.items)

    def _wait(self, ready: Callable[[], bool], block: bool, timeout: float | None,
              point: str, what: str) -> bool:
        """Whether ``ready()`` holds, waiting for it (virtually) when ``block``; ``point`` names
        the scheduling point, ``what`` the wait a thread outside the controlled ones made."""
        sched = self.sched
        if block and timeout is not None and timeout < 0:
            raise ValueError("'timeout' must be a non-negative number")
        if sched.me() is None:
            sched.foreign("a queue")
            if ready() or not block or sched.aborting:
                return ready()
            sched.cannot_wait(f"{what} (a controlled queue)")
            raise RuntimeError(f"{what} outside the controlled threads: nothing would end "
                               f"the wait")
        _as_threading(timeout)
        sched.point(point)
        if ready() or not block:
            return ready()
        deadline = None if timeout is None else sched.now + timeout
        return sched.block(ready, deadline, point)

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if not self._wait(lambda: not self.full(), block, timeout, "queue.put",
                          "put to a full queue"):
            raise queue.Full
        self.items.append(item)
        self.unfinished += 1

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        if not self._wait(lambda: bool(self.items), block, timeout, "queue.get",
                          "got from an empty queue"):
            raise queue.Empty
        return self.items.popleft()

    def put_nowait(self, item: Any) -> None:
        self.put(item, block=False)

    def get_nowait(self) -> Any:
        return self.get(block=False)

    def task_done(self) -> None:
        if self.unfinished <= 0:
            raise ValueError("task_done() called too many times")
        self.unfinished -= 1

    def join(self) -> None:
        self._wait(lambda: self.unfinished == 0, True, None, "queue.join",
                   "joined a queue with unfinished tasks")


class VirtualClock(Clock):
    """The executor's clock under the explorer: controlled primitives, virtual time."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched

    #: a clock read is a scheduling point only if asked: time moves only when every thread
    #: is blocked, so no other thread can change what a read returns before the reader's next
    #: point; preempting at the read adds schedules without adding behaviours
    clock_points = False
    #: virtual time: no native wait can stand in for this clock's (``RuntimeProxy``
    #: gives the executor a ``ClockRelay`` instead of the C relay)
    real = False

    def monotonic(self) -> float:
        if self.clock_points and self.sched.me() is not None:
            self.sched.point("clock")
        return self.sched.now

    def now_us(self) -> int:
        return int(self.sched.now * 1e6)

    def sleep(self, seconds: float) -> None:
        sched = self.sched
        if sched.me() is None:
            sched.foreign("a sleep")
            return
        _as_threading(seconds)  # what ``SYSTEM.sleep`` (``time.sleep``) raises for it
        sched.point("sleep")
        if seconds > 0:
            sched.block(lambda: False, sched.now + seconds, "sleep")

    def wait(self, cond, timeout):
        return cond.wait(timeout)

    def wait_event(self, event, timeout):
        return event.wait(timeout)

    def lock(self):
        return CLock(self.sched)

    def condition(self, lock, name: str = ""):
        return CCondition(self.sched, lock)

    def event(self):
        return CEvent(self.sched)

    def rlock(self):
        return CRLock(self.sched)

    def semaphore(self, value: int = 1):
        return CSemaphore(self.sched, value)

    def bounded_semaphore(self, value: int = 1):
        return CSemaphore(self.sched, value, bounded=True)

    def queue(self, maxsize: int = 0):
        return CQueue(self.sched, maxsize)

    def start_thread(self, target, name, args=()):
        return self.sched.spawn(target, name, args)


# ---- the scheduler ---------------------------------------------------------------------------------
class Scheduler:
    """Hands one baton between controlled threads; the driver (the test's thread) starts a
    run and gets the baton back when nothing can happen any more, the step budget is spent or
    the virtual horizon is reached."""

    OUTSIDE = object()

    def __init__(self, chooser, now: float = 1000.0) -> None:
        self.chooser = chooser
        self.now = now
        self.threads: list[CThread] = []
        self.running: CThread | None = None
        self.steps = 0
        self.choices: list[int] = []
        self.trace: list[str] = []  # the last choices, for the failure report
        self.failure: str | None = None
        self.aborting = False
        self.driver_sem = threading.Semaphore(0)
        self.budget = 0
        self.horizon = now
        self.stop_reason = ""
        self.device: DeviceModel | None = None
        self.on_point: Callable[[], None] | None = None  # cheap checks, every point
        self.on_blocked: Callable[[], None] | None = None  # checks when no thread can run
        self.on_jump: Callable[[], None] | None = None
        self.on_step: Callable[[], None] | None = None  # before each device step
        #: time may pass while the device could still progress (execution timeouts)
        self.slow_device = True
        #: a time jump never passes the run's horizon (several schedulers kept at the same
        #: virtual time, drivers/tools/differential.py); default: jump to the next deadline
        self.clamp_to_horizon = False
        #: a canonical order of the threads that can run when no running thread goes on
        #: (the running one blocked, finished or jumped time): sorted by this key, stable in
        #: creation order. None (default): creation order, the thread that jumped first.
        #: Several schedulers compared with each other (drivers/tools/differential.py) set
        #: it, so that threads woken at one instant (a job's deadline and its caller's wait
        #: on that same deadline) run in the same order on every one of them
        self.rank: Callable[[CThread], int] | None = None
        self._jumped = False
        #: a check (``on_point``, ``on_blocked``, ``on_jump``) is running: it runs in whichever
        #: controlled thread holds the baton, but as the driver would, outside the controlled
        #: world (a lock it takes is no scheduling point: one was a recursion into the check)
        self.checking = False
        #: the thread that builds the scenario and runs the final check (``interleave`` sets
        #: it): another thread that is not a controlled one using a controlled object fails
        #: the schedule (``foreign``). None (the executor's explorer): not checked
        self.driver: threading.Thread | None = None
        #: the real seconds a run may go without any scheduling point (None: ``watchdog_s()``,
        #: the environment's); ``interleave`` sets a caller's ``watchdog_s=``
        self.watchdog: float | None = None

    # -- from controlled threads --
    def me(self) -> CThread | None:
        if self.checking:
            return None
        thread = threading.current_thread()
        return thread if isinstance(thread, CThread) and thread.sched is self else None

    def foreign(self, what: str) -> None:
        """Called where a controlled object is used outside the controlled threads: from a
        thread that is neither one of them nor the ``driver`` (nor a check, nor the
        teardown), fail the schedule and raise, naming the thread. Its steps are not
        scheduled: the exploration would miss its races and could not replay them."""
        thread = threading.current_thread()
        if self.driver is None or thread is self.driver or self.checking or self.aborting:
            return
        message = (f"thread {thread.name} used {what} made by the explorer's clock but is not "
                   f"one of its threads (not started by clock.start_thread): its steps are not "
                   f"scheduled, so the exploration would miss its races and could not replay "
                   f"them; start it with clock.start_thread(target, name)")
        self.fail(message)
        raise RuntimeError(message)

    def cannot_wait(self, what: str) -> None:
        """Refuse a wait that only a controlled thread can make (one that would block) by the
        ``driver``: the scenario, before any thread ran, or a check, with every thread
        stopped; it would wait for ever (or its timeout, in real time) for threads that run
        only once it returns. Nothing for the executor's explorer (no ``driver``)."""
        if self.driver is None or self.aborting:
            return
        if self.checking:
            raise RuntimeError(
                f"an invariant {what}: it runs with every thread stopped, so the wait would "
                f"never end; read the state without waiting")
        if threading.current_thread() is not self.driver:
            return
        if self.budget:  # (the run is over: the final check)
            raise RuntimeError(
                f"the final check {what}: it runs once no thread can go on, so the wait "
                f"would never end; read the state without waiting")
        raise RuntimeError(
            f"the scenario {what}: no thread runs until the scenario has returned (it builds "
            f"the code under test and returns its final check, which runs when every thread "
            f"is done); leave the threads to the explorer, or wait in a thread started with "
            f"clock.start_thread")

    def _check(self, check: Callable[[], None] | None) -> None:
        """Run one of the checks (``on_point`` ...) outside the controlled world."""
        if check is None:
            return
        self.checking = True
        try:
            check()
        finally:
            self.checking = False

    def spawn(self, target: Callable, name: str, args: tuple = ()) -> CThread:
        if self.me() is None:
            self.foreign("start_thread")
        thread = CThread(self, target, name, args)
        self.threads.append(thread)
        thread.start()  # parked on its semaphore until chosen
        if self.me() is not None:
            self.point("spawn")
        return thread

    def fail(self, message: str) -> None:
        if self.failure is None:
            self.failure = message

    def point(self, what: str) -> None:
        """A preemption point: the running thread may be replaced."""
        me = self.me()
        if me is None:
            return
        if self.aborting:
            raise _Abort()
        me.what = what
        me.pred = None
        self._switch(me)

    def block(self, pred: Callable[[], bool], deadline: float | None, what: str) -> bool:
        """Block the running thread until ``pred()`` or the virtual ``deadline``."""
        me = self.me()
        if me is None:
            raise RuntimeError(f"block({what!r}) outside a controlled thread")
        if self.aborting:
            raise _Abort()
        if pred():
            return True
        if deadline is not None and self.now >= deadline:
            return False
        me.pred, me.deadline, me.what = pred, deadline, what
        try:
            self._switch(me)
        finally:
            me.pred, me.deadline = None, None
        return pred()

    def exit_thread(self, me: CThread) -> None:
        if self.aborting:
            return
        nxt = self._decide(me)
        self._transfer(None, nxt)

    def _switch(self, me: CThread) -> None:
        nxt = self._decide(me)
        if nxt is me:
            return
        self._transfer(me, nxt)
        me.sem.acquire()
        if self.aborting:
            raise _Abort()

    def _transfer(self, me, nxt) -> None:
        # after the release below this thread touches no shared state
        if nxt is None:
            self.running = None
            self.driver_sem.release()
        else:
            self.running = nxt
            nxt.sem.release()

    # -- decisions --
    def _decide(self, me: CThread | None) -> CThread | None:
        """The next thread to run (None: back to the driver). Device steps and time jumps
        chosen here are performed here, by whichever thread holds the baton."""
        while True:
            if self.failure is not None:
                self.stop_reason = "failure"
                return None
            try:
                self._check(self.on_point)
            except AssertionError as exc:
                self.fail(str(exc))
                continue
            now = self.now
            live = [t for t in self.threads if not t.finished]
            runnable = [t for t in live if t.enabled(now)]
            if self.rank is not None:
                runnable.sort(key=self.rank)
            if me is not None and me in runnable and not (self._jumped and self.rank):
                runnable.remove(me)  # option 0: no preemption
                runnable.insert(0, me)
            device = self.device.options() if self.device is not None else []
            deadlines = [t.deadline for t in live if t.pred is not None and t.deadline is not None]
            ready = self.device.next_ready() if self.device is not None else None
            if ready is not None:  # a timed device: its next job ends then
                deadlines.append(ready)
            if not runnable:
                try:
                    self._check(self.on_blocked)
                except AssertionError as exc:
                    self.fail(str(exc))
                    continue
            options: list = runnable + device
            if not runnable and deadlines and now < self.horizon and (
                    self.slow_device or not device):
                options.append("jump")
            if not options:
                self.stop_reason = "horizon" if deadlines else "quiescent"
                return None
            if self.steps >= self.budget:
                self.stop_reason = "budget"
                return None
            index = 0
            if len(options) > 1:
                index = self.chooser.choose(options, self)
                self.choices.append(index)
            self.steps += 1
            chosen = options[index]
            label = chosen if isinstance(chosen, str) else chosen.label
            if len(self.trace) > 400:
                del self.trace[:200]
            if isinstance(chosen, CThread):
                self._jumped = False
                if chosen is not me or len(options) > 1:
                    self.trace.append(f"{label}:{chosen.what}")
                return chosen
            self.trace.append(label)
            if chosen == "jump":
                target = min(deadlines)
                if self.clamp_to_horizon:
                    target = min(target, self.horizon)
                self.now = max(now, target)
                self._jumped = True
                try:
                    self._check(self.on_jump)
                except AssertionError as exc:
                    self.fail(str(exc))
            elif self.device is not None:  # (a device step is an option only with one)
                self.device.step(chosen)

    # -- from the driver --
    def run(self, steps: int = 1_000_000, horizon_s: float = 60.0) -> str:
        """Let the controlled threads run; returns why the run stopped: quiescent (nothing
        can happen), budget, horizon or failure."""
        if self.aborting:
            return "failure"
        watchdog = watchdog_s(self.watchdog)  # (refused before any thread runs)
        self.budget = self.steps + steps
        self.horizon = self.now + horizon_s
        nxt = self._decide(None)
        if nxt is not None:
            self.running = nxt
            nxt.sem.release()
            # the watchdog times each stretch without a scheduling point, not the whole run:
            # a long schedule (millions of steps) that keeps reaching points is no hang
            seen = self.steps
            while not self.driver_sem.acquire(timeout=watchdog):
                if self.steps == seen:
                    self.fail(self._watchdog_report(watchdog))
                    self.stop_reason = "failure"
                    break
                seen = self.steps
        return self.stop_reason

    def _watchdog_report(self, watchdog: float) -> str:
        running = self.running
        frames = sys._current_frames()
        stack = ""
        if running is not None and running.ident in frames:
            stack = "".join(traceback.format_stack(frames[running.ident])[-12:])
        blocked = ""
        if running is not None and running.ident in frames:
            # (threading's and queue's own objects wait in those modules: name the call)
            # the innermost frames in those modules, the outermost of them: the user's call
            for frame, _ in traceback.walk_stack(frames[running.ident]):
                module = frame.f_globals.get("__name__")
                if module not in ("threading", "queue"):
                    break
                owner = frame.f_locals.get("self")
                kind = type(owner).__name__ + "." if owner is not None else ""
                blocked = f" (blocked in {module}.{kind}{frame.f_code.co_name})"
        return (f"watchdog: thread {running and running.name} did not reach a scheduling point "
                f"within {watchdog}s real time{blocked} (an uncontrolled blocking call? "
                f"threading's and queue's own objects are not scheduled: make them with the "
                f"clock, clock.lock(), rlock(), condition(lock), event(), semaphore(n), "
                f"bounded_semaphore(n), queue(maxsize)); {WATCHDOG_RAISE}\n{stack}")

    def abort_threads(self) -> None:
        """Tear down: every parked thread raises _Abort and ends."""
        self.aborting = True
        for thread in self.threads:
            if not thread.finished:
                thread.sem.release()
        for thread in self.threads:
            threading.Thread.join(thread, 5.0)

    def describe(self) -> str:
        lines = []
        for t in self.threads:
            if t.finished:
                continue
            state = "runnable" if t.pred is None else (
                f"blocked in {t.what}" + ("" if t.deadline is None else
                                          f" until {t.deadline - 1000.0:.3f}"))
            lines.append(f"  {t.label}: {state}")
        return "\n".join(lines)


# ---- the device: stepped emulator behind controlled runtime objects ----------------------------
class DeviceModel:
    """Which device steps are possible now, and doing one (in the thread holding the baton)."""

    def __init__(self, sched: Scheduler, engines: int = 1) -> None:
        self.sched = sched
        self.emu: Emulator | None = None  # set when the explored executor opens its device
        self.engines = engines
        self.epoch = 0  # bumped by anything that may let a stuck engine progress
        self.stuck: dict[int, int] = {}
        self.armed: dict[int, int] = {}  # fault point -> NTH param (for the Wait fault)
        self.stale_armed = False
        self.closed = False

    #: the device proxy ``RuntimeProxy.open_device`` wraps the device in
    proxy_class: type[DeviceProxy] | None = None

    def controls(self) -> Emulator:
        """The emulator controls of the explored device, once the executor opened it."""
        if self.emu is None:
            raise RuntimeError("the explored device is not open yet")
        return self.emu

    def next_ready(self) -> float | None:
        """When a job of a timed device (differential.TimedDevice) ends; None: untimed."""
        return None

    def take_wait_fault(self, outbuf) -> bool:
        """A Wait fault scheduled for ``outbuf``'s job fires now (armed by the model): True.
        The untimed device has none (its faults are armed by call count)."""
        return False

    def options(self) -> list[str]:
        emu = self.emu
        if emu is None or self.closed:
            return []
        out = []
        for engine in range(self.engines):
            if self.stuck.get(engine) == self.epoch:
                continue
            rc, jobs, _stage = emu.pending(engine)
            if rc == 0 and jobs > 0:
                out.append(f"device{engine}")
        if not out and self.stale_armed and self.stuck.get(0) != self.epoch:
            if emu.counters().get("stale_pending", 0) > 0:
                out.append("device0")
        return out

    def step(self, label: str) -> None:
        from calexec.drivers.calrt.runtime import Did, Stage
        engine = int(label[len("device"):])
        if self.sched.on_step is not None:
            self.sched.on_step()
        if self.emu is None:  # (device steps are options only once the device is open)
            return
        rc, did = self.emu.step(engine, int(Stage.NONE))
        if rc != 0 or did in (Did.NOTHING, Did.HUNG, Did.BLOCKED):
            self.stuck[engine] = self.epoch
        else:
            self.epoch += 1

    def wait_fault_fires_next(self) -> bool:
        from calexec.drivers.calrt.runtime import Fault
        nth = self.armed.get(int(Fault.WAIT_RC))
        if nth is None or self.emu is None:
            return False
        rc, calls, fired = self.emu.fault_stats(Fault.WAIT_RC)
        return rc == 0 and fired == 0 and calls + 1 == nth


class _Proxy:
    __slots__ = ("_inner", "_model")

    def __init__(self, inner, model: DeviceModel) -> None:
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "_model", model)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


def _wrap(value, model: DeviceModel):
    from calexec.drivers.calrt import runtime as rt
    if isinstance(value, tuple):
        return tuple(_wrap(v, model) for v in value)
    if isinstance(value, list):
        return [_wrap(v, model) for v in value]
    for kind, proxy in ((rt.Calbin, CalbinProxy), (rt.Model, ModelProxy),
                        (rt.OutputBuf, OutputBufProxy)):
        if isinstance(value, kind):
            return proxy(value, model)
    return value


class ClockRelay:
    """The submitter's relay (machines/device_api.py ``SubmitRelay``) on an injected clock:
    the C relay's submitter-only rules (drivers/native/calexec_relay.c; its reference model
    ``RelayModel(submitter_only=True)``, which ``tests/test_native_relay.py`` checks both
    against) in Python, with the clock's own lock and condition, so the explorer schedules
    its waits and the ``infer`` its waiter makes like any other. It is what an executor with
    ``native_relay`` gets under the explorer and in the differential test."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._cv = clock.condition(clock.lock(), "relay")
        self._fires: deque[tuple[int, Any, Any, Any, int, Any, Any]] = deque()
        self._wake = False
        self._closed = False

    def fire(self, tag: int, device: Any, model: Any, kv: Any, seq: int, inbuf: Any,
             outbuf: Any, /) -> bool:
        from calexec.drivers.native.relay import QUEUE
        with self._cv:
            if self._closed or len(self._fires) == QUEUE:
                return False
            self._fires.append((tag, device, model, kv, seq, inbuf, outbuf))
            self._cv.notify_all()
            return True

    def wake(self) -> None:
        with self._cv:
            if not self._closed:
                self._wake = True
                self._cv.notify_all()

    def wait(self, timeout_s: float, /) -> tuple[int, int, int]:
        from calexec.drivers.native.relay import Kind
        clock = self._clock
        end = clock.monotonic() + max(0.0, timeout_s)
        with self._cv:
            while not (self._closed or self._fires or self._wake):
                remaining = end - clock.monotonic()
                if remaining <= 0:
                    return int(Kind.TIMEOUT), 0, 0
                clock.wait(self._cv, remaining)
            if self._closed:
                return int(Kind.CLOSED), 0, 0
            if not self._fires:
                self._wake = False
                return int(Kind.WAKE), 0, 0
            tag, device, model, kv, seq, inbuf, outbuf = self._fires.popleft()
        # only this (the submitter's) thread infers, outside the lock, as the C relay does
        return int(Kind.INFERRED), tag, device.infer(model, kv, seq, inbuf, outbuf)

    def close(self) -> list[int]:
        with self._cv:
            dropped = [item[0] for item in self._fires]
            self._fires.clear()
            self._closed = True
            self._cv.notify_all()
        return dropped

    def free(self) -> None:
        pass


class RuntimeProxy(_Proxy):
    """``CalRT`` whose device is stepped and whose blocking calls are scheduling points."""

    def submit_relay(self, clock: Clock) -> ClockRelay:
        """The relay on the explorer's clock (never the C relay: it would call the runtime
        past the proxies, in real time)."""
        return ClockRelay(clock)

    def open_device(self, config: str = ""):
        rc, device = self._inner.open_device(config)
        if rc != 0:
            return rc, device
        model = self._model
        model.emu = device.emu
        if device.emu.set_stepped(True) != 0:
            raise RuntimeError("the emulator refused stepped mode")
        return rc, (model.proxy_class or DeviceProxy)(device, model)


class DeviceProxy(_Proxy):
    def _call(self, name, *args):
        model = self._model
        model.sched.point(f"runtime.{name}")
        result = getattr(self._inner, name)(*args)
        model.epoch += 1
        return result

    def infer(self, *args):
        return self._call("infer", *args)

    def infer_with_fixed_task_type(self, *args):
        return self._call("infer_with_fixed_task_type", *args)

    def reset(self):
        return self._call("reset")

    def reset_ccu(self):
        return self._call("reset_ccu")

    def reset_configuration(self):
        return self._call("reset_configuration")

    def load_calbin(self, path):
        return _wrap(self._inner.load_calbin(path), self._model)

    def close(self):
        self._model.closed = True
        return self._inner.close()


class CalbinProxy(_Proxy):
    def models(self):
        return _wrap(self._inner.models(), self._model)


class ModelProxy(_Proxy):
    def create_output_buf(self):
        return _wrap(self._inner.create_output_buf(), self._model)


class OutputBufProxy(_Proxy):
    """``Wait`` blocks virtually until the job's status changes (a device step) or the
    timeout passes on the virtual clock; then the real ``Wait(0)`` gives the runtime's code."""

    def _settled(self) -> bool:
        rc, status = self._inner.get_status()
        return rc != 0 or status not in _PENDING

    def wait(self, timeout_us: int) -> int:
        model = self._model
        sched = model.sched
        sched.point("runtime.Wait")
        if model.take_wait_fault(self):
            return self._inner.wait(0)
        if not self._settled() and not model.wait_fault_fires_next():
            sched.block(self._settled, sched.now + max(0, timeout_us) / 1e6, "runtime.Wait")
        return self._inner.wait(0)

    def get_status(self):
        self._model.sched.point("runtime.GetStatus")
        return self._inner.get_status()

    def destroy(self) -> int:
        """§5.1 invariant 4: never destroyed while the runtime may still write it."""
        rc, status = self._inner.get_status()
        if rc == 0 and status in _PENDING:
            self._model.sched.fail("an OutputBuf was destroyed while the runtime still runs "
                                   f"its job (GetStatus={status}): its generation was torn "
                                   "down under a job on the device")
        return self._inner.destroy()


# ---- the explorer: an executor, its scenario actions and its checks -------------------------------
VOCAB = 151936
FAULTS = ("SUBMIT_RC", "WAIT_RC", "CCU_EXCEPTION", "OUTPUT_NAN", "OUTPUT_SHORT", "UNKNOWN_CSR",
          "SLICE_FAIL", "HANG", "STALE_COMPLETION", "CAN_ALLOCATE_FALSE", "APPLY_FALSE")
SEQS = (1, 2, 3)


OTHER_SEED_XOR = 0x5A5A5A
GOLDEN_DECODE_STEPS = 1
_GOLDENS: dict[str, tuple[int, ...]] = {}  # calbin sha256 -> oracle golden tokens


def write_calbins(directory: str) -> dict[str, str]:
    """The two calbins a scenario switches between (the synthetic model, two seeds); their
    §9.2 goldens are pinned from the numpy oracle (an independent expectation). ``directory``
    is made if it does not exist (``write_calbins("/tmp/x")`` in a fresh shell)."""
    from calexec.drivers.synthetic import calbin as cb
    os.makedirs(directory, exist_ok=True)
    main = os.path.join(directory, "explore_main.calbin")
    other = os.path.join(directory, "explore_other.calbin")
    seed = cb.default_spec().seed
    for path, calbin_seed in ((main, seed), (other, seed ^ OTHER_SEED_XOR)):
        sha = cb.write(path, cb.default_spec(seed=calbin_seed))
        if sha not in _GOLDENS:
            _GOLDENS[sha] = _oracle_golden(calbin_seed)
    return {"main": main, "other": other}


def _oracle_golden(seed: int) -> tuple[int, ...]:
    from calexec.drivers.synthetic import oracle
    from calexec.machines.executor import ExecutorConfig
    ref = oracle.OracleSequence(seed)
    ref.run(list(ExecutorConfig(calbin_path="").golden_tokens))
    out = [ref.next_token()]
    for _ in range(GOLDEN_DECODE_STEPS):
        ref.run([out[-1]])
        out.append(ref.next_token())
    return tuple(out)


_CLOSED = 0  # explorers closed in this process


class Explorer:
    """One executor under the controlled scheduler. Drive it with the scenario methods
    (``start``, ``prefill``, ``decode``, ``stream``, ``bad_argument``, ``cancel``, ``arm``,
    ``request_recovery``, ``switch``, ``reset_sequence``, ``shutdown``, ``run``, ``finish``);
    every call is
    recorded in ``script`` so ``replay(script, choices)`` reproduces the schedule."""

    def __init__(self, calbins: dict[str, str], chooser=None, *, reset_kind: str = "reset",
                 capacity: int = 1, kv_blocks: int = 64, slack_s: float = 0.1,
                 seed: int | None = None) -> None:
        self.calbins = calbins
        self.chooser = chooser or TapeChooser()
        self.sched = Scheduler(self.chooser)
        self.device = DeviceModel(self.sched, engines=capacity)
        self.sched.device = self.device
        self.sched.on_point = self._check_point
        self.sched.on_blocked = self._check_blocked
        self.sched.on_jump = self._check_late
        self.sched.on_step = self._check_memory
        self.options: dict[str, Any] = {"reset_kind": reset_kind, "capacity": capacity,
                                        "kv_blocks": kv_blocks, "slack_s": slack_s}
        self.seed = seed
        self.slack = slack_s
        self.script: list[tuple] = []
        #: one (virtual time, switched) per ``switch`` action, in order: whether its admin
        #: call found the lifecycle Ready and switched, or found it busy and did nothing
        self.switch_log: list[tuple[float, bool]] = []
        self.handles: list = []
        #: job id -> its place in the order jobs were resolved (a done callback): the order
        #: of their KV commits (one thread completes jobs, committing before it resolves),
        #: which the virtual clock's completion times cannot give (a device of no time ends
        #: every job at the same instant)
        self.resolved_order: dict[int, int] = {}
        self.results: list = []
        self.rows: dict[int, np.ndarray] = {}  # job id -> the caller's logits row
        #: job id -> a copy of a decode stream step's logits, taken when its ``wait()``
        #: returned (valid until the stream's next step): checked against the oracle
        self.stream_logits: dict[int, np.ndarray] = {}
        #: one (seq, greedy, answers) per ``stream`` action: each step's code ("ok" or the
        #: Status code) in order, then the ``close()`` code
        self.streams: list[tuple[int, bool, list[str]]] = []
        self.pools: list = []
        self.gens: list = []
        self.discarded: set[int] = set()
        self._ex: DeviceExecutor | None = None  # made by start()
        self._closed = False
        # the charts' contracts (machines/charts.py: the one-chart §5.1 invariants), checked
        # by every run the executor makes and reported at the next scheduling point
        from calexec.machines.chart_contracts import enable_contracts
        from calexec.machines.charts import DECLARED
        self.contracts = enable_contracts(*DECLARED.values(), raise_on_violation=False)

    @property
    def ex(self) -> DeviceExecutor:
        """The executor under exploration (made by ``start``)."""
        if self._ex is None:
            raise RuntimeError("Explorer.start() first")
        return self._ex

    @property
    def started_ex(self) -> DeviceExecutor | None:
        """The executor under exploration, None before ``start`` made it."""
        return self._ex

    # ---- scenario ---------------------------------------------------------------------------
    def start(self) -> None:
        from calexec.contracts.manifest import default_manifest_path, load_manifest
        from calexec.drivers.calrt.runtime import CalRT
        from calexec.machines.executor import DeviceExecutor, ExecutorConfig
        from calexec.machines.faults import FaultController, RecoveryPolicy
        o = self.options
        policy = RecoveryPolicy(reset_kind=o["reset_kind"], drain_grace_s=0.2,
                                max_recoveries=50)
        settings: dict[str, Any] = dict(
            calbin_path=self.calbins["main"],
            device_config=f"kv_blocks={o['kv_blocks']};kv_block_size=16;dma_guard=0",
            inflight_capacity=o["capacity"], slots_per_kind=2, check_lock_order=True,
            execution_timeout_s=2.0, timeout_grace_s=0.2, golden_timeout_s=2.0,
            golden_decode_steps=GOLDEN_DECODE_STEPS, goldens=dict(_GOLDENS),
            fence_grace_s=0.5, recovery=policy)
        settings.update(self.config_overrides())
        config = ExecutorConfig(**settings)
        clock = VirtualClock(self.sched)
        self._ex = DeviceExecutor(self.runtime(CalRT.load()),
                                  load_manifest(default_manifest_path()), config,
                                  fault_sink=FaultController(policy, seed=0), clock=clock)
        out: dict[str, Any] = {}
        self._spawn("main", lambda: out.setdefault("status", self.ex.start()))
        self.sched.slow_device = False  # a start that times out proves nothing
        try:
            self.sched.run(1_000_000, 60.0)
        finally:
            self.sched.slow_device = True
        if hasattr(self.chooser, "begin"):
            self.chooser.begin()
        status = out.get("status")
        if self.sched.failure is None and (status is None or not status.ok):
            self.sched.fail(f"executor start under the explorer did not succeed: {status}")
        self._raise_if_failed()

    def config_overrides(self) -> dict:
        """ExecutorConfig fields a subclass sets on top of the explorer's (differential.py)."""
        return {}

    def runtime(self, calrt: CalRT) -> RuntimeApi:
        """The runtime the executor gets: the stepped, controlled proxy of ``calrt``."""
        return RuntimeProxy(calrt, self.device)

    def _spawn(self, name: str, fn: Callable[[], Any]) -> None:
        self.sched.spawn(fn, name)

    def _request(self, make: Callable[[], InferenceRequest], logits_out=None,
                 row: bool = False) -> None:
        """A request thread: ``make()``'s request, enqueued and waited for. ``row``: the
        caller passes a logits row of its own (NaN-filled), checked by ``check_logits``."""
        ex = self.ex

        def body():
            request = make()
            out = logits_out
            if row:
                out = np.full(request.logits_range(VOCAB)[1], np.nan, np.float32)
            handle = ex.enqueue(request, logits_out=out, on_created=self._track)
            result = handle.wait_until(None)
            self.results.append((handle, request, result))
            if row:
                self.rows[handle.job_id] = out
            if isinstance(result, Status) and result.code == "internal.unexpected_exception":
                self.sched.fail(f"enqueue's barrier caught an exception: {result}")
        self._spawn("request", body)

    def _track(self, handle: JobHandle) -> None:
        """A job the explorer made: kept, with its place in the resolve order."""
        self.handles.append(handle)
        order = self.resolved_order
        handle.add_done_callback(lambda done: order.setdefault(done.job_id, len(order)))

    def _deadline(self, seconds: float) -> float:
        return self.ex.clock.monotonic() + seconds

    def prefill(self, seq: int, n: int, deadline_s: float = 5.0, rewind: bool = False) -> None:
        self.script.append(("prefill", seq, n, deadline_s, rewind))

        def make():
            past = 0 if rewind else self._committed(seq)
            tokens = np.arange(7, 7 + n, dtype=np.int32)
            return InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=tokens,
                                    positions=np.arange(past, past + n, dtype=np.int32),
                                    past_len=past, deadline=self._deadline(deadline_s))
        self._request(make, row=True)

    def decode(self, seq: int, deadline_s: float = 5.0) -> None:
        self.script.append(("decode", seq, deadline_s))

        def make():
            past = self._committed(seq)
            return InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                    tokens=np.asarray([11], dtype=np.int32),
                                    positions=np.asarray([past], dtype=np.int32),
                                    past_len=past, deadline=self._deadline(deadline_s))
        self._request(make, row=True)

    def stream(self, seq: int, steps: int, greedy: bool, deadline_s: float = 5.0) -> None:
        """A ``decode_stream`` of ``seq`` from its committed length (the next step pre-armed;
        ``greedy``: greedy ahead, the completion thread firing each next step with the
        argmax): ``steps`` steps, the first with token 11, each next one with the argmax of
        the one before, then ``close()``, racing whatever runs. Every step's handle is tracked
        as a request's (resolved by its bound; none unresolved at the end), and so is each
        step fired ahead, read after every step (``DecodeStream.ahead``), taken or
        discarded; every step's logits are checked against the oracle."""
        self.script.append(("stream", seq, steps, greedy, deadline_s))
        ex = self.ex

        def body() -> None:
            answers: list[str] = []
            self.streams.append((seq, greedy, answers))
            seen: set[int] = set()

            def track(handle: JobHandle) -> None:
                if handle.job_id not in seen:
                    seen.add(handle.job_id)
                    self._track(handle)
            stream = ex.decode_stream(seq, self._committed(seq), self._deadline(deadline_s),
                                      greedy_ahead=greedy)
            token = 11
            try:
                for _ in range(steps):
                    submitted = stream.submit(token)
                    if isinstance(submitted, Status):
                        answers.append(submitted.code)
                        break
                    track(submitted)
                    result = stream.wait()
                    ahead = stream.ahead
                    if ahead is not None and ahead[1] is not None:
                        track(ahead[1])
                    if isinstance(result, Status):
                        answers.append(result.code)
                        if result.code == "internal.unexpected_exception":
                            self.sched.fail(f"a decode stream's step: {result}")
                        break
                    answers.append("ok")
                    self.stream_logits[submitted.job_id] = np.array(result.logits, copy=True)
                    token = int(result.argmax)
            finally:
                answers.append(stream.close().code)
        self._spawn("stream", body)

    def bad_argument(self, which: int) -> None:
        """A caller error: logits_out too small / of the wrong dtype, a NaN deadline."""
        self.script.append(("bad_argument", which))
        which %= 3
        logits = {0: np.zeros(10, np.float32), 1: np.zeros(200_000, np.float64)}.get(which)

        def make():
            return InferenceRequest(
                seq_id=3, kind=TaskKind.PREFILL_IDS, tokens=np.asarray([5, 6], np.int32),
                positions=np.asarray([0, 1], np.int32), past_len=0,
                deadline=float("nan") if which == 2 else self._deadline(5.0))
        self._request(make, logits_out=logits)

    def cancel(self, index: int) -> None:
        self.script.append(("cancel", index))
        handles = self.handles

        def body():
            if handles:
                handles[index % len(handles)].cancel()
        self._spawn("cancel", body)

    def arm(self, point: str, nth: int = 1) -> None:
        """Arm an emulator fault on the Nth counted call (driver side: atomic)."""
        from calexec.drivers.calrt.runtime import Fault, FaultMode
        self.script.append(("arm", point, nth))
        emu = self.device.emu
        if emu is None or self.device.closed:
            return
        if emu.set_fault(Fault[point], FaultMode.NTH, nth, 0, 0) != 0:
            raise RuntimeError(f"arm {point} nth={nth} refused")
        self.device.armed[int(Fault[point])] = nth
        if point == "STALE_COMPLETION":
            self.device.stale_armed = True
        self.device.epoch += 1

    def request_recovery(self) -> None:
        """A device fault reported to the controller (reset, rebuild, golden)."""
        self.script.append(("request_recovery",))
        self._spawn("admin-fault", self.report_device_fault)

    def report_device_fault(self) -> None:
        """Report a device fault to the executor's fault controller (on the caller's thread)."""
        self.ex.faults.report(Status.failure(
            "explorer.device_fault", Category.DEVICE, Phase.RECOVERY, "injected by the explorer"))

    def switch(self, to_other: bool, golden_ok: bool = True) -> None:
        """A model switch; ``golden_ok=False`` records a golden the calbin cannot meet, so
        the switch is refused and rolls back."""
        self.script.append(("switch", to_other, golden_ok))
        ex, path = self.ex, self.calbins["other" if to_other else "main"]

        def body():
            sha = pinned = None
            if not golden_ok:
                with open(path, "rb") as f:
                    sha = hashlib.sha256(f.read()).hexdigest()
                pinned = ex.goldens.get(sha)
                ex.goldens[sha] = (1, 2, 3)
            try:
                ready = ex.state == "Ready"
                self.switch_log.append((self.sched.now, ready))
                if ready:
                    ex.switch_model(path)
            finally:
                if sha is not None:
                    if pinned is None:
                        ex.goldens.pop(sha, None)
                    else:
                        ex.goldens[sha] = pinned
        self._spawn("admin-switch", body)

    def reset_sequence(self, seq: int) -> None:
        self.script.append(("reset_sequence", seq))
        ex = self.ex

        def body():  # the owner of the id gives it back (SequenceOwnership), racing anything
            status = ex.release_sequence(seq)
            if not status.ok and status.code not in ("kv.sequence_busy",
                                                     "kv.sequence_on_device"):
                self.sched.fail(f"release_sequence({seq}) failed: {status}")
        self._spawn("admin-reset-seq", body)

    def shutdown(self) -> None:
        """A drain/shutdown started now, racing whatever runs (``finish`` waits for admin
        calls first, then shuts down again). In the random scenarios since stop 62, drawn
        beside them (``with_streams``: the seed's other actions stay what they were); a
        model switch racing it, once an open finding (switch_model raised AttributeError
        once shutdown released the generation), is explored by tests/test_core_probe60.py
        and passes (stop 60)."""
        self.script.append(("shutdown",))
        ex = self.ex
        self._spawn("shutdown-early", lambda: ex.shutdown(grace=2.0))

    def run(self, steps: int = 1_000_000, tape: Sequence[int] | None = None,
            horizon_s: float = 30.0) -> str:
        self.script.append(("run", steps, horizon_s))
        if tape is not None and isinstance(self.chooser, PriorityTapeChooser):
            self.chooser.extend(tape)
        why = self.sched.run(steps, horizon_s)
        self._raise_if_failed()
        if why == "quiescent":
            self.check_quiescent()
        return why

    def finish(self) -> None:
        """Shut down (drain) under the scheduler and check nothing is left behind."""
        self.script.append(("finish",))
        ex = self.ex
        out: dict[str, Any] = {}
        # admin calls end first: a switch racing shutdown is a known, separate finding
        for _ in range(50):
            if not any(t.name.startswith("admin") and not t.finished for t in self.sched.threads):
                break
            if self.sched.run(1_000_000, 30.0) == "quiescent":
                self.check_quiescent()
            self._raise_if_failed()
        # ``shutdown.recovery_busy``: a recovery still ran after the grace and nothing was torn
        # down; like a supervisor, try again (bounded)
        for _ in range(5):
            out.clear()
            self._spawn("shutdown", lambda: out.setdefault("status", ex.shutdown(grace=2.0)))
            why = self.sched.run(1_000_000, 60.0)
            self._raise_if_failed()
            status = out.get("status")
            if status is None or status.code != "shutdown.recovery_busy":
                break
        problems = []
        if why == "horizon":
            problems.append("shutdown did not finish within 60 s of virtual time")
        stuck = [t.label for t in self.sched.threads if not t.finished]
        if stuck:
            problems.append(f"threads never ended: {stuck}\n{self.sched.describe()}")
        undone = [h for h in self.handles if not h.done]
        if undone:
            problems.append(f"handles never resolved: {undone}")
        if not ex.lifecycle.final:
            problems.append(f"lifecycle {ex.state} after shutdown")
        if ex.state == "Stopped":
            for pool in self.pools:
                counts = pool.counts()
                if counts["Leased"] or counts["InFlight"]:
                    problems.append(f"generation {pool.generation_id} slots left {counts}")
        if problems:
            self.sched.fail("; ".join(problems))
        self._raise_if_failed()
        problems = self.logits_problems()
        if problems:
            self.sched.fail("logits: " + "; ".join(problems[:5]))
        self._raise_if_failed()

    def logits_problems(self) -> list[str]:
        """After the run: every delivered result's logits are in the caller's row and are the
        numpy oracle's for its sequence's committed history (every job that committed, in
        completion order, cancelled-after-submit ones included); a row of a job that failed
        is untouched, except after non-finite output (documented: partly written)."""
        from calexec.drivers.synthetic import calbin as cb
        from calexec.drivers.synthetic import oracle
        seed = cb.default_spec().seed
        seeds = {self.calbins["main"]: seed, self.calbins["other"]: seed ^ OTHER_SEED_XOR}
        paths = {gen.id: gen.calbin_path for gen in self.gens}
        problems, committed = [], []
        for handle, _request, result in self.results:
            row = self.rows.get(handle.job_id)
            if row is None:
                continue
            if isinstance(result, Status):
                if result.code != "internal.output_not_finite" and not np.isnan(row).all():
                    problems.append(f"job {handle.job_id} ({result.code}) wrote the caller's row")
            elif not (np.shares_memory(result.logits, row) and result.argmax == int(
                    np.argmax(row[:result.logits.shape[0]]))):
                problems.append(f"job {handle.job_id}: result not in the caller's row")
        for handle in self.handles:
            job = job_of(handle)
            if job.txn is not None and job.txn.run.state == "Committed":
                committed.append(job)
        # in commit order: by completion time, ties (the virtual clock's) by the resolve
        # order; by job id, a rewinding prefill of 0..4 completed first was checked after a
        # job at 1 it had preceded on the device (PCT seed 57378)
        order = self.resolved_order
        committed.sort(key=lambda j: (j.timings.completed_us,
                                      order.get(j.job_id, len(order) + j.job_id)))
        sequences: dict[tuple[int, int], Any] = {}
        for job in committed:
            request, key = job.request, (job.generation_id, job.request.seq_id)
            if job.generation_id not in paths:
                continue
            ref = sequences.get(key)
            if ref is None or request.past_len > ref.length:
                if request.past_len != 0:  # a commit the run did not see: cannot say
                    sequences.pop(key, None)
                    continue
                ref = sequences[key] = oracle.OracleSequence(seeds[paths[job.generation_id]])
            tokens, result = request.tokens, job.result
            if tokens is None:  # (the explorer's requests are all token requests)
                raise AssertionError(f"job {job.job_id}: committed without tokens")
            ref.run([int(t) for t in tokens], request.past_len)
            got = self.stream_logits.get(job.job_id)  # a decode stream's step (a copy)
            if got is None:
                if job.job_id not in self.rows or result is None or isinstance(result, Status):
                    continue  # (a row this explorer's requests did not own: not theirs)
                got = result.logits
            expected = oracle.bf16_to_f32(oracle.logits_bf16(ref.states[-1]))
            if not np.array_equal(got, expected[:got.shape[0]]):
                problems.append(f"job {job.job_id} (seq {request.seq_id} at "
                                f"{request.past_len}): logits differ from the oracle")
        return problems

    def close(self) -> None:
        """Abort whatever still runs and close the device (always call; idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.contracts.disable()
        self.sched.abort_threads()
        ex = self.ex
        device = None if ex is None else ex.device
        if isinstance(device, DeviceProxy) and not self.device.closed:
            self.device.closed = True
            device._inner.close()
        # earlier explorers' executors (tens of MB of host buffers per generation) sit in
        # reference cycles: collect them every few explorers, or a long exploration grows by
        # gigabytes between the collector's own runs
        global _CLOSED
        _CLOSED += 1
        if _CLOSED % 4 == 0:
            gc.collect()

    # ---- checks -------------------------------------------------------------------------------
    def _committed(self, seq: int) -> int:
        kvc = self.ex.kvc
        view = None if kvc is None else kvc.seqs.get(seq)
        return 0 if view is None else view.committed_len

    def _check_point(self) -> None:
        if self.contracts.violations:
            raise AssertionError(f"chart contract violated: {self.contracts.violations[0]}")
        ex = self._ex
        if ex is None:
            return
        if ex.locks.violations:
            raise AssertionError(f"lock order: {ex.locks.violations[0]}")
        if ex.thread_faults:
            raise AssertionError(f"an executor thread caught an exception: "
                                 f"{ex.thread_faults[0]}")
        inflight = ex.dispatch.inflight
        if not 0 <= inflight <= ex.config.inflight_capacity:
            raise AssertionError(f"in-flight count {inflight} outside "
                                 f"[0, {ex.config.inflight_capacity}]")

    def _see_generation(self) -> None:
        gen = self.ex.gen
        if gen is not None and gen not in self.gens:
            self.gens.append(gen)
            self.pools.append(gen.pool)

    def _check_memory(self) -> None:
        """Host memory the device may still DMA into is never dropped (FI14, defect 8)."""
        self._see_generation()
        dropped = [g for g in self.gens if g.id not in self.discarded
                   and any(s.host_output is None for s in g.pool.slots)]
        emu = self.device.emu
        if not dropped or self.device.closed or emu is None:
            return
        pending = emu.counters().get("stale_pending", 0)
        for gen in dropped:
            self.discarded.add(gen.id)
        if pending:
            raise AssertionError(f"host memory of generation(s) {[g.id for g in dropped]} "
                                 f"dropped while {pending} stale DMA(s) are pending")

    def _check_blocked(self) -> None:
        """No thread can run: every thread is in a wait, so no update is half done."""
        ex = self.ex
        if ex is None:
            return
        self._check_memory()
        live = [job_of(h) for h in self.handles if not h.done]
        for job in live:  # §5.1 invariants 5 and 7
            lease = job.lease
            if lease is not None and lease.held and lease.slot.generation_id != job.generation_id:
                raise AssertionError(f"{job!r} holds a slot of generation "
                                     f"{lease.slot.generation_id}")
            if job.txn is not None and job.txn.run.state == "Submitted" and not (
                    lease is not None and lease.held and lease.slot.run.state == "InFlight"):
                raise AssertionError(f"{job!r}: KV txn Submitted but its slot is not InFlight")
        state = ex.lifecycle.state
        busy = [t for t in self.sched.threads if not t.finished and not (
            t.name in ("calexec-submitter", "calexec-completion") and t.what == "cond")]
        if state == "Ready":
            for pool in self.pools:  # invariant 8
                if pool is not ex.pool and any(s.run.state not in ("Quarantined", "Retired")
                                               for s in pool.slots):
                    raise AssertionError(f"Ready, but old generation {pool.generation_id} has "
                                         f"slots {pool.counts()}")
            self._check_kv()
        if busy:
            return
        # idle: nobody works, so nothing may stay taken
        if state not in ("Ready", "Failed", "Stopped"):
            raise AssertionError(f"lifecycle wedged in {state} with no thread working")
        if ex.config.threads and not ex.life.stopping:
            dead = [name for name, alive in ex.threads_alive().items() if not alive]
            if dead:
                raise AssertionError(f"executor threads not running: {dead}")
        if state == "Ready":
            problems = []
            # guesses of implicit pre-arms (machines/autoarm.py) hold one slot, one token of
            # budget and one KV txn each until their deadline, which the submitter's wait
            # must end at (so it releases them): nothing else may stay taken
            peek = ex.dispatch.peek()  # (every thread waits: nothing changes it now)
            guesses = [e.job for e in peek["guesses"] if e.job is not None]
            submitter = next((t for t in self.sched.threads
                              if t.name == "calexec-submitter" and not t.finished), None)
            for job in guesses:
                if job not in peek["armed"]:
                    problems.append(f"guess {job!r} not in the armed list")
                elif submitter is not None and (submitter.deadline is None
                                                or submitter.deadline > job.deadline + 1e-6):
                    problems.append(f"guess {job!r} (deadline {job.deadline:.3f}) outlives the "
                                    "submitter's wait")
            guess_txns = {id(job.txn) for job in guesses}
            if peek["pending_tokens"] != len(guesses):
                problems.append(f"pending_tokens={peek['pending_tokens']} with {len(guesses)} "
                                "guesses")
            if peek["inflight"] != len(peek["held"]):
                problems.append(f"inflight={peek['inflight']} with "
                                f"{len(peek['held'])} held by the runtime")
            if peek["queued"] or ex.completing:
                problems.append(f"queues {peek['queued']}/{ex.completing}")
            pool, kvc = ex.pool, ex.kvc
            if pool is None or kvc is None:
                raise AssertionError("Ready without a generation")
            counts = pool.counts()
            if counts["Leased"] != len(guesses) or (counts["InFlight"]
                                                    and not peek["held"]):
                problems.append(f"slots {counts} with {len(guesses)} guesses")
            open_txns = [v for v in kvc.seqs.values()
                         if (v.open_txn is not None and id(v.open_txn) not in guess_txns)
                         or (v.next_txn is not None and id(v.next_txn) not in guess_txns)]
            if open_txns:
                problems.append(f"open KV transactions {open_txns}")
            if problems:
                raise AssertionError("idle and Ready, but resources are still taken: "
                                     + ", ".join(problems))

    def _check_kv(self) -> None:
        """Invariant 6: a sequence's device KV length is its committed length whenever no
        transaction of it is open (read from the runtime's KvManager)."""
        gen = self.ex.gen
        if gen is None or gen.released:
            return
        for seq, view in list(gen.kvc.seqs.items()):
            if view.unknown_reason is not None or view.open_txn is not None or view.on_device:
                continue
            # the explorer runs on the bundled emulator's KvManager (drivers/calrt/runtime.py),
            # which also answers the device's length of a sequence (machines/ never asks)
            rc, device_len = cast("KvManager", gen.kv).seq_len(seq)
            if rc == 0 and device_len != view.committed_len:
                raise AssertionError(f"seq {seq}: device KV length {device_len} != committed "
                                     f"{view.committed_len} with no job open")

    def _check_late(self) -> None:
        """After a time jump: no handle is unresolved past its bound (+ slack)."""
        ex, now = self.ex, self.sched.now
        for handle in self.handles:
            job = job_of(handle)
            if job.done:
                continue
            if job.timings.submitted_us > 0:
                bound, what = ex.execution_deadline(job), "execution deadline"
            else:
                bound, what = job.deadline, "deadline (never submitted)"
            if now > bound + self.slack:
                raise AssertionError(f"job {job.job_id} (seq {job.request.seq_id}, state "
                                     f"{job.run.state}) unresolved {now - bound:.3f}s past its "
                                     f"{what}")

    def _raise_if_failed(self) -> None:
        sched = self.sched
        if sched.failure is None:
            return
        info = {"seed": self.seed, "options": self.options, "script": self.script,
                "choices": list(sched.choices),
                "pct": getattr(self.chooser, "params", None)}
        # a file of its own (named by the process and the choices alone, a second failure
        # with as many choices in the same process overwrote the one a message names)
        directory = replay_dir()
        try:
            os.makedirs(directory, exist_ok=True)
            fd, path = tempfile.mkstemp(prefix=f"calexec-explore-{os.getpid()}-"
                                               f"{len(sched.choices)}-", suffix=".json",
                                        dir=directory)
            with os.fdopen(fd, "w") as f:
                json.dump(info, f)
        except OSError as exc:
            path = f"(not written in {directory!r}: {exc.strerror or exc})"
        choices = sched.choices
        shown = choices if len(choices) <= 200 else f"{len(choices)} choices, see {path}"
        message = (f"{sched.failure}\n--- at virtual t={sched.now - 1000.0:.3f}s after "
                   f"{sched.steps} steps; threads:\n{sched.describe()}\n--- last choices: "
                   f"{' '.join(sched.trace[-40:])}\n--- replay: calexec.drivers.tools.explore."
                   f"replay_file({path!r})  (seed={self.seed}, script={self.script!r}, "
                   f"choices={shown})")
        self.close()
        raise ExplorationFailure(message, info)

    def check_quiescent(self) -> None:
        """After ``run`` ended quiescent: deadlock = a thread blocked for good that is not an
        idle executor loop, or work that no thread will take."""
        sched, ex = self.sched, self.ex
        if sched.stop_reason != "quiescent":
            return
        stuck = []
        for t in sched.threads:
            if t.finished:
                continue
            idle = (t.name == "calexec-submitter" and not ex.dispatch.peek()["queued"]
                    and t.what == "cond") or (
                t.name == "calexec-completion" and not ex.completing and t.what == "cond")
            if not idle:
                stuck.append(t.label)
        if stuck:
            sched.fail(f"deadlock: {stuck} blocked with no timed wait, no device work and "
                       f"nothing that could wake them")
        self._raise_if_failed()


# ---- scripted, random and replayed runs ---------------------------------------------------------
def perform(explorer: Explorer, action: tuple) -> None:
    name, *args = action
    if name == "run":
        explorer.run(args[0], horizon_s=args[1])
    elif name == "finish":
        explorer.finish()
    else:
        getattr(explorer, name)(*args)


def random_script(rng: random.Random, length: int) -> list[tuple]:
    """A random scenario: traffic, faults, recoveries, switches, interleaved with runs."""
    script: list[tuple] = []
    for _ in range(length):
        r = rng.random()
        if r < 0.30:
            script.append(("prefill", rng.choice(SEQS), rng.randint(1, 20),
                           rng.choice((0.05, 0.5, 5.0)), rng.random() < 0.3))
        elif r < 0.45:
            script.append(("decode", rng.choice(SEQS), rng.choice((0.05, 0.5, 5.0))))
        elif r < 0.50:
            script.append(("cancel", rng.randrange(8)))
        elif r < 0.53:
            script.append(("bad_argument", rng.randrange(3)))
        elif r < 0.63:
            script.append(("arm", rng.choice(FAULTS), rng.randint(1, 3)))
        elif r < 0.68:
            script.append(("arm", "HANG", 1))
        elif r < 0.73:
            script.append(("request_recovery",))
        elif r < 0.80:
            script.append(("switch", rng.random() < 0.5, rng.random() < 0.7))
        elif r < 0.83:
            script.append(("reset_sequence", rng.choice(SEQS)))
        else:
            script.append(("run", rng.choice((5, 50, 1_000_000)), 30.0))
    return script


def with_streams(rng: random.Random, script: list[tuple]) -> list[tuple]:
    """``script`` with decode streams (pre-armed, greedy ahead) and, in some scenarios, a
    mid-run shutdown inserted among its actions (since stop 62). Drawn from a generator of
    their own, so a seed's other actions, and their order, stay what they were. A
    ``reset_sequence`` (``release_sequence``) drawn beside a stream of its sequence races
    that stream's steps, the step it fired ahead and its ``close()``."""
    out: list[tuple] = []
    for action in script:
        if rng.random() < 0.12:
            seq = rng.choice(SEQS)
            out.append(("stream", seq, rng.randint(1, 4), rng.random() < 0.6,
                        rng.choice((0.05, 0.5, 5.0))))
            if rng.random() < 0.3:  # its sequence released while it runs
                out.append(("reset_sequence", seq))
        out.append(action)
    if rng.random() < 0.15:
        out.insert(rng.randint(len(out) // 2, len(out)), ("shutdown",))
    return out


def explore_seed(calbins: dict[str, str], seed: int, length: int = 12,
                 exclude: Sequence[str] = ()) -> Explorer:
    """One PCT schedule of a random scenario, both drawn from ``seed``; raises
    ``ExplorationFailure`` (with the seed) on a violation. ``explore_seed(calbins, seed)``
    replays it."""
    rng = random.Random(seed)
    options: dict[str, Any] = {
        "reset_kind": "none" if rng.random() < 0.3 else "reset",
        "kv_blocks": rng.choice((8, 64)),
        # Phase B (two jobs in flight) in a third of the scenarios; a generator of its
        # own, so a seed's scenario and schedule stay what they were in Phase A
        "capacity": 2 if random.Random(seed ^ 0xB0B).random() < 0.3 else 1}
    script = [a for a in with_streams(random.Random(seed ^ 0x5EA), random_script(rng, length))
              if a[0] not in exclude]
    # change points over the scenario's expected length (~12 choices per action after the
    # start), as Shuttle sizes them from the executions it has seen
    chooser = PCTChooser(seed, depth=rng.randint(1, 6), steps=12 * len(script) + 20)
    explorer = Explorer(calbins, chooser, seed=seed, **options)
    try:
        explorer.start()
        for action in script:
            perform(explorer, action)
        explorer.finish()
    finally:
        explorer.close()
    return explorer


def replay(calbins: dict[str, str], script: Sequence[tuple], choices: Sequence[int],
           lenient: bool = False, **options) -> Explorer:
    """Replay a recorded schedule exactly (script + choice indices from a failure report);
    ``lenient``: on code changed since the report, the same choices as far as they fit
    (``LenientReplayChooser``): a regression test's schedule up to the fixed window."""
    chooser = LenientReplayChooser(choices) if lenient else ReplayChooser(choices)
    explorer = Explorer(calbins, chooser, **options)
    try:
        explorer.start()
        for action in script:
            perform(explorer, tuple(action))
    finally:
        explorer.close()
    return explorer


class LenientReplayChooser(ReplayChooser):
    """A replay that tolerates a changed schedule (index modulo the options; 0 past the
    tape's end): for shrinking, and for replaying a fixed failure's schedule."""

    def choose(self, options: list, sched: Scheduler) -> int:
        value = self.tape[self.i] if self.i < len(self.tape) else 0
        self.i += 1
        return value % len(options)


def _run_script(calbins, script, chooser, options) -> str | None:
    explorer = Explorer(calbins, chooser, **options)
    try:
        explorer.start()
        for action in script:
            perform(explorer, tuple(action))
    except ExplorationFailure as failure:
        return _kind(failure)
    finally:
        explorer.close()
    return None


def _kind(failure: ExplorationFailure) -> str:
    """A failure's first line without its numbers (job ids and times move when shrinking)."""
    return re.sub(r"[0-9][0-9.]*", "#", str(failure).split("\n")[0])


def shrink(calbins: dict[str, str], info: dict, attempts: int = 300) -> dict:
    """Greedy shrinking of a failure's ``replay_info`` (e.g. from a PCT seed): drop script
    actions, then zero runs of choices (0 = the default, no preemption), keeping any schedule
    that still fails with the same first line. Returns the smaller ``replay_info`` with
    ``preemptions`` = its non-zero choices."""
    options = dict(info["options"])
    script = [tuple(a) for a in info["script"]]
    choices = list(info["choices"])
    target = _run_script(calbins, script, LenientReplayChooser(choices), options)
    if target is None:
        raise ValueError("the recorded schedule does not fail when replayed")
    tries = 0
    pct = info.get("pct")

    def still_fails(s, c) -> bool:
        nonlocal tries
        tries += 1
        return _run_script(calbins, s, LenientReplayChooser(c), options) == target

    def pct_fails(s) -> list[int] | None:
        """The script under the failure's own PCT priorities (robust to dropped actions:
        priorities, not choice indices); the recorded choices when it still fails."""
        nonlocal tries
        tries += 1
        explorer = Explorer(calbins, PCTChooser(*(pct or ())), **options)  # (called with one)
        try:
            explorer.start()
            for action in s:
                perform(explorer, tuple(action))
        except ExplorationFailure as failure:
            if _kind(failure) == target:
                return list(failure.replay_info["choices"])
        finally:
            explorer.close()
        return None

    i = 0
    while i < len(script) and tries < attempts:  # drop actions (never the final one)
        candidate = script[:i] + script[i + 1:]
        if script[i][0] != "finish":
            found = pct_fails(candidate) if pct else (
                choices if still_fails(candidate, choices) else None)
            if found is not None:
                script, choices = candidate, found
                continue
        i += 1
    chunk = max(1, len(choices) // 2)
    while chunk >= 1 and tries < attempts:  # zero runs of choices, halving the run length
        start = 0
        while start < len(choices) and tries < attempts:
            if any(choices[start:start + chunk]):
                candidate = choices[:start] + [0] * len(choices[start:start + chunk]) \
                    + choices[start + chunk:]
                if still_fails(script, candidate):
                    choices = candidate
            start += chunk
        chunk //= 2
    while choices and choices[-1] == 0:
        choices.pop()
    return {"seed": info.get("seed"), "options": options, "script": script,
            "choices": choices, "failure": target, "replays": tries,
            "preemptions": sum(1 for c in choices if c)}


def _read_replay(path: str) -> dict:
    """The replay JSON at ``path``: ``options`` (an object), ``script`` and ``choices`` (lists,
    the choices integers >= 0). Else a ``ValueError`` naming the file and what is wrong, before
    anything is written or started: another file (a typo, a trace, a truncated copy) raised
    ``JSONDecodeError: Expecting value: line 1 column 1``, ``KeyError: 'options'`` or
    ``TypeError: list indices must be integers``, naming neither the file nor what to give."""
    what = (f"replay_file({path!r}): not a replay file the explorer wrote (give the path a "
            f"failure's '--- replay: calexec.drivers.tools.explore.replay_file(...)' line names)")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        info = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:  # (JSONDecodeError is a ValueError)
        raise ValueError(f"{what}: no JSON ({err})") from None
    if not isinstance(info, dict):
        raise ValueError(f"{what}: a JSON {type(info).__name__}, where the explorer writes an "
                         f"object with options, script and choices")
    for key, kind in (("options", dict), ("script", list), ("choices", list)):
        if key not in info:
            raise ValueError(f"{what}: no {key!r}")
        if not isinstance(info[key], kind):
            raise ValueError(f"{what}: {key}={info[key]!r:.60} is no JSON "
                             f"{'object' if kind is dict else 'array'}")
    bad = [c for c in info["choices"] if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad:
        raise ValueError(f"{what}: choices holds {bad[0]!r:.60}, where each is an integer >= 0")
    return info


def replay_file(path: str, calbins: dict[str, str] | None = None) -> Explorer:
    """Replay the JSON a failure report names (calbins: None writes them to a temporary
    directory, removed when the replay ends, failing or not: each replay left one behind)."""
    info = _read_replay(path)
    options = dict(info["options"])
    if calbins is not None:
        return replay(calbins, info["script"], info["choices"], **options)
    with tempfile.TemporaryDirectory(prefix="calexec-explore-") as tmp:
        return replay(write_calbins(tmp), info["script"], info["choices"], **options)
