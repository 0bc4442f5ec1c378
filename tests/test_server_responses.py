"""Stop 63: OpenAI's Responses API (``POST /v1/responses``, drivers/serving/responses_api.py),
on the chat path, against a live loopback server on the synthetic model, with the official
``openai`` SDK unmodified (``responses.create``, ``create(stream=True)``,
``responses.stream``, ``responses.parse``, a tool round-trip) and raw httpx for the events'
order and the refusals. Before: every call was a 404 (no such route). Replies are checked
against the numpy oracle's greedy tokens, or against the chat route's answer to the same
conversation. Client timeout 10 s, no retries."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from fastapi.testclient import TestClient
from openai.types.responses import ResponseFailedEvent

from calexec.drivers.calrt.runtime import Fault, FaultMode
from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    MODEL,
    metric_total,
    metric_value,
    openai_server,
    oracle_tokens,
    started_executor,
    wait_for,
)

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as served:
        yield served


def _reply(text: str, n: int) -> str:
    """The greedy reply the plain chat template gives to ``text`` (its rendered messages)."""
    return tokenizer.decode(oracle_tokens(tokenizer.encode(text + "assistant:"), n))


def _events(text: str) -> list[tuple[str, dict]]:
    """(event name, data) of each SSE event of a Responses stream."""
    return [(name, json.loads(data)) for name, data in
            re.findall(r"event: (\S+)\ndata: (\{.*?\})\n\n", text)]


class Person(pydantic.BaseModel):
    # bounded: the synthetic model's random weights never close an unbounded string
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 12}},
                          "required": ["city"], "additionalProperties": False}}


# ---- the SDK ------------------------------------------------------------------------------------
def test_create_answers_a_response_object_the_sdk_reads(live):
    _, client, _ = live
    r = client.responses.create(model=MODEL, input="Hello", instructions="Be terse.",
                                max_output_tokens=5, metadata={"k": "v"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.output_text == _reply("system: Be terse.\nuser: Hello\n", 5)
    # the synthetic model never ends on its own: max_output_tokens cut it
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    assert item.content[0].type == "output_text"
    prompt = len(tokenizer.encode("system: Be terse.\nuser: Hello\nassistant:"))
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (
        prompt, 5, prompt + 5)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.instructions, r.max_output_tokens, r.metadata, r.user) == (
        "Be terse.", 5, {"k": "v"}, "u1")
    assert r.tool_choice == "auto" and r.tools == [] and r.store is False


def test_input_items_with_parts_and_roles_render_as_chat_messages(live):
    _, client, _ = live
    r = client.responses.create(model=MODEL, max_output_tokens=4, input=[
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Part one."}, {"type": "input_text", "text": "Two."}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Ok."}]},
        {"role": "user", "content": "Go"}])
    assert r.output_text == _reply(
        "developer: Rules.\nuser: Part one.\nTwo.\nassistant: Ok.\nuser: Go\n", 4)


def test_create_stream_sends_the_semantic_events_in_order(live):
    _, client, _ = live
    events = list(client.responses.create(model=MODEL, input="Hello", max_output_tokens=4,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     *["response.output_text.delta"] * 4, "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == _reply("user: Hello\n", 4)
    last = events[-1].response
    assert last.output_text == text and last.usage.output_tokens == 4
    assert last.incomplete_details.reason == "max_output_tokens"
    assert len({e.response.id for e in events if hasattr(e, "response")}) == 1


def test_responses_stream_helper_and_parse_give_the_parsed_model(live):
    _, client, _ = live
    with client.responses.stream(model=MODEL, input="Invent a person.", text_format=Person,
                                 max_output_tokens=200) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and isinstance(final.output_parsed, Person)
    assert "".join(deltas) == final.output_text
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person,
                                    max_output_tokens=200)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    assert parsed.output_parsed == final.output_parsed  # greedy: the same person
    assert parsed.text.format.type == "json_schema"


def test_a_tool_round_trip_answers_as_chat_does(live):
    """A function call (tool_choice required), then its output sent back as
    ``function_call_output`` with the call item the SDK returned (with ``parsed_arguments``,
    as responses.parse returns it): the second turn's answer is the chat route's to the same
    conversation."""
    server, client, _ = live
    first = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER],
                                    tool_choice="required", max_output_tokens=200)
    [call] = first.output
    assert first.status == "completed" and call.type == "function_call"
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    assert call.id.startswith("fc_") and isinstance(json.loads(call.arguments)["city"], str)
    # the item as responses.parse returns it (its parse of the arguments: ignored)
    sent_back = {**call.model_dump(exclude_unset=True),
                 "parsed_arguments": json.loads(call.arguments)}
    second = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=6,
        input=[{"role": "user", "content": "Weather in Paris?"}, sent_back,
               {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}])
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=TIMEOUT_S, json={
        "max_tokens": 6, "tools": [{"type": "function", "function": {
            k: v for k, v in WEATHER.items() if k != "type"}}],
        "messages": [{"role": "user", "content": "Weather in Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": call.call_id, "type": "function", "function": {
                             "name": call.name, "arguments": call.arguments}}]},
                     {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny."}]})
    assert chat.status_code == 200, chat.text
    assert second.output_text == chat.json()["choices"][0]["message"]["content"]


def test_a_named_tool_choice_streams_the_function_call_events(live):
    server, _, _ = live
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
            "input": "Weather?", "tools": [WEATHER], "stream": True, "max_output_tokens": 200,
            "tool_choice": {"type": "function", "name": "get_weather"}}) as r:
        events = _events(r.read().decode())
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    assert all(data["type"] == kind for kind, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    args = "".join(d["delta"] for k, d in events if k.endswith("arguments.delta"))
    done = events[-1][1]["response"]
    assert done["output"][0]["arguments"] == args == events[-3][1]["arguments"]
    assert done["output"][0]["id"] == events[2][1]["item"]["id"]
    assert done["tool_choice"] == {"type": "function", "name": "get_weather"}


# ---- refusals and the stored-response routes -------------------------------------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input.0.content.0.type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input.0.type"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"bogus": 1}, "bogus"),
])
def test_what_is_not_supported_is_refused_naming_the_field(live, extra, param):
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", extra_body=extra)
    assert caught.value.param == param, caught.value.body
    assert param.split(".")[0] in caught.value.message


def test_store_true_is_accepted_and_nothing_is_kept(live):
    server, client, _ = live
    r = client.responses.create(model=MODEL, input="x", store=True, max_output_tokens=1)
    assert r.status == "incomplete" and r.store is False
    for method in ("GET", "DELETE"):
        got = httpx.request(method, f"{server.url}/v1/responses/{r.id}", timeout=TIMEOUT_S)
        assert got.status_code == 404, got.text
        assert r.id in got.json()["error"]["message"]
        assert got.json()["error"]["param"] == "response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


# ---- the chat path's behaviour, kept ---------------------------------------------------------
def test_a_deadline_mid_stream_ends_with_response_failed(live):
    server, _, _ = live
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=30, json={
            "input": "x", "stream": True, "max_output_tokens": 30000, "timeout": 0.5}) as r:
        assert r.status_code == 200
        events = _events(r.read().decode())
    kind, data = events[-1]
    assert kind == "response.failed" and data["response"]["status"] == "failed"
    error = data["response"]["error"]
    # the documented shape (stop 63, responses second: the code was chat's, "request.deadline",
    # outside the documented codes, which a validating client refuses): validated as the SDK
    # types it, chat's code kept in the message, its error type in ``type``
    failed = ResponseFailedEvent.model_validate(data)
    assert failed.response.error.code == "server_error" and error["type"] == "timeout_error"
    assert error["message"].startswith("request timeout=0.5 s passed")
    assert error["message"].endswith(".deadline)")
    assert any(k == "response.output_text.delta" for k, _ in events)


def test_a_failed_stream_says_the_tokens_it_used(live):
    """``response.failed`` carried ``usage: null`` (the chat stream's usage came only with its
    last chunk, which a failed stream never sends): now the usage so far, as OpenAI's failed
    response carries it (the SDK's ``ResponseUsage``): the prompt's tokens and at least one
    output token per text delta sent."""
    server, _, _ = live
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=30, json={
            "input": "x", "stream": True, "max_output_tokens": 30000, "timeout": 0.5}) as r:
        assert r.status_code == 200
        events = _events(r.read().decode())
    kind, data = events[-1]
    assert kind == "response.failed", kind
    usage = ResponseFailedEvent.model_validate(data).response.usage
    assert usage is not None, data["response"]
    deltas = sum(k == "response.output_text.delta" for k, _ in events)
    assert usage.input_tokens == len(tokenizer.encode("user: x\nassistant:")), usage
    assert usage.output_tokens >= deltas > 0, (usage, deltas)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_a_deadline_of_a_whole_answer_is_the_chat_routes_504(live):
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=30, json={
        "input": "x", "max_output_tokens": 30000, "timeout": 0.5})
    assert r.status_code == 504 and r.json()["error"]["code"].endswith(".deadline"), r.text
    assert r.headers["x-should-retry"] == "false"


def test_a_client_gone_mid_stream_gives_back_its_sequence(live):
    server, _, service = live
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
            "input": "x", "stream": True, "max_output_tokens": 30000}) as r:
        for line in r.iter_lines():
            if line.startswith("event: response.output_text.delta"):
                break
    wait_for(lambda: service.sequences.in_use == 0, what="the sequence given back")


def test_requests_are_counted_as_chat_requests_are(live):
    server, client, _ = live
    before = httpx.get(f"{server.url}/metrics").text
    ok0 = metric_value(before, "calexec_request_success_total",
                       {"finished_reason": "length"}) or 0
    # (summed over the codes: a refusal of another code counted before this test, e.g. the
    # max_output_tokens one of the parametrised refusals on the same xdist worker, is a
    # series of its own, and metric_value answered the first series alone)
    bad0 = metric_total(before, "calexec_request_failures_total",
                        {"category": "invalid_request"})
    client.responses.create(model=MODEL, input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", background=True)
    after = httpx.get(f"{server.url}/metrics").text
    assert metric_value(after, "calexec_request_success_total",
                        {"finished_reason": "length"}) == ok0 + 1
    assert metric_total(after, "calexec_request_failures_total",
                        {"category": "invalid_request"}) == bad0 + 1


def test_kv_exhausted_is_429_with_retry_after(tmp_path):
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig())
        executor.device.emu.set_fault(Fault.CAN_ALLOCATE_FALSE, FaultMode.ALWAYS, 1)
        with TestClient(app) as client:
            r = client.post("/v1/responses", json={"input": "x", "max_output_tokens": 1,
                                                   "timeout": 0.2})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["status"]["code"] == "kv.deadline"
    finally:
        executor.shutdown(5.0)


# ---- stop 63 (responses second): what a Responses client is told --------------------------------
@pytest.mark.parametrize(("extra", "param"), [
    ({"tools": [{"type": "function"}]}, "tools.0.name"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "strin"},
                          "strict": True}}}, "text.format.schema"),
    ({"input": "a" * 41000}, "input"),  # the context: its default max_output_tokens
    ({"input": "a" * 41000, "max_output_tokens": 1}, "input"),  # the context, at admission
])
def test_errors_speak_of_the_responses_fields_never_of_chat_s(live, extra, param):
    """Stop 63: the param was the Responses field but the message spoke of the chat request the
    body was translated into (``tools.0.function.name``, ``tool_choice.function.name``,
    ``response_format.json_schema.schema``, "your messages take ... tokens", "the prompt or
    messages"), fields a Responses client never sent."""
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S,
                   json={"input": "x", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    for chat_word in ("messages", "max_tokens", "max_completion_tokens", "response_format",
                      "function."):
        assert chat_word not in error["message"], error["message"]
        assert chat_word not in r.json()["status"]["message"]
    assert param.split(".")[0] in error["message"]


@pytest.mark.parametrize(("extra", "param"), [
    ({"background": 0}, "background"),  # 0 == False: taken for "not in the background"
    ({"background": "false"}, "background"),
    ({"top_logprobs": False}, "top_logprobs"),  # False == 0
    ({"top_logprobs": 0.0}, "top_logprobs"),
    ({"service_tier": 1}, "service_tier"),
    ({"service_tier": "bogus"}, "service_tier"),  # the SDK's values, as chat checks them
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"stream": True, "stream_options": {"include_usage": True}},
     "stream_options.include_usage"),
])
def test_a_wrong_value_of_a_neutral_field_is_refused_naming_it(live, extra, param):
    """Stop 63 (responses second): the fields accepted because they change nothing here were
    taken whatever their value: ``background: 0`` and ``top_logprobs: false`` (equal to
    False and 0 in Python); an unknown ``stream_options`` key was refused naming only
    ``stream_options``."""
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S,
                   json={"input": "x", "max_output_tokens": 1, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert param.split(".")[-1] in r.json()["error"]["message"]


def test_the_documented_values_of_the_neutral_fields_are_accepted(live):
    server, _, _ = live
    # the SDK's values (openai 3.51: service tiers "fast", "ultrafast"; retention "in_memory")
    for tier in ("auto", "default", "flex", "scale", "priority", "fast", "ultrafast"):
        for retention in ("in_memory", "in-memory", "24h"):
            r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
                "input": "x", "max_output_tokens": 1, "service_tier": tier, "background": False,
                "prompt_cache_retention": retention, "top_logprobs": 0,
                "prompt_cache_options": {"ttl": "30m"}})
            assert r.status_code == 200, r.text
            assert r.json()["service_tier"] == "default"


