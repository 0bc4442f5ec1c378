"""Streaming defects a real client hits, found by probing a loopback server (branch
stream2): each case used to hold more than it should, send a chunk the official ``openai``
SDK misreads, word an error in the executor's terms or reuse an id. Real executor on the bundled emulator;
raw loopback sockets where a client misbehaves; every wait bounded."""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    MODEL,
    ServeLikeServer,
    live_fixture,  # noqa: F401 - the fixture ``live``
    metric_value,
    read_until_closed,
    stalled_client,
    started_executor,
    stream_tool_calls,
    wait_for,
)


def _idle(service) -> bool:
    return (service.active == 0 and service.sequences.in_use == 0
            and service.releases_pending == 0)


def _choices_waiting(service) -> float | None:
    """The choices held waiting for their client to take chunks, as the metrics say."""
    return metric_value(service.metrics.exposition().decode(), "calexec_stream_choices_waiting")


#: the stalled request's timeout: the choices fill the socket buffers and their queue well
#: before it on a loaded host (some 100 tokens each), and are held from then until its cut
STALLED_TIMEOUT_S = 10


def test_a_client_that_stops_reading_an_n2_stream_holds_the_generation_back(tmp_path):
    """A stream of several choices (``n`` > 1) queued every choice's chunks for the sender
    without bound: a client that stopped reading left the choices generating to the end (a
    whole response, up to ``max_choices`` x the context, held in memory for nobody until the
    deadline). The queue is now bounded: the choices wait for the client as one choice's
    stream does (``calexec_stream_choices_waiting`` counts them), and the cut at the deadline
    gives everything back."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    service = app.state.service
    body = {"prompt": [1, 2, 3], "max_tokens": 3000, "n": 2, "stream": True,
            "timeout": STALLED_TIMEOUT_S}
    try:
        with ServeLikeServer(app, small_buffers=True) as server:
            sent = time.monotonic()
            sock = stalled_client(server.port, body)
            try:
                deadline = sent + STALLED_TIMEOUT_S
                wait_for(lambda: service.sends.waiting == 1, what="the server's send stalled",
                         timeout=max(0.0, deadline - time.monotonic()))
                # both choices come to wait for room (held from then until the cut at the
                # deadline + slack, so this wait may use the whole timeout); unbounded, they
                # never wait: they generate on until the cut
                wait_for(lambda: _choices_waiting(service) == 2,
                         what="both choices held, waiting for room",
                         timeout=max(0.0, deadline - time.monotonic()))
                assert service.active == 2
                wait_for(lambda: _idle(service), what="the stalled stream cut and freed",
                         timeout=deadline + service.config.deadline_slack_s + 10
                         - time.monotonic())
                counts = service.sequences.counts()
                assert counts["free"] == counts["capacity"], counts
                # the cut ended their wait (the cut ends the runs, then cancels the choices'
                # tasks: a loaded loop may be read between the two)
                wait_for(lambda: _choices_waiting(service) == 0, what="the choices' wait ended",
                         timeout=10)
                data, ended = read_until_closed(sock)
                assert ended in ("eof", "reset") and b"data: [DONE]" not in data, ended
            finally:
                sock.close()
    finally:
        executor.shutdown(5.0)


def test_a_client_that_closes_a_stalled_n2_stream_frees_its_choices_at_once(tmp_path):
    """The choices of a stalled stream wait for room (the test above); the client closing
    ends that wait: both sequences come back at once, not at the deadline (60 s)."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    service = app.state.service
    try:
        with ServeLikeServer(app, small_buffers=True) as server:
            sock = stalled_client(server.port, {"prompt": [1, 2, 3], "max_tokens": 3000,
                                                "n": 2, "stream": True, "timeout": 60})
            try:
                wait_for(lambda: service.sends.waiting == 1, what="the server's send stalled",
                         timeout=30)
                wait_for(lambda: _choices_waiting(service) == 2,
                         what="both choices held, waiting for room", timeout=30)
                assert service.active == 2
            finally:
                sock.close()
            wait_for(lambda: _idle(service), what="the closed stream's choices freed",
                     timeout=10)
            text = service.metrics.exposition().decode()
            assert metric_value(text, "calexec_kv_sequences_in_use") == 0
            assert metric_value(text, "calexec_stream_choices_waiting") == 0
    finally:
        executor.shutdown(5.0)


