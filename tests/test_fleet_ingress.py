"""The fleet ingress (drivers/fleet/ingress.py): a stream outlives the replica that started it.

No Ray and no device here: a "replica" is a plain async generator yielding what a replica's
``relay_http`` yields (progress messages and ASGI messages) for a fixed token sequence, and
each test chooses how it fails (its process dies: the generator raises; it drains: it hands
off; its device fails: a retryable SSE error event; or it answers 503). The server's side of
a resume (re-prefill, text state, chat, seeded sampling) is tested in
tests/test_server_handoff.py; the Ray deployment in tests/test_ray_serve.py.
"""

from __future__ import annotations

import asyncio
import json
import urllib.parse

import pydantic
import pytest
from openai.types.responses import ResponseErrorEvent, ResponseStreamEvent

from calexec.drivers.fleet.edge import RELAYED_FROM
from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress, request_timeout
from calexec.drivers.serving.handoff import PROGRESS_TYPE

TOKENS = [11, 12, 13, 14, 15, 16]
BODY = {"prompt": [1, 2], "max_tokens": len(TOKENS), "stream": True}


def chunk(i: int) -> bytes:
    return b'data: {"i":%d,"token_ids":[%d]}\n\n' % (i, TOKENS[i])


TAIL = b'data: {"finish_reason":"length","usage":6}\n\ndata: [DONE]\n\n'
UNCUT = b"".join(chunk(i) for i in range(len(TOKENS))) + TAIL


class Replica:
    """A fake device replica. ``fail_at``: the index of the first token it does not send,
    and ``how`` it fails there (raise | handoff | error | end | 503); None: it never fails.
    ``gate``: an event each token waits for (a slow replica)."""

    def __init__(self, name: str, fail_at: int | None = None, how: str = "raise",
                 gate: asyncio.Event | None = None) -> None:
        self.name, self.fail_at, self.how, self.gate = name, fail_at, how, gate
        self.requests: list[dict] = []
        self.closed = False  # its generator was closed or cancelled before its end
        self.finished = False

    def start(self, status: int = 200) -> dict:
        return {"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/event-stream"),
                            (b"x-calexec-replica", self.name.encode())]}

    async def __call__(self, request: dict):
        self.requests.append(request)
        resume = request.get("resume") or {}
        first = len(resume.get("tokens", []))
        try:
            yield {"type": PROGRESS_TYPE, "replica": self.name}  # as ray_serve's relay_http
            if self.how == "early":  # died before it answered anything
                raise RuntimeError("ActorDiedError: the replica's process died")
            if self.how == "503" and self.fail_at is not None:
                yield self.start(503)
                yield {"type": "http.response.body", "body": b'{"error":{"message":"busy"}}',
                       "more_body": False}
                self.finished = True
                return
            yield {"type": PROGRESS_TYPE, "seed": 7, "id": resume.get("id") or f"cmpl-{self.name}",
                   "created": resume.get("created") or 1000 + len(self.requests),
                   "prompt_tokens": 2}
            yield self.start()
            for i in range(first, len(TOKENS) + 1):  # the last index: before the tail
                if self.gate is not None and i > first:  # a slow replica after its first
                    await self.gate.wait()
                if i == self.fail_at:
                    if self.how == "raise":
                        raise RuntimeError("ActorDiedError: the replica's process died")
                    if self.how == "handoff":  # then its response ends (no [DONE])
                        yield {"type": PROGRESS_TYPE, "handoff": "drained"}
                        yield {"type": "http.response.body", "body": b"", "more_body": False}
                        return
                    if self.how == "error":
                        yield {"type": PROGRESS_TYPE, "error": "device.fault", "retryable": True,
                               "cause": "unavailable"}
                        yield {"type": "http.response.body",
                               "body": b'data: {"error":{"message":"device fault"}}\n\n',
                               "more_body": False}
                        return
                    if self.how == "end":
                        return
                if i == len(TOKENS):
                    break
                yield {"type": PROGRESS_TYPE, "tokens": [TOKENS[i]]}
                yield {"type": "http.response.body", "body": chunk(i), "more_body": True}
            yield {"type": PROGRESS_TYPE, "final": True}
            yield {"type": "http.response.body", "body": TAIL, "more_body": True}
            if self.how == "after_tail":  # died before its end-of-body message
                raise RuntimeError("ActorDiedError: the replica's process died")
            yield {"type": "http.response.body", "body": b"", "more_body": False}
            self.finished = True
        finally:
            if not self.finished:
                self.closed = True


