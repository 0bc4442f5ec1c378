"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 66 (branch
probe-http): a JSON body giving one key twice; a grammar compiled, and its matcher built, on
the event loop. Real executor on the bundled emulator."""

from __future__ import annotations

import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving import grammar
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import live_fixture, started_executor

assert live_fixture  # the fixture ``live``, imported by its name


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


def served_while_held(url: str, route: str, body: dict, entered: threading.Event,
                      release: threading.Event, what: str) -> None:
    """POSTs ``body`` to ``route`` from a thread; once the test's stand-in has ``entered``
    (``what`` if never), ``/health`` and a plain completion are asked while it holds (until
    ``release``, set here afterwards): each of the three is answered 200."""
    answers: dict[str, httpx.Response] = {}
    asking = threading.Thread(target=lambda: answers.setdefault(
        "held", httpx.post(f"{url}{route}", json=body, timeout=60.0)))
    asking.start()
    try:
        assert entered.wait(30.0), what
        health = httpx.get(f"{url}/health", timeout=10.0)
        plain = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2],
                                                          "max_tokens": 2}, timeout=10.0)
        assert not release.is_set()
    finally:
        release.set()
        asking.join(60.0)
    assert health.status_code == 200, health.text[:300]
    assert plain.status_code == 200, plain.text[:300]
    assert answers["held"].status_code == 200, answers["held"].text[:300]


@pytest.mark.parametrize("route, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "response_format": {"type": "json_object"}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "parameters": {"type": "object"}}}]}),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2,
                         "response_format": {"type": "json_object"}}),
])
def test_other_clients_are_served_while_a_grammar_compiles(live, monkeypatch, route, body):
    """A ``json_schema`` of 2,000 ``anyOf`` branches (170 KB, within the body limit) took 12 s
    of checks and llguidance's compile on the event loop: every other client, ``/health``
    and running streams alike, waited that long. The compile runs in a worker thread: here
    it is held until ``/health`` and another completion have been answered (on the old code
    they waited for it: their deadline passed), then the request is answered."""
    server, _, service = live
    entered, release = threading.Event(), threading.Event()
    name = "chat_structure" if route == "/v1/chat/completions" else "completion_structure"
    real = getattr(grammar, name)

    def held(*args):
        entered.set()
        release.wait(30.0)  # (bounded: the test sets it)
        return real(*args)

    monkeypatch.setattr(grammar, name, held)
    served_while_held(server.url, route, body, entered, release, "the grammar was never built")


def test_other_clients_are_served_while_a_grammar_s_matcher_is_built(live, monkeypatch):
    """Each choice of a request with a grammar builds llguidance's matcher when its first
    token is chosen: half a second for the 2,000-branch schema above, on the event loop,
    where ``/health`` waited 2.3 s behind it once the compile had moved to a thread. It is
    built in a worker thread: held here until ``/health`` and another completion have been
    answered (on the old code they waited for it: their deadline passed)."""
    server, _, _ = live
    entered, release = threading.Event(), threading.Event()
    real = grammar.Structure.start

    def held(self):
        entered.set()
        release.wait(30.0)  # (bounded: the test sets it)
        return real(self)

    monkeypatch.setattr(grammar.Structure, "start", held)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_object"}}
    served_while_held(server.url, "/v1/chat/completions", body, entered, release,
                      "the matcher was never built")
