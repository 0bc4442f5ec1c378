"""What the CLI probe of stop 63 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 63 (cli)")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from calexec import cli, cliargs


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


@pytest.mark.parametrize(("codes", "said"), [
    ("0", "0 is a passing run (the mutant survived), never 'not judged'"),
    ("3,4,5,0", "0 is a passing run"),
    ("256", "256 is no exit code a run can end with (1..255, or -1..-"),
    (str(10 ** 30), f"{10 ** 30} is no exit code a run can end with"),
    ("-1000", "-1000 is no exit code a run can end with"),
])
def test_charts_mutate_refuses_an_error_code_no_run_can_be_judged_by(
        codes: str, said: str, capsys: pytest.CaptureFixture[str]):
    """``charts mutate --error-codes 256`` (or 10**30, -1000: no exit code; or 0, judged a
    survivor before the error codes are looked at) was taken and never matched: every mutant
    was judged as if the flag were not given, the run minutes long. Now refused before the
    run, exit 2, naming the flag and the code (``--mutant nope``: on the old code the refusal
    is that of the mutant, and the test fails on the message)."""
    code = cli.main(["charts", "mutate", "--test-cmd", "true", "--error-codes", codes,
                     "--mutant", "nope"])
    err = capsys.readouterr().err
    assert code == cliargs.EXIT_CONFIG, err
    assert err.startswith(f"calexec charts mutate: --error-codes={codes!r}: "), err
    assert said in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("codes", ["3,4,5", "1", "255", "-9", ""])
def test_charts_mutate_takes_the_exit_codes_a_run_can_end_with(
        codes: str, capsys: pytest.CaptureFixture[str]):
    code = cli.main(["charts", "mutate", "--test-cmd", "true", "--error-codes", codes,
                     "--mutant", "nope"])
    err = capsys.readouterr().err
    assert code == cliargs.EXIT_CONFIG, err
    assert "--mutant='nope': no such mutant" in err, err


def test_diagrams_live_refuses_a_job_shot_over_the_live_shot(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """``diagrams live --out x.png --job-out ./x.png`` ran the load, shot the live page into
    x.png, then the job's path over it: both paths printed, exit 0, the live shot gone. Now
    refused before the load, exit 2, naming both flags."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["diagrams", "live", "--out", "x.png", "--job-out",
                     str(tmp_path / "." / "x.png"), "--seconds", "0.1", "--clients", "1"])
    captured = capsys.readouterr()
    assert code == cliargs.EXIT_CONFIG, captured.err
    assert captured.err.startswith("calexec diagrams live: --job-out="), captured.err
    assert "the same file as --out='x.png'" in captured.err, captured.err
    assert len(captured.err.splitlines()) == 1 and captured.out == ""
    assert not (tmp_path / "x.png").exists()
