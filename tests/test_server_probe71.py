"""Adversarial HTTP and admin input found by probing a loopback ``calexec serve`` at stop 71
(branch probe-http): a reload's calbin path replaced by a FIFO while it is checked or
loaded, a served model name no client sends back, what ``best_of``, an admin body over the
limit, a path a slash away from a route and a timeout met while prompt logprobs were scored
are told, a FIFO at the dump file's name, ``max_tool_calls``. Real executor on the bundled
emulator; loopback only; every wait bounded."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT, Device
from calexec.drivers.serving.service import ServerConfig
from calexec.drivers.synthetic import calbin
from calexec.machines import switch_check
from fifo_swap import fifo_after_look, to_fifo
from test_server_support import started_executor


def _bounded(call, fifo: str, end: int = os.O_WRONLY) -> list:
    """``call()`` in a thread, waited for at most 30 s: what it returned (empty: still
    running, then unblocked by opening ``fifo``'s other end, ``end``, so no thread is left
    behind)."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(30.0)
    if thread.is_alive():
        fd = os.open(fifo, end | os.O_NONBLOCK)  # the open that waits returns
        thread.join(30.0)
        os.close(fd)
        return []
    return out


def test_a_reload_path_replaced_by_a_fifo_while_checked_is_refused_not_held(tmp_path,
                                                                            monkeypatch):
    """``POST /admin/reload``'s check (``DeviceExecutor.check_calbin``) ``stat`` ed the path
    (a regular file), then opened it again by path to read its first bytes, for the
    runtime's loader and for the sha256: a path replaced by a FIFO between the ``stat`` and
    an open held the check in that open for ever (the reload never answered, a worker thread
    held). The file is now opened once without waiting and every read is of what is open:
    ``calbin.not_a_file`` naming the mode and that the path was replaced."""
    path = str(tmp_path / "next.calbin")
    calbin.write(path, calbin.default_spec())
    real_stat = os.stat
    swapped: list[str] = []

    def stat_then_swap(p, *args, **kwargs):
        result = real_stat(p, *args, **kwargs)
        if os.fspath(p) == path and not swapped:  # the check's stat saw the regular file
            swapped.append(path)
            to_fifo(path)
        return result

    monkeypatch.setattr(os, "stat", stat_then_swap)
    answered = _bounded(lambda: switch_check.check_calbin(
        CalRT.load(), load_manifest(default_manifest_path()), path), path)
    monkeypatch.undo()
    assert swapped, "the check never stat'ed the path"
    assert answered, "the check waited in an open of the FIFO (unblocked by the test)"
    status = answered[0]
    assert status.code == "calbin.not_a_file", status
    assert "not a regular file (mode prw" in status.message, status
    assert "replaced while it was checked" in status.message, status


def test_a_calbin_replaced_by_a_fifo_before_the_load_rolls_the_switch_back(tmp_path,
                                                                          monkeypatch):
    """A switch (``DeviceExecutor.switch_model``: a reload after its check) looked at the
    path (``stat``: a regular file) and then gave it to the runtime's loader, which opened
    it again: a FIFO put there between the two held the switch in the loader's open for
    ever, the lifecycle Configuring, the previous generation torn down, nothing served. The
    driver now opens the path without waiting and looks at what it opened: a FIFO is not
    given to the loader (FILE_READ), the switch rolls back and the previous calbin serves."""
    executor = started_executor(tmp_path)
    path = str(tmp_path / "next.calbin")
    calbin.write(path, calbin.default_spec())
    real_load = Device.load_calbin
    swapped: list[str] = []

    def swap_then_load(self, p, *args, **kwargs):
        if p == path and not swapped:  # the switch looked at the file; now it loads
            swapped.append(p)
            to_fifo(path)
        return real_load(self, p, *args, **kwargs)

    try:
        monkeypatch.setattr(Device, "load_calbin", swap_then_load)
        answered = _bounded(lambda: executor.switch_model(path), path)
        monkeypatch.undo()
        assert swapped, "the switch never loaded the path"
        assert answered, "the switch waited in the loader's open of the FIFO"
        assert answered[0].code == "recovery.rolled_back", answered[0]
        assert "FILE_READ" in answered[0].message, answered[0]
        assert executor.state == "Ready" and executor.gen is not None
        assert executor.gen.calbin_path == executor.config.calbin_path
    finally:
        executor.shutdown(5.0)