class Router:
    """Calls the first replica not in the request's ``avoid`` (the LifecycleRouter's rule)."""

    def __init__(self, *replicas: Replica) -> None:
        self.replicas = replicas
        self.calls: list[str] = []

    def __call__(self, request: dict):
        avoid = request.get("avoid") or []
        replica = next((r for r in self.replicas if r.name not in avoid), self.replicas[-1])
        self.calls.append(replica.name)
        return replica(request)


class Client:
    """Drives the ingress as an ASGI server would: one request, every message recorded;
    ``leave_after``: disconnect once that many body bytes arrived."""

    def __init__(self, body: dict = BODY, path: str = "/v1/completions",
                 leave_after: int | None = None,
                 headers: tuple[tuple[bytes, bytes], ...] = (), method: str = "POST",
                 raw_path: bytes | None = None) -> None:
        self.body, self.path, self.leave_after = body, path, leave_after
        self.headers, self.method, self.raw_path = headers, method, raw_path
        self.messages: list[dict] = []
        self.left = asyncio.Event()

    async def run(self, app) -> Client:
        scope = {"type": "http", "method": self.method, "path": self.path, "query_string": b"",
                 "headers": [(b"content-type", b"application/json"), *self.headers],
                 "http_version": "1.1"}
        if self.raw_path is not None:  # as uvicorn gives it: undecoded, beside the decoded one
            scope["raw_path"] = self.raw_path
        given = False

        async def receive():
            nonlocal given
            if not given:
                given = True
                return {"type": "http.request", "body": json.dumps(self.body).encode(),
                        "more_body": False}
            await self.gone()
            return {"type": "http.disconnect"}

        await asyncio.wait_for(app(scope, receive, self.send), timeout=10)
        return self

    async def gone(self) -> None:
        """Returns when the client disconnects (``receive`` then says ``http.disconnect``)."""
        await self.left.wait()

    async def send(self, message: dict) -> None:
        """The server's ``send``: record the message; leave after ``leave_after`` bytes."""
        assert message["type"].startswith("http."), message  # nothing internal leaks
        self.messages.append(message)
        if self.leave_after is not None and len(self.content) >= self.leave_after:
            self.left.set()

    @property
    def starts(self) -> list[dict]:
        return [m for m in self.messages if m["type"] == "http.response.start"]

    @property
    def content(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages
                        if m["type"] == "http.response.body")

    @property
    def ended(self) -> bool:
        return any(m["type"] == "http.response.body" and not m.get("more_body", False)
                   for m in self.messages)

    def header(self, name: bytes) -> bytes | None:
        return dict(self.starts[0]["headers"]).get(name)


def relay_one_body(body: bytes) -> tuple[Replica, list[dict]]:
    """``body`` POSTed to /v1/completions through an ingress in front of one replica, read
    by the ingress in one piece (the client then stays until the ingress is done): the
    replica (``requests``: what reached it) and every ASGI message the ingress sent."""
    replica = Replica("r1")
    app = FleetIngress(Router(replica), FailoverSettings(backoff_s=0.001))
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
    sent: list[dict] = []
    given = False

    async def receive() -> dict:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.sleep(30)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    return replica, sent


def ingress(router, **settings) -> FleetIngress:
    return FleetIngress(router, FailoverSettings(**{"backoff_s": 0.001, **settings}))


def run(app, client: Client | None = None) -> Client:
    return asyncio.run((client or Client()).run(app))


