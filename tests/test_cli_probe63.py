"""What the CLI probe of stop 63 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 63 (cli)")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from calexec import cliargs


def _calexec(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m calexec.cli ARGV`` in a child, its stdin closed, bounded by ``timeout``."""
    return subprocess.run([sys.executable, "-m", "calexec.cli", *argv], capture_output=True,
                          text=True, stdin=subprocess.DEVNULL, timeout=timeout, check=False)


def test_conform_refuses_a_calbin_that_is_a_fifo_without_waiting_for_a_writer(tmp_path: Path):
    """``conform --calbin FIFO`` read the FIFO whole before any experiment: with no writer it
    waited without end, no line said (``/dev/zero`` read until the memory was gone), where
    every other command's ``--calbin`` says ``not a regular file``. A child, bounded: on the
    old code it is killed at the timeout, and the test fails."""
    fifo = tmp_path / "model.calbin"
    os.mkfifo(fifo)
    done = _calexec(["conform", "--quick", "--calbin", str(fifo)], timeout=60.0)
    assert done.returncode == cliargs.EXIT_CONFIG, done.stderr[-2000:]
    assert done.stderr == f"calexec conform: --calbin={str(fifo)!r}: not a regular file\n"
    assert done.stdout == ""
