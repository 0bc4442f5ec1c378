"""Stop 74 (lead): behind the fleet ingress, ``POST /admin/cancel/{id}`` goes to the replica
running the request it names (drivers/fleet/ingress.py ``FleetIngress.cancel_target``, the
router's ``request["replica"]`` pin). Until stop 74 it went to the router's choice, one
replica, and answered 404 whenever the request ran on another: with two replicas, half the
cancels of an operator missed.

Two real servers (each its own executor on the bundled emulator) behind one ingress served by
uvicorn on a loopback port; the ingress's ``call`` alternates between them as a router without
a pin would (so an unpinned cancel reaches the other replica) and follows a pin. Every wait is
a bounded poll; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.calrt.runtime import Stage  # noqa: E402
from calexec.drivers.fleet.edge import serve_relayed  # noqa: E402
from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress  # noqa: E402
from calexec.drivers.serving.handoff import PROGRESS_TYPE  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import LiveServer, started_executor, wait_for  # noqa: E402

TOKEN = "lead74-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}
NAMES = ("r1", "r2")
WAIT_S = 30.0


class Fleet:
    """Two replicas' apps and the calls the ingress made: ``(replica, method, path, pin)``."""

    def __init__(self, apps: dict, executors: dict) -> None:
        self.apps, self.executors = apps, executors
        self.calls: list[tuple[str, str, str, str | None]] = []

    def __call__(self, request: dict):
        pin = request.get("replica")
        name = pin if pin in self.apps else NAMES[len(self.calls) % len(NAMES)]
        self.calls.append((name, request["method"], request["path"], pin))
        app = self.apps[name]

        async def stream():
            if request.get("progress"):  # as ray_serve's relay_http names its replica
                yield {"type": PROGRESS_TYPE, "replica": name}
            async for message in serve_relayed(app, request):
                yield message
        return stream()

    def service(self, name: str):
        return self.apps[name].state.service


@contextlib.contextmanager
def fleet(tmp_path, **config) -> Iterator[tuple[LiveServer, Fleet]]:
    executors = {}
    try:
        for name in NAMES:
            (tmp_path / name).mkdir()
            executors[name] = started_executor(tmp_path / name)
        apps = {name: create_app(ex, ServerConfig(admin_token=TOKEN, **config))
                for name, ex in executors.items()}
        replicas = Fleet(apps, executors)
        with LiveServer(FleetIngress(replicas, FailoverSettings())) as server:
            yield server, replicas
    finally:
        for executor in executors.values():
            executor.device.emu.set_stepped(False)
            executor.shutdown(5.0)


def cancel(url: str, ident: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/cancel/{ident}", headers=AUTH, timeout=WAIT_S)


def assert_back(service) -> None:
    wait_for(lambda: service.active == 0 and service.sequences.in_use == 0
             and service.releases_pending == 0, WAIT_S, "every sequence id back")
    assert service.admission.waiting == 0


def test_a_cancel_by_x_request_id_reaches_the_replica_where_the_request_waits(tmp_path):
    """A request waiting for admission on r1 (its one sequence id held), cancelled through
    the ingress by its ``X-Request-Id``: the cancel is pinned to r1 (202) and the client
    gets 409 ``request.aborted``; without the pin it reached r2 and answered 404."""
    with fleet(tmp_path, max_sequences=1) as (server, replicas):
        r1 = replicas.service("r1")
        held = r1.sequences.acquire()
        out: list = []
        thread = threading.Thread(target=lambda: out.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4},
            headers={"x-request-id": "fleet74-wait"}, timeout=WAIT_S)))
        thread.start()
        wait_for(lambda: r1.admission.waiting == 1, WAIT_S, "the request waiting on r1")
        answer = cancel(server.url, "fleet74-wait")
        assert answer.status_code == 202, answer.text
        assert answer.json()["x_request_id"] == "fleet74-wait"
        assert replicas.calls[-1] == ("r1", "POST", "/admin/cancel/fleet74-wait", "r1")
        thread.join(WAIT_S)
        assert out[0].status_code == 409, out[0].text
        assert out[0].json()["error"]["code"] == "request.aborted"
        r1.sequences.release(held)
        assert_back(r1)