def test_an_uncut_stream_passes_through_without_progress_messages():
    r1 = Replica("r1")
    app = ingress(Router(r1))
    client = run(app)
    assert client.content == UNCUT and len(client.starts) == 1 and client.ended
    assert r1.requests[0]["progress"] is True and "resume" not in r1.requests[0]
    assert dict(r1.requests[0]["headers"])[RELAYED_FROM] == b"ingress"  # never re-relayed
    assert app.failovers == {}


@pytest.mark.parametrize("cut", [0, 1, 3, len(TOKENS)])
@pytest.mark.parametrize("how,cause", [("raise", "replica_died"), ("handoff", "drained"),
                                       ("error", "unavailable"), ("end", "replica_died")])
def test_a_stream_cut_after_k_tokens_continues_on_a_sibling(cut, how, cause):
    r1, r2 = Replica("r1", fail_at=cut, how=how), Replica("r2")
    app = ingress(Router(r1, r2))
    client = run(app)
    # the client's bytes are those of an uncut run: nothing lost, nothing twice, one start
    assert client.content == UNCUT and client.content.count(b"[DONE]") == 1
    assert len(client.starts) == 1 and client.ended
    if cut:  # the client has r1's start; r2's was dropped
        assert client.header(b"x-calexec-replica") == b"r1"
    else:  # nothing had gone out: the start is r2's, naming the replica that failed
        assert client.header(b"x-calexec-replica") == b"r2" and client.header(RELAYED_FROM) == b"r1"
    resume = r2.requests[0]["resume"]
    assert resume["tokens"] == TOKENS[:cut] and resume["seed"] == 7
    assert resume["id"] == "cmpl-r1" and resume["created"] == 1001
    assert resume["opened"] == (cut > 0) and 0 < resume["timeout"] <= 30
    assert r2.requests[0]["avoid"] == ["r1"]
    assert app.failovers == {cause: 1} and app.reprefilled == 2 + cut


def test_a_failover_before_the_first_byte_carries_the_relayed_from_header():
    r1, r2 = Replica("r1", fail_at=0, how="503"), Replica("r2")
    client = run(ingress(Router(r1, r2)))
    assert client.starts[0]["status"] == 200 and client.content == UNCUT
    assert client.header(RELAYED_FROM) == b"r1" and client.header(b"x-calexec-replica") == b"r2"
    assert "resume" not in r2.requests[0]  # r1 never admitted it: nothing to resume


def test_a_chain_of_failures_within_the_budget_still_completes():
    replicas = [Replica(f"r{i}", fail_at=i + 1) for i in range(3)] + [Replica("r3")]
    app = ingress(Router(*replicas), max_failovers=3)
    client = run(app)
    assert client.content == UNCUT and app.failovers == {"replica_died": 3}
    assert [len(r.requests[0].get("resume", {}).get("tokens", [])) for r in replicas] \
        == [0, 1, 2, 3]
    assert replicas[3].requests[0]["avoid"] == ["r0", "r1", "r2"]


def test_budget_exhausted_mid_stream_ends_with_the_sse_error_event():
    replicas = [Replica(f"r{i}", fail_at=i + 2) for i in range(3)]
    app = ingress(Router(*replicas), max_failovers=2)
    client = run(app)
    body = client.content
    assert body.startswith(b"".join(chunk(i) for i in range(4)))  # what was sent stays
    events = [line for line in body.split(b"\n\n") if line]
    assert json.loads(events[-1][6:])["error"]["type"] == "unavailable_error"
    assert b"[DONE]" not in body and client.ended and app.exhausted == 1
    # a replica's own retryable SSE error event is what the client gets when the budget ends
    app = ingress(Router(Replica("r1", fail_at=2, how="error")), max_failovers=0)
    client = run(app)
    assert client.content.endswith(b'data: {"error":{"message":"device fault"}}\n\n')