def test_a_calbin_replaced_after_the_drivers_look_is_loaded_as_looked_at(tmp_path,
                                                                         monkeypatch):
    """The driver's look (``fstat`` of what it opened) and the loader's open are two steps
    too: the loader and the hash are given ``/proc/self/fd/N``, a new open of the file the
    driver holds, so a FIFO put at the path after the look is not what they open; the switch
    serves the calbin that was looked at (and names it by its path)."""
    executor = started_executor(tmp_path)
    path = str(tmp_path / "next.calbin")
    calbin.write(path, calbin.default_spec())
    try:
        swapped = fifo_after_look(monkeypatch, path)  # once the driver looked at the calbin
        answered = _bounded(lambda: executor.switch_model(path), path)
        monkeypatch.undo()
        assert swapped, "nothing looked at the opened calbin before loading it"
        assert answered, "the switch waited in the loader's open of the FIFO"
        assert answered[0].ok, answered[0]
        assert executor.state == "Ready" and executor.gen is not None
        assert executor.gen.calbin_path == path
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("name, said", [
    (" qwen3", "begins or ends with a space: clients send 'qwen3'"),
    ("qwen3 ", "begins or ends with a space: clients send 'qwen3'"),
    ("m" * 4097, "4097 characters, at most 4096"),
])
def test_a_served_model_name_no_client_sends_back_is_refused(name, said):
    """``calexec serve --served-model-name ' qwen3'`` (a quoting slip in a unit file) served,
    exit 0, its ``/v1/models`` listing ``" qwen3"``: every client sending ``"qwen3"`` got 404
    ``model_not_found``; a name of a file's whole text (``"$(cat notes)"``) went into every
    response body and every metric series. Both are refused before the executor starts,
    exit 2, naming the flag (``ServerConfig(model_name=...)`` alike); a name of non-ASCII
    letters, or one with inner spaces, is still taken."""
    done = subprocess.run([sys.executable, "-m", "calexec.cli", "serve", "--once",
                           "--served-model-name", name], capture_output=True, text=True,
                          timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert lines[-1].startswith("calexec serve: --served-model-name="), lines[-1]
    assert said in lines[-1], lines[-1]
    assert len(lines[-1]) < 500, lines[-1]  # the name is cut, the error stays one short line
    with pytest.raises(ValueError, match="^model_name=") as err:
        ServerConfig(model_name=name)
    assert said in str(err.value), err.value
    for taken in ("モデル", "my model", "org/qwen3-8b"):
        assert ServerConfig(model_name=taken).model_name == taken


@pytest.mark.parametrize("body", [{"best_of": 2}, {"best_of": 4, "n": 2}])
def test_a_best_of_above_one_is_told_what_to_send(tmp_path, body):
    """``best_of: 2`` was refused ``best_of=2: best_of > 1 is not supported``: the field and
    the value, no word of what the server takes, where ``best_of: 0`` (stop 65) and every
    other refused parameter with a neutral value say it. It now says to send 1 or leave it
    out, and that ``n`` gives several choices."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1,
                                                     **body})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "best_of", error
    assert error["message"].startswith(f"best_of={body['best_of']}: best_of > 1 is not "
                                       "supported"), error
    assert "send 1 or leave it out; n gives n choices" in error["message"], error


@pytest.mark.parametrize("route, takes", [
    ("/admin/reload", '/admin/reload takes {"calbin": PATH}, the path of a calbin file'),
    ("/admin/drain", "/admin/drain takes no body: the grace is the query parameter"),
])
def test_an_admin_body_over_the_limit_is_told_what_the_route_takes(tmp_path, route, takes):
    """An operator sending a calbin's bytes to ``POST /admin/reload`` (``curl --data-binary
    @model.calbin``, the path meant) got the API's 413: ``send a smaller body (fewer or
    shorter prompts), or start the server with a larger --max-body-bytes``: no prompt is
    sent there and a larger limit only made a second wrong answer. It now says what the
    route takes; an API route's 413 keeps its words."""
    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    big = b"x" * 4096
    try:
        app = create_app(executor, ServerConfig(admin_token="tok", max_body_bytes=1024))
        from fastapi.testclient import TestClient
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.post(route, content=big, headers={
                "Authorization": "Bearer tok", "Content-Type": "application/json"})
            api = client.post("/v1/completions", content=big,
                              headers={"Content-Type": "application/json"})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 413, r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith("request body exceeds max_body_bytes=1024: "), message
    assert takes in message and "prompts" not in message, message
    assert "--max-body-bytes" not in message, message
    assert api.status_code == 413 and "fewer or shorter prompts" in api.text, api.text[:300]


@pytest.mark.parametrize("reader", [False, True])
def test_a_fifo_at_the_dump_files_name_is_refused_not_waited_on_nor_fed(tmp_path, reader):
    """The dump file's name is predictable (``<dir>/calexec-dump-<pid>.jsonl``) and its
    directory may be one others write to (``/tmp``: a symlink planted there was refused at
    stop 54). A FIFO made at that name held the writer in its open for ever when nobody
    read it (every later record dropped as "writer behind"), and handed every record,
    prompts included, to whoever read it. A record is now appended only to a regular file:
    the FIFO is refused at once, counted in ``errors`` and warned as any refusal, and
    nothing reaches its reader."""
    from calexec.drivers.serving.dumpsink import DumpSink

    sink = DumpSink(tmp_path / "dump", max_bytes=1_000_000, include_content=True)
    os.mkfifo(sink.path)
    read_end = os.open(sink.path, os.O_RDONLY | os.O_NONBLOCK) if reader else None
    try:
        answered = _bounded(lambda: sink.write({"prompt": "a secret prompt"}), str(sink.path),
                            os.O_RDONLY)
        assert answered, "the record's write waited in the open of a FIFO no one read"
        assert answered[0] is False
        assert sink.counts()["error"] == 1 and sink.counts()["written"] == 0, sink.counts()
        if read_end is not None:
            try:
                leaked = os.read(read_end, 4096)
            except BlockingIOError:
                leaked = b""
            assert leaked == b"", leaked
    finally:
        if read_end is not None:
            os.close(read_end)


