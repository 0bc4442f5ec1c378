"""Stop 62's server probe (docs/traceability.md "Found at stop 62 (server)"): a flag given
twice on a command line, and what the HTTP server answers to adversarial input. Loopback
servers on the bundled emulator; every wait bounded."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from calexec import cli, cliargs
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    ServeLikeServer,
    responses,
    send_raw,
    split_head,
    started_executor,
)


# ---- a single-value flag given twice -----------------------------------------------------------
def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's exit, as the console script sees it
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


#: a calbin that is not there: each command line below ends at once (no server started, no
#: device opened) refusing it, after the parser took its flags
ABSENT = ["--calbin", "/nonexistent/probe62.calbin"]


@pytest.mark.parametrize(("argv", "said"), [
    (["serve", *ABSENT, "--host", "127.0.0.1", "--host", "0.0.0.0"],
     "--host given twice with different values ('127.0.0.1', then '0.0.0.0'): the last, "
     "'0.0.0.0', is taken"),
    (["serve", *ABSENT, "--port", "1", "--port=2"],
     "--port given twice with different values (1, then 2): the last, 2, is taken"),
    (["serve", *ABSENT, "--port", "8000", "--grace", "1", "--port", "8001", "--port", "8002"],
     "--port given 3 times with different values (8000, then 8001, then 8002): the last, "
     "8002, is taken"),
    (["golden", "record", *ABSENT, "--out", "a.json", "--out", "b.json"],
     "--out given twice with different values ('a.json', then 'b.json'): the last, 'b.json', "
     "is taken"),
    (["demo", *ABSENT, "--seqs", "1", "--seqs", "2"],
     "--seqs given twice with different values (1, then 2): the last, 2, is taken"),
], ids=["serve-host", "serve-port-equals", "serve-port-thrice",
        "golden-out", "demo-seqs"])
def test_a_single_value_flag_given_twice_with_different_values_is_named_and_the_last_taken(
        argv, said):
    """``serve --host 127.0.0.1 --host 0.0.0.0`` (an operator's wrapper script appending a
    flag the command line already had) bound 0.0.0.0 without a word. The last value is still
    taken, as argparse and vLLM's and uvicorn's command lines take it (a wrapper putting its
    defaults first relies on it), but every command (``cliargs.Parser``) now says so on
    stderr, one warning line naming the flag, the values and the one taken; the command goes
    on (here to its refusal of the absent calbin)."""
    code, out, err = _run(argv)
    assert code == cliargs.EXIT_CONFIG, err
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 2, err
    assert lines[0].endswith(said) and ": warning: " in lines[0], err
    assert "/nonexistent/probe62.calbin" in lines[1], err


def test_the_last_value_is_the_one_taken():
    p = cliargs.parser("probe", None)
    p.add_argument("--port", type=cliargs.port, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        args = p.parse_args(["--port", "1", "--host", "a\nb", "--port", "2", "--host", "c"])
    assert (args.port, args.host) == (2, "c")
    lines = err.getvalue().splitlines()
    assert lines == [
        "probe: warning: --port given twice with different values (1, then 2): the last, 2, "
        "is taken",
        "probe: warning: --host given twice with different values ('a\\nb', then 'c'): the "
        "last, 'c', is taken"]


def test_the_same_value_twice_and_a_collecting_flag_repeated_are_taken():
    """What a repetition cannot make ambiguous is taken without a word: the same value given
    twice, a switch given twice, a flag that collects (``action="append"``) given several
    times."""
    p = cliargs.parser("probe", None)
    p.add_argument("--port", type=cliargs.port, default=8000)
    p.add_argument("--once", action="store_true")
    p.add_argument("--only", action="append", default=[])
    with contextlib.redirect_stderr(io.StringIO()) as err:
        args = p.parse_args(["--port", "1", "--once", "--port", "1", "--once",
                             "--only", "a", "--only", "b"])
        assert (args.port, args.once, args.only) == (1, True, ["a", "b"])
        args = p.parse_args([])
    assert (args.port, args.once, args.only) == (8000, False, [])
    assert err.getvalue() == ""


def test_a_switch_and_its_opposite_given_together_are_named():
    """``--x`` and ``--no-x`` (one destination) given together: the last is taken, named."""
    p = cliargs.parser("probe", None)
    p.add_argument("--stream", dest="stream", action="store_true")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    with contextlib.redirect_stderr(io.StringIO()) as err:
        args = p.parse_args(["--stream", "--no-stream"])
    assert args.stream is False
    assert "--stream/--no-stream given twice with different values (True, then False): the " \
           "last, False, is taken" in err.getvalue()


# ---- a Host field whose value is no host ------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    try:
        with ServeLikeServer(create_app(executor, ServerConfig())) as live:
            yield live
    finally:
        executor.shutdown(5.0)


HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
COMPLETION = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()


def _completion(host: bytes, version: bytes = b"1.1") -> bytes:
    return (b"POST /v1/completions HTTP/" + version + b"\r\nhost: " + host
            + b"\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
            % len(COMPLETION) + COMPLETION)


@pytest.mark.parametrize("host", [
    b"a b", b"evil.example/path", b"user@evil.example", b"x?y", b"x#y", b'"x"', b"x\\y",
    b"<x>", b"x{y}", b"\xc3\xa9.example", b"a" * 100 + b" b",
], ids=["space", "slash", "userinfo", "query", "fragment", "quote", "backslash", "angle",
        "brace", "non-ascii", "long"])
def test_a_host_field_whose_value_is_no_host_is_a_400_naming_it(served, host):
    """RFC 9112 section 3.2: a server MUST answer 400 to a request whose Host field has an
    invalid value (as to none or several, refused since stop 53). ``Host: a b``, a path, a
    userinfo, a non-ASCII byte were served (the completion ran: 200). Now the OpenAI-shaped
    400 ``request.malformed_http`` naming the value (JSON-quoted, cut to 80 characters),
    after the answer to the request pipelined before it; nothing of it runs. The bytes taken
    are Go's net/http's (``httpguts.ValidHostHeader``)."""
    data, ended = send_raw(served.port, HEALTH + _completion(host))
    answers = responses(data)
    assert [a[0][:12] for a in answers] == [b"HTTP/1.1 200", b"HTTP/1.1 400"], data[:800]
    assert answers[1][1].get("x-request-id"), answers[1][1]
    error = json.loads(answers[1][2])["error"]
    assert error["code"] == "request.malformed_http", error
    shown = json.dumps(host.decode("latin-1"))
    assert f"Host {shown[:80]}" in error["message"] and "RFC 9112" in error["message"], error
    assert ended == "eof", ended


@pytest.mark.parametrize("host", [
    b"127.0.0.1", b"127.0.0.1:8000", b"localhost", b"[::1]:8000", b"[fe80::1%25eth0]",
    b"my-host.example_1", b"", b"x:", b"a!$&'()*+,;=~.example",
], ids=["v4", "v4-port", "name", "v6-port", "v6-zone", "name-dash-underscore", "empty",
        "empty-port", "sub-delims"])
def test_a_valid_host_is_still_served(served, host):
    """A host, with or without its port, an IPv6 literal, the empty value (RFC 9112 section
    3.2: a target without an authority) and RFC 3986's sub-delims are taken."""
    data, _ = send_raw(served.port, _completion(host).replace(
        b"content-type", b"connection: close\r\ncontent-type"))
    status, _, body = split_head(data)
    assert status.startswith(b"HTTP/1.1 200 "), data[:500]
    assert len(json.loads(body)["choices"][0]["token_ids"]) == 2


def test_an_http_1_0_request_with_a_host_that_is_no_host_is_a_400_too(served):
    """The rule is for any request with a Host field; an HTTP/1.0 request needs none."""
    data, _ = send_raw(served.port, _completion(b"a b", b"1.0"))
    status, _, body = split_head(data)
    assert status.startswith(b"HTTP/1.1 400 "), data[:500]
    assert json.loads(body)["error"]["code"] == "request.malformed_http"