def test_an_n3_chat_stream_opens_every_choice_in_index_order_for_the_sdk_helper(live):
    """The SDK's ``chat.completions.stream`` helper builds its snapshot from the first chunk
    (``choices[index] = ...`` on that chunk's list) and appends a choice it has not seen: it
    needs the choices to appear in index order. Each choice sent its own opening (``role``)
    after its first token, so choice 1's could come first (the helper's IndexError) or after
    choice 2's (its text appended to the wrong choice). The openings of every choice now go
    out first, in index order, then the choices' chunks as they come."""
    _, client, _ = live
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "n": 3,
            "stream": True, "temperature": 1.0, "seed": 5,
            "stop": ">"}  # (the helper refuses a "length" finish: each ends at its 1st id)
    chunks = list(client.chat.completions.create(model=MODEL, **body))
    opening = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:3]]
    assert opening == [(0, "assistant"), (1, "assistant"), (2, "assistant")], opening
    assert all(c.choices[0].delta.role is None for c in chunks[3:])
    whole = client.chat.completions.create(model=MODEL, **{**body, "stream": False})
    with client.chat.completions.stream(model=MODEL, **{k: v for k, v in body.items()
                                                         if k != "stream"}) as stream:
        final = stream.get_final_completion()
    assert [(c.index, c.message.content, c.finish_reason) for c in final.choices] == \
        [(c.index, c.message.content, c.finish_reason) for c in whole.choices]


CALL = '<tool_call>\n{"name":"get","arguments":'


@pytest.mark.parametrize(("text", "arguments", "content"), [
    (CALL + '{"x":1}}\n</tool_ca', ['{"x":1}'], ""),  # cut in the close tag
    (CALL + '{"x":1}}', ['{"x":1}'], ""),  # cut after the call's "}"
    (CALL + '{"x":1}', ['{"x":1}'], ""),  # cut right after the arguments
    (CALL + '{"x":{"y":"}"}', ['{"x":{"y":"}"}'], ""),  # cut inside: as generated
    (CALL + '{"x":1}}\n</tool_call>\n<tool_call>\n{"', ['{"x":1}'], ""),  # in an opening
    ('hi <tool_call>\n{"na', [], "hi "),  # an opening cut before its name
])
def test_a_tool_call_stream_cut_by_max_tokens_streams_no_call_markup(text, arguments,
                                                                     content):
    """A streamed tool call cut by ``max_tokens`` flushed the text held back at the end into
    the call's arguments or the content: ``{"x":1}}\\n</tool_ca`` as the arguments of a call
    whose arguments were whole (JSON no client parses), the start of the next call's
    ``<tool_call>`` as content. What is held back is the call's markup (the grammar writes
    it): it is dropped; arguments cut inside stay as generated, as OpenAI streams them."""
    deltas, calls, stream = stream_tool_calls(text)
    assert calls == arguments
    assert "".join(d.get("content", "") for d in deltas) == content
    assert stream.cut


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_past_its_timeout_is_told_so_not_an_executor_internal(live, stream):
    """A request whose ``timeout`` ran out mid-generation got the executor's own words for
    the step that met the deadline ("queue deadline passed before infer()", "wait_until
    deadline passed; the job continues (state Succeeded)", "admission deadline passed"): a
    streamed client read them as the error event's message after 300 tokens, a whole
    answer's as the 504's. The message now says the request's timeout ran out, its value and
    how many tokens were generated; the code (``<phase>.deadline``) is kept."""
    server, _, _ = live
    body = {"prompt": "x", "max_tokens": 30000, "stream": stream, "timeout": 0.5}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    if stream:
        assert r.status_code == 200
        events = [json.loads(m) for m in re.findall(r"data: (\{.*?\})\n\n", r.text)]
        error = events[-1]["error"]
        assert len(events) > 1 and "data: [DONE]" not in r.text
    else:
        assert r.status_code == 504, r.text
        error = r.json()["error"]
    assert error["code"].endswith(".deadline"), error
    assert error["message"].startswith("request timeout=0.5 s passed after "), error
    assert " generated tokens" in error["message"], error


def test_response_ids_are_unique_across_server_processes(tmp_path):
    """``id`` was ``cmpl-<the process's request counter>``: every server (a restart, each
    replica of a fleet) answered its first request ``cmpl-1``, so a client or a proxy that
    keys responses by id (OpenAI: "a unique identifier") merged different answers; a request
    of several choices already had a random one. Each response's id is now random, as
    vLLM's (``cmpl-<32 hex>``), streamed or not, constant over a stream."""
    from fastapi.testclient import TestClient

    executor = started_executor(tmp_path)
    ids = []
    try:
        for _ in range(2):  # two servers on one executor: each with its own counter
            with TestClient(create_app(executor, ServerConfig())) as client:
                ids.append(client.post("/v1/completions", json={
                    "prompt": [1, 2], "max_tokens": 1}).json()["id"])
                chunks = client.post("/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                    "stream": True}).text
                streamed = set(re.findall(r'"id":"([^"]+)"', chunks))
                assert len(streamed) == 1, streamed
                ids.extend(streamed)
    finally:
        executor.shutdown(5.0)
    assert len(set(ids)) == 4, ids
    assert all(re.fullmatch(r"(chat)?cmpl-[0-9a-f]{32}", i) for i in ids), ids