def test_budget_exhausted_before_the_first_byte_is_the_replicas_503():
    replicas = [Replica(f"r{i}", fail_at=0, how="503") for i in range(2)]
    app = ingress(Router(*replicas), max_failovers=1)
    client = run(app)
    assert client.starts[0]["status"] == 503 and client.content == b'{"error":{"message":"busy"}}'
    assert len(client.starts) == 1 and app.exhausted == 1
    # a replica that died before answering: the ingress's own 503 + Retry-After
    client = run(ingress(Router(Replica("r0", fail_at=0)), max_failovers=0))
    start = client.starts[0]
    assert start["status"] == 503 and dict(start["headers"])[b"retry-after"] == b"1"
    assert json.loads(client.content)["error"]["type"] == "unavailable_error"


def test_the_request_deadline_bounds_the_failovers():
    r1 = Replica("r1", fail_at=1)
    app = ingress(Router(r1), max_failovers=100, backoff_s=0.05, max_backoff_s=0.05)
    client = run(app, Client({**BODY, "timeout": 0.3}))
    assert b"[DONE]" not in client.content and client.ended and app.exhausted == 1
    assert 1 < len(r1.requests) < 100  # retried (backing off), then the deadline ended it
    assert request_timeout(b'{"timeout": 2.5}', 30) == 2.5
    assert request_timeout(b'{"timeout": "x"}', 30) == request_timeout(b"[", 30) == 30


def test_client_disconnect_stops_the_sibling():
    gate = asyncio.Event()
    r1, r2 = Replica("r1", fail_at=2), Replica("r2", gate=gate)

    async def go():
        client = Client(leave_after=len(chunk(0) + chunk(1) + chunk(2)))
        app = ingress(Router(r1, r2))
        await client.run(app)  # r2 sends token 2, then waits for a gate nobody opens
        return client, app
    client, app = asyncio.run(go())
    assert client.content == b"".join(chunk(i) for i in range(3))
    assert r2.closed and not r2.finished  # the sibling's stream was closed, not run out
    assert b"[DONE]" not in client.content and app.failovers == {"replica_died": 1}


def test_other_routes_are_forwarded_once_without_progress_or_retry():
    r1, r2 = Replica("r1", fail_at=0, how="503"), Replica("r2")
    router = Router(r1, r2)
    client = run(ingress(router), Client(path="/admin/drain"))
    assert client.starts[0]["status"] == 503 and router.calls == ["r1"]
    assert "progress" not in r1.requests[0] and "resume" not in r1.requests[0]


def test_chat_completions_fail_over_too():
    r1, r2 = Replica("r1", fail_at=2), Replica("r2")
    client = run(ingress(Router(r1, r2)), Client(path="/v1/chat/completions"))
    assert client.content == UNCUT and r2.requests[0]["path"] == "/v1/chat/completions"


def test_a_client_cannot_inject_resume_state_through_the_ingress():
    r1 = Replica("r1")
    forged = {**BODY, "resume": {"tokens": [99]}}
    run(ingress(Router(r1)), Client(forged))
    request = r1.requests[0]
    assert "resume" not in request  # only the ingress's own state ever goes there
    assert json.loads(request["body"])["resume"] == {"tokens": [99]}  # the server refuses it


def test_a_replica_dying_after_its_last_chunk_ends_the_stream_without_failover():
    r1, r2 = Replica("r1", how="after_tail"), Replica("r2")
    app = ingress(Router(r1, r2))
    client = run(app)
    assert client.content == UNCUT and client.ended and not r2.requests and app.failovers == {}


def test_a_replica_dying_before_it_answered_is_avoided_on_the_retry():
    r1, r2 = Replica("r1", how="early"), Replica("r2")
    app = ingress(Router(r1, r2))
    client = run(app, Client({**BODY, "stream": False}))
    assert client.content == UNCUT and r2.requests[0]["avoid"] == ["r1"]
    assert app.failovers == {"replica_died": 1}


