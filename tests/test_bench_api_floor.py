"""``bench server``'s ``api_process_floor`` side (issue 28, ``api_floor.py``): the engine
socket answers each framed request with its run's tokens, a failure as an error, a bad frame
by closing only that connection; the API app relays over pooled connections; the API process
prints its URL and exits when its stdin closes; bad fields and flags are named. No timing
threshold: the benchmark reports numbers, tests don't."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading

import pytest

from calexec.drivers.tools.bench import api_floor

pytestmark = pytest.mark.skipif(not hasattr(socket, "AF_UNIX"), reason="no Unix sockets")


def _fake_run(prompt: list[int], max_tokens: int) -> list[int]:
    if prompt[0] == 666:
        raise RuntimeError("the device said no")
    return [(prompt[-1] + i) % 1000 for i in range(max_tokens)]


def _ask(path: str, payload: bytes) -> dict[str, object] | None:
    """One raw frame to the engine socket; its answer, or None when it closed the link."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        conn.connect(path)
        conn.sendall(payload)
        head = conn.recv(4)
        if len(head) < 4:
            return None
        size = api_floor.frame_length(head)
        body = b""
        while len(body) < size:
            body += conn.recv(size - len(body))
        return api_floor.decode_body(body)


@pytest.fixture
def engine():
    with tempfile.TemporaryDirectory(prefix="calexec-api-floor-") as tmp:
        path = os.path.join(tmp, "engine.sock")
        eng = api_floor.EngineSocket(path, _fake_run)
        try:
            yield path
        finally:
            eng.close()
        left = [t.name for t in threading.enumerate() if t.name.startswith("api-floor-")]
        assert left == []  # the acceptor and every connection's thread joined


def test_the_engine_answers_tokens_errors_and_survives_a_bad_frame(engine):
    ok = api_floor.encode({"prompt": [1, 2, 3], "max_tokens": 4})
    assert _ask(engine, ok) == {"tokens": [3, 4, 5, 6]}
    failing = api_floor.encode({"prompt": [666], "max_tokens": 1})
    assert _ask(engine, failing) == {"error": "RuntimeError: the device said no"}
    # bad frames close their own connection only
    assert _ask(engine, b"\x05\x00\x00\x00{oops") is None
    assert _ask(engine, (api_floor.MAX_FRAME + 1).to_bytes(4, "little")) is None
    assert _ask(engine, api_floor.encode({"prompt": [], "max_tokens": 1})) is None
    assert _ask(engine, ok) == {"tokens": [3, 4, 5, 6]}  # still serving


@pytest.mark.parametrize(("obj", "named"), [
    ({"prompt": [], "max_tokens": 1}, "prompt=[]"),
    ({"prompt": [1, "x"], "max_tokens": 1}, "prompt="),
    ({"prompt": [True], "max_tokens": 1}, "prompt="),
    ({"max_tokens": 1}, "prompt=None"),
    ({"prompt": [1], "max_tokens": 0}, "max_tokens=0"),
    ({"prompt": [1], "max_tokens": "2"}, "max_tokens='2'"),
])
def test_a_bad_request_is_refused_naming_the_field(obj, named):
    with pytest.raises(api_floor.FrameError, match=named.replace("[", r"\[")):
        api_floor.check_request(obj)


def test_frames_are_bounded_and_must_be_json_objects():
    with pytest.raises(api_floor.FrameError, match="more than"):
        api_floor.encode({"prompt": [1] * api_floor.MAX_FRAME})
    with pytest.raises(api_floor.FrameError, match="not a JSON object"):
        api_floor.decode_body(b"[1, 2]")
    with pytest.raises(api_floor.FrameError, match="not JSON"):
        api_floor.decode_body(b"{")


def test_the_api_app_relays_over_pooled_connections(engine):
    import http.client

    from calexec.drivers.tools.chaos import LiveServer

    with LiveServer(api_floor.create_app(engine)) as live:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
        for last in (3, 9):  # the second request reuses the pooled engine connection
            conn.request("POST", "/v1/completions",
                         body=json.dumps({"prompt": [1, last], "max_tokens": 3}),
                         headers={"Content-Type": "application/json"})
            response = conn.getresponse()
            body = json.loads(response.read())
            assert response.status == 200
            assert body["choices"][0]["token_ids"] == [last, last + 1, last + 2]
            assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3,
                                     "total_tokens": 5}
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [666]}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 500
        assert "the device said no" in json.loads(response.read())["error"]["message"]
        conn.close()


def test_an_engine_socket_that_is_not_there_is_a_502_naming_it(tmp_path):
    import http.client

    from calexec.drivers.tools.chaos import LiveServer

    missing = str(tmp_path / "no-engine.sock")
    with LiveServer(api_floor.create_app(missing)) as live:
        conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=10)
        conn.request("POST", "/v1/completions", body=json.dumps({"prompt": [1]}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        body = json.loads(response.read())
        conn.close()
    assert response.status == 502 and missing in body["error"]["message"]


def test_the_api_process_prints_its_url_and_exits_when_stdin_closes(engine):
    proc = subprocess.Popen([sys.executable, "-m", "calexec.drivers.tools.bench.api_floor",
                             "--socket", engine], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdin is not None
        assert proc.stdout.readline().startswith("http://127.0.0.1:")
        proc.stdin.close()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("argv", [[], ["--socket", "x", "--max-seconds", "0"]])
def test_the_api_process_refuses_bad_flags(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        api_floor.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    # (since stop 74 calexec's seconds: "argument --max-seconds: must be ... got '0'")
    assert ("--socket" in err) if not argv else ("--max-seconds" in err and "'0'" in err)
