"""What the CLI probe of stop 59 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 59 (cli)")."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from proc_table import stat_rows


def _alive(pid: int) -> bool:
    """``pid`` is a live process (a zombie, ended but not reaped, is not)."""
    return any(row[0] == pid and row[1] != "Z" for row in stat_rows())


@pytest.mark.parametrize("argv", [
    ["conform", "--quick", "--only", "parallel"],
    ["bench", "overhead", "--runs", "1", "--tokens", "4", "--zero-tokens", "4"],
], ids=["conform", "bench-overhead"])
def test_a_sigterm_during_the_native_build_ends_the_compiler(tmp_path: Path, argv: list[str]):
    """``conform`` (``make lib``) and ``bench overhead`` (``make floor``) build C code with
    ``subprocess.run``; a SIGTERM (an interrupt, ``cli._run``) during the build killed
    ``make`` only, and the compiler it had started ran on, orphaned, after calexec exited
    130. The build runs in a process group of its own now, killed whole on the interrupt."""
    pids = tmp_path / "cc.pids"
    compiler = tmp_path / "slowcc"  # a compiler that takes its time: says its pid, then waits
    compiler.write_text(f"#!/bin/sh\necho $$ >> {pids}\nexec sleep 600\n")
    compiler.chmod(0o755)
    proc = subprocess.Popen([sys.executable, "-m", "calexec.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL,
                            env={**os.environ, "CC": str(compiler), "TMPDIR": str(tmp_path)})
    started: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while not started:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            if pids.exists():
                started = [int(line) for line in pids.read_text().split()]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 5
        while any(_alive(pid) for pid in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = [pid for pid in started if _alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in started:  # (the old code's compiler: ended here, not left to the machine)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert left == [], "the compiler ran on after the SIGTERM"
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == f"calexec {' '.join(argv[:2 if argv[0] == 'bench' else 1])}: interrupted"