def test_a_body_that_trickles_in_is_a_408_and_reaches_no_replica():
    """A slowloris client (part of its body, then nothing) holds the ingress no longer than
    ``body_timeout_s``, as the server (408 ``request.body_timeout``); no replica is called."""
    r1 = Replica("r1")
    router = Router(r1)
    app = ingress(router, body_timeout_s=0.05)
    messages: list[dict] = []
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
    parts = [{"type": "http.request", "body": b'{"prompt": [1', "more_body": True}]

    async def receive():
        if parts:
            return parts.pop()
        await asyncio.Event().wait()  # the rest never comes (the client stays)
        return {"type": "http.disconnect"}

    async def send(message):
        messages.append(message)
    asyncio.run(asyncio.wait_for(app(scope, receive, send), timeout=10))
    assert messages[0]["status"] == 408
    error = json.loads(messages[1]["body"])["error"]
    assert error["code"] == "request.body_timeout" and "13 bytes came" in error["message"]
    assert router.calls == [] and r1.requests == []


def test_failover_settings_refuse_a_body_timeout_that_is_not_positive():
    with pytest.raises(ValueError, match="body_timeout_s"):
        FailoverSettings(body_timeout_s=0)


def test_the_ingress_s_own_answers_carry_an_x_request_id_and_a_replica_s_is_kept():
    """Every response of the server carries ``x-request-id`` (the client's sane
    ``X-Request-Id``, else its own); the ingress relays a replica's answer with the replica's
    header, but its own answers (the 503 when no replica answered, the drain's 503) had
    none: the client's id is echoed there, else one is made; a replica's is never replaced."""
    dead = lambda: Router(Replica("r0", fail_at=0))  # noqa: E731 - died before answering
    client = run(ingress(dead(), max_failovers=0))
    made = client.header(b"x-request-id")
    assert client.starts[0]["status"] == 503 and made and len(made) == 32
    given = ((b"x-request-id", b"trace-42"),)
    client = run(ingress(dead(), max_failovers=0), Client(headers=given))
    assert client.header(b"x-request-id") == b"trace-42"
    # an id that is no printable ASCII, or too long, is not echoed (the server's rule)
    client = run(ingress(dead(), max_failovers=0),
                 Client(headers=((b"x-request-id", b"x" * 129),)))
    assert client.header(b"x-request-id") not in (None, b"x" * 129)
    app = ingress(Router(Replica("r1")))
    app.draining = True
    client = run(app, Client(headers=given))
    assert client.starts[0]["status"] == 503 and client.header(b"x-request-id") == b"trace-42"

    class Named(Replica):  # a replica's answer names its own id: relayed as it is
        def start(self, status: int = 200) -> dict:
            message = super().start(status)
            message["headers"] = [*message["headers"], (b"x-request-id", b"cmpl-r1")]
            return message

    client = run(ingress(Router(Named("r1"))), Client(headers=given))
    assert client.content == UNCUT
    assert [v for k, v in client.starts[0]["headers"] if k == b"x-request-id"] == [b"cmpl-r1"]


# ---- which failures fail over (hand mutants of `retryable`, stops 47 and 48) ------------
class Refusing(Replica):
    """A sibling that answers ``status`` at once (before admitting anything)."""

    def __init__(self, name: str, status: int) -> None:
        super().__init__(name)
        self.status = status

    async def __call__(self, request: dict):
        self.requests.append(request)
        yield {"type": PROGRESS_TYPE, "replica": self.name}
        yield self.start(self.status)
        yield {"type": "http.response.body",
               "body": b'{"error":{"message":"refused %d"}}' % self.status, "more_body": False}
        self.finished = True


class Failing(Replica):
    """Sends tokens up to ``fail_at``, then an SSE error event its progress marks not
    retryable (the request's own failure), then ``then``: "end" (its end-of-body message)
    or "die" (the process dies before it)."""

    def __init__(self, name: str, fail_at: int, then: str) -> None:
        super().__init__(name)
        self.fail_at, self.then = fail_at, then

    async def __call__(self, request: dict):
        self.requests.append(request)
        yield {"type": PROGRESS_TYPE, "replica": self.name}
        yield {"type": PROGRESS_TYPE, "seed": 7, "id": "cmpl-x", "created": 1, "prompt_tokens": 2}
        yield self.start()
        for i in range(self.fail_at):
            yield {"type": PROGRESS_TYPE, "tokens": [TOKENS[i]]}
            yield {"type": "http.response.body", "body": chunk(i), "more_body": True}
        yield {"type": PROGRESS_TYPE, "error": "internal.output_not_finite", "retryable": False,
               "cause": "internal"}
        yield {"type": "http.response.body", "body": ERROR, "more_body": self.then == "die"}
        if self.then == "die":
            raise RuntimeError("ActorDiedError: the replica's process died")
        self.finished = True


