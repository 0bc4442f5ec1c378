"""Stop 55, the server's leftovers: each defect pinned here (docs/traceability.md "Found at
stop 55 (server)"). Real executor on the bundled emulator (and on a vendor-like build of it
without its emulator controls); every wait bounded."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import tracemalloc

import pytest

import calexec.drivers.calrt as calrt_pkg
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin
from calexec.drivers.tools.conform.experiment_rig import build_emulator_lib


@pytest.fixture(scope="module")
def vendor_lib(tmp_path_factory) -> str:
    """The bundled emulator built as a shared library that exports only the CalRT ABI (no
    ``calrt_emu_*`` controls): what ``--runtime-lib`` loads for a vendor shim (``has_emu``
    false: no host-side read of a calbin, no second device for a check)."""
    out = tmp_path_factory.mktemp("vendor")
    full = build_emulator_lib(str(out / "full"))
    names = subprocess.run(["nm", "-D", "--defined-only", full], capture_output=True,
                           text=True, check=True).stdout.split()
    abi = sorted(n for n in names if n.startswith("calrt_") and not n.startswith("calrt_emu_"))
    script = out / "vendor.map"
    script.write_text("{ global: " + " ".join(f"{n};" for n in abi) + " local: *; };\n")
    sources = [f"{calrt_pkg.__path__[0]}/{name}.c"
               for name in ("emulator", "emu_controls", "emu_engine")]
    lib = str(out / "libvendor.so")
    subprocess.run(["cc", "-std=c11", "-O2", "-pthread", "-fPIC", "-shared",
                    f"-Wl,--version-script={script}", "-o", lib, *sources], check=True)
    assert CalRT.load(lib).has_emu is False
    return lib


def serve(*argv: str, timeout: float = 150.0) -> subprocess.CompletedProcess[str]:
    code = f"import sys\nfrom calexec.cli import main\nsys.exit(main({list(argv)!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("content", [b"\x00garbage\xff" * 40, b"CALBIN\n"],
                         ids=["garbage", "short"])
def test_serve_on_a_vendor_runtime_names_a_calbin_its_loader_refuses(vendor_lib, tmp_path,
                                                                    content):
    """``calexec serve --runtime-lib VENDOR --calbin FILE`` with a file that is no calbin: the
    pre-start check cannot run a vendor runtime's loader (a second device is hardware), so
    the start's own refusal was printed raw: ``executor failed to start:
    calrt.configure_failed [artifact/configure] CalRT configure returned 12 (FILE_FORMAT):
    calbin load '...'``. Now the start's refusal of the file is said as the bundled
    emulator's is: the flag, the path, the loader's reason, exit 3 (docs/server.md)."""
    path = tmp_path / "model.calbin"
    path.write_bytes(content)
    done = serve("serve", "--once", "--runtime-lib", vendor_lib, "--reset-kind", "none",
                 "--calbin", str(path))
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    assert lines[-1] == (f"calexec serve: --calbin={str(path)!r}: not a valid calbin "
                         "(calbin.invalid): not a calbin the runtime loads: the loader "
                         "refused it (ERR_FILE_FORMAT); the executor did not start"), lines[-1]
    assert not any("configure returned" in line for line in lines), done.stderr


#: ``calexec serve`` with ``open`` counting the bytes Python reads from one file
COUNTING = r'''
import builtins, io, os, sys
from calexec.cli import main
path, argv = sys.argv[1], sys.argv[2:]
read = [0]
real_open = builtins.open
class Counting(io.RawIOBase):
    def __init__(self, raw): self.raw = raw
    def readable(self): return True
    def readinto(self, b):
        n = self.raw.readinto(b); read[0] += n or 0; return n
    def fileno(self): return self.raw.fileno()
    def close(self): self.raw.close(); super().close()
def named(file):  # the driver reads the file it holds open as /proc/self/fd/N (stop 71)
    return (isinstance(file, str) and file.startswith("/proc/self/fd/")
            and os.path.realpath(file) == path) or file == path
def counting_open(file, mode="r", *a, **k):
    if named(file) and mode == "rb":
        return io.BufferedReader(Counting(io.FileIO(file, "rb")))
    return real_open(file, mode, *a, **k)
builtins.open = counting_open
rc = main(argv)
print("READ", read[0], file=sys.stderr)
sys.exit(rc)
'''


def padded_calbin(tmp_path, copies: int = 100_000) -> tuple[str, str]:
    """A valid synthetic calbin made large (its ``seed`` line repeated: the emulator's
    loader takes it, as many times as it comes) and its sha256."""
    lines = calbin.dumps(calbin.default_spec()).decode().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith("seed "))
    data = "".join(lines[:at + 1] + [lines[at]] * copies + lines[at + 1:]).encode()
    path = tmp_path / "big.calbin"
    path.write_bytes(data)
    return str(path), hashlib.sha256(data).hexdigest()


def test_serve_with_a_pinned_calbin_reads_it_whole_once(tmp_path):
    """``calexec serve --calbin`` under a manifest pinning the calbin's sha256: the
    pre-start check hashed the file (read whole), ran the runtime's loader on a scratch
    device whose driver hashed it again (read whole, held whole in memory), then the start
    hashed it a third time: for a multi-GB calbin, three reads and the whole file in
    memory before serving. Now the check reads the file's first bytes (and the emulator's
    loader its directives), no hash: the start hashes it once, in chunks, as it loads it
    (and refuses a pin mismatch itself). Python reads it whole once."""
    from calexec.contracts.manifest import default_manifest_path

    path, sha = padded_calbin(tmp_path)
    size = len(open(path, "rb").read())
    text = default_manifest_path().read_text()
    assert '# calbin_sha256 = "' in text
    manifest = tmp_path / "pinned.toml"
    manifest.write_text(text.replace('# calbin_sha256 = "', f'calbin_sha256 = "{sha}" # "', 1))
    done = subprocess.run([sys.executable, "-c", COUNTING, path, "serve", "--once",
                           "--manifest", str(manifest), "--calbin", path,
                           "--allow-unpinned-golden"], capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    read = int(done.stderr.rsplit("READ ", 1)[1].split()[0])
    assert size <= read <= size + 64 * 1024, (read, size)


def test_loading_a_calbin_never_holds_it_whole_in_memory(tmp_path):
    """``Device.load_calbin`` hashed the file with ``hashlib.sha256(f.read())``: the whole
    calbin as one Python bytes object, beside the runtime's own copy (a 4 GB calbin, 4 GB
    more at every start and reload). Now it is hashed in chunks; the sha256 is the same."""
    path, sha = padded_calbin(tmp_path)
    size = len(open(path, "rb").read())
    rc, device = CalRT.load().open_device("")
    assert rc == 0 and device is not None
    try:
        tracemalloc.start()
        try:
            rc, loaded = device.load_calbin(path)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert rc == 0 and loaded is not None
        assert loaded.sha256 == sha
        assert peak < size // 2, (peak, size)
        assert loaded.unload() == 0
    finally:
        device.close()


TOKEN = "probe55-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_a_reload_sent_while_the_server_drains_is_refused_before_its_body(tmp_path):
    """While a drain waits for a stream, ``POST /admin/reload`` with ``Expect: 100-continue``
    got ``100 Continue`` (uvicorn sends it when the route reads the body) and then the 503:
    the client uploaded its body to be refused (one waiting for the 100 before sending hung
    until it gave up). Now the draining 503 (``reload refused, lifecycle unchanged: server
    is draining``, ``param: calbin``, ``Retry-After``, ``Connection: close``) is answered
    before the body is read, as the OpenAI endpoints do; a reload without the expectation
    (its body on its way) is read and refused as before; nothing moves."""
    from test_server_support import draining_with_a_stream, sent_with_and_without_expect, split_head

    with draining_with_a_stream(tmp_path, TOKEN) as (server, executor, _):
        generation = executor.gen.id
        payload = json.dumps({"calbin": executor.gen.calbin_path}).encode()
        head = (b"POST /admin/reload HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                + f"authorization: Bearer {TOKEN}\r\n".encode()
                + b"content-type: application/json\r\n")
        for data, ended in sent_with_and_without_expect(server.port, head, payload):
            assert b"100 Continue" not in data, data[:300]
            status, headers, body = split_head(data)
            assert status.startswith(b"HTTP/1.1 503 "), data[:300]
            assert headers.get("connection") == "close" and "retry-after" in headers, headers
            error = json.loads(body)["error"]
            assert error["message"] == ("reload refused, lifecycle unchanged: server is "
                                        "draining"), error
            assert error["param"] == "calbin", error
            assert ended == "eof", ended
        assert executor.gen.id == generation and executor.state == "Ready"


def test_a_draining_fleet_ingress_reads_the_body_it_refuses_so_the_client_gets_the_503():
    """The fleet ingress's own draining 503 ("fleet is draining") was sent without reading
    the request's body: with a body still arriving (here 900 kB, under ``max_body_bytes``,
    on a request that closes the connection), the close found it unread in the socket and
    reset the connection (every time here: the client, still sending or reading, gets
    ECONNRESET, the 503 lost if it had not read it yet). Now the body is read first
    (bounded, as the server reads a refused body): the 503 then an orderly close. A request
    that expects ``100-continue`` is answered before its body (no ``100 Continue``),
    ``Connection: close``."""
    from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress
    from test_fleet_ingress import Replica, Router
    from test_server_support import LiveServer, read_until_closed, split_head

    replica = Replica("r1")
    app = FleetIngress(Router(replica), FailoverSettings(backoff_s=0.001))
    app.draining = True
    body = json.dumps({"prompt": "x" * 900_000, "max_tokens": 1}).encode()
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
    with LiveServer(app) as server:
        for attempt in range(5):
            with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
                sock.sendall(head + b"connection: close\r\n\r\n" + body)
                data, ended = read_until_closed(sock)
            status, headers, payload = split_head(data)
            assert status.startswith(b"HTTP/1.1 503 "), (attempt, data[:300])
            assert "retry-after" in headers, headers
            assert json.loads(payload)["error"]["message"] == "fleet is draining", payload
            assert ended == "eof", (attempt, ended)
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            sock.sendall(head + b"expect: 100-continue\r\n\r\n")  # (no body before the 100)
            data, ended = read_until_closed(sock)
        assert b"100 Continue" not in data, data[:300]
        status, headers, _ = split_head(data)
        assert status.startswith(b"HTTP/1.1 503 ") and headers.get("connection") == "close", data
        assert ended == "eof", ended
    assert replica.requests == []  # nothing reached a replica


def test_the_fleet_ingress_closes_the_connection_of_a_body_it_timed_out():
    """The fleet ingress answers a body that does not arrive whole within ``body_timeout_s``
    408, as the server does; but without ``Connection: close``: the connection stayed
    open, uvicorn reading the rest as the same request's body for as long as the client
    trickled it (here a byte every second for 8 s: never closed), so the timeout bounded
    nothing. The 408 (and the 413 of a body too large) now close it, as the server's:
    closed while the trickle goes on (judged by the connection's end, not by a duration)."""
    from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress
    from test_fleet_ingress import Replica, Router
    from test_server_support import LiveServer

    replica = Replica("r1")
    app = FleetIngress(Router(replica), FailoverSettings(backoff_s=0.001, body_timeout_s=1.0))
    with LiveServer(app) as server, \
            socket.create_connection(("127.0.0.1", server.port), timeout=1) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                     b"content-type: application/json\r\ncontent-length: 100\r\n\r\n")
        got, ended = b"", None
        for _ in range(8):  # a byte a second, never the whole body
            try:
                sock.sendall(b" ")
                chunk = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except OSError as err:
                ended = type(err).__name__
                break
            if not chunk:
                ended = "eof"
                break
            got += chunk
    assert got.startswith(b"HTTP/1.1 408 "), got[:300]
    assert b"\r\nconnection: close\r\n" in got.lower(), got[:300]
    assert ended in ("eof", "ConnectionResetError", "BrokenPipeError"), ended  # not still open
    assert replica.requests == []


