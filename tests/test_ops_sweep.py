"""The operational surface as an SRE meets it (stop 40).

- the fleet ingress (drivers/fleet/ingress.py) and its clients: one whose connection is gone
  (the server's ``send`` raises), one that stops reading (``send`` blocks), a replica that
  never answers: each is cut within the request's deadline + slack, the replica's call
  stopped, no failover counted; a draining fleet still forwards its liveness and metrics
  probes;
- ``calexec serve`` as a process: a second signal that cuts a running stream exits 3, not 0;
  the startup warnings about an open ``--host`` without ``--api-key`` and an admin token file
  its group or others can read;
- the API key: an unknown ``/v1`` route or method asked without it is a 401, as vLLM answers.

The fleet cases drive the ingress as tests/test_fleet_ingress.py does (plain async generators
as replicas, no Ray, no device); the ``serve`` cases run ``calexec serve`` in a child process
on loopback, bounded, killed at the end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading

import httpx

from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress
from calexec.drivers.serving.handoff import PROGRESS_TYPE
from test_fleet_ingress import BODY, Client, Replica, Router, chunk, run
from test_server_support import free_port, run_leaving_client, slow_stream, wait_for


class GoneClient(Client):
    """A client whose connection is gone after ``leave_after`` body bytes: the server's
    ``send`` then raises (ASGI 2.4: "a server-specific subclass of OSError" when sending on
    a closed connection; hypercorn, granian and Ray Serve's proxy do), and ``receive`` says
    ``http.disconnect``."""

    async def send(self, message: dict) -> None:
        if self.left.is_set():
            raise ConnectionResetError("the client's connection is closed")
        await super().send(message)


def fleet(*replicas: Replica) -> tuple[FleetIngress, Router]:
    router = Router(*replicas)
    return FleetIngress(router, FailoverSettings(backoff_s=0.001, retry_after_s=2)), router


def test_a_send_to_a_client_that_left_stops_the_replica_and_is_no_failover():
    gate = asyncio.Event()
    gate.set()  # the replica streams at full speed
    r1, r2 = Replica("r1", gate=gate), Replica("r2")
    app, router = fleet(r1, r2)

    async def scenario():
        client = await GoneClient(BODY, leave_after=len(chunk(0) + chunk(1))).run(app)
        return client, r1.closed  # (before asyncio.run closes what was left open)
    client, stopped = asyncio.run(scenario())
    assert client.content == chunk(0) + chunk(1)
    # the replica's generation was stopped (its sequence comes back), not left running...
    assert stopped and not r1.finished
    # ...and a client that left is no replica death: nothing counted, no sibling started
    assert app.failovers == {} and router.calls == ["r1"] and not r2.requests


def probe(app: FleetIngress, method: str, path: str) -> Client:
    """One request of ``method`` to ``path`` (``Client`` sends POST)."""
    async def as_method(scope, receive, send):
        await app({**scope, "method": method}, receive, send)
    return run(as_method, Client(path=path))


def test_a_draining_fleet_still_answers_its_liveness_and_metrics_probes():
    """A single server keeps /health 200 while it drains (docs/server.md "Drain": a liveness
    probe must not kill a process finishing its work); the fleet's ingress refused every
    request, /health and /metrics included, for the whole --grace."""
    r1 = Replica("r1")
    app, router = fleet(r1)
    app.draining = True  # as FleetIngress.drain sets it
    for method, path in (("GET", "/health"), ("HEAD", "/health"), ("GET", "/metrics")):
        answer = probe(app, method, path)
        assert answer.starts[0]["status"] == 200, (method, path)
    assert len(router.calls) == 3  # forwarded to a replica, as when not draining
    # what admits work, and readiness, are still refused at the ingress: 503 + Retry-After
    for method, path in (("GET", "/ready"), ("POST", "/v1/completions"),
                         ("POST", "/admin/reload")):
        answer = probe(app, method, path)
        assert answer.starts[0]["status"] == 503 and answer.header(b"retry-after") == b"2"
    assert len(router.calls) == 3



class StoppedReader(Client):
    """A client that stops reading after ``leave_after`` body bytes without closing its
    connection: the server's ``send`` then blocks (its transport's buffer is full) for ever."""

    async def gone(self) -> None:
        await asyncio.Event().wait()  # it never disconnects either

    async def send(self, message: dict) -> None:
        if self.leave_after is not None and len(self.content) >= self.leave_after:
            await asyncio.Event().wait()  # its socket buffer is full: the send waits
        self.messages.append(message)


def test_a_client_that_stops_reading_is_cut_at_its_deadline_by_the_ingress(caplog):
    """A single server cuts a stream whose client stopped reading at the request's deadline
    + slack (docs/server.md); the fleet's ingress waited in its send for ever: the request
    stayed active (a fleet drain then waited its whole grace and exited 3) and the replica's
    stream was never stopped. Judged by what the ingress says it waited (at most the
    deadline + slack), not by a wall-clock threshold (a loaded host is slow, not wrong)."""
    caplog.set_level(logging.INFO, logger="calexec.fleet_ingress")
    gate = asyncio.Event()
    gate.set()
    r1, r2 = Replica("r1", gate=gate), Replica("r2")
    router = Router(r1, r2)
    app = FleetIngress(router, FailoverSettings(backoff_s=0.001, deadline_slack_s=0.2))

    async def scenario():
        client = await StoppedReader({**BODY, "timeout": 0.5}, leave_after=len(chunk(0))).run(app)
        return client, r1.closed
    client, stopped = asyncio.run(scenario())  # (Client.run gives up after 10 s)
    # the send was bounded by the deadline (0.5 s) + slack (0.2 s), not the client's whim
    waits = [float(m.group(1)) for r in caplog.records
             if (m := re.search(r"client left while replica r1 answered \(the client read "
                                r"nothing for ([0-9.]+) s, past its deadline\)", r.getMessage()))]
    assert len(waits) == 1 and waits[0] <= 0.7, [r.getMessage() for r in caplog.records]
    assert client.content == chunk(0) and stopped and not r1.finished
    assert app.active == 0 and app.failovers == {} and router.calls == ["r1"]



class Frozen:
    """A replica whose process stopped (SIGSTOP, a partition) or a router with no replica to
    place the call on (Ray Serve queues it until one comes up): the call yields nothing more
    after ``answer`` (``"nothing"`` or ``"one_token"``) and never ends."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.closed = False
        self.calls = 0

    async def __call__(self, request: dict):
        self.calls += 1
        try:
            if self.answer == "one_token":
                yield {"type": PROGRESS_TYPE, "replica": "frozen", "seed": 7, "id": "cmpl-f",
                       "created": 1, "prompt_tokens": 2}
                yield {"type": "http.response.start", "status": 200,
                       "headers": [(b"content-type", b"text/event-stream")]}
                yield {"type": PROGRESS_TYPE, "tokens": [11]}
                yield {"type": "http.response.body", "body": chunk(0), "more_body": True}
            await asyncio.Event().wait()  # for ever
        finally:
            self.closed = True


