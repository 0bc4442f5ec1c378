"""Helpers shared by the server tests (no tests here): executors on the bundled emulator,
a uvicorn server on an ephemeral loopback port, the oracle's greedy tokens, metric lookup, an
ASGI app streaming to a client that leaves mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.fleet.edge import serve_relayed
from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress
from calexec.drivers.synthetic import calbin, oracle
from calexec.drivers.tools.chaos import LiveServer  # noqa: F401 - re-exported for the server tests
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

#: the model name ``calexec serve`` reports for the synthetic calbin (``--served-model-name``)
MODEL = "calexec-qwen3-synthetic"


def started_executor(tmp: Path, device_config: str = "",
                     executor_class: type[DeviceExecutor] = DeviceExecutor,
                     **config) -> DeviceExecutor:
    """A started executor (of ``executor_class``) serving the default synthetic calbin
    written into ``tmp``."""
    path = str(tmp / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = executor_class(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(calbin_path=path, device_config=device_config,
                                             **config))
    status = executor.start()
    if not status.ok:
        raise RuntimeError(f"executor did not start: {status}")
    return executor


@contextlib.contextmanager
def stepped_server(tmp: Path, **config) -> Iterator[tuple]:
    """(server, service, executor) of a loopback server (``ServerConfig(**config)``) on a
    fresh executor (``started_executor``); the device unstepped and the executor shut down
    at the end, whatever the test left stepped."""
    from calexec.drivers.serving.server import ServerConfig, create_app
    executor = started_executor(tmp)
    app = create_app(executor, ServerConfig(**config))
    try:
        with LiveServer(app) as server:
            yield server, app.state.service, executor
    finally:
        executor.device.emu.set_stepped(False)
        executor.shutdown(5.0)


def busy_engine(emu) -> int | None:
    """The emulator engine (0 or 1) that holds a job, or None."""
    return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)


def bos_tokenizer(path: Path) -> Path:
    """A WordLevel ``tokenizer.json`` written at ``path`` (returned) whose post-processor puts
    ``[BOS]`` (id 1) before every single text: ``hello`` 5, ``user`` 6, ``:`` 7,
    ``assistant`` 8, any other word ``[UNK]`` (0)."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, processors
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "[BOS]": 1, "hello": 5,
                                                 "user": 6, ":": 7, "assistant": 8},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="[BOS] $A",
                                                       special_tokens=[("[BOS]", 1)])
    tok.save(str(path))
    return path


@contextlib.contextmanager
def openai_server(tmp: Path, config=None, timeout: float = 60.0) -> Iterator[tuple]:
    """A started executor on the synthetic calbin behind ``create_app`` on a loopback uvicorn
    (ephemeral port), with an official ``openai`` client for it: yields ``(server, client,
    service)``; the server is stopped and its thread joined, the executor shut down (bounded)."""
    import openai

    from calexec.drivers.serving.server import ServerConfig, create_app

    executor = started_executor(tmp)
    try:
        app = create_app(executor, config if config is not None else ServerConfig())
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused",
                                   max_retries=0, timeout=timeout)
            yield server, client, app.state.service
    finally:
        executor.shutdown(5.0)


@pytest.fixture(scope="module", name="live")
def live_fixture(tmp_path_factory) -> Iterator[tuple]:
    """The fixture ``live``: ``openai_server`` for a whole test module, ``(server, client,
    service)``. A test module imports it (``from test_server_support import live_fixture``)
    under this name, so its tests' ``live`` argument shadows no import."""
    with openai_server(tmp_path_factory.mktemp("calbin")) as served:
        yield served


#: the official ``openai`` client's timeout (seconds) of ``sdk_client_fixture``
SDK_TIMEOUT_S = 10.0


@pytest.fixture(scope="module", name="client")
def sdk_client_fixture(tmp_path_factory) -> Iterator:
    """The fixture ``client``: the official ``openai`` client of an ``openai_server`` for a
    whole test module (timeout ``SDK_TIMEOUT_S``, no retries). Imported as ``live_fixture``
    is (``from test_server_support import sdk_client_fixture``)."""
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=SDK_TIMEOUT_S) as (_, sdk, _):
        yield sdk


def streamed_chat(client, **kwargs) -> tuple[str | None, list, str | None]:
    """``(content, [(name, arguments)], finish_reason)`` of a chat stream's deltas joined
    (``client``: an official ``openai`` client; ``kwargs``: the request's)."""
    content: str | None = None
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += (call.function.name or "") if call.function else ""
                entry[1] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[k]) for k in sorted(calls)], finish


