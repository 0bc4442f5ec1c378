"""``calexec serve`` stopped by SIGTERM or SIGHUP during the executor's start (warm-up and
golden, before it listens): it ends by that signal as documented (docs/server.md "Drain"), and
its scratch directory (the synthetic calbin) is removed first. Before, the signal's default
action killed the process there and left a ``calexec-serve-*`` directory in the temp dir each
time. The start is held long enough by a slow emulated device (300 ms per job); the test
waits for the log line that says the start began, not for a time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from test_server_support import free_port

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_signal_during_the_start_removes_the_scratch_directory_and_ends_by_it(tmp_path,
                                                                                signum):
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec", "serve", "--port", str(free_port()),
         "--device-config", "decode_us=300000", "--log-level", "info"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "starting the executor" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(60), "".join(lines)
        assert list(tmp_path.glob("calexec-serve-*")), "no scratch directory while starting"
        proc.send_signal(signum)
        assert proc.wait(60) == -signum, "".join(lines)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    reader.join(10)
    assert not any("listening on" in line for line in lines), "the start ended first"
    assert not list(tmp_path.glob("calexec-serve-*")), "the scratch directory was left"
