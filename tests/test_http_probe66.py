"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 66 (branch
probe-http): a JSON body giving one key twice. Real executor on the bundled emulator."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe66"))
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            yield client
    finally:
        executor.shutdown(5.0)


CHAT = '"messages": [{"role": "user", "content": "hi"}]'


@pytest.mark.parametrize("route, body, param", [
    ("/v1/completions", '{"prompt": [1, 2], "max_tokens": 1, "max_tokens": 2}', "max_tokens"),
    # the same key written with an escape is the same key
    ("/v1/completions", '{"prompt": [1, 2], "max_tokens": 1, "max\\u005ftokens": 2}',
     "max_tokens"),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "hi", "role": "system"}], "max_tokens": 1}',
     "messages.0.role"),
    ("/v1/chat/completions", '{' + CHAT + ', "max_tokens": 1, "response_format": '
     '{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", '
     '"type": "array"}}}}', "response_format.json_schema.schema.type"),
    ("/v1/responses", '{"input": "hi", "max_output_tokens": 1, "input": "bye"}', "input"),
    ("/tokenize", '{"prompt": "hi", "prompt": "bye"}', "prompt"),
])
def test_a_key_given_twice_in_one_object_is_refused_naming_it(client, route, body, param):
    """``{"prompt": [1, 2], "max_tokens": 1, "max_tokens": 2}`` was a 200 served with the
    second value (the parser keeps the last key silently; a proxy or log reading the first
    saw another request), a message's ``role`` given twice likewise, where ``/admin/reload``
    refuses a key given twice. It is a 400 naming the key's path; the body with each key once
    is served."""
    r = client.post(route, content=body.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"] == (f"{param}: given more than once in its object (the last one "
                                "would silently win), give it once"), error
    once = {"/v1/completions": '{"prompt": [1, 2], "max_tokens": 1}',
            "/v1/chat/completions": '{' + CHAT + ', "max_tokens": 1}',
            "/v1/responses": '{"input": "hi", "max_output_tokens": 1}',
            "/tokenize": '{"prompt": "hi"}'}[route]
    r = client.post(route, content=once.encode(), headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text[:300]


def test_a_refused_field_is_named_before_a_key_given_twice(client):
    """A body both malformed in a field and repeating a key is refused for the field, as
    before: the key check comes after the parser's own."""
    r = client.post("/v1/completions", content=b'{"prompt": [1, 2], "max_tokens": 1, '
                    b'"max_tokens": -1}', headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text[:300]
    assert r.json()["error"]["param"] == "max_tokens"
    assert r.json()["error"]["message"].startswith("max_tokens=-1"), r.json()
