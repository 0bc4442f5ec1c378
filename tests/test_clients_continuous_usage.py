"""vLLM's ``stream_options.continuous_usage_stats`` (stop 63, clients): guidellm 0.8.1, the
benchmark client used with vLLM, sends ``{"include_usage": true, "continuous_usage_stats":
true}`` on every streamed request; the server refused the option with a 400, so a guidellm
run completed no request. As vLLM (``serving_completion.py``, ``serving_chat.py``): with
``include_usage`` true every chunk carries ``usage`` (the choice's prompt tokens and the
tokens its text reached so far; a chat's role chunk 0), and the final usage chunk is still
sent; with ``include_usage`` false no chunk does. The recorded guidellm bodies are replayed
over httpx against a loopback server on the synthetic model (docs/server.md, the
``stream_options`` row; docs/traceability.md "Found at stop 63 (clients)")."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

import needs
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    MODEL,
    metric_value,
    openai_server,
    started_executor,
    through_ingress,
)

TIMEOUT_S = 30.0
CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}
PROMPT = "The quick brown fox jumps over the lazy dog, then "
#: the bodies guidellm 0.8.1 sent (recorded), its synthetic data's prompt shortened
GUIDELLM = {
    "/v1/completions": {"model": MODEL, "stream": True, "stream_options": CONTINUOUS,
                        "max_tokens": 16, "ignore_eos": True, "prompt": PROMPT},
    "/v1/chat/completions": {"model": MODEL, "stream": True, "stream_options": CONTINUOUS,
                             "max_completion_tokens": 16, "ignore_eos": True,
                             "messages": [{"role": "user", "content": [
                                 {"type": "text", "text": PROMPT}]}]},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (srv, _, svc):
        yield srv, svc


def _events(server, path: str, body: dict) -> list[dict]:
    """The stream's chunks (``[DONE]`` checked and left off)."""
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=TIMEOUT_S) as r:
        assert r.status_code == 200, r.read()
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def _whole(server, path: str, body: dict) -> dict:
    plain = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    answer = httpx.post(f"{server.url}{path}", json=plain, timeout=TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _check_continuous(events: list[dict], prompt_tokens: dict[int, int]) -> dict[int, int]:
    """Every chunk carries ``usage``: a choice's chunk its prompt (``prompt_tokens`` by
    index) and exactly the tokens its chunks listed so far (``token_ids``; a role chunk
    none), non-decreasing, total their sum; the last chunk is the usage chunk. The tokens
    each choice reached."""
    reached: dict[int, int] = {}
    for event in events[:-1]:
        assert "usage" in event, event
        (choice,) = event["choices"]
        k = choice["index"]
        listed = reached.get(k, 0) + len(choice.get("token_ids", ()))
        usage = event["usage"]
        assert usage == {"prompt_tokens": prompt_tokens[k], "completion_tokens": listed,
                         "total_tokens": prompt_tokens[k] + listed}, (event, listed)
        reached[k] = listed
    assert events[-1]["choices"] == [] and set(reached) == set(prompt_tokens), events[-1]
    return reached


@pytest.mark.parametrize("path", list(GUIDELLM))
def test_guidellms_recorded_stream_gets_usage_on_every_chunk(server, path):
    """The recorded guidellm body: 200 (it was a 400 "stream_options.continuous_usage_stats:
    not supported"); every chunk's usage counts the tokens that chunk's text reached, decode
    bursts (several tokens in one send) included; the last content chunk's count is the usage
    chunk's, and the usage chunk is the non-streamed answer's usage."""
    srv, _ = server
    body = GUIDELLM[path]
    whole = _whole(srv, path, body)
    events = _events(srv, path, body)
    reached = _check_continuous(events, {0: whole["usage"]["prompt_tokens"]})
    assert reached == {0: 16}
    assert events[-1]["usage"] == whole["usage"] == {
        "prompt_tokens": whole["usage"]["prompt_tokens"], "completion_tokens": 16,
        "total_tokens": whole["usage"]["prompt_tokens"] + 16}
    if path == "/v1/chat/completions":  # the role chunk: no token yet, as vLLM's
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
        assert events[0]["usage"]["completion_tokens"] == 0
    counts = [e["usage"]["completion_tokens"] for e in events]
    assert counts == sorted(counts)


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"n": 2}),
    ("/v1/completions", {"prompt": ["abc", "a longer prompt"]}),
    ("/v1/chat/completions", {"n": 3}),
], ids=["completions-n2", "prompt-list", "chat-n3"])
def test_every_choice_s_chunks_count_its_own_tokens(server, path, extra):
    """A request of several choices: each chunk's usage is its choice's (its prompt, its
    tokens so far, as vLLM's ``previous_num_tokens[i]``); every chat choice's role chunk
    counts none; the usage chunk sums them as the non-streamed answer does."""
    srv, service = server
    body = {**GUIDELLM[path], **extra, "max_tokens": 5, "seed": 3, "temperature": 1.0}
    body.pop("max_completion_tokens", None)
    whole = _whole(srv, path, body)
    events = _events(srv, path, body)
    if path == "/v1/chat/completions":
        prompts = dict.fromkeys(range(3), whole["usage"]["prompt_tokens"])
        roles = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
        assert len(roles) == 3 and {e["usage"]["completion_tokens"] for e in roles} == {0}
    elif "n" in extra:
        prompts = dict.fromkeys(range(2), whole["usage"]["prompt_tokens"])  # (counted once)
    else:
        sizes = [len(service.tokenizer.encode(p, True)) for p in extra["prompt"]]
        prompts = dict(enumerate(sizes))
    reached = _check_continuous(events, prompts)
    assert reached == dict.fromkeys(prompts, 5)
    assert events[-1]["usage"] == whole["usage"]


