"""Issue 27 part A: structured outputs and tools through llguidance (drivers/serving/grammar.py).

On the synthetic model (random weights) the output is forced valid by the grammar's token mask
on the FP32 row: every response parses against its JSON schema (hypothesis over a family of
schemas; each answer checked by :func:`conforms`, a reference checker of that family written
here), streams concatenate to the same, tool calls parse against the tool's parameters, the
official SDK's ``chat.completions.parse`` with a pydantic model works, bad schemas are 400s
naming the field. Without llguidance (the ``[server]`` extra) the tests that need it skip with
the reason (fail under CALEXEC_REQUIRE_TOOLS=1) and the fields answer 400 naming the package.

CI-sized: ``CALEXEC_STRUCTURED_EXAMPLES`` (default 10) schemas per hypothesis test.
"""

from __future__ import annotations

import datetime
import decimal
import enum
import json
import math
import os
import re
import sys
import uuid
from typing import Annotated, Any, Literal

import httpx
import numpy as np
import openai
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import needs
from calexec.drivers.serving import grammar, sampling
from calexec.drivers.serving.byte_tokenizer import ByteTokenizer
from calexec.drivers.serving.openai_api import ChatMessage, render_chat
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, started_executor, stream_tool_calls

MODEL = "calexec-qwen3-synthetic"
EXAMPLES = int(os.environ.get("CALEXEC_STRUCTURED_EXAMPLES", "10"))
MAX_TOKENS = 160  # the family below ends well within it


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        yield create_app(executor, ServerConfig())
    finally:
        executor.shutdown(5.0)


@pytest.fixture(scope="module")
def live(app):
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield server, client


@pytest.fixture()
def llguidance():
    return needs.module("llguidance", "server")


def post(server, body: dict[str, Any], path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def chat_body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "answer"}],
            "max_tokens": MAX_TOKENS, **fields}


