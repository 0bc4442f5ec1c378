"""Found at stop 62 (server, second): the fleet ingress's routes forwarded once (/health,
/ready, /v1/models, /metrics, /admin/*...) and answers cut after they started. Replicas are
plain async generators, as in tests/test_fleet_ingress.py (no Ray, no device); every wait is
bounded by the test."""

from __future__ import annotations

import asyncio
import json

import pytest

from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress
from calexec.drivers.serving.handoff import PROGRESS_TYPE


class Hanging:
    """A replica that answers ``start`` (if given: with its ``x-calexec-replica``, as
    ray_serve's ``ReplicaHeaders`` adds) and ``first`` body bytes (if any), then hangs
    without dying; ``closed``: its call was stopped. It names itself first only when asked
    for progress (ray_serve's ``relay_http``: completions and chat alone)."""

    def __init__(self, name: str = "r1", start: bool = False, first: bytes = b"",
                 content_type: bytes = b"application/json") -> None:
        self.name, self.start, self.first, self.content_type = name, start, first, content_type
        self.calls: list[dict] = []
        self.closed = asyncio.Event()

    async def __call__(self, request: dict):
        self.calls.append(request)
        try:
            if request.get("progress"):
                yield {"type": PROGRESS_TYPE, "replica": self.name}
            if self.start:
                yield {"type": "http.response.start", "status": 200,
                       "headers": [(b"content-type", self.content_type),
                                   (b"x-calexec-replica", self.name.encode())]}
            if self.first:
                yield {"type": "http.response.body", "body": self.first, "more_body": True}
            await asyncio.Event().wait()  # hangs: never answers more, never dies
        finally:
            self.closed.set()


async def request(app: FleetIngress, method: str, path: str, body: bytes = b""
                  ) -> list[dict]:
    """Every ASGI message the ingress sends for one request whose client stays connected;
    bounded at 10 s (the old code: never answered)."""
    scope = {"type": "http", "method": method, "path": path, "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
    given = False
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


def answer(sent: list[dict], ended: bool = True) -> tuple[int, dict[bytes, bytes], bytes]:
    """(status, headers, body) of the one response sent; ``ended``: whether the ingress
    finished it (an unfinished one: the server closes the connection, the client sees it cut)."""
    starts = [m for m in sent if m["type"] == "http.response.start"]
    assert len(starts) == 1, sent
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert (not sent[-1].get("more_body", False)) is ended, sent
    return starts[0]["status"], dict(starts[0]["headers"]), body


@pytest.mark.parametrize("method,path", [("GET", "/health"), ("GET", "/ready"),
                                         ("GET", "/v1/models"), ("GET", "/metrics"),
                                         ("POST", "/tokenize")])
@pytest.mark.parametrize("started", [False, True])
def test_a_replica_hanging_on_a_route_forwarded_once_is_a_504_at_its_bound(method, path,
                                                                           started):
    """A replica that hangs without dying (a stopped process, a wedged event loop) held a
    request to a route forwarded once, and its client's connection, for ever: the ingress
    set no bound on those routes. Now its whole answer must come within ``route_timeout_s``,
    else the replica's call is cancelled and the client gets 504 ``wait.deadline`` in the
    OpenAI error shape naming the route, the replica and the bound, with Retry-After (another
    replica may answer a retry). Also when the replica sent its response start and hung."""
    async def go():
        replica = Hanging(start=started)
        app = FleetIngress(replica, FailoverSettings(route_timeout_s=0.2))
        sent = await request(app, method, path)
        return replica, sent
    replica, sent = asyncio.run(go())
    status, headers, body = answer(sent)
    assert status == 504, body
    error = json.loads(body)["error"]
    assert error["type"] == "timeout_error" and error["code"] == "wait.deadline", error
    assert f"{method} {path}" in error["message"] and "route_timeout_s=0.2 s" in error["message"]
    # the replica is named once it named itself (its response start), else "its replica"
    assert ("from replica r1" if started else "from its replica") in error["message"], error
    assert headers[b"retry-after"] == b"1" and b"x-request-id" in headers
    assert replica.closed.is_set() and len(replica.calls) == 1  # stopped, not retried


def test_a_replica_hanging_on_an_admin_reload_is_a_504_at_the_admin_bound():
    """``POST /admin/reload`` runs a model switch, longer than a probe: its bound is
    ``admin_timeout_s`` (the switch's own bounds plus slack), not ``route_timeout_s``. Past
    it the client gets 504 naming the route and the bound and saying the reload may still
    run on the replica, with ``x-should-retry: false`` and no Retry-After (a retry would
    switch again); the replica's call is stopped and the reload never repeated elsewhere."""
    async def go():
        replica = Hanging()
        app = FleetIngress(replica, FailoverSettings(route_timeout_s=0.05, admin_timeout_s=0.3))
        sent = await request(app, "POST", "/admin/reload", b'{"calbin": "m2.calbin"}')
        return replica, sent
    replica, sent = asyncio.run(go())
    status, headers, body = answer(sent)
    assert status == 504, body
    message = json.loads(body)["error"]["message"]
    assert "POST /admin/reload" in message and "admin_timeout_s=0.3 s" in message, message
    assert "may still be running it" in message, message
    assert headers[b"x-should-retry"] == b"false" and b"retry-after" not in headers
    assert replica.closed.is_set() and len(replica.calls) == 1
    # the admin bound is the admin routes' alone: a probe keeps the short one
    assert FailoverSettings().route_timeout_s < FailoverSettings().admin_timeout_s


def test_a_json_answer_whose_replica_hangs_mid_body_is_left_cut_at_its_bound():
    """A replica that sent the start and the first bytes of a text (or JSON) answer and then
    hung held the request for ever (no bound). At its bound the answer is left unfinished:
    the server closes the connection and the client sees it cut (a 504 cannot follow a 200),
    and the replica's call is stopped."""
    async def hangs():
        replica = Hanging(start=True, first=b"# HELP a", content_type=b"text/plain")
        app = FleetIngress(replica, FailoverSettings(route_timeout_s=0.2))
        return replica, await request(app, "GET", "/metrics")
    replica, sent = asyncio.run(hangs())
    status, _, body = answer(sent, ended=False)
    assert status == 200 and body == b"# HELP a", body
    assert replica.closed.is_set()


def test_a_json_answer_whose_replica_dies_mid_body_gets_no_sse_event_and_no_end():
    """A replica that sent the start and the first bytes of a JSON answer and then died:
    the ingress appended ``data: {"error": ...}`` (the SSE error event) to the JSON body and
    ended it, a document no parser reads, sent as if whole. The SSE error event goes only
    into an SSE stream; a cut JSON or text answer is left unfinished, so the server closes
    the connection and the client sees it cut."""
    async def dying(request: dict):
        yield {"type": PROGRESS_TYPE, "replica": "r1"}
        yield {"type": "http.response.start", "status": 200,
               "headers": [(b"content-type", b"application/json")]}
        yield {"type": "http.response.body", "body": b'{"data": [', "more_body": True}
        raise RuntimeError("ActorDiedError: the replica's process died")

    async def died():
        return await request(FleetIngress(dying, FailoverSettings()), "GET", "/v1/models")
    status, _, body = answer(asyncio.run(died()), ended=False)
    assert status == 200 and body == b'{"data": [', body
