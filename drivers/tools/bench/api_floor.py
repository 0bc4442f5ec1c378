"""The ``api_process_floor`` side of ``calexec bench server`` (issue 28): the ceiling of the
layout vLLM uses, an API process of its own in front of the executor's process.

Two halves:

* :class:`EngineSocket`, in the bench's process beside the executor: a Unix socket whose
  connections each carry one request at a time, framed as a 4-byte little-endian length and a
  JSON object ``{"prompt": [ids], "max_tokens": M}``; each is answered with
  ``{"tokens": [ids]}`` (or ``{"error": text}``) after the request ran straight through the
  executor (what the benchmark's direct side runs, in the connection's thread).
* this module run as a process, ``python -m calexec.drivers.tools.bench.api_floor --socket
  PATH``: uvicorn and FastAPI on 127.0.0.1 (an ephemeral port, printed as the first line of
  stdout) whose ``/v1/completions`` parses the same kind of pydantic body as the
  ``http_floor`` app, sends it over a pooled connection to the socket, and answers the tokens
  as a completion. It exits when its stdin closes (the bench ended) or after
  ``--max-seconds``. It ignores SIGINT: a Ctrl-C at the terminal reaches the whole process
  group, and stopping the run is the bench's (it closes the stdin), not a traceback here.

What it leaves out is exactly what the in-process server adds beyond HTTP: admission and the
waiting queue, sequence ownership, resumes, decode bursts and streams, metrics, stop strings,
sampling. So its ratio to the direct side is an upper bound for an API process split, not a
figure of a server that exists: it says how far that layout could take the server before any
of that work is put back.
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

from calexec import cliargs

#: the largest frame either half reads (a request of a few hundred ids is far below it)
MAX_FRAME = 1 << 20
#: the API process's own bound on its life (s) when nobody closes its stdin
DEFAULT_MAX_SECONDS = 3600.0

_HEAD = struct.Struct("<I")


class FrameError(ValueError):
    """A frame that is not a length-prefixed JSON object of at most ``MAX_FRAME`` bytes."""


def encode(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":")).encode()
    if len(data) > MAX_FRAME:
        raise FrameError(f"frame of {len(data)} bytes: more than {MAX_FRAME}")
    return _HEAD.pack(len(data)) + data


def decode_body(data: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError:
        raise FrameError(f"a frame that is not JSON: {data[:80]!r}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"a frame that is not a JSON object: {data[:80]!r}")
    return obj


def frame_length(head: bytes) -> int:
    (size,) = _HEAD.unpack(head)
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes announced: more than {MAX_FRAME}")
    return int(size)


def _read_exactly(conn: socket.socket, size: int) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = conn.recv(size - got)
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def check_request(obj: dict[str, Any]) -> tuple[list[int], int]:
    """The request's prompt and max_tokens; FrameError naming the bad field and value."""
    prompt, max_tokens = obj.get("prompt"), obj.get("max_tokens")
    if (not isinstance(prompt, list) or not prompt
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise FrameError(f"prompt={str(prompt)[:80]}: must be a non-empty list of token ids")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise FrameError(f"max_tokens={max_tokens!r}: must be an integer >= 1")
    return prompt, max_tokens


class EngineSocket:
    """The executor's half: a Unix socket at ``path`` answering each request with
    ``run(prompt, max_tokens)`` (the tokens) in the connection's own thread. A failure of
    ``run`` is answered as ``{"error": text}``; a bad frame closes its connection.
    :meth:`close` ends the listener and every connection and joins their threads (bounded)."""

    def __init__(self, path: str, run: Callable[[list[int], int], list[int]]) -> None:
        self.path, self._run = path, run
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(256)
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._acceptor = threading.Thread(target=self._accept, name="api-floor-accept",
                                          daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed by close()
                return
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                thread = threading.Thread(target=self._serve, args=(conn,),
                                          name="api-floor-conn", daemon=True)
                live = [i for i, t in enumerate(self._threads) if t.is_alive()]
                self._conns = [self._conns[i] for i in live] + [conn]  # (ended ones dropped)
                self._threads = [self._threads[i] for i in live] + [thread]
                thread.start()  # (under the lock: close() never joins an unstarted thread)

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                head = _read_exactly(conn, _HEAD.size)
                if head is None:
                    return
                body = _read_exactly(conn, frame_length(head))
                if body is None:
                    return
                prompt, max_tokens = check_request(decode_body(body))
                try:
                    reply: dict[str, Any] = {"tokens": [int(t) for t in
                                                        self._run(prompt, max_tokens)]}
                except Exception as exc:  # noqa: BLE001 - answered to the API process
                    reply = {"error": f"{type(exc).__name__}: {exc}"}
                conn.sendall(encode(reply))
        except (OSError, FrameError):
            return  # a closed or broken connection, a bad frame: this connection ends
        finally:
            conn.close()

    def close(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        try:  # (on Linux, close alone does not wake a thread blocked in accept)
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout)
        for thread in threads:
            thread.join(timeout)


def floor_body() -> Any:
    """The body model of the floor apps (``http_floor``, ``api_process_floor``): the same
    kind of pydantic body as the server's, reduced to what the benchmark sends."""
    import pydantic

    class Body(pydantic.BaseModel):
        prompt: list[int]
        max_tokens: int = 16
        temperature: float | None = None
        stream: bool = False
    return Body


def floor_completion(model: str, prompt_tokens: int, tokens: list[int]) -> dict[str, Any]:
    """A floor app's answer: a completion of ``tokens`` in OpenAI's shape."""
    import time

    return {"id": f"cmpl-{model}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [{
                "index": 0, "text": "x" * len(tokens), "logprobs": None,
                "finish_reason": "length", "token_ids": tokens}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                      "total_tokens": prompt_tokens + len(tokens)}}