def streamed(server, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed chat answer."""
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/chat/completions",
                      json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


# ---- a reference checker of the schema family -----------------------------------------------
def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """``value`` satisfies ``schema`` (the keywords the family below uses: type, enum,
    minimum/maximum, minLength/maxLength, pattern, items/minItems/maxItems, properties,
    required, additionalProperties false)."""
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return False
    elif kind == "number":
        if not isinstance(value, int | float) or isinstance(value, bool):
            return False
    elif kind == "boolean":
        return isinstance(value, bool)
    elif kind == "string":
        if not isinstance(value, str):
            return False
        if not schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", 1 << 30):
            return False
        return "pattern" not in schema or re.search(schema["pattern"], value) is not None
    elif kind == "array":
        if not isinstance(value, list):
            return False
        if not schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", 1 << 30):
            return False
        return all(conforms(v, schema["items"]) for v in value)
    elif kind == "object":
        if not isinstance(value, dict):
            return False
        props = schema.get("properties", {})
        if any(k not in value for k in schema.get("required", [])):
            return False
        if schema.get("additionalProperties") is False and set(value) - set(props):
            return False
        return all(conforms(v, props[k]) for k, v in value.items() if k in props)
    if kind in ("integer", "number"):
        return schema.get("minimum", -float("inf")) <= value <= schema.get("maximum", float("inf"))
    return True


def _bounds(draw, low: int, high: int) -> tuple[int, int]:
    a = draw(st.integers(low, high))
    return a, draw(st.integers(a, high))


@st.composite
def leaf_schemas(draw) -> dict[str, Any]:
    kind = draw(st.sampled_from(["integer", "number", "string", "pattern", "enum", "boolean"]))
    if kind == "integer":
        lo, hi = _bounds(draw, -1000, 1000)
        return {"type": "integer", "minimum": lo, "maximum": hi}
    if kind == "number":
        lo, hi = _bounds(draw, -50, 50)
        return {"type": "number", "minimum": lo, "maximum": hi}
    if kind == "string":
        lo, hi = _bounds(draw, 0, 6)
        return {"type": "string", "minLength": lo, "maxLength": hi}
    if kind == "pattern":
        return {"type": "string", "pattern": draw(st.sampled_from(
            ["^[a-z]{1,4}$", "^[0-9]{3}-[0-9]{2}$", "^(yes|no)$", "^[A-F0-9]{2,6}$"]))}
    if kind == "enum":
        return {"type": "string", "enum": draw(st.lists(
            st.text("abcxyz_", min_size=1, max_size=5), min_size=1, max_size=4, unique=True))}
    return {"type": "boolean"}


def _object(props: dict[str, Any], draw) -> dict[str, Any]:
    names = sorted(props)
    required = draw(st.lists(st.sampled_from(names), unique=True)) if names else []
    return {"type": "object", "properties": props, "required": sorted(required, key=names.index),
            "additionalProperties": False}


@st.composite
def schemas(draw) -> dict[str, Any]:
    """Objects with required and optional properties: leaves, arrays of leaves (1-3 items),
    one nested object."""
    names = draw(st.lists(st.sampled_from(["id", "name", "tags", "size", "ok", "inner"]),
                          min_size=1, max_size=4, unique=True))
    props: dict[str, Any] = {}
    for name in names:
        shape = draw(st.sampled_from(["leaf", "leaf", "array", "nested"]))
        if shape == "array":
            lo, hi = _bounds(draw, 0, 3)
            props[name] = {"type": "array", "items": draw(leaf_schemas()), "minItems": lo,
                           "maxItems": hi}
        elif shape == "nested":
            inner = {f"k{i}": draw(leaf_schemas()) for i in range(draw(st.integers(1, 2)))}
            props[name] = _object(inner, draw)
        else:
            props[name] = draw(leaf_schemas())
    return _object(props, draw)


def test_the_reference_checker_refuses_what_the_family_excludes():
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0,
                                                     "maximum": 3},
                                               "b": {"type": "string", "pattern": "^[a-z]{1,4}$"}},
              "required": ["a"], "additionalProperties": False}
    assert conforms({"a": 2, "b": "ab"}, schema)
    for bad in ({"a": 4}, {"b": "ab"}, {"a": 1, "b": "ABC"}, {"a": 1, "c": 0}, {"a": True},
                [1]):
        assert not conforms(bad, schema), bad


# ---- the mask on the row (sampling.py), against a reference computation ----------------------
class _Allowed:
    """A RowConstraint allowing a fixed set of tokens; records what it accepted."""

    def __init__(self, vocab: int, allowed: list[int]) -> None:
        self.mask = np.zeros(vocab, dtype=bool)
        self.mask[allowed] = True
        self.accepted: list[int] = []

    def allowed(self) -> np.ndarray:
        return self.mask

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    @property
    def finished(self) -> bool:
        return False


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 1 << 30), allowed=st.lists(st.integers(0, 63), min_size=1,
                                                       max_size=8, unique=True),
       temperature=st.sampled_from([0.0, 0.7, 1.3]), bias=st.integers(-5, 5))
def test_the_mask_sets_every_other_token_to_minus_infinity_before_the_choice(seed, allowed,
                                                                            temperature, bias):
    row = np.random.default_rng(seed).standard_normal(64).astype(np.float32)
    params = sampling.SamplingParams(temperature=temperature, seed=seed,
                                     logit_bias=((allowed[0], float(bias)),),
                                     grammar=_FixedGrammar())
    constraint = _Allowed(64, allowed)
    reference = np.full(64, -np.inf, dtype=np.float32)
    reference[allowed] = row[allowed]
    reference[allowed[0]] += np.float32(bias)
    got = sampling.process(row, params, constraint=constraint)
    assert np.array_equal(got, reference)
    token, _ = sampling.pick(row, params, 0, argmax=int(np.argmax(row)), constraint=constraint)
    assert token in allowed and constraint.accepted == [token]
    if temperature == 0.0:  # greedy: the masked row's argmax, never the raw one
        assert token == int(np.argmax(reference))
    else:  # one draw of [seed, index] over the masked row's softmax, by inverse CDF
        x = reference.astype(np.float64)
        probs = np.exp((x - x.max()) / temperature)
        u = np.random.default_rng([seed, 0]).random()
        assert token == int(np.searchsorted(np.cumsum(probs), u * probs.sum(), side="right"))


class _FixedGrammar:
    def start(self) -> _Allowed:
        return _Allowed(64, [0])


# ---- structured outputs: every answer parses against its schema ------------------------------
def _json_schema(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": strict}}


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas(), sampled=st.booleans(), seed=st.integers(0, 1 << 20))
def test_every_answer_parses_against_its_schema(live, llguidance, schema, sampled, seed):
    server, _ = live
    fields = {"temperature": 1.0, "seed": seed} if sampled else {}
    r = post(server, chat_body(response_format=_json_schema(schema), **fields))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", (schema, choice)
    value = json.loads(choice["message"]["content"])
    assert conforms(value, schema), (schema, value)


def test_without_the_grammar_the_synthetic_model_writes_no_json(live):
    """What the mask changes: the same request without response_format is not JSON (the
    synthetic model's weights are random), so the test above fails without the mask."""
    server, _ = live
    r = post(server, chat_body(max_tokens=24))
    assert r.status_code == 200, r.text
    with pytest.raises(ValueError):
        json.loads(r.json()["choices"][0]["message"]["content"])


@pytest.mark.parametrize("sampled", [False, True])
def test_a_stream_concatenates_to_the_whole_answer(live, llguidance, sampled):
    server, _ = live
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 5},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["name", "size", "tags"], "additionalProperties": False}
    body = chat_body(response_format=_json_schema(schema),
                     **({"temperature": 0.9, "seed": 11} if sampled else {}))
    whole = post(server, body).json()["choices"][0]
    chunks = streamed(server, body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == whole["message"]["content"]
    assert conforms(json.loads(text), schema)
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "stop"


def test_every_choice_of_n_and_of_a_prompt_list_follows_the_schema(live, llguidance):
    server, _ = live
    schema = {"type": "object", "properties": {"v": {"enum": ["a", "bb", "ccc"]},
                                               "n": {"type": "integer", "minimum": -5,
                                                     "maximum": 5}},
              "required": ["v", "n"], "additionalProperties": False}
    r = post(server, chat_body(response_format=_json_schema(schema), n=3, temperature=1.0,
                               seed=7))
    assert r.status_code == 200, r.text
    r2 = post(server, {"model": MODEL, "prompt": ["a", "b"], "max_tokens": 40,
                       "response_format": _json_schema(schema)}, "/v1/completions")
    assert r2.status_code == 200, r2.text
    texts = [c["message"]["content"] for c in r.json()["choices"]] + \
        [c["text"] for c in r2.json()["choices"]]
    assert len(texts) == 5
    for text in texts:
        assert conforms(json.loads(text), schema), text


def test_json_object_is_an_object_and_completions_take_response_format(live, llguidance):
    server, _ = live
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    r = post(server, {"model": MODEL, "prompt": "x", "max_tokens": 40,
                      "response_format": _json_schema(schema)}, "/v1/completions")
    assert r.status_code == 200, r.text
    assert conforms(json.loads(r.json()["choices"][0]["text"]), schema)
    # json_object: any object (the synthetic model's keys may run past max_tokens: then
    # only the start is an object's)
    r = post(server, chat_body(response_format={"type": "json_object"}, max_tokens=60))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["message"]["content"]), dict)
    else:
        assert choice["message"]["content"].startswith("{")


# ---- tools ----------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


def _check_calls(calls: list[dict[str, Any]]) -> None:
    assert calls
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name = call["function"]["name"]
        assert conforms(json.loads(call["function"]["arguments"]), SCHEMAS[name]), call


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "get_time"}}])
def test_a_forced_tool_call_parses_against_the_tools_parameters(live, llguidance, choice):
    server, _ = live
    r = post(server, chat_body(tools=[WEATHER, CLOCK], tool_choice=choice,
                               parallel_tool_calls=False))
    assert r.status_code == 200, r.text
    result = r.json()["choices"][0]
    # OpenAI's: a named function's calls end "stop", "required" ones "tool_calls"
    assert result["finish_reason"] == ("stop" if isinstance(choice, dict) else "tool_calls"), \
        result
    calls = result["message"]["tool_calls"]
    assert len(calls) == 1
    _check_calls(calls)
    if isinstance(choice, dict):
        assert calls[0]["function"]["name"] == "get_time"


def test_parallel_tool_calls_are_each_valid(live, llguidance):
    server, _ = live
    r = post(server, chat_body(tools=[CLOCK], tool_choice="required", max_tokens=120))
    assert r.status_code == 200, r.text
    result = r.json()["choices"][0]
    if result["finish_reason"] == "tool_calls":
        _check_calls(result["message"]["tool_calls"])
    else:  # the synthetic model may call again and again until max_tokens: the calls
        # before the cut are whole, the cut one's arguments as generated (as streamed)
        assert result["finish_reason"] == "length"
        assert result["message"]["content"] is None
        calls = result["message"]["tool_calls"]
        if calls[:-1]:
            _check_calls(calls[:-1])
        assert calls[-1]["function"]["arguments"].startswith("{"), calls


