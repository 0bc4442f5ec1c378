"""The server's waiting queue (issue 16): a completion request that finds no free KV sequence
id, or arrives while the device lifecycle is Draining/Recovering/Configuring/Warming, waits for
an id and for Ready, up to its own deadline, instead of an immediate 429/503 (Triton's DELAY
policy; vLLM's ``num_requests_waiting``). A resumed generation (drivers/serving/resume.py) waits for
its fresh sequence id here too, ahead of the requests not yet admitted.

One mechanism for both reasons:

* ``AdmissionQueue.try_admit`` (synchronous, on the event loop) gives an id at once when the
  lifecycle is Ready, the executor healthy, nobody waits ahead and an id is free; else it
  registers a :class:`Waiter` (FIFO), or refuses when ``max_waiting`` requests already wait
  (counted at a request's first choice: its later choices, admitted with it, wait their turn)
  (429 ``kv.full`` when the lifecycle is Ready, healthy and ids are exhausted; 503 during
  recovery or while ``executor.health()`` names a reason, e.g. a hung job not yet recovered)
  or when waiting cannot help (draining server, lifecycle Failed/Stopped/Created: 503).
* ``AdmissionQueue.wait`` suspends the request's task (no worker thread: the thread limiters of
  running requests are untouched) until the waiter is handed an id, refused, or its deadline
  passes (504 ``admission.deadline``). A cancelled wait (client disconnect) leaves the queue and
  gives back an id it was handed but did not take.
* ``pump`` hands free ids to the waiters in order (resumes first, then fresh requests, FIFO
  within each) while the lifecycle is Ready and healthy, and refuses every waiter once the
  lifecycle is Failed/Stopped or the server drains (a drain refuses only requests not yet
  admitted: resumes and the later choices of an admitted request keep waiting). It runs when a sequence id is freed (the
  pool's ``on_free`` hook, from any thread, through ``call_soon_threadsafe``; ``call_soon`` on
  the loop's own thread) and from one
  watcher task per queue while anyone waits: the executor has no public state-change event, so
  the watcher re-reads its lifecycle every ``lifecycle_poll_s`` (slices of 5 ms by default, 10
  times that while Ready, when frees wake the queue anyway).

Everything but ``wake_threadsafe`` runs on the event loop thread: no lock is needed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import anyio
import attrs

from calexec.contracts.status import Phase, Status


def _running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, if any."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


#: lifecycle states a request waits through (the §9.1 recovery and model switch path)
WAITABLE = frozenset({"Draining", "Recovering", "Configuring", "Warming"})


@attrs.define(eq=False)
class Waiter:
    """One request waiting for a sequence id (and Ready)."""

    resume: bool
    #: a later choice of a request already admitted (``try_admit``): a drain does not refuse it
    admitted: bool = False
    since: float = attrs.Factory(time.monotonic)
    event: anyio.Event = attrs.Factory(anyio.Event)
    seq_id: int | None = None  # handed by pump(), not yet taken by wait()
    status: Status | None = None  # refused by pump()
    queued: bool = True


class AdmissionQueue:
    """FIFO of requests waiting for a KV sequence id and a Ready lifecycle (module docstring)."""

    def __init__(self, sequences: Any, state: Callable[[], str], health: Callable[[], list[str]],
                 draining: Callable[[], bool], max_waiting: int, poll_s: float,
                 failure: Callable[[], Status | None] = lambda: None) -> None:
        self.sequences = sequences
        self._state, self._health, self._draining = state, health, draining
        self._failure = failure
        self.max_waiting = max_waiting
        self.poll_s = poll_s
        self._resumes: deque[Waiter] = deque()
        self._fresh: deque[Waiter] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watcher: asyncio.Task | None = None

    @property
    def waiting(self) -> int:
        """Requests waiting now (``calexec_num_requests_waiting``)."""
        return len(self._resumes) + len(self._fresh)

    # ---- admission --------------------------------------------------------------------------
    def try_admit(self, resume: bool = False, admitted: bool = False) -> int | Waiter | Status:
        """A sequence id now, a registered :class:`Waiter`, or the refusal (module docstring).
        ``resume``: an admitted request resuming on a fresh sequence (never refused for a full
        queue; served before fresh requests; not refused while the server drains).
        ``admitted``: a later choice of a request of several that was admitted (its turn in
        the FIFO as any request's; not refused while the server drains: a drain lets admitted
        requests finish; nor for a full queue: ``max_waiting`` is met by a request once, at
        its first choice, and a request admitted is served whole. Until stop 72 a later
        choice was refused 429 ``kv.full`` after the earlier ones ran, the request's answer
        a 429 or, streamed, an error event after their chunks)."""
        self._remember_loop()
        state = self._state()
        if self._draining() and not (resume or admitted):
            return Status.unavailable(Phase.ADMISSION, "server is draining")
        if state != "Ready" and state not in WAITABLE:
            return self.not_serving(state)
        queue = self._resumes if resume else self._fresh
        ahead = len(self._resumes) if resume else self.waiting
        reasons = self._health() if state == "Ready" else []
        if state == "Ready" and not ahead and not reasons:
            seq_id = self.sequences.acquire()
            if seq_id is not None:
                return seq_id
        if not (resume or admitted) and self.waiting >= self.max_waiting:
            full = f"{self.waiting} requests already wait (max_waiting={self.max_waiting})"
            if state == "Ready" and not reasons:
                return Status.exhausted(
                    "kv", Phase.ADMISSION, f"all {self.sequences.size} KV sequence ids are in "
                    f"use and {full}")
            return Status.unavailable(
                Phase.ADMISSION, f"{'; '.join(reasons) or f'device lifecycle is {state}'} "
                f"and {full}")
        waiter = Waiter(resume, admitted)
        queue.append(waiter)
        self._ensure_watcher()
        return waiter

    async def wait(self, waiter: Waiter, until: float) -> int | Status:
        """The sequence id handed to ``waiter``, or why not: its refusal, or a deadline Status
        once ``until`` (absolute ``time.monotonic()``) passed. Cancellation (client gone)
        leaves the queue and gives back an id handed but not taken."""
        try:
            with anyio.move_on_after(max(0.0, until - time.monotonic())):
                await waiter.event.wait()
        except BaseException:
            self.leave(waiter)
            raise
        if waiter.seq_id is not None:
            seq_id, waiter.seq_id = waiter.seq_id, None
            return seq_id
        if waiter.status is not None:
            return waiter.status
        self.leave(waiter)
        state = self._state()
        reasons = self._health() if state == "Ready" else []
        return Status.deadline(Phase.ADMISSION, f"deadline passed after waiting "
                               f"{time.monotonic() - waiter.since:.3f}s for a KV sequence id "
                               f"and Ready (device lifecycle {state}"
                               + "".join(f"; {r}" for r in reasons) + ")")

    async def take(self, run: Any, until: float) -> Status | None:
        """``run`` holds no sequence: give it the id its waiter (``run.waiter``, from
        ``try_admit``) is handed, waiting until ``until`` at most. None once ``run.seq_id``
        is set; else the Status the request ends with."""
        waiter, run.waiter = run.waiter, None
        got = await self.wait(waiter, until) if isinstance(waiter, Waiter) else waiter
        if isinstance(got, Status):
            return got
        run.seq_id = got
        return None

    def leave(self, waiter: Any) -> None:
        """``waiter`` gives up (idempotent): out of the queue; an id it was handed goes back
        (also an id ``try_admit`` answered at once and nobody took yet)."""
        if isinstance(waiter, int) and not isinstance(waiter, bool):
            self.sequences.release(waiter)
            return
        if not isinstance(waiter, Waiter):
            return
        if waiter.queued:
            waiter.queued = False
            (self._resumes if waiter.resume else self._fresh).remove(waiter)
        if waiter.seq_id is not None:
            seq_id, waiter.seq_id = waiter.seq_id, None
            self.sequences.release(seq_id)  # on_free pumps it to the next waiter

    def not_serving(self, state: str) -> Status:
        """The 503 of a request the lifecycle ``state`` (not Ready, not one to wait in) will
        not serve: a Failed one names the failure that ended it (``failure``), which a client
        retrying the request's first 500 (the OpenAI SDKs retry every 5xx) otherwise met only
        as "device lifecycle is Failed", its last answer and so the error it raised."""
        failure = self._failure() if state == "Failed" else None
        return Status.unavailable(Phase.ADMISSION, f"device lifecycle is {state}"
                                  + (f" after {failure}" if failure is not None else ""))

    # ---- waking -----------------------------------------------------------------------------
    def pump(self) -> None:
        """Hand free ids to waiters in order, or refuse them all when waiting cannot help."""
        if not self.waiting:
            return
        state = self._state()
        if state != "Ready" and state not in WAITABLE:
            self._refuse_all(self.not_serving(state), resumes=True)
            return
        if self._draining():
            self._refuse_all(Status.unavailable(Phase.ADMISSION, "server is draining"),
                             resumes=False)
        if state != "Ready" or self._health():
            return
        for queue in (self._resumes, self._fresh):
            while queue:
                seq_id = self.sequences.acquire()
                if seq_id is None:
                    return
                waiter = queue.popleft()
                waiter.queued = False
                waiter.seq_id = seq_id
                waiter.event.set()

    def _refuse_all(self, status: Status, resumes: bool) -> None:
        """Refuse the waiters; ``resumes`` False (a drain): not the resumes, nor the later
        choices of admitted requests, which keep their places."""
        for queue in ((self._resumes, self._fresh) if resumes else (self._fresh,)):
            kept = [waiter for waiter in queue if waiter.admitted and not resumes]
            while queue:
                waiter = queue.popleft()
                if waiter.admitted and not resumes:
                    continue
                waiter.queued = False
                waiter.status = status
                waiter.event.set()
            queue.extend(kept)

    def wake_threadsafe(self) -> None:
        """From any thread (a sequence id was freed): pump on the event loop. On the loop's
        own thread (a request's ``finish`` releasing its sequence, once per request) the pump
        is queued with ``call_soon``: the same callback in the same place of the loop's
        queue, without ``call_soon_threadsafe``'s write to the loop's self-pipe, which woke
        the running loop once more for nothing (issue 28, stop 64)."""
        loop = self._loop
        if loop is None:
            return
        try:
            if _running_loop() is loop:
                loop.call_soon(self.pump)
            else:
                loop.call_soon_threadsafe(self.pump)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _remember_loop(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()

    def _ensure_watcher(self) -> None:
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        """While anyone waits: re-read the lifecycle in bounded slices and pump (the executor
        offers no state-change event; frees wake the queue directly)."""
        while self.waiting:
            ready = self._state() == "Ready"
            await anyio.sleep(self.poll_s * (10 if ready else 1))
            self.pump()
