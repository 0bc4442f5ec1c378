"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 72 (branch
probe-http): a path ending in an encoded line feed routed as the route, a Responses
``tool_choice`` of the wrong JSON type named by pydantic's union branch, and what a Responses
``tool_choice`` without ``tools`` is told. Real executor on the bundled emulator; loopback
only; every wait bounded."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import pytest

from calexec.drivers.serving.service import ServerConfig
from test_server_support import started_executor


def _answers(server_url: str, asked: list[tuple[str, str, bytes | None]],
             headers: dict[str, str] | None = None) -> list[tuple[int, dict | None]]:
    """Each ``(method, path, body)`` of ``asked`` sent on its own connection as written (the
    path's escapes as the client wrote them): its status and JSON body (None when it has no
    body)."""
    where = urlsplit(server_url)
    out = []
    for method, path, body in asked:
        conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
        try:
            conn.request(method, path, body=body,
                         headers={"Content-Type": "application/json", **(headers or {})})
            response = conn.getresponse()
            data = response.read()
            out.append((response.status, json.loads(data) if data else None))
        finally:
            conn.close()
    return out


def test_a_path_ending_in_an_encoded_line_feed_is_no_route(tmp_path):
    """``GET /health%0A``, ``POST /v1/completions%0A``, ``GET /v1/models/<id>%0A`` and
    ``GET /debug/statecharts/live.json%0A`` were served as the route without the line feed:
    Starlette's route patterns end in ``$``, which Python's ``re`` matches before a final
    ``\\n``, so a path no route has reached every route (a proxy in front filtering the
    exact path let it through, as ``/admin%2Freload`` did until stop 60), and
    ``/v1/models/<id>%0A`` answered 200 for an id with a line feed that a body's ``model``
    is refused for (404). Such a path is now the 404 of a path no route serves, and such an
    id one no model has (``model_not_found``)."""
    from calexec.drivers.serving.server import create_app
    from test_server_support import MODEL, LiveServer

    executor = started_executor(tmp_path)
    completion = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    try:
        with LiveServer(create_app(executor, ServerConfig())) as server:
            asked = [("GET", "/health%0A", None), ("GET", "/health%0a", None),
                     ("POST", "/v1/completions%0A", completion),
                     ("GET", "/debug/statecharts/live.json%0A", None),
                     ("POST", "/admin/drain%0A", None)]
            asked_ids = [("GET", f"/v1/models/{MODEL}%0A", None),
                         ("GET", "/v1/models/a%0Ab", None)]
            got = _answers(server.url, asked)
            ids = _answers(server.url, asked_ids)
            # the routes themselves are served as before
            plain = _answers(server.url, [("GET", "/health", None),
                                          ("GET", f"/v1/models/{MODEL}", None)])
    finally:
        executor.shutdown(5.0)
    for (method, path, _), (status, body) in zip(asked, got):
        assert status == 404, (method, path, status, body)
        assert body is not None and body["error"]["code"] == "not_found", (path, body)
        assert "no such route" in body["error"]["message"], (path, body)
    assert plain[0][0] == 200 and plain[1][0] == 200, plain
    # an id holding a line feed, at its end or inside it (the 404 of no route until now),
    # is an id no model has, as a body's model is
    for (_, path, _), (status, body) in zip(asked_ids, ids):
        assert status == 404 and body["error"]["code"] == "model_not_found", (path, body)
        assert body["error"]["param"] == "model", (path, body)


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/responses/input_tokens"])
@pytest.mark.parametrize("choice", [5, 1.5, True, ["auto"]])
def test_a_responses_tool_choice_of_the_wrong_type_names_the_field(tmp_path, route, choice):
    """``tool_choice: 5`` (or a boolean, a list) on ``/v1/responses`` was refused
    ``tool_choice.str=5: Input should be a valid string`` with ``param: tool_choice.str``:
    ``str`` is pydantic's name of a branch of the field's type (a string or an object), no
    field of the body, which docs/server.md "Errors" says a ``param`` never is. The field is
    named, and every form it takes."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    body = {"input": "hi", "tool_choice": choice,
            "tools": [{"type": "function", "name": "f"}]}
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post(route, json=body)
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "tool_choice", error
    assert error["message"].startswith(f"tool_choice={json.dumps(choice)}: must be one of "
                                       "str, "), error
    assert "tool_choice.str" not in error["message"], error


@pytest.mark.parametrize("route", ["/v1/responses", "/v1/responses/input_tokens"])
@pytest.mark.parametrize("tools", [None, []])
def test_a_responses_tool_choice_without_tools_is_shown_as_sent(tmp_path, route, tools):
    """``tool_choice: {"type": "function", "name": "f"}`` without ``tools`` on
    ``/v1/responses`` was refused ``tool_choice={"type": "function", "function": {"name":
    "f"}}: needs tools``: the chat form the body was translated into, which the client never
    sent (docs/server.md: a Responses error's message names what the client sent, since stop
    63). It now shows the value as sent."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    choice = {"type": "function", "name": "f"}
    body = {"input": "hi", "tool_choice": choice,
            **({} if tools is None else {"tools": tools})}
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post(route, json=body)
            required = client.post(route, json={"input": "hi", "tool_choice": "required"})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "tool_choice", error
    assert error["message"] == f"tool_choice={json.dumps(choice)}: needs tools", error
    assert required.status_code == 400, required.text[:300]
    assert required.json()["error"]["message"] == 'tool_choice="required": needs tools'