def test_a_stream_is_cancelled_through_the_ingress_by_its_response_id(tmp_path):
    """A stream on r1 held by its stepped emulator after its first event, cancelled through
    the ingress by the response id its chunks carry: pinned to r1, 202, and the stream ends
    with the ``request.aborted`` error event; r1's sequence ids come back."""
    with fleet(tmp_path) as (server, replicas):
        emu = replicas.executors["r1"].device.emu
        assert emu.set_stepped(True) == 0
        lines: list[str] = []

        def read() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=WAIT_S,
                              json={"prompt": [5, 6, 7], "max_tokens": 40,
                                    "stream": True}) as response:
                for line in response.iter_lines():
                    lines.append(line)
        thread = threading.Thread(target=read)
        thread.start()

        def busy() -> int | None:
            return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)

        def first_event() -> dict | None:
            return next((json.loads(line[6:]) for line in list(lines)
                         if line.startswith("data: {")), None)
        for _ in range(8):  # (bounded: the prefill, then the first token's event)
            wait_for(lambda: busy() is not None or first_event() is not None, WAIT_S,
                     "a job on r1's device or the first event")
            if first_event() is not None:
                break
            assert emu.step(busy(), Stage.JOB)[0] == 0
        ident = first_event()["id"]
        wait_for(lambda: busy() is not None, WAIT_S, "the next job on r1's device")
        answer = cancel(server.url, ident)
        assert answer.status_code == 202, answer.text
        assert answer.json()["response_ids"] == [ident]
        assert replicas.calls[-1][0] == "r1" and replicas.calls[-1][3] == "r1"
        assert emu.set_stepped(False) == 0
        thread.join(WAIT_S)
        assert not thread.is_alive()
        last = json.loads(next(line[6:] for line in reversed(lines) if line.startswith("data: {")))
        assert last["error"]["code"] == "request.aborted", lines[-3:]
        assert "data: [DONE]" not in lines
        assert_back(replicas.service("r1"))


def test_a_cancel_the_ingress_cannot_place_goes_to_the_router_s_choice(tmp_path):
    """An id no request in progress here has: no pin (the router's choice), the replica's
    404, which says the ingress could not place it and asked one replica."""
    with fleet(tmp_path) as (server, replicas):
        answer = cancel(server.url, "nothing-74")
        assert answer.status_code == 404, answer.text
        assert replicas.calls[-1][3] is None
        assert "fleet ingress" in answer.json()["error"]["message"]


# ---- the ingress alone: fake replicas (no device) --------------------------------------------
def test_an_id_naming_requests_on_two_replicas_is_not_pinned():
    """The same ``X-Request-Id`` sent with one request to each replica: a cancel by it is
    not pinned to either (the router's choice; the ingress does not answer for the
    replicas), while a response id naming one of them is pinned to its replica."""
    calls: list[str | None] = []
    release: list[asyncio.Event] = []
    running: list[asyncio.Event] = []

    def call(request: dict):
        pin = request.get("replica")
        calls.append(pin)
        name = f"r{len(calls)}"

        async def stream():
            if request["path"].startswith("/admin/cancel/"):
                yield {"type": "http.response.start", "status": 202, "headers": []}
                yield {"type": "http.response.body", "body": b"{}", "more_body": False}
                return
            gate, up = asyncio.Event(), asyncio.Event()
            release.append(gate)
            running.append(up)
            yield {"type": PROGRESS_TYPE, "replica": name}
            yield {"type": PROGRESS_TYPE, "seed": 1, "id": f"cmpl-{name}", "created": 1,
                   "prompt_tokens": 1}
            up.set()
            await gate.wait()
            yield {"type": "http.response.start", "status": 200, "headers": []}
            yield {"type": "http.response.body", "body": b"{}", "more_body": False}
        return stream()

    ingress = FleetIngress(call, FailoverSettings())

    async def request(path: str, headers: list) -> None:
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                body = b"" if "cancel" in path else json.dumps(
                    {"prompt": [1], "max_tokens": 1}).encode()
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()

        async def send(message):
            pass
        scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
                 "headers": headers, "http_version": "1.1"}
        await asyncio.wait_for(ingress(scope, receive, send), timeout=WAIT_S)

    async def go() -> None:
        same = [(b"content-type", b"application/json"), (b"x-request-id", b"twice")]
        generations = [asyncio.ensure_future(request("/v1/completions", same))
                       for _ in range(2)]
        for _ in range(1000):  # (bounded: both running)
            if len(running) == 2 and all(up.is_set() for up in running):
                break
            await asyncio.sleep(0.01)
        await request("/admin/cancel/twice", [])
        await request("/admin/cancel/cmpl-r2", [])
        for gate in release:
            gate.set()
        await asyncio.gather(*generations)
    asyncio.run(go())
    assert calls == [None, None, None, "r2"], calls


def test_a_drain_grace_of_minus_zero_is_answered_as_zero(tmp_path):
    """``POST /admin/drain?grace=-0`` is a drain of grace 0, answered ``"grace": 0.0`` (it
    was ``-0.0``, and the log said ``grace -0s``)."""
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        with LiveServer(app) as server:
            answer = httpx.post(f"{server.url}/admin/drain?grace=-0", headers=AUTH,
                                timeout=WAIT_S)
            assert answer.status_code == 202, answer.text
            assert b'"grace":0.0' in answer.content, answer.text
    finally:
        executor.shutdown(5.0)
