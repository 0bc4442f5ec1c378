"""Found at stop 57 (server): each test names what a user hit before its fix (docs/traceability.md,
"Found at stop 57 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

import needs
from calexec.drivers.fleet.edge import serve_relayed
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor, through_ingress

TOKEN = "probe57-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe57"))
    try:
        with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
            yield client
    finally:
        executor.shutdown(5.0)


# ---- /debug and /admin: a query parameter a route does not take -----------------------------
@pytest.mark.parametrize("path", [
    "/debug/jobs", "/debug/statecharts", "/debug/statecharts/live.json",
])
def test_a_debug_route_refuses_a_query_parameter_it_does_not_take_naming_it(client, path):
    """``GET /debug/jobs?limt=5`` (and the statecharts' redirect and ``live.json``) answered
    200 as if the parameter had been honoured, where ``/debug/jobs/{id}``, ``runs/{id}``
    and the ``/admin`` routes answer a 400 naming it; now every ``/debug`` route does."""
    r = client.get(path, params={"limt": "5"}, follow_redirects=False)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"].startswith("limt: unknown parameter"), error
    assert error["type"] == "invalid_request_error"
    assert client.get(path, follow_redirects=False).status_code in (200, 307)


@pytest.mark.parametrize("method, path, query, headers", [
    ("GET", "/debug/jobs", "zeta=1&alpha=2", {}),
    ("POST", "/admin/drain", "zeta=1&alpha=2&grace=0", AUTH),
    ("POST", "/admin/reload", "zeta=1&alpha=2", AUTH),
    ("GET", "/debug/jobs/1", "zeta=1&alpha=2&format=json", AUTH),
])
def test_every_unknown_query_parameter_is_named_not_only_the_first(client, method, path, query,
                                                                  headers):
    """Two mistyped parameters: the 400 named one of them, and the client fixing it met the
    other on its next try; the message names both now (``param`` the first, sorted)."""
    r = client.request(method, f"{path}?{query}", headers=headers)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "alpha", error
    assert error["message"].startswith("alpha, zeta: unknown parameters, refused"), error


# ---- the fleet ingress and a started stream of several choices ------------------------------
@pytest.fixture(scope="module")
def replica_app(tmp_path_factory):
    """One server app, every replica of the fleet (each call is a replica of its own)."""
    executor = started_executor(tmp_path_factory.mktemp("fleet57"))
    try:
        yield create_app(executor, ServerConfig())
    finally:
        executor.shutdown(5.0)


def _per_choice(content: bytes) -> tuple[dict[object, list[str]], set[str], int]:
    """A stream's events by choice index (each choice's entries, as JSON), with ``"usage"``
    the usage chunks; the ids of its chunks; how many ``[DONE]`` it has."""
    by_choice: dict[object, list[str]] = {}
    ids: set[str] = set()
    events = [e for e in content.decode().split("\n\n") if e]
    for event in events:
        if event == "data: [DONE]":
            continue
        chunk = json.loads(event.removeprefix("data: "))
        assert "error" not in chunk, chunk
        ids.add(chunk["id"])
        for choice in chunk["choices"]:
            by_choice.setdefault(choice["index"], []).append(json.dumps(choice, sort_keys=True))
        if chunk.get("usage"):
            by_choice.setdefault("usage", []).append(json.dumps(chunk["usage"], sort_keys=True))
    return by_choice, ids, events.count("data: [DONE]")


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 4, "n": 2, "temperature": 1.0}),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 4,
                         "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                              "n": 3, "temperature": 1.0, "seed": 11}),
], ids=["n2-unseeded", "prompt-list-usage", "chat-n3-seeded"])
@pytest.mark.parametrize("cut", [1, 4])
def test_a_started_stream_of_several_choices_finishes_on_a_sibling(replica_app, path, body, cut):
    """A streamed request of several choices (``n`` > 1, a prompt list) through the fleet
    ingress whose replica died after some chunks ended with the SSE error event
    (``lifecycle.unavailable``, "not continued on a sibling"): such a request reported no
    progress, so nothing could resume it. The replica reports its seed, id, ``created`` and
    each event's choice now; the sibling runs every choice again with them and sends only
    the events the client lacks: one stream, one id, one ``[DONE]``, each choice's events
    those of the same request uncut (its seed the one the first replica drew)."""
    content, calls = through_ingress(replica_app, path, {**body, "stream": True}, cut)
    assert len(calls) == 2, [c.get("resume") for c in calls]
    resume = calls[1]["resume"]
    assert sum(resume["choices"]) == cut and resume["tokens"] == [], resume
    cut_choices, cut_ids, done = _per_choice(content)
    assert done == 1 and cut_ids == {resume["id"]}, cut_ids
    whole, _ = through_ingress(replica_app, path, {**body, "stream": True,
                                                  "seed": resume["seed"]}, 10 ** 6)
    whole_choices, _, _ = _per_choice(whole)
    assert cut_choices == whole_choices
    assert len([k for k in cut_choices if k != "usage"]) >= 2


@pytest.mark.parametrize("job_id", ["9" * 19, "1" * 30])
def test_a_job_id_past_18_digits_is_refused_saying_what_is_taken(client, job_id):
    """``GET /debug/jobs/9999999999999999999`` said ``must be a job id (a decimal integer)``
    of a decimal integer: the rule (1 to 18 ASCII digits, docs/server.md) was not said."""
    r = client.get(f"/debug/jobs/{job_id}", headers=AUTH)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "job_id" and "1 to 18 ASCII digits" in error["message"], error


# ---- a named tool_choice ---------------------------------------------------------------------
GET_Q = {"type": "function", "function": {"name": "get", "description": "get q", "parameters": {
    "type": "object", "properties": {"q": {"type": "integer"}}, "required": ["q"]}}}


def test_a_named_tool_choice_is_one_call_whole_and_streamed(client):
    """``tool_choice: {"type": "function", "function": {"name": "get"}}`` (langchain's
    ``with_structured_output(method="function_calling")`` and ``bind_tools(tool_choice=)``
    send it) let the model write call after call of that function: here greedy went on until
    ``max_tokens`` (400), and the whole answer, cut inside the next call's arguments, had no
    ``tool_calls`` at all, its first call complete (langchain's structured output: None).
    A named function is called once now, as vLLM answers it: one call, ``finish_reason``
    ``"stop"``, whole and streamed alike."""
    needs.module("llguidance", "server")
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [GET_Q],
            "tool_choice": {"type": "function", "function": {"name": "get"}}, "max_tokens": 400}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert [call["function"]["name"] for call in calls] == ["get"], choice
    assert isinstance(json.loads(calls[0]["function"]["arguments"])["q"], int)
    assert choice["finish_reason"] == "stop", choice
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    deltas = [d for c in chunks if c["choices"] for d in c["choices"][0]["delta"].get(
        "tool_calls") or ()]
    assert {d["index"] for d in deltas} == {0}, deltas
    arguments = "".join(d["function"].get("arguments", "") for d in deltas)
    assert arguments == calls[0]["function"]["arguments"]
    assert [c["choices"][0]["finish_reason"] for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]] == ["stop"]


@pytest.mark.parametrize("resume, said", [
    ({"tokens": [5, 6], "choices": [1, 0]}, "not re-prefilled from tokens"),
    ({"choices": [1, 0, 0]}, "not re-prefilled from tokens"),  # more choices than asked
    ({"choices": [-1, 0]}, "resume.choices=[-1, 0]: must be a list of event counts >= 0"),
    ({"choices": "12"}, "resume.choices='12': must be a list of event counts >= 0"),
])
def test_a_resume_of_several_choices_the_sibling_cannot_use_is_a_400_naming_resume(
        replica_app, resume, said):
    """The resume state of a request of several choices is its seed, id, ``created`` and
    the events of each choice the client has; one that carries tokens (a one-choice resume),
    more choices than the request asks, or counts that are no counts is refused naming
    ``resume``, before anything is generated."""
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2, "n": 2, "stream": True}).encode()
    request = {"method": "POST", "path": "/v1/completions", "query_string": b"",
               "headers": [(b"content-type", b"application/json")], "body": body,
               "http_version": "1.1", "progress": True, "resume": {"seed": 1, **resume}}

    async def answer() -> list[dict]:
        return [m async for m in serve_relayed(replica_app, request)]
    messages = asyncio.run(asyncio.wait_for(answer(), 60))
    start = next(m for m in messages if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.response.body")
    assert start["status"] == 400, payload
    error = json.loads(payload)["error"]
    assert error["param"] == "resume" and said in error["message"], error
