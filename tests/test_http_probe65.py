"""Adversarial HTTP input found by probing a loopback ``calexec serve`` at stop 65 (branch
probe-http): a refused parameter's message that contradicts the value it refuses. Real
executor on the bundled emulator."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import started_executor


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("probe65"))
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            yield client
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("value, shown", [(0, "0"), (-3, "-3"), (True, "true"), (1.5, "1.5"),
                                          ("2", '"2"')])
def test_a_best_of_below_one_or_of_no_integer_is_not_told_best_of_above_one(client, value,
                                                                            shown):
    """``best_of: 0`` (or -3, ``true``, 1.5, ``"2"``) was refused ``best_of=0: best_of > 1 is
    not supported``: untrue of the value sent, and no word of what to send. It now says what
    ``best_of`` must be and what to send; ``best_of: 3`` keeps its answer."""
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1,
                                             "best_of": value})
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "best_of", error
    assert error["message"].startswith(f"best_of={shown}: must be an integer >= 1"), error
    assert "send 1 or leave it out" in error["message"], error
    r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "best_of": 3})
    assert r.json()["error"]["message"].startswith("best_of=3: best_of > 1 is not supported")
    assert "send 1 or leave it out" in r.json()["error"]["message"]  # (since stop 71)


@pytest.mark.parametrize("route, base", [
    ("/v1/completions", {"prompt": [1, 2]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_two_logit_bias_keys_naming_one_token_are_refused(client, route, base):
    """``"logit_bias": {"7": 60, "07": 60}`` names token 7 twice (JSON keeps both keys); both
    biases were added to its logit, 120 where a bias is at most 100, and the answer was a
    200. It is a 400 naming both keys and the token now; ``{"7": 60}`` alone is served."""
    body = {**base, "max_tokens": 1, "logit_bias": {"7": 60, "07": 60}}
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "logit_bias", error
    assert error["message"] == ('logit_bias["07"] and logit_bias["7"] both name token 7: give '
                                "each token once"), error
    assert client.post(route, json={**body, "logit_bias": {"7": 60}}).status_code == 200


@pytest.mark.parametrize("path, body, field, value", [
    ("/v1/completions?stream=true", {"prompt": [1, 2], "max_tokens": 2}, "stream", '"true"'),
    ("/v1/chat/completions?max_tokens=1",
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, "max_tokens", '"1"'),
    ("/v1/responses?stream=true", {"input": "hi", "max_output_tokens": 2}, "stream", '"true"'),
    ("/tokenize?add_special_tokens=false", {"prompt": "hi"}, "add_special_tokens", '"false"'),
])
def test_a_body_field_given_in_the_query_is_refused_naming_it(client, path, body, field, value):
    """``POST /v1/completions?stream=true`` was answered a whole JSON answer, the query
    unread and unsaid (every other parameter the server does not honour is refused, named).
    A body field given in the query is a 400 naming it and where to send it; a query
    parameter no body field is named so (an Azure client's ``api-version``) is still
    ignored."""
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == field, error
    assert error["message"] == (f"{field}={value}: given in the query, which this route does "
                                f"not read; send {field} in the JSON body"), error
    route = path.split("?")[0]
    assert client.post(f"{route}?api-version=2024-06-01", json=body).status_code == 200
