"""The fleet edge (drivers/fleet/edge.py): which completions a replica relays to a sibling.

No Ray here: the replica's app is a small ASGI app whose answer each test chooses, the relay is
a plain function, and the sibling is a second edge reached through ``serve_relayed``, the same
function a Ray replica runs for a relayed request. The Ray deployment test
(tests/test_ray_serve.py) runs the real thing.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from calexec.drivers.fleet.edge import (
    BODY_GONE,
    BODY_LATE,
    BODY_TOO_LARGE,
    BODY_WHOLE,
    RELAYED_FROM,
    ReplicaEdge,
    read_body,
    relay_request,
    serve_relayed,
)
from needs import module
from test_server_support import run_leaving_client, slow_stream

BODY = {"prompt": [1, 2], "max_tokens": 2}


class FakeApp:
    """Answers every request with ``answer`` (status, body or list of SSE chunks) and records
    the bodies it received; ``on_request`` runs first (e.g. the device fails meanwhile)."""

    def __init__(self, status: int = 200, chunks: list[bytes] | None = None,
                 on_request=None, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        self.status = status
        self.extra_headers = headers or []
        self.chunks = chunks
        self.on_request = on_request
        self.bodies: list[bytes] = []
        self.headers: list[dict] = []

    async def __call__(self, scope, receive, send) -> None:
        assert scope["type"] == "http"
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        self.bodies.append(body)
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        if self.on_request is not None:
            self.on_request()
        if self.chunks is not None:
            await send({"type": "http.response.start", "status": self.status,
                        "headers": [(b"content-type", b"text/event-stream")]})
            for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        payload = json.dumps({"status": self.status, "len": len(body)}).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode())]
        if self.status == 503:
            headers.append((b"retry-after", b"1"))
        headers += self.extra_headers
        await send({"type": "http.response.start", "status": self.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


class Flag:
    def __init__(self, value: bool) -> None:
        self.value = value

    def __call__(self) -> bool:
        return self.value


def edge(app, *, serving=True, relay=None, target=True, limit=1 << 20, name="r1") -> ReplicaEdge:
    return ReplicaEdge(app, replica=name, serving=serving if callable(serving) else Flag(serving),
                       relay=relay, relay_target=Flag(target) if isinstance(target, bool)
                       else target, max_body_bytes=limit, retry_after_s=2)


def sibling(app, **kwargs):
    """A relay into a second edge (the sibling replica), as a Ray replica's relay_http does;
    records every request it relays."""
    sib = edge(app, name="r2", **kwargs)
    sent: list[dict] = []

    def relay(request):
        sent.append(request)
        return serve_relayed(sib, request)
    return relay, sent


def post(app, path="/v1/completions", body=BODY, headers=None) -> httpx.Response:
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge") as client:
            return await client.post(path, json=body, headers=headers)
    return asyncio.run(go())


def test_serving_replica_answers_itself():
    local, remote = FakeApp(200), FakeApp(200)
    relay, sent = sibling(remote)
    r = post(edge(local, relay=relay))
    assert r.status_code == 200 and r.json()["len"] == len(local.bodies[0])
    assert json.loads(local.bodies[0]) == BODY
    assert not sent and RELAYED_FROM.decode() not in r.headers


def test_replica_that_does_not_serve_relays_at_once_with_the_whole_body():
    local, remote = FakeApp(503), FakeApp(200)
    relay, sent = sibling(remote)
    e = edge(local, serving=False, relay=relay)
    r = post(e)
    assert r.status_code == 200 and r.headers[RELAYED_FROM.decode()] == "r1"
    assert local.bodies == []  # this device never saw it
    assert json.loads(remote.bodies[0]) == BODY
    assert remote.headers[0][RELAYED_FROM.decode()] == "r1"
    assert remote.headers[0]["content-length"] == str(len(remote.bodies[0]))
    assert len(sent) == 1 and e.relayed == 1


def test_503_answered_here_is_retried_once_on_a_sibling():
    local, remote = FakeApp(503), FakeApp(200)
    relay, sent = sibling(remote)
    r = post(edge(local, relay=relay))
    assert r.status_code == 200 and r.headers[RELAYED_FROM.decode()] == "r1"
    assert len(local.bodies) == 1 and len(remote.bodies) == 1


def test_503_without_a_serving_sibling_reaches_the_client_unchanged():
    local = FakeApp(503)
    relay, sent = sibling(FakeApp(200))
    r = post(edge(local, relay=relay, target=False))
    assert r.status_code == 503 and r.headers["retry-after"] == "1" and not sent
    assert r.json() == {"status": 503, "len": len(local.bodies[0])}


def test_500_while_still_serving_is_the_request_s_failure_and_not_relayed():
    relay, sent = sibling(FakeApp(200))
    r = post(edge(FakeApp(500), relay=relay))
    assert r.status_code == 500 and not sent and "retry-after" not in r.headers


def test_500_that_took_the_device_down_is_a_503_relayed_to_a_sibling():
    serving = Flag(True)
    local = FakeApp(500, on_request=lambda: setattr(serving, "value", False))
    relay, sent = sibling(FakeApp(200))
    r = post(edge(local, serving=serving, relay=relay))
    assert r.status_code == 200 and len(sent) == 1 and len(local.bodies) == 1


def test_500_that_took_the_device_down_without_sibling_is_503_with_retry_after():
    serving = Flag(True)
    local = FakeApp(500, on_request=lambda: setattr(serving, "value", False))
    r = post(edge(local, serving=serving, relay=None))
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert r.json()["status"] == 500  # the body (the replica's Status) is unchanged


def test_a_relayed_request_is_never_relayed_again():
    relay, sent = sibling(FakeApp(200))
    r = post(edge(FakeApp(503), serving=False, relay=relay),
             headers={RELAYED_FROM.decode(): "r0"})
    assert r.status_code == 503 and not sent
    # two devices refusing: the sibling answers its own 503, the client gets it (one hop)
    refusing, sent2 = sibling(FakeApp(503), serving=False)
    r = post(edge(FakeApp(503), serving=False, relay=refusing))
    assert r.status_code == 503 and len(sent2) == 1
    assert r.headers[RELAYED_FROM.decode()] == "r1" and r.headers["retry-after"] == "1"


def test_only_completions_are_relayed():
    relay, sent = sibling(FakeApp(200))
    e = edge(FakeApp(503), serving=False, relay=relay)
    assert post(e, path="/ready").status_code == 503
    assert post(e, path="/admin/drain").status_code == 503
    assert not sent


def test_stream_from_this_replica_passes_through_unheld():
    chunks = [b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
    relay, sent = sibling(FakeApp(200))
    r = post(edge(FakeApp(200, chunks=chunks), relay=relay))
    assert r.status_code == 200 and r.content == b"".join(chunks) and not sent


def test_relayed_stream_arrives_chunk_by_chunk_in_order():
    chunks = [b"data: %d\n\n" % i for i in range(5)] + [b"data: [DONE]\n\n"]
    relay, _ = sibling(FakeApp(200, chunks=chunks))
    e = edge(FakeApp(503), serving=False, relay=relay)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
             "query_string": b""}
    sent: list[dict] = []
    body = json.dumps(BODY).encode()
    received = iter([{"type": "http.request", "body": body, "more_body": False}])

    async def receive():
        try:
            return next(received)
        except StopIteration:
            await asyncio.sleep(3600)  # the client stays

    async def send(message):
        sent.append(message)
    asyncio.run(e(scope, receive, send))
    assert sent[0]["status"] == 200 and (RELAYED_FROM, b"r1") in sent[0]["headers"]
    assert [m["body"] for m in sent[1:] if m["body"]] == chunks
    assert sent[-1]["more_body"] is False


def test_relay_that_fails_before_answering_sends_the_held_503():
    def broken(request):
        raise ConnectionError("sibling actor died")
    e = edge(FakeApp(503), relay=broken)
    r = post(e)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert e.relayed == 1 and e.relay_failures == 1
    # and on arrival: the replica answers itself
    local = FakeApp(503)
    e = edge(local, serving=False, relay=broken)
    assert post(e).status_code == 503 and len(local.bodies) == 1


def test_body_over_the_limit_is_passed_through_whole_and_not_relayed():
    relay, sent = sibling(FakeApp(200))
    local = FakeApp(503)
    big = {"prompt": list(range(400)), "max_tokens": 1}
    r = post(edge(local, serving=False, relay=relay, limit=64), body=big)
    assert r.status_code == 503 and not sent
    assert json.loads(local.bodies[0]) == big  # the app read every byte, replayed then live


def test_client_leaving_during_a_relay_stops_the_sibling():
    """The sibling's app is mid-stream when the client disconnects: the relay stream is closed,
    the sibling's app sees http.disconnect and ends."""
    slow, state = slow_stream(b"data: 1\n\n")
    relay, _ = sibling(slow)
    e = edge(FakeApp(503), serving=False, relay=relay)
    sent = run_leaving_client(e)
    assert state == {"saw_disconnect": True, "finished": True}
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]