def test_streamed_tool_calls_assemble_to_the_whole_answer(live, llguidance):
    server, _ = live
    body = chat_body(tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False)
    whole = post(server, body).json()["choices"][0]
    chunks = streamed(server, body)
    calls: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for piece in (chunk["choices"][0]["delta"].get("tool_calls") or []
                      if chunk["choices"] else []):
            if "id" in piece:  # a call's first piece: index, id, type, name
                assert piece["function"]["arguments"] == "" and piece["type"] == "function"
                calls[piece["index"]] = {"id": piece["id"], "type": "function", "function": {
                    "name": piece["function"]["name"], "arguments": ""}}
            else:
                calls[piece["index"]]["function"]["arguments"] += \
                    piece["function"]["arguments"]
    assert [c["function"] for c in calls.values()] == \
        [c["function"] for c in whole["message"]["tool_calls"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    _check_calls(list(calls.values()))


def test_n_streamed_choices_each_carry_their_own_tool_call(live, llguidance):
    server, _ = live
    body = chat_body(tools=[CLOCK], tool_choice="required", parallel_tool_calls=False, n=2,
                     temperature=1.0, seed=5)
    calls: dict[int, dict[str, Any]] = {}
    finish: dict[int, str] = {}
    for chunk in streamed(server, body):
        for choice in chunk["choices"]:
            for piece in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(choice["index"], {"function": {"arguments": ""}})
                if "id" in piece:
                    entry.update(id=piece["id"], type="function")
                    entry["function"]["name"] = piece["function"]["name"]
                entry["function"]["arguments"] += piece["function"]["arguments"]
            if choice["finish_reason"] is not None:
                finish[choice["index"]] = choice["finish_reason"]
    assert sorted(calls) == [0, 1] and finish == {0: "tool_calls", 1: "tool_calls"}
    _check_calls(list(calls.values()))


def test_auto_answers_with_text_or_calls_and_the_response_says_which(live, llguidance):
    server, _ = live
    r = post(server, chat_body(tools=[CLOCK], tool_choice="auto", max_tokens=12))
    assert r.status_code == 200, r.text
    result = r.json()["choices"][0]
    if result["message"].get("tool_calls"):
        assert result["finish_reason"] == "tool_calls"
        _check_calls(result["message"]["tool_calls"])
    else:
        assert not result["message"]["content"].startswith(grammar.CALL_OPEN)


@pytest.mark.parametrize(("text", "content", "names"), [
    ("the answer is 4", "the answer is 4", []),
    ("<tool_c is not a call", "<tool_c is not a call", []),
    ('<tool_call>\n{"name":"get_time","arguments":{"zone":3}}\n</tool_call>', None,
     ["get_time"]),
    ('let me look\n<tool_call>\n{"name":"get_time","arguments":{"zone":-1}}\n</tool_call>\n'
     '<tool_call>\n{"name":"get_weather","arguments":{"city":"a}\\n","unit":"celsius"}}\n'
     '</tool_call>', "let me look\n", ["get_time", "get_weather"]),
    ('<tool_call>\n{"name":"get_time","arguments":{"zo', None, []),  # cut by max_tokens
    # cut by max_tokens after the arguments, in the call's closing markup: the stream sent
    # the call whole (its arguments end at their "}"), and so does the whole answer
    ('<tool_call>\n{"name":"get_time","arguments":{"zone":3}}\n</tool_ca', None,
     ["get_time"]),
    ('<tool_call>\n{"name":"get_time","arguments":{"zone":3}', None, ["get_time"]),
    ('so\n<tool_call>\n{"name":"get_time","arguments":{"zone":1}}\n</tool_call>\n'
     '<tool_call>\n{"na', "so\n", ["get_time"]),  # a second call's opening cut short
    ('a <tool_call> tag, then <tool_call>\n{"name":"get_time","arguments":{"zone":0}}\n'
     '</tool_call>', "a <tool_call> tag, then ", ["get_time"]),  # what auto's grammar allows
])
def test_auto_output_parsing_whole_and_streamed_agree(text, content, names):
    """parse_tool_calls (the whole answer) and ToolCallStream (fed one character at a time,
    as a stream) read the same calls and content. An answer cut only in a call's closing
    markup was text in the whole answer while the stream had sent the call (found by driving
    llama-index's ``achat_with_tools`` and ``astream_chat_with_tools``): both have the call."""
    parsed_content, calls = grammar.parse_tool_calls(text)
    assert [c["function"]["name"] for c in calls] == names
    assert parsed_content == (text if not names else content)
    for call in calls:
        assert conforms(json.loads(call["function"]["arguments"]),
                        SCHEMAS[call["function"]["name"]])
    deltas, streamed_calls, _ = stream_tool_calls(text)
    if names:
        assert "".join(d.get("content", "") for d in deltas) == (content or "")
        assert streamed_calls == [c["function"]["arguments"] for c in calls]


@pytest.mark.parametrize("cut", [1, 3, 14])
def test_a_call_cut_in_its_closing_markup_is_a_call_whole_and_streamed(live, llguidance, cut):
    """``tool_choice: required`` answered with a call whose last ``cut`` tokens (bytes: the
    closing ``}\n</tool_call>``, 14 of them) ``max_tokens`` cut off: the stream sent the call
    with its whole arguments, the whole answer gave no call and the markup as content. Both
    now have the call (``finish_reason: length``)."""
    server, _ = live
    body = chat_body(tools=[CLOCK], tool_choice="required", parallel_tool_calls=False,
                     max_tokens=200)
    r = post(server, body)
    assert r.status_code == 200, r.text
    full = r.json()
    generated = full["usage"]["completion_tokens"]
    expected = full["choices"][0]["message"]["tool_calls"]
    assert full["choices"][0]["finish_reason"] == "tool_calls" and len(expected) == 1
    body = {**body, "max_tokens": generated - cut}
    r = post(server, body)
    assert r.status_code == 200, r.text
    whole = r.json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None, whole
    got = whole["message"]["tool_calls"]
    assert [c["function"] for c in got] == [c["function"] for c in expected]
    arguments, finish = "", None
    for chunk in streamed(server, body):
        for choice in chunk["choices"]:
            for piece in choice["delta"].get("tool_calls") or []:
                arguments += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    assert arguments == expected[0]["function"]["arguments"] and finish == "length"


@pytest.mark.parametrize("parallel", [None, False])
def test_auto_lets_text_come_before_calls_but_every_call_follows_its_schema(llguidance,
                                                                          parallel):
    """The "auto" grammar itself (no model): text, text then calls, and nothing else; a call
    after text is held to its tool's schema like a call at the start."""
    plan = grammar.chat_structure(None, grammar.tool_setup([CLOCK], "auto"), parallel,
                                  ByteTokenizer(), 151936, 151643)
    call = '<tool_call>\n{"name":"get_time","arguments":{"zone":3}}\n</tool_call>'

    def error_after(text: str) -> str:
        state = plan.start()
        for byte in text.encode():
            if state.error:
                break
            state.accept(256 + byte)
        return state.error
    assert not error_after("no call at all")
    assert not error_after("let me look " + call)
    assert error_after('let me look <tool_call>\n{"name":"get_weather"')
    assert error_after('let me look <tool_call>\n{"name":"get_time","arguments":{"zone":99}')
    assert bool(error_after(call + "\n" + call)) == (parallel is False)


def test_tool_calls_and_tool_results_in_the_history_are_rendered(live):
    """The multi-turn loop: the assistant's tool_calls and the tool's answer go back in."""
    server, _ = live
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": 2}'}}
    messages = [{"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages,
                                                   "return_token_strs": True}, timeout=30)
    assert r.status_code == 200, r.text
    text = "".join(r.json()["token_strs"])
    assert text == ('user: time?\nassistant: <tool_call>\n{"name": "get_time", "arguments": '
                    '{"zone": 2}}\n</tool_call>\ntool: 12:00\nassistant:')
    r = post(server, {"model": MODEL, "messages": messages, "max_tokens": 2, "tools": [CLOCK],
                      "tool_choice": "none"})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("cut", [4, 12])
def test_a_structured_stream_continued_on_a_sibling_equals_an_uncut_one(app, llguidance, cut):
    """Mid-stream failover (issue 16): the sibling replays the tokens already sent into the
    grammar before it continues, so the answer is the uncut one (valid JSON), not a second
    object started mid-answer."""
    from test_server_handoff import events, through_ingress
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "size": {"type": "integer", "minimum": 0,
                                                        "maximum": 999}},
              "required": ["name", "size"], "additionalProperties": False}
    body = chat_body(response_format=_json_schema(schema), stream=True, temperature=0.9, seed=3)
    reference = events(through_ingress(app, "/v1/chat/completions", body)[0])
    got = events(through_ingress(app, "/v1/chat/completions", body, cut)[0])
    for e in (*reference, *got):
        e["id"] = e["created"] = None
    assert got == reference
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in got if e["choices"])
    assert conforms(json.loads(text), schema)


