"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 75 (branch
probe-http): the less-used routes and the parameters the three generation routes share. Real
executor on the bundled emulator behind ``create_app``; every wait bounded."""

from __future__ import annotations

import json

import httpx
import pytest

from test_server_support import live_fixture  # noqa: F401 - the ``live`` fixture

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