def test_a_path_a_slash_away_from_a_route_is_told_which(tmp_path):
    """``POST //v1/completions`` (a hand-written client joining a base URL ending in ``/``
    to ``/v1/completions``; ``curl $BASE/v1/...``), ``POST /v1/chat/completions/`` (no
    redirect since stop 40: Starlette built its ``Location`` from the client's ``Host``) and
    ``POST /v1//chat/completions`` were answered ``no such route`` alone: the route the
    client meant was not named. The 404 now says ``did you mean /v1/completions?`` and why;
    a path no route is near stays as it was."""
    import http.client
    import json
    from urllib.parse import urlsplit

    from calexec.drivers.serving.server import create_app
    from test_server_support import LiveServer

    executor = started_executor(tmp_path)
    answers = {}
    try:
        with LiveServer(create_app(executor, ServerConfig())) as server:
            where = urlsplit(server.url)
            for path in ("//v1/completions", "/v1/chat/completions/", "/v1//chat/completions",
                         "/admin/reload/", "/v1/nothing/"):
                conn = http.client.HTTPConnection(where.hostname, where.port, timeout=30)
                try:
                    conn.request("POST", path, body=b"{}",
                                 headers={"Content-Type": "application/json"})
                    response = conn.getresponse()
                    answers[path] = (response.status, json.loads(response.read()))
                finally:
                    conn.close()
    finally:
        executor.shutdown(5.0)
    for path, meant in (("//v1/completions", "/v1/completions"),
                        ("/v1/chat/completions/", "/v1/chat/completions"),
                        ("/v1//chat/completions", "/v1/chat/completions"),
                        ("/admin/reload/", "/admin/reload")):
        status, body = answers[path]
        message = body["error"]["message"]
        assert status == 404 and body["error"]["code"] == "not_found", (path, body)
        assert message.startswith(f"POST {path}: no such route: did you mean {meant}? "), message
    status, body = answers["/v1/nothing/"]
    assert status == 404 and "did you mean" not in body["error"]["message"], body


@pytest.mark.parametrize("extra", [{"echo": True, "logprobs": 1}, {"prompt_logprobs": 1}])
def test_a_timeout_met_while_the_prompt_is_scored_names_the_prompt_logprobs(tmp_path, extra):
    """Prompt logprobs (``echo`` with ``logprobs``, vLLM's ``prompt_logprobs``) score the
    prompt one token per device job: a long prompt's request met its ``timeout`` before any
    token was generated and was told ``... passed after 0 generated tokens ...: give a
    larger timeout or a smaller max_tokens``, though ``max_tokens: 1`` was not what took the
    time. It now names the positions scored, the prompt logprobs, and what to change (a
    larger timeout, a shorter prompt, or no prompt logprobs)."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path, device_config="decode_us=20000")
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post("/v1/completions", json={
                "prompt": [5] * 200, "max_tokens": 1, "timeout": 0.5, **extra})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 504, r.text[:300]
    message = r.json()["error"]["message"]
    assert message.startswith("request timeout=0.5 s passed after "), message
    assert "of the prompt's 199 logprobs positions, before any token was generated" in message
    assert ("give a larger timeout or a shorter prompt, or leave prompt logprobs out"
            in message), message
    assert "max_tokens" not in message, message


def test_max_tool_calls_is_honoured_not_refused(tmp_path):
    """``max_tool_calls`` on ``/v1/responses`` bounds the calls to built-in tools (OpenAI's
    reference: "The maximum number of total calls to built-in tools"), which this server
    refuses in ``tools``: any count is honoured, none being made. It was a 400 ``not
    supported`` for every value, failing a client that sets a bound by habit; an integer
    >= 0 is now served and echoed in the response, another value refused naming it."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import create_app

    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            served = client.post("/v1/responses", json={
                "input": "hi", "max_output_tokens": 16, "max_tool_calls": 3})
            refused = client.post("/v1/responses", json={
                "input": "hi", "max_output_tokens": 16, "max_tool_calls": -1})
    finally:
        executor.shutdown(5.0)
    assert served.status_code == 200, served.text[:300]
    assert served.json()["max_tool_calls"] == 3
    assert refused.status_code == 400, refused.text[:300]
    error = refused.json()["error"]
    assert error["param"] == "max_tool_calls", error
    assert error["message"].startswith("max_tool_calls=-1: must be an integer >= 0 or null"), error
