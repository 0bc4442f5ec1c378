"""``calexec serve``: the reference HTTP server on the bundled emulator (or a vendor shim).

``--once`` is the smoke run (README's run command): serve on an ephemeral loopback port, send
one sample completion over the socket, print it as a curl command with the JSON response,
drain and exit.

Exit codes: 0 after a clean drain (SIGTERM/SIGINT, ``POST /admin/drain``, or the end of
``--once``); 2 for bad arguments or configuration (one line naming the flag); 3 when the
executor failed to start, when a second signal forced the exit while requests still ran
(they were cut), or when its lifecycle ended ``Failed`` (work did not drain within
``--grace``, or a device fault needed a reset that ``--reset-kind`` / ``--conform-report`` did
not allow: with an external ``--runtime-lib`` and neither, the reset kind is ``none``, spec
§9.1), so a supervisor restarts the process; 4 when the ``--once`` sample request did not
return a completion.

``--ray --replicas N`` serves the same app from N Ray Serve replicas, one device each
(drivers/fleet/ray_serve.py, docs/deployment.md): it joins the cluster in ``$RAY_ADDRESS`` or
starts a local one (on loopback only for a loopback ``--host``), serves until SIGTERM/SIGINT
(or, with ``--once``, one sample completion), then drains the fleet at its ingress within
``--grace``, shuts Serve and Ray down, waits for the local cluster's processes and exits 0; 3
when the deployment did not start or requests were still running after ``--grace``. The
library never exits the process; this module's ``main`` returns the code to the console
script.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO, cast

import attrs

from calexec import cliargs
from calexec.contracts.status import Status
from calexec.drivers.device_spec import DeviceSpec, with_emulated_latency, within_request_timeout
from calexec.drivers.memory import pin_mmap_threshold
from calexec.drivers.serving import byte_tokenizer, hf_tokenizer
from calexec.drivers.serving.dumpsink import DumpConfigError, DumpSink
from calexec.drivers.serving.executor_view import served
from calexec.drivers.serving.process import (
    MAX_SWITCH_INTERVAL_US,
    SERVING_SWITCH_INTERVAL_US,
    raise_open_file_limit,
    set_gil_switch_interval_us,
)
from calexec.drivers.serving.server import (
    DrainingServer,
    ServerConfig,
    create_app,
    listening_url,
    uvicorn_config,
)
from calexec.drivers.serving.service import (
    DEFAULT_MAX_CHOICES,
    MAX_CHOICES,
    api_key_problem,
    cors_origin_problem,
    model_name_problem,
    sequence_ids_problem,
    shown_name,
)
from calexec.drivers.serving.wire import cut_ids
from calexec.machines import switch_check
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

EXIT_OK, EXIT_USAGE, EXIT_FAILED, EXIT_SAMPLE_FAILED = 0, 2, 3, 4

#: ServerConfig's defaults the flags show (and ``--timeout`` is checked against at startup)
_SERVER_DEFAULTS = attrs.fields(ServerConfig)
# (attrs types a field's default as optional; these three have one)
MAX_TIMEOUT_S = cast(float, _SERVER_DEFAULTS.max_timeout_s.default)
DEFAULT_MODEL_NAME = cast(str, _SERVER_DEFAULTS.model_name.default)
DEFAULT_END_TOKEN = cast(int, _SERVER_DEFAULTS.end_token_id.default)

#: the ``--once`` sample request body
SAMPLE_REQUEST: dict[str, Any] = {"prompt": "Hello, Calculet!", "max_tokens": 8}


def parser() -> argparse.ArgumentParser:
    """``calexec serve``'s parser (public: a test reads the flags as the command does)."""
    p = cliargs.parser("calexec serve", __doc__)
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=cliargs.port, help="TCP port (default 8000; with --once an "
                                                      "ephemeral port)")
    cliargs.add_device_args(p, reset=True)
    p.add_argument("--allow-unpinned-golden", action="store_true",
                   help="start (and /admin/reload) a calbin with no golden pinned by `calexec "
                        "golden record` (its first warm-up is trusted; logged at WARNING)")
    p.add_argument("--device-config", default="", help="device config string, e.g. "
                   "'kv_blocks=64;decode_us=10000' (emulator keys: docs/emulator.md; a key the "
                   "runtime refuses is named)")
    p.add_argument("--served-model-name", default=DEFAULT_MODEL_NAME, metavar="NAME",
                   help="the model name the API reports (requests may also name the "
                        "manifest's model; any other `model` is a 404)")
    p.add_argument("--tokenizer", metavar="PATH", type=cliargs.nonempty,
                   help="a Hugging Face tokenizer.json (or its directory; "
                        "tokenizer_config.json next to it gives the chat template and "
                        "eos_token) loaded with the `tokenizers` library (pip install "
                        "'calexec[tokenizer]'); default: the byte-level tokenizer of the "
                        "synthetic model")
    p.add_argument("--api-key", metavar="KEY",  # None: $CALEXEC_API_KEY (main)
                   help="OpenAI endpoints (/v1/*, /tokenize, /detokenize, /tokenizer_info) "
                        "need 'Authorization: Bearer KEY' (default: $CALEXEC_API_KEY; unset: "
                        "open); /health, /ready, /ping, /version, /metrics and /debug/* stay "
                        "open (/admin/* and /debug/jobs/{id} take --admin-token-file's token)")
    p.secret("--api-key")  # (never echoed: the parser's warnings and hints show no key)
    p.add_argument("--cors-origin", metavar="ORIGIN", action="append", default=[],
                   help="allow browser pages of this origin (scheme://host[:port], or '*') to "
                        "call the server: CORS preflights answered, responses marked; "
                        "repeatable (default: CORS off)")
    p.add_argument("--admin-token-file", type=cliargs.nonempty_path, help="file holding the admin bearer "
                   "token; without it the admin endpoints are disabled")
    p.add_argument("--grace", type=cliargs.seconds, default=30.0,
                   help="drain grace in seconds")
    p.add_argument("--max-sequences", type=cliargs.positive_int, default=32,
                   help="KV sequence ids to lease")
    p.add_argument("--max-waiting", type=cliargs.non_negative_int, default=1024,
                   help="requests that may wait within their deadline for a sequence id or for "
                        "Ready during a recovery (0: refuse at once with 429/503)")
    p.add_argument("--max-choices", type=cliargs.int_in(1, MAX_CHOICES),
                   default=DEFAULT_MAX_CHOICES,
                   help="choices one request may ask for: prompts x n (above it: 400 naming "
                        f"n or prompt), 1..{MAX_CHOICES}; at most half the sequence ids run "
                        "at once")
    p.add_argument("--max-body-bytes", type=cliargs.positive_int, default=1 << 20,
                   help="largest request body (above it: 413); raise it for batches of long "
                        "prompts (lm-eval's windows: 4 prompts of 40,000 token ids are "
                        "~1.3 MB)")
    p.add_argument("--metrics-names", choices=("calexec", "vllm"), default="calexec",
                   help="vllm: /metrics also exports vLLM's vllm: families (names, types and "
                        "labels as vLLM's server; docs/server.md)")
    p.add_argument("--max-resumes", type=cliargs.non_negative_int, default=3,
                   help="resumes of one request after device-side/retryable failures "
                        "(docs/server.md; 0: the request fails as the fault did)")
    p.add_argument("--timeout", type=cliargs.seconds, default=30.0,
                   help="default request deadline in seconds (at most the server's "
                        f"max_timeout_s, {MAX_TIMEOUT_S:g}); a job on the device longer than a "
                        "third of it (at least 5 s) is taken for a hung device")
    p.add_argument("--dump-dir", type=cliargs.output_path, help="enable the dump sink in this directory")
    p.add_argument("--dump-max-bytes", type=cliargs.positive_int, default=16 << 20,
                   help="dump size cap in bytes")
    p.add_argument("--dump-prompts", action="store_true",
                   help="also dump prompt and completion content (off by default)")
    # (taken and ignored without --dump-dir: the operator believed prompts were dumped, or
    # capped, and nothing was written)
    for flag, what in (("--dump-prompts", "dumps nothing"),
                       ("--dump-max-bytes", "caps nothing")):
        p.only_with(flag, lambda args: args.dump_dir is not None,
                    f"{what} without --dump-dir, which enables the dump (give --dump-dir DIR, "
                    f"or leave {flag} out)")
    p.add_argument("--gil-switch-us", type=cliargs.int_in(0, MAX_SWITCH_INTERVAL_US),
                   default=SERVING_SWITCH_INTERVAL_US,
                   help="GIL switch interval in microseconds, at most "
                        f"{MAX_SWITCH_INTERVAL_US} (0 keeps Python's 5000): shorter hand-offs "
                        "between the executor's threads, see drivers/serving/process.py")
    p.add_argument("--native-relay", action="store_true",
                   help="the executor's submitter waits in the native relay and infers the "
                        "steps fired for it from C (ExecutorConfig.native_relay; off by "
                        "default: docs/architecture.md \"Native hand-offs\")")
    cliargs.add_inflight_capacity(p)
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   help="log level (default info; with --once warning)")
    p.add_argument("--ray", action="store_true",
                   help="serve through Ray Serve, one replica per device (needs calexec[ray])")
    p.add_argument("--replicas", type=cliargs.positive_int,
                   help="with --ray: number of replicas/devices (default 1)")
    p.add_argument("--once", action="store_true",
                   help="smoke run: serve, send one sample completion over loopback, print it "
                        "as a curl command with the JSON response, drain and exit")
    return p


