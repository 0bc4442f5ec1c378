"""Found at stop 58 (server): each test names what a user hit before its fix (docs/traceability.md,
"Found at stop 58 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import needs
from calexec.contracts.fields import shown
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import MODEL, started_executor

TOKEN = "probe58-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe58"))
    try:
        with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
            yield client
    finally:
        executor.shutdown(5.0)


# ---- a refused value is echoed as the client wrote it (JSON), not as Python prints it --------
@pytest.mark.parametrize("route,body,expected", [
    ("/v1/completions", {"prompt": "hi", "temperature": True},
     "temperature=true: must be one of int, float"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"},
     'temperature="hot": must be one of int, float'),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"},
     'echo="yes": Input should be a valid boolean'),
    ("/v1/completions", {"prompt": "hi", "stop": [None]}, "stop[0]=null: "),
    ("/v1/completions", {"prompt": "hi", "stop": ["a", ""]},
     'stop[1]="": must be a non-empty string'),
    ("/v1/completions", {"prompt": {"a": 1}}, 'prompt={"a": 1}: must be one of '),
    ("/v1/completions", {"prompt": "hi", "logprobs": True}, "logprobs=true: "),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}},
     'logit_bias["abc"]: the key must be a token id'),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}, 'suffix="x": '),
    ("/v1/completions", {"prompt": "hi", "model": "nope"},
     f'model="nope" does not exist; served: {MODEL}, qwen3_synthetic'),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}},
     'response_format.type="xml": must be one of text, json_object, json_schema'),
    ("/v1/chat/completions", {"messages": [{"role": "bot", "content": "x"}]},
     'messages[0].role="bot": must be one of system, developer, user, assistant, tool'),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]},
     'messages[0].content: missing (or null), a "user" message needs content'),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]},
     'messages[0].tool_call_id: missing, a "tool" message needs'),
    ("/v1/chat/completions", {"messages": CHAT, "service_tier": "zz"},
     'service_tier="zz": Input should be "auto", "default", "flex", "scale", "priority" or '
     '"fast"'),
    ("/v1/chat/completions", {"messages": CHAT, "tool_choice": {
        "type": "function", "function": {"name": "f"}}},
     'tool_choice={"type": "function", "function": {"name": "f"}}: needs tools'),
])
def test_a_refused_value_is_echoed_as_json_not_as_a_python_repr(client, route, body, expected):
    """Refusals showed the value as Python's repr: ``temperature=True``, ``stop[0]=None``,
    ``echo='yes'``, ``prompt={'a': 1}``, ``tool_choice={'type': 'function', ...}``, a list of
    served models as ``['a', 'b']``, pydantic's ``Input should be 'auto' or ...``: what no
    JSON client wrote. They are written as JSON (``true``, ``null``, ``"yes"``)."""
    r = client.post(route, json=body)
    assert r.status_code in (400, 404), r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith(expected), message
    assert "'" not in message.replace("model's", "").replace("assistant's", ""), message


@pytest.mark.parametrize("number,shown_as", [("NaN", "NaN"), ("Infinity", "Infinity"),
                                             ("-Infinity", "-Infinity"), ("1e400", "Infinity")])
def test_a_non_finite_number_is_echoed_as_json_writes_it(client, number, shown_as):
    """``"temperature": NaN`` was refused as ``temperature=nan`` (Python's float repr); a
    JSON client wrote ``NaN``, ``Infinity`` (or a number past the float range)."""
    raw = f'{{"prompt": "hi", "max_tokens": 1, "temperature": {number}}}'
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith(f"temperature={shown_as}: must be a number in [0, 2]"), message


@pytest.mark.parametrize("path,params,expected", [
    ("/admin/drain", {"grace": "soon"}, 'grace="soon": must be a finite number'),
    ("/admin/drain", [("grace", "1"), ("grace", "2")], 'grace="1": given 2 times'),
    ("/debug/jobs/1", {"format": "xml"}, 'format="xml": must be one of html, json'),
])
def test_an_admin_or_debug_refusal_echoes_its_query_value_in_json_quotes(client, path, params,
                                                                          expected):
    """``/admin/drain?grace=soon`` was refused as ``grace='soon'``; the value is quoted as
    JSON quotes a string, as every other message of the server now shows a value."""
    method = client.post if path.startswith("/admin") else client.get
    r = method(path, params=params, headers=AUTH)
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["message"].startswith(expected), r.text[:300]
    assert client.get("/ready").status_code == 200  # (no drain started)


@pytest.mark.parametrize("calbin,said", [(None, "null"), (5, "5"), (["a"], '["a"]'),
                                         ("", '""'), (False, "false")])
def test_a_reload_without_a_path_names_the_value_as_json(client, calbin, said):
    """``POST /admin/reload {"calbin": null}`` was refused ``calbin=None: ...`` (the
    executor's check prints the value as Python does; ``["a"]`` as ``['a']``). The route
    names it as the client wrote it; still 400 ``calbin.path_required``, nothing moved."""
    r = client.post("/admin/reload", json={"calbin": calbin}, headers=AUTH)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["code"] == "calbin.path_required" and error["param"] == "calbin", error
    assert error["message"] == (f"calbin={said}: a calbin file path (a non-empty string) is "
                                "required"), error
    assert client.get("/ready").status_code == 200


def test_shown_writes_a_lone_surrogate_as_its_escape_so_the_message_is_utf8():
    """``shown`` (the value in a message) keeps a message UTF-8 encodable: a lone surrogate
    (a query or header decoded with ``surrogateescape``) as JSON's ``\\udXXX`` escape,
    numpy scalars as numbers, a value too large to print named, not raised."""
    import numpy as np
    text = shown("a\ud800b")
    assert text == '"a\\ud800b"' and text.encode("utf-8")
    assert shown(np.int64(3)) == "3" and shown(np.float32(1.5)) == "1.5"
    assert shown(None) == "null" and shown((1, None)) == "[1, null]"
    assert shown(10 ** 5000) == "(a value too large to show)"
    assert shown("x" * 500, 10) == '"' + "x" * 9


# ---- a named tool_choice: the output is the arguments alone, as vLLM's ----------------------
PARIS = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris"]}},
        "required": ["city"], "additionalProperties": False}}}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ARGUMENTS = '{"city":"Paris"}'  # the only value the schema allows: one byte token each


def _named(max_tokens: int, **fields) -> dict:
    return {"messages": CHAT, "tools": [PARIS], "tool_choice": NAMED, "max_tokens": max_tokens,
            **fields}


def _streamed_call(client, body: dict) -> tuple[dict, str, list]:
    """(the call the stream's deltas assemble, the last finish_reason, the contents sent)."""
    call: dict = {"function": {"arguments": ""}}
    finish, contents = None, []
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            contents.append(choice["delta"].get("content"))
            for piece in choice["delta"].get("tool_calls") or []:
                assert piece["index"] == 0, piece
                if "id" in piece:
                    assert "name" not in call["function"], "a second call opened"
                    call.update(id=piece["id"], type=piece["type"])
                    call["function"]["name"] = piece["function"]["name"]
                call["function"]["arguments"] += piece["function"]["arguments"]
            finish = choice["finish_reason"] or finish
    return call, finish, contents


def test_a_named_tool_calls_arguments_alone_count_against_max_tokens(client):
    """With ``tool_choice`` naming a function, the output was ``<tool_call>\\n{"name":
    "get_weather", "arguments": ...}\\n</tool_call>``: the markup and the name took max_tokens,
    so a budget the arguments fit in (vLLM generates only them) ended "length", with no call
    and the markup as the content. Now the output is the arguments: they complete, "stop",
    and usage counts their tokens alone; streamed, the same call."""
    needs.module("llguidance", "server")
    r = client.post("/v1/chat/completions", json=_named(len(ARGUMENTS)))
    assert r.status_code == 200, r.text[:300]
    answer = r.json()
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    assert choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS}, call
    assert call["type"] == "function" and call["id"].startswith("call_"), call
    assert answer["usage"]["completion_tokens"] == len(ARGUMENTS), answer["usage"]
    streamed, finish, contents = _streamed_call(client, _named(len(ARGUMENTS)))
    assert finish == "stop" and streamed["function"] == call["function"], streamed
    assert not any(contents), contents


def test_a_named_tool_call_cut_by_max_tokens_is_the_call_as_generated(client):
    """Cut short, a named call is the call with the arguments generated so far and
    ``finish_reason`` "length" (vLLM's answer), whole and streamed alike; never the markup
    ``<tool_call>\\n{"name":`` as the message's content."""
    needs.module("llguidance", "server")
    cut = 6
    r = client.post("/v1/chat/completions", json=_named(cut))
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length", choice
    assert choice["message"]["content"] is None, choice
    [call] = choice["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGUMENTS[:cut]}, call
    streamed, finish, contents = _streamed_call(client, _named(cut))
    assert finish == "length" and streamed["function"] == call["function"], streamed
    assert not any(contents), contents
