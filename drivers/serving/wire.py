"""HTTP plumbing of the reference server: bounded request bodies, cancelling work when the
client disconnects, SSE framing."""

from __future__ import annotations

import json
from typing import Any

import anyio
from fastapi import Request
from starlette.requests import ClientDisconnect


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