def test_a_jinja_chat_template_gets_the_tools_and_the_calls():
    """A tokenizer's template (Qwen3's reads them so) gets the request's ``tools`` and each
    message's ``tool_calls`` (``arguments`` parsed from their JSON text, as transformers'
    templates read them and vLLM passes them: written back with ``tojson``) and
    ``tool_call_id``; with tool_choice "none" the tools are still offered to it."""
    needs.module("jinja2", "tokenizer")  # a tokenizer's chat template is rendered by jinja2
    tok = ByteTokenizer()
    tok.chat_template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>"
        "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}<call>{{ c.function.name }}:"
        "{{ c.function.arguments | tojson }}"
        "</call>{% endfor %}{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    messages = [ChatMessage(role="user", content="time?"),
                ChatMessage(role="assistant", content="", tool_calls=[{
                    "id": "call_1", "type": "function",
                    "function": {"name": "get_time", "arguments": '{"zone":1}'}}]),
                ChatMessage(role="tool", tool_call_id="call_1", content="12:00")]
    expected = ('<|user|>time?<|assistant|><call>get_time:{"zone": 1}</call>'
                '<|tool|>12:00[call_1]<|assistant|>')
    for choice in ("auto", "none"):
        setup = grammar.tool_setup([CLOCK, WEATHER], choice)
        text = render_chat(messages, tok, tools=setup)
        assert text == "<tools>get_time;get_weather;</tools>" + expected
    assert render_chat(messages, tok) == expected


# ---- the official SDK -------------------------------------------------------------------------
class Answer(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = pydantic.Field(ge=0, le=99)
    label: str = pydantic.Field(max_length=6)


def test_the_sdks_parse_helper_returns_the_pydantic_model(live, llguidance):
    _, client = live
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "answer"}], response_format=Answer,
        max_tokens=MAX_TOKENS)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Answer)
    assert 0 <= parsed.count <= 99 and len(parsed.label) <= 6


def test_the_sdks_pydantic_function_tool_is_called_with_valid_arguments(live, llguidance):
    _, client = live

    class GetTime(pydantic.BaseModel):
        zone: int = pydantic.Field(ge=-12, le=14)

    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "time?"}],
        tools=[openai.pydantic_function_tool(GetTime)], tool_choice="required",
        parallel_tool_calls=False, max_tokens=MAX_TOKENS)
    call = completion.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetTime)
    assert completion.choices[0].finish_reason == "tool_calls"


