"""Stop 75 (left): what stop 74 left.

1. A stream whose generation ended while its last send waits for a client that stopped
   reading: the device's resources come back at once, and ``POST /admin/cancel/{id}``
   finds it and cuts the send (202), not a 404 with everything held until the deadline.
2. Chat answers say the ``service_tier`` used when the request set one.
3. A chat ``tool`` message answering no call of the assistant message before it: OpenAI's
   400s.
4. ``chaos_clients`` reads its own numbers as the CLI does.
5. A model switch whose roll back could restore nothing (the calbin written over in place)
   is refused before anything moves.
"""

from __future__ import annotations

import json
import logging

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from test_server_support import (  # noqa: E402
    ServeLikeServer,
    live_fixture,  # noqa: F401  (the module's ``live`` server)
    metric_value,
    oracle_tokens,
    read_until_closed,
    stalled_client,
    started_executor,
    wait_device_idle,
    wait_for,
)

TOKEN = "left75-admin"
AUTH = {"authorization": f"Bearer {TOKEN}"}
WAIT_S = 30.0


def stalled_at_the_tail(app, marker: bytes):
    """``app`` whose first response body message carrying ``marker`` (the stream's tail: its
    ``[DONE]``, the Responses' ``response.incomplete`` of a ``max_output_tokens`` end) is
    preceded by 4 MiB of SSE comment (``:`` lines, which every client skips): on a client
    that reads nothing the server's send waits right there, after the generation ended,
    whatever the socket buffers hold."""
    async def wrapped(scope, receive, send):
        padded = False

        async def padding_send(message):
            nonlocal padded
            if (not padded and message.get("type") == "http.response.body"
                    and marker in message.get("body", b"")):
                padded = True
                await send({"type": "http.response.body", "more_body": True,
                            "body": (b": " + b"x" * 1022 + b"\n") * 4096 + b"\n"})
            await send(message)
        await wrapped.app(scope, receive, padding_send)
    wrapped.app = app
    return wrapped


def idle(service) -> bool:
    return (service.active == 0 and service.sequences.in_use == 0
            and service.releases_pending == 0 and not service.live_requests())


@pytest.mark.parametrize(("path", "body", "marker"), [
    ("/v1/completions", {"prompt": [1, 2, 3]}, b"[DONE]"),
    ("/v1/completions", {"prompt": [1, 2, 3], "n": 2}, b"[DONE]"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}, b"[DONE]"),
    ("/v1/responses", {"input": "hello"}, b"event: response.incomplete")],
    ids=["completions", "n2", "chat", "responses"])
def test_a_stream_whose_generation_ended_gives_back_the_device_and_is_cancellable(
        tmp_path, caplog, path, body, marker):
    """The generation of 4 tokens ends; the tail's send waits for a client that reads
    nothing (its deadline 600 s away). The sequence ids, KV blocks and slots are back at
    once (nothing is generated any more), and a cancel by the response id finds the
    response (202), cuts its send (the connection closed, no ``[DONE]``) and counts it
    ``request.aborted``. Before stop 75: the cancel answered 404 and the stream held its
    sequence until its deadline + ``deadline_slack_s``."""
    caplog.set_level(logging.INFO)
    tokens = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    service = app.state.service
    try:
        with ServeLikeServer(stalled_at_the_tail(app, marker), small_buffers=True) as server:
            sock = stalled_client(server.port, {**body, tokens: 4, "stream": True,
                                                "timeout": 600}, path)
            try:
                wait_for(lambda: metric_value(service.metrics.exposition().decode(),
                                              "calexec_responses_send_waiting") == 1,
                         WAIT_S, "the tail's send waiting for the client")
                # the generation ended: nothing of the device is held for bytes already made
                wait_for(lambda: service.sequences.in_use == 0, WAIT_S,
                         "the sequence ids back while the tail waits")
                wait_device_idle(executor, WAIT_S)
                # (a request of several choices has no run left: each choice ended)
                (ident,) = {cut.names[0] for cut in service.streams}
                answer = httpx.post(f"{server.url}/admin/cancel/{ident}", headers=AUTH,
                                    timeout=WAIT_S)
                assert answer.status_code == 202, answer.text
                wait_for(lambda: idle(service), WAIT_S, "the cut response ended")
                raw, ended = read_until_closed(sock)
                assert ended in ("eof", "reset"), (ended, len(raw))
                assert b"data: [DONE]" not in raw
            finally:
                sock.close()
            text = service.metrics.exposition().decode()
            assert metric_value(text, "calexec_admin_cancels_total",
                                {"outcome": "cancelled"}) == 1
            assert metric_value(text, "calexec_request_failures_total",
                                {"code": "request.client_stalled"}) is None
            ok = httpx.post(f"{server.url}/v1/completions",
                            json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=WAIT_S)
            assert ok.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 3)
        assert service.sequences.consistent() and service.sequences.withheld == 0
    finally:
        executor.shutdown(5.0)
    assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]


