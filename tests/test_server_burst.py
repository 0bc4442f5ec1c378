"""Issue 27: a burst of concurrent requests on default settings is queued, not refused (vLLM
queues them; the server used to answer 104 of 200 with 429): the waiting queue's default
(``ServerConfig.max_waiting``) holds a burst of ``CALEXEC_BURST`` (200) requests beside the 32
sequence ids, every one completes with the oracle's tokens, and the queue stays bounded: one
more than ``max_sequences + max_waiting`` is refused with 429 ``kv.full``.

A loopback server on the bundled emulator (zero-latency profile), small ``max_tokens``;
every request has a deadline and the client a timeout.
"""

from __future__ import annotations

import asyncio
import os

import httpx

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, oracle_tokens, started_executor, wait_for

BURST = int(os.environ.get("CALEXEC_BURST", "200"))
PROMPT = [3, 1, 4, 1, 5]


async def _burst(url: str, count: int, body: dict) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        return list(await asyncio.gather(*(client.post("/v1/completions", json=body)
                                           for _ in range(count))))


def test_a_burst_of_200_on_default_settings_is_queued_not_refused(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    expected = oracle_tokens(PROMPT, 2)
    try:
        with LiveServer(app) as server:
            replies = asyncio.run(_burst(server.url, BURST,
                                         {"prompt": PROMPT, "max_tokens": 2, "timeout": 30}))
            codes = [r.status_code for r in replies]
            assert codes.count(429) == 0, (codes.count(429), [r.text for r in replies
                                                              if r.status_code != 200][:1])
            assert codes == [200] * BURST
            assert all(r.json()["choices"][0]["token_ids"] == expected for r in replies)
            service = app.state.service
            wait_for(lambda: service.sequences.in_use == 0, what="every id back")
            assert service.sequences.consistent() and service.admission.waiting == 0
    finally:
        executor.shutdown(5.0)


def test_the_queue_stays_bounded_429_only_beyond_it(tmp_path):
    """A small server (2 ids, 3 may wait) and slow decode steps: of 8 concurrent requests 5
    are admitted or queued and complete, the 3 beyond the bound get 429 ``kv.full`` naming
    ``max_waiting`` at once."""
    executor = started_executor(tmp_path, "decode_us=20000")
    app = create_app(executor, ServerConfig(max_sequences=2, max_waiting=3))
    try:
        with LiveServer(app) as server:
            replies = asyncio.run(_burst(server.url, 8,
                                         {"prompt": PROMPT, "max_tokens": 4, "timeout": 30}))
            codes = sorted(r.status_code for r in replies)
            assert codes == [200] * 5 + [429] * 3
            refused = [r for r in replies if r.status_code == 429]
            assert all("max_waiting=3" in r.json()["error"]["message"] for r in refused)
            assert all(r.headers.get("retry-after") for r in refused)
    finally:
        executor.shutdown(5.0)