# the bodies the OpenAI Agents SDK (openai-agents 0.24.0, OpenAIResponsesModel) sent for an
# Agent with a @function_tool and output_type=Person, ModelSettings(max_tokens=200,
# tool_choice="required", parallel_tool_calls=False), recorded from its httpx client (it needs
# urllib3>=2.8 and websockets<17, against constraints.txt's pins: not installed in CI)
AGENT_TOOL = {"name": "get_weather", "parameters": {
    "properties": {"city": {"maxLength": 8, "title": "City", "type": "string"}},
    "required": ["city"], "title": "get_weather_args", "type": "object",
    "additionalProperties": False}, "strict": True, "type": "function",
    "description": "The weather in a city."}
AGENT_TEXT = {"format": {"type": "json_schema", "name": "final_output", "schema": {
    "properties": {"name": {"maxLength": 12, "title": "Name", "type": "string"},
                   "age": {"maximum": 150, "minimum": 0, "title": "Age", "type": "integer"}},
    "required": ["name", "age"], "title": "Person", "type": "object",
    "additionalProperties": False}, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_the_agents_sdk_s_recorded_turns_are_answered(live, stream):
    """Runner.run / Runner.run_streamed's turns: a required tool call, then (tool_choice
    reset, each call and its output sent back as the SDK sends them) until the structured
    answer (greedy: the same turns as the recorded run, a second call then the Person)."""
    server, _, _ = live
    first = {"model": MODEL, "include": [],
             "input": [{"content": "Weather in Paris?", "role": "user"}],
             "instructions": "Be terse.", "max_output_tokens": 200,
             "parallel_tool_calls": False, "text": AGENT_TEXT, "tool_choice": "required",
             "tools": [AGENT_TOOL], **({"stream": True} if stream else {})}

    def post(body: dict) -> dict:
        if not stream:
            r = httpx.post(f"{server.url}/v1/responses", json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
            return r.json()
        with httpx.stream("POST", f"{server.url}/v1/responses", json=body,
                          timeout=TIMEOUT_S) as r:
            assert r.status_code == 200
            events = _events(r.read().decode())
        assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
        assert events[-1][0] == "response.completed", events[-1]
        return events[-1][1]["response"]

    body, turns, history = first, 0, first["input"]
    while True:  # as Runner.run: each call's output sent back, until a final output
        done = post(body)
        turns += 1
        assert done["status"] == "completed", done
        calls = [item for item in done["output"] if item["type"] == "function_call"]
        if not calls:
            break
        assert turns < 4, "no final output in 3 turns"
        [call] = calls  # parallel_tool_calls false: one
        city = json.loads(call["arguments"])["city"]
        sent_back = {k: call[k] for k in ("arguments", "call_id", "name", "type", "id", "status")}
        body = {k: v for k, v in first.items() if k != "tool_choice"}  # reset after a call
        body["input"] = [*history, sent_back, {
            "call_id": call["call_id"], "output": f"Sunny in {city}.",  # the tool's answer
            "type": "function_call_output"}]
        history = body["input"]
    [message] = done["output"]
    assert turns > 1 and message["type"] == "message"
    assert isinstance(Person.model_validate_json(message["content"][0]["text"]), Person)


@pytest.mark.parametrize("tools", [[WEATHER], None])
def test_an_unknown_tool_choice_is_told_the_responses_shape(live, tools):
    """Stop 63 (responses second): ``tool_choice: "bogus"`` was told chat's shape of a named
    choice (``{"type": "function", "function": {"name": ...}}``, which /v1/responses refuses),
    or, without tools, that it "needs tools", as if the value were right."""
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
        "input": "x", "tool_choice": "bogus", **({"tools": tools} if tools else {})})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "tool_choice" and "bogus" in error["message"]
    assert '{"type": "function", "name": ...}' in error["message"], error["message"]
    assert '"function": {' not in error["message"] and "needs tools" not in error["message"]


@pytest.mark.parametrize(("item", "param"), [
    ({"type": "message", "role": "user", "content": "a", "status": 5}, "input.0.status"),
    ({"type": "message", "role": "user", "content": "a", "id": ["m"]}, "input.0.id"),
    ({"type": "function_call_output", "call_id": "c", "output": "o", "status": "done"},
     "input.0.status"),
])
def test_an_item_s_id_or_status_of_the_wrong_kind_is_refused(live, item, param):
    """Stop 63 (responses second): an input item's ``id`` and ``status`` (the SDK sends its
    output items back with them) were ignored whatever they held."""
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S,
                   json={"input": [item], "max_output_tokens": 1})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


