"""``calexec diagrams live``: screenshots of the live statecharts page under load, and of one
job's path (for docs/diagrams.md).

Starts the bundled emulator and the reference server on 127.0.0.1, sends completions from a few
client threads, and takes a headless-Chromium screenshot of ``/debug/statecharts`` under that
load; then fails one request with an injected CCU exception and screenshots its job's path page.
The pages themselves are drivers/serving/live_charts.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from calexec import cliargs
from calexec.drivers.serving.live_charts import path_page


def _run_bounded(argv: list[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess:
    proc: subprocess.Popen[str] | None = None
    try:
        with cliargs.interrupts_held():  # (a Ctrl-C inside Popen(): the browser, started but
            # not yet returned to end, ran on after exit 130 and wrote the PNG then)
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, start_new_session=True, env=env)
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        if proc is None:  # (never: only communicate() times out)
            raise
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        return subprocess.CompletedProcess(argv, -9, out, err + f"\ntimed out after {timeout}s")
    except BaseException:  # a Ctrl-C (in its own session, the browser does not get it): the
        # browser and its helpers would run on after the command ended, and write the PNG then
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        raise
    try:  # helpers a browser leaves behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def chromium_capture(url: str, workdir: str, screenshot: str | None = None,
                     size: tuple[int, int] = (1400, 2400), budget_ms: int = 4000,
                     timeout: float = 90.0) -> subprocess.CompletedProcess:
    """Headless Chromium on ``url`` after ``budget_ms`` of page time: a PNG screenshot when
    ``screenshot`` is given, else the DOM (stdout) after the page's scripts ran."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise FileNotFoundError("chromium is not on PATH (Debian package 'chromium'; "
                                "bash .ci/install-server-tools)")
    argv = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
            "--no-first-run", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", f"--user-data-dir={os.path.join(workdir, 'profile')}",
            f"--virtual-time-budget={budget_ms}", f"--window-size={size[0]},{size[1]}"]
    argv += [f"--screenshot={screenshot}"] if screenshot else ["--dump-dom"]
    # its temporary files in a directory of their own, removed after it: the
    # org.chromium.Chromium.* directory it makes in $TMPDIR stayed there when a Ctrl-C or a
    # timeout killed it. Not workdir itself: the singleton socket Chromium makes in it must fit
    # a unix socket's 107 bytes, and a pytest tmp_path (pytest-1017/<test name>) did not:
    # "Socket path too long", SIGABRT
    browser_tmp = _short_tmpdir()
    try:
        return _run_bounded(argv + [url], timeout,
                            {**os.environ, "HOME": workdir, "TMPDIR": browser_tmp})
    finally:
        shutil.rmtree(browser_tmp, ignore_errors=True)


# org.chromium.Chromium.XXXXXX/SingletonSocket, and a margin
_SOCKET_TAIL = 48
_SUN_PATH_MAX = 107


def _short_tmpdir() -> str:
    """A new private directory whose path leaves room for Chromium's singleton socket: in the
    user's temporary directory when that is short enough, else in ``/tmp``."""
    for base in (tempfile.gettempdir(), "/tmp"):
        if len(base) + len("/cxchr-XXXXXXXX") + _SOCKET_TAIL <= _SUN_PATH_MAX \
                and os.path.isdir(base) and os.access(base, os.W_OK | os.X_OK):
            return tempfile.mkdtemp(prefix="cxchr-", dir=base)
    return tempfile.mkdtemp(prefix="cxchr-")  # (Chromium then says which path was too long)