def test_echo_and_logprobs_chunks_count_generated_tokens_only(server):
    """``echo`` with ``logprobs``: the first chunk carries the prompt's text and rows, but its
    usage counts the one token generated (the prompt is ``prompt_tokens``), as vLLM's."""
    srv, _ = server
    body = {**GUIDELLM["/v1/completions"], "max_tokens": 4, "echo": True, "logprobs": 1}
    whole = _whole(srv, "/v1/completions", body)
    events = _events(srv, "/v1/completions", body)
    assert events[0]["choices"][0]["text"].startswith(PROMPT)
    assert events[0]["usage"]["completion_tokens"] == 1
    _check_continuous(events, {0: whole["usage"]["prompt_tokens"]})
    assert events[-1]["usage"] == whole["usage"]


def test_a_stop_string_s_chunks_count_the_tokens_generated(server):
    """A stop string (no decode burst; text held back while it may start one): each chunk
    still counts its token, the last one every token generated, as the answer's usage."""
    srv, _ = server
    body = {**GUIDELLM["/v1/completions"], "max_tokens": 12, "stop": ["<1>", "zzz"]}
    whole = _whole(srv, "/v1/completions", body)
    events = _events(srv, "/v1/completions", body)
    reached = _check_continuous(events, {0: whole["usage"]["prompt_tokens"]})
    assert reached == {0: whole["usage"]["completion_tokens"]}
    assert events[-1]["usage"] == whole["usage"]


def test_tool_call_chunks_count_the_tokens_held_back_before_them(server):
    """A forced tool call's stream: a token whose text is held back sends no chunk; the next
    chunk lists its id and counts it (as vLLM counts a token whose delta was None)."""
    needs.module("llguidance", "server")
    srv, _ = server
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                               "maximum": 99}},
        "required": ["n"], "additionalProperties": False}}}
    body = {**GUIDELLM["/v1/chat/completions"], "max_completion_tokens": 40, "tools": [tool],
            "tool_choice": {"type": "function", "function": {"name": "pick"}}, "seed": 1,
            "temperature": 1.0}
    whole = _whole(srv, "/v1/chat/completions", body)
    events = _events(srv, "/v1/chat/completions", body)
    assert any(e["choices"] and "tool_calls" in e["choices"][0]["delta"] for e in events)
    reached = _check_continuous(events, {0: whole["usage"]["prompt_tokens"]})
    assert reached == {0: whole["usage"]["completion_tokens"]}
    assert events[-1]["usage"] == whole["usage"]


@pytest.mark.parametrize("path", list(GUIDELLM))
@pytest.mark.parametrize("options,usage_chunks", [
    ({"continuous_usage_stats": True}, 0),
    ({"include_usage": False, "continuous_usage_stats": True}, 0),
    ({"include_usage": True, "continuous_usage_stats": False}, 1),
    ({"include_usage": True, "continuous_usage_stats": None}, 1),
])
def test_without_include_usage_continuous_stats_add_nothing(server, path, options,
                                                            usage_chunks):
    """As vLLM's ``should_include_usage``: continuous stats only with ``include_usage``;
    without it no chunk carries usage; continuous false (or null) leaves the one usage
    chunk at the end."""
    srv, _ = server
    events = _events(srv, path, {**GUIDELLM[path], "stream_options": options})
    with_usage = [i for i, e in enumerate(events) if "usage" in e]
    assert with_usage == ([len(events) - 1] if usage_chunks else []), events


