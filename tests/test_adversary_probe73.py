"""Adversarial admin input and model switches found by probing a loopback ``calexec serve``
at stop 73 (branch probe-adversary). Real executor on the bundled emulator; loopback only;
every wait bounded."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import httpx
import pytest

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from test_server_support import LiveServer, started_executor

TOKEN = "adversary-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

#: a synthetic calbin's line, and the same line with a byte that is no UTF-8 in its name: the
#: emulator's loader takes any byte but a space or a line end in these names (a CSR's or a
#: tensor's must be one it knows)
NOT_UTF8 = {"meta_key": (b"meta hidden 64", b"meta hidd\x94n 64"),
            "model_name": (b"model qwen3_prefill_ids_s40960_b1",
                           b"model qwen3_prefill_ids_s40960_b\x94")}


def _not_utf8_calbin(tmp: Path, where: str) -> str:
    """The default synthetic calbin (written into ``tmp`` by ``started_executor``) with one
    name (``where``: a key of ``NOT_UTF8``) holding the byte 0x94: its path."""
    good = (tmp / "synthetic.calbin").read_bytes()
    line, bad = NOT_UTF8[where]
    assert line in good, where
    path = tmp / f"{where}.calbin"
    path.write_bytes(good.replace(line, bad, 1))
    return str(path)


@pytest.mark.parametrize("where", sorted(NOT_UTF8))
def test_a_reload_of_a_calbin_whose_name_is_no_utf8_is_a_400_naming_it(tmp_path, where):
    """A calbin the runtime's loader takes whose model or meta name holds a byte
    that is no UTF-8 (one flipped byte of a file): ``POST /admin/reload`` answered 500
    ``server.unexpected_error`` (a ``UnicodeDecodeError`` of the runtime driver's read of the
    names, in the check that promises never to raise) and the server logged a traceback. It
    is the 400 ``calbin.invalid`` of a file that is no calbin, naming the name; nothing moved,
    the model serves on."""
    executor = started_executor(tmp_path)
    bad = _not_utf8_calbin(tmp_path, where)
    generation = executor.gen.id if executor.gen is not None else None
    try:
        with LiveServer(create_app(executor, ServerConfig(admin_token=TOKEN))) as server, \
                httpx.Client(base_url=server.url, timeout=30) as http:
            reload = http.post("/admin/reload", json={"calbin": bad}, headers=AUTH)
            answer = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    finally:
        executor.shutdown(5.0)
    assert reload.status_code == 400, reload.text
    error = reload.json()["error"]
    assert error["code"] == "calbin.invalid" and error["param"] == "calbin", error
    assert "not UTF-8" in error["message"] and json.dumps(bad) in error["message"], error
    assert answer.status_code == 200, answer.text
    assert executor.gen is None or generation is not None  # (read before the shutdown)


@pytest.mark.parametrize("where", sorted(NOT_UTF8))
def test_a_switch_to_a_calbin_whose_name_is_no_utf8_rolls_back(tmp_path, where):
    """``DeviceExecutor.switch_model`` of such a file (an embedder's call, or a file replaced
    after the reload's check): the ``UnicodeDecodeError`` came out of the switch, which had
    torn the old generation down, and the lifecycle stayed in Configuring for good (every
    request 503, every later switch "cannot recover from lifecycle Configuring"). The switch
    now fails as for any calbin the runtime refuses: rolled back, the previous calbin
    serves."""
    executor = started_executor(tmp_path)
    good = str(tmp_path / "synthetic.calbin")
    try:
        status = executor.switch_model(_not_utf8_calbin(tmp_path, where))
        state, reasons = executor.state, executor.health()
        again = executor.switch_model(good)
    finally:
        executor.shutdown(5.0)
    assert not status.ok and status.code == "recovery.rolled_back", status
    assert "not UTF-8" in status.message, status
    assert state == "Ready" and reasons == [], (state, reasons)
    assert again.ok, again


def test_a_start_on_a_calbin_whose_name_is_no_utf8_fails_and_says_why(tmp_path):
    """``DeviceExecutor.start`` of such a file raised the ``UnicodeDecodeError`` (with the
    calbin loaded and the lifecycle in Configuring); it ends Failed with a status naming the
    name, as a start on a calbin the loader refuses."""
    started_executor(tmp_path).shutdown(5.0)  # (writes the synthetic calbin into tmp_path)
    bad = _not_utf8_calbin(tmp_path, "meta_key")
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(calbin_path=bad))
    try:
        status = executor.start()
    finally:
        executor.shutdown(5.0)
    assert not status.ok and "not UTF-8" in status.message, status
    assert executor.state in ("Failed", "Stopped"), executor.state


def test_the_500_of_an_unexpected_error_says_the_connection_closes(tmp_path, monkeypatch):
    """After a 500 ``server.unexpected_error`` the server closes the connection (uvicorn
    closes it once the exception Starlette re-raises reaches it), but the 500 did not say so:
    a client keeping the connection alive (httpx, the openai SDKs, curl with several URLs)
    sent its next request on it and got ``ECONNRESET`` (an unexpected reload error, then a
    completion, on one ``httpx.Client``). The 500 now says ``Connection: close``, so no
    client reuses the connection it ends."""
    from calexec.drivers.serving import openai_api
    from test_server_support import ServeLikeServer, responses, send_raw

    def broken(model, raw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_api, "parse", broken)
    executor = started_executor(tmp_path)
    try:
        with ServeLikeServer(create_app(executor, ServerConfig())) as server:
            port = int(server.url.rsplit(":", 1)[1])
            body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
            # (on a connection of its own: the server closes it after the 500)
            raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                   b"application/json\r\nContent-Length: " + str(len(body)).encode()
                   + b"\r\n\r\n" + body)
            data, how = send_raw(port, raw)
            with httpx.Client(base_url=server.url, timeout=30) as http:
                first = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                after = http.get("/health")  # (a new connection, as the 500 said)
    finally:
        executor.shutdown(5.0)
    (_, headers, _), = responses(data)
    assert headers.get("connection") == "close", (headers, how)
    assert first.status_code == 500 and first.headers.get("connection") == "close", \
        first.headers
    assert first.json()["error"]["code"] == "server.unexpected_error", first.text
    assert after.status_code == 200, after.text


#: a synthetic calbin's line, and the same line with bytes after its last field: the
#: emulator's loader read the fields and dropped the rest, so a corrupted line loaded as
#: another value (a seed, a meta value: another model) or lost the line it ran into
TRAILING = {"seed": (b"seed 12648430\n", b"seed 1264843\x97\n"),
            "meta_value": (b"meta vocab 151936\nmeta hidden 64\n",
                           b"meta vocab 151936&meta hidden 64\n"),
            "meta_junk": (b"meta max_batch 1\n", b"meta max_batch 1 2\n"),
            "model_kind": (b"prefill_ids\n", b"prefill_ids x\n"),
            "csr": (b"csr cur_seq_len\n", b"csr cur_seq_len x\n"),
            "tensor": (b"input positions S32 1 1,40960\n", b"input positions S32 1 1,40960 x\n"),
            "end": (b"end\n", b"end x\n"),
            # (not trailing bytes: numbers %llu / %lld / %d read as no number they are)
            "seed_sign": (b"seed 12648430\n", b"seed -12648430\n"),
            "seed_past_u64": (b"seed 12648430\n", b"seed 184467440737095516160\n"),
            "salt_plus": (b"salt 405743004425239057\n", b"salt +405743004425239057\n"),
            "meta_past_i64": (b"meta max_batch 1\n", b"meta max_batch 99999999999999999999\n"),
            "meta_key_cut": (b"meta max_batch 1\n", b"meta " + b"k" * 63 + b"5\n"),
            "sliceable": (b"output logits BF16 0 1,16,151936\n",
                          b"output logits BF16 4294967296 1,16,151936\n")}


@pytest.mark.parametrize("where", sorted(TRAILING))
def test_a_calbin_line_with_bytes_after_its_fields_is_refused(tmp_path, where):
    """One corrupted byte that ends a number early (``seed 1264843\\x97``: the seed 1264843,
    another model's weights) or joins two lines (``meta vocab 151936&meta hidden 64``: no
    ``hidden``) passed the reload's check (``check_calbin`` ok) and the loader; a line whose
    fields are followed by anything but white space is now refused, ``calbin.invalid``, as
    a line the loader cannot read; so is a tensor's sliceable flag other than ``0`` or ``1``
    (``4294967296``, read as an int, overflowed and loaded as 0), a number with a sign the
    field does not take or past its type (``seed -12648430`` loaded as 2**64 - 12648430;
    ``%llu`` / ``%lld`` past the type are undefined behaviour), and a meta key cut at 63
    characters whose next character is a digit (``meta kkk...k5``: the key's first 63
    characters, value 5)."""
    executor = started_executor(tmp_path)
    good = (tmp_path / "synthetic.calbin").read_bytes()
    line, bad = TRAILING[where]
    assert line in good, where
    path = tmp_path / f"{where}.calbin"
    path.write_bytes(good.replace(line, bad, 1))
    try:
        status = executor.check_calbin(str(path))
        fine = executor.check_calbin(str(tmp_path / "synthetic.calbin"))
    finally:
        executor.shutdown(5.0)
    assert not status.ok and status.code == "calbin.invalid", status
    assert fine.ok, fine


@pytest.mark.parametrize("where", sorted(TRAILING))
def test_the_python_calbin_reader_refuses_what_the_loader_refuses(tmp_path, where):
    """``drivers/synthetic/calbin.loads`` (one format, one grammar with the C loader) read a
    line's first fields and dropped the rest too: it refuses such a line, naming it."""
    from calexec.drivers.synthetic import calbin

    good = calbin.dumps(calbin.default_spec())
    line, bad = TRAILING[where]
    assert calbin.loads(good) == calbin.default_spec()
    with pytest.raises(ValueError, match="calbin line"):
        calbin.loads(good.replace(line, bad, 1))



def test_a_reload_whose_body_a_drain_cut_names_calbin(tmp_path):
    """A reload whose body's read a drain cut (every body read once the drain stopped
    waiting for requests is cut at once; here the body is not sent before the answer, so the
    read waits for it): answered ``server is draining`` (or, cut while the drain was ending,
    ``server drained: ... before the request's body arrived whole; retry``: stop 64's words,
    kept) with ``param: null``, where docs/server.md gives a reload refused while draining
    ``param: calbin``, as a reload whose body was read first is told."""
    from test_server_support import read_until_closed, responses, wait_for

    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=TOKEN))
    service = app.state.service
    body = json.dumps({"calbin": str(tmp_path / "synthetic.calbin")}).encode()
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            drain = http.post("/admin/drain?grace=0", headers=AUTH)
            wait_for(lambda: service.drain_status is not None, what="the drain's end")
            port = int(server.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"POST /admin/reload HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                             + TOKEN.encode() + b"\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
                data, _ = read_until_closed(sock)  # (the body is never sent)
    finally:
        executor.shutdown(5.0)
    assert drain.status_code == 202, drain.text
    (status, headers, raw), = responses(data)
    assert status.startswith(b"HTTP/1.1 503") and headers.get("retry-after"), (status, headers)
    error = json.loads(raw)["error"]
    assert error["param"] == "calbin", error
    assert error["code"] == "lifecycle.unavailable", error
    assert error["message"] == "server is draining", error


#: TOML nested past Python's recursion limit: ``tomllib`` raises RecursionError on it
DEEP_TOML = b"format = 1\nx = " + b"[" * 100_000 + b"]" * 100_000 + b"\n"


def test_a_goldens_file_nested_past_the_parser_is_golden_file_invalid(tmp_path):
    """The goldens file is read again at each reload; one nested past the TOML parser's
    recursion (``x = [[[[...]]]]``) made ``switch_model`` raise ``RecursionError`` (the
    reload a 500 ``server.unexpected_error`` with a traceback) where a goldens file that no
    longer loads is ``golden.file_invalid`` naming it, nothing switched (docs/server.md)."""
    import shutil

    from calexec.contracts.goldens import goldens_path

    manifest = tmp_path / "m.toml"
    shutil.copyfile(default_manifest_path(), manifest)
    goldens = goldens_path(manifest)
    shutil.copyfile(goldens_path(default_manifest_path()), goldens)
    started_executor(tmp_path).shutdown(5.0)  # (writes the synthetic calbin into tmp_path)
    path = str(tmp_path / "synthetic.calbin")
    executor = DeviceExecutor(CalRT.load(), load_manifest(str(manifest)),
                              ExecutorConfig(calbin_path=path))
    try:
        assert executor.start().ok
        goldens.write_bytes(DEEP_TOML)
        status = executor.switch_model(path)
        state = executor.state
    finally:
        executor.shutdown(5.0)
    assert not status.ok and status.code == "golden.file_invalid", status
    assert "nested deeper" in status.message and str(goldens) in status.message, status
    assert state == "Ready", state


def test_a_manifest_nested_past_the_parser_is_a_manifest_error(tmp_path):
    """``load_manifest`` (``calexec serve --manifest M``) of such a file raised the
    ``RecursionError``; it is the ``ManifestError`` of a file that is not valid TOML."""
    from calexec.contracts.manifest import ManifestError

    manifest = tmp_path / "m.toml"
    manifest.write_bytes(DEEP_TOML)
    with pytest.raises(ManifestError, match="nested deeper"):
        load_manifest(str(manifest))
