"""``wire.body_or_refusal`` with the drain's ``BodyReads``: every way a body's read ends
is answered as before stop 65, when the cut had a cancel scope of its own around the read's
time bound (one scope per read now, ``BodyReads.hold``; issue 28). The same cases passed on
the code before the change (c038965): they pin its answers, status, message and headers."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from calexec.drivers.serving import wire


class _Upload:
    """An ASGI ``receive`` side: ``chunks`` as ``http.request`` messages (the last one ends
    the body when ``whole``), then a wait for ever; ``waiting`` is set once the read waits."""

    def __init__(self, chunks: list[bytes], whole: bool = False) -> None:
        self.chunks = list(chunks)
        self.whole = whole
        self.waiting = asyncio.Event()

    async def receive(self) -> dict[str, object]:
        if self.chunks:
            chunk = self.chunks.pop(0)
            return {"type": "http.request", "body": chunk,
                    "more_body": bool(self.chunks) or not self.whole}
        self.waiting.set()
        await asyncio.Event().wait()  # never set: only a cancel ends the wait
        raise AssertionError("unreachable")


def _request(upload: _Upload, length: int | None = None) -> Request:
    headers = [(b"content-type", b"application/json")]
    if length is not None:
        headers.append((b"content-length", str(length).encode()))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers,
             "http_version": "1.1", "query_string": b"", "root_path": ""}
    return Request(scope, upload.receive)


def _answer(got: bytes | wire.BodyRefusal) -> object:
    if isinstance(got, wire.BodyRefusal):
        return (got.http_status, got.status.code, got.status.message, got.headers)
    return got


def _run(coro):  # noqa: ANN001, ANN202 - a test helper
    return asyncio.run(asyncio.wait_for(coro, 10.0))


DRAINED = ("server drained: its grace ran out before the request's body arrived whole; retry")


@pytest.mark.parametrize("with_reads", [False, True])
def test_a_whole_body_is_read(with_reads):
    async def main() -> object:
        reads = wire.BodyReads() if with_reads else None
        return await wire.body_or_refusal(_request(_Upload([b'{"a"', b": 1}"], whole=True)),
                                          100, 5.0, reads)
    assert _run(main()) == b'{"a": 1}'


def test_a_cut_during_the_read_is_the_draining_503_saying_why():
    async def main() -> object:
        reads, upload = wire.BodyReads(), _Upload([b'{"a"'])

        async def cut() -> None:
            await upload.waiting.wait()
            reads.cut()
        task = asyncio.get_running_loop().create_task(cut())
        got = await wire.body_or_refusal(_request(upload), 100, 30.0, reads)
        await task
        return _answer(got)
    status, code, message, headers = _run(main())
    assert (status, headers) == (503, wire.CLOSE)
    assert message == DRAINED, message
    assert code == "lifecycle.unavailable", code


def test_a_read_after_the_cut_is_told_the_server_is_draining():
    async def main() -> object:
        reads = wire.BodyReads()
        reads.cut("none left running")
        return _answer(await wire.body_or_refusal(_request(_Upload([b'{"a"'])), 100, 30.0,
                                                  reads))
    status, _, message, headers = _run(main())
    assert (status, message, headers) == (503, "server is draining", wire.CLOSE)


def test_a_body_not_whole_in_its_time_is_the_408_not_a_cut():
    async def main() -> object:
        reads = wire.BodyReads()
        got = await wire.body_or_refusal(_request(_Upload([b'{"a"'])), 100, 0.05, reads)
        assert not reads.cut_done
        return _answer(got)
    status, _, message, headers = _run(main())
    assert (status, headers) == (408, wire.CLOSE)
    assert message == ("the request body did not arrive whole within body_timeout_s=0.05 s: "
                       "4 bytes of an undeclared length came"), message


def test_a_cut_while_a_too_large_body_is_dropped_is_the_draining_503():
    """A body declared past the limit is read and dropped before its 413 (``_discard``);
    a drain cutting that read answers the draining 503, as the cut's own scope around the
    whole read did."""
    async def main() -> object:
        reads, upload = wire.BodyReads(), _Upload([b"x" * 10])

        async def cut() -> None:
            await upload.waiting.wait()
            reads.cut()
        task = asyncio.get_running_loop().create_task(cut())
        got = await wire.body_or_refusal(_request(upload, length=1000), 100, 30.0, reads)
        await task
        return _answer(got)
    status, _, message, headers = _run(main())
    assert (status, message, headers) == (503, DRAINED, wire.CLOSE)


def test_a_too_large_body_is_the_413():
    async def main() -> object:
        reads = wire.BodyReads()
        return _answer(await wire.body_or_refusal(
            _request(_Upload([b"x" * 60, b"x" * 60], whole=True)), 100, 30.0, reads))
    status, _, _, headers = _run(main())
    assert (status, headers) == (413, wire.CLOSE)