@pytest.fixture(scope="module", name="executor")
def executor_fixture(tmp_path_factory) -> Iterator[DeviceExecutor]:
    """The fixture ``executor``: ``started_executor`` for a whole test module, shut down
    (bounded) after it. Imported as ``live_fixture`` is."""
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    yield executor
    executor.shutdown(5.0)


@contextlib.contextmanager
def admin_test_client(executor: DeviceExecutor, token: str) -> Iterator:
    """A ``TestClient`` of ``create_app(executor)`` with admin token ``token``, its server
    exceptions answered, not raised (a 500 is what a client saw)."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app

    app = create_app(executor, ServerConfig(admin_token=token))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def structured_answer(sdk, schema: dict, how: str, prompt: str = "hi") -> tuple[str, str]:
    """(the JSON text answered, finish_reason) of ``schema`` as a ``response_format``
    (``how``: "response_format") or as the parameters of a named tool's call (any other
    ``how``), asked of the official ``openai`` client ``sdk`` with ``prompt``."""
    messages = [{"role": "user", "content": prompt}]
    if how == "response_format":
        answer = sdk.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": "p",
                                                                    "schema": schema}})
        return answer.choices[0].message.content, answer.choices[0].finish_reason
    answer = sdk.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=120,
        tools=[{"type": "function", "function": {"name": "p", "parameters": schema}}],
        tool_choice={"type": "function", "function": {"name": "p"}})
    calls = answer.choices[0].message.tool_calls
    assert calls and len(calls) == 1, answer
    return calls[0].function.arguments, answer.choices[0].finish_reason


def oracle_tokens(prompt: list[int], n: int, seed: int = calbin.DEFAULT_SEED) -> list[int]:
    """The greedy continuation of ``prompt`` (n tokens) by the numpy oracle."""
    seq = oracle.OracleSequence(seed)
    seq.run(prompt)
    out = []
    for _ in range(n):
        token = seq.next_token()
        out.append(token)
        seq.run([token])
    return out


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """Value of the sample ``name`` with ``labels`` in a Prometheus exposition, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels or {}).items() <= sample.labels.items():
                return sample.value
    return None


def metric_total(text: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of the samples ``name`` whose labels include ``labels`` (0 when none): a
    counter asked by some of its labels (``metric_value`` answers the first matching series
    alone, which names one code of a category once several codes of it were counted)."""
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples
               if sample.name == name and (labels or {}).items() <= sample.labels.items())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (bounded) until true; AssertionError naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


def wait_serve_ready(proc, url: str, timeout: float = 30.0) -> None:
    """Poll ``url``'s ``/ready`` (bounded by ``timeout``) until it answers 200, for a
    ``calexec serve`` subprocess ``proc`` (``stderr`` piped): its stderr in the assertion if
    it exited first."""
    import httpx

    def up() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, proc.stderr.read().decode()
            return False
    wait_for(up, timeout=timeout, what="calexec serve to become ready")


def server_idle(service) -> bool:
    return (service.active == 0 and service.sequences.in_use == 0
            and service.releases_pending == 0)


def wait_device_idle(executor: DeviceExecutor, timeout: float) -> None:
    """Wait (bounded) until ``executor`` holds nothing: no job in flight or queued, no KV
    sequence or reserved block, no pending token, every buffer slot free."""
    def device_idle() -> bool:
        snap = executor.snapshot()
        slots = snap["slots"]
        return (snap["inflight"] == 0 and snap["queued"] == 0 and not snap["kv_sequences"]
                and snap["kv_blocks_reserved"] == 0 and snap["pending_tokens"] == 0
                and slots["Leased"] == 0 and slots["InFlight"] == 0 and slots["Quarantined"] == 0)
    wait_for(device_idle, timeout, "every slot free, no KV sequence or job left")


def slow_stream(*chunks: bytes) -> tuple[Callable, dict[str, bool]]:
    """An ASGI app (a sibling replica's, say) that reads the request, sends a 200 and
    ``chunks`` (more to come), then waits for the next message: and the state it fills in,
    ``saw_disconnect`` (that message was ``http.disconnect``) and ``finished``."""
    state = {"saw_disconnect": False, "finished": False}

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for body in chunks:
            await send({"type": "http.response.body", "body": body, "more_body": True})
        message = await receive()  # blocks until the relay is stopped
        state["saw_disconnect"] = message["type"] == "http.disconnect"
        state["finished"] = True
    return app, state


def run_leaving_client(app, *, send_raises: bool = False, timeout: float = 10.0) -> list[dict]:
    """Run ``app`` (bounded by ``timeout``) on a ``POST /v1/completions`` of ``{}`` whose
    client leaves once the first body chunk arrived: ``receive`` then says ``http.disconnect``;
    with ``send_raises`` a later ``send`` raises ``ConnectionResetError`` (ASGI 2.4: the
    connection is closed), else it is recorded too. Returns the messages the client got."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b""}
    sent: list[dict] = []

    async def go():
        gone = asyncio.Event()
        messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if send_raises and gone.is_set():
                raise ConnectionResetError("the client's connection is closed")
            sent.append(message)
            if message.get("body"):
                gone.set()  # the client leaves once the first chunk arrived
        await asyncio.wait_for(app(scope, receive, send), timeout)
    asyncio.run(go())
    return sent


SVG_ACTIVE = re.compile(r"<title>(\w+)</title>\s*<\w+ fill=\"turquoise\"")


class ServeLikeServer(LiveServer):
    """``LiveServer`` with the uvicorn configuration ``calexec serve`` runs the app with
    (``server.uvicorn_config``: connections a cut response aborts). ``small_buffers``: its
    connections buffer about 12 KB of unsent response (a 4 KiB kernel send buffer, set on the
    listening socket, which they inherit, autotuning off; a 4 KiB transport high-water mark),
    so a client that stops reading stalls the server's sends after some 100 tokens, as it does
    after megabytes with the defaults."""

    def __init__(self, app, small_buffers: bool = False) -> None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        from calexec.drivers.serving.server import abortable, uvicorn_config

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        extra = {}
        if small_buffers:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)

            class SmallBuffers(abortable(AutoHTTPProtocol)):
                def connection_made(self, transport) -> None:
                    transport.set_write_buffer_limits(high=4096)
                    super().connection_made(transport)
            extra["http"] = SmallBuffers
        listener.bind(("127.0.0.1", 0))
        self.server = uvicorn.Server(uvicorn_config(app, port=0, log_level="warning",
                                                    access_log=False, **extra))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [listener]},
                                       name="uvicorn-serve", daemon=True)