def create_app(path: str) -> Any:
    """The API process's app: ``/v1/completions`` over pooled connections to ``path``."""
    import asyncio

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    Body = floor_body()
    app = FastAPI()
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def ask(request: dict[str, Any]) -> dict[str, Any]:
        reader, writer = idle.pop() if idle else await asyncio.open_unix_connection(path)
        try:
            writer.write(encode(request))
            size = frame_length(await reader.readexactly(_HEAD.size))
            reply = decode_body(await reader.readexactly(size))
        except BaseException:
            writer.close()  # a connection in an unknown state is not reused
            raise
        idle.append((reader, writer))
        return reply

    async def completions(body: Any) -> JSONResponse:
        try:
            reply = await ask({"prompt": body.prompt, "max_tokens": body.max_tokens})
        except (OSError, asyncio.IncompleteReadError, FrameError) as exc:
            return JSONResponse({"error": {"message": f"engine socket {path}: {exc}",
                                           "type": "engine_unavailable"}}, status_code=502)
        if "error" in reply:
            return JSONResponse({"error": {"message": str(reply["error"]),
                                           "type": "internal_error"}}, status_code=500)
        tokens = [int(t) for t in reply["tokens"]]
        return JSONResponse(floor_completion("api-floor", len(body.prompt), tokens))
    completions.__annotations__["body"] = Body  # (a local class: FastAPI gets the class)
    app.post("/v1/completions")(completions)
    return app


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="calexec-bench-api-floor", description=__doc__)
    parser.add_argument("--socket", required=True, help="the engine's Unix socket")
    # (calexec's seconds: float() also read "1_0" as 10 and "٣" as 3 until stop 74)
    parser.add_argument("--max-seconds", type=cliargs.seconds, default=DEFAULT_MAX_SECONDS,
                        help=f"exit after this long at the latest (default {DEFAULT_MAX_SECONDS:g})")
    args = parser.parse_args(argv)
    import asyncio

    import uvicorn

    class FloorServer(uvicorn.Server):
        """uvicorn, but a SIGINT (a Ctrl-C at the bench's terminal) is not its to act on:
        uvicorn shut down, then raised the signal again, a ``KeyboardInterrupt`` traceback
        under the bench's own ``interrupted`` line."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if sig != signal.SIGINT:
                super().handle_exit(sig, frame)

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # (restored by uvicorn after it serves)
    server = FloorServer(uvicorn.Config(create_app(args.socket), host="127.0.0.1", port=0,
                                        log_level="warning", access_log=False))

    async def serve() -> None:
        task = asyncio.create_task(server.serve())
        loop = asyncio.get_running_loop()
        stdin_closed = loop.create_future()

        def closed() -> None:
            if not stdin_closed.done():
                stdin_closed.set_result(None)

        def watch_stdin() -> None:  # a daemon thread: the process never waits for it
            sys.stdin.read()  # returns at EOF: the bench closed it or ended
            loop.call_soon_threadsafe(closed)
        threading.Thread(target=watch_stdin, name="api-floor-stdin", daemon=True).start()
        while not server.started:
            if task.done():
                return
            await asyncio.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        print(f"http://127.0.0.1:{port}", flush=True)
        await asyncio.wait([stdin_closed, task], timeout=args.max_seconds,
                           return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await task
    asyncio.run(serve())
    return 0


if __name__ == "__main__":  # pragma: no cover - run as a process by bench server
    sys.exit(main(sys.argv[1:]))