ERROR = b'data: {"error":{"message":"output not finite","type":"internal_error"}}\n\n'
SENT = b"".join(chunk(i) for i in range(2))


def test_a_stream_s_own_failure_reaches_the_client_and_is_not_failed_over():
    for then in ("end", "die"):
        r1, r2 = Failing("r1", 2, then), Replica("r2")
        app = ingress(Router(r1, r2))
        client = run(app)
        assert client.content == SENT + ERROR and client.ended, (then, client.content)
        assert not r2.requests and app.failovers == {} and app.exhausted == 0, then


def test_a_sibling_s_429_after_the_client_s_response_started_is_failed_over():
    r1, r2, r3 = Replica("r1", fail_at=2), Refusing("r2", 429), Replica("r3")
    app = ingress(Router(r1, r2, r3), max_failovers=2)
    client = run(app)
    assert client.content == UNCUT and len(client.starts) == 1
    assert app.failovers == {"replica_died": 1, "unavailable": 1}
    assert r3.requests[0]["avoid"] == ["r1", "r2"]


def test_a_sibling_s_other_refusal_after_the_response_started_ends_it_uncounted():
    r1, r2, r3 = Replica("r1", fail_at=2), Refusing("r2", 500), Replica("r3")
    app = ingress(Router(r1, r2, r3), max_failovers=2)
    client = run(app)
    assert client.content.startswith(SENT) and b"[DONE]" not in client.content
    last = [e for e in client.content.split(b"\n\n") if e][-1]
    assert json.loads(last[6:])["error"]["message"] == "refused 500", last
    assert not r3.requests and app.failovers == {"replica_died": 1}
    assert app.exhausted == 0  # the request's own failure, not a spent failover budget


# ---- stop 63: the Responses API behind the ingress ---------------------------------------------
RESPONSES_EVENTS = [b'event: response.created\ndata: {"type":"response.created",'
                    b'"sequence_number":0}\n\n',
                    b'event: response.output_text.delta\ndata: {"type":'
                    b'"response.output_text.delta","sequence_number":1,"delta":"a"}\n\n',
                    b'event: response.completed\ndata: {"type":"response.completed",'
                    b'"sequence_number":2}\n\n']


class ResponsesReplica:
    """A replica answering /v1/responses with ``RESPONSES_EVENTS``: ``pause_s`` before its
    last event (a long generation), ``how`` it fails: "503" (refused before its first byte),
    "raise" after its first event (its process died mid-stream), None: it does not."""

    def __init__(self, name: str, how: str | None = None, pause_s: float = 0.0) -> None:
        self.name, self.how, self.pause_s = name, how, pause_s
        self.requests: list[dict] = []

    async def __call__(self, request: dict):
        self.requests.append(request)
        yield {"type": PROGRESS_TYPE, "replica": self.name}  # as ray_serve's relay_http
        if self.how == "503":
            yield {"type": "http.response.start", "status": 503, "headers": []}
            yield {"type": "http.response.body", "body": b'{"error":{"message":"busy"}}'}
            return
        yield {"type": "http.response.start", "status": 200,
               "headers": [(b"content-type", b"text/event-stream")]}
        yield {"type": "http.response.body", "body": RESPONSES_EVENTS[0], "more_body": True}
        if self.how == "raise":
            raise RuntimeError("ActorDiedError: the replica's process died")
        yield {"type": "http.response.body", "body": RESPONSES_EVENTS[1], "more_body": True}
        await asyncio.sleep(self.pause_s)
        yield {"type": "http.response.body", "body": RESPONSES_EVENTS[2], "more_body": False}


RESPONSES_BODY = {"input": "x", "stream": True, "timeout": 5}