def test_a_replica_that_never_answers_is_bounded_by_the_request_deadline():
    """docs/server.md: failovers are bounded by the request's deadline, and past the budget
    the client gets the 503 + Retry-After before the first byte, else the SSE error event.
    An attempt itself was not bounded: a replica that stopped answering (or a call no replica
    took) held the client until it gave up, and the fleet's drain for its whole grace."""
    for answer in ("nothing", "one_token"):
        frozen = Frozen(answer)
        app = FleetIngress(frozen, FailoverSettings(backoff_s=0.001, deadline_slack_s=0.1,
                                                    retry_after_s=2))

        async def scenario(app: FleetIngress):
            return await Client({**BODY, "timeout": 0.4}).run(app)  # gives up after 10 s
        client = asyncio.run(scenario(app))
        # the attempt was ended by the request's deadline (its bound), the budget then spent
        assert app.exhausted == 1, answer
        assert frozen.closed and app.active == 0 and client.ended
        if answer == "nothing":
            assert client.starts[0]["status"] == 503 and client.header(b"retry-after") == b"2"
            error = json.loads(client.content)["error"]
        else:
            assert client.content.startswith(chunk(0)) and b"[DONE]" not in client.content
            error = json.loads(client.content[len(chunk(0)):].removeprefix(b"data: "))["error"]
        assert "deadline" in error["message"], error