# ---- 2: chat's service_tier -------------------------------------------------------------------
def test_a_chat_answer_says_the_service_tier_it_used_when_one_was_asked(tmp_path):
    """OpenAI's ``ChatCompletion`` and ``ChatCompletionChunk``: "when the service_tier
    parameter is set, the response body will include the service_tier value ... actually
    used"; one tier serves here, ``default``, as the Responses route echoes. The whole answer,
    every chunk (usage chunk included) and each choice's of ``n`` 2 say it, valid as the
    SDK's types; an answer to a request without it is as before (no key). Before stop 75 no
    chat answer carried it."""
    openai_types = pytest.importorskip("openai.types.chat")
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    try:
        from test_server_support import LiveServer
        with LiveServer(app) as server:
            chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
            for tier in ("flex", "auto", "priority", "default"):
                whole = httpx.post(f"{server.url}/v1/chat/completions",
                                   json={**chat, "service_tier": tier}, timeout=WAIT_S).json()
                assert whole["service_tier"] == "default", whole
                openai_types.ChatCompletion.model_validate(whole, strict=False)
            for n in (1, 2):
                events = []
                with httpx.stream("POST", f"{server.url}/v1/chat/completions", timeout=WAIT_S,
                                  json={**chat, "n": n, "stream": True, "service_tier": "flex",
                                        "stream_options": {"include_usage": True}}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            events.append(json.loads(line[6:]))
                assert events and all(e["service_tier"] == "default" for e in events), events
                for e in events:
                    openai_types.ChatCompletionChunk.model_validate(e)
            plain = httpx.post(f"{server.url}/v1/chat/completions", json=chat,
                               timeout=WAIT_S).json()
            assert "service_tier" not in plain
    finally:
        executor.shutdown(5.0)


# ---- 3: a chat tool message answering no call ------------------------------------------------
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
CALL2 = {**CALL, "id": "call_2"}
USER = {"role": "user", "content": "weather?"}


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([USER, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
     "messages.1.role", "must be a response to a preceeding message with 'tool_calls'"),
    ([{"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, USER],
     "messages.0.role", "must be a response to a preceeding message with 'tool_calls'"),
    ([USER, {"role": "assistant", "content": "let me see"},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
     "messages.2.role", "without tool_calls"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}],
     "messages.2.tool_call_id", "'tool_call_id' of \"call_9\" not found in 'tool_calls' of "
     "previous message (messages[1] calls \"call_1\")"),
    ([USER, {"role": "assistant", "content": None, "tool_calls": [CALL]},
      {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}, USER,
      {"role": "tool", "tool_call_id": "call_1", "content": "again"}],
     "messages.4.role", "must be a response to a preceeding message with 'tool_calls'")],
    ids=["after_user", "first", "after_assistant_text", "unknown_id", "after_a_later_turn"])
def test_a_tool_message_answering_no_call_is_refused_as_openai_refuses_it(live, messages,
                                                                         param, words):
    """OpenAI answers 400 ``Invalid parameter: messages with role 'tool' must be a response
    to a preceeding message with 'tool_calls'`` (``param: messages.[N].role``) and
    ``'tool_call_id' of 'call_X' not found in 'tool_calls' of previous message``; so does
    the server now, naming the message (``messages.N.role`` / ``messages.N.tool_call_id``).
    Before stop 75: 200, the model reading an answer to a call it never made."""
    server = live[0]
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=WAIT_S,
                        json={"messages": messages, "max_tokens": 2})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_tool_messages_answering_the_calls_before_them_are_answered(live):
    """What the SDKs and agent frameworks send: each call's answer after the assistant
    message with the calls, several answers in a row, a later turn with calls of its own."""
    history = [USER, {"role": "assistant", "content": None, "tool_calls": [CALL, CALL2]},
               {"role": "tool", "tool_call_id": "call_2", "content": "rain"},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
               {"role": "assistant", "content": "Sunny in Paris."}, USER,
               {"role": "assistant", "content": "checking", "tool_calls": [
                   {**CALL, "id": "call_3"}]},
               {"role": "tool", "tool_call_id": "call_3", "content": "sunny"}]
    answer = httpx.post(f"{live[0].url}/v1/chat/completions", timeout=WAIT_S,
                        json={"messages": history, "max_tokens": 2})
    assert answer.status_code == 200, answer.text