def test_a_responses_stream_is_bounded_by_its_own_deadline_not_route_timeout_s():
    """Stop 63: /v1/responses was forwarded once, as /v1/models is, its whole answer bounded
    by ``route_timeout_s`` whatever its ``timeout``: a generation longer than that (10 s by
    default) was cut. Now its deadline is the request's, as a completion's."""
    r1 = ResponsesReplica("r1", pause_s=0.3)
    app = ingress(Router(r1), route_timeout_s=0.05)
    client = run(app, Client(RESPONSES_BODY, path="/v1/responses"))
    assert client.starts[0]["status"] == 200 and client.ended
    assert client.content == b"".join(RESPONSES_EVENTS)


def test_a_responses_request_refused_before_its_first_byte_runs_on_a_sibling():
    r1, r2 = ResponsesReplica("r1", how="503"), ResponsesReplica("r2")
    app = ingress(Router(r1, r2))
    client = run(app, Client(RESPONSES_BODY, path="/v1/responses"))
    assert client.starts[0]["status"] == 200 and client.content == b"".join(RESPONSES_EVENTS)
    assert client.header(RELAYED_FROM) == b"r1" and r2.requests[0]["avoid"] == ["r1"]
    # never asked for progress: the replica reports none, hands nothing off, resumes nothing
    assert all("progress" not in r.requests[0] and "resume" not in r.requests[0]
               for r in (r1, r2))
    assert app.failovers == {"unavailable": 1}


def test_a_responses_stream_that_started_is_not_resumed_on_a_sibling():
    r1, r2 = ResponsesReplica("r1", how="raise"), ResponsesReplica("r2")
    app = ingress(Router(r1, r2))
    client = run(app, Client(RESPONSES_BODY, path="/v1/responses"))
    assert not r2.requests and client.ended and len(client.starts) == 1
    assert client.content.startswith(RESPONSES_EVENTS[0])
    last = [e for e in client.content.split(b"\n\n") if e][-1]
    assert last.startswith(b"event: error\ndata: "), last
    error = ResponseErrorEvent.model_validate_json(last.removeprefix(b"event: error\ndata: "))
    assert "not continued on a sibling" in error.message, error
    assert b"response.completed" not in client.content and app.failovers == {}


def test_a_responses_stream_the_ingress_ends_ends_with_a_responses_error_event():
    """Stop 64: the ingress ended a Responses stream whose replica died with chat's error
    event (``data: {"error": {...}}``, no ``type``), which no Responses event type parses: a
    client reading the Responses' events could not tell what happened. Now the Responses
    ``error`` event (the SDK's ``ResponseErrorEvent``, one of its ``ResponseStreamEvent``
    union) numbered after the last event the client got, chat's code in the message."""
    r1 = ResponsesReplica("r1", how="raise")
    app = ingress(Router(r1, ResponsesReplica("r2")))
    client = run(app, Client(RESPONSES_BODY, path="/v1/responses"))
    last = [e for e in client.content.split(b"\n\n") if e][-1]
    name, _, data = last.partition(b"\ndata: ")
    assert name == b"event: error", last
    event = pydantic.TypeAdapter(ResponseStreamEvent).validate_json(data)
    assert isinstance(event, ResponseErrorEvent), event
    assert event.sequence_number == 1 and event.code == "server_error", event
    assert event.message.endswith("(lifecycle.unavailable)"), event
    assert "replica_died at r1" in event.message, event


class SplitResponsesReplica(ResponsesReplica):
    """Its first two events, the second cut inside its ``sequence_number``, then it dies."""

    async def __call__(self, request: dict):
        self.requests.append(request)
        yield {"type": PROGRESS_TYPE, "replica": self.name}
        yield {"type": "http.response.start", "status": 200,
               "headers": [(b"content-type", b"text/event-stream")]}
        cut = RESPONSES_EVENTS[1].index(b'"sequence_number":') + len(b'"sequence_number":')
        for body in (RESPONSES_EVENTS[0] + RESPONSES_EVENTS[1][:cut], RESPONSES_EVENTS[1][cut:]):
            yield {"type": "http.response.body", "body": body, "more_body": True}
        raise RuntimeError("ActorDiedError: the replica's process died")


