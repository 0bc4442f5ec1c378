"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 75 (branch
probe-http): the less-used routes and the parameters the three generation routes share. Real
executor on the bundled emulator behind ``create_app``; every wait bounded."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from test_server_support import (
    busy_engine,
    live_fixture,  # noqa: F401 - the ``live`` fixture
    send_raw,
    serve_like_fixture,  # noqa: F401 - the ``serve_like`` fixture
    server_idle,
    split_head,
    stepped_server,
    wait_device_idle,
    wait_for,
)

TOKEN = "probe75-admin"
WAIT_S = 30.0
FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", content=json.dumps(body).encode(),
                      headers={"content-type": "application/json"}, timeout=30)


@pytest.mark.parametrize("fields", [
    {"text": {"format": {"type": "json_schema"}}},
    {"text": {"format": {"type": "json_schema", "name": "x y", "schema": {"type": "object"}}}},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"},
                         "strict": "yes"}}},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
    {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"$ref": "#/nope"}}}},
    {"tools": [{**FUNCTION, "parameters": {"type": "nonsense"}}]},
    {"tools": [{**FUNCTION, "parameters": {"$ref": "#/nope"}}]},
], ids=["format-without-name", "format-name-with-a-space", "strict-no-boolean",
        "schema-of-an-unknown-type", "schema-ref-to-nothing", "tool-parameters-unknown-type",
        "tool-parameters-ref-to-nothing"])
def test_input_tokens_refuses_the_text_format_and_tools_responses_refuses(live, fields):
    """``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``) is
    documented "refused as /v1/responses refuses", yet it counted (200) a body whose
    ``text.format`` json_schema or function tool ``/v1/responses`` refuses with a 400 naming
    the field: the count checked the tools' names and shapes only, never the structure the
    Responses would be generated under (its ``name``, ``strict``, a schema llguidance cannot
    compile), so a client counting before it sends learnt of the error only once it sent.
    The count now refuses it as the Responses do: the same status, ``param`` and message."""
    server, _, _ = live
    body = {"input": "hi", **fields}
    answered = _post(server, "/v1/responses", {**body, "max_output_tokens": 2})
    counted = _post(server, "/v1/responses/input_tokens", body)
    assert answered.status_code == 400, answered.text[:300]
    assert counted.status_code == 400, counted.text[:300]
    assert counted.json()["error"]["param"] == answered.json()["error"]["param"], counted.text
    assert counted.json()["error"]["message"] == answered.json()["error"]["message"]


def test_input_tokens_counts_a_valid_text_format_and_tools_as_responses_admit_them(live):
    """A ``text.format`` json_schema and tools the Responses take are counted as before: the
    count is the Responses' ``usage.input_tokens``."""
    server, _, _ = live
    body = {"input": "hi", "tools": [FUNCTION],
            "text": {"format": {"type": "json_schema", "name": "x", "strict": True,
                                "schema": {"type": "object", "properties": {},
                                           "additionalProperties": False}}}}
    answered = _post(server, "/v1/responses", {**body, "max_output_tokens": 2})
    counted = _post(server, "/v1/responses/input_tokens", body)
    assert answered.status_code == 200, answered.text[:300]
    assert counted.status_code == 200, counted.text[:300]
    assert counted.json()["input_tokens"] == answered.json()["usage"]["input_tokens"] > 0


@pytest.mark.parametrize("target", [
    "/v1/completions#x", "/v1/completions?#", "/health#frag", "http://127.0.0.1/v1/completions#x",
], ids=["fragment", "empty-query-and-fragment", "get-route", "absolute-form"])
def test_a_request_target_with_a_fragment_is_refused(serve_like, target):
    """A request target holding a fragment (``POST /v1/completions#x``; RFC 9112 section 3.2:
    the origin and absolute forms have none, a client strips it before sending, RFC 9110
    section 7.1) was served as the path before the ``#`` (uvicorn's URL parser drops the
    fragment), so a proxy in front matching exact paths (refusing ``/admin/reload``) passed
    ``/admin/reload#x`` on to the route, as it did ``%2F`` and ``%0A`` until stops 64 and 72.
    It is the OpenAI-shaped 400 ``request.malformed_http`` naming the fragment, nothing run."""
    body = json.dumps({"prompt": [1, 2], "max_tokens": 1}).encode()
    method = "GET" if target.startswith("/health") else "POST"
    data, _ = send_raw(serve_like.port, (
        f"{method} {target} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body) if method == 'POST' else 0}\r\nconnection: close\r\n\r\n"
    ).encode() + (body if method == "POST" else b""))
    status, headers, answer = split_head(data)
    assert status == b"HTTP/1.1 400 Bad Request", data[:400]
    error = json.loads(answer)["error"]
    assert error["code"] == "request.malformed_http", error
    assert "fragment" in error["message"] and "#" in error["message"], error
    assert headers.get("x-request-id"), headers


