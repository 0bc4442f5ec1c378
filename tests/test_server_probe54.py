"""Stop 54, the server's leftovers: each defect pinned here (docs/traceability.md "Found at
stop 54 (server)"). Real executor on the bundled emulator; every wait bounded."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading

import pytest
from fastapi.testclient import TestClient

import needs
from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    MODEL,
    ServeLikeServer,
    draining_with_a_stream,
    executor_fixture,  # noqa: F401 - the fixture ``executor``
    sent_with_and_without_expect,
    split_head,
)

TOKEN = "probe54-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def client(executor):
    with TestClient(create_app(executor, ServerConfig(admin_token=TOKEN))) as client:
        yield client


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "user"}, "content"),
    ({"role": "user", "content": None}, "content"),
    ({"role": "system"}, "content"),
    ({"role": "developer", "content": None}, "content"),
    ({"role": "assistant"}, "content"),
    ({"role": "tool", "tool_call_id": "call_1"}, "content"),
    ({"role": "tool", "content": "42"}, "tool_call_id"),
    ({"role": "user", "content": []}, "content"),  # (OpenAI: an empty array, 400)
], ids=["user", "user-null", "system", "developer-null", "assistant-bare", "tool-no-content",
        "tool-no-id", "user-no-parts"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_a_message_without_the_fields_its_role_needs_is_a_400_naming_it(client, message, param,
                                                                        path):
    """OpenAI answers 400 ``Missing required parameter: 'messages[1].content'`` for a user,
    system or developer message without content (and for a null one); a tool message needs
    content and ``tool_call_id``; an assistant message may leave content out only when it
    has ``tool_calls``. The server took them all and rendered the message as empty text
    (``user: \\n``), answering as if the client had sent an empty turn."""
    messages = [{"role": "user", "content": "hi"}, message]
    body = {"messages": messages}
    if path == "/v1/chat/completions":
        body.update(model=MODEL, max_tokens=1)
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == f"messages.1.{param}", error
    assert f"messages[1].{param}" in error["message"], error
    assert message["role"] in error["message"], error


@pytest.mark.parametrize("message", [
    {"role": "assistant", "tool_calls": [CALL]},
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "assistant", "content": None, "refusal": "no"},  # the SDK's dump of a refusal
    {"role": "user", "content": ""},
    {"role": "user", "content": [{"type": "text", "text": "a"}]},
], ids=["assistant-calls", "assistant-null-calls", "assistant-refusal", "user-empty",
        "user-parts"])
def test_messages_with_what_their_role_needs_are_still_taken(client, message):
    messages = [{"role": "user", "content": "hi"}, message]
    if message["role"] == "assistant" and message.get("tool_calls"):
        messages.append({"role": "tool", "tool_call_id": "call_1", "content": "42"})
    r = client.post("/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("shape", ["top", "nested"])
def test_an_admin_reload_body_with_a_key_given_twice_is_a_400_naming_it(client, executor, shape):
    """``POST /admin/reload`` with ``{"calbin": A, "calbin": B}``: Python's JSON parser keeps
    the last value, so the server switched the model to B (here the calbin it serves: a
    switch to a new generation) while the operator's body also named A. Now a 400 naming the
    key, nothing checked or moved. (The API's bodies keep JSON's last-one-wins, as vLLM's
    pydantic parser does.)"""
    served = executor.gen.calbin_path
    generation = executor.gen.id
    if shape == "top":
        raw = f'{{"calbin": "/nonexistent/a.calbin", "calbin": {json.dumps(served)}}}'
        key = "calbin"
    else:
        raw = f'{{"calbin": {json.dumps(served)}, "x": {{"k": 1, "k": 2}}}}'
        key = "k"
    r = client.post("/admin/reload", content=raw.encode(),
                    headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == key and error["code"] == "request.invalid", error
    assert error["message"].startswith(f"{key}: given more than once"), error
    assert executor.gen.id == generation and executor.state == "Ready"


TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"], "additionalProperties": False}}}


@pytest.mark.parametrize(("tool_choice", "finish"), [
    ({"type": "function", "function": {"name": "get"}}, "stop"),
    ("required", "tool_calls"),
], ids=["named", "required"])
def test_the_calls_of_a_named_tool_choice_finish_stop_as_openais_do(client, tool_choice, finish):
    """OpenAI ends the calls a named ``tool_choice`` forced with ``finish_reason: "stop"``,
    whole and streamed, and ``"required"`` ones with ``"tool_calls"`` (vLLM aligned its
    answers to that table: vllm-project/vllm#25054); this server said ``"tool_calls"`` for
    both. The openai SDK and langchain-openai read the calls whatever the reason."""
    needs.module("llguidance", "server")
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL],
            "tool_choice": tool_choice, "parallel_tool_calls": False, "max_tokens": 60}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["tool_calls"], choice
    assert choice["finish_reason"] == finish, choice
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: {")]
    reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert [r for r in reasons if r is not None] == [finish], reasons
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in chunks if c["choices"])


@pytest.mark.parametrize(("content", "code", "why"), [
    (b"\x00garbage\xff" * 40, "calbin.invalid", "the loader refused it (ERR_FILE_FORMAT)"),
    (b"CALBIN\n", "calbin.invalid", "the loader refused it (ERR_FILE_FORMAT)"),
    (b"", "calbin.empty", "the file is empty"),
], ids=["garbage", "short", "empty"])
def test_serve_with_a_calbin_that_is_not_one_names_the_flag_the_path_and_why(tmp_path, content,
                                                                            code, why):
    """``calexec serve --calbin FILE`` with a file that is no calbin said ``executor failed
    to start: calrt.configure_failed [artifact/configure] CalRT configure returned 12
    (FILE_FORMAT): calbin load '...'`` (after an ERROR line saying the same): a runtime
    phrase naming neither the flag nor what is wrong with the file. Now the reload's check
    (``DeviceExecutor.check_calbin``) runs before the executor starts: one line naming
    ``--calbin``, the path and the reason, exit 3 (docs/server.md: a calbin the emulator
    refuses ends the start with 3)."""
    path = tmp_path / "model.calbin"
    path.write_bytes(content)
    code_line = ("import sys\nfrom calexec.cli import main\n"
                 f"sys.exit(main(['serve', '--once', '--calbin', {str(path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code_line], capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0] == (f"calexec serve: --calbin={str(path)!r}: not a valid calbin ({code}): "
                        f"{'not a calbin the runtime loads: ' if code == 'calbin.invalid' else ''}"
                        f"{why}; the executor was not started"), lines[0]


def test_serve_with_a_calbin_without_a_pinned_golden_names_the_flag_that_allows_it(tmp_path):
    """A valid calbin with no pinned golden (a synthetic calbin of another seed): the start
    is refused ``golden.unpinned``, whose message (the core's) said "or set
    allow_unpinned_golden", a config field a ``calexec serve`` user does not have; the line
    now names the flag, ``--allow-unpinned-golden``. Exit 3 as before."""
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "seed5.calbin"
    calbin.write(str(path), calbin.default_spec(seed=5))
    code_line = ("import sys\nfrom calexec.cli import main\n"
                 f"sys.exit(main(['serve', '--once', '--calbin', {str(path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code_line], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 3, (done.returncode, done.stderr)
    failed = [line for line in done.stderr.splitlines() if "failed to start" in line]
    assert len(failed) == 1 and "golden.unpinned" in failed[0], done.stderr
    assert "--allow-unpinned-golden" in failed[0], failed[0]


def test_a_completion_sent_while_the_server_drains_is_refused_before_its_body(tmp_path):
    """While a drain waits for a stream, ``POST /v1/completions`` with ``Expect:
    100-continue`` got ``100 Continue`` (uvicorn sends it when the route reads the body), so
    the client uploaded its body only to be refused 503 (a client waiting for the 100 before
    sending, as here, had to send it first: it hung). Now the draining 503 (``Retry-After``,
    ``Connection: close``) is answered before the body is read, with no ``100 Continue``;
    a request without the expectation (its body on its way) is read and refused as before."""
    payload = json.dumps({"prompt": [1], "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\n")
    with draining_with_a_stream(tmp_path, TOKEN) as (server, _, _):
        for data, ended in sent_with_and_without_expect(server.port, head, payload):
            assert b"100 Continue" not in data, data[:300]
            status, headers, body = split_head(data)
            assert status.startswith(b"HTTP/1.1 503 "), data[:300]
            assert headers.get("connection") == "close" and "retry-after" in headers, headers
            error = json.loads(body)["error"]
            assert "server is draining" in error["message"], error
            assert ended == "eof", ended


def test_serve_dump_prompts_writes_a_file_only_its_owner_can_read(tmp_path):
    """``calexec serve --dump-dir D --dump-prompts`` under the common umask 022: the dump file,
    which holds every user's prompt and completion, was created 0644 (anyone on the host
    could read it); now 0600. The record of ``--once``'s sample request is in it: the drain
    flushed the sink's writer thread before the exit."""
    directory = tmp_path / "dump"
    done = subprocess.run(
        [sys.executable, "-c", "import sys\nfrom calexec.cli import main\nsys.exit(main(["
         f"'serve', '--once', '--device-config', 'decode_us=0', '--dump-dir', "
         f"{str(directory)!r}, '--dump-prompts']))"],
        capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.umask(0o022))
    assert done.returncode == 0, done.stderr
    files = list(directory.iterdir())
    assert len(files) == 1, files
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600, oct(files[0].stat().st_mode)
    records = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(records) == 1 and records[0]["text"] and records[0]["prompt_token_ids"], records


class StalledFile:
    """``os.open`` of ``path`` (a dump sink's file) waits until :meth:`release` (bounded):
    a disk that stalls, as a hung NFS mount does. A FIFO no one read stood for one until
    stop 71, when the sink stopped opening anything but a regular file."""

    def __init__(self, monkeypatch, path) -> None:
        self.path = os.fspath(path)
        self.gate = threading.Event()
        real_open = os.open

        def stalled_open(file, *args, **kwargs):
            if os.fspath(file) == self.path:
                self.gate.wait(120.0)
            return real_open(file, *args, **kwargs)
        monkeypatch.setattr(os, "open", stalled_open)

    def stall(self) -> None:
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()


def test_a_dump_file_that_blocks_never_holds_the_event_loop(executor, tmp_path, monkeypatch):
    """The dump record was written on the event loop at the end of every request: a disk that
    stalls (here the dump file's open waits, as on a hung NFS mount) stopped the whole
    server, every other request and ``/health`` included. Now the records are queued for
    the sink's writer thread: the server answers meanwhile, and once the file takes them
    they are written in the order the requests ended."""
    import httpx

    sink = DumpSink(tmp_path / "dump", max_bytes=1 << 20)
    stalled = StalledFile(monkeypatch, sink.path)
    unblock = stalled.release
    try:
        with ServeLikeServer(create_app(executor, ServerConfig(), sink)) as server, \
                httpx.Client(base_url=server.url, timeout=5) as http:
            sent = []
            for prompt in ([1], [1, 2], [1, 2, 3]):
                r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text
                sent.append(r.headers["x-request-id"])
                assert http.get("/health").status_code == 200
            assert sink.counts()["written"] == 0  # all waiting for the file
            unblock()
            assert sink.flush(10)
            data = sink.path.read_bytes()
        records = [json.loads(line) for line in data.decode().splitlines()]
        assert [r["x_request_id"] for r in records] == sent
        assert [r["prompt_tokens"] for r in records] == [1, 2, 3]
        assert sink.counts() == {"written": 3, "dropped": 0, "error": 0, "overflow": 0}
    finally:
        unblock()


def test_a_dump_writer_behind_a_stuck_file_drops_and_counts_past_its_bound(tmp_path, caplog,
                                                                           monkeypatch):
    """The queue the writer thread takes from is bounded (``max_pending_bytes``): while the
    file takes nothing, records past the bound are dropped and counted (``overflow``, one
    warning line), never held without end; a ``close`` that runs out of time counts what it
    could not write. Those taken are written in order once the file takes them."""
    import logging

    sink = DumpSink(tmp_path / "dump", max_bytes=1 << 20, max_pending_bytes=100)
    stalled = StalledFile(monkeypatch, sink.path)
    record = {"i": 0, "pad": "x" * 27}  # 44 bytes a line: 2 fit in the bound
    with caplog.at_level(logging.WARNING, logger="calexec.dump"):
        taken = [sink.submit({**record, "i": i}) for i in range(6)]
    # the queue holds 2; the writer takes one record off it to block in open(), and when is
    # timing (before the third, or only after the fifth on a loaded host: CI once saw
    # [T, T, F, F, F, T]), so 2 or 3 are taken and the rest dropped; one warning per streak
    assert taken[:2] == [True, True] and taken.count(True) <= 3, taken
    assert sink.counts()["overflow"] == taken.count(False)
    warned = [r for r in caplog.records if "dump writer behind" in r.getMessage()]
    assert 1 <= len(warned) <= 2, warned
    assert sink.flush(0.2) is False  # nothing moves: the file's open waits
    stalled.release()
    assert sink.flush(10)
    lines = sink.path.read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [
        i for i, ok in enumerate(taken) if ok]
    assert sink.counts()["written"] == taken.count(True)
    # stuck again: close gives up on what is left within its time, counted, warned
    stalled.stall()
    before = sink.counts()["overflow"]
    assert sink.submit(record) and sink.submit(record)
    with caplog.at_level(logging.WARNING, logger="calexec.dump"):
        assert sink.close(0.2) is False
    assert sink.counts()["overflow"] - before in (1, 2)  # (one may be the writer's, in open)
    assert any("not written" in r.getMessage() for r in caplog.records)
    # closed again (the app's shutdown after a drain), the writer still stuck in open(): it
    # answers at once that a record is still held, not after waiting its timeout for the disk
    # again (an hour here: the join's bound is what fails if it waits, never a duration)
    held = {"overflow": sink.counts()["overflow"]}
    again = threading.Thread(target=lambda: held.update(closed=sink.close(3600.0)),
                             name="second-close", daemon=True)
    again.start()
    again.join(30)
    waiting = again.is_alive()
    stalled.release()  # (lets the writer end)
    again.join(30)
    assert not waiting, "a second close waited for the write the stuck file holds"
    assert held == {"overflow": held["overflow"], "closed": False}, held
    assert sink.counts()["overflow"] == held["overflow"]  # the held record is not given up


def test_a_dump_file_name_planted_as_a_symlink_is_refused_not_followed(tmp_path, caplog):
    """The dump file's name is predictable (``calexec-dump-<pid>.jsonl``); in a directory
    others can write to, a symlink planted at it sent every record (users' prompts, with
    ``--dump-prompts``) to wherever it pointed. The sink never opens it through a symlink:
    the record is refused and counted as any refused write, with its warning, and the link's
    target stays untouched."""
    sink = DumpSink(tmp_path / "dump", max_bytes=1 << 20, include_content=True)
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    os.symlink(target, sink.path)
    with caplog.at_level("WARNING", logger="calexec.dump"):
        assert sink.write({"prompt": "secret", "id": "x"}) is False
    assert target.read_text() == ""
    assert sink.counts()["error"] == 1 and sink.counts()["written"] == 0
    assert "ELOOP" in caplog.text


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_tool_choice_naming_a_function_called_like_a_mode_calls_that_function(client, name):
    """A function may be called "none", "auto" or "required" (1 to 64 letters, digits, _ or
    -); ``tool_choice: {"type": "function", "function": {"name": "auto"}}`` was read as the
    mode of that name: "none" answered text with no call, "auto" free text, "required" a
    call of another tool. Now it is the named function's call, as for any other name."""
    needs.module("llguidance", "server")
    tools = [{"type": "function", "function": {**TOOL["function"], "name": name}},
             {"type": "function", "function": {**TOOL["function"], "name": "other"}}]
    r = client.post("/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": name}},
        "parallel_tool_calls": False, "max_tokens": 120})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert [call["function"]["name"] for call in calls] == [name], choice
    assert choice["finish_reason"] == "stop", choice


def test_the_fleet_ingress_relays_a_body_nested_past_the_parsers_limit():
    """``calexec serve --ray``: the ingress reads a request's ``timeout`` from its body
    (``request_timeout``) before relaying it; a body nested past Python's recursion limit
    (``[[[[...``, 100,000 deep, under the 1 MiB body limit) raised RecursionError out of the
    ingress (a plain 500 from the proxy, no OpenAI-shaped body, nothing relayed). Now it
    takes the default deadline and relays the body, whose replica refuses it 400 (as the
    single server does: docs/server.md)."""
    from calexec.drivers.fleet.ingress import request_timeout
    from test_fleet_ingress import relay_one_body

    nested = b"[" * 100_000 + b"]" * 100_000
    assert request_timeout(nested, 30.0) == 30.0
    replica, sent = relay_one_body(nested)
    assert len(replica.requests) == 1 and replica.requests[0]["body"] == nested
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]
