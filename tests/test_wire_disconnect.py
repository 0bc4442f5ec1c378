"""``wire.until_disconnect``: the work runs to its end while the client stays, is cancelled
when the client disconnects first, leaves no watcher behind, and passes a failure of either
the work or the watcher to the caller (the server's handlers answer it; nothing is lost in a
task nobody awaits). ``wire.BoundedStreamingResponse``: a send that fails or a cancelled
response ends its body at once (what the request holds comes back then)."""

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
    """The work waits for ever: only the disconnect's cancel ends it (else ``_run``'s 10 s
    bound fails the test), and until_disconnect returns normally."""
    async def main() -> list[str]:
        client = _Client()
        seen: list[str] = []

        async def work() -> None:
            client.gone.set()  # the client leaves while the work waits
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                seen.append("cancelled")
                raise
            seen.append("reached its end")
        await wire.until_disconnect(client, work)  # type: ignore[arg-type]
        return seen
    assert _run(main()) == ["cancelled"]


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
        working = asyncio.Event()

        async def work() -> None:
            working.set()
            await asyncio.Event().wait()
        task = asyncio.get_running_loop().create_task(
            wire.until_disconnect(_Client(), work))  # type: ignore[arg-type]
        await working.wait()  # the cancel lands while the work runs, not before it started
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "swallowed"
    assert _run(main()) == "cancelled"


def _bounded_response(released: list[str]) -> wire.BoundedStreamingResponse:
    """A ``BoundedStreamingResponse`` over a body whose ``finally`` (where a request gives
    back its sequence id) records "released"; its bound far away, its cut recording "cut"."""
    import time

    async def body():  # noqa: ANN202 - a test helper
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
        finally:
            released.append("released")

    async def on_cut() -> None:
        released.append("cut")
    return wire.BoundedStreamingResponse(body(), wire.SendBounds(),
                                         lambda: time.monotonic() + 600, on_cut)


_SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
          "http_version": "1.1", "method": "POST", "path": "/", "headers": []}


def test_a_send_that_fails_ends_the_body_at_once():
    """A send that raised (a server writing into a connection already gone: uvloop's
    RuntimeError on a closed transport, ASGI 2.4's OSError) left the response's body
    suspended: what its ``finally`` gives back (the request's sequence id, KV, decode slot)
    stayed held until the generator was garbage-collected, which the exception's reference
    cycle puts off to the next full collection (on a live server, a sequence id still in
    use after 35 s and at the drain). The body is closed before the failure goes on."""
    import gc

    async def main() -> tuple[list[str], str]:
        released: list[str] = []
        response, sends = _bounded_response(released), []

        async def send(message: dict[str, object]) -> None:
            sends.append(message)
            if len(sends) > 2:
                raise RuntimeError("unable to perform operation on <TCPTransport closed=True>")

        async def receive() -> dict[str, object]:
            await asyncio.sleep(30)  # the client says nothing (bounded: _run's 10 s)
            return {"type": "http.disconnect"}
        try:
            await response(_SCOPE, receive, send)  # type: ignore[arg-type]
        except Exception as failure:  # noqa: BLE001 - what the server would see
            return list(released), type(failure).__name__
        return list(released), "no failure"
    gc.disable()  # what a collection would do later is not what is tested
    try:
        assert _run(main()) == (["released"], "RuntimeError")
    finally:
        gc.enable()


def test_a_response_whose_task_is_cancelled_ends_its_body_before_the_cancel_completes():
    """The client left: the server cancels the response's task in a send. The body's
    ``finally`` ran only when the generator was collected; it runs before the task ends."""
    import gc

    async def main() -> list[str]:
        released: list[str] = []
        response = _bounded_response(released)
        blocked = asyncio.Event()

        async def send(message: dict[str, object]) -> None:
            if message.get("body"):
                blocked.set()
                await asyncio.sleep(30)  # a send that waits (cancelled below)

        async def receive() -> dict[str, object]:
            await asyncio.sleep(30)
            return {"type": "http.disconnect"}
        task = asyncio.get_running_loop().create_task(
            response(_SCOPE, receive, send))  # type: ignore[arg-type]
        await blocked.wait()
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return list(released)
    gc.disable()
    try:
        assert _run(main()) == ["released"]
    finally:
        gc.enable()