# ---- refusals ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param", "says"), [
    ({"response_format": _json_schema({"type": "strin"})},
     "response_format.json_schema.schema", "llguidance"),
    ({"response_format": _json_schema({"type": "object", "properties": {"a": {"$ref": "#/x"}}})},
     "response_format.json_schema.schema", "llguidance"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!",
                                                                 "schema": {}}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "regex"}}, "response_format", "json_schema"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "strin"}}}]},
     "tools.0.function.parameters", "llguidance"),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type", "function"),
    ({"tools": [CLOCK], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"functions": [CLOCK["function"]]}, "functions", "tools"),
    ({"function_call": "auto"}, "function_call", "tool_choice"),
])
def test_bad_structured_fields_are_400s_naming_the_field(live, llguidance, fields, param, says):
    server, _ = live
    r = post(server, chat_body(**fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


@pytest.mark.parametrize("where", ["response_format", "tools"])
@pytest.mark.parametrize("strict", [True, False])
def test_keywords_llguidance_does_not_apply_are_refused_naming_their_place(live, llguidance,
                                                                           where, strict):
    """A keyword llguidance does not apply is a 400 naming it and its JSON pointer: with
    strict the 400 named no place until stop 64. ``uniqueItems`` alone is served without
    strict (a pydantic ``set[...]`` field writes it, and pydantic reads duplicates into the
    set); ``contains`` is refused strict or not."""
    server, _ = live
    schema = {"type": "object", "properties": {"ids": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxItems": 3, "uniqueItems": True}}, "required": ["ids"], "additionalProperties": False}
    def send(schema: dict[str, Any]) -> httpx.Response:
        if where == "tools":
            tool = {"type": "function", "function": {"name": "f", "parameters": schema,
                                                     "strict": strict}}
            return post(server, chat_body(tools=[tool], tool_choice="required",
                                          parallel_tool_calls=False))
        return post(server, chat_body(response_format=_json_schema(schema, strict=strict)))
    param = ("tools.0.function.parameters" if where == "tools"
             else "response_format.json_schema.schema")
    r = send(schema)
    if strict:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert '"uniqueItems" at /properties/ids/uniqueItems' in error["message"], error
        assert "declare a list" in error["message"], error
        assert error["param"] == param, error
    else:
        assert r.status_code == 200, r.text
    ids = schema["properties"]["ids"]  # type: ignore[index]
    plain = {key: value for key, value in ids.items() if key != "uniqueItems"}
    contains = {**schema, "properties": {"ids": {**plain, "contains": {"const": 3}}}}
    r = send(contains)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert '"contains" at /properties/ids/contains' in error["message"], error
    assert error["param"] == param, error


def _refusal(schema: dict[str, Any], strict: bool = False) -> str | None:
    """The message of the grammar's refusal of ``schema`` as a response_format (None: none)."""
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema,
                                                 "strict": strict}}
    try:
        grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    except grammar.GrammarError as err:
        assert err.param == "response_format.json_schema.schema", err.param
        return str(err)
    return None


KIND = {"type": "string", "enum": ["card", "cash"]}


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("schema,place", [
    pytest.param({"type": "object", "properties": {"kind": KIND, "number": {"type": "string"}},
                  "required": ["kind"],
                  "if": {"properties": {"kind": {"const": "card"}}},
                  "then": {"required": ["number"]}}, '"if" at /if', id="if_then"),
    pytest.param({"type": "object", "properties": {"pay": {
        "type": "object", "properties": {"kind": KIND},
        "if": {"properties": {"kind": {"const": "card"}}},
        "else": {"required": ["kind"]}}}}, '"if" at /properties/pay/if', id="nested_if_else"),
    pytest.param({"type": "object", "properties": {"a": {"type": "string"}},
                  "dependentSchemas": {"a": {"required": ["b"]}},
                  "unevaluatedProperties": False}, '"dependentSchemas" at /dependentSchemas',
                 id="unevaluated_beside_dependent_schemas"),
    pytest.param({"$defs": {"Tag": {"type": "string", "not": {"const": "x"}}},
                  "type": "object", "properties": {"if": {"$ref": "#/$defs/Tag"}}},
                 '"not" at /$defs/Tag/not', id="not_in_a_definition"),
    pytest.param({"type": "array", "contains": {"const": 1}}, '"contains" at /contains',
                 id="contains"),
    pytest.param({"type": "object", "properties": {"a": {"type": "integer"}},
                  "dependentRequired": {"a": ["b"]}},
                 '"dependentRequired" at /dependentRequired', id="dependent_required"),
])
def test_a_keyword_llguidance_ignores_is_refused_naming_its_pointer(llguidance, schema, place,
                                                                    strict):
    """``if``/``then``/``else`` (and ``not``, ``dependentSchemas``, ``contains``,
    ``dependentRequired``...) are keywords llguidance does not apply; it implements no ``not``,
    so a conditional cannot be rewritten as ``anyOf`` of ``{allOf: [if, then]}`` and ``{allOf:
    [{not: if}, else]}``. Until stop 64 a schema without strict had them ignored without a
    word (``{"kind":"card"}`` answered where ``then`` required ``number``); with strict the
    400 named no place. Now a 400 naming the keyword and its JSON pointer (a property named
    ``if`` is a name, not the keyword)."""
    message = _refusal(schema, strict)
    assert message is not None and place in message, message
    assert "does not apply" in message and "leave it out" in message, message


BIG = 10 ** 19  # past 2^63, its digits kept by a double's shortest form


@pytest.mark.parametrize("schema,text", [
    pytest.param({"type": "object", "properties": {"n": {"type": "integer"},
                                                   "big": {"const": BIG}},
                  "required": ["big"]}, '{"big":10000000000000000000}',
                 id="const_beside_an_integer_property"),
    pytest.param({"type": "object", "properties": {"n": {"type": "integer"}, "big": {
        "type": "array", "items": {"enum": [BIG, 1.5e19]}}}, "required": ["big"]},
                 '{"big":[15000000000000000000,10000000000000000000]}',
                 id="enum_in_an_array_beside_an_integer"),
])
def test_a_big_const_of_no_integer_type_beside_an_integer_is_served_as_written(
        llguidance, schema, text):
    """Until stop 64 any node of no ``type`` holding a number past 2^63-1 was a 400 ("an
    integer bound llguidance caps at 2^63-1") wherever the schema declared an integer, though
    a property's value takes no type from its neighbours and llguidance writes it as given.
    It is served (every byte of the answer allowed), and a type that does reach it (an
    ``allOf`` member, a parent over its branches) still refuses it."""
    rf = {"type": "json_schema", "json_schema": {"name": "b", "schema": schema}}
    plan = grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    assert _refused_at(plan, text) is None
    for reached in ({"allOf": [{"type": "integer"}, {"const": BIG}]},
                    {"type": "integer", "anyOf": [{"const": BIG}]},
                    {"$defs": {"B": {"const": BIG}}, "type": "integer", "$ref": "#/$defs/B"}):
        message = _refusal(reached)
        assert message is not None and "caps at 2^63-1" in message, (reached, message)


@pytest.mark.parametrize("schema,where", [
    pytest.param({"const": 2 ** 63}, "schema.const=9223372036854775808", id="const"),
    pytest.param({"type": "object", "properties": {"x": {"type": "number", "enum": [
        1, 2 ** 64 - 2048]}}}, "schema.properties.x.enum[1]=18446744073709549568",
                 id="number_enum"),
])
def test_a_const_past_2_to_the_63_a_double_writes_otherwise_is_refused(llguidance, schema,
                                                                        where):
    """From 2^63 up llguidance writes a value of no integer type as a double's shortest
    digits: ``{"const": 9223372036854775808}`` was answered ``9223372036854776000``
    (``finish_reason: stop``), another number, which the schema does not allow. Now a 400
    naming it; one whose digits the shortest form keeps (10^19) is served."""
    message = _refusal(schema)
    assert message is not None and f"{where}: an integer llguidance writes as" in message, \
        message
    assert "10000000000000000000" in message, message
    assert _refusal({"const": BIG}) is None


def test_the_date_patterns_allow_exactly_the_dates_python_reads():
    """:data:`grammar.FORMAT_PATTERNS`' date: every day of every month (01-12, 01-31) of
    years with and without a February 29th (centuries too, 0001 and 9999) matches exactly
    when ``datetime.date`` takes it; year 0000 never."""
    date = re.compile(grammar.FORMAT_PATTERNS["date"])
    for year in (1, 4, 100, 400, 1900, 1996, 2000, 2023, 2024, 2100, 9996, 9999):
        for month in range(1, 13):
            for day in range(1, 32):
                text = f"{year:04d}-{month:02d}-{day:02d}"
                try:
                    datetime.date.fromisoformat(text)
                except ValueError:
                    valid = False
                else:
                    valid = True
                assert bool(date.fullmatch(text)) == valid, text
    assert not date.fullmatch("0000-01-01")


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.datetimes(timezones=st.sampled_from([datetime.UTC, datetime.timezone(
    datetime.timedelta(hours=-12, minutes=-25)), datetime.timezone(datetime.timedelta(
        hours=5, minutes=30))])))
def test_every_aware_datetime_python_writes_matches_the_date_time_pattern(moment):
    text = moment.isoformat().replace("+00:00", "Z")
    assert re.fullmatch(grammar.FORMAT_PATTERNS["date-time"], text), text
    assert re.fullmatch(grammar.FORMAT_PATTERNS["time"], text.split("T")[1]), text


class Stamped(pydantic.BaseModel):
    when: datetime.datetime
    day: datetime.date
    at: datetime.time


def test_dates_and_times_the_grammar_writes_parse_as_pydantic_reads_them(llguidance):
    """llguidance's ``date``/``date-time``/``time`` formats let ``"2023-02-29"`` (no such
    day), a lowercase ``t``/``z`` and a leap second ``:60`` through (the synthetic model
    wrote ``"5279-11-24t23:18:60-12:25"``): a pydantic model with datetime fields failed to
    parse 8 answers of 40. Each answer now parses (random walks of the grammar's mask, 40
    seeds), and the grammar refuses those forms."""
    rf = {"type": "json_schema", "json_schema": {"name": "s",
                                                 "schema": Stamped.model_json_schema()}}
    plan = grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    for bad in ('{"when":"2023-02-29', '{"when":"2024-01-01t', '{"when":"2024-01-01T00:00:6',
                '{"when":"2024-01-01T00:00:00z'):
        assert _refused_at(plan, bad) == len(bad) - 1, bad
    for seed in range(40):
        rng = np.random.default_rng(seed)
        state, text = plan.start(), bytearray()
        while len(text) < 400:
            allowed = np.flatnonzero(state.allowed())
            if 151643 in allowed:
                break
            token = int(rng.choice(allowed))
            state.accept(token)
            text.append(token - 256)
        Stamped.model_validate_json(bytes(text))  # raises if it does not parse


class Shade(enum.Enum):
    RED = "red"
    GREEN = "green"


def _walks(plan, seeds: range, limit: int = 400) -> list[bytes]:
    """Random walks of ``plan``'s mask (each allowed token alike), each to where the grammar
    may end (or ``limit`` bytes)."""
    texts = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        state, text = plan.start(), bytearray()
        while len(text) < limit:
            allowed = np.flatnonzero(state.allowed())
            if 151643 in allowed:
                break
            token = int(rng.choice(allowed))
            state.accept(token)
            text.append(token - 256)
        texts.append(bytes(text))
    return texts


@pytest.mark.parametrize("keys", [
    pytest.param(Literal["a", "b"], id="literal"), pytest.param(Shade, id="enum_ref"),
    pytest.param(uuid.UUID, id="uuid"), pytest.param(datetime.date, id="date"),
    pytest.param(Annotated[str, pydantic.Field(max_length=3)], id="max_length"),
])
def test_a_pydantic_dict_of_constrained_keys_is_served_with_those_keys(llguidance, keys):
    """pydantic writes a ``dict`` whose keys are constrained with ``propertyNames``, which
    llguidance does not apply: until stop 64 the keys were the model's own (``.parse()``
    failed), then a 400. Its keys are now properties or a patternProperties key, and every
    answer (random walks of the mask, 20 seeds) parses as the dict type."""
    adapter = pydantic.TypeAdapter(dict[keys, int])  # type: ignore[valid-type]
    schema = adapter.json_schema()
    assert "propertyNames" in schema, schema
    rf = {"type": "json_schema", "json_schema": {"name": "d", "schema": schema}}
    plan = grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    for text in _walks(plan, range(20)):
        adapter.validate_json(text)  # raises if it does not parse


def test_a_bounded_dict_of_literal_keys_keeps_its_bound(llguidance):
    """``dict[Literal["a.b", "c d", "e-f"], int]`` with ``max_length=2``: its keys as optional
    properties made llguidance ignore the ``maxProperties`` beside them (a warning: three
    keys were let through); as one alternation the bound holds: every answer parses, two
    keys at most, a third refused by the mask."""
    adapter = pydantic.TypeAdapter(
        Annotated[dict[Literal["a.b", "c d", "e-f"], int], pydantic.Field(max_length=2)])
    rf = {"type": "json_schema", "json_schema": {"name": "d", "schema": adapter.json_schema()}}
    plan = grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    for text in _walks(plan, range(20)):
        assert len(adapter.validate_json(text)) <= 2, text
    two = '{"a.b":1,"e-f":2,'
    assert _refused_at(plan, two) == len(two) - 1


@pytest.mark.parametrize("strict", [False, True])
def test_a_property_count_beside_optional_properties_is_refused_naming_it(llguidance, strict):
    """llguidance applies ``minProperties``/``maxProperties`` only where every declared
    property is required, and ignored one beside optional properties without strict (a
    warning; with strict a 400 naming no place): now a 400 naming it."""
    schema = {"type": "object", "properties": {"x": {
        "type": "object", "properties": {"a": {"type": "integer"}},
        "additionalProperties": {"type": "integer"}, "minProperties": 2}}}
    message = _refusal(schema, strict)
    assert message is not None and '"minProperties" at /properties/x/minProperties' \
        in message, message


def test_property_names_said_in_two_ways_at_once_is_refused_naming_it(llguidance):
    """A ``propertyNames`` that is not one ``enum``, ``pattern``, ``format`` or length (here a
    pattern and a length) is not rewritten: a 400 naming it and its place."""
    message = _refusal({"type": "object", "additionalProperties": {"type": "integer"},
                        "propertyNames": {"pattern": "^[a-z]+$", "maxLength": 3}})
    assert message is not None and '"propertyNames" at /propertyNames' in message, message


@pytest.mark.parametrize("strict", [False, True])
def test_unevaluated_properties_beside_a_lone_ref_closes_on_the_definitions_keys(llguidance,
                                                                                strict):
    """``{"$ref": "#/$defs/P", "unevaluatedProperties": false}`` (what a strict-mode schema
    writer puts beside a reference): llguidance does not apply ``unevaluatedProperties``, so
    it was ignored without strict and a 400 with it (and with either since this stop's
    refusal of keywords llguidance does not apply). It is closed on the definition's keys,
    as beside an ``allOf``: every answer (random walks, 20 seeds) is P's object alone."""
    pet = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
           "required": ["a"]}
    schema = {"$defs": {"P": pet}, "$ref": "#/$defs/P", "unevaluatedProperties": False}
    rf = {"type": "json_schema", "json_schema": {"name": "u", "schema": schema,
                                                 "strict": strict}}
    plan = grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    for text in _walks(plan, range(20)):
        value = json.loads(text)
        assert set(value) == {"a"} and len(value["a"]) <= 3, text


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("schema,place", [
    pytest.param({"type": "array", "items": {"oneOf": [
        {"type": "number", "minimum": 2.25}, {"enum": ["b"]}, {"type": "integer",
                                                               "minimum": 29}]}},
                 '"oneOf" at /items/oneOf', id="number_and_integer"),
    pytest.param({"$defs": {"Size": {"oneOf": [{"type": "integer", "maximum": 5},
                                               {"type": "integer", "minimum": 3}]}},
                  "type": "object", "properties": {"size": {"$ref": "#/$defs/Size"}}},
                 '"oneOf" at /$defs/Size/oneOf', id="overlapping_ranges_in_a_definition"),
])
def test_a_oneof_llguidance_serves_as_anyof_is_refused_naming_it(llguidance, schema, place,
                                                                 strict):
    """llguidance serves a ``oneOf`` whose branches it cannot prove disjoint as ``anyOf``
    (a warning, without strict): the schema fuzzer's ``[1813668406159,null]`` matched both
    the number and the integer branch, which oneOf refuses (and with strict the 400 named no
    place). Now a 400 naming the oneOf; a tagged union, or branches of different types, is
    served (every answer matching one branch)."""
    message = _refusal(schema, strict)
    assert message is not None and place in message and "write anyOf" in message, message
    union = {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"},
                                                         "n": {"type": "integer"}},
                        "required": ["kind", "n"]},
                       {"type": "object", "properties": {"kind": {"const": "b"}},
                        "required": ["kind"]}, {"type": "string", "maxLength": 2}]}
    assert _refusal(union, strict) is None


