"""What an operator running ``calexec serve`` met at stop 53 (its monitoring and its files).

- the dump sink's cap (``--dump-max-bytes``) counted the bytes the sink had written since the
  process started, not the size of its file: a dump file rotated away (renamed, as logrotate
  does by default, or truncated in place by ``copytruncate``) left a new, small file, and once
  the old one's bytes reached the cap every record was dropped for the rest of the process;
- ``calexec_request_failures_total`` ("failed completion requests") counted the refusals of
  routes that are no completion (``/v1/models`` without the API key, a bad ``/tokenize``...),
  whose successes are counted nowhere: a poller of ``/v1/models`` without the key made the
  completions' failure rate;
- a forced exit (a second signal) answered each non-streamed request it cut with uvicorn's
  plain-text ``500 Internal Server Error`` (no OpenAI body, no ``x-request-id``: a server bug
  to its client) where docs/server.md says the connections of the requests cut are closed;
- the streams a drain's grace cut ended with one of three messages ("server drained: its grace
  ran out", "device lifecycle is Draining; not admitting", "generation 1 retired while the job
  was armed"), depending on where the executor's shutdown met each, and the last two were
  first resumed: ``calexec_resumes_total`` counted resumes at a drain (no device fault).
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.server import ServerConfig, create_app
from test_ops_sweep import killed, serve_process, stopped
from test_server_support import LiveServer, metric_value, started_executor, wait_for


def record(i: int) -> dict:
    return {"request_id": i, "pad": "x" * 60}


def test_a_dump_file_rotated_away_is_written_again_not_dropped(tmp_path):
    """Three records fill the cap; the file is renamed away (logrotate's default), then
    emptied in place (``copytruncate``): each time the sink writes the next records into the
    file that is there, as the cap is a bound on that file."""
    sink = DumpSink(tmp_path / "dump", max_bytes=300)
    assert [sink.write(record(i)) for i in range(4)] == [True, True, True, False]
    assert sink.dropped == 1
    os.rename(sink.path, f"{sink.path}.1")  # rotated: the next write makes a new file
    assert [sink.write(record(10 + i)) for i in range(3)] == [True, True, True]
    lines = sink.path.read_text().splitlines()
    assert [json.loads(line)["request_id"] for line in lines] == [10, 11, 12]
    os.truncate(sink.path, 0)  # copytruncate: the same file, emptied
    assert sink.write(record(20)) is True
    assert [json.loads(line)["request_id"]
            for line in sink.path.read_text().splitlines()] == [20]
    assert sink.records == 7 and sink.dropped == 1 and sink.errors == 0
    assert sink.path.stat().st_size <= sink.max_bytes


def failures(client: TestClient) -> float:
    text = client.get("/metrics").text
    return sum(metric_value(text, "calexec_request_failures_total", {"code": code}) or 0.0
               for code in ("request.invalid", "request.invalid_api_key",
                            "request.model_not_found"))


@pytest.fixture(scope="module", name="keyed")
def keyed_fixture(tmp_path_factory):
    """A server on the emulator whose OpenAI routes need the API key ``k1``."""
    executor = started_executor(tmp_path_factory.mktemp("keyed"))
    try:
        with TestClient(create_app(executor, ServerConfig(api_key="k1"))) as client:
            yield client
    finally:
        executor.shutdown(5.0)


KEY = {"Authorization": "Bearer k1"}


@pytest.mark.parametrize(("method", "path", "body", "headers", "status"), [
    ("GET", "/v1/models", None, {}, 401),  # a gateway's poll without the key
    ("GET", "/v1/models/other", None, KEY, 404),
    ("GET", "/tokenizer_info", None, {}, 401),
    ("POST", "/tokenize", {"prompt": "a", "content": "b"}, KEY, 400),
    ("POST", "/detokenize", {"tokens": "x"}, KEY, 400),
])
def test_a_refusal_of_a_route_that_is_no_completion_is_no_failed_completion(
        keyed, method, path, body, headers, status):
    before = failures(keyed)
    r = keyed.request(method, path, json=body, headers=headers)
    assert r.status_code == status, r.text
    assert failures(keyed) == before


def test_a_refused_completion_is_still_a_failed_completion(keyed):
    before = failures(keyed)
    assert keyed.post("/v1/completions", json={"prompt": "a"}).status_code == 401
    assert keyed.post("/v1/completions", json={"prompt": "a", "model": "x"},
                      headers=KEY).status_code == 404
    assert keyed.post("/v1/chat/completions", json={"messages": []},
                      headers=KEY).status_code == 400
    assert failures(keyed) == before + 3


def test_a_forced_exit_closes_the_connection_of_a_request_it_cuts_not_a_plain_500(tmp_path):
    proc, url = serve_process(tmp_path, "--grace", "30", "--device-config", "decode_us=20000")
    got: list[object] = []

    def whole_answer() -> None:  # 1000 tokens: 20 s, past the test
        try:
            got.append(httpx.post(f"{url}/v1/completions", timeout=60,
                                  json={"prompt": [5, 6], "max_tokens": 1000}))
        except httpx.TransportError as err:
            got.append(err)
    worker = threading.Thread(target=whole_answer, daemon=True)
    try:
        worker.start()
        wait_for(lambda: "calexec_num_requests_running 1.0" in httpx.get(
            f"{url}/metrics", timeout=2).text, what="the request to run")
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503,
                 what="/ready to report draining")
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
        worker.join(10)
    finally:
        killed(proc)
    assert code == 3 and "1 request(s) still running were cut" in err, err
    assert len(got) == 1
    answer = got[0]
    assert isinstance(answer, httpx.TransportError), (
        f"HTTP {answer.status_code} {answer.headers.get('content-type')}: {answer.text!r}"
        if isinstance(answer, httpx.Response) else answer)


def test_the_requests_a_drains_grace_cuts_end_alike_and_resume_nothing(tmp_path):
    executor = started_executor(tmp_path, "decode_us=1000")
    app = create_app(executor, ServerConfig(admin_token="t"))
    service = app.state.service
    ends: list[str] = []

    def stream(url: str, i: int) -> None:  # greedy and sampled: 5 s of tokens each
        try:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=30, json={
                    "prompt": [5, 6], "max_tokens": 5000, "stream": True,
                    "temperature": 0.5 if i % 2 else 0}) as r:
                lines = [line for line in r.iter_lines() if line]
            ends.append(lines[-1])
        except httpx.HTTPError as err:
            ends.append(repr(err))
    try:
        with LiveServer(app) as server:
            workers = [threading.Thread(target=stream, args=(server.url, i), daemon=True)
                       for i in range(4)]
            for worker in workers:
                worker.start()
            wait_for(lambda: service.active == 4, what="the streams to run")
            r = httpx.post(f"{server.url}/admin/drain", params={"grace": 0.3},
                           headers={"Authorization": "Bearer t"})
            assert r.status_code == 202, r.text
            for worker in workers:
                worker.join(30)
            wait_for(lambda: service.drain_status is not None, what="the drain")
            text = service.metrics.exposition().decode()
    finally:
        executor.shutdown(5.0)
    drained = ('data: {"error":{"message":"server drained: its grace (0.3 s) ran out before '
               'the request finished; retry","type":"unavailable_error","code":'
               '"lifecycle.unavailable","param":null}}')
    assert ends == [drained] * 4, ends
    resumes = sum(metric_value(text, "calexec_resumes_total", {"cause": cause}) or 0.0
                  for cause in ("unavailable", "generation_replaced", "cancelled"))
    assert resumes == 0, [line for line in text.splitlines() if "resumes_total" in line]