def test_read_body_reports_complete_overflow_disconnect_and_a_body_too_slow():
    async def run(messages, limit, timeout_s=10.0):
        it = iter(messages)

        async def receive():
            message = next(it)
            if message is None:  # the client sends nothing more (and stays)
                await asyncio.Event().wait()
            return message
        return await read_body(receive, limit, timeout_s)
    parts = [{"type": "http.request", "body": b"ab", "more_body": True},
             {"type": "http.request", "body": b"cd", "more_body": False}]
    assert asyncio.run(run(parts, 10)) == ([b"ab", b"cd"], BODY_WHOLE)
    assert asyncio.run(run(parts, 1)) == ([b"ab"], BODY_TOO_LARGE)
    assert asyncio.run(run([{"type": "http.disconnect"}], 10)) == ([], BODY_GONE)
    # a slowloris client: part of its body, then nothing; bounded by the timeout given
    assert asyncio.run(run([parts[0], None], 10, 0.05)) == ([b"ab"], BODY_LATE)


def test_relay_request_strips_a_forged_marker_and_sets_its_own():
    scope = {"method": "POST", "path": "/x/v1/completions", "root_path": "/x",
             "headers": [(b"x-calexec-relayed-from", b"forged"), (b"content-length", b"99"),
                         (b"transfer-encoding", b"chunked"), (b"authorization", b"Bearer t")],
             "query_string": b"a=1"}
    request = relay_request(scope, b"{}", "r1")
    assert request["path"] == "/v1/completions" and request["query_string"] == b"a=1"
    assert request["headers"] == [(b"authorization", b"Bearer t"), (RELAYED_FROM, b"r1"),
                                  (b"content-length", b"2")]


