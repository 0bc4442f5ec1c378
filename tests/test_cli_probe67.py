"""What the CLI probe of stop 67 found giving every command bad numbers, abbreviated flags and
huge counts, each pinned (docs/traceability.md, "Found at stop 67 (cli)"): an abbreviated flag
taken for the flag it starts, a wait bound derived from a huge count that overflowed the
standard library's waits, a SIGHUP or SIGQUIT that ended a command with its children running
on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from calexec import cliargs
from calexec.cli import main as cli
from calexec.drivers.tools.bench import loadgen, server_overhead
from calexec.drivers.tools.bench.subproc import run_group

#: a calbin that is not there: a command line the parser takes ends at once refusing it
ABSENT = ["--calbin", "/nonexistent/probe67.calbin"]


@pytest.mark.parametrize(("argv", "typed", "full"), [
    (["demo", *ABSENT, "--dec", "0"], "--dec", "--decode-us"),
    (["demo", *ABSENT, "--seq", "2"], "--seq", "--seqs"),
    (["serve", *ABSENT, "--po", "1"], "--po", "--port"),
    (["bench", "overhead", *ABSENT, "--tok=5"], "--tok=5", "--tokens"),
    (["--vers"], "--vers", "--version"),
], ids=["demo-dec", "demo-seq", "serve-po", "overhead-tok-equals", "top-level-vers"])
def test_an_abbreviated_flag_is_refused_naming_the_flag_in_full(argv, typed, full, capsys):
    """``calexec demo --dec 0`` was taken as ``--decode-us 0`` (argparse's prefix matching),
    so a script's meaning hung on the flags a version had: a later flag starting alike made
    the same line an "ambiguous option" error, and a typo that is a prefix of another flag
    was taken for it without a word. A flag is taken only as spelled in full now; the
    refusal names the flag meant."""
    assert cli(argv) == cliargs.EXIT_CONFIG
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert f"unrecognized arguments: {typed}" in err, err
    assert f"abbreviations are not taken: did you mean {full}?" in err, err


def test_an_abbreviation_of_several_flags_is_one_line_naming_them(capsys):
    parser = cliargs.parser("calexec probe", None)
    for flag in ("--timeout", "--test-cmd", "--targets"):
        parser.add_argument(flag)
    with pytest.raises(SystemExit):
        parser.parse_args(["--t", "1"])
    err = capsys.readouterr().err
    assert "did you mean --targets or --test-cmd or --timeout?" in err, err


def test_a_wait_bound_beyond_the_standard_librarys_waits_is_clamped():
    assert cliargs.wait_s(2.5e6) == cliargs.MAX_SECONDS
    assert cliargs.wait_s(60.0) == 60.0
    # a subprocess's wait of more than about 24.8 days: `bench server --requests 150000`'s
    # out-of-process load generator (the bound is 60 s a request)
    done = run_group([sys.executable, "-c", "print(1)"], 2.5e6)
    assert done.returncode == 0 and done.stdout == "1\n"


@pytest.fixture
def closed_port():
    """A loopback port bound but not listening: a connection to it is refused at once."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def test_a_huge_request_count_is_bounded_not_an_overflow(closed_port):
    """``calexec bench server --requests 1000000000000000000000000000000`` ended in
    ``internal error: OverflowError: timestamp out of range for platform time_t``, exit 70:
    its load threads' join bound (60 s a request) overflowed. The bound is now one the
    waits take; here every worker ends at its first failed request, and the failure is the
    answer."""
    huge = 10**30

    def one(worker: int, i: int) -> None:
        raise ConnectionRefusedError("refused")

    with pytest.raises(server_overhead.BenchError, match="request.s. failed, first: refused"):
        server_overhead.load(huge, 2, one)
    with pytest.raises(loadgen.LoadError, match="request.s. failed"):
        loadgen.run(f"http://127.0.0.1:{closed_port}", huge, 2, 1)


@pytest.mark.parametrize("sig", ["SIGHUP", "SIGQUIT"])
def test_a_hangup_or_quit_ends_the_command_and_its_child_processes(tmp_path, sig):
    """``calexec charts mutate`` (any command whose child processes would outlive it: conform's
    experiment, a build, ``diagrams live``'s browser) ended by a SIGHUP (its terminal closed,
    the ssh connection lost) died at once, exit 129, its test command running on (calexec's
    whole suite by default); SIGQUIT (Ctrl-\\) the same. Both are now an interrupt, as a
    SIGTERM is: the command ends its children, says ``interrupted`` and exits 130."""
    (tmp_path / "hupdoor67.py").write_text(
        "from statemachine import State, StateChart\n\n\nclass Door(StateChart):\n"
        "    closed = State(initial=True)\n    open_ = State()\n"
        "    press = closed.to(open_) | open_.to(closed)\n")
    started = tmp_path / "started"
    # the test command says its pid, then sleeps until killed (never waited out)
    command = (f"{sys.executable} -c \"import os, pathlib, time; "
               f"pathlib.Path({str(started)!r}).write_text(str(os.getpid())); time.sleep(600)\"")
    number = getattr(signal, sig)

    def default_signals() -> None:  # (a background job of a shell ignores SIGQUIT: not here)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
        signal.signal(signal.SIGQUIT, signal.SIG_DFL)

    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec.cli", "charts", "mutate", "--chart", "hupdoor67:Door",
         "--test-cmd", command, "--timeout", "600"], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=default_signals)
    try:
        deadline = time.monotonic() + 120
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        child = int(started.read_text())
        proc.send_signal(number)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    try:
        assert proc.returncode == 130, err
        assert "calexec charts mutate: interrupted" in err, err
        deadline = time.monotonic() + 60
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the test command (pid {child}) runs on after the {sig}"
    finally:
        if _alive(child):  # (the defect: not left running past the test)
            os.kill(child, signal.SIGKILL)


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_hangup_ignored_when_the_command_starts_stays_ignored():
    """``nohup calexec bench soak ... &`` must outlive its terminal: a SIGHUP ignored when the
    command starts is not made an interrupt."""
    before = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with cliargs.sigterm_interrupts():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            assert callable(signal.getsignal(signal.SIGTERM))
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, before)