def test_the_reload_check_of_a_large_file_that_is_no_calbin_reads_none_of_it_whole(tmp_path):
    """``POST /admin/reload`` runs ``check_calbin``, whose emulator loader check went through
    the driver's ``load_calbin``, which hashed the file with ``f.read()`` before the runtime
    even looked at it: a 64 MB file that is no calbin (up to ``max_calbin_bytes``, 16 GiB) was
    read whole into the server's memory to be refused. Now the driver hashes only a file the
    runtime loaded, and the check's scratch load not at all: refused at its first line."""
    path = tmp_path / "big.bin"
    with open(path, "wb") as f:  # (sparse: no disk)
        f.truncate(64 << 20)
    runtime = CalRT.load()
    tracemalloc.start()
    try:
        why = runtime.inspect_calbin(str(path))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert isinstance(why, str) and "ERR_FILE_FORMAT" in why, why
    assert peak < 4 << 20, peak


#: a ``calexec serve`` run in which ``import ray`` fails (nothing Ray starts, whatever runs)
NO_RAY = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "ray":
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, _Block())
from calexec.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("count", ["0", "-2"])
def test_serve_ray_with_no_replica_is_refused_before_ray_starts(count):
    """``calexec serve --ray --replicas 0`` was checked as ``(args.replicas or 1) < 1``: 0
    became 1, so the command started a local Ray cluster (a minute on a loaded machine) and
    deployed one replica instead of refusing the flag. ``--replicas`` is now a positive
    integer at parse time, as ``--max-sequences``: exit 2 naming it, nothing started."""
    done = subprocess.run([sys.executable, "-c", NO_RAY, "serve", "--ray", "--replicas", count,
                           "--port", "0"], capture_output=True, text=True, timeout=60)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert lines == [f"calexec serve: error: argument --replicas: must be >= 1, got {count} "
                     "(see calexec serve --help)"], done.stderr


