"""What the CLI probe of stop 58 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 58 (cli)")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calexec import cli
from proc_table import stat_rows


@pytest.mark.parametrize("seconds", ["0.01", "2.99"])
def test_a_chaos_gate_too_short_to_judge_is_refused_not_passed(
        capsys: pytest.CaptureFixture[str], seconds: str):
    """``accept --gates chaos --chaos-seconds 0.01`` ran one scheduled fault into ~16 requests
    and printed ``PASS chaos_a``, exit 0: a verdict on nearly nothing. Refused now before any
    gate runs, naming the flag, the value and the least it takes (as a soak too short to judge
    is), exit 2."""
    code = cli.main(["accept", "--gates", "chaos", "--phase", "a", "--json",
                     "--chaos-seconds", seconds])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"calexec accept: --chaos-seconds={seconds}: the chaos gate "
                               "needs at least 3 s "), lines
    assert captured.out == ""


def test_an_output_directory_that_takes_no_file_is_named_not_the_scratch_one(
        capsys: pytest.CaptureFixture[str]):
    """``charts names --out /proc/x.py`` (a directory that exists but takes no new file: a
    read-only mount, one the user may not write) said ``cannot write '/proc/.partial-3m707l3l'``,
    the name of the scratch directory the output is staged in, which the user never gave nor
    will find; it names the output the flag gave now."""
    code = cli.main(["charts", "names", "--out", "/proc/x.py"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("calexec charts names: --out='/proc/x.py': cannot write it: "), lines
    assert ".partial-" not in lines[0]
    assert captured.out == ""


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (zombies not counted)."""
    return [pid for pid, state, _, group in stat_rows() if state != "Z" and group == pgid]


def _descendants(root: int) -> set[int]:
    """The live processes started by ``root`` and by those (zombies not counted), whatever
    their process group: ``bench server``'s API process runs in a session of its own since
    stop 66, so its group no longer shows it."""
    rows = [(pid, parent) for pid, state, parent, _ in stat_rows() if state != "Z"]
    found: set[int] = set()
    grew = True
    while grew:
        grew = False
        for pid, parent in rows:
            if pid not in found and (parent == root or parent in found):
                found.add(pid)
                grew = True
    return found


def _alive(pids: set[int]) -> list[int]:
    return sorted(pid for pid, state, _, _ in stat_rows() if state != "Z" and pid in pids)


@pytest.mark.parametrize(("argv", "children"), [
    (["demo", "--seqs", "4", "--tokens", "2000", "--decode-us", "2000"], 0),
    (["bench", "server", "--requests", "200", "--rounds", "2"], 1),
], ids=["demo", "bench-server"])
def test_a_sigterm_mid_run_removes_the_temporary_directory_and_ends_the_children(
        tmp_path: Path, argv: list[str], children: int):
    """A SIGTERM (``timeout 600 calexec ...``, a supervisor, ``kill PID``) to ``demo``, ``accept``,
    every ``bench`` and ``sim bench`` ended calexec by the signal: its ``calexec-*`` temporary
    directory stayed in $TMPDIR and ``bench server``'s load generator process ran on. A SIGTERM
    is an interrupt now as a Ctrl-C is (it was for ``conform``, ``charts mutate``, ``charts
    cover``, ``diagrams live`` only): the directory removed, the children ended, exit 130, one
    line."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "calexec.cli", *argv],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "TMPDIR": str(scratch)})
    started: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while not (any(scratch.iterdir()) and len(started) >= children):
            # (not proc.communicate() in the message: it waited for the whole run, minutes)
            assert proc.poll() is None and time.monotonic() < deadline, (
                f"no temporary directory and {len(started)} of {children} children in 120 s")
            started = _descendants(proc.pid)
            time.sleep(0.05)
        started |= _descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
        deadline = time.monotonic() + 5
        while (_group(proc.pid) or _alive(started)) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _group(proc.pid) + _alive(started)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in set(_group(proc.pid)) | set(_alive(started)):  # (the old code's load
            # generator: ended here)
            os.kill(pid, signal.SIGKILL)
    assert left == [], "a child process ran on after the SIGTERM"
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == f"calexec {' '.join(argv[:2 if argv[0] == 'bench' else 1])}: interrupted"
    assert "Traceback" not in err
    assert sorted(p.name for p in scratch.iterdir()) == []


@pytest.mark.parametrize("stderr", ["full", "reader-left"])
def test_a_stderr_that_cannot_be_written_does_not_cost_the_result(stderr: str):
    """The progress lines go to stderr; when it could not be written (``2>/dev/full``; its
    reader left: ``2> >(head -1)``, a log pipe that closed) the first one ended the command:
    exit 141, "the reader of stdout left", or 1, "a check failed" (the interpreter's exit for
    the error it could not report), and the result on stdout was never printed. Stderr's
    failure now only silences it: the JSON result, exit 0."""
    argv = [sys.executable, "-m", "calexec.cli", "bench", "charts", "--iters", "2", "--json"]
    if stderr == "full":
        with open("/dev/full", "w") as full:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=full, text=True,
                                  stdin=subprocess.DEVNULL, timeout=120)
        code, out = done.returncode, done.stdout
    else:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                stdin=subprocess.DEVNULL)
        assert proc.stderr is not None and proc.stdout is not None
        proc.stderr.close()  # (the reader leaves before the first progress line)
        try:
            out = proc.stdout.read()
            code = proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            proc.stdout.close()
    assert code == 0, (code, out)
    assert json.loads(out)["iters"] == 2
