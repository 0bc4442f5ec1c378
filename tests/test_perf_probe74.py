"""Stop 74 (perf, issue 28): the plain request's event-loop work made cheaper on its one path,
each change a claim of equality that these tests pin where the suite did not.

* A request step's time bound (``CompletionService._step``) and a body's read
  (``wire.read_body``, ``_discard``) are an ``asyncio.timeout`` where they were anyio's
  ``move_on_after`` (42 Python calls a scope, 12 now). A bound that fires mid-await answers
  as before: the step's 504 "the server stopped waiting" (a job's enqueue that never
  returns), an operator's cancel inside it the 409 ``request.aborted``, a client leaving
  inside it no answer and every id back; a ``TimeoutError`` the read itself raises is not
  the bound's (it propagates, as it did through anyio's scope). The test of the 504 passed
  on the code before the change and fails on a bound whose expiry is not caught (a 500).
* A body's framing headers (its media type, content and transfer codings) are read in one
  pass (``wire.body_framing``), where three checks took a pass each: the same refusal for
  any header fields (a differential over generated ones).
* The server's counters are ``metrics.LeanCounter`` (one call and one lock a count, where
  prometheus_client's took four calls): the same exposition, byte for byte, for the same
  counts (a differential against prometheus_client's ``Counter``).
* A response id's random hex is ``wire.uuid4_hex`` (``uuid.uuid4().hex`` written out): the
  same digits for the same random bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics import disable_created_metrics, enable_created_metrics
from prometheus_client.openmetrics import exposition as openmetrics

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from starlette.requests import Request  # noqa: E402

from calexec.drivers.serving import metrics, wire  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    metric_value,
    server_idle,
    started_executor,
    wait_for,
)

TOKEN = "perf74-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WAIT_S = 30.0
#: the request paths a step's wait can be on: a non-streamed burst (the defaults), the plain
#: path with its waits inline, and with its waits on worker threads
PATHS = {"bursts": {},
         "inline": {"decode_bursts": False, "stream_bursts": False},
         "threads": {"decode_bursts": False, "stream_bursts": False, "inline_waits": False}}


class HeldEnqueue:
    """The executor as the server holds it, its ``enqueue`` held at ``gate`` (set: it goes
    on): a step whose job's enqueue does not return (an admission or an arming that blocks),
    the wait the step's time bound ends. ``entered`` is set once an enqueue waits."""

    def __init__(self, executor) -> None:  # noqa: ANN001 - a DeviceExecutor
        self._executor = executor
        self.gate = threading.Event()
        self.entered = threading.Event()

    def __getattr__(self, name: str):  # noqa: ANN204 - every other member is the executor's
        return getattr(self._executor, name)

    def enqueue(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        self.entered.set()
        self.gate.wait(WAIT_S)
        return self._executor.enqueue(*args, **kwargs)


@contextlib.contextmanager
def held_server(tmp_path, **config) -> Iterator[tuple]:
    """(server, service, held executor): the enqueue held until the end of the block."""
    executor = started_executor(tmp_path, "decode_us=0", auto_prearm=False)
    held = HeldEnqueue(executor)
    app = create_app(held, ServerConfig(admin_token=TOKEN, prearm=False, **config))
    try:
        with LiveServer(app) as server:
            yield server, app.state.service, held
            held.gate.set()
            wait_for(lambda: server_idle(app.state.service), WAIT_S, "the server idle")
    finally:
        held.gate.set()
        executor.shutdown(5.0)


#: the 504 of a step whose bound fired (``_step``'s Status, told as the request's timeout)
STOPPED_WAITING = (
    "request timeout=0.3 s passed after 0 generated tokens (the body's timeout, or the "
    "server's --timeout); the request ended there: give a larger timeout or a smaller "
    "max_tokens (request deadline passed; the server stopped waiting)")


def _error(response: httpx.Response) -> tuple:
    body = response.json()
    error, status = body["error"], body["status"]
    return (response.status_code, error["code"], error["type"], error["message"],
            status["http_status"], status["grpc_code"], status["category"], status["phase"])


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("stream", [False, True])
def test_a_step_bound_firing_mid_await_answers_the_servers_504(tmp_path, path, stream):
    """The request's job's enqueue never returns: a tenth of the slack past the request's
    deadline the step's bound fires inside the await (a burst's, an inline wait's, a worker
    thread's) and the request ends with the server's own 504, as anyio's scope ended it
    (the same answer on the code before stop 74: status, code, message, the status object),
    on a stream before its first chunk too; the held enqueue, let go, is cancelled and every
    id comes back."""
    with held_server(tmp_path, deadline_slack_s=1.0, **PATHS[path]) as (server, service, held):
        r = httpx.post(f"{server.url}/v1/completions", timeout=WAIT_S,
                       json={"prompt": [5, 6, 7], "max_tokens": 4, "timeout": 0.3,
                             "stream": stream})
        assert held.entered.is_set()
    assert _error(r) == (504, "wait.deadline", "timeout_error", STOPPED_WAITING, 504,
                         "DEADLINE_EXCEEDED", "deadline", "wait"), r.text
    assert r.headers["content-type"].startswith("application/json")


def test_an_operator_cancel_inside_a_step_bound_is_the_409(tmp_path):
    """An operator's cancel of a request whose step waits in its bound (the enqueue held)
    expires the bound (``wire.expire``) where it cancelled anyio's scope: the 409
    ``request.aborted``, and the request's metrics as before."""
    with held_server(tmp_path, deadline_slack_s=5.0) as (server, service, held):
        out: list = []
        thread = threading.Thread(target=lambda: out.append(httpx.post(
            f"{server.url}/v1/completions", timeout=WAIT_S,
            json={"prompt": [5, 6, 7], "max_tokens": 4})))
        thread.start()
        assert held.entered.wait(WAIT_S)
        ident = next(iter({run.response_id for run in service.live_requests()}))
        answer = httpx.post(f"{server.url}/admin/cancel/{ident}", headers=AUTH,
                            timeout=WAIT_S)
        assert answer.status_code == 202, answer.text
        thread.join(WAIT_S)
        metrics = httpx.get(f"{server.url}/metrics").text
    response = out[0]
    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "request.aborted"
    assert ident in response.json()["error"]["message"]
    assert metric_value(metrics, "calexec_request_failures_total",
                        {"code": "request.aborted"}) == 1, metrics


def test_a_client_leaving_inside_a_step_bound_ends_the_request(tmp_path):
    """A client that leaves while its step waits in the bound: the disconnect's anyio scope
    (``wire.until_disconnect``) cancels through the ``asyncio.timeout`` (which passes a
    cancel that is not its own on), the request ends counted as a cancelled one and every id
    comes back once the enqueue returns."""
    with held_server(tmp_path, deadline_slack_s=5.0) as (server, service, held):
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(f"{server.url}/v1/completions", timeout=httpx.Timeout(WAIT_S, read=0.5),
                       json={"prompt": [5, 6, 7], "max_tokens": 4})
        wait_for(lambda: service.active == 0, WAIT_S, "the request ended")
        metrics = httpx.get(f"{server.url}/metrics").text
    assert metric_value(metrics, "calexec_request_failures_total",
                        {"code": "request.cancelled"}) == 1, metrics
    assert metric_value(metrics, "calexec_request_success_total") is None, metrics


# ---- the body's read ---------------------------------------------------------------------
def _request(receive) -> Request:  # noqa: ANN001
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "query_string": b"", "root_path": ""}
    return Request(scope, receive)