def test_the_fleet_ingress_relays_a_timeout_past_the_float_range():
    """The ingress reads a request's ``timeout`` from its body (``request_timeout``) before
    relaying it; an integer past the float range (``"timeout": 1000...0``, 401 digits: JSON
    has no bound, Python parses it as an int) raised OverflowError from ``math.isfinite``
    out of the ingress (a plain 500 from the proxy, nothing relayed). Now it takes the
    default deadline and relays the body, whose replica refuses it 400 naming ``timeout``,
    as the single server does."""
    from calexec.drivers.fleet.ingress import request_timeout
    from test_fleet_ingress import relay_one_body

    body = b'{"prompt": [1], "max_tokens": 1, "timeout": 1' + b"0" * 400 + b"}"
    assert request_timeout(body, 30.0) == 30.0
    replica, sent = relay_one_body(body)
    assert len(replica.requests) == 1 and replica.requests[0]["body"] == body
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200]


def test_serve_names_a_calbin_its_manifest_pin_refuses_in_one_line(tmp_path):
    """With the pin no longer hashed by the pre-start check (above), the sha256 mismatch is
    the start's (``manifest.sha256_mismatch`` from ``Manifest.resolve``): still said as the
    check said it, naming the flag, the path and both hashes, exit 3."""
    from calexec.contracts.manifest import default_manifest_path

    path, sha = padded_calbin(tmp_path, copies=1)
    text = default_manifest_path().read_text()
    manifest = tmp_path / "pinned.toml"
    manifest.write_text(text.replace('# calbin_sha256 = "', f'calbin_sha256 = "{"0" * 64}" # "',
                                     1))
    done = serve("serve", "--once", "--manifest", str(manifest), "--calbin", path)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert lines[-1].startswith(f"calexec serve: --calbin={path!r}: not a valid calbin "
                                "(calbin.manifest_mismatch): manifest.sha256_mismatch: "
                                f"calbin_sha256={sha} but "), lines[-1]
    assert lines[-1].endswith(f"pins {'0' * 64}; the executor did not start"), lines[-1]


def test_serve_ray_names_a_calbin_no_replica_could_load_before_ray_starts(tmp_path):
    """``calexec serve --ray --calbin FILE`` with a file that is not a calbin started a local
    Ray (a minute or more) and failed only as its replicas deployed; it now runs the check
    ``serve`` runs without ``--ray`` first (Ray blocked here: the refusal must come before
    any import of it): one line naming the flag, exit 3."""
    garbage = tmp_path / "garbage.calbin"
    garbage.write_text("not a calbin\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a local Ray's case
    done = subprocess.run([sys.executable, "-c", NO_RAY, "serve", "--ray", "--calbin",
                           str(garbage), "--port", "0"], capture_output=True, text=True,
                          timeout=60, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 3, (done.returncode, done.stderr)
    assert len(lines) == 1 and lines[0].startswith(
        f"calexec serve: --calbin={str(garbage)!r}: not a valid calbin (calbin.invalid)"), lines
    assert "Ray" in lines[0] and "ray" not in done.stdout.lower()