class Priced(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    price: decimal.Decimal
    discount: decimal.Decimal | None = None


def test_a_pydantic_decimal_field_is_served_and_parses(live, llguidance):
    """pydantic writes a ``Decimal`` field as ``anyOf: [{"type": "number"}, {"type":
    "string", "pattern": "^(?!^[-+.]*$)[+-]?0*\\d*\\.?\\d*$"}]``, whose look-ahead llguidance's
    regexes do not implement: until stop 64 every model with a Decimal field was a 400
    (``regex parse error ... look-around ... is not supported``) under ``.parse()``. The
    pattern is served as the same language without it; each sampled answer parses."""
    _, client = live
    for seed in range(6):
        chat = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "price"}],
            response_format=Priced, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        choice = chat.choices[0]
        assert choice.finish_reason == "stop", choice
        assert isinstance(choice.message.parsed, Priced), choice
        assert Priced.model_validate_json(choice.message.content) == choice.message.parsed


class Money(pydantic.BaseModel):
    amount: Annotated[decimal.Decimal, pydantic.Field(max_digits=6, decimal_places=2)]
    rate: Annotated[decimal.Decimal, pydantic.Field(decimal_places=3)]
    size: Annotated[decimal.Decimal, pydantic.Field(max_digits=3)]


def test_a_constrained_pydantic_decimal_is_served_as_a_string_it_reads(llguidance):
    """``condecimal(max_digits=6, decimal_places=2)`` (and either alone): pydantic's pattern
    holds look-aheads llguidance's regexes do not implement, so every such model was a 400
    until stop 64; its number branch (``{"type": "number"}``, any number) let through values
    of more places than it allows, which ``.parse()`` refuses. It is served as its string
    form, a look-around-free part of the pattern: every answer (random walks, 30 seeds)
    parses."""
    rf = {"type": "json_schema", "json_schema": {"name": "m",
                                                 "schema": Money.model_json_schema()}}
    plan = grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    for text in _walks(plan, range(30)):
        Money.model_validate_json(text)  # raises if it does not parse


