"""Stop 74's probe with more of the ecosystem's clients (docs/traceability.md "Found at stop 74
(clients)"): DSPy (``dspy.LM("openai/<model>", api_base=...)`` on its own lm15 engine and on
litellm; Predict, ChainOfThought, the JSON adapter's structured outputs, ReAct, ``acall``,
streamify; a provider declared with ``register_provider`` under lm15's chat presets), haystack's
``OpenAIChatGenerator`` and ``OpenAIResponsesChatGenerator`` (streaming callbacks, tools and a
tool round trip, structured output), autogen's ``OpenAIChatCompletionClient`` and
``AssistantAgent`` (tools, streaming, structured output), langgraph's prebuilt ReAct agent over
``ChatOpenAI`` (chat and Responses), mirascope's ``llm.call``, and the ``openai`` SDK's
completions with token-id prompts, ``echo`` with logprobs, ``suffix``, ``best_of``, ``user`` and
the chat and Responses metadata fields.

The requests, as each library sent them, are ``tests/data/clients74/bodies.json`` (which calls
sent them: its ``_about``); these tests replay them over httpx, so CI needs none of the
libraries, and validate every answer and every chunk with the pinned ``openai`` SDK's own
pydantic types in strict mode, the SSE framing, ids, ``created``, usage and finish reasons.
tests/test_clients_frameworks74.py drives the libraries themselves (``.ci/clients``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import needs
from test_server_support import MODEL, live_fixture  # noqa: F401 - the ``live`` fixture

httpx = needs.module("httpx", "server")
pydantic = needs.module("pydantic", "server")

from openai.types import Completion  # noqa: E402 - after the extra's check
from openai.types.chat import ChatCompletion, ChatCompletionChunk  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

TIMEOUT_S = 30.0
BODIES = json.loads((Path(__file__).parent / "data" / "clients74" / "bodies.json")
                    .read_text(encoding="utf-8"))
LIBRARIES = sorted(k for k in BODIES if not k.startswith("_"))
CASES = [(library, i) for library in LIBRARIES for i in range(len(BODIES[library]))]
CHAT_FINISH = {"stop", "length", "tool_calls"}
ADAPTERS = {t: pydantic.TypeAdapter(t) for t in (Completion, ChatCompletion, ChatCompletionChunk,
                                                 Response, ResponseStreamEvent)}


def strict(kind, text: str, tolerated: tuple[tuple, ...] = ()):
    """``text`` validated as the SDK's ``kind`` in strict mode; the errors whose location
    starts with one of ``tolerated`` (where the SDK's type is narrower than OpenAI's own
    answers: an echoed prompt's first logprob is null, a streamed completion's chunk has no
    finish_reason yet) are not failures."""
    try:
        return ADAPTERS[kind].validate_json(text, strict=True)
    except pydantic.ValidationError as err:
        left = [e for e in err.errors()
                if not any(e["loc"][:len(t)] == t and e["input"] is None for t in tolerated)]
        assert not left, f"{kind.__name__}: {left}\n{text[:400]}"
        return json.loads(text)


def sse_data(text: str) -> list[str]:
    """The ``data`` of each event of an SSE body: every event one ``data:`` line (after an
    ``event:`` line on /v1/responses), each ended by a blank line."""
    assert text.endswith("\n\n"), repr(text[-40:])
    out = []
    for block in text[:-2].split("\n\n"):
        lines = block.split("\n")
        if lines[0].startswith("event: "):
            name, lines = lines[0].removeprefix("event: "), lines[1:]
            assert json.loads(lines[0].removeprefix("data: "))["type"] == name, block[:200]
        assert len(lines) == 1 and lines[0].startswith("data: "), block[:200]
        out.append(lines[0].removeprefix("data: "))
    return out


def check_created(created: int) -> None:
    assert isinstance(created, int) and abs(created - time.time()) < 3600


def completion_tolerated(index_count: int, streamed: bool) -> tuple[tuple, ...]:
    out: list[tuple] = []
    for i in range(index_count):
        out += [("choices", i, "logprobs", "token_logprobs", 0),
                ("choices", i, "logprobs", "top_logprobs", 0)]
        if streamed:
            out.append(("choices", i, "finish_reason"))
    return tuple(out)


def check_chat(body: dict, r) -> None:
    if body.get("stream"):
        data = sse_data(r.text)
        assert data[-1] == "[DONE]"
        chunks = [strict(ChatCompletionChunk, d) for d in data[:-1]]
        assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
        assert {c.created for c in chunks} == {chunks[0].created}
        check_created(chunks[0].created)
        if (body.get("stream_options") or {}).get("include_usage"):
            last, chunks = chunks[-1], chunks[:-1]
            assert last.choices == [] and last.usage is not None
            assert last.usage.prompt_tokens + last.usage.completion_tokens == \
                last.usage.total_tokens
        assert all(c.usage is None for c in chunks)
        finished: dict[int, str] = {}
        for chunk in chunks:
            for choice in chunk.choices:
                assert choice.index not in finished
                if choice.finish_reason is not None:
                    finished[choice.index] = choice.finish_reason
        assert sorted(finished) == list(range(body.get("n") or 1))
        assert set(finished.values()) <= CHAT_FINISH
        return
    answer = strict(ChatCompletion, r.text)
    assert answer.id.startswith("chatcmpl-") and answer.model == MODEL
    check_created(answer.created)
    assert [c.index for c in answer.choices] == list(range(body.get("n") or 1))
    usage = answer.usage
    assert usage.prompt_tokens > 0
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    for choice in answer.choices:
        assert choice.finish_reason in CHAT_FINISH
        if choice.finish_reason == "tool_calls":
            assert choice.message.tool_calls and choice.message.content is None
        if (body.get("response_format") or {}).get("type") == "json_schema" \
                and choice.finish_reason == "stop":
            json.loads(choice.message.content)  # the grammar's: whole JSON


def check_completions(body: dict, r) -> None:
    prompt = body["prompt"]
    prompts = len(prompt) if isinstance(prompt, list) and prompt and \
        isinstance(prompt[0], (str, list)) else 1
    choices = prompts * (body.get("n") or 1)
    if body.get("stream"):
        data = sse_data(r.text)
        assert data[-1] == "[DONE]"
        tolerated = completion_tolerated(choices, streamed=True)
        chunks = [strict(Completion, d, tolerated) for d in data[:-1]]
        ids = {c["id"] if isinstance(c, dict) else c.id for c in chunks}
        assert len(ids) == 1 and ids.pop().startswith("cmpl-")
        return
    answer = strict(Completion, r.text, completion_tolerated(choices, streamed=False))
    answer = answer if isinstance(answer, dict) else answer.model_dump()
    assert answer["id"].startswith("cmpl-")
    check_created(answer["created"])
    assert len(answer["choices"]) == choices
    usage = answer["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == usage["total_tokens"]
    for choice in answer["choices"]:
        assert choice["finish_reason"] in {"stop", "length"}
        if body.get("echo") and body.get("logprobs") is not None:
            lp = choice["logprobs"]
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert len(lp["tokens"]) == len(lp["text_offset"]) == len(lp["token_logprobs"])


def check_responses(body: dict, r) -> None:
    if body.get("stream"):
        events = [strict(ResponseStreamEvent, d) for d in sse_data(r.text)]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert events[0].type == "response.created"
        terminal = [e for e in events if e.type in ("response.completed",
                                                     "response.incomplete", "response.failed")]
        assert terminal == [events[-1]] and terminal[0].type != "response.failed"
        answer = terminal[0].response
    else:
        answer = strict(Response, r.text)
    assert answer.id.startswith("resp_") and answer.status in ("completed", "incomplete")
    check_created(int(answer.created_at))
    usage = answer.usage
    assert usage.input_tokens + usage.output_tokens == usage.total_tokens


@pytest.mark.parametrize(("library", "i"), CASES)
def test_each_clients_recorded_request_is_answered_as_it_reads_it(live, library, i):
    """(Not a defect: pins what held.) Every request the libraries sent, with the headers they
    sent, is answered with the status it got when recorded, every answer and chunk valid as the
    SDK's strict types, one id per answer, its usage adding up, each choice ended once."""
    server, _, _ = live
    row = BODIES[library][i]
    r = httpx.post(f"{server.url}{row['path']}", content=json.dumps(row["body"]),
                   headers=row["headers"], timeout=TIMEOUT_S)
    assert r.status_code == row["status"], r.text
    if r.status_code != 200:
        error = r.json()["error"]
        assert error["param"] == row["param"] and row["param"] in error["message"]
        assert error["type"] == "invalid_request_error"
        return
    {"/v1/chat/completions": check_chat, "/v1/completions": check_completions,
     "/v1/responses": check_responses}[row["path"]](row["body"], r)