# ---- stop 63 (clients third): verbosity and metadata ---------------------------------------
def test_the_default_verbosity_is_accepted_and_another_refused_naming_it(live):
    """``text.verbosity`` (chat's ``verbosity``) was refused even at its default "medium",
    which the Agents SDK sends when ModelSettings.verbosity is set: "medium" (and null) are
    taken and echoed; "low"/"high" are 400s naming the field, its value and why."""
    server, client, _ = live
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                text={"verbosity": "medium"})
    assert r.text is not None and r.text.verbosity == "medium"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "x"}],
                                          max_completion_tokens=1, verbosity="medium")
    assert chat.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", text={"verbosity": "low"})
    assert caught.value.param == "text.verbosity"
    assert "'low'" in caught.value.message or '"low"' in caught.value.message
    assert "medium" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       verbosity="high")
    assert caught.value.param == "verbosity" and "medium" in caught.value.message


@pytest.mark.parametrize(("metadata", "param", "says"), [
    ({f"k{i}": "v" for i in range(17)}, "metadata", "17 pairs"),
    ({"k" * 65: "v"}, "metadata." + "k" * 65, "65 characters"),
    ({"tag": "v" * 513}, "metadata.tag", "513 characters"),
])
@pytest.mark.parametrize("route", ["responses", "chat"])
def test_metadata_past_openais_limits_is_refused_naming_the_key(live, metadata, param, says,
                                                                route):
    """OpenAI's ``metadata`` (Responses and chat): at most 16 pairs, keys of at most 64
    characters, values of at most 512. Taken whatever its size before: tags OpenAI refuses
    worked here only. The limits themselves are accepted."""
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as caught:
        if route == "responses":
            client.responses.create(model=MODEL, input="x", metadata=metadata)
        else:
            client.chat.completions.create(model=MODEL, metadata=metadata,
                                           messages=[{"role": "user", "content": "x"}])
    assert caught.value.param == param and says in caught.value.message, caught.value.body
    at_limits = {f"k{i}": "v" for i in range(15)} | {"k" * 64: "v" * 512}
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=1,
                                metadata=at_limits)
    assert r.metadata == at_limits
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                   max_completion_tokens=1, metadata=at_limits)


