"""The sends of a streamed response with a streamed decode burst (``ServerConfig.stream_bursts``,
stop 35): events of tokens the burst already took go out in one send with the next ones (the
same bytes as one send per event: the differential test in test_server_inline_waits.py), and
at most ``STREAM_AHEAD`` events go in one send, so a burst that stays ahead of the loop never
holds a client's tokens back until it ends.

A loopback server on the bundled emulator (zero latency), its event loop slowed per event
(``wire.sse`` sleeps 10 ms, about 15 times a token's time on the device path), so the burst is
ahead of the loop for the whole stream."""

from __future__ import annotations

import json
import time

import httpx

from calexec.drivers.serving import wire
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.serving.service import STREAM_AHEAD
from calexec.drivers.tools.chaos import LiveServer
from test_server_support import oracle_tokens, started_executor

PROMPT, COUNT = [3, 1, 4], 40


def test_a_burst_ahead_of_the_loop_sends_its_events_together_at_most_stream_ahead_a_send(
        tmp_path, monkeypatch):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    sends: list[int] = []  # events per body send of the stream

    async def recording(scope, receive, send):
        async def record(message):
            if message["type"] == "http.response.body" and message.get("body"):
                sends.append(message["body"].count(b"data: {"))
            await send(message)
        await app(scope, receive, record)

    real_sse = wire.sse

    def slow_sse(data):
        time.sleep(0.01)  # the loop is slower than the device: the burst stays ahead
        return real_sse(data)
    monkeypatch.setattr(wire, "sse", slow_sse)
    try:
        with LiveServer(recording) as server, \
                httpx.Client(base_url=server.url, timeout=60) as client:
            with client.stream("POST", "/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": COUNT,
                                     "stream": True}) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        executor.shutdown(5.0)
    assert lines[-1] == "data: [DONE]"
    tokens = [t for line in lines[:-1]
              for t in json.loads(line[len("data: "):])["choices"][0]["token_ids"]]
    assert tokens == list(oracle_tokens(PROMPT, COUNT))
    assert sum(sends) == COUNT + 1  # every token's event and the last one, once each
    assert max(sends) > 1, sends  # events of tokens the burst had taken went together
    assert max(sends) <= STREAM_AHEAD, sends  # never more than STREAM_AHEAD a send