def _closing(*fds: int):
    """A ``preexec_fn`` closing ``fds`` in the child, as ``<&-``/``>&-`` does."""
    def close() -> None:
        for fd in fds:
            os.close(fd)
    return close


@pytest.mark.parametrize("argv", [
    ["--version"], ["charts", "paths", "calexec.machines.charts:JobChart"]],
    ids=["version", "charts-paths"])
def test_a_closed_stdout_is_one_line_exit_2_not_a_result_lost(argv):
    """``calexec charts paths M:C >&-`` (stdout closed by the shell or a supervisor): Python
    makes ``sys.stdout`` None, ``print`` wrote nothing, and the command exited 0 with its
    result lost. Now it is a stdout that cannot be written, as a full one: one line, exit 2."""
    done = subprocess.run([sys.executable, "-m", "calexec.cli", *argv],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          preexec_fn=_closing(1), timeout=120)
    assert done.returncode == cliargs.EXIT_CONFIG, done.stderr
    assert done.stderr.endswith("cannot write to stdout: Bad file descriptor\n"), done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


def test_closed_standard_descriptors_are_not_reused_for_files():
    """With stdin and stderr closed (``<&- 2>&-``) the next file calexec opened took
    descriptor 0, then 2: a report or a socket became the stdin or stderr its child
    processes inherit. They are /dev/null now, the next file gets a descriptor above 2."""
    script = ("import os, sys\nfrom calexec.cli import main\ncode = main(['--version'])\n"
              "fd = os.open(os.devnull, os.O_RDONLY)\nsys.stdout.write(f'\\n{code} {fd}\\n')\n")
    done = subprocess.run([sys.executable, "-c", script], stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                          preexec_fn=_closing(0, 2), timeout=120)
    code, fd = done.stdout.splitlines()[-1].split()
    assert code == "0", done.stdout
    assert int(fd) > 2, f"the next file opened took descriptor {fd}"