# ---- stop 63 (clients third): logprobs -------------------------------------------------------
LOGPROBS = "message.output_text.logprobs"


def test_logprobs_are_the_chat_routes_on_the_output_text(live):
    """``include=["message.output_text.logprobs"]`` and ``top_logprobs`` were 400s: now the
    output text's part carries chat's logprobs of the same request (token, logprob, bytes,
    top_logprobs), in the SDK's types, the bytes writing the text."""
    _, client, _ = live
    r = client.responses.create(model=MODEL, input="x", max_output_tokens=6, include=[LOGPROBS],
                                top_logprobs=2)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "x"}],
                                          max_completion_tokens=6, logprobs=True,
                                          top_logprobs=2)
    expected = [e.model_dump() for e in chat.choices[0].logprobs.content]
    part = r.output[0].content[0]
    assert part.logprobs is not None and len(part.logprobs) == 6
    assert [e.model_dump() for e in part.logprobs] == expected
    assert all(len(e.top_logprobs) == 2 for e in part.logprobs)
    assert bytes(b for e in part.logprobs for b in e.bytes).decode() == r.output_text
    # include alone: the token's own logprob, no top tokens; neither: none at all
    alone = client.responses.create(model=MODEL, input="x", max_output_tokens=6,
                                    include=[LOGPROBS])
    assert [e.logprob for e in alone.output[0].content[0].logprobs] == \
        [e["logprob"] for e in expected]
    assert all(e.top_logprobs == [] for e in alone.output[0].content[0].logprobs)
    plain = client.responses.create(model=MODEL, input="x", max_output_tokens=6)
    assert plain.output[0].content[0].logprobs == []


