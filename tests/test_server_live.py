"""The reference server on a real loopback socket: the official ``openai`` client, client
disconnects, and SIGTERM drain of a ``calexec serve`` subprocess."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import httpx
import openai
import pytest

from calexec.drivers.calrt.runtime import Emulator
from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    LiveServer,
    free_port,
    metric_value,
    oracle_tokens,
    started_executor,
    wait_for,
    wait_serve_ready,
)


@pytest.fixture
def live(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    with LiveServer(app) as server:
        yield server, executor, app.state.service
    executor.shutdown(5.0)


def test_openai_client_completions_and_streaming(live):
    server, _, service = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                           timeout=20)
    prompt = [11, 12, 13, 14]
    done = client.completions.create(model="calexec-qwen3-synthetic", prompt=prompt,
                                     max_tokens=5)
    expected = oracle_tokens(prompt, 5)
    assert done.choices[0].text == tokenizer.decode(expected)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == 4 and done.usage.completion_tokens == 5
    pieces, reasons = [], []
    for chunk in client.completions.create(model="calexec-qwen3-synthetic", prompt=prompt,
                                           max_tokens=5, stream=True):
        pieces.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert "".join(pieces) == done.choices[0].text
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    text = client.completions.create(model="qwen3_synthetic", prompt="hi", max_tokens=2)
    assert text.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="calexec-qwen3-synthetic", prompt=[151936],
                                  max_tokens=1)
    assert service.sequences.in_use == 0


def test_streaming_client_disconnect_cancels_its_job(live):
    server, executor, service = live
    Emulator(executor.device).set_latency(decode_us=100_000)
    cancelled0 = executor.counters["cancelled"]
    submitted0 = executor.counters["submitted"]
    with httpx.Client(base_url=server.url, timeout=20) as client:
        with client.stream("POST", "/v1/completions",
                           json={"prompt": [1, 2, 3], "max_tokens": 200, "stream": True}) as r:
            assert r.status_code == 200
            first = next(r.iter_lines())
            assert json.loads(first[len("data: "):])["choices"][0]["token_ids"]
        # leaving the block closes the connection mid-stream
        wait_for(lambda: service.active == 0, what="the request to finish after disconnect")
        metrics = client.get("/metrics").text
    # The generation stopped early: the job in flight when the disconnect was noticed ended
    # cancelled (FI12), or, when it was noticed between two jobs (at a send), none was started.
    assert executor.counters["submitted"] - submitted0 < 10  # far from max_tokens=200
    assert executor.counters["cancelled"] - cancelled0 in (0, 1)
    # the cancelled job's sequence comes back once the job ended (background release)
    wait_for(lambda: service.sequences.in_use == 0, what="the sequence's release")
    assert service.sequences.withheld == 0 and service.sequences.consistent()
    assert metric_value(metrics, "calexec_request_failures_total",
                        {"category": "cancelled"}) == 1
    assert metric_value(metrics, "calexec_generation_tokens_total") in (None, 0)
    assert executor.snapshot()["inflight"] == 0


def test_sigterm_drains_a_serve_subprocess(tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec", "serve", "--port", str(port), "--grace", "20",
         "--device-config", "decode_us=50000", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ}, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_serve_ready(proc, url)
        events: list[str] = []
        first = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", timeout=30,
                              json={"prompt": [5, 6], "max_tokens": 12, "stream": True}) as r:
                for line in r.iter_lines():
                    if line:
                        events.append(line)
                        first.set()
        worker = threading.Thread(target=stream)
        worker.start()
        assert first.wait(10)
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503,
                 what="/ready to report draining")
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": [1]}, timeout=5)
        assert refused.status_code == 503 and refused.headers["retry-after"]
        worker.join(30)
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert events[-1] == "data: [DONE]"
    tokens = [t for e in events[:-1] for t in json.loads(e[6:])["choices"][0]["token_ids"]]
    assert tokens == oracle_tokens([5, 6], 12)


def test_32_concurrent_clients_no_errors_and_inflight_within_capacity(live):
    server, executor, service = live
    capacity = executor.config.inflight_capacity
    seen: list[int] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            seen.append(executor.snapshot()["inflight"])
            stop.wait(0.001)
    sampler = threading.Thread(target=sample)
    sampler.start()
    results: dict[int, tuple[int, list[int]]] = {}

    def one(i: int) -> None:
        r = httpx.post(f"{server.url}/v1/completions", timeout=30,
                       json={"prompt": [i + 1, i + 2], "max_tokens": 4})
        results[i] = (r.status_code, r.json()["choices"][0]["token_ids"]
                      if r.status_code == 200 else [])
    workers = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    stop.set()
    sampler.join(5)
    assert {i: code for i, (code, _) in results.items()} == {i: 200 for i in range(32)}
    assert all(results[i][1] == oracle_tokens([i + 1, i + 2], 4) for i in range(32))
    assert seen and max(seen) <= capacity
    assert service.sequences.in_use == 0
