"""An app that is gone keeps neither its service nor its executor alive (stop 65): FastAPI's
module-level caches of route functions held every app's route closures, and through them its
executor, so a process creating app after app (this test suite, an embedder serving a new
executor) kept some 200 old executors (tens of MB each) alive. Stop 65 emptied those caches
at the lifespan's end; since stop 66 the closures hold only a weak reference to the service
(``RouteService``), so an app whose lifespan never ran lets go of it too."""

from __future__ import annotations

import gc
import types
import weakref

import attrs
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from calexec.drivers.serving.server import CompletionService, create_app
from calexec.machines.executor import DeviceExecutor
from test_server_support import MODEL, started_executor

BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}


def served_and_stopped(tmp, other: TestClient) -> tuple[weakref.ref, weakref.ref]:
    """Weak references to the executor and service of an app that served a plain and a
    streamed completion, whose lifespan then ended and whose executor was shut down; ``other``
    (an app still serving) answers a streamed completion after it."""
    executor = started_executor(tmp)
    app = create_app(executor)
    with TestClient(app) as client:
        assert client.post("/v1/completions", json=BODY).status_code == 200
        with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
            assert r.status_code == 200 and b"[DONE]" in r.read()
        refs = weakref.ref(executor), weakref.ref(app.state.service)
    executor.shutdown(5.0)
    with other.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    return refs


def test_an_app_whose_lifespan_ended_frees_its_executor(tmp_path):
    """Three apps served and stopped one after the other, while a fourth serves throughout:
    once collected, none of the three's executors or services is alive (all three were), and
    the one serving still answers."""
    (tmp_path / "live").mkdir()
    executor = started_executor(tmp_path / "live")
    try:
        with TestClient(create_app(executor)) as other:
            refs = []
            for i in range(3):
                (tmp_path / str(i)).mkdir()
                refs.append(served_and_stopped(tmp_path / str(i), other))
            gc.collect()
            alive = [(i, what) for i, pair in enumerate(refs)
                     for what, ref in zip(("executor", "service"), pair) if ref() is not None]
            assert alive == []
            assert other.post("/v1/completions", json=BODY).status_code == 200
    finally:
        executor.shutdown(5.0)


def test_an_app_whose_lifespan_never_ran_frees_its_executor(tmp_path):
    """An app served by a ``TestClient`` outside ``with`` (or mounted in another app, whose
    lifespan Starlette does not run) never ran its lifespan, so stop 65's emptying of
    FastAPI's caches at its end never came: its executor and service stayed alive in them.
    The route closures now hold only a weak reference to the service, whose one owner is
    ``app.state.service``: once the app is gone, so are both."""
    executor = started_executor(tmp_path)
    app = create_app(executor)
    client = TestClient(app)
    assert client.post("/v1/completions", json=BODY).status_code == 200
    with client.stream("POST", "/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and b"[DONE]" in r.read()
    assert client.get("/health").status_code == 200
    refs = weakref.ref(executor), weakref.ref(app.state.service)
    executor.shutdown(5.0)
    del app, client, executor
    gc.collect()
    assert [ref() is None for ref in refs] == [True, True]


def _reached(value: object, path: str, seen: set[int], found: list[str]) -> None:
    """Walk what ``value`` holds as a function (its closure cells and defaults, a bound
    method's object, an attrs class's fields), noting a service or an executor by its path."""
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, (CompletionService, DeviceExecutor)):
        found.append(f"{path}: {type(value).__name__}")
    elif isinstance(value, types.FunctionType):
        cells = zip(value.__code__.co_freevars, value.__closure__ or ())
        for name, cell in cells:
            try:
                held = cell.cell_contents
            except ValueError:  # (a cell not set yet)
                continue
            _reached(held, f"{path}.{name}", seen, found)
        for i, default in enumerate(value.__defaults__ or ()):
            _reached(default, f"{path}.<default {i}>", seen, found)
    elif isinstance(value, types.MethodType):
        _reached(value.__self__, f"{path}.__self__", seen, found)
    elif attrs.has(type(value)):  # (the chat pipeline, ChatPath)
        for field in attrs.fields(type(value)):
            _reached(getattr(value, field.name), f"{path}.{field.name}", seen, found)


def test_no_route_function_holds_the_service_or_the_executor(tmp_path):
    """Whatever keeps a route function (FastAPI's caches of them, a debugger, a profiler)
    keeps nothing big: no route's closure, nor any function it calls through one (the chat
    pipeline the Responses route shares included), holds the service or the executor; each
    reaches them through ``app.state.service``'s weak reference (``RouteService``), once
    per call. Until stop 66 every route held both."""
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor)
        found: list[str] = []
        for route in app.routes:
            if isinstance(route, APIRoute):
                _reached(route.endpoint, route.path, set(), found)
        assert found == []
        assert TestClient(app).get("/health").status_code == 200
    finally:
        executor.shutdown(5.0)
