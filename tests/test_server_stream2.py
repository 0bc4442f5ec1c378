"""Streaming defects a real client hits, found by probing a loopback server (branch
stream2): each case used to hold more than it should, send a chunk the official ``openai``
SDK misreads, or answer a parameter silently wrong. Real executor on the bundled emulator;
raw loopback sockets where a client misbehaves; every wait bounded."""

from __future__ import annotations

import json
import re
import time

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    ServeLikeServer,
    metric_value,
    read_until_closed,
    stalled_client,
    started_executor,
    wait_for,
)


def _idle(service) -> bool:
    return (service.active == 0 and service.sequences.in_use == 0
            and service.releases_pending == 0)


def test_a_client_that_stops_reading_an_n2_stream_holds_the_generation_back(tmp_path):
    """A stream of several choices (``n`` > 1) queued every choice's chunks for the sender
    without bound: a client that stopped reading left the choices generating to the end (a
    whole response, up to ``max_choices`` x the context, held in memory for nobody until the
    deadline). The queue is now bounded: the choices wait for the client as one choice's
    stream does, and the cut at the deadline gives everything back."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    service = app.state.service
    body = {"prompt": [1, 2, 3], "max_tokens": 3000, "n": 2, "stream": True, "timeout": 4}
    try:
        with ServeLikeServer(app, small_buffers=True) as server:
            sent = time.monotonic()
            sock = stalled_client(server.port, body)
            try:
                wait_for(lambda: service.sends.waiting == 1, what="the server's send stalled",
                         timeout=3)
                before = executor.snapshot()["succeeded"]
                time.sleep(0.5)
                # the choices stand still: a few steps finishing, not thousands
                assert executor.snapshot()["succeeded"] - before < 40
                assert service.active == 2
                wait_for(lambda: _idle(service), what="the stalled stream cut and freed",
                         timeout=sent + 4 + service.config.deadline_slack_s + 10
                         - time.monotonic())
                counts = service.sequences.counts()
                assert counts["free"] == counts["capacity"], counts
                data, ended = read_until_closed(sock)
                assert ended in ("eof", "reset") and b"data: [DONE]" not in data, ended
            finally:
                sock.close()
    finally:
        executor.shutdown(5.0)