def test_streamed_logprobs_ride_the_text_deltas_and_add_up_to_the_whole(live):
    """Streamed, each ``response.output_text.delta`` carries its tokens' logprobs (every event
    validated as the SDK types it); together, and on the done events and the completed
    Response, they are the whole answer's."""
    server, client, _ = live
    from openai.types.responses import Response, ResponseStreamEvent
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    whole = client.responses.create(model=MODEL, input="x", max_output_tokens=6,
                                    include=[LOGPROBS], top_logprobs=3)
    expected = [e.model_dump() for e in whole.output[0].content[0].logprobs]
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
            "input": "x", "stream": True, "max_output_tokens": 6, "include": [LOGPROBS],
            "top_logprobs": 3}) as r:
        assert r.status_code == 200
        events = _events(r.read().decode())
    for _, data in events:
        adapter.validate_python(data)
    deltas = [e for k, d in events if k == "response.output_text.delta" for e in d["logprobs"]]
    assert deltas == expected
    done = next(d for k, d in events if k == "response.output_text.done")
    assert done["logprobs"] == expected
    final = Response.model_validate(events[-1][1]["response"])
    assert [e.model_dump() for e in final.output[0].content[0].logprobs] == expected


@pytest.mark.parametrize(("include", "param"), [
    (["bogus"], "include.0"),  # (reasoning.encrypted_content, ...: accepted, nothing to add)
    ([LOGPROBS, "file_search_call.result"], "include.1"),
    ("message.output_text.logprobs", "include"),
])
def test_an_include_this_server_cannot_give_is_refused_naming_it(live, include, param):
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S,
                   json={"input": "x", "max_output_tokens": 1, "include": include})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_the_response_and_its_events_validate_as_the_sdks_types(live):
    """The usage lacked ``input_tokens_details.cache_write_tokens``, which the SDK's
    ``ResponseUsage`` (openai 3.51) requires: the SDK builds its objects without validating, so
    ``responses.create`` read it, but a client validating the JSON (``Response.model_validate``,
    as a typed proxy or a recorded-turn replay does) was refused every Response and the
    completed/incomplete events. Now each one validates, whole and streamed."""
    server, _, _ = live
    from openai.types.responses import Response, ResponseStreamEvent
    r = httpx.post(f"{server.url}/v1/responses", timeout=TIMEOUT_S,
                   json={"input": "x", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())
    assert response.usage is not None and response.usage.input_tokens_details.cached_tokens == 0
    with httpx.stream("POST", f"{server.url}/v1/responses", timeout=TIMEOUT_S, json={
            "input": "x", "stream": True, "max_output_tokens": 2}) as streamed:
        events = _events(streamed.read().decode())
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    kinds = [type(adapter.validate_python(data)).__name__ for _, data in events]
    assert kinds[-1] == "ResponseIncompleteEvent"


def test_the_text_s_logprobs_stop_where_its_bytes_end():
    """Before tool calls, the message's logprobs are the tokens that wrote its text, not the
    calls' markup (a whole answer's chat logprobs hold every token)."""
    from calexec.drivers.serving.responses_api import text_logprobs
    entries = [{"token": t, "bytes": list(t.encode())} for t in ("Hi", " é", "\n<tool_call>")]
    assert text_logprobs(entries, "Hi é") == entries[:2]
    assert text_logprobs(entries, "") == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_cut_at_max_output_tokens_is_incomplete_not_completed(live, stream):
    """A function call whose arguments the output's maximum cut (``{"city":"N÷N~``, no
    whole JSON) said ``status: "completed"``: a client trusting it ran the function on
    arguments that do not parse. Now "incomplete", whole and streamed; a call that ends
    within the budget stays "completed"."""
    server, _, _ = live
    from openai.types.responses import Response
    tool = {"type": "function", "name": "echo", "parameters": {
        "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}
    statuses = {}
    for budget in (4, 200):
        body = {"input": "x", "tools": [tool], "stream": stream, "max_output_tokens": budget,
                "tool_choice": {"type": "function", "name": "echo"}}
        if stream:
            with httpx.stream("POST", f"{server.url}/v1/responses", timeout=30,
                              json=body) as r:
                events = _events(r.read().decode())
            response = Response.model_validate(events[-1][1]["response"])
            done = [d["item"] for k, d in events if k == "response.output_item.done"]
            assert [item["status"] for item in done] == [o.status for o in response.output]
        else:
            r = httpx.post(f"{server.url}/v1/responses", timeout=30, json=body)
            response = Response.model_validate(r.json())
        [call] = [o for o in response.output if o.type == "function_call"]
        statuses[budget] = (response.status, call.status)
        try:
            json.loads(call.arguments)
            whole = True
        except ValueError:
            whole = False
        assert (call.status == "completed") == whole, call
    assert statuses[4] == ("incomplete", "incomplete")
