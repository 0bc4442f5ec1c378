"""Adversarial HTTP and admin input found by probing a loopback ``calexec serve`` at stop 70
(branch probe-http): two clients sending one ``X-Request-Id`` at once, and what the admin API
and a request caught by a model switch are told. Real executor on the bundled emulator;
loopback only; every wait bounded."""

from __future__ import annotations

import json
import threading

import httpx

from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, server_idle, started_executor, wait_for


def test_two_requests_sending_one_x_request_id_have_dump_records_told_apart(tmp_path):
    """Two clients sending one ``X-Request-Id`` at once (a retried call, a client reusing a
    trace id) are both answered, each with its own body ``id``; but the dump record of each
    named only the shared ``x_request_id`` and the server's internal integer id, so a client
    quoting what it got (the body's ``id``, which stays unique: docs/server.md "Request
    ids") could not find its record among the others. Each record now names its response's
    ``id`` too: a whole answer, a stream, each choice of ``n`` 2 (one id), a Responses call."""
    executor = started_executor(tmp_path)
    sink = DumpSink(tmp_path / "dump", max_bytes=1_000_000)
    try:
        app = create_app(executor, ServerConfig(), sink)
        with LiveServer(app) as server:
            sends = [
                ("/v1/completions", {"prompt": "a", "max_tokens": 4}),
                ("/v1/completions", {"prompt": "a", "max_tokens": 4, "stream": True}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                                          "max_tokens": 3, "n": 2}),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "b"}],
                                          "max_tokens": 3, "stream": True}),
                ("/v1/responses", {"input": "c", "max_output_tokens": 16}),
            ]
            barrier = threading.Barrier(len(sends), timeout=30.0)
            got: dict[int, tuple[int, str, str]] = {}

            def send(k: int, path: str, body: dict) -> None:
                with httpx.Client(base_url=server.url, timeout=60.0) as client:
                    barrier.wait()
                    r = client.post(path, json=body, headers={"X-Request-Id": "shared-7"})
                    if body.get("stream"):
                        first = next(line for line in r.text.splitlines()
                                     if line.startswith("data: {"))
                        body_id = json.loads(first[len("data: "):])["id"]
                    else:
                        body_id = r.json()["id"]
                    got[k] = (r.status_code, r.headers["x-request-id"], body_id)

            threads = [threading.Thread(target=send, args=(k, path, body))
                       for k, (path, body) in enumerate(sends)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60.0)
            assert sorted(got) == list(range(len(sends))), got
            assert all(status == 200 and header == "shared-7"
                       for status, header, _ in got.values()), got
            ids = [body_id for _, _, body_id in got.values()]
            assert len(set(ids)) == len(sends), ids  # the bodies' ids stay unique
            service = app.state.service
            wait_for(lambda: server_idle(service), what="the requests to finish")
        assert sink.flush(10.0), sink.counts()
        records = [json.loads(line) for line in sink.path.read_text().splitlines()]
        assert {record["x_request_id"] for record in records} == {"shared-7"}
        # one record per choice: the n=2 chat's two records carry its one id
        assert sorted(record["response_id"] for record in records) == sorted(
            ids + [got[2][2]]), records
    finally:
        executor.shutdown(5.0)