@pytest.mark.parametrize("wrong", [0, 1, "true", []])
def test_a_continuous_usage_stats_that_is_no_boolean_is_refused(server, wrong):
    srv, _ = server
    body = {**GUIDELLM["/v1/completions"],
            "stream_options": {"include_usage": True, "continuous_usage_stats": wrong}}
    answer = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=TIMEOUT_S)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "stream_options", error
    assert error["message"] == (f"stream_options.continuous_usage_stats={json.dumps(wrong)}: "
                                "must be a boolean, true or false")


@pytest.fixture(scope="module")
def replica_app(tmp_path_factory):
    """One server app, every replica of the fleet (each call is a replica of its own)."""
    executor = started_executor(tmp_path_factory.mktemp("fleet"))
    try:
        yield create_app(executor, ServerConfig())
    finally:
        executor.shutdown(5.0)


def test_a_stream_continued_on_a_sibling_keeps_counting(replica_app):
    """Through the fleet ingress, a replica dying after three chunks: the sibling continues
    the stream from the tokens sent (``resume``), its chunks counting on from theirs; the
    client's stream is the uncut one's."""
    body = {**GUIDELLM["/v1/completions"], "max_tokens": 8, "seed": 5, "temperature": 1.0}
    whole, _ = through_ingress(replica_app, "/v1/completions", body, 99)  # never dies
    cut, calls = through_ingress(replica_app, "/v1/completions", body, 3)
    assert len(calls) == 2 and calls[1]["resume"]["tokens"], [c.get("resume") for c in calls]

    def usages(content: bytes) -> list[dict]:
        return [json.loads(e.removeprefix("data: "))["usage"]
                for e in content.decode().split("\n\n") if e and e != "data: [DONE]"]
    assert usages(cut) == usages(whole)
    assert [u["completion_tokens"] for u in usages(whole)] == [*range(1, 9), 8, 8]


@pytest.mark.parametrize("path", list(GUIDELLM))
def test_a_decode_burst_s_chunks_sent_together_count_each_its_own_tokens(replica_app, path):
    """A streamed greedy run's decode burst takes tokens ahead of the loop (up to
    ``STREAM_AHEAD``, then waits for room); the loop sends the chunks of the tokens taken
    in one send. Each chunk's usage is the tokens its own text reached, never the tokens the
    burst took by then. The client's send of the second token (the burst started after the
    first) is held until the burst waits for room (``calexec_stream_bursts_waiting``), so
    the next sends carry several chunks."""
    service = replica_app.state.service
    body = {**GUIDELLM[path], "max_tokens": 40}
    body.pop("max_completion_tokens", None)
    scope = {"type": "http", "method": "POST", "path": path, "query_string": b"",
             "headers": [(b"content-type", b"application/json")], "http_version": "1.1"}
    bodies: list[bytes] = []

    def burst_waits() -> bool:
        text = service.metrics.exposition().decode()
        return metric_value(text, "calexec_stream_bursts_waiting") == 1

    async def go() -> None:
        given, tokens = asyncio.Event(), []

        async def receive():
            if not given.is_set():
                given.set()
                return {"type": "http.request", "body": json.dumps(body).encode(),
                        "more_body": False}
            await asyncio.Event().wait()  # the client stays

        async def send(message):
            if message["type"] != "http.response.body" or not message.get("body"):
                return
            bodies.append(message["body"])
            tokens.append(message["body"].count(b'"token_ids"'))
            if sum(tokens) == 2:  # the second token's: the burst runs (it starts after one)
                for _ in range(1000):  # bounded
                    if burst_waits():
                        break
                    await asyncio.sleep(0.01)
        await asyncio.wait_for(replica_app(scope, receive, send), timeout=60)
    asyncio.run(go())
    assert len(bodies) > 1 and burst_waits() is False
    per_send = [b.count(b"data: {") for b in bodies]
    assert max(per_send) > 1, per_send  # chunks of a burst went together
    content = b"".join(bodies).decode()
    events = [json.loads(e.removeprefix("data: ")) for e in content.split("\n\n")
              if e and e != "data: [DONE]"]
    prompt = events[-1]["usage"]["prompt_tokens"]
    assert _check_continuous(events, {0: prompt}) == {0: 40}
