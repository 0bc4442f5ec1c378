"""``wire.until_disconnect``: the work runs to its end while the client stays, is cancelled
when the client disconnects first, leaves no watcher behind, and passes a failure of either
the work or the watcher to the caller (the server's handlers answer it; nothing is lost in a
task nobody awaits)."""

from __future__ import annotations

import asyncio

import pytest

from calexec.drivers.serving import wire


class _Client:
    """An ASGI ``receive`` side: ``http.request`` messages, then a disconnect once ``gone``
    is set (or ``fail`` raised instead)."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.gone = asyncio.Event()
        self.fail = fail
        self.receives = 0

    async def receive(self) -> dict[str, object]:
        self.receives += 1
        if self.receives == 1:  # a message that is not a disconnect: the watcher goes on
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.gone.wait()
        if self.fail is not None:
            raise self.fail
        return {"type": "http.disconnect"}


def _run(coro):  # noqa: ANN001, ANN202 - a test helper
    return asyncio.run(asyncio.wait_for(coro, 10.0))


def test_the_work_runs_to_its_end_and_no_watcher_is_left():
    async def main() -> list[str]:
        client, done = _Client(), []

        async def work() -> None:
            for _ in range(3):
                await asyncio.sleep(0)
            done.append("work")
        await wire.until_disconnect(client, work)  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the cancelled watcher ends on the next turn of the loop
        watchers = [t for t in asyncio.all_tasks()
                    if getattr(t.get_coro(), "__qualname__", "").endswith(".watch")]
        done.extend(t.get_name() for t in watchers if not t.done())
        return done
    assert _run(main()) == ["work"]


def test_a_disconnect_cancels_the_work_and_returns_normally():
    async def main() -> tuple[bool, bool]:
        client = _Client()
        reached_end = False

        async def work() -> None:
            nonlocal reached_end
            client.gone.set()  # the client leaves while the work waits
            await asyncio.sleep(5)
            reached_end = True
        started = asyncio.get_running_loop().time()
        await wire.until_disconnect(client, work)  # type: ignore[arg-type]
        return reached_end, asyncio.get_running_loop().time() - started < 4
    assert _run(main()) == (False, True)


def test_a_failure_of_the_work_reaches_the_caller_as_itself():
    async def main() -> None:
        async def work() -> None:
            await asyncio.sleep(0)
            raise KeyError("inside the work")
        await wire.until_disconnect(_Client(), work)  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="inside the work"):
        _run(main())


def test_a_failure_of_the_watcher_cancels_the_work_and_reaches_the_caller():
    async def main() -> None:
        client = _Client(fail=RuntimeError("receive broke"))

        async def work() -> None:
            client.gone.set()
            await asyncio.sleep(5)
        await wire.until_disconnect(client, work)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="receive broke"):
        _run(main())


def test_a_cancel_from_outside_is_not_swallowed():
    """The caller's own cancellation (its deadline, the server shutting down) goes through:
    only the disconnect's cancel ends quietly."""
    async def main() -> str:
        async def work() -> None:
            await asyncio.sleep(5)
        task = asyncio.get_running_loop().create_task(
            wire.until_disconnect(_Client(), work))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "swallowed"
    assert _run(main()) == "cancelled"