# ---- 4: the chaos clients' own arguments -------------------------------------------------------
@pytest.mark.parametrize(("argv", "named"), [
    (["http://127.0.0.1:9", "1_0", "1", "1"], "CLIENTS='1_0'"),
    (["http://127.0.0.1:9", "0", "1", "1"], "CLIENTS='0'"),
    (["http://127.0.0.1:9", "1", "\u0663", "1"], "SEED='\u0663'"),
    (["http://127.0.0.1:9", "1", "1", "1_0"], "MAX_SECONDS='1_0'"),
    (["http://127.0.0.1:9", "1", "1", "nan"], "MAX_SECONDS='nan'"),
    (["http://127.0.0.1:9", "1"], "usage: URL CLIENTS SEED MAX_SECONDS (got 2 arguments)")],
    ids=["underscore", "zero", "arabic_indic", "seconds_underscore", "nan", "count"])
def test_the_chaos_clients_read_their_numbers_as_the_cli_does(capsys, argv, named):
    """``python -m calexec.drivers.tools.chaos_clients URL CLIENTS SEED MAX_SECONDS`` read its
    numbers with Python's ``int()``/``float()``: ``1_0`` ran 10 clients, ``٣`` seeded 3, and
    a missing argument was a ValueError traceback. Now the CLI's ASCII reading
    (``cliargs.ascii_integer``/``ascii_number``): one line naming the argument, exit 2."""
    from calexec.drivers.tools import chaos_clients
    assert chaos_clients.main(argv) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1, err


# ---- 5: a model switch whose roll back target was written over in place -----------------------
OTHER_SEED = 12345  # a calbin of another model, whose golden nobody pinned: always refused


def reload(server, path, **more) -> httpx.Response:
    return httpx.post(f"{server.url}/admin/reload", json={"calbin": str(path), **more},
                      headers=AUTH, timeout=120)