@pytest.mark.parametrize("status", [200, 400, 429, 504])
def test_other_answers_are_never_relayed(status):
    relay, sent = sibling(FakeApp(200))
    r = post(edge(FakeApp(status), relay=relay))
    assert r.status_code == status and not sent


def test_chat_completions_are_relayed_like_completions():
    relay, sent = sibling(FakeApp(200))
    r = post(edge(FakeApp(503), serving=False, relay=relay), path="/v1/chat/completions",
             body={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and len(sent) == 1
    assert sent[0]["path"] == "/v1/chat/completions"


def test_a_completion_path_with_an_encoded_slash_is_not_relayed():
    """``POST /v1%2Fcompletions`` is no completion to the replica's server (an encoded slash
    outside a model id is no separator: ``wire.routed_path``; it answers 404), but the edge
    decided on the decoded path and, its replica not serving, relayed it to a sibling (a relay
    spent on a request no replica serves). The edge now decides on the path the server routes:
    the replica answers it itself."""
    local, remote = FakeApp(404), FakeApp(200)
    relay, sent = sibling(remote)
    e = edge(local, serving=False, relay=relay)
    r = post(e, path="/v1%2Fcompletions")
    assert r.status_code == 404 and not sent and e.relayed == 0
    assert RELAYED_FROM.decode() not in r.headers


def test_the_sdk_retries_the_503_of_a_500_that_took_the_device_down():
    """A compatibility or programming 500 says ``x-should-retry: false`` (no retry on that
    device fixes it); once it took the replica's device down the edge answers it as the
    fleet's 503 + Retry-After, "retry on another device", but kept the header, so the
    OpenAI SDK (which obeys it over the 503) never retried: one answer. Now the 503 has no
    such header, and the SDK (``max_retries`` 2) retries it."""
    openai = module("openai", "clients")
    serving = Flag(True)
    local = FakeApp(500, on_request=lambda: setattr(serving, "value", False),
                    headers=[(b"x-should-retry", b"false")])
    app = edge(local, serving=serving, relay=None)
    answers: list[httpx.Response] = []

    async def record(response: httpx.Response) -> None:
        answers.append(response)

    async def go() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://edge",
                                     event_hooks={"response": [record]}) as http:
            sdk = openai.AsyncOpenAI(base_url="http://edge/v1", api_key="unused",
                                     max_retries=2, http_client=http)
            with pytest.raises(openai.APIStatusError) as failed:
                await sdk.completions.create(model="m", prompt=[1, 2], max_tokens=2)
            assert failed.value.status_code == 503
    asyncio.run(go())  # (the SDK waits the 503's Retry-After, 2 s, before each retry)
    assert [a.status_code for a in answers] == [503, 503, 503]
    assert all("x-should-retry" not in a.headers for a in answers)
