"""A server of your own that embeds calexec's executor (issue 25; docs/embedding.md).

JSON lines over TCP on 127.0.0.1 with asyncio streams: no web framework, no extra dependency.
A connection sends requests, one JSON object per line, and reads the answer line by line::

    {"prompt": [3, 14, 15], "max_tokens": 8, "stop": [0], "timeout_s": 30}
        -> {"token": 42}  one line per token
        -> {"done": true, "finish_reason": "length" | "stop", "tokens": [42, ...]}
        or {"error": {"code": ..., "category": ..., "phase": ..., "raw": ..., "http_status": ...,
                      "grpc_code": ..., "message": ...}}   (Status.to_dict(); the tokens sent stay)
    {"op": "health"}  -> {"ready": true, "reasons": [], "lifecycle": "Ready"}

A request line is at most 1 MiB (``MAX_LINE_BYTES``: a prompt of the model's whole context
fits); a longer one is answered with a ``request.invalid`` error line and the connection closed.

Greedy decoding: a prefill reserving the KV of the whole request, then the executor's pre-armed
decode stream with greedy ahead. Every completion is awaited with ``JobHandle.wait_async``: no
thread waits for the device. The calls that may block (admission, a stream's submit and close,
``release_sequence``, ``start``, ``shutdown``) run on a fixed pool of control threads, one per
sequence id, so no call waits behind another generation's and no thread is made per token.

    python examples/asyncio_server.py [--port 0] [--sequences 4] [--grace 10] [--calbin PATH]
                                      [--device-config KNOBS]

It prints ``listening on 127.0.0.1:PORT``, serves until SIGTERM or SIGINT, then stops accepting,
lets the generations in progress finish within ``--grace`` seconds, shuts the executor down and
prints ``executor Stopped`` (exit 0) or ``executor <state>: <status>`` (exit 3).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import logging
import signal
import sys
import tempfile
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

import attrs
import numpy as np

from calexec.contracts.errors import Category
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin as synthetic
from calexec.machines.api import CompletionHandle, DecodeSteps, InferenceExecutor
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

log = logging.getLogger("asyncio_server")
T = TypeVar("T")
P = ParamSpec("P")
#: how long a finished generation waits for its cancelled last job before withholding its id
RELEASE_WAIT_S = 30.0
#: the longest request line read: a prompt as long as the model's context (40,960 ids of up
#: to 6 digits and a separator) fits; asyncio's default, 64 KiB, held ~10,000 ids
MAX_LINE_BYTES = 1 << 20
#: a token id is an int32 on the device (§6.3 checks it against the vocabulary)
TOKEN_ID_MAX = 2**31 - 1


class Refused(Exception):
    """A generation ended with a Status (the client gets ``{"error": status.to_dict()}``)."""

    def __init__(self, status: Status) -> None:
        super().__init__(str(status))
        self.status = status


@attrs.define
class _Run:
    """What one generation holds, for its finish: its sequence id, its last job, its stream,
    and a control-thread call still running when the generation was cancelled."""

    seq_id: int
    handle: CompletionHandle | None = None
    stream: DecodeSteps | None = None
    pending: asyncio.Future[Any] | None = None


class Embedding:
    """The executor inside an asyncio application: the sequence ids it owns, its control
    threads and one generation's path."""

    def __init__(self, executor: InferenceExecutor, sequences: int) -> None:
        self.ex = executor
        self.control = ThreadPoolExecutor(max_workers=sequences, thread_name_prefix="app-control")
        self.free: asyncio.Queue[int] = asyncio.Queue()
        for seq_id in range(1, sequences + 1):  # 0 is the executor's golden-run sequence
            self.free.put_nowait(seq_id)
        self.sequences = sequences
        self.withheld: set[int] = set()
        self.finishing: set[asyncio.Task[None]] = set()

    async def call(self, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        """A call that may block, on a control thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self.control, functools.partial(fn, *args, **kwargs))

    async def _blocking(self, run: _Run, fn: Callable[P, T], *args: P.args,
                        **kwargs: P.kwargs) -> T:
        """``call`` for a generation: if the generation is cancelled meanwhile the call still
        ends on its thread, and its result (a handle, a stream) goes to the finish."""
        pending: asyncio.Future[T] = asyncio.ensure_future(self.call(fn, *args, **kwargs))
        run.pending = pending
        value = await asyncio.shield(pending)
        run.pending = None
        return value

    async def generate(self, prompt: list[int], max_tokens: int, stop: frozenset[int],
                       deadline: float) -> AsyncGenerator[int, None]:
        """The greedy tokens of ``prompt``; raises ``Refused`` with the Status that ended it.
        Use it under ``contextlib.aclosing`` so that an early exit gives everything back."""
        try:  # (asyncio.timeout, not wait_for: a cancel never loses an id already taken)
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                seq_id = await self.free.get()
        except TimeoutError:
            raise Refused(Status.exhausted("sequences", Phase.ADMISSION, f"all {self.sequences} "
                                           "sequence ids in use until the deadline")) from None
        run = _Run(seq_id)
        try:
            request = InferenceRequest(
                seq_id=seq_id, kind=TaskKind.PREFILL_IDS, tokens=np.asarray(prompt, np.int32),
                positions=np.arange(len(prompt), dtype=np.int32), past_len=0, deadline=deadline,
                kv_reserve_len=len(prompt) + max_tokens)  # all its KV up front: no hold and wait
            run.handle = await self._blocking(run, self.ex.enqueue, request)
            result = await run.handle.wait_async(deadline)  # no thread waits for the device
            if isinstance(result, Status):
                raise Refused(result)
            token, produced = result.argmax, 1
            yield token
            if produced == max_tokens or token in stop:
                return
            run.stream = await self._blocking(
                run, self.ex.decode_stream, seq_id, result.kv_len, deadline,
                max_len=len(prompt) + max_tokens, greedy_ahead=True, stop_tokens=stop,
                max_steps=max_tokens - 1)
            while produced < max_tokens and token not in stop:
                step = await self._blocking(run, run.stream.submit, token)
                if isinstance(step, Status):
                    raise Refused(step)
                run.handle = step
                await step.wait_async(run.stream.deadline)
                # resolved: wait() takes the result at once; past the deadline it cancels the
                # job and closes the stream, which may wait a little: a control thread then
                result = (run.stream.wait() if step.done
                          else await self._blocking(run, run.stream.wait))
                if isinstance(result, Status):
                    raise Refused(result)
                token, produced = result.argmax, produced + 1
                yield token
        finally:
            task = asyncio.get_running_loop().create_task(self._finish(run))
            self.finishing.add(task)
            task.add_done_callback(self.finishing.discard)

    async def _finish(self, run: _Run) -> None:
        """Give the sequence id back once nothing of it runs: a control-thread call cut short
        by a cancel has ended, the last job is resolved (cancelled first: nobody takes its
        result), the stream is closed, the KV released on the executor. An id whose release
        fails for good is withheld, never reused."""
        if run.pending is not None:
            try:
                value = await run.pending
            except Exception:  # noqa: BLE001 - a bug of the call: log it, release anyway
                log.exception("sequence %d: a control call raised", run.seq_id)
                value = None
            if isinstance(value, DecodeSteps):
                run.stream = value
            elif isinstance(value, CompletionHandle):
                run.handle = value
        if run.handle is not None and not run.handle.done:
            run.handle.cancel()
            await run.handle.wait_async(time.monotonic() + RELEASE_WAIT_S)
        if run.stream is not None:
            await self.call(run.stream.close)  # waits (bounded) for a step fired ahead
        status = Status.OK
        for _ in range(3):  # kv.sequence_on_device (UNAVAILABLE): the device lets go later
            status = await self.call(self.ex.release_sequence, run.seq_id, 1.0)
            if status.ok or status.category != Category.UNAVAILABLE:
                break
        if status.ok:
            self.free.put_nowait(run.seq_id)
        else:
            log.warning("sequence %d withheld: %s", run.seq_id, status)
            self.withheld.add(run.seq_id)

    async def close(self, grace: float) -> Status:
        """After the generations ended: wait for their finishes, shut the executor down."""
        if self.finishing:
            await asyncio.wait(set(self.finishing), timeout=grace)
        status = await self.call(self.ex.shutdown, grace)
        self.control.shutdown(wait=True)
        return status


def _invalid(message: str) -> Status:
    return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE, message)


def parse(body: object) -> tuple[list[int], int, frozenset[int], float]:
    """(prompt, max_tokens, stop, deadline) of a request line; raises Refused naming a field."""
    if not isinstance(body, dict):
        raise Refused(_invalid("a request is a JSON object"))
    prompt, max_tokens = body.get("prompt"), body.get("max_tokens", 16)
    stop, timeout_s = body.get("stop", []), body.get("timeout_s", 30.0)
    if not (isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt)):
        raise Refused(_invalid("prompt: a non-empty list of token ids"))
    beyond = next((i for i, t in enumerate(prompt) if not 0 <= t <= TOKEN_ID_MAX), None)
    if beyond is not None:  # (np.asarray(prompt, np.int32) raised OverflowError on it)
        raise Refused(_invalid(f"prompt[{beyond}]={prompt[beyond]}: not a token id"))
    if type(max_tokens) is not int or max_tokens < 1:
        raise Refused(_invalid(f"max_tokens={max_tokens!r}: an int >= 1"))
    if not (isinstance(stop, list) and all(type(t) is int for t in stop)):
        raise Refused(_invalid("stop: a list of token ids"))
    if type(timeout_s) not in (int, float) or not 0 < timeout_s <= 3600:
        raise Refused(_invalid(f"timeout_s={timeout_s!r}: seconds in (0, 3600]"))
    return prompt, max_tokens, frozenset(stop), time.monotonic() + timeout_s


class JsonLineServer:
    """The TCP front: one task per connection, one generation at a time per connection."""

    def __init__(self, embedding: Embedding, host: str = "127.0.0.1", port: int = 0) -> None:
        self.embedding = embedding
        self.host, self.port = host, port
        self.server: asyncio.Server | None = None
        self.generations: set[asyncio.Task[None]] = set()
        self.connections: set[asyncio.Task[Any]] = set()
        self.draining = False

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, self.host, self.port,
                                                 limit=MAX_LINE_BYTES)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _send(self, writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
        writer.write(json.dumps(message).encode() + b"\n")
        await writer.drain()

    async def _connection(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()  # a connection handler runs in its own task
        if me is not None:
            self.connections.add(me)
        try:
            while line := await reader.readline():
                try:
                    body = json.loads(line)
                except ValueError:
                    body = None
                if isinstance(body, dict) and body.get("op") == "health":
                    reasons = self.embedding.ex.health()  # never blocks
                    await self._send(writer, {"ready": not reasons and not self.draining,
                                              "reasons": reasons,
                                              "lifecycle": self.embedding.ex.state})
                    continue
                task = asyncio.create_task(self._generation(body, writer))
                self.generations.add(task)
                task.add_done_callback(self.generations.discard)
                await task
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: its generation was cancelled with this task
        except ValueError:  # readline: a line longer than the limit; the rest is unread
            with contextlib.suppress(ConnectionError):
                await self._send(writer, {"error": _invalid(
                    f"a request line is longer than {MAX_LINE_BYTES} bytes").to_dict()})
        finally:
            if me is not None:
                self.connections.discard(me)
            writer.close()

    async def _generation(self, body: object, writer: asyncio.StreamWriter) -> None:
        tokens: list[int] = []
        try:
            if self.draining:
                raise Refused(Status.unavailable(Phase.ADMISSION, "the server is draining"))
            prompt, max_tokens, stop, deadline = parse(body)
            async with contextlib.aclosing(self.embedding.generate(
                    prompt, max_tokens, stop, deadline)) as generated:
                async for token in generated:
                    tokens.append(token)
                    await self._send(writer, {"token": token})
        except Refused as refused:
            await self._send(writer, {"error": refused.status.to_dict()})
            return
        reason = "stop" if tokens and tokens[-1] in stop else "length"
        await self._send(writer, {"done": True, "finish_reason": reason, "tokens": tokens})

    async def drain(self, grace: float) -> Status:
        """Stop accepting, let the generations in progress finish within ``grace`` (then
        cancel them), close the connections and shut the executor down."""
        end = time.monotonic() + grace
        self.draining = True
        if self.server is not None:
            self.server.close()
        if self.generations:
            await asyncio.wait(set(self.generations), timeout=grace)
        for task in (*self.generations, *self.connections):
            task.cancel()
        if self.connections:
            await asyncio.wait(set(self.connections), timeout=max(0.0, end - time.monotonic()))
        return await self.embedding.close(max(1.0, end - time.monotonic()))


async def serve(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="asyncio-server-") as tmp:
        calbin = args.calbin
        if calbin is None:  # the bundled emulator's synthetic model
            calbin = f"{tmp}/qwen3_synthetic.calbin"
            synthetic.write(calbin, synthetic.default_spec())
        executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                                  ExecutorConfig(calbin_path=calbin,
                                                 device_config=args.device_config))
        embedding = Embedding(executor, args.sequences)
        status = await embedding.call(executor.start)  # the golden warm-up blocks
        if not status.ok:
            print(f"executor did not start: {status}", flush=True)
            await embedding.close(1.0)
            return 3
        server = JsonLineServer(embedding, "127.0.0.1", args.port)
        await server.start()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        print(f"listening on 127.0.0.1:{server.port}", flush=True)
        await stop.wait()
        status = await server.drain(args.grace)
        print(f"executor {executor.state}" + ("" if status.ok else f": {status}"), flush=True)
        return 0 if status.ok and executor.state == "Stopped" else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=0, help="0: any free port (printed)")
    parser.add_argument("--sequences", type=int, default=4, help="KV sequence ids (and so "
                        "generations at once, and control threads)")
    parser.add_argument("--grace", type=float, default=10.0, help="drain and shutdown grace (s)")
    parser.add_argument("--calbin", help="default: the synthetic model, written to a temp dir")
    parser.add_argument("--device-config", default="", help="the runtime's device config (the "
                        "emulator's knobs, e.g. decode_us=2000)")
    return asyncio.run(serve(parser.parse_args(argv)))


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main())