@pytest.mark.parametrize(("x_request_id", "written"), [
    ("job/42", "job%2F42"), ("job/42", "job%2f42"), ("..", "%2e%2e"), ("a/./b", "a%2F.%2Fb"),
], ids=["encoded-slash", "lower-case-escape", "dot-segment", "slash-and-dot"])
def test_a_request_is_cancelled_by_an_x_request_id_written_with_escapes(tmp_path, x_request_id,
                                                                        written):
    """``POST /admin/cancel/{id}`` takes a request's ``X-Request-Id`` (docs/server.md: 1 to 128
    printable ASCII characters, ``/`` among them), and its route's parameter takes a slash;
    but a client escaping the id as a path segment (``urllib.parse.quote(id, safe="")``,
    ``job%2F42``) was answered 404 ``id="job%2F42": no request in progress has this ...``
    and the request ran on: the escape of a slash or a dot segment was kept as sent outside
    the model id (stop 64's rule against ``/admin%2Freload``), the one parameter allowed a
    decoded slash. The cancel's id now is a parameter that takes one too, so the request is
    found by its id and cancelled (202, the client answered 409 ``request.aborted``)."""
    with stepped_server(tmp_path, admin_token=TOKEN) as (server, service, executor):
        emu = executor.device.emu
        assert emu.set_stepped(True) == 0
        out: list = []
        thread = threading.Thread(target=lambda: out.append(httpx.post(
            f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 40},
            headers={"x-request-id": x_request_id}, timeout=WAIT_S)))
        thread.start()
        try:
            wait_for(lambda: busy_engine(emu) is not None, WAIT_S, "a job held on the device")
            answer = httpx.post(f"{server.url}/admin/cancel/{written}", timeout=WAIT_S,
                                headers={"authorization": f"Bearer {TOKEN}"})
        finally:
            assert emu.set_stepped(False) == 0
            thread.join(WAIT_S)
        assert answer.status_code == 202, answer.text
        assert answer.json()["x_request_id"] == x_request_id, answer.json()
        assert out[0].status_code == 409, out[0].text
        assert out[0].json()["error"]["code"] == "request.aborted", out[0].text
        wait_for(lambda: server_idle(service), WAIT_S, "every sequence id back")
        wait_device_idle(executor, WAIT_S)


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"content": "hi", "add_generation_prompt": False}, "add_generation_prompt"),
    ({"prompt": "hi", "chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),
    ({"content": "hi", "chat_template_kwargs": {"x": 1}}, "chat_template_kwargs"),
], ids=["prompt-add-generation-prompt", "content-add-generation-prompt",
        "prompt-template-kwargs", "content-template-kwargs"])
def test_tokenize_refuses_a_chat_field_without_messages(live, fields, param):
    """``POST /tokenize`` refuses the chat's ``tools`` and ``continue_final_message`` given
    with a ``prompt`` (or llama-server's ``content``), which no chat template renders ("named,
    not ignored"), but took ``add_generation_prompt: false`` and ``chat_template_kwargs``
    there and ignored them: the count was the prompt's as if they were unsaid. Each is
    refused so, naming it; their neutral values (``add_generation_prompt: true``, ``{}``,
    null) are taken as before."""
    server, _, _ = live
    refused = _post(server, "/tokenize", fields)
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == param and "only with messages" in error["message"], error
    neutral = {**fields, param: True if param == "add_generation_prompt" else {}}
    assert _post(server, "/tokenize", neutral).status_code == 200
    assert _post(server, "/tokenize", {**fields, param: None}).status_code == 200


@pytest.mark.parametrize("temperature", [1e-300, 1e-320, 5e-324])
def test_a_tiny_temperature_samples_the_greedy_token_without_a_floating_point_warning(
        temperature):
    """``temperature: 1e-320`` (any number in (0, 2] is taken) made the sampler's
    ``(x - max) / temperature`` overflow to -inf, the right limit (the most likely token
    alone keeps its mass), but numpy said so on stderr, ``sampling.py: RuntimeWarning:
    overflow encountered in divide``, in the server's log for a valid request (and raised it
    under ``-W error``, a 500 from the worker thread). The overflow is expected there: no
    warning, the greedy token drawn."""
    import warnings

    import numpy as np

    from calexec.drivers.serving.sampling import SamplingParams, pick

    logits = np.array([0.5, 3.0, 2.999999, -1.0, 2.5], dtype=np.float32)
    params = SamplingParams(temperature=temperature, seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        token, _ = pick(logits, params, 0)
    assert token == int(np.argmax(logits)) == 1


@pytest.mark.parametrize(("method", "target", "meant"), [
    ("GET", "//v1/models/calexec-qwen3-synthetic", "/v1/models/calexec-qwen3-synthetic"),
    ("GET", "/v1//models/calexec-qwen3-synthetic", "/v1/models/calexec-qwen3-synthetic"),
    ("GET", "/v1/responses//resp_x", "/v1/responses/resp_x"),
    ("GET", "/v1/responses/resp_x/", "/v1/responses/resp_x"),
    ("POST", "//admin/cancel/some-id", "/admin/cancel/some-id"),
], ids=["models-id-doubled-first", "models-id-doubled-inside", "responses-id-doubled",
        "responses-id-trailing", "cancel-doubled-first"])
def test_a_slash_slip_before_a_path_parameter_names_the_route_meant(serve_like, method,
                                                                    target, meant):
    """A 404 whose path is a route's but for a doubled or trailing slash names the route
    meant (stop 71: ``POST //v1/completions`` is told ``did you mean /v1/completions?``), but
    only among the routes without a path parameter: ``GET //v1/models/<id>`` (the SDK's
    ``models.retrieve`` behind a base URL ending in ``/``), ``/v1/responses//<id>`` and
    ``POST //admin/cancel/<id>`` were told ``no such route`` alone. The path tidied of its
    slip is now tried against every route, so each names the route it meant."""
    data, _ = send_raw(serve_like.port, (
        f"{method} {target} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n"
        "connection: close\r\n\r\n").encode())
    status, _, answer = split_head(data)
    assert status == b"HTTP/1.1 404 Not Found", data[:300]
    message = json.loads(answer)["error"]["message"]
    assert f"did you mean {meant}?" in message, message