def test_the_error_event_follows_a_sequence_number_cut_between_two_chunks():
    client = run(ingress(Router(SplitResponsesReplica("r1"))),
                 Client(RESPONSES_BODY, path="/v1/responses"))
    last = [e for e in client.content.split(b"\n\n") if e][-1]
    event = ResponseErrorEvent.model_validate_json(last.partition(b"\ndata: ")[2])
    assert event.sequence_number == 2, event


class Hanging:
    """A replica that names itself and then never answers (its ``requests``: what reached it)."""

    def __init__(self, name: str = "r1") -> None:
        self.name = name
        self.requests: list[dict] = []

    async def __call__(self, request: dict):
        self.requests.append(request)
        yield {"type": PROGRESS_TYPE, "replica": self.name}
        await asyncio.Event().wait()  # (cancelled by the ingress's bound)
        yield {}  # pragma: no cover - never reached


def sent_as(raw: str) -> dict:
    """``Client`` keywords of a request sent as ``raw``: its ``raw_path``, and the ``path``
    uvicorn decodes it to (``unquote``: an encoded slash a separator, a byte of no UTF-8
    character U+FFFD)."""
    return {"path": urllib.parse.unquote(raw), "raw_path": raw.encode()}


@pytest.mark.parametrize("raw", ["/v1%2Fcompletions", "/v1/chat%2Fcompletions",
                                 "/v1%2Fresponses"])
def test_a_generation_route_with_an_encoded_slash_is_no_generation_to_the_ingress(raw):
    """The replica routes the path as sent (an encoded slash outside a model id is no
    separator: ``wire.routed_path``) and answers ``POST /v1%2Fcompletions`` 404; the ingress
    decided on the decoded path and took it for a completion: progress asked, and a replica's
    503 failed over to a sibling (its failover budget spent on a request no replica serves).
    It is now forwarded once, as any route that is no generation."""
    r1, r2 = Replica("r1", fail_at=0, how="503"), Replica("r2")
    router = Router(r1, r2)
    app = ingress(router)
    client = run(app, Client(**sent_as(raw)))
    assert router.calls == ["r1"], router.calls
    assert client.starts[0]["status"] == 503 and not app.failovers
    assert not {"progress", "resume", "avoid"} & set(r1.requests[0]), r1.requests[0]
    assert r1.requests[0]["raw_path"] == raw.encode()  # the replica routes it as sent


@pytest.mark.parametrize("method, raw, named", [
    ("GET", "/nope%FFx", "GET /nope%FFx"),
    ("GET", "/v1/models/%ff%fe", "GET /v1/models/%ff%fe"),
    ("POST", "/admin%2Freload", "POST /admin%2Freload"),
])
def test_the_ingress_s_504_names_the_path_as_sent_and_bounds_it_as_the_replica_routes_it(
        caplog, method, raw, named):
    """A replica that never answers a route forwarded once: the ingress's 504 and its log line
    named the decoded path (``GET /nope\ufffdx``, a character the client never sent), and
    bounded ``POST /admin%2Freload`` as ``/admin/reload`` (``admin_timeout_s``, ``x-should-retry:
    false``), a route the replica does not route it to (it answers 404). Now the path as sent,
    bounded by ``route_timeout_s`` as the replica's 404 would be."""
    app = ingress(Router(Hanging()), route_timeout_s=0.01, admin_timeout_s=0.02)
    with caplog.at_level("WARNING", logger="calexec.fleet_ingress"):
        client = run(app, Client(method=method, **sent_as(raw)))
    assert client.starts[0]["status"] == 504
    message = json.loads(client.content)["error"]["message"]
    assert message.startswith(f"{named}: no answer from replica r1 within route_timeout_s="), \
        message
    assert client.header(b"x-should-retry") is None and client.header(b"retry-after") == b"1"
    logged = [r.getMessage() for r in caplog.records if "no answer from replica" in r.getMessage()]
    assert logged and logged[0].startswith(f"{named}: "), logged
    assert "\ufffd" not in message + logged[0]