def test_a_request_task_cancelled_by_its_server_stops_the_replica():
    """Ray Serve's proxy cancels a request's task when its HTTP client disconnects (it does not
    say ``http.disconnect``); the ingress's own task then ended, but the task forwarding the
    replica's stream went on: the replica generated to its end for nobody, its sequence held."""
    gate = asyncio.Event()  # the replica sends token 0, then waits for a gate nobody opens
    r1 = Replica("r1", gate=gate)
    app, router = fleet(r1)

    async def scenario():
        request = asyncio.ensure_future(Client().run(app))
        while not r1.requests:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # streaming: token 0 sent, waiting on the gate
        request.cancel()  # what the proxy does when the client disconnects
        await asyncio.gather(request, return_exceptions=True)
        await asyncio.sleep(0.05)
        left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return r1.closed, left
    closed, left = asyncio.run(scenario())
    assert closed and not r1.finished  # its stream was stopped at once
    assert left == [] and app.active == 0 and app.failovers == {}



def test_a_send_to_a_client_that_left_stops_the_sibling_of_a_replica_relay():
    """The replica's own edge (drivers/fleet/edge.py) relaying to a sibling: a send to its
    client that raises (the connection closed, ASGI 2.4) was counted as a relay failure and
    left the sibling's stream running (its app never saw the disconnect)."""
    from calexec.drivers.fleet.edge import ReplicaEdge, serve_relayed

    slow, state = slow_stream(b"data: 1\n\n", b"data: 2\n\n")

    def never(scope, receive, send):
        raise AssertionError("this replica does not serve: it relays")
    sib = ReplicaEdge(slow, replica="r2", serving=lambda: True, relay=None,
                      relay_target=lambda: False, max_body_bytes=1 << 20)
    edge = ReplicaEdge(never, replica="r1", serving=lambda: False,
                       relay=lambda request: serve_relayed(sib, request, stop_grace_s=5.0),
                       relay_target=lambda: True, max_body_bytes=1 << 20)
    run_leaving_client(edge, send_raises=True)
    assert state["saw_disconnect"]  # the sibling's app was told, at once
    assert edge.relay_failures == 0  # a client that left is no failed relay


def serve_process(tmp_path, *args: str) -> tuple[subprocess.Popen, str]:
    """``calexec serve`` on a free loopback port, ready (bounded: 30 s); the caller kills it.
    ``--log-level warning`` unless ``args`` give one (a flag given twice with different values
    is refused since stop 62)."""
    port = free_port()
    level = [] if "--log-level" in args else ["--log-level", "warning"]
    proc = subprocess.Popen([sys.executable, "-m", "calexec", "serve", "--port", str(port),
                             *level, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ}, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/ready", timeout=1).status_code == 200
        except httpx.TransportError:
            assert proc.poll() is None, proc.communicate(timeout=10)
            return False
    try:
        wait_for(up, timeout=30, what="calexec serve to become ready")
    except BaseException:
        proc.kill()
        proc.communicate(timeout=10)
        raise
    return proc, url


def stopped(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    """The exit code and stderr of ``proc`` (killed if it outlives ``timeout``)."""
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
        raise AssertionError(f"calexec serve did not exit within {timeout} s: {err}") from None
    return proc.returncode, err


def stream_in_thread(url: str, max_tokens: int, request_id: str | None = None
                     ) -> tuple[threading.Thread, threading.Event, list[bytes]]:
    """A streamed completion from a worker thread, sent with ``X-Request-Id: request_id``
    when given: (thread, first event seen, the lines)."""
    first = threading.Event()
    lines: list[bytes] = []
    headers = {} if request_id is None else {"X-Request-Id": request_id}

    def run() -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=60, headers=headers,
                              json={"prompt": [5, 6], "max_tokens": max_tokens,
                                    "stream": True}) as r:
                for line in r.iter_lines():
                    lines.append(line.encode())
                    first.set()
        except httpx.HTTPError:
            pass  # cut
        finally:
            first.set()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, first, lines


def killed(proc) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=10)


def stream_cut_at_a_stop(tmp_path, *, forced: bool, request_id: str | None = None
                         ) -> tuple[int, str, list[bytes]]:
    """``calexec serve`` (20 ms a token) sent SIGTERM with a 1000-token stream in flight (20 s
    of tokens): ``forced``, a 30 s grace and, once /ready reports draining, a SIGINT that
    forces the exit; else a 0.5 s grace that runs out. (exit code, stderr, the stream's
    lines); the stream is sent with ``X-Request-Id: request_id`` when given."""
    proc, url = serve_process(tmp_path, "--grace", "30" if forced else "0.5",
                              "--device-config", "decode_us=20000")
    try:
        worker, first, lines = stream_in_thread(url, 1000, request_id)
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        if forced:
            wait_for(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503,
                     what="/ready to report draining")
            proc.send_signal(signal.SIGINT)
        code, err = stopped(proc)
        worker.join(10)
    finally:
        killed(proc)
    return code, err, lines