def test_a_timeout_error_the_read_raises_is_not_the_bounds():
    """A ``TimeoutError`` raised by the body's read itself (not its time bound expiring)
    propagates, as it did through anyio's ``move_on_after``: never taken for the 408."""
    async def receive() -> dict:
        raise TimeoutError("the receive's own")

    async def read() -> object:
        return await wire.body_or_refusal(_request(receive), 1000, 5.0, wire.BodyReads())
    with pytest.raises(TimeoutError, match="the receive's own"):
        asyncio.run(asyncio.wait_for(read(), WAIT_S))


def test_expire_ends_an_entered_bound_and_leaves_an_ended_one():
    """``wire.expire``: an entered bound ends (``TimeoutError`` on leaving it, at the loop's
    next turn); one expired already, expired twice or left is left as it is (no error)."""
    async def scenario() -> list[str]:
        seen = []
        bound = asyncio.timeout(math.inf)
        with contextlib.suppress(TimeoutError):
            async with bound:
                wire.expire(bound)
                wire.expire(bound)
                await asyncio.sleep(WAIT_S)
                seen.append("not expired")
        seen.append(f"expired={bound.expired()}")
        wire.expire(bound)  # left: nothing waits in it
        left = asyncio.timeout(math.inf)
        async with left:
            pass
        wire.expire(left)
        seen.append(f"left expired={left.expired()}")
        return seen
    assert asyncio.run(asyncio.wait_for(scenario(), WAIT_S)) == [
        "expired=True", "left expired=False"]


# ---- the body's framing headers, one pass -----------------------------------------------------
_KEYS = [b"content-type", b"content-encoding", b"transfer-encoding", b"content-length",
         b"Content-Type", b"x-other", b"expect"]
_VALUES = ["", "application/json", "Application/JSON; charset=utf-8", "text/plain",
           "application/vnd.api+json", "application/+json", " gzip", "identity", "gzip, identity",
           "identity, gzip", ",", "chunked", "gzip, chunked", "identity, chunked", "CHUNKED ",
           "br", "deflate,,br", "multipart/form-data; boundary=x", "\xe9t\xe9", "a" * 200]


