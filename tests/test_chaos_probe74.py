"""Stop 74 (chaos): ``POST /admin/cancel/{id}`` raced against the other state machines a
request meets: a recovery (a device fault mid-decode, the stream's resume), a model switch
(``POST /admin/reload``), a drain, the request's own deadline, its client leaving, Phase B
(two jobs on the device), grammar-constrained requests, ``n`` > 1 streams, two cancels of one
id at once, and a stream whose client stopped reading (its send blocked). Each moment is held
deterministically where it can be (the stepped emulator, a held sequence id, an Event
barrier), then a seeded, bounded schedule mixes them. After each: no 500, no traceback in the
log, the client's answer is one documented shape (409 ``request.aborted`` / its error event,
or the request's own outcome when it ended first: never both, never a hang), every sequence
id, KV block, slot, the queue and the in-progress registry back, and the metrics agree with
what the clients saw. Nothing asserts a duration: every wait is a bounded poll.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import re
import threading
from collections.abc import Iterator

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode, Stage  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    ServeLikeServer,
    metric_value,
    oracle_tokens,
    read_until_closed,
    stalled_client,
    started_executor,
    wait_for,
)

TOKEN = "chaos74-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}
PROMPT = [5, 6, 7]
WAIT_S = 30.0


def busy_engine(emu) -> int | None:
    return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)


@contextlib.contextmanager
def served(tmp_path, executor_config: dict | None = None, serve_like: bool = False,
           **config) -> Iterator[tuple]:
    """(server, service, executor) of a loopback server with the admin token; the device
    unstepped and the executor shut down at the end."""
    executor = started_executor(tmp_path, **(executor_config or {}))
    app = create_app(executor, ServerConfig(admin_token=TOKEN, **config))
    try:
        with (ServeLikeServer(app, small_buffers=True) if serve_like
              else LiveServer(app)) as server:
            yield server, app.state.service, executor
    finally:
        executor.device.emu.set_stepped(False)
        executor.device.emu.clear_all_faults()
        executor.shutdown(5.0)


def cancel(url: str, ident: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/cancel/{ident}", headers=AUTH, timeout=WAIT_S)


def idle(service) -> bool:
    return (service.active == 0 and service.sequences.in_use == 0
            and service.releases_pending == 0 and not service.live_requests())


def assert_all_back(service, executor, device: bool = True) -> None:
    """Every sequence id, the waiting queue, the in-progress registry and (``device``) the
    device's slots, KV blocks and jobs are back."""
    wait_for(lambda: idle(service), WAIT_S, "every sequence id back")
    assert service.sequences.consistent() and service.sequences.withheld == 0
    assert service.admission.waiting == 0
    text = service.metrics.exposition().decode()
    assert metric_value(text, "calexec_responses_send_waiting") in (0, None)
    if not device:
        return

    def device_idle() -> bool:
        snap = executor.snapshot()
        slots = snap["slots"]
        return (snap["inflight"] == 0 and snap["queued"] == 0 and not snap["kv_sequences"]
                and snap["kv_blocks_reserved"] == 0 and snap["pending_tokens"] == 0
                and slots["Leased"] == 0 and slots["InFlight"] == 0 and slots["Quarantined"] == 0)
    wait_for(device_idle, WAIT_S, "every slot free, no KV sequence or job left")


def no_traceback(caplog) -> None:
    """No ERROR record and no traceback in the server's log."""
    bad = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


def sse_events(raw: bytes) -> list:
    """The ``data:`` payloads of a stream's bytes (``[DONE]`` as the string)."""
    out: list = []
    for data in re.findall(rb"data: (.*?)\n\n", raw, re.S):
        out.append("[DONE]" if data == b"[DONE]" else json.loads(data))
    return out


# ---- 2: a cancel of a stream whose client stopped reading ------------------------------------
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": [1, 2, 3]}),
    ("/v1/completions", {"prompt": [1, 2, 3], "n": 2}),
    ("/v1/responses", {"input": "hello"})], ids=["completions", "n2", "responses"])
def test_a_cancel_of_a_stream_blocked_on_its_send_cuts_it_and_frees_it_at_once(tmp_path, caplog,
                                                                               path, body):
    """A raw client with a small receive buffer that never reads: the server's send waits for
    it (long before the request's 600 s deadline). A cancel by its ``x-request-id`` closes the
    connection (no ``[DONE]``) and gives back its sequence ids, KV blocks and slots now; the
    request counted ``request.aborted``, not ``request.client_stalled``. Before stop 74 the
    cancel answered 202 and the stream held everything until its deadline + slack."""
    caplog.set_level(logging.INFO)
    tokens = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    with served(tmp_path, serve_like=True) as (server, service, executor):
        sock = stalled_client(server.port, {**body, tokens: 30000, "stream": True,
                                            "timeout": 600}, path)
        try:
            wait_for(lambda: metric_value(service.metrics.exposition().decode(),
                                          "calexec_responses_send_waiting") == 1,
                     WAIT_S, "the server's send waiting for the client")
            (ident,) = {run.response_id for run in service.live_requests()}
            answer = cancel(server.url, ident)
            assert answer.status_code == 202, answer.text
            wait_for(lambda: idle(service), WAIT_S,
                     "the stalled stream cut and freed by the cancel (not at its deadline)")
            assert_all_back(service, executor)
            raw, ended = read_until_closed(sock)
            assert ended in ("eof", "reset"), (ended, len(raw))
            assert b"data: [DONE]" not in raw
        finally:
            sock.close()
        text = service.metrics.exposition().decode()
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.aborted"}) >= 1
        assert metric_value(text, "calexec_request_failures_total",
                            {"code": "request.client_stalled"}) is None
        assert metric_value(text, "calexec_admin_cancels_total", {"outcome": "cancelled"}) == 1
        ok = httpx.post(f"{server.url}/v1/completions",
                        json={"prompt": PROMPT, "max_tokens": 3}, timeout=WAIT_S)
        assert ok.json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 3)
    no_traceback(caplog)
