"""Issue 28 (stop 65): a non-streamed decode burst is handed to a thread of the service's
own pool (``calexec-burst``) directly, not through anyio's ``to_thread`` (a turn of the event
loop and a limiter's shielded one before every burst); its answers equal the plain path's
(``tests/test_server_inline_waits.py``'s differential test, deadlines and faults included).
Here: the thread is the pool's, one serves one request after another (no thread per
request), and the pool's threads end when the app stops. Since stop 70 the pool's own keeper
starts its threads (``threads.WorkerPool``; tests/test_worker_pool.py).

A loopback server on the bundled emulator (zero-latency profile), a deadline on every
request and a timeout on the client."""

from __future__ import annotations

import httpx

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, oracle_tokens, started_executor
from thread_starts import recording_thread_starts

PROMPT = [5, 6, 7]


def test_non_streamed_bursts_run_in_the_pools_thread_which_ends_with_the_app(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    burst_jobs = "calexec_decode_burst_jobs_total"
    registry = app.state.service.metrics.registry
    try:
        with recording_thread_starts() as starts:
            with LiveServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30.0) as client:
                before = registry.get_sample_value(burst_jobs) or 0.0
                for _ in range(3):  # one after another: one thread serves them all
                    r = client.post("/v1/completions", json={
                        "prompt": PROMPT, "max_tokens": 8, "timeout": 30})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 8)
                assert registry.get_sample_value(burst_jobs) - before == 3 * 8
                # the pool's keeper starts its threads (stop 70): the first burst's, and a
                # spare when a burst takes the last idle one; not one a request
                bursts = [t for _, t in starts.starts if t.name.startswith("calexec-burst_")]
                assert 1 <= len(bursts) <= 2, [t.name for _, t in starts.starts]
                assert all(t.is_alive() for t in bursts)
        for thread in bursts:  # the app stopped: the pool's idle threads end
            thread.join(10.0)
            assert not thread.is_alive(), thread.name
    finally:
        executor.shutdown(5.0)