def host_problem(host: str) -> str | None:
    """Why ``--host`` is written as no bind address is (``--host=...: ...``), or None: a URL's
    spelling of it (``[::1]``, ``127.0.0.1:8000``, ``http://...``) was refused as a name "this
    machine does not resolve", with no word of what to write instead."""
    shown = f"--host={host!r}"
    if "://" in host:
        return f"{shown}: give the address alone, not a URL (e.g. --host 127.0.0.1 --port 8000)"
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(.*))?", host)
    if bracketed is not None:
        port = "" if bracketed[2] is None else f" --port {bracketed[2]}"
        return (f"{shown}: write an IPv6 address without the brackets a URL puts around it "
                f"(--host {bracketed[1]}{port})")
    name, colon, port = host.rpartition(":")
    if colon and name and ":" not in name and port.isdigit():  # (IPv6 has two colons or more)
        return f"{shown}: give the port as --port, not in --host (--host {name} --port {port})"
    return None


def _listen_socket(host: str, port: int) -> socket.socket:
    """The server's listening socket, bound before the executor starts, so a ``--host`` that
    is no address of this machine or a ``--port`` in use is refused in one line naming them
    (exit 2), never after the executor started (it used to exit 3 without naming the host).
    ValueError naming the flag."""
    if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", host):  # a dotted quad: no name lookup for it
        try:
            ipaddress.IPv4Address(host)
        except ValueError as err:
            raise ValueError(f"--host={host!r}: not an IPv4 address ({err})") from None
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (OSError, UnicodeError) as err:
        raise ValueError(f"--host={host!r}: not an address or a host name this machine "
                         f"resolves ({err})") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        sock.bind(address)
    except OSError as err:
        sock.close()
        raise ValueError(f"--host={host!r} --port={port}: cannot listen there: "
                         f"{err.strerror or err}") from None
    return sock


