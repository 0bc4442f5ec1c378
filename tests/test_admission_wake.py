"""The waiting queue's wake-up on a freed sequence id (stop 64, issue 28): a release on the
event loop's own thread (every request's ``finish``) queues the pump with ``call_soon``, not
``call_soon_threadsafe`` (whose self-pipe write woke the running loop once more per request,
for nothing); a release from another thread still wakes the loop. Either way the pump runs
and the waiter gets the freed id (the same callback in the same queue)."""

from __future__ import annotations

import asyncio
import threading

from calexec.drivers.serving.admission import AdmissionQueue, Waiter
from calexec.drivers.serving.service import SequencePool


def _queue(pool: SequencePool) -> AdmissionQueue:
    queue = AdmissionQueue(pool, state=lambda: "Ready", health=list, draining=lambda: False,
                           max_waiting=4, poll_s=0.005)
    pool.on_free = queue.wake_threadsafe
    return queue


async def _served(waiter: Waiter, queue: AdmissionQueue) -> int:
    got = await queue.wait(waiter, until=asyncio.get_running_loop().time() + 30.0)
    assert isinstance(got, int), got
    return got


def _counting(loop: asyncio.AbstractEventLoop) -> list[object]:
    """Record the waiting queue's pumps ``loop`` is woken for through
    ``call_soon_threadsafe`` (an asyncio loop's own method, shadowed on the instance)."""
    calls: list[object] = []
    real = loop.call_soon_threadsafe

    def counted(callback, *args, **kwargs):  # type: ignore[no-untyped-def]
        if getattr(callback, "__name__", None) == "pump":
            calls.append(callback)
        return real(callback, *args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return calls


def test_a_release_on_the_loop_pumps_without_waking_it_through_its_pipe() -> None:
    async def main() -> tuple[list[object], int, int]:
        calls = _counting(asyncio.get_running_loop())
        pool = SequencePool(range(1, 2))
        queue = _queue(pool)
        held = queue.try_admit()
        assert held == 1
        waiter = queue.try_admit()  # no id free: it waits
        assert isinstance(waiter, Waiter)
        pool.release(1)  # on the loop's thread, as finish() releases
        got = await asyncio.wait_for(_served(waiter, queue), 30)
        pool.release(got)  # nobody waits: the pump finds nothing to do
        await asyncio.sleep(0)
        return calls, got, queue.waiting

    calls, got, waiting = asyncio.run(main())
    assert got == 1 and waiting == 0
    assert calls == []


def test_a_release_from_another_thread_still_wakes_the_loop() -> None:
    async def main() -> tuple[list[object], int]:
        loop = asyncio.get_running_loop()
        calls = _counting(loop)
        pool = SequencePool(range(1, 2))
        queue = _queue(pool)
        assert queue.try_admit() == 1
        waiter = queue.try_admit()
        assert isinstance(waiter, Waiter)
        releaser = threading.Thread(target=pool.release, args=(1,))
        releaser.start()
        got = await asyncio.wait_for(_served(waiter, queue), 30)
        await loop.run_in_executor(None, releaser.join, 30)
        return calls, got

    calls, got = asyncio.run(main())
    assert got == 1
    assert len(calls) == 1