@pytest.mark.parametrize("target", ["another", "the_serving_path"])
def test_a_switch_that_could_not_roll_back_is_refused_before_anything_moves(tmp_path, target):
    """``cp new.calbin served.calbin`` while it serves (a write in place: the file held open
    since it served holds the new bytes too), then ``POST /admin/reload`` of a calbin that is
    refused (its golden not pinned), another path or the serving one: the roll back had
    nothing to restore, ``calbin.changed``, and the server ended Failed (the model on the
    device no longer served). Now the reload is refused before anything moves, a 409
    ``calbin.rollback_changed`` naming the path written over and what to do; the model that
    served goes on serving, and the operator who accepts it switches with
    ``without_rollback: true``."""
    from calexec.drivers.synthetic import calbin
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    try:
        from test_server_support import LiveServer
        with LiveServer(app) as server:
            served = tmp_path / "synthetic.calbin"
            sha = executor.gen.sha256
            calbin.write(str(served), calbin.default_spec(seed=OTHER_SEED))  # (in place)
            other = tmp_path / "other.calbin"
            calbin.write(str(other), calbin.default_spec(seed=OTHER_SEED))
            answer = reload(server, other if target == "another" else served)
            assert answer.status_code == 409, answer.text
            error = answer.json()["error"]
            assert error["code"] == "calbin.rollback_changed" and error["param"] == "calbin"
            assert error["type"] == "invalid_request_error", error
            assert answer.headers["x-should-retry"] == "false"  # (a retry meets the same)
            message = error["message"]
            assert f'"{served}" was written over in place since it served' in message, message
            assert "nothing moved" in message and "(mv)" in message, message
            assert '"without_rollback": true' in message, message
            assert executor.state == "Ready" and executor.gen.sha256 == sha
            ok = httpx.post(f"{server.url}/v1/completions",
                            json={"prompt": [5, 6, 7], "max_tokens": 3}, timeout=WAIT_S)
            assert ok.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 3)
            bad = reload(server, served, without_rollback="yes")
            assert bad.status_code == 400 and bad.json()["error"]["param"] == "without_rollback"
            # the operator accepts no roll back: a calbin whose golden is pinned (the
            # default spec, written to a new file renamed over the path) switches
            new = tmp_path / "synthetic.calbin.new"
            calbin.write(str(new), calbin.default_spec())
            new.replace(served)
            switched = reload(server, served, without_rollback=True)
            assert switched.status_code == 200, switched.text
            assert executor.state == "Ready" and executor.gen.sha256 == sha
            # and the file it serves from now is held as it is: a switch rolls back again
            refused = reload(server, other)
            assert refused.status_code == 500, refused.text
            assert refused.json()["error"]["code"] == "recovery.rolled_back"
            assert executor.state == "Ready" and executor.gen.sha256 == sha
    finally:
        executor.shutdown(5.0)


def test_a_calbin_rewritten_with_the_same_bytes_still_rolls_back(tmp_path):
    """The check hashes the held file only once its ctime moved, and a file written again
    with the bytes that served (``cp`` of the same calbin) still rolls back: a refused switch
    answers 500 ``recovery.rolled_back`` and the model that served serves again."""
    from calexec.drivers.synthetic import calbin
    executor = started_executor(tmp_path)
    try:
        served = tmp_path / "synthetic.calbin"
        sha = executor.gen.sha256
        calbin.write(str(served), calbin.default_spec())  # (the same bytes, in place)
        other = tmp_path / "other.calbin"
        calbin.write(str(other), calbin.default_spec(seed=OTHER_SEED))
        status = executor.switch_model(str(other))
        assert status.code == "recovery.rolled_back", status
        assert executor.state == "Ready" and executor.gen.sha256 == sha
    finally:
        executor.shutdown(5.0)


def test_a_cancel_after_the_generation_ended_gives_a_reading_client_the_error_event(tmp_path):
    """A client that reads: the cancel (by the response id) comes while the last token's
    chunk goes out, the generation of ``max_tokens`` 1 ended. The answer is 202 and the
    stream ends with the ``request.aborted`` error event, never a 202 followed by
    ``[DONE]`` (what ``bench soak --cancels`` checks), counted ``request.aborted``. Before
    stop 75 the cancel answered 404 and the stream ended with ``[DONE]``."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    service = app.state.service
    told: list = []

    async def cancelling(scope, receive, send):
        async def on_token(message):
            body = message.get("body", b"")
            if not told and message.get("type") == "http.response.body" and b'"text"' in body:
                ident = json.loads(body.split(b"data: ", 1)[1].split(b"\n")[0])["id"]
                told.append(service.cancel(ident))  # (on the loop, as the admin route calls it)
            await send(message)
        await app(scope, receive, on_token)
    try:
        from test_server_support import LiveServer
        with LiveServer(cancelling) as server:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=WAIT_S,
                              json={"prompt": [1, 2, 3], "max_tokens": 1, "stream": True}) as r:
                raw = r.read()
            assert told and told[0].outcome == "cancelled", told
            assert b"data: [DONE]" not in raw, raw
            assert b'"request.aborted"' in raw, raw
            wait_for(lambda: idle(service), WAIT_S, "the request ended")
            text = service.metrics.exposition().decode()
            assert metric_value(text, "calexec_request_failures_total",
                                {"code": "request.aborted"}) == 1
        wait_device_idle(executor, WAIT_S)
    finally:
        executor.shutdown(5.0)