def test_the_recorded_requests_cover_every_library_and_what_they_send():
    """The data holds what the probe saw each library send: a re-record that lost a library or
    a field fails here, not silently."""
    assert LIBRARIES == ["autogen", "dspy", "haystack", "langgraph", "mirascope", "openai_sdk"]
    rows = [row for library in LIBRARIES for row in BODIES[library]]
    agents = {row["headers"].get("user-agent", "").split("/")[0] for row in rows}
    assert {"lm15", "DSPy", "OpenAI"} <= agents  # DSPy's own stdlib client among them
    sent = {key for row in rows for key in row["body"]}
    assert {"max_completion_tokens", "max_tokens", "response_format", "tools", "tool_choice",
            "stream_options", "n", "logprobs", "top_logprobs", "echo", "suffix", "best_of",
            "user", "metadata", "store", "service_tier", "prediction", "modalities", "audio",
            "parallel_tool_calls", "include", "max_output_tokens",
            "prompt_cache_key", "safety_identifier", "reasoning_effort", "top_k", "min_p",
            "repetition_penalty", "ignore_eos"} <= sent
    prompts = [row["body"]["prompt"] for row in rows if row["path"] == "/v1/completions"]
    assert any(isinstance(p, list) and p and isinstance(p[0], int) for p in prompts)
    assert any(isinstance(p, list) and p and isinstance(p[0], list) for p in prompts)
    roles = {m["role"] for row in rows for m in row["body"].get("messages", ())}
    assert {"system", "user", "assistant", "tool"} <= roles
    paths = {row["path"] for row in rows}
    assert paths == {"/v1/chat/completions", "/v1/completions", "/v1/responses"}


