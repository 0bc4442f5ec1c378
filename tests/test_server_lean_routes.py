"""The completion routes without FastAPI's per-request handler (stop 67, issue 28:
``server.lean_endpoints``): ``POST /v1/completions`` and ``/v1/chat/completions`` call their
endpoint with the request, not through FastAPI's ``get_request_handler`` (which read no body
for them, solved the one ``Request`` parameter's dependencies and passed the returned
``Response`` on as it was). Differential: the same requests, valid and refused, generated
from a seed, plus the pinned corpus of ``test_server_answers_golden``, sent to the app as
``create_app`` builds it and to the same app with FastAPI's handler put back on those routes
(``request_response(route.get_route_handler())``, what ``APIRoute`` builds): every status,
header a client reads and body is equal, and so is the OpenAPI document. Passes on the code
before the change (both apps are then FastAPI's)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import fastapi.routing
import pytest
from fastapi.routing import APIRoute, request_response

from calexec.drivers.serving import openai_api
from calexec.drivers.serving import server as server_module
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_answers_golden import ADMIN, CHAT, COMPLETION, CORPUS, ORIGIN, _answer, _json
from test_server_support import LiveServer, started_executor

HOT = ("/v1/completions", "/v1/chat/completions")


def _generated(seed: int, count: int) -> list[tuple[str, str, str, bytes | None, dict[str, str]]]:
    """``count`` requests to the two routes drawn from ``seed``: valid ones (streamed or not,
    n, logprobs, stop), refused ones (a bad type, an unknown field, a refused parameter, an
    unknown model, bad JSON), with cookies, a query string and a client request id."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        chat = rng.random() < 0.5
        body: dict[str, Any] = dict(CHAT if chat else COMPLETION)
        body["max_tokens"] = rng.choice([1, 3, 8])
        if rng.random() < 0.3:
            body["stream"] = True
        if rng.random() < 0.2:
            body.update(n=2, temperature=0.8, seed=rng.randrange(100))
        if not chat and rng.random() < 0.2:
            body["logprobs"] = 1
        kind = rng.choice(["ok", "ok", "ok", "type", "field", "refused", "model", "json"])
        if kind == "type":
            body["max_tokens"] = "x"
        elif kind == "field":
            body["bogus"] = 1
        elif kind == "refused":
            body["best_of" if not chat else "functions"] = 2
        elif kind == "model":
            body["model"] = "nope"
        raw = b'{"prompt": [1,' if kind == "json" else _json(body)
        headers: dict[str, str] = {}
        if rng.random() < 0.3:
            headers["Cookie"] = f"a={i}; b=\"x y\"; broken"
        if rng.random() < 0.3:
            headers["X-Request-Id"] = f"gen-{i}"
        path = HOT[1] if chat else HOT[0]
        if rng.random() < 0.2:
            path += f"?q={i}&r=%20"
        out.append((f"generated {i} ({kind})", "POST", path, raw, headers))
    return out


def _fastapi_handlers(app: Any) -> None:
    """FastAPI's own handler back on the completion routes, as ``APIRoute`` builds it."""
    for route in app.router.routes:
        if isinstance(route, APIRoute) and route.path in HOT:
            route.app = request_response(route.get_route_handler())


def _answers(tmp: Path, plain: bool, requests: list) -> tuple[dict[str, Any], str]:
    tmp.mkdir(parents=True, exist_ok=True)
    executor = started_executor(tmp)
    try:
        config = ServerConfig(admin_token=ADMIN, max_body_bytes=4096, cors_origins=(ORIGIN,),
                              max_sequences=2, max_waiting=0)
        app = create_app(executor, config)
        if plain:
            _fastapi_handlers(app)
        with LiveServer(app) as live:
            got = {name: _answer(live.port, method, path, body, headers)
                   for name, method, path, body, headers in requests}
        return got, json.dumps(app.openapi(), sort_keys=False)
    finally:
        executor.shutdown(5.0)


@pytest.fixture
def solved(monkeypatch) -> list[int]:
    """Counts FastAPI's ``solve_dependencies`` calls (one per request its handler takes)."""
    calls = [0]
    real = fastapi.routing.solve_dependencies

    async def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return await real(*args, **kwargs)
    monkeypatch.setattr(fastapi.routing, "solve_dependencies", counting)
    return calls


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")  # (the app's own, in openapi())
def test_every_answer_equals_fastapis_handlers(tmp_path, solved):
    requests = [r for r in CORPUS if r[2].split("?")[0] in HOT] + _generated(67, 40)
    lean, lean_doc = _answers(tmp_path / "lean", False, requests)
    plain, plain_doc = _answers(tmp_path / "plain", True, requests)
    assert lean_doc == plain_doc  # /openapi.json's document, byte for byte
    assert sorted(lean) == sorted(plain)
    for name in plain:
        assert lean[name] == plain[name], name
    # the generated requests reach answers of each kind (a corpus all 500 would pin nothing)
    statuses = {a["status"] for a in plain.values()}
    assert {200, 400, 404} <= statuses, statuses


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")
def test_an_unexpected_error_is_the_same_500(tmp_path, monkeypatch):
    def broken(*args: Any) -> str:
        raise RuntimeError("a bug")
    monkeypatch.setattr(openai_api, "new_response_id", broken)
    requests = [("completion", "POST", HOT[0], _json(COMPLETION), {"X-Request-Id": "bug-1"}),
                ("chat", "POST", HOT[1], _json(CHAT), {"X-Request-Id": "bug-2"})]
    lean, _ = _answers(tmp_path / "lean", False, requests)
    plain, _ = _answers(tmp_path / "plain", True, requests)
    assert lean == plain
    assert {a["status"] for a in lean.values()} == {500}


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")
def test_a_completion_solves_no_dependencies(tmp_path, solved):
    """The point of the change: a completion and a chat request go past FastAPI's
    dependency solving (failed before it: one ``solve_dependencies`` a request); another
    route still takes FastAPI's handler."""
    requests = [("completion", "POST", HOT[0], _json(COMPLETION), {}),
                ("chat", "POST", HOT[1], _json(CHAT), {})]
    got, _ = _answers(tmp_path, False, requests)
    assert {a["status"] for a in got.values()} == {200}
    assert solved[0] == 0
    got, _ = _answers(tmp_path, False, [("models", "GET", "/v1/models", None, {})])
    assert got["models"]["status"] == 200 and solved[0] == 1


@pytest.mark.filterwarnings("ignore:Duplicate Operation ID")
def test_a_traced_request_takes_fastapis_handler(tmp_path, solved, monkeypatch):
    """While FastAPI traces a request (its OpenTelemetry configured), the route goes through
    FastAPI's handler, which records its spans; the answer is the same."""
    monkeypatch.setattr(server_module, "traced", lambda: True)
    requests = [("completion", "POST", HOT[0], _json(COMPLETION), {})]
    traced, _ = _answers(tmp_path / "traced", False, requests)
    assert solved[0] == 1
    plain, _ = _answers(tmp_path / "plain", True, requests)
    assert traced == plain
