"""Stop 68's probe with the ecosystem's other OpenAI-compatible clients (docs/traceability.md
"Found at stop 68 (clients)"): litellm (``openai/`` and ``hosted_vllm/``), instructor,
pydantic-ai, the OpenAI Agents SDK's chat-completions model and smolagents'
``OpenAIServerModel``, each used as its docs show against a loopback server; the Responses
API as the Agents SDK's default ``OpenAIResponsesModel``, pydantic-ai's
``OpenAIResponsesModel`` and ``litellm.responses`` send it; and evalscope's service mode
(``eval_type="openai_api"``) and its perf benchmark. Every body they sent was answered and
each library parsed the answers (streams, usage, finish reasons, tool calls' ids and
indices); the refusals, ``reasoning_effort`` (litellm, pydantic-ai) and ``prediction``
(pydantic-ai), are 400s naming the field.

The bodies, as each library sent them, are ``tests/data/clients68/bodies.json`` (which calls
sent them: its ``_about``); these tests replay them over httpx, so CI needs none of the
libraries, and check what the libraries read of each answer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import needs
from test_server_support import MODEL, live_fixture  # noqa: F401 - the ``live`` fixture

httpx = needs.module("httpx", "server")

TIMEOUT_S = 30.0
BODIES = json.loads((Path(__file__).parent / "data" / "clients68" / "bodies.json")
                    .read_text(encoding="utf-8"))
CASES = [(library, i) for library, rows in BODIES.items() if not library.startswith("_")
         for i in range(len(rows))]
FINISH = {"stop", "length", "tool_calls"}


def sse_chunks(text: str) -> list[dict]:
    """The JSON chunks of an SSE answer, which must end with ``data: [DONE]``."""
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-1]
    return [json.loads(e.removeprefix("data: ")) for e in events[:-1]]


def tool_names(body: dict) -> set[str]:
    return {t["function"]["name"] for t in body.get("tools") or ()}


def forced(body: dict) -> bool:
    """The grammar writes a call: ``tool_choice`` "required" or a named function."""
    choice = body.get("tool_choice")
    return choice == "required" or isinstance(choice, dict)


def check_usage(usage: dict) -> None:
    assert usage["prompt_tokens"] > 0
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]


def check_whole_chat(body: dict, answer: dict) -> None:
    assert answer["object"] == "chat.completion" and answer["model"] == MODEL
    assert [c["index"] for c in answer["choices"]] == list(range(body.get("n", 1)))
    check_usage(answer["usage"])
    for choice in answer["choices"]:
        assert choice["finish_reason"] in FINISH
        message = choice["message"]
        assert message["role"] == "assistant"
        calls = message.get("tool_calls") or []
        if choice["finish_reason"] == "tool_calls":
            assert calls and message["content"] is None
        for call in calls:
            assert call["type"] == "function" and call["id"].startswith("call_")
            assert call["function"]["name"] in tool_names(body)
            if choice["finish_reason"] == "tool_calls":
                assert isinstance(json.loads(call["function"]["arguments"]), dict)
        if body.get("logprobs"):
            tokens = choice["logprobs"]["content"]
            assert tokens and all(len(t["top_logprobs"]) == body.get("top_logprobs", 0)
                                  for t in tokens)


def check_streamed_chat(body: dict, chunks: list[dict]) -> None:
    """What litellm's, pydantic-ai's, instructor's, the Agents SDK's and smolagents' stream
    readers take from the chunks: one id, each choice opened once and ended once, a call's
    first delta with its ``index``, ``id``, ``type`` and name, later ones by ``index`` only,
    and the usage chunk (``choices: []``) last exactly when ``stream_options`` asks."""
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    wants_usage = (body.get("stream_options") or {}).get("include_usage", False)
    if wants_usage:
        assert chunks[-1]["choices"] == []
        check_usage(chunks[-1]["usage"])
        chunks = chunks[:-1]
    assert all("usage" not in c or c["usage"] is None for c in chunks)
    finished: dict[int, str] = {}
    calls: dict[tuple[int, int], dict] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            index = choice["index"]
            assert index not in finished, f"choice {index} went on after its finish_reason"
            if choice.get("finish_reason"):
                finished[index] = choice["finish_reason"]
            for piece in choice["delta"].get("tool_calls") or ():
                key = (index, piece["index"])
                if key not in calls:
                    assert piece["id"].startswith("call_") and piece["type"] == "function"
                    assert piece["function"]["name"] in tool_names(body)
                    calls[key] = {"id": piece["id"], "arguments": ""}
                else:
                    assert "id" not in piece or piece["id"] in (None, calls[key]["id"])
                calls[key]["arguments"] += piece["function"].get("arguments") or ""
    assert sorted(finished) == list(range(body.get("n", 1)))
    assert set(finished.values()) <= FINISH
    if forced(body) and "tool_calls" in finished.values():
        assert calls
    for (index, _), call in calls.items():
        if finished[index] == "tool_calls":
            assert isinstance(json.loads(call["arguments"]), dict)


def sse_events(text: str) -> list[dict]:
    """The Responses events of an SSE answer: each ``event:`` line names its data's ``type``."""
    events = []
    for block in (b for b in text.split("\n\n") if b.strip()):
        name, data = block.split("\n", 1)
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}", block[:200]
        events.append(event)
    return events