@pytest.mark.parametrize("constraints", [{"decimal_places": 2}, {"max_digits": 4},
                                         {"max_digits": 4, "decimal_places": 2},
                                         {"max_digits": 2, "decimal_places": 2}])
def test_the_decimal_part_allows_only_what_the_pattern_and_pydantic_allow(constraints):
    """A differential check of ``grammar.decimal_part``: every string of up to 7 of
    ``-.019`` it matches, pydantic's pattern matches (Python's ``re`` implements its
    look-aheads) and pydantic reads as the constrained Decimal."""
    import itertools
    adapter = pydantic.TypeAdapter(Annotated[decimal.Decimal, pydantic.Field(**constraints)])
    given_ = adapter.json_schema()["anyOf"][1]["pattern"]
    part = grammar.decimal_part(given_)
    assert part is not None, given_
    matched = 0
    for n in range(1, 8):
        for chars in itertools.product("-.019", repeat=n):
            text = "".join(chars)
            if re.fullmatch(part, text):
                matched += 1
                assert re.search(given_, text), text
                adapter.validate_json(json.dumps(text))
    assert matched > 20


def test_the_decimal_pattern_without_look_ahead_is_the_same_language():
    """A differential check of :data:`grammar.LOOKAROUND_FREE`: each rewrite matches exactly
    the strings its original matches (every string of up to 6 of ``+-.05x``; Python's
    ``re`` implements the look-ahead)."""
    import itertools
    for given_, served in grammar.LOOKAROUND_FREE.items():
        original, rewrite = re.compile(given_), re.compile(served)
        for n in range(7):
            for chars in itertools.product("+-.05x", repeat=n):
                text = "".join(chars)
                assert bool(original.fullmatch(text)) == bool(rewrite.fullmatch(text)), text