def main(argv: list[str]) -> int:
    """``calexec diagrams live --out PNG [--job-out PNG] [--seconds S] [--clients N]``."""
    parser = cliargs.parser("calexec diagrams live",
                            "Screenshot /debug/statecharts under load, and one job's path.")
    parser.add_argument("--out", type=cliargs.output_file, default="docs/img/live.png",
                        help="PNG to write")
    parser.add_argument("--job-out", default="docs/img/job_path.png", type=cliargs.not_stdout,
                        help="PNG of /debug/jobs/{id} for a request failed by an injected CCU "
                             "exception ('' to skip)")
    parser.add_argument("--seconds", type=cliargs.seconds, default=5.0,
                        help="load before the shot")
    parser.add_argument("--clients", type=cliargs.clients, default=4,
                        help="concurrent client threads")
    args = parser.parse_args(argv[2:])
    # before the executor and the load start: what would fail only at the shot
    for flag, value in (("--out", args.out), ("--job-out", args.job_out)):
        if value and not os.path.isdir(os.path.dirname(os.path.abspath(value))):
            raise cliargs.UserError(f"{flag}={value!r}: no directory "
                                    f"{os.path.dirname(os.path.abspath(value))!r} to write it in")
        if value:  # (a directory itself, read-only: Chromium failed after the whole load)
            cliargs.writable_file(flag, value)
    if args.job_out and os.path.realpath(args.job_out) == os.path.realpath(args.out):
        # (the job's shot replaced the live page's, both paths printed, exit 0)
        raise cliargs.UserError(f"--job-out={args.job_out!r}: the same file as "
                                f"--out={args.out!r}: the job's path would replace the live "
                                f"page's shot; give another path, or --job-out '' to skip it")
    if shutil.which("chromium") is None and shutil.which("chromium-browser") is None:
        raise cliargs.UserError("needs headless Chromium: chromium is not on PATH (Debian "
                                "package 'chromium'; bash .ci/install-server-tools)")
    import httpx
    import uvicorn

    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.serving.executor_view import served
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.synthetic import calbin
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    # (a SIGTERM is an interrupt: the browser, in a session of its own, is killed with it)
    with cliargs.sigterm_interrupts(), tempfile.TemporaryDirectory(prefix="calexec-live-") as tmp:
        path = os.path.join(tmp, "synthetic.calbin")
        calbin.write(path, calbin.default_spec())
        ex = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                            ExecutorConfig(calbin_path=path, device_config="decode_us=20000"))
        server: Any = None
        thread: threading.Thread | None = None
        stop = threading.Event()
        # every way out shuts the executor down: the warm-up of its start included (a Ctrl-C
        # there left it Warming, its device open and its threads running to the exit), a
        # start that failed, a server that did not start, the load and the shots
        try:
            status = ex.start()
            if not status.ok:
                raise cliargs.UserError(f"executor did not start: {status}",
                                        cliargs.EXIT_REFUSED)
            # (no resumes: the injected CCU exception of the job shot must fail its request,
            # whose error names the job; a resumed request answers 200 and names none)
            app = create_app(served(ex), ServerConfig(max_resumes=0))
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1",
                                                   port=0, log_level="warning",
                                                   access_log=False))
            thread = threading.Thread(target=server.run, daemon=True)
            thread.start()
            end = time.monotonic() + 30
            while not server.started and time.monotonic() < end and thread.is_alive():
                time.sleep(0.05)
            if not server.started:
                raise cliargs.UserError("the server on 127.0.0.1 did not start within 30 s",
                                        cliargs.EXIT_REFUSED)
            url = f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"

            def client(i: int) -> None:
                with httpx.Client(base_url=url, timeout=30) as http:
                    while not stop.is_set():
                        http.post("/v1/completions", json={"prompt": [i + 1, 2, 3],
                                                           "max_tokens": 16})

            clients = [threading.Thread(target=client, args=(i,), daemon=True)
                       for i in range(args.clients)]
            for c in clients:
                c.start()
            time.sleep(args.seconds)
            done = chromium_capture(f"{url}/debug/statecharts", tmp, screenshot=os.path.abspath(args.out))
            stop.set()
            for c in clients:
                c.join(30)
            if args.job_out and done.returncode == 0:
                done = _job_path_shot(ex, server, url, tmp, os.path.abspath(args.job_out))
        finally:
            stop.set()
            if server is not None:
                server.should_exit = True
            if thread is not None:
                thread.join(10)
            if not ex.lifecycle.final:  # (a failed start ended it Failed, closed)
                ex.shutdown(10.0)
    if done.returncode != 0 or not os.path.exists(args.out):
        print(f"calexec diagrams live: chromium failed: {done.stderr[-2000:]}", file=sys.stderr)
        return 1
    print(cliargs.shell_word(args.out))  # one line each, whatever the path holds
    if args.job_out:
        print(cliargs.shell_word(args.job_out))
    return 0


def _job_path_shot(ex: Any, server: Any, url: str, tmp: str, out: str) -> subprocess.CompletedProcess:
    """A request failed by a DONE_CCU_EXCEPTION: screenshot of its job's path page."""
    import httpx

    from calexec.drivers.calrt.runtime import Fault, FaultMode, bundled_emulator

    bundled_emulator(ex.device).set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0)
    with httpx.Client(base_url=url, timeout=30) as http:
        body = http.post("/v1/completions", json={"prompt": [7, 7, 8], "max_tokens": 4}).json()
    job_id = body.get("status", {}).get("job_id") if isinstance(body, dict) else None
    if job_id is None:  # (the request was not failed by the fault: no job to draw)
        raise cliargs.UserError(f"--job-out: the request the injected CCU exception should "
                                f"fail answered {str(body)[:200]}", cliargs.EXIT_FAILED)
    page_file = os.path.join(tmp, f"job_{job_id}.html")
    with open(page_file, "w", encoding="utf-8") as fh:
        fh.write(path_page(ex.job_trail(job_id)))
    return chromium_capture(f"file://{page_file}", tmp, screenshot=out, size=(1200, 1500),
                            budget_ms=500)