def test_a_response_echoes_the_hints_it_was_given_and_when_it_completed(live):
    """A Response echoes the request's ``top_logprobs`` (honoured: each token carries that many
    alternatives, fewer where a grammar allows fewer), ``prompt_cache_key``,
    ``prompt_cache_retention`` and ``safety_identifier`` as OpenAI's does, and a completed one
    says when (``completed_at``); an incomplete one has none. Until stop 74 the four were
    absent, so ``response.top_logprobs`` read None after asking for 3 (haystack's and the
    Agents SDK's response metadata), and ``completed_at`` was never set."""
    server, client, _ = live
    before = int(time.time())
    asked = dict(model=MODEL, input="hi", top_logprobs=3, prompt_cache_key="k",
                 prompt_cache_retention="in-memory", safety_identifier="s")
    cut = client.responses.create(max_output_tokens=4, **asked)
    assert cut.status == "incomplete" and cut.completed_at is None
    whole = client.responses.create(max_output_tokens=16, text={"format": {
        "type": "json_schema", "name": "b", "schema": {"type": "boolean"}}}, **asked)
    assert whole.status == "completed"
    for response in (cut, whole):
        assert (response.top_logprobs, response.prompt_cache_key,
                response.prompt_cache_retention, response.safety_identifier) == \
            (3, "k", "in_memory", "s")
    tokens = cut.output[0].content[0].logprobs
    assert tokens and all(len(t.top_logprobs) == 3 for t in tokens)
    assert before <= whole.completed_at <= time.time() + 1
    strict(Response, whole.model_dump_json(by_alias=True))
    r = httpx.post(f"{server.url}/v1/responses", json=dict(asked, max_output_tokens=4,
                                                            stream=True), timeout=TIMEOUT_S)
    events = [json.loads(d) for d in sse_data(r.text)]
    assert events[0]["response"]["completed_at"] is None
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["top_logprobs"] == 3
    plain = client.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    assert (plain.top_logprobs, plain.prompt_cache_key, plain.safety_identifier) == \
        (None, None, None)