#: the largest --admin-token-file read (a token is a line; more is not a token file)
ADMIN_TOKEN_MAX_BYTES = 4096


def _admin_token(path: Path | None) -> str | None:
    if path is None:
        return None
    # (a FIFO no one writes to is empty, /dev/zero too long: neither waits nor reads forever)
    token = cliargs.read_small_text("--admin-token-file", path, ADMIN_TOKEN_MAX_BYTES,
                                    "an admin token file").strip()
    if not token:
        raise ValueError(f"--admin-token-file={str(path)!r} is empty")
    lines = len(token.splitlines())
    if lines > 1:  # (was "the token has U+000A at character 4", the file's second line unsaid)
        raise ValueError(f"--admin-token-file={str(path)!r} holds {lines} lines: the file "
                         "holds the token alone, on one line")
    problem = api_key_problem(token)  # a token no request could match locks the admin out
    if problem is not None:
        raise ValueError(f"--admin-token-file={str(path)!r}: the token {problem}")
    return token


def exposure_warnings(host: str, api_key: str | None, token_file: Path | None,
                      bound: str | None = None) -> list[str]:
    """What an operator should hear about who can reach or steer this server (WARNING lines
    at startup, nothing refused): a ``--host`` that is not loopback with no ``--api-key``
    (anyone reaching the address runs completions), an ``--admin-token-file`` the group or
    others can read (anyone on the machine can drain or reload the server; a Kubernetes secret
    volume mounts its files 0644 unless told otherwise, so this is not refused). ``bound``:
    the address the server listens on, judged in place of ``host``'s text when given
    (``--host 127.1`` and a name that resolves to 127.0.0.1 listen on loopback, and were
    warned about; ``--host 0`` is said as the 0.0.0.0 it binds)."""
    from calexec.drivers.fleet.local_ray import is_loopback  # (imports no Ray)

    said = []
    if api_key is None and not is_loopback(host if bound is None else bound):
        shown = f"--host={host!r}" + ("" if bound in (None, host) else f" ({bound})")
        said.append(f"{shown} is not a loopback address and no --api-key is set: "
                    "anyone who reaches it can run completions (set --api-key or "
                    "$CALEXEC_API_KEY, or bind 127.0.0.1 behind a proxy that authenticates)")
    if token_file is not None:
        try:
            mode = token_file.stat().st_mode & 0o777
        except OSError:
            mode = 0  # (read already: a race with its removal is not this check's)
        if mode & 0o077:
            who = " and ".join(w for w, bits in (("its group", 0o070), ("others", 0o007))
                               if mode & bits)
            said.append(f"--admin-token-file={str(token_file)!r} is readable by {who} "
                        f"(mode {mode:04o}): whoever reads it can drain or reload this "
                        "server; chmod 600 it")
    return said


def _warn_exposure(args: argparse.Namespace, bound: str | None = None) -> None:
    """Log :func:`exposure_warnings` (after every flag was checked and the address taken: a
    refused command prints its one line only); ``bound``: the listener's address."""
    for line in exposure_warnings(args.host, args.api_key, args.admin_token_file, bound):
        logging.getLogger("calexec.serve").warning("%s", line)


