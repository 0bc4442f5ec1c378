"""What the CLI probe of stop 59 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 59 (cli)")."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from calexec import cli, cliargs
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


def test_a_ticker_says_a_long_loops_count_at_most_every_interval_and_at_its_end(
        capsys: pytest.CaptureFixture[str]):
    """The progress of a long loop: one line when ``every_s`` has passed since the last (or
    the start), none between, and the last count always."""
    now = [100.0]
    tick = cliargs.Ticker("bench charts", "jobs", 7, every_s=10.0, clock=lambda: now[0])
    for done, at in enumerate([101.0, 109.9, 110.0, 115.0, 119.9, 120.5, 121.0], start=1):
        now[0] = at
        tick(done)
    assert capsys.readouterr().err.splitlines() == [
        "bench charts: jobs 3/7", "bench charts: jobs 6/7", "bench charts: jobs 7/7"]


@pytest.mark.parametrize(("argv", "lines"), [
    (["bench", "charts", "--iters", "3"],
     ["bench charts: compiled charts: jobs 3/3", "bench charts: python-statemachine: jobs 3/3"]),
    (["bench", "logits", "--iters", "3"], ["bench: logits: iterations 3/3"]),
    (["sim", "bench", "--iters", "3", "--profile-iters", "2"],
     ["sim bench: zero-latency decode jobs 3/3", "sim bench: decode jobs at 10000 us 2/2"]),
    (["bench", "recovery", "--recoveries", "2"], ["bench: recovery: recoveries 2/2"]),
], ids=["bench-charts", "bench-logits", "sim-bench", "bench-recovery"])
def test_the_timed_loops_of_the_microbenchmarks_say_their_progress(
        capsys: pytest.CaptureFixture[str], argv: list[str], lines: list[str]):
    """``bench charts``, ``bench logits`` and ``sim bench`` said one line as each timed loop
    began, then nothing until the result: with a large ``--iters`` (``--profile-iters`` of
    10 ms jobs) minutes of silence, a hang to whoever watches. Each loop now says its count on
    stderr every ``cliargs.PROGRESS_S`` seconds and at its end (``cliargs.Ticker``); stdout
    is still the one JSON object. (``bench recovery`` said ``bench: bench recovery: 20/100``
    every 10 recoveries, whatever their pace: it counts as they do now.)"""
    assert cli.main([*argv, "--json"]) == 0
    captured = capsys.readouterr()
    assert isinstance(json.loads(captured.out), dict)
    err = captured.err.splitlines()
    assert [line for line in err if line in lines] == lines, err


@pytest.mark.parametrize(("argv", "flag"), [
    (["diagrams", "--check", "--out", "{file}"], "--out"),
    (["diagrams", "--check", "--out", "{dir}", "--png", "{file}"], "--png"),
    (["charts", "draw", "calexec.machines.charts:JobChart", "--check", "--out", "{file}"],
     "--out"),
], ids=["diagrams-out", "diagrams-png", "charts-draw-out"])
def test_a_check_whose_output_directory_is_a_file_is_refused_naming_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, argv: list[str], flag: str):
    """``diagrams --check --out x.txt`` (``--png``, ``charts draw --check --out``: a file where
    the directory should be) said every diagram was ``missing``, exit 1 "a check failed", and
    named the fix ``calexec diagrams --out x.txt``, which is refused, exit 2, ``not a
    directory``. The check refuses it as the write does: one line naming the flag and the
    value, exit 2."""
    file = tmp_path / "x.txt"
    file.write_text("not a directory\n")
    args = [word.format(file=file, dir=tmp_path / "diagrams") for word in argv]
    code = cli.main(args)
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.splitlines() == [
        f"calexec {' '.join(argv[:2] if argv[0] == 'charts' else argv[:1])}: "
        f"{flag}={str(file)!r}: not a directory"], captured.err
    assert captured.out == ""


@pytest.mark.parametrize(("argv", "lines"), [
    (["demo", "--seqs", "1", "--tokens", "3"],
     ["calexec demo: decode rounds 0/2", "calexec demo: decode rounds 1/2"]),
    (["bench", "pingpong", "--seqs", "1", "--tokens", "2", "--solo-tokens", "2", "--json"],
     ["bench: pingpong: tokens of 1 sequences 2/2"]),
], ids=["demo", "bench-pingpong"])
def test_the_decode_loops_of_demo_and_pingpong_say_their_progress_when_due(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str],
        lines: list[str]):
    """``demo --tokens 3000 --decode-us 2000`` and ``bench pingpong --tokens 3000`` said one
    line, then nothing for minutes while they decoded. Their loops say their count when one is
    due (every ``$CALEXEC_PROGRESS_S`` seconds, 10 by default; 0 here: every step), and a
    quick run stays as quiet as it was (no count at its end)."""
    monkeypatch.setenv("CALEXEC_PROGRESS_S", "0")
    assert cli.main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    for line in lines:
        assert line in err, err
    monkeypatch.delenv("CALEXEC_PROGRESS_S")
    assert cli.main(argv) == 0
    assert not [line for line in capsys.readouterr().err.splitlines()
                if any(word in line for word in ("decode rounds", "tokens of"))]


@pytest.mark.parametrize("value", ["x", "nan", "-1", "inf", "1e30"])
def test_a_bad_progress_interval_in_the_environment_is_refused_naming_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, value: str):
    """``$CALEXEC_PROGRESS_S`` is refused before the run, one line naming it and the value,
    exit 2, nothing on stdout."""
    monkeypatch.setenv("CALEXEC_PROGRESS_S", value)
    code = cli.main(["bench", "charts", "--iters", "2", "--json"])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.splitlines() == [
        f"calexec bench charts: CALEXEC_PROGRESS_S={value!r}: must be a number of seconds >= 0 "
        "and at most 1e+06"]
    assert captured.out == ""


def test_bench_server_under_a_long_temporary_directory_runs_the_api_process_floor(
        tmp_path: Path):
    """``bench server`` binds its API-process floor's engine socket in its temporary
    directory; under a long $TMPDIR (a CI workspace's, macOS's /var/folders/...: a Unix
    socket's path takes about 100 bytes) the run ended ``internal error: OSError: AF_UNIX path
    too long``, exit 70. The socket goes to a short directory of its own then, removed at the
    end, and the side is measured."""
    deep = tmp_path / ("d" * 100)
    deep.mkdir()
    before = set(Path("/tmp").glob("calexec-sock-*"))
    done = subprocess.run(
        [sys.executable, "-m", "calexec.cli", "bench", "server", "--requests", "4", "--rounds",
         "1", "--concurrency", "1", "--max-tokens", "2", "--json"],
        capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=300,
        env={**os.environ, "TMPDIR": str(deep)})
    assert done.returncode == 0, done.stderr
    floor = json.loads(done.stdout)["c1"]["api_process_floor"]
    assert isinstance(floor, dict) and floor["req_per_s"] > 0, floor
    assert list(deep.iterdir()) == []
    assert set(Path("/tmp").glob("calexec-sock-*")) == before