@pytest.mark.parametrize("route, body, param", [
    ("/v1/chat/completions",
     {"tools": [{"type": "function", "function": {"name": "get_weather\n"}}],
      "tool_choice": "required"}, "tools.0.function.name"),
    ("/v1/chat/completions",
     {"response_format": {"type": "json_schema",
                          "json_schema": {"name": "answer\n", "schema": {"type": "object"}}}},
     "response_format.json_schema.name"),
    ("/v1/responses", {"tools": [{"type": "function", "name": "get_weather\n"}]},
     "tools.0.name"),
])
def test_a_tool_or_schema_name_ending_in_a_line_feed_is_refused(tmp_path, route, body, param):
    """A function tool named ``"get_weather\\n"`` (a name read from a file with its line end)
    was served: the name check (``1 to 64 letters, digits, _ or -``, grammar.FUNCTION_NAME)
    ended in ``$``, which Python's ``re`` matches before a final line feed, so the name went
    into the prompt and the tool-call grammar with its line feed (a ``tool_choice:
    "required"`` answer came back with no tool call, cut at max_tokens). The same held for a
    ``json_schema``'s ``name``. Both are refused, naming the field."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    asked = ({"input": "hi", "max_output_tokens": 4} if route == "/v1/responses" else
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post(route, json={**asked, **body})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "must be a string of 1 to 64 letters, digits, _ or -" in error["message"], error


def test_a_manifest_sha256_pin_ending_in_a_line_feed_is_refused_at_load(tmp_path):
    """``calbin_sha256 = "<64 hex digits>\\n"`` in a manifest (the output of ``sha256sum ...
    | cut -d' ' -f1`` pasted with its line end) was taken by the check "must be 64
    lower-case hex digits" (``SHA256_RE``'s ``$`` matched before the final line feed); the
    pin then never equalled a calbin's digest, so ``calexec serve --manifest`` and every
    reload refused the right calbin with ``calbin_sha256=<hex> but ... pins <hex>`` (the
    same digits twice). The manifest is refused at load, naming the key."""
    from calexec.contracts.manifest import ManifestError, default_manifest_path, load_manifest
    from calexec.contracts.types import SHA256_RE

    text = open(default_manifest_path(), encoding="utf-8").read()
    digest = "ab" * 32
    path = tmp_path / "m.toml"
    path.write_text(text.replace('calrt_version = "0.7.6"\n',
                                 f'calrt_version = "0.7.6"\ncalbin_sha256 = "{digest}\\n"\n'),
                    encoding="utf-8")
    with pytest.raises(ManifestError) as refused:
        load_manifest(str(path))
    assert "calbin_sha256" in str(refused.value), refused.value
    assert "64 lower-case hex digits" in str(refused.value), refused.value
    assert SHA256_RE.fullmatch(digest) and not SHA256_RE.fullmatch(digest + "\n")
    # the same pin without the line feed loads
    path.write_text(text.replace('calrt_version = "0.7.6"\n',
                                 f'calrt_version = "0.7.6"\ncalbin_sha256 = "{digest}"\n'),
                    encoding="utf-8")
    assert load_manifest(str(path)).calbin_sha256 == digest


@pytest.mark.parametrize("given", ["no", 0, [], {}])
def test_a_responses_include_obfuscation_of_the_wrong_type_is_refused(tmp_path, given):
    """``stream_options: {"include_obfuscation": "no"}`` on a streamed ``/v1/responses`` was
    served, the value taken whatever it was, where docs/server.md says a ``stream_options``
    option of the wrong type is a 400 naming it and chat refuses
    ``stream_options.include_usage: "yes"`` so. It is refused naming the option; a boolean
    (or null) is served as before."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    body = {"input": "hi", "max_output_tokens": 1, "stream": True}
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post("/v1/responses",
                            json={**body, "stream_options": {"include_obfuscation": given}})
            served = [client.post("/v1/responses",
                                  json={**body, "stream_options": {"include_obfuscation": ok}})
                      for ok in (True, False, None)]
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "stream_options.include_obfuscation", error
    assert error["message"].startswith(
        f"stream_options.include_obfuscation={json.dumps(given)}: must be a boolean"), error
    assert [s.status_code for s in served] == [200, 200, 200], [s.text[:200] for s in served]


@pytest.mark.parametrize("route, needs", [("/v1/completions", "prompt"),
                                          ("/v1/chat/completions", "messages"),
                                          ("/v1/responses", "input"),
                                          ("/detokenize", "tokens")])
@pytest.mark.parametrize("raw, kind", [(b"[]", "array"), (b'[{"prompt": "hi"}]', "array"),
                                       (b'"hi"', "string"), (b"5", "number"),
                                       (b"null", "null"), (b"true", "boolean")])
def test_an_api_body_that_is_no_json_object_is_named_by_its_type(tmp_path, route, needs, raw,
                                                                 kind):
    """A body that is valid JSON but no object (``[{"prompt": ...}]``, a batch sent as an
    array; ``null``; a bare string) was refused ``body: Input should be an object``:
    pydantic's words, naming neither what was sent nor what the route takes, where
    ``/admin/reload`` says ``body: must be a JSON object {"calbin": PATH}, not array``. The
    API's routes now say the body's JSON type and the object they take."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post(route, content=raw, headers={"Content-Type": "application/json"})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] is None, error
    assert error["message"].startswith(f"body: must be a JSON object with {needs} "), error
    assert error["message"].endswith(f", not {kind}"), error
