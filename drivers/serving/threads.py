"""Worker threads the event loop hands work to without ever starting a thread itself.

``threading.Thread.start`` returns only once the new thread has been scheduled and has
signalled that it runs. On a CPU-starved host that wait took 0.1-0.25 s (issue 28, stop 69:
the chaos gate's stacks found the event loop inside it, in ``ThreadPoolExecutor.submit``'s
``_adjust_thread_count`` and in the per-release thread of ``release_later``), and every
request the loop serves waits with it. :class:`WorkerPool` runs calls on named daemon threads
like a ``ThreadPoolExecutor``, but its ``submit`` only queues the call and counts: a thread
of the pool's own (its *keeper*, started with the pool) starts the workers, one whenever a
submit takes the last idle one (so the next submit finds one ready) or finds none, up to
``max_workers``; none before the first submit. A call waits in
the queue for the next free or newly started worker; it never waits for a thread to start on
the submitter's thread. A worker idle for ``idle_s`` (:data:`IDLE_S`, 10 s, as anyio's
worker threads) ends while another idle worker is left to take the next call: after a burst
of concurrency the pool shrinks back to one idle worker (until stop 71 every thread a burst
started stayed for the life of the server: 69 idle threads after a soak at 64 clients).

The threads hold the pool's shared state, not the pool: when the :class:`WorkerPool` is
collected without :meth:`WorkerPool.shutdown` (an app dropped by a test), its threads end as a
``ThreadPoolExecutor``'s do.

A worker the host refuses to start (``RuntimeError: can't start new thread``: a thread or
memory limit, a container's ``pids.max``) is logged and asked for again, after a back-off
of up to :data:`RESTART_MAX_S`, while the interpreter is not ending: the calls queued for it
run once one starts (a ``ThreadPoolExecutor``'s submit raised it to its caller; the pool's
calls have no caller left to raise to). A call that raises ``StopIteration`` fails its future
with a ``RuntimeError`` from it, as anyio's ``to_thread`` answered: an asyncio future refuses
``StopIteration``, and a loop awaiting ``asyncio.wrap_future`` would wait forever.

Its lock, condition, queue and threads come from a :class:`~calexec.machines.clock.Clock`
(the system's by default), so the interleaving explorer (``drivers/tools/interleave.py``)
can run it under its scheduler (``tests/test_worker_pool.py``).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from calexec.machines.clock import SYSTEM, Clock

T = TypeVar("T")

_STOP = object()  # (a worker's queue item: end)
#: the longest wait (s) before the keeper asks the host again for a worker it refused
RESTART_MAX_S = 1.0
#: how long (s) a worker waits idle before it ends, when another idle worker is left
IDLE_S = 10.0
_RESTART_FIRST_S = 0.01

log = logging.getLogger("calexec.server")


class _Shared:
    """The state the pool's threads share (under ``mu``): the work queue, and how many workers
    there are, are idle and unclaimed (``free``), are being started, and how many queued calls
    no idle worker was counted for (``backlog``)."""

    def __init__(self, max_workers: int, name: str, clock: Clock, idle_s: float) -> None:
        self.max_workers = max_workers
        self.name = name
        self.clock = clock
        self.idle_s = idle_s
        # the host's clock (``real``: a native wait stands in for its waits): the C queue,
        # a tenth of ``queue.Queue``'s put and get (about 1.3 us a call) on the event loop's
        # submit; another clock's (the explorer's) for its scheduler to see
        self.work: queue.SimpleQueue[Any] | queue.Queue[Any] = (
            queue.SimpleQueue() if clock.real else clock.queue())
        self.mu = clock.lock()
        self.keeper_cv = clock.condition(self.mu, "keeper")
        self.workers = 0  # started (or starting) and not ended
        self.to_start = 0  # asked of the keeper, not started yet
        self.free = 0  # idle workers no queued call was counted against
        self.backlog = 0  # queued calls no idle worker was counted for
        self.closed = False
        self.numbers = itertools.count()

    def want_worker(self) -> None:
        """(Under ``mu``.) One more worker, unless the pool has its ``max_workers``."""
        if not self.closed and self.workers + self.to_start < self.max_workers:
            self.to_start += 1
            self.keeper_cv.notify()

    def claim(self) -> None:
        """(Under ``mu``, a submit.) Count the queued call against an idle worker, else as
        backlog; ask the keeper for a worker when none is left idle."""
        if self.free > 0:
            self.free -= 1
        else:
            self.backlog += 1
        if self.free == 0:
            self.want_worker()

    def idle(self) -> None:
        """(Under ``mu``, a worker about to take its next call.) It takes a backlogged call or
        counts as free."""
        if self.backlog > 0:
            self.backlog -= 1
        else:
            self.free += 1

    def retire(self) -> bool:
        """(Under ``mu``, a worker idle for ``idle_s``.) Whether it ends now: the pool is not
        closed (each worker then takes one of the stops ``close`` queued) and another idle
        worker no queued call was counted against is left, so the next submit still finds
        one ready. An idle worker is counted in ``free`` until a submit claims it; idle
        workers are alike, so the one that ends takes one of those counts."""
        if self.closed or self.free < 2:
            return False
        self.free -= 1
        self.workers -= 1
        return True

    def close(self) -> None:
        """No new calls; every worker ends once the calls already queued ran (the keeper still
        starts the workers asked for, then ends)."""
        with self.mu:
            if self.closed:
                return
            self.closed = True
            stops = self.workers + self.to_start  # (the keeper still starts those asked for)
            self.keeper_cv.notify_all()
        for _ in range(stops):
            self.work.put(_STOP)

    def keep(self) -> None:
        """(The keeper thread.) Start the workers asked for, until the pool is closed. One the
        host refuses is asked for again after a back-off (module doc), unless the interpreter
        is ending."""
        backoff = 0.0  # (s; 0: the last start succeeded)
        while True:
            with self.mu:
                while self.to_start == 0 and not self.closed:
                    self.keeper_cv.wait()
                if self.to_start == 0:  # (closed)
                    return
                self.to_start -= 1
                self.workers += 1
                number = next(self.numbers)
            try:
                self.clock.start_thread(self.serve, f"{self.name}_{number}")
            except RuntimeError as exc:  # (the host's limit, or the interpreter is ending)
                with self.mu:
                    self.workers -= 1
                    if sys.is_finalizing():
                        return
                    # still wanted: the calls counted for it wait in the queue (a closed
                    # pool's too: they run before the stops)
                    self.to_start += 1
                    running = self.workers
                if backoff == 0.0:
                    log.warning("%s: cannot start a worker thread (%s; %d running); asking "
                                "again every %g s at most meanwhile", self.name, exc,
                                running, RESTART_MAX_S)
                backoff = min(RESTART_MAX_S, max(_RESTART_FIRST_S, 2 * backoff))
                with self.mu:
                    self.keeper_cv.wait(backoff)
                continue
            if backoff:
                log.warning("%s: worker threads start again", self.name)
                backoff = 0.0

    def serve(self) -> None:
        """(A worker.) Run queued calls until told to stop."""
        while True:
            with self.mu:
                self.idle()
            while True:
                try:
                    item = self.work.get(True, self.idle_s)
                    break
                except queue.Empty:  # idle that long: end unless it is the last one idle
                    with self.mu:
                        if self.retire():
                            return
            if item is _STOP:
                with self.mu:
                    self.workers -= 1
                return
            future, fn, args = item
            del item
            if future.set_running_or_notify_cancel():
                try:
                    result = fn(*args)
                except StopIteration as exc:  # (an asyncio future refuses it: module doc)
                    error = RuntimeError(f"a {self.name} call raised StopIteration")
                    error.__cause__ = exc
                    future.set_exception(error)
                    del error  # (nor its traceback while idle)
                except BaseException as exc:  # noqa: BLE001 - the caller's, through its future
                    future.set_exception(exc)
                else:
                    future.set_result(result)
                    del result
            # nothing of the call kept while idle (a cancelled one's too): a step's result
            # holds a job handle, which holds the executor of an app already dropped
            del future, fn, args


class WorkerPool:
    """Up to ``max_workers`` daemon threads named ``{name}_N`` that run submitted calls; a
    submit never starts a thread, and a worker idle ``idle_s`` seconds ends while another
    idle one is left (module doc). ``shutdown`` is final: later submits raise
    ``RuntimeError`` as a shut-down ``ThreadPoolExecutor``'s do. ``clock``: where its
    threads and their lock come from (module doc)."""

    def __init__(self, max_workers: int, name: str, clock: Clock = SYSTEM,
                 idle_s: float = IDLE_S) -> None:
        if max_workers < 1:
            raise ValueError(f"WorkerPool max_workers must be >= 1, got {max_workers}")
        if not (isinstance(idle_s, (int, float)) and not isinstance(idle_s, bool)
                and 0 < idle_s <= threading.TIMEOUT_MAX):
            raise ValueError(f"WorkerPool idle_s must be a number of seconds > 0, got "
                             f"{idle_s!r}")
        self._shared = _Shared(max_workers, name, clock, float(idle_s))
        self._keeper = clock.start_thread(self._shared.keep, f"{name}-keeper")
        weakref.finalize(self, self._shared.close)

    def submit(self, fn: Callable[..., T], /, *args: Any) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args)``; its future. Never blocks beyond a lock held for counting and
        queuing (the queue is unbounded)."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        shared = self._shared
        with shared.mu:
            if shared.closed:
                raise RuntimeError(f"cannot schedule new calls after {shared.name}'s shutdown")
            shared.claim()
            # queued under the lock: a shutdown between the count and the put would queue
            # every worker's stop ahead of the call, and no worker would be left to run it
            shared.work.put((future, fn, args))
        return future

    def shutdown(self) -> None:
        """No new calls; idle workers end now, busy ones after the calls already queued."""
        self._shared.close()

    @property
    def workers(self) -> int:
        """Workers started (or being started) and not ended."""
        with self._shared.mu:
            return self._shared.workers + self._shared.to_start