def test_a_second_signal_that_cuts_a_stream_is_no_clean_exit(tmp_path):
    """The first SIGTERM drains; a second one forces the exit, cutting what still runs: that
    is no clean drain (exit 0), it exits 3 naming the requests it cut."""
    proc, url = serve_process(tmp_path, "--grace", "30", "--device-config", "decode_us=20000")
    try:
        first = threading.Event()
        events: list[bytes] = []

        def stream() -> None:
            try:
                with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                                  json={"prompt": [5, 6], "max_tokens": 2000,
                                        "stream": True}) as r:
                    for line in r.iter_lines():
                        events.append(line.encode())
                        first.set()
            except httpx.HTTPError:
                pass  # cut
        worker = threading.Thread(target=stream, daemon=True)
        worker.start()
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503,
                 what="/ready to report draining")
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
        worker.join(10)
    finally:
        killed(proc)
    assert b"data: [DONE]" not in events  # the stream was cut...
    assert code == 3, err  # ...so the exit says so
    # forced by the second signal, not the 30 s grace run out (it says which)
    assert "forced exit by a second signal: 1 request(s) still running were cut" in err


def test_a_non_loopback_host_without_an_api_key_is_warned_about():
    from calexec import serve

    for host in ("0.0.0.0", "::", "10.1.2.3"):
        warned = serve.exposure_warnings(host, None, None)
        assert len(warned) == 1 and f"--host={host!r}" in warned[0]
        assert "--api-key" in warned[0]
        assert serve.exposure_warnings(host, "key", None) == []  # guarded: nothing to say
    for host in ("127.0.0.1", "::1", "localhost"):
        assert serve.exposure_warnings(host, None, None) == []


def test_an_admin_token_file_others_can_read_is_warned_about_at_startup(tmp_path):
    """The admin token drains and reloads the server: a token file the group or others can
    read (a fresh file's 0644) is said in one WARNING line naming it and its mode; 0600 is
    quiet. (Warned, not refused: a Kubernetes secret volume mounts its files 0644 unless told
    otherwise.)"""
    token = tmp_path / "admin.token"
    token.write_text("s3cret-admin\n", encoding="utf-8")
    for mode, warned in ((0o644, True), (0o640, True), (0o600, False), (0o400, False)):
        token.chmod(mode)
        done = subprocess.run([sys.executable, "-m", "calexec", "serve", "--once",
                               "--admin-token-file", str(token)],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        line = f"--admin-token-file={str(token)!r} is readable by"
        assert (line in done.stderr) is warned, (oct(mode), done.stderr)
        if warned:
            assert f"mode {mode:04o}" in done.stderr and "s3cret" not in done.stderr


def test_with_an_api_key_no_v1_path_answers_an_unauthenticated_client_but_401(tmp_path):
    """``--api-key`` guards ``/v1/*`` (docs/server.md "API key"); a client without the key
    learnt which /v1 routes and methods exist (404 for ``/v1/foo``, 405 for ``POST
    /v1/models``). vLLM's middleware answers 401 to any /v1 path without the key, as OpenAI
    does; with the key the route's own 404/405 comes back. Other paths keep theirs."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    from test_server_support import started_executor

    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig(api_key="k3y"))) as client:
            for method, path in (("GET", "/v1/foo"), ("POST", "/v1/embeddings"),
                                 ("POST", "/v1/models"), ("DELETE", "/v1/completions"),
                                 ("GET", "/v1")):
                answer = client.request(method, path)
                assert answer.status_code == 401, (method, path, answer.text)
                assert answer.json()["error"]["code"] == "invalid_api_key"
                keyed = client.request(method, path, headers={"authorization": "Bearer k3y"})
                assert keyed.status_code in (404, 405), (method, path)
            assert client.get("/nope").status_code == 404  # not an OpenAI path: as before
            assert client.get("/metrics").status_code == 200
        with TestClient(create_app(executor, ServerConfig())) as client:  # no key: as before
            assert client.get("/v1/foo").status_code == 404
    finally:
        executor.shutdown(5.0)