def check_response(body: dict, answer: dict | list[dict]) -> None:
    """What the Agents SDK's ``OpenAIResponsesModel``, pydantic-ai's and litellm's Responses
    readers take: one terminal event (``response.completed`` or ``response.incomplete``) last,
    ``sequence_number`` 0, 1, 2, ..., and a forced call's ``function_call`` item whole."""
    if isinstance(answer, list):  # streamed
        assert [e["sequence_number"] for e in answer] == list(range(len(answer)))
        assert answer[0]["type"] == "response.created"
        terminal = [e for e in answer if e["type"] in ("response.completed",
                                                       "response.incomplete",
                                                       "response.failed")]
        assert terminal == [answer[-1]] and terminal[0]["type"] != "response.failed"
        answer = terminal[0]["response"]
    assert answer["object"] == "response" and answer["status"] in ("completed", "incomplete")
    usage = answer["usage"]
    assert usage["input_tokens"] + usage["output_tokens"] == usage["total_tokens"]
    kinds = [item["type"] for item in answer["output"]]
    assert kinds and set(kinds) <= {"message", "function_call"}
    if isinstance(body.get("tool_choice"), dict):
        call = answer["output"][-1]
        assert call["type"] == "function_call" and call["name"] == body["tool_choice"]["name"]
        assert call["call_id"].startswith("call_")
        if answer["status"] == "completed":
            assert isinstance(json.loads(call["arguments"]), dict)


def check_completions(body: dict, answer: dict | list[dict]) -> None:
    if isinstance(answer, list):  # streamed
        assert all(c["object"] == "text_completion" for c in answer)
        assert {c["choices"][0]["finish_reason"] for c in answer} - {None} <= FINISH
        return
    assert answer["object"] == "text_completion"
    check_usage(answer["usage"])
    assert len(answer["choices"]) == body.get("n", 1)
    for choice in answer["choices"]:
        assert choice["finish_reason"] in FINISH
        if body.get("echo"):
            assert choice["text"].startswith(body["prompt"])


@pytest.mark.parametrize(("library", "i"), CASES)
def test_each_clients_recorded_body_is_answered_as_it_reads_it(live, library, i):
    """(Not a defect: pins what held.) Every body the libraries sent is answered with
    the status it got when recorded, and the answer has what the library read of it."""
    server, _, _ = live
    row = BODIES[library][i]
    body = row["body"]
    r = httpx.post(f"{server.url}{row['path']}", json=body, timeout=TIMEOUT_S)
    assert r.status_code == row["status"], r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["param"] == row["param"]
        assert row["param"] in error["message"]
        return
    if row["path"] == "/v1/responses":
        check_response(body, sse_events(r.text) if body.get("stream") else r.json())
        return
    answer = sse_chunks(r.text) if body.get("stream") else r.json()
    if row["path"] == "/v1/completions":
        check_completions(body, answer)
    elif body.get("stream"):
        check_streamed_chat(body, answer)
    else:
        check_whole_chat(body, answer)


def test_the_recorded_bodies_cover_every_library_and_the_fields_they_send():
    """The data holds what the probe saw each library send: a drop in coverage (a re-record
    that lost a library or a field) fails here, not silently."""
    libraries = {k for k in BODIES if not k.startswith("_")}
    assert libraries == {"litellm", "instructor", "pydantic_ai", "openai_agents", "smolagents",
                         "evalscope"}
    sent = {key for rows in (BODIES[k] for k in libraries) for row in rows for key in row["body"]}
    assert {"max_completion_tokens", "parallel_tool_calls", "stream_options", "store",
            "metadata", "service_tier", "seed", "logprobs", "top_logprobs", "stop",
            "response_format", "tool_choice", "tools", "n", "reasoning_effort",
            "chat_template_kwargs", "top_k", "min_p", "repetition_penalty", "prediction",
            "user", "prompt_cache_key"} <= sent
    strict = [row["body"]["response_format"] for k in libraries for row in BODIES[k]
              if (row["body"].get("response_format") or {}).get("type") == "json_schema"]
    assert any(rf["json_schema"].get("strict") for rf in strict)
    roles = {m["role"] for k in libraries for row in BODIES[k]
             for m in row["body"].get("messages", ())}
    assert {"system", "user", "assistant", "tool"} <= roles
    responses = [row["body"] for k in libraries for row in BODIES[k]
                 if row["path"] == "/v1/responses"]
    items = {i.get("type") for body in responses if isinstance(body["input"], list)
             for i in body["input"]}
    assert {"function_call", "function_call_output"} <= items