def _old_reading(request: Request) -> tuple[str, str] | None:
    """The route's reading before stop 74: the three functions, in its order."""
    for field, check in (("content-type", wire.non_json_media),
                         ("content-encoding", wire.unsupported_coding),
                         ("transfer-encoding", wire.unsupported_transfer_coding)):
        found = check(request)
        if found is not None:
            return field, found
    return None


@given(st.lists(st.tuples(st.sampled_from(_KEYS),
                          st.one_of(st.sampled_from(_VALUES),
                                    st.text(st.characters(max_codepoint=255), max_size=30))),
                max_size=6))
@settings(max_examples=600, deadline=None)
def test_body_framing_answers_as_the_three_checks_did(fields):
    """``wire.body_framing`` (one pass over the header fields) finds what the three checks
    found, called one after the other, for any header fields: the same field and value, or
    None for both."""
    scope = {"type": "http", "method": "POST", "path": "/v1/completions",
             "headers": [(key, value.encode("latin-1")) for key, value in fields],
             "http_version": "1.1", "query_string": b"", "root_path": ""}
    assert wire.body_framing(Request(scope)) == _old_reading(Request(scope))


# ---- the server's counters ------------------------------------------------------------------
@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both record a series' creation time from ``time.time()``: one value for all."""
    monkeypatch.setattr(time, "time", lambda: 1765000000.25)


#: the shapes of the server's counter families (``ServerMetrics``): labelled with the model,
#: labelled without it, unlabelled; a name given with ``_total`` too
_FAMILIES = [("calexec_api_requests", ("route", "outcome", "model_name")),
             ("calexec_request_failures", ("category", "code", "raw", "model_name")),
             ("calexec_admin_cancels", ("outcome",)),
             ("calexec_prompt_tokens", ()),
             ("calexec_decode_burst_jobs_total", ())]


@pytest.mark.parametrize("created", [True, False])
@pytest.mark.parametrize("seed", [74, 75])
def test_lean_counters_expose_what_prometheus_clients_counters_did(created, seed, fixed_clock):
    """``metrics.LeanCounter`` fed the same counts as prometheus_client's ``Counter`` (children
    looked up before any count, in any order, label values to be escaped, amounts of 0, ints
    and floats, a refused negative amount) exposes the same bytes, in the text format and in
    OpenMetrics, with and without the ``_created`` series."""
    if not created:
        disable_created_metrics()
    try:
        rng = random.Random(seed)
        old_reg, new_reg = CollectorRegistry(), CollectorRegistry()
        pairs = [(labels, Counter(name, f"help of {name} \"q\"\n", labels, registry=old_reg),
                  metrics.LeanCounter(name, f"help of {name} \"q\"\n", labels, registry=new_reg))
                 for name, labels in _FAMILIES]
        values = ["a", "b", "x \"quoted\"\nline\\", "model-1", ""]
        for _ in range(2000):
            labels, old, new = rng.choice(pairs)
            if labels:
                key = tuple(rng.choice(values) for _ in labels)
                old, new = old.labels(*key), new.labels(*key)
            amount = rng.choice([0, 1, 1, 1, 3, 2.5, 1e-9, 10**6, -1])
            if rng.random() < 0.1:
                continue  # (a child looked up, not counted)
            outcomes = []
            for counter in (old, new):
                try:
                    counter.inc(amount)
                    outcomes.append("counted")
                except ValueError as err:
                    outcomes.append(str(err))
            assert outcomes[0] == outcomes[1]
        assert generate_latest(new_reg) == generate_latest(old_reg)
        assert openmetrics.generate_latest(new_reg) == openmetrics.generate_latest(old_reg)
        assert repr(list(new_reg.collect())) == repr(list(old_reg.collect()))
    finally:
        enable_created_metrics()


# ---- response ids ---------------------------------------------------------------------------
def test_uuid4_hex_is_uuid4s_hex_for_the_same_random_bytes(monkeypatch):
    """``wire.uuid4_hex`` (a response body's ``id``, the server's ``x-request-id``) gives what
    ``uuid.uuid4().hex`` gave for the same 16 random bytes: every byte value at the version
    and variant positions, and 2,000 seeded draws."""
    rng = random.Random(74)
    draws = [bytes(rng.randrange(256) for _ in range(16)) for _ in range(2000)]
    draws += [bytes([0] * 6 + [b] + [0] + [b] + [0] * 7) for b in range(256)]
    draws += [bytes([255] * 6 + [b] + [255] + [b] + [255] * 7) for b in range(256)]
    for raw in draws:
        monkeypatch.setattr(os, "urandom", lambda n, raw=raw: raw[:n])
        assert wire.uuid4_hex() == uuid.uuid4().hex, raw.hex()
