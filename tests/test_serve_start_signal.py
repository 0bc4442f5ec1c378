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


def _started(tmp_path, port: int) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """``calexec serve`` with ``$TMPDIR`` = ``tmp_path``, its stderr read by a thread; the
    event is set once it listens (or its stderr ended)."""
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec", "serve", "--port", str(port), "--log-level", "info"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    lines: list[str] = []
    listening = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line:
                listening.set()
        listening.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, lines, listening


def test_a_start_removes_the_scratch_directory_a_killed_server_left(tmp_path):
    """SIGKILL (the OOM killer, a supervisor's stop timeout) runs no clean-up: each killed
    server left its ``calexec-serve-*`` directory in the temp dir, a crash loop one per
    restart. The next start removes it (its server's ``flock`` went with the process) and
    says so; a running server's directory is left alone."""
    port = free_port()
    procs = []
    try:
        first, lines, listening = _started(tmp_path, port)
        procs.append(first)
        assert listening.wait(60) and first.poll() is None, "".join(lines)
        [left] = tmp_path.glob("calexec-serve-*")
        first.kill()
        first.wait(30)
        assert left.exists(), "SIGKILL ran no clean-up"
        second, lines, listening = _started(tmp_path, port)
        procs.append(second)
        assert listening.wait(60) and second.poll() is None, "".join(lines)
        [running] = tmp_path.glob("calexec-serve-*")
        assert running != left, "the killed server's directory is still there"
        assert any(f"removed 1 scratch directory of killed servers: {left}" in line
                   for line in lines), "".join(lines)
        third, lines3, listening3 = _started(tmp_path, free_port())
        procs.append(third)
        assert listening3.wait(60) and third.poll() is None, "".join(lines3)
        assert running.exists(), "a running server's directory was removed"
        assert len(list(tmp_path.glob("calexec-serve-*"))) == 2
        for proc in (second, third):
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)
    assert not list(tmp_path.glob("calexec-serve-*"))


def test_stale_scratch_is_only_an_unlocked_directory_of_this_user(tmp_path):
    """What :func:`remove_stale_scratch` leaves: a directory whose lock a live process
    holds, one with no lock file (between a start's ``mkdtemp`` and its lock; an older
    calexec's), a symlink, a file of that name, another prefix."""
    import fcntl

    from calexec.serve import SCRATCH_LOCK, remove_stale_scratch

    stale = tmp_path / "calexec-serve-stale"
    held = tmp_path / "calexec-serve-held"
    unlocked = tmp_path / "calexec-serve-nolock"
    other = tmp_path / "calexec-replica-x"
    for d in (stale, held, unlocked, other):
        d.mkdir()
        (d / "synthetic.calbin").write_bytes(b"x")
    for d in (stale, held, other):
        (d / SCRATCH_LOCK).write_bytes(b"")
    (tmp_path / "calexec-serve-link").symlink_to(stale)
    (tmp_path / "calexec-serve-file").write_bytes(b"")
    fd = os.open(held / SCRATCH_LOCK, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        assert remove_stale_scratch(str(tmp_path)) == [str(stale)]
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "calexec-replica-x", "calexec-serve-file", "calexec-serve-held", "calexec-serve-link",
        "calexec-serve-nolock"]
    assert remove_stale_scratch(str(tmp_path)) == [str(held)]  # its holder let go


def test_a_lock_file_that_is_not_a_regular_file_is_left_without_blocking_the_start(tmp_path):
    """A ``.lock`` that is a named pipe (only a process of the same user can make one) is
    neither opened blocking (a FIFO's read-only open waits for a writer: the start would hang
    for good) nor taken for a stale server's lock: its directory is left."""
    from calexec.serve import SCRATCH_LOCK, remove_stale_scratch

    odd = tmp_path / "calexec-serve-fifo"
    odd.mkdir()
    os.mkfifo(odd / SCRATCH_LOCK)
    done = threading.Event()
    result: list[list[str]] = []

    def scan() -> None:
        result.append(remove_stale_scratch(str(tmp_path)))
        done.set()

    worker = threading.Thread(target=scan, daemon=True)
    worker.start()
    finished = done.wait(30.0)
    if not finished:  # free the blocked open so the thread ends with the test
        os.close(os.open(odd / SCRATCH_LOCK, os.O_WRONLY | os.O_NONBLOCK))
        worker.join(5.0)
    assert finished, "remove_stale_scratch blocked on a FIFO named .lock"
    assert result == [[]]
    assert odd.is_dir()
