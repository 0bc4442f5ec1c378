"""An app whose lifespan ended keeps neither its service nor its executor alive (stop 65):
FastAPI's module-level caches of route functions held every app's route closures, and
through them its executor, so a process creating app after app (this test suite, an
embedder serving a new executor) kept some 200 old executors (tens of MB each) alive."""

from __future__ import annotations

import gc
import weakref

from fastapi.testclient import TestClient

from calexec.drivers.serving.server import create_app
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
    the one serving still answers (its routes' cached classification was dropped too)."""
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
