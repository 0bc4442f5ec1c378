"""Found at stop 59 (server): each test names what a user hit before its fix (docs/traceability.md,
"Found at stop 59 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

import needs
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor

CHAT = [{"role": "user", "content": "hi"}]
LOOP = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe59"))
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            yield client
    finally:
        executor.shutdown(5.0)


def _format(schema: str) -> str:
    return ('"response_format": {"type": "json_schema", "json_schema": {"name": "x", '
            f'"schema": {schema}}}}}')


def _tools(parameters: str, choice: str = '"required"') -> str:
    return ('"tools": [{"type": "function", "function": {"name": "f", "parameters": '
            f'{parameters}}}}}], "tool_choice": {choice}')


def _post(client, route: str, fields: str, stream: bool = False):
    lead = ('"prompt": "x"' if route == "/v1/completions"
            else '"messages": [{"role": "user", "content": "hi"}]')
    raw = "{" + lead + ', "max_tokens": 8, ' + fields + (', "stream": true' if stream else "") + "}"
    return client.post(route, content=raw, headers={"content-type": "application/json"})


# ---- a number past a double's range in a schema ------------------------------------------------
@pytest.mark.parametrize("route,fields,param,where", [
    ("/v1/chat/completions", _format('{"const": 1e400}'),
     "response_format.json_schema.schema", "response_format.json_schema.schema.const"),
    ("/v1/chat/completions", _format('{"enum": [2, 1e400]}'),
     "response_format.json_schema.schema", "response_format.json_schema.schema.enum[1]"),
    ("/v1/completions", _format('{"type": "number", "maximum": -1e400}'),
     "response_format.json_schema.schema", "response_format.json_schema.schema.maximum"),
    ("/v1/chat/completions",
     _tools('{"type": "object", "properties": {"a": {"const": 1e400}}, "required": ["a"]}'),
     "tools.0.function.parameters", "tools.0.function.parameters.properties.a.const"),
    ("/v1/chat/completions",
     _tools('{"type": "object"}', '"auto"') + ", " + _format('{"const": 1e400}'),
     "response_format.json_schema.schema", "response_format.json_schema.schema.const"),
], ids=["const", "enum", "completions-maximum", "tool-parameters", "tools-and-format"])
def test_a_schema_number_past_a_double_is_a_400_naming_where_it_is(client, route, fields,
                                                                    param, where):
    """The body's parser reads ``1e400`` as Infinity, which llguidance's JSON writes as
    ``null``: ``{"const": 1e400}`` was answered 200 ``null`` with ``finish_reason: stop``,
    a value the schema never allowed (``maximum: 1e400``: a 400 saying "Expected f64 for
    'maximum', got null", a null the client never wrote). Now a 400 naming the field and
    the number's place in the schema."""
    needs.module("llguidance", "server")
    r = _post(client, route, fields)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param
    assert f"{where}=Infinity: not a finite number" in error["message"] or \
        f"{where}=-Infinity: not a finite number" in error["message"], error["message"]


# ---- a schema no JSON value satisfies ----------------------------------------------------------
@pytest.mark.parametrize("route,fields,param,stream", [
    ("/v1/chat/completions", _format(json.dumps(LOOP)), "response_format.json_schema.schema",
     False),
    ("/v1/chat/completions", _format(json.dumps(LOOP)), "response_format.json_schema.schema",
     True),
    ("/v1/completions", _format(json.dumps(LOOP)), "response_format.json_schema.schema", False),
    ("/v1/chat/completions", _tools('{"type": "object"}', '"auto"') + ", "
     + _format(json.dumps(LOOP)), "response_format.json_schema.schema", False),
], ids=["chat", "chat-stream", "completions", "tools-and-format"])
def test_a_schema_no_value_satisfies_is_a_400_not_an_empty_answer(client, route, fields, param,
                                                                  stream):
    """A ``$ref`` that refers only to itself defines no value: llguidance compiles it, and its
    first mask allows only the end token, so the answer was empty text with
    ``finish_reason: stop``, 200, as if the schema had been honoured (with tools, the answer
    left out and the model sent to call one). Now a 400 naming the field, whole or streamed
    (before any chunk)."""
    needs.module("llguidance", "server")
    r = _post(client, route, fields, stream)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param
    assert "no JSON value satisfies it" in error["message"], error["message"]


def test_a_recursive_schema_that_has_values_is_still_served(client):
    """The check refuses only a grammar that can end before any text: a schema recursing
    through a choice that ends (a linked list of nulls) is answered, its JSON parsed."""
    needs.module("llguidance", "server")
    schema = {"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": "#"},
                                           "maxItems": 1}]}
    r = client.post("/v1/chat/completions", json={
        "messages": CHAT, "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x",
                                                                   "schema": schema}}})
    assert r.status_code == 200, r.text[:300]
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])
    assert choice["message"]["content"]