def test_a_tokenizer_json_is_given_to_llguidance(tmp_path, llguidance):
    """A --tokenizer tokenizer.json (byte-level BPE, trained here: nothing is downloaded) is
    loaded by llguidance itself; its answers are forced into the schema too."""
    tokenizers = needs.module("tokenizers", "tokenizer")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(['{"name": "abc", "size": 12, "ok": true}'] * 20, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(tmp_path / "tokenizer.json")))
    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 4},
        "size": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "size"], "additionalProperties": False}
    try:
        with LiveServer(app) as server:
            for fields in ({}, {"temperature": 1.0, "seed": 5}):
                r = post(server, chat_body(response_format=_json_schema(schema), **fields))
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                assert choice["finish_reason"] == "stop", choice
                assert conforms(json.loads(choice["message"]["content"]), schema)
    finally:
        executor.shutdown(5.0)


def test_without_llguidance_the_fields_say_which_package_to_install(live, monkeypatch):
    server, _ = live
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance: ImportError
    for fields, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                          ({"tools": [CLOCK], "tool_choice": "required"}, "tools")):
        r = post(server, chat_body(**fields))
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and "llguidance" in error["message"], error
        assert "pip install" in error["message"]
    # tools that are not called need no grammar
    r = post(server, chat_body(tools=[CLOCK], tool_choice="none", max_tokens=2))
    assert r.status_code == 200, r.text


# ---- numbers a double holds (stop 63, clients third) -----------------------------------------
NUMBERS = {"type": "object", "properties": {
    "x": {"type": "number"},
    "xs": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
    "either": {"anyOf": [{"type": "number"}, {"type": "string", "maxLength": 4}]},
    "n": {"type": "integer"}},
    "required": ["x", "xs", "either", "n"], "additionalProperties": False}
MEASURE = {"type": "function", "function": {"name": "measure", "parameters": NUMBERS}}
HUGE = "1" + "0" * 308  # 10^308: an integer part past a double's range (1.797e308)


def _numbers_plans(llguidance) -> dict[str, Any]:
    """The grammar of the ``NUMBERS`` object in every place a number can be written: the
    answer's, a required, named, "auto" tool call's arguments, "auto" with response_format."""
    tok, vocab, end = ByteTokenizer(), 151936, 151643
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBERS}}
    return {
        "answer": (grammar.completion_structure(rf, tok, vocab, end), ""),
        "required": (grammar.chat_structure(None, grammar.tool_setup([MEASURE], "required"),
                                            None, tok, vocab, end),
                     '<tool_call>\n{"name":"measure","arguments":'),
        "named": (grammar.chat_structure(None, grammar.tool_setup(
            [MEASURE], {"type": "function", "function": {"name": "measure"}}), None, tok,
            vocab, end), ""),
        "auto": (grammar.chat_structure(None, grammar.tool_setup([MEASURE], "auto"), None, tok,
                                        vocab, end),
                 'let me see <tool_call>\n{"name":"measure","arguments":'),
        "auto-answer": (grammar.chat_structure(rf, grammar.tool_setup([MEASURE], "auto"), None,
                                               tok, vocab, end), ""),
    }


def _refused_at(plan, text: str) -> int | None:
    """Where the grammar's mask first refuses a byte of ``text`` (None: all allowed)."""
    state = plan.start()
    for i, byte in enumerate(text.encode()):
        if not state.allowed()[256 + byte]:
            return i
        state.accept(256 + byte)
    return None


@pytest.mark.parametrize("place", ["answer", "required", "named", "auto", "auto-answer"])
def test_every_number_the_grammar_lets_through_is_finite(llguidance, place):
    """llguidance's JSON number takes any exponent and any number of digits: ``1e999`` (or
    309 digits then ``.0``) was written where a schema said ``number``, and Python, pydantic
    and JavaScript read it as Infinity (``.parse()`` gave ``inf`` for a float field). Now, in
    a property, an array's items, an anyOf branch, an integer, a tool call's arguments (every
    tool_choice), a number's magnitude stays below 10^308; a negative exponent, a fraction,
    1e307 and 308 digits are still written."""
    plan, before = _numbers_plans(llguidance)[place]
    fine = before + '{"x":1e307,"xs":[-9.5E+306,1e-999,' + HUGE[:-1] + '.25],"either":' \
        '12e306,"n":' + HUGE[:-1] + '}'
    assert _refused_at(plan, fine) is None
    for bad in ('{"x":1e308', '{"x":1,"xs":[2,1E+0309', '{"x":-' + HUGE,
                '{"x":1,"xs":[],"either":99e307', '{"x":1,"xs":[],"either":1,"n":' + HUGE):
        assert _refused_at(plan, before + bad) == len(before + bad) - 1, bad


class Reading(pydantic.BaseModel):
    value: float
    more: list[float] = pydantic.Field(max_length=3)


def test_the_sdks_parse_gives_finite_floats(live, llguidance):
    """``chat.completions.parse`` and ``responses.parse`` of a pydantic model with float
    fields, sampled (temperature 1, seeds 0..9): every float finite (before, seed 2 alone gave
    ``{"a":8E0439466240008,...}``, ``inf``)."""
    _, client = live
    for seed in range(10):
        chat = client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": "numbers"}],
            response_format=Reading, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed)
        answer = client.responses.parse(model=MODEL, input="numbers", text_format=Reading,
                                        max_output_tokens=MAX_TOKENS, temperature=1.0,
                                        extra_body={"seed": seed})
        for parsed in (chat.choices[0].message.parsed, answer.output_parsed):
            assert parsed is not None
            assert all(math.isfinite(v) for v in (parsed.value, *parsed.more)), (seed, parsed)


def test_a_schema_number_no_answer_writes_is_refused_naming_it(llguidance):
    """``{"const": 1.5e308}``: finite, but of 309 digits as llguidance writes it, past the
    numbers an answer may hold (below 10^308): the mask left nothing at its last digit and the
    answer was cut there, "stop". Now a 400 naming its place."""
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"x": {"enum": [1, 1.5e308]}}}}}
    with pytest.raises(grammar.GrammarError) as caught:
        grammar.completion_structure(rf, ByteTokenizer(), 151936, 151643)
    assert caught.value.param == "response_format.json_schema.schema"
    assert "schema.properties.x.enum[1]=1.5e+308" in str(caught.value), str(caught.value)
    assert "10^308" in str(caught.value)