@pytest.fixture(scope="module", name="serve_like")
def serve_like_fixture(tmp_path_factory) -> Iterator[ServeLikeServer]:
    """The fixture ``serve_like``: the app of ``started_executor`` on the uvicorn
    configuration ``calexec serve`` runs (its HTTP protocol, ``ServeLikeServer``) for a whole
    test module. Imported as ``live_fixture`` is."""
    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with ServeLikeServer(create_app(executor)) as server:
            yield server
    finally:
        executor.shutdown(5.0)


@contextlib.contextmanager
def chaos_server(tmp: Path) -> Iterator[tuple]:
    """``tools/chaos.py``'s executor (the emulator's faults for the test to arm) behind a
    ``ServeLikeServer`` and an ``httpx.Client`` of it (30 s timeout): ``(emulator, service,
    client)``. At the end the emulator's faults are cleared and the executor is shut down."""
    import httpx

    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.tools.chaos import chaos_executor

    executor = chaos_executor(tmp)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            yield emu, app.state.service, http
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)


def stalled_client(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A raw loopback client with a 4 KiB receive buffer that sends ``body`` and never reads
    (the caller closes it)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
    sock.settimeout(10.0)
    sock.connect(("127.0.0.1", port))
    payload = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json"
                 f"\r\ncontent-length: {len(payload)}\r\n\r\n".encode() + payload)
    return sock


def read_until_closed(sock: socket.socket, limit: int = 64 << 20) -> tuple[bytes, str]:
    """Everything the server still sends on ``sock`` and how the connection ended: "eof",
    "reset", or "open" when it still sent (or stayed silent but open) after ``limit`` bytes or
    a 10 s silence (the socket's timeout)."""
    data = bytearray()
    try:
        while len(data) < limit:
            chunk = sock.recv(1 << 16)
            if not chunk:
                return bytes(data), "eof"
            data += chunk
    except ConnectionResetError:
        return bytes(data), "reset"
    except TimeoutError:
        pass
    return bytes(data), "open"


def send_raw(port: int, raw: bytes, timeout: float = 30.0) -> tuple[bytes, str]:
    """``raw`` on a fresh loopback connection to ``port``; what came back until the server
    closed it, and how (``read_until_closed``; ``timeout`` of silence: "open")."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(raw)
        return read_until_closed(sock)


def split_head(data: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """The status line, the headers (lower-case names) and the rest of a raw response."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return lines[0], headers, rest


def responses(data: bytes) -> list[tuple[bytes, dict[str, str], bytes]]:
    """The responses in ``data`` (each framed by its Content-Length): status line, headers
    (lower-case names), body."""
    found = []
    while data:
        status, headers, rest = split_head(data)
        length = int(headers.get("content-length", len(rest)))
        found.append((status, headers, rest[:length]))
        data = rest[length:]
    return found