# ---- best_of below n ----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_best_of_below_n_is_a_400_naming_best_of(client, stream):
    """``best_of: 1`` with ``n: 2`` asks for the best one of one candidate and for two
    choices; OpenAI and vLLM refuse it (vLLM: "best_of must be greater than or equal to n").
    It was served with two choices. Now a 400 naming ``best_of``; ``best_of`` equal to ``n``
    (1) and left out are still served."""
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "n": 2,
                                              "best_of": 1, "stream": stream})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "best_of"
    assert error["message"].startswith("best_of=1 < n=2: best_of must be >= n"), error["message"]
    for body in ({"n": 1, "best_of": 1}, {"n": 2}, {"n": 2, "best_of": None}):
        served = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, **body})
        assert served.status_code == 200, served.text[:300]
        assert len(served.json()["choices"]) == body["n"]


# ---- Authorization given twice ----------------------------------------------------------------
KEY = "probe59-api-key"
TOKEN = "probe59-admin-token"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe59-keyed"))
    try:
        with TestClient(create_app(executor, ServerConfig(api_key=KEY, admin_token=TOKEN))
                        ) as client:
            yield client
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("route,secret", [("/v1/completions", KEY),
                                          ("/admin/drain?grace=abc", TOKEN)],
                         ids=["api-key", "admin-token"])
@pytest.mark.parametrize("order", ["right-first", "wrong-first"])
def test_authorization_given_twice_is_a_401_whichever_comes_first(keyed, route, secret, order):
    """``Authorization`` is one credential (RFC 9110 section 11.6.2), and the server took the
    first of two: the right key followed by a wrong one was let in, the wrong one first
    refused as if no key had been sent, whatever a proxy in front had checked. Two are now a
    401 naming the header given twice, whichever is first; one is read as before."""
    pair = [("authorization", f"Bearer {secret}"), ("authorization", "Bearer wrong")]
    if order == "wrong-first":
        pair.reverse()
    body = {"prompt": "hi", "max_tokens": 1} if route == "/v1/completions" else None
    r = keyed.post(route, json=body, headers=pair)
    assert r.status_code == 401, r.text[:300]
    error = r.json()["error"]
    assert error["type"] == "authentication_error"
    assert error["message"].startswith("Authorization given 2 times: send one"), error["message"]
    once = keyed.post(route, json=body, headers={"authorization": f"Bearer {secret}"})
    # the key alone serves; the admin token alone reaches the route (its 400 naming grace)
    if route == "/v1/completions":
        assert once.status_code == 200, once.text[:300]
    else:
        assert once.status_code == 400 and once.json()["error"]["param"] == "grace", once.text


# ---- a list refused for its length ------------------------------------------------------------
@pytest.mark.parametrize("field,value,expected", [
    ("stop", [f"s{i}" for i in range(17)], "stop: 17 given: at most 16 stop strings"),
    ("stop_token_ids", list(range(100)), "stop_token_ids: 100 given: at most 64 ids"),
    ("logit_bias", {str(i): 1 for i in range(301)}, "logit_bias: 301 given: at most 300 entries"),
])
def test_a_list_over_its_limit_is_refused_naming_its_count(client, field, value, expected):
    """17 stop strings were refused ``stop=["s0", "s1", "s2", "s3"]: at most 16 stop
    strings``: the first four shown as if they were the whole list, a list of 4 refused for
    being over 16; 301 ``logit_bias`` entries ``logit_bias=301: ...``, as if the bias were
    301. The refusal now says how many were given."""
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, field: value})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field
    assert error["message"] == expected


# ---- a body in Latin-1 ------------------------------------------------------------------------
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_a_body_that_is_not_utf8_names_the_byte_not_a_json_syntax_error(client, route):
    """A body encoded in Latin-1 (``café`` as ``caf\\xe9``: what a Windows client or
    ``curl --data @file`` of a cp1252 file sends) was refused with the parser's words,
    ``body: Invalid JSON: invalid unicode code point at line 1 column 16`` (or "EOF while
    parsing a string"): a JSON syntax error the client did not make. UTF-16 and UTF-32 were
    already named; the refusal now says the body is not UTF-8 and which byte."""
    body = ({"messages": [{"role": "user", "content": "caf\u00e9"}]}
            if route == "/v1/chat/completions" else {"prompt": "caf\u00e9"})
    raw = json.dumps(body, ensure_ascii=False).encode("latin-1")  # é as one byte, 0xE9
    r = client.post(route, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    at = raw.index(b"\xe9")
    assert error["message"] == ("body: JSON must be UTF-8 (RFC 8259 section 8.1); byte "
                                f"{at} (0xE9) is not UTF-8 (a Latin-1 or Windows-1252 body?): "
                                "send it encoded as UTF-8"), error["message"]
    assert error["param"] is None
    good = client.post(route, content=raw.decode("latin-1").encode("utf-8"),
                       headers={"content-type": "application/json"})
    assert good.status_code == 200, good.text[:300]