@cliargs.command_main
def main(argv: list[str]) -> int:
    """Entry point; ``argv`` starts with the command word ``serve``."""
    args = parser().parse_args(argv[1:])
    # the key's source, named when it is refused: a key set (empty) in the environment by a
    # container's settings was refused as "--api-key is empty", a flag the command never had
    key_source = "--api-key"
    if args.api_key is None and "CALEXEC_API_KEY" in os.environ:
        args.api_key, key_source = os.environ["CALEXEC_API_KEY"], "$CALEXEC_API_KEY"
    pin_mmap_threshold()  # a long-running server: freed buffers go back to the OS
    port = args.port if args.port is not None else 0 if args.once else 8000
    log_level = args.log_level or ("warning" if args.once else "info")
    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    raised = raise_open_file_limit()  # every connection is a descriptor (process.py)
    if raised is not None:
        logging.getLogger("calexec.serve").info("open-file limit %d -> %d", *raised)
    try:
        set_gil_switch_interval_us(args.gil_switch_us)
        token = _admin_token(args.admin_token_file)
        try:
            dump = None if args.dump_dir is None else DumpSink(
                args.dump_dir.absolute(), args.dump_max_bytes, include_content=args.dump_prompts)
        except DumpConfigError as err:
            raise ValueError(f"--dump-dir={str(args.dump_dir)!r}: {err}") from None
        except OSError as err:  # its directory cannot be made (a file there: not a directory)
            raise ValueError(str(cliargs.cannot_make_dir("--dump-dir", args.dump_dir, err))) from None
        if dump is not None:  # a directory no file can be made in: refused now, not a warning
            try:                # and a dropped record per request once serving
                cliargs.writable_file("--dump-dir", dump.path, args.dump_dir)
            except cliargs.UserError as err:
                raise ValueError(str(err)) from None
        if args.timeout > MAX_TIMEOUT_S:  # refused here, not per request blaming the client
            raise ValueError(f"--timeout={args.timeout:g}: above the server's largest request "
                             f"deadline, max_timeout_s={MAX_TIMEOUT_S:g}")
        problem = model_name_problem(args.served_model_name)
        if problem is not None:  # (every response would say "model": "", carry a newline)
            raise ValueError(f"--served-model-name={shown_name(args.served_model_name)}: "
                             f"{problem}")
        problem = None if args.api_key is None else api_key_problem(args.api_key)
        if problem is not None:  # checked here: it would refuse every request
            raise ValueError(f"{key_source} {problem}" + (
                " (it gives --api-key: unset it for an open server)"
                if key_source != "--api-key" else ""))
        for origin in args.cors_origin:
            problem = cors_origin_problem(origin)
            if problem is not None:
                raise ValueError(f"--cors-origin{problem}")
        tokenizer_path = None if args.tokenizer is None else os.path.abspath(args.tokenizer)
        loaded = hf_tokenizer.load(tokenizer_path, "--tokenizer")  # the error names the flag
        end_token = DEFAULT_END_TOKEN if loaded.eos_token_id is None else loaded.eos_token_id
        config = ServerConfig(admin_token=token, max_sequences=args.max_sequences,
                              default_timeout_s=args.timeout, model_name=args.served_model_name,
                              api_key=args.api_key, tokenizer_path=tokenizer_path,
                              end_token_id=end_token, max_waiting=args.max_waiting,
                              max_resumes=args.max_resumes, max_choices=args.max_choices,
                              max_body_bytes=args.max_body_bytes,
                              cors_origins=tuple(args.cors_origin),
                              metrics_names=args.metrics_names, drain_grace_s=args.grace)
        problem = host_problem(args.host)
        if problem is not None:
            raise ValueError(problem)
        if args.replicas is not None and not args.ray:
            raise ValueError(f"--replicas={args.replicas} needs --ray")
        if args.ray and dump is not None:
            raise ValueError("--dump-dir is not supported with --ray")
        spec = cliargs.device_spec(args)
    except (OSError, ValueError, DumpConfigError) as err:
        print(f"calexec serve: {err}", file=sys.stderr)
        return EXIT_USAGE
    if args.ray:
        return _serve_ray(args, config, port, spec)
    try:
        listener = _listen_socket(args.host, port)
    except ValueError as err:
        print(f"calexec serve: {err}", file=sys.stderr)
        return EXIT_USAGE
    # once the flags are known good (a refusal stays one line), of the address bound
    _warn_exposure(args, str(listener.getsockname()[0]))
    try:
        return _serve(args, config, port, spec, listener, dump, log_level)
    except _Terminated as ended:  # the scratch directory is gone: now end by the signal
        signal.signal(ended.signum, signal.SIG_DFL)
        os.kill(os.getpid(), ended.signum)
        return EXIT_FAILED  # (not reached where the signal's default action ends the process)


