"""Stop 53's probe of the streamed answers (server-sent events) of ``/v1/completions`` and
``/v1/chat/completions`` on a loopback server on the synthetic model: a stream joined must be
the whole answer of the same request (seeded), and every event framed as
``data: <json>\\n\\n`` with ``[DONE]`` last. Raw ``httpx`` (the bytes as sent), client timeout
30 s; hypothesis examples bounded (``CALEXEC_SSE_EXAMPLES``, default 25)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from test_server_support import openai_server  # noqa: E402

EXAMPLES = int(os.environ.get("CALEXEC_SSE_EXAMPLES", "25"))
#: byte-level tokenizer: ids 256..511 are the UTF-8 bytes; these write 'a', 'b', '\n' and the
#: bytes of 'é' (C3 A9) and '€' (E2 82 AC), so characters split across tokens, lone
#: continuation bytes (U+FFFD) and stop strings ending inside a character all occur
BYTES = [256 + b for b in (0x61, 0x62, 0x0A, 0xC3, 0xA9, 0xE2, 0x82, 0xAC)]
STOPS = ["a", "b", "é", "€", "\n", "\ufffd", "ab", "éa", "€b"]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin")) as (server, _, _):
        yield server.url


def events(raw: str) -> list[Any]:
    """The events of a stream, each checked to be one ``data: <json>`` line + a blank line,
    ``[DONE]`` the last and only there."""
    assert raw.endswith("\n\n"), raw[-80:]
    out: list[Any] = []
    for event in raw[:-2].split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event, event[:120]
        out.append(event[len("data: "):])
    assert out[-1] == "[DONE]" and "[DONE]" not in out[:-1], out[-2:]
    return [json.loads(data) for data in out[:-1]]


def joined(chunks: list[dict[str, Any]], chat: bool) -> dict[str, Any]:
    """The chunks of a stream as the whole answer's choices and usage (what a client that
    joins them gets)."""
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if chunk.get("usage") is not None:
            assert chunk["choices"] == [] and usage is None, chunk
            usage = chunk["usage"]
        for c in chunk["choices"]:
            d = choices.setdefault(c["index"], {"index": c["index"], "text": "",
                                                "token_ids": [], "finish_reason": None,
                                                "logprobs": None})
            assert d["finish_reason"] is None, f"a chunk after choice {c['index']} finished"
            d["text"] += c["delta"].get("content") or "" if chat else c["text"]
            d["token_ids"] += c.get("token_ids", [])
            d["finish_reason"] = c["finish_reason"]
            if c["logprobs"]:
                d["logprobs"] = d["logprobs"] or {k: [] for k in c["logprobs"]}
                for key in c["logprobs"]:
                    d["logprobs"][key] += c["logprobs"][key]
    return {"choices": [choices[k] for k in sorted(choices)], "usage": usage}


def whole_choices(answer: dict[str, Any], chat: bool) -> dict[str, Any]:
    return {"choices": [{"index": c["index"],
                         "text": (c["message"]["content"] or "") if chat else c["text"],
                         "token_ids": c["token_ids"], "finish_reason": c["finish_reason"],
                         "logprobs": c["logprobs"]} for c in answer["choices"]],
            "usage": answer["usage"]}


@st.composite
def requests(draw) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    max_tokens = draw(st.sampled_from([1, 2, 3, 8]))
    body: dict[str, Any] = {
        "max_tokens": max_tokens, "seed": draw(st.integers(0, 1000)),
        "temperature": draw(st.sampled_from([0, 1, 1.5])), "n": draw(st.integers(1, 3)),
        "allowed_token_ids": draw(st.lists(st.sampled_from(BYTES), min_size=1, max_size=5,
                                           unique=True)),
        "stop": draw(st.lists(st.sampled_from(STOPS), max_size=3, unique=True)) or None,
        "include_stop_str_in_output": draw(st.booleans()),
        "min_tokens": draw(st.integers(0, max_tokens)),
    }
    if draw(st.booleans()):
        body["stop_token_ids"] = body["allowed_token_ids"][:1]
    if chat:
        body["messages"] = [{"role": "user", "content": draw(st.sampled_from(["x", "é€"]))}]
        if draw(st.booleans()):
            body.update(logprobs=True, top_logprobs=draw(st.integers(0, 3)))
        return "/v1/chat/completions", body
    body["prompt"] = draw(st.sampled_from(["hello", "é", ["a", "€b"], [[1, 2], [3]]]))
    body["echo"] = draw(st.booleans())
    if draw(st.booleans()):
        body["logprobs"] = draw(st.integers(0, 3))
    return "/v1/completions", body


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(request=requests())
def test_a_stream_joined_is_the_whole_answer(url: str, request: tuple[str, dict[str, Any]]):
    """Text (stop strings split across tokens and inside UTF-8 characters, echo), token ids,
    logprobs with their text offsets and top entries, finish reasons and usage of every
    choice (n x prompts interleaved) are the whole answer's, streamed or not."""
    path, body = request
    chat = path.endswith("chat/completions")
    with httpx.Client(base_url=url, timeout=30) as client:
        whole = client.post(path, json=body)
        stream = client.post(path, json={**body, "stream": True,
                                         "stream_options": {"include_usage": True}})
    assert whole.status_code == stream.status_code, (whole.text[:300], stream.text[:300])
    if whole.status_code != 200:  # refused alike (min_tokens above what a stop allows...)
        assert whole.json()["error"] == stream.json()["error"]
        return
    assert stream.headers["content-type"] == "text/event-stream; charset=utf-8"
    assert stream.headers["cache-control"] == "no-cache"
    chunks = events(stream.text)
    assert {c["id"] for c in chunks} == {stream.headers["x-request-id"]}
    assert joined(chunks, chat) == whole_choices(whole.json(), chat)


