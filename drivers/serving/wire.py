"""HTTP plumbing of the reference server: bounded request bodies, cancelling work when the
client disconnects, SSE framing, and streamed responses whose every send is bounded (a client
that stops reading cannot hold what its request holds)."""

from __future__ import annotations

import json
import math
import time
from typing import Any, Awaitable, Callable

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive, Scope, Send

#: ASGI scope extension: a callable that aborts the request's connection at once (set by the
#: HTTP protocol ``server.uvicorn_config`` runs; a response cut by its bound calls it, so the
#: connection ends without waiting for a client that reads nothing)
ABORT_EXTENSION = "calexec.abort"


class ClientGone(Exception):
    """The client disconnected before its request body arrived whole."""


def sse(data: Any) -> bytes:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n".encode("utf-8")


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None when it exceeds ``limit`` bytes (declared or actual); raises
    :class:`ClientGone` when the client disconnects mid-upload (the route answers it as a
    cancelled request, never with an ASGI traceback)."""
    declared = request.headers.get("content-length")
    if (declared is not None and declared.isascii() and declared.isdigit()
            and int(declared) > limit):
        return None
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return None
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone(f"the client disconnected after {size} bytes of its body") from None
    return b"".join(chunks)


async def until_disconnect(request: Request, work) -> None:
    """Run ``await work()``; cancel it if the client disconnects first."""
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            tg.cancel_scope.cancel()
        tg.start_soon(watch)
        await work()
        tg.cancel_scope.cancel()


class SendBounds:
    """The bounds of every send of the responses it guards (:class:`BoundedStreamingResponse`):
    a send waits at most until its response's bound; :meth:`cut` lowers every bound, sends
    already waiting included, to a time (a drain's end). Event-loop only."""

    def __init__(self) -> None:
        self._waiting: set[anyio.CancelScope] = set()
        self.cut_at = math.inf  # time.monotonic(); inf until a drain cuts

    def cut(self, at: float) -> None:
        """From now on no send waits past ``at`` (``time.monotonic()``)."""
        self.cut_at = min(self.cut_at, at)
        for scope in list(self._waiting):
            scope.deadline = min(scope.deadline, _loop_time(at))

    async def send(self, send: Send, message: Message, until: float) -> bool:
        """``await send(message)``, given up at ``until`` (``time.monotonic()``) or the cut:
        False when it did not complete by then (then nothing more can be sent: the
        connection's write side is stalled)."""
        with anyio.CancelScope(deadline=_loop_time(min(until, self.cut_at))) as scope:
            self._waiting.add(scope)
            try:
                await send(message)
            finally:
                self._waiting.discard(scope)
        return not scope.cancelled_caught


def _loop_time(monotonic: float) -> float:
    """``time.monotonic()`` -> the event loop's clock, which anyio's deadlines use."""
    return anyio.current_time() + (monotonic - time.monotonic())


class BoundedStreamingResponse(StreamingResponse):
    """A streamed response whose every send must complete by ``until()`` (absolute
    ``time.monotonic()``; a request's deadline + ``deadline_slack_s``) or the ``bounds``' cut.
    A server blocks in a send once a client stops reading and the socket buffers are full;
    past the bound the response is cut instead: ``on_cut()`` runs (it gives back what the
    request holds), the body iterator is closed, and the connection is aborted when the
    server offers it (:data:`ABORT_EXTENSION`; else the server closes it as a response the
    application did not complete)."""

    def __init__(self, content: Any, bounds: SendBounds, until: Callable[[], float],
                 on_cut: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.bounds, self.until, self.on_cut = bounds, until, on_cut
        self.abort: Callable[[], None] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.abort = (scope.get("extensions") or {}).get(ABORT_EXTENSION)
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        sent = await self.bounds.send(send, {"type": "http.response.start",
                                             "status": self.status_code,
                                             "headers": self.raw_headers}, self.until())
        if sent:
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                sent = await self.bounds.send(send, {"type": "http.response.body",
                                                     "body": chunk, "more_body": True},
                                              self.until())
                if not sent:
                    break
            else:
                sent = await self.bounds.send(send, {"type": "http.response.body", "body": b"",
                                                     "more_body": False}, self.until())
        if not sent:
            await self._cut()

    async def _cut(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.on_cut()
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
        if self.abort is not None:
            self.abort()