class _Terminated(BaseException):
    """SIGTERM or SIGHUP before the server listens (the executor's start): raised in the main
    thread to unwind the start, so that the scratch directory holding the synthetic calbin is
    removed; ``serve`` then ends by that signal, as without a handler (docs/server.md). A
    process killed by it before left a ``calexec-serve-*`` directory in the temp dir each
    time (a pod restarted during its warm-up, a supervisor's stop)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class _StartSignals:
    """For the executor's start (from ``__enter__`` to ``restore``), SIGTERM and SIGHUP raise
    :class:`_Terminated` in the main thread; ``restore`` (also on exit, once) puts the
    previous handlers back, before the server installs its own drain handlers (uvicorn
    raises a signal it caught again once it stopped: it must not meet this handler). SIGINT
    keeps Python's ``KeyboardInterrupt``, which unwinds the same way."""

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StartSignals:
        if threading.current_thread() is not threading.main_thread():
            return self  # (Python runs handlers in the main thread only)

        def terminated(signum: int, frame: object) -> None:
            raise _Terminated(signum)

        for name in ("SIGTERM", "SIGHUP"):
            sig = getattr(signal, name, None)
            if sig is None:  # (no SIGHUP on Windows)
                continue
            try:
                self._previous[sig] = signal.signal(sig, terminated)
            except (ValueError, OSError):
                continue
        return self

    def restore(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    def __exit__(self, *exc: object) -> None:
        self.restore()


#: the start's scratch directory in the temp dir (the synthetic calbin): ``calexec-serve-*``
SCRATCH_PREFIX = "calexec-serve-"
#: the file in a scratch directory its server holds an exclusive ``flock`` on while it runs
SCRATCH_LOCK = ".lock"


def remove_stale_scratch(temp_dir: str) -> list[str]:
    """Remove the ``calexec-serve-*`` directories in ``temp_dir`` that no server holds: a
    server killed by SIGKILL (the OOM killer, a supervisor's stop timeout, ``kill -9``) never
    ran its clean-up, so each such restart left one behind (a crash loop filled the temp
    dir). A directory is stale when its ``.lock`` file can be locked: its server's lock went
    with its process (``flock`` locks are the kernel's, released at any death, and hold
    across pid namespaces sharing the directory). Only directories of this user, never
    through a symlink; one without a lock file (another server between making it and
    locking it, an older calexec's) or whose lock is not a regular file (a named pipe: never
    opened blocking) is left alone. Returns the removed paths."""
    try:
        import fcntl
    except ImportError:  # (no flock: nothing can tell a live server's directory)
        return []
    removed = []
    try:
        names = sorted(os.listdir(temp_dir))
    except OSError:
        return []
    for name in names:
        path = os.path.join(temp_dir, name)
        if not name.startswith(SCRATCH_PREFIX):
            continue
        try:
            st = os.lstat(path)
            if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
                continue
            # (never blocking: a FIFO's read-only open would wait for a writer)
            fd = os.open(os.path.join(path, SCRATCH_LOCK),
                         os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue  # not a lock file a server made: not its directory to remove
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # a running server holds it
        else:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def scratch_directory() -> Iterator[str]:
    """The start's scratch directory (``$TMPDIR/calexec-serve-*``), removed on the way out,
    held by an exclusive ``flock`` on its ``.lock`` file while the server runs, so that a
    later start removes it if this process dies without its clean-up
    (:func:`remove_stale_scratch`, which runs first). The lock file is locked under another
    name and then renamed to ``.lock``: a directory's ``.lock`` is never seen unlocked while
    its server lives."""
    removed = remove_stale_scratch(tempfile.gettempdir())
    if removed:
        logging.getLogger("calexec.serve").info(
            "removed %d scratch director%s of killed servers: %s", len(removed),
            "y" if len(removed) == 1 else "ies", ", ".join(removed[:4]) +
            (f" and {len(removed) - 4} more" if len(removed) > 4 else ""))
    tmp = tempfile.mkdtemp(prefix=SCRATCH_PREFIX)
    fd = None
    try:
        try:
            import fcntl
        except ImportError:
            pass
        else:
            taking = os.path.join(tmp, SCRATCH_LOCK + ".taking")
            fd = os.open(taking, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.rename(taking, os.path.join(tmp, SCRATCH_LOCK))
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # (still locked: no other start removes it)
        if fd is not None:
            os.close(fd)


def _serve(args: argparse.Namespace, config: ServerConfig, port: int, spec: DeviceSpec,
           listener: socket.socket, dump: DumpSink | None, log_level: str) -> int:
    """``serve`` from its listening socket on (``main``): the executor's start in a scratch
    directory, then the server until it drains."""
    with listener, scratch_directory() as tmp, \
            _StartSignals() as start_signals:
        try:
            runtime = spec.runtime()
            spec.check_device_config(runtime, args.device_config)
            reset_kind, why = spec.reset()
            # (a hung job is found within a third of --timeout; an emulated latency in
            # --device-config moves the deadlines out with it)
            executor = DeviceExecutor(runtime, spec.manifest(), with_emulated_latency(
                within_request_timeout(ExecutorConfig(
                    calbin_path=spec.calbin(tmp), device_config=args.device_config,
                    recovery=spec.recovery(), allow_unpinned_golden=args.allow_unpinned_golden,
                    native_relay=args.native_relay, inflight_capacity=args.inflight_capacity),
                    args.timeout)))
        except (OSError, ValueError) as err:
            print(f"calexec serve: {err}", file=sys.stderr)
            return EXIT_USAGE
        logging.getLogger("calexec.serve").info("reset_kind=%s from %s", reset_kind, why)
        logging.getLogger("calexec.serve").info(
            "inflight_capacity=%d (Phase %s)", executor.config.inflight_capacity,
            "B" if executor.config.inflight_capacity == 2 else "A")
        logging.getLogger("calexec.serve").info(
            "execution deadline %gs + %gs per token (--timeout %gs): a job on the device "
            "longer is taken for a hung device and the device recovered",
            executor.config.execution_timeout_s, executor.config.execution_timeout_per_token_s,
            args.timeout)
        bound_url = listening_url(*listener.getsockname()[:2])
        logging.getLogger("calexec.serve").info(
            "bound %s; starting the executor (warm-up, golden): connections are "
            "refused until it serves", bound_url)
        if args.calbin is not None:  # the reload's check, before the device is touched: a
            # file the loader refuses is named as a calbin, not as a CalRT configure failure;
            # the sha256 pin is the start's to check (it hashes the file as it loads it: read
            # whole once, not once more here)
            checked = executor.check_calbin(args.calbin, hash_pin=False)
            if not checked.ok:
                print(_calbin_refused(args.calbin, checked, "was not started"), file=sys.stderr)
                return EXIT_FAILED
        status = executor.start()
        refusal = None if args.calbin is None or status.ok else switch_check.start_refusal(
            status, args.calbin)
        if refusal is not None:  # what the check could not see: a vendor runtime's loader
            # (no host-side read), the manifest's sha256 pin
            print(_calbin_refused(args.calbin, refusal, "did not start"), file=sys.stderr)
            return EXIT_FAILED
        if not status.ok:
            # the core names its config field; a serve user has the flag
            hint = ("; or start with --allow-unpinned-golden (the first golden run is then "
                    "the reference)" if status.code == "golden.unpinned" else "")
            print(f"calexec serve: executor failed to start: {status}{hint}", file=sys.stderr)
            return EXIT_FAILED
        problem = sequence_ids_problem(served(executor), args.max_sequences)  # known once started
        if problem is not None:
            executor.shutdown(args.grace)
            print(f"calexec serve: --max-sequences{problem}; lower --max-sequences or raise "
                  "max_seqs in --device-config", file=sys.stderr)
            return EXIT_USAGE
        app = create_app(served(executor), config, dump)
        sample = SampleRun(args.timeout + 10.0, sys.stdout, args.api_key) if args.once else None
        if sample is not None:
            sample.byte_level = args.tokenizer is None
            sample.served = spec.served()
        def started(server: DrainingServer, url: str) -> None:
            # once the socket listens, not before the executor's start: a probe of the logged
            # address is then answered (uvicorn, handed the socket, does not say it)
            logging.getLogger("calexec.serve").info("listening on %s", bound_url)
            if sample is not None:
                sample.start(server, url)
        # log_config=None: uvicorn's lines go through the root handler above, one format
        # (``LEVEL logger: message``) for the whole log, not uvicorn's ``INFO:     ...``
        start_signals.restore()  # the server's drain handlers from here on
        server = DrainingServer(uvicorn_config(app, host=args.host, port=port,
                                               log_level=log_level, access_log=False,
                                               log_config=None),
                                app.state.service, args.grace, on_started=started)
        server.run(sockets=[listener])
        service = app.state.service
        if service.drain_status is None:  # left the loop without a drain (a Failed one drains)
            status = executor.shutdown(args.grace)
        else:
            status = service.drain_status
        if not status.ok or executor.state != "Stopped":
            print(f"calexec serve: executor ended {executor.state}: {status}", file=sys.stderr)
            return EXIT_FAILED
        if server.cut:  # a second signal ended the drain: what still ran was cut, not drained
            print(f"calexec serve: forced exit by a second signal: {server.cut} request(s) "
                  "still running were cut", file=sys.stderr)
            return EXIT_FAILED
        if sample is not None:
            # (a SIGTERM drains the server while the sample may still be reading its answer or
            # printing it: its outcome is read once its thread ended, not half-way)
            return sample.result(f"executor {executor.state}")
        return EXIT_OK


def _calbin_refused(path: str, refusal: Status, started: str) -> str:
    """The one line of a ``--calbin`` refused (a ``calbin.<reason>`` failure of
    machines/switch_check.py): the flag, the path, the reason, what became of the executor."""
    why = refusal.message.removeprefix(f"calbin={switch_check.named(path)}: ")
    return (f"calexec serve: --calbin={path!r}: not a valid calbin ({refusal.code}): {why}; "
            f"the executor {started}")


def replica_settings(args: argparse.Namespace, config: ServerConfig,
                     spec: DeviceSpec) -> dict[str, Any]:
    """The fields of ``serve --ray``'s ``ReplicaSettings`` (drivers/fleet/ray_serve.py), from
    the flags that set ``serve``'s own executor: each replica's executor is set as it would
    be (``--inflight-capacity`` and ``--allow-unpinned-golden`` were taken and ignored by
    ``--ray``: every replica in Phase A, a calbin with no pinned golden refused)."""
    return {"device_config": args.device_config, "calbin_path": args.calbin,
            "runtime_lib": args.runtime_lib, "grace_s": args.grace, "server": config,
            "gil_switch_us": args.gil_switch_us, "manifest_path": args.manifest,
            "reset_kind": spec.reset()[0], "native_relay": args.native_relay,
            "inflight_capacity": args.inflight_capacity,
            "allow_unpinned_golden": args.allow_unpinned_golden}


def _serve_ray(args: argparse.Namespace, config: ServerConfig, port: int, spec) -> int:
    """``--ray``: deploy ``--replicas`` replicas behind Serve's proxy on ``--host:--port``.

    A local Ray started for a loopback ``--host`` listens on loopback only (Ray's
    single-machine mode, drivers/fleet/local_ray.py). The SIGTERM/SIGINT handlers go in after
    ``ray.init`` (which replaces its caller's). On a signal the fleet drains at its ingress
    (new requests 503 + Retry-After, those in progress finish within ``--grace``), then Serve
    shuts down (each replica drains what is left), then Ray, and the command waits for every
    process of the local cluster to end: 0, or 3 when requests were still running after
    ``--grace`` (they are cut)."""
    from calexec.drivers.fleet import local_ray

    os.environ.update(local_ray.local_environment(args.host))  # read at `import ray`
    local = not local_ray.joins_cluster()
    if local:  # (as without --ray: a key the runtime refuses or one given twice is named
        # before Ray starts, not as every replica's failed deployment)
        try:
            spec.check_device_config(spec.runtime(), args.device_config)
        except (OSError, ValueError) as err:
            print(f"calexec serve --ray: {err}", file=sys.stderr)
            return EXIT_USAGE
    if local and args.calbin is not None:  # before Ray starts (a minute or more): a file its
        # replicas would refuse at deploy is named now, as without --ray; a cluster's nodes
        # read the path on their own file systems, so it is not checked here then
        try:
            checked = switch_check.check_calbin(spec.runtime(), spec.manifest(), args.calbin,
                                                hash_pin=False)
        except (OSError, ValueError) as err:
            print(f"calexec serve --ray: {err}", file=sys.stderr)
            return EXIT_USAGE
        if not checked.ok:
            print(_calbin_refused(args.calbin, checked, "was not started (nor Ray: no replica "
                                  "was deployed)"), file=sys.stderr)
            return EXIT_FAILED
    try:
        import ray
        from ray import serve

        from calexec.drivers.fleet.ray_serve import ReplicaSettings, build_app, drain_fleet
    except ImportError as err:
        print(f"calexec serve --ray: {err}; install the extra: pip install 'calexec[ray]'",
              file=sys.stderr)
        return EXIT_USAGE
    _warn_exposure(args)
    if port == 0:  # --once: an ephemeral port the proxy can bind
        with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
            s.bind((args.host, 0))
            port = s.getsockname()[1]
    settings = ReplicaSettings(**replica_settings(args, config, spec))
    try:
        ray.init(address=local_ray.init_address(), include_dashboard=False)
    except (ConnectionError, RuntimeError, ray.exceptions.RayError) as err:
        if local:
            raise
        print(f"calexec serve --ray: {local_ray.join_error(os.environ['RAY_ADDRESS'], err)}",
              file=sys.stderr)
        return EXIT_USAGE
    with local_ray.StopSignals() as signals:
        try:
            if local:
                local_ray.check_node_ip(args.host, ray.util.get_node_ip_address())
            serve.start(http_options={"host": args.host, "port": port})
            try:
                serve.run(build_app(settings, args.replicas or 1), name="calexec",
                          route_prefix="/")
            except RuntimeError as err:  # a replica could not start (see its logs)
                print(f"calexec serve --ray: deployment failed: {err}", file=sys.stderr)
                return EXIT_FAILED
            url = listening_url(args.host, port)
            sample = None
            if args.once:
                sample = SampleRun(args.timeout + 10.0, sys.stdout, args.api_key)
                sample.served = (f"{spec.served()}, {args.replicas or 1} replica(s) under "
                                 "Ray Serve")
                # (a wildcard --host: the sample asks this machine's loopback, as without --ray)
                sample.ok = sample.request(listening_url(args.host, port, reachable=True))
                # then the fleet drains at its ingress as on a signal, and says so as `serve
                # --once` does (it ended on the sample's answer, no `drained:` line)
            else:
                print(f"calexec serve --ray: {args.replicas or 1} replica(s) serving {url}",
                      flush=True)
                signals.stop.wait()
                print(f"calexec serve --ray: {signals.received}: draining (grace "
                      f"{args.grace:g} s)", flush=True)
            try:
                drained = drain_fleet("calexec", args.grace)
            except Exception as err:  # noqa: BLE001 - the ingress is unreachable: the shutdown still runs
                print(f"calexec serve --ray: the drain at the ingress failed: {err!r}",
                      file=sys.stderr)
                return EXIT_FAILED
            if not drained["drained"]:
                print(f"calexec serve --ray: {drained['active']} request(s) still running "
                      f"after --grace={args.grace:g} s are cut"
                      f"{cut_ids(drained.get('request_ids', []))}", file=sys.stderr)
                return EXIT_FAILED
            if sample is not None:
                return sample.result(f"{args.replicas or 1} replica(s) under Ray Serve")
            return EXIT_OK
        except local_ray.RayBindError as err:
            print(f"calexec serve --ray: {err}", file=sys.stderr)
            return EXIT_USAGE
        finally:  # still under our handlers: a second signal cannot cut the drain short
            forced = local_ray.shutdown(local)
            if forced:
                logging.getLogger("calexec.serve").warning(
                    "Ray processes still running after ray.shutdown, ended: %s",
                    "; ".join(forced))


class SampleRun:
    """``--once``: from a worker thread, send :data:`SAMPLE_REQUEST` to the running server,
    print it as a curl command and the JSON response, then start the drain (always, so the
    process ends). ``ok`` is True only when a completion came back with HTTP 200."""

    def __init__(self, timeout_s: float, out: TextIO, api_key: str | None = None) -> None:
        self.timeout_s = timeout_s
        self.out = out
        self.api_key = api_key
        self.byte_level = True  # the sample's note on the tokenizer (False with --tokenizer)
        #: what the banner says is served (``DeviceSpec.served``)
        self.served = "the synthetic calbin on the bundled emulator"
        self.ok = False
        #: what writing to ``out`` raised on the sample's thread (its reader left, ``| head``:
        #: BrokenPipeError; a full disk): ``main`` raises it once the server drained, for the
        #: console script to answer as any stdout failure (exit 141, or one line, exit 2)
        self.out_error: OSError | None = None
        #: the thread ``start`` runs the sample on (None: not started, or ``request`` called
        #: on the caller's thread: ``serve --ray --once``)
        self._thread: threading.Thread | None = None
        #: ``request`` began (False: the server drained before it served)
        self.sent = False

    def start(self, server: DrainingServer, url: str) -> None:
        """``DrainingServer.on_started``: never blocks the event loop."""
        self._thread = threading.Thread(target=self._run, args=(server, url),
                                        name="calexec-serve-once", daemon=True)
        self._thread.start()

    def result(self, drained: str) -> int:
        """Once the server drained (``drained``: what it says drained): the exit code of the
        run, its last line printed. The sample's thread is joined first, within the request's
        own timeout: a SIGTERM drains the server while the sample may still be reading its
        answer or printing it, and its outcome read then was a failure (exit 4, "see above")
        that the thread went on to print as a 200. A sample never sent (a signal before the
        server served) or still running after the deadline says so. Raises what writing to
        ``out`` raised (for the console script to answer)."""
        thread = self._thread
        if thread is not None:
            thread.join(self.timeout_s)
            if thread.is_alive():
                print(f"calexec serve --once: the sample request did not end within "
                      f"{self.timeout_s:g} s of the drain", file=sys.stderr)
                return EXIT_SAMPLE_FAILED
        if self.out_error is not None:  # not the request's failure: stdout's
            raise self.out_error
        if not self.ok:
            why = "failed (see above)" if self.sent else \
                "was not sent: the server drained before it served"
            print(f"calexec serve --once: the sample request {why}", file=sys.stderr)
            return EXIT_SAMPLE_FAILED
        print(f"drained: {drained}; exit {EXIT_OK}", file=self.out, flush=True)
        return EXIT_OK

    def _run(self, server: DrainingServer, url: str) -> None:
        try:
            self.ok = self.request(url)
        except OSError as err:  # (``request`` answers the HTTP errors: this is ``out``'s)
            self.out_error = err
        finally:
            server.drain_soon()

    def request(self, url: str) -> bool:
        """Send the sample to ``url`` and print it; True for an HTTP 200 completion."""
        self.sent = True
        endpoint = f"{url}/v1/completions"
        body = json.dumps(SAMPLE_REQUEST)
        say = self._say
        say(f"calexec serve --once: {self.served}, serving {url}")
        say("sample request:")
        headers = {"content-type": "application/json"}
        auth = ""
        if self.api_key is not None:
            headers["authorization"] = f"Bearer {self.api_key}"
            auth = " -H \"Authorization: Bearer $CALEXEC_API_KEY\""
        say(f"  curl -s {endpoint} -H 'content-type: application/json'{auth} "
            f"-d {shlex.quote(body)}")
        request = urllib.request.Request(endpoint, data=body.encode("utf-8"), method="POST",
                                         headers=headers)
        t0 = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                code, raw = response.status, response.read()
        except urllib.error.HTTPError as err:
            code, raw = err.code, err.read()
        except (OSError, ValueError) as err:  # connection refused/reset, timeout
            say(f"request failed: {err}")
            return False
        ms = (time.monotonic() - t0) * 1000.0
        try:
            reply = json.loads(raw)
        except ValueError:
            say(f"response (HTTP {code}, {ms:.1f} ms) is not JSON: {raw[:200]!r}")
            return False
        say(f"response (HTTP {code}, {ms:.1f} ms):")
        # indented, but lists of numbers (token_ids) kept on one line
        say(re.sub(r"\[[\d,\s]*\]", lambda m: json.dumps(json.loads(m.group(0))),
                   json.dumps(reply, indent=2)))
        if code != 200:
            return False
        choice = reply["choices"][0]
        say(f"completion: {reply['usage']['completion_tokens']} tokens after "
            f"{reply['usage']['prompt_tokens']} prompt tokens, finish_reason="
            f"{choice['finish_reason']}, text {choice['text']!r}")
        if self.byte_level:
            say(f"  (byte-level tokenizer: ids {byte_tokenizer.BYTE_OFFSET}.."
                f"{byte_tokenizer.BYTE_OFFSET + 255} are UTF-8 bytes, other ids print as <id>; "
                "the synthetic model's weights are random)")
        return True

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)