@pytest.mark.parametrize("temperature", [0, 1])
@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_with_only_end_or_stop_tokens_allowed_is_refused_naming_min_tokens(
        url: str, temperature: int, stream: bool):
    """``allowed_token_ids`` that are all end or stop tokens, with ``min_tokens`` (which holds
    those back): no token could be chosen, every logit was -inf, and the answer (streamed or
    not) went on with tokens outside ``allowed_token_ids`` (id 0 greedy, the vocabulary's
    last id sampled), ``finish_reason: stop`` and no word of it. Now a 400 naming
    ``min_tokens``, before anything is admitted."""
    with httpx.Client(base_url=url, timeout=30) as client:
        for extra in ({"allowed_token_ids": [353], "stop_token_ids": [353]},
                      {"allowed_token_ids": [151643]},  # the synthetic model's end token
                      {"allowed_token_ids": [151643, 353], "stop_token_ids": [353]}):
            answer = client.post("/v1/completions", json={
                "prompt": "hi", "max_tokens": 4, "min_tokens": 2, "temperature": temperature,
                "stream": stream, **extra})
            assert answer.status_code == 400, answer.text[:300]
            error = answer.json()["error"]
            assert error["param"] == "min_tokens"
            assert error["message"].startswith("min_tokens=2: every token of allowed_token_ids")
        # one allowed token that is neither: served, and only it is generated
        answer = client.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "min_tokens": 2,
            "temperature": temperature, "stream": stream,
            "allowed_token_ids": [151643, 354], "stop_token_ids": [353]})
        assert answer.status_code == 200, answer.text[:300]
        if stream:
            ids = [t for c in events(answer.text) for ch in c["choices"]
                   for t in ch.get("token_ids", [])]
        else:
            ids = answer.json()["choices"][0]["token_ids"]
        assert ids[:2] == [354, 354] and set(ids) <= {151643, 354}, ids


@pytest.mark.parametrize("temperature", [0, 1])
def test_a_grammar_that_allows_none_of_the_allowed_token_ids_ends_with_a_400(
        url: str, temperature: int):
    """``response_format`` JSON with ``allowed_token_ids`` the grammar never allows next ('a':
    a JSON object opens with '{'): every logit was -inf and the answer was token 0 (greedy
    and sampled), outside both, ``finish_reason: stop``, as if all went well. Now the
    request ends with a 400 naming ``allowed_token_ids`` (whole; a stream's error event, its
    status when nothing was sent yet), also once a few tokens went out ('{' allowed, then
    nothing the grammar takes after it)."""
    with httpx.Client(base_url=url, timeout=30) as client:
        for allowed, n in (([353], 1), ([353], 2), ([256 + ord("{")], 1)):
            body = {"prompt": "hi", "max_tokens": 4, "allowed_token_ids": allowed, "n": n,
                    "response_format": {"type": "json_object"}, "temperature": temperature}
            whole = client.post("/v1/completions", json=body)
            assert whole.status_code == 400, whole.text[:300]
            error = whole.json()["error"]
            assert error["param"] == "allowed_token_ids", error
            assert error["message"].startswith(f"allowed_token_ids={allowed}: none of them "
                                               "can be token "), error
            stream = client.post("/v1/completions", json={**body, "stream": True})
            if allowed == [353]:  # the first token: nothing sent, the response's status
                assert stream.status_code == 400, stream.text[:300]
                assert stream.json()["error"] == error
            else:  # '{' went out: the stream's error event, no [DONE]
                assert stream.status_code == 200
                data = [e for e in stream.text.split("\n\n") if e]
                assert data[0].startswith("data: {") and '"token_ids":[379]' in data[0]
                assert json.loads(data[-1][len("data: "):]) == {"error": error}


def test_a_tool_chat_stream_s_last_chunk_has_null_logprobs_as_a_text_chat_s(url: str):
    """With ``tools`` (the tool shape) and ``logprobs``, a stream's last chunk that holds no
    token (``finish_reason: length``) carried ``logprobs: {"content": []}``, where the same
    chat without tools (and OpenAI) sends null; the tokens' chunks carry theirs alike."""
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "stream": True,
            "logprobs": True, "seed": 1, "temperature": 1}
    tool = {"type": "function", "function": {"name": "get"}}
    with httpx.Client(base_url=url, timeout=30) as client:
        for extra in ({}, {"tools": [tool]}):
            chunks = events(client.post("/v1/chat/completions", json={**body, **extra}).text)
            last = chunks[-1]["choices"][0]
            assert last["finish_reason"] == "length" and last["logprobs"] is None, (extra, last)
            rows = [row for c in chunks[:-1] for row in (c["choices"][0]["logprobs"] or
                                                         {"content": []})["content"]]
            assert len(rows) == 3, (extra, rows)