def stream_tool_calls(text: str) -> tuple[list[dict], list[str], object]:
    """Feed ``text`` to a ``grammar.ToolCallStream`` one character at a time, as a stream of
    tokens would, then end it: the deltas, each call's streamed arguments joined (by call
    index, in index order), and the stream itself."""
    from calexec.drivers.serving import grammar

    stream = grammar.ToolCallStream()
    deltas = [d for ch in text for d in stream.feed(ch)] + stream.feed("", final=True)
    calls: dict[int, str] = {}
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            calls[piece["index"]] = calls.get(piece["index"], "") + piece["function"]["arguments"]
    return deltas, [calls[i] for i in sorted(calls)], stream


@contextlib.contextmanager
def draining_with_a_stream(tmp: Path, token: str) -> Iterator[tuple]:
    """A server (admin token ``token``) whose ``POST /admin/drain?grace=30`` waits for one
    stream the helper holds open: yields ``(server, executor, service)`` while it drains.
    After the block the drain must still be waiting (nothing the block sent ended it or
    started anything); then the stream is let go and the drain ends (bounded); the executor
    is shut down either way."""
    import httpx

    from calexec.drivers.serving.server import ServerConfig, create_app

    executor = started_executor(tmp, device_config="decode_us=20000")
    app = create_app(executor, ServerConfig(admin_token=token))
    service = app.state.service
    stop = threading.Event()

    def stream(url: str) -> None:  # holds the drain open until the block ends
        with httpx.Client(timeout=30) as http, http.stream(
                "POST", f"{url}/v1/completions",
                json={"prompt": [1, 2], "max_tokens": 500, "stream": True}) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return
    try:
        with ServeLikeServer(app) as server:
            holder = threading.Thread(target=stream, args=(server.url,), daemon=True)
            holder.start()
            wait_for(lambda: service.active == 1, what="the stream running")
            r = httpx.post(f"{server.url}/admin/drain?grace=30",
                           headers={"Authorization": f"Bearer {token}"}, timeout=10)
            assert r.status_code == 202, r.text
            yield server, executor, service
            assert service.active == 1 and service.drain_status is None  # still draining
            stop.set()
            holder.join(30)
            wait_for(lambda: service.drain_status is not None, timeout=30, what="drain")
    finally:
        stop.set()
        executor.shutdown(5.0)


def sent_with_and_without_expect(port: int, head: bytes, payload: bytes
                                 ) -> list[tuple[bytes, str]]:
    """``head`` (a request line and headers, without the blank line) sent twice on fresh
    connections: with ``Expect: 100-continue`` and no body (a client waiting for the 100),
    then with ``Connection: close`` and ``payload``; what came back each time until the
    server closed, and how (``read_until_closed``)."""
    out = []
    for expect in (b"expect: 100-continue\r\n", b"connection: close\r\n"):
        whole = head + expect + b"content-length: %d\r\n\r\n" % len(payload)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            sock.sendall(whole if b"expect" in expect else whole + payload)
            out.append(read_until_closed(sock))
    return out


async def dies_after(stream, chunks: int):
    """``stream`` until ``chunks`` non-empty body chunks went out; then its process "dies"."""
    sent = 0
    try:
        async for message in stream:
            if message["type"] == "http.response.body" and message.get("body"):
                if sent == chunks:
                    raise RuntimeError("ActorDiedError: the replica's process died")
                sent += 1
            yield message
    finally:
        await stream.aclose()


def through_ingress(app, path: str, body: dict, die_after: int, progress: bool = True
                    ) -> tuple[bytes, list[dict]]:
    """(what the client got, the calls the ingress made) of ``body`` through the fleet ingress,
    its first replica dying after ``die_after`` body chunks. ``progress`` False: the replicas
    report no progress (as one from before a request kind reported any)."""
    calls: list[dict] = []

    def call(request):
        calls.append(request)
        if not progress:
            request = {key: value for key, value in request.items() if key != "progress"}
        stream = serve_relayed(app, request)
        return dies_after(stream, die_after) if len(calls) == 1 else stream

    ingress = FleetIngress(call, FailoverSettings(backoff_s=0.001))
    sent: list[dict] = []

    async def go():
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
        given = asyncio.Event()

        async def receive():
            if not given.is_set():
                given.set()
                return {"type": "http.request", "body": json.dumps(body).encode(),
                        "more_body": False}
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            sent.append(message)
        await asyncio.wait_for(ingress(scope, receive, send), timeout=60)
    asyncio.run(go())
    assert sum(m["type"] == "http.response.start" for m in sent) == 1
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"), calls
