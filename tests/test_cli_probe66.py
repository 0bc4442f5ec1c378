"""What the CLI probe of stop 66 found in a CLI's hostile environment, each pinned
(docs/traceability.md, "Found at stop 66 (cli)"): an interrupt landing in a worker thread's
``Popen()``, ``bench server``'s API process in the terminal's process group, an ASCII
stdout, an interrupt inside ``Popen()`` of ``diagrams live``'s browser,
a ``CALEXEC_TRANSITION_GATE`` that is neither 0 nor 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from calexec.cli import main as cli


def test_an_interrupt_while_a_mutate_worker_starts_its_command_ends_the_command(
        tmp_path, monkeypatch, capsys):
    """``calexec charts mutate --jobs N``: a Ctrl-C (or a SIGTERM made one) taken by the main
    thread while a worker thread was inside ``Popen()`` of a mutant's run (a worker thread
    holds no signal) ended the commands recorded, not the one being started: it was recorded
    after, ran on, and calexec, exit 130 said, waited on it for its whole timeout. It is now
    ended as it is recorded."""
    real = subprocess.Popen
    started: list[subprocess.Popen] = []
    released = threading.Event()

    def popen(*args, **kwargs):
        proc = real(*args, **kwargs)
        if threading.current_thread() is threading.main_thread():  # the unmutated run
            return proc
        started.append(proc)
        # the Ctrl-C reaches the main thread, waiting on the workers, while this one's
        # Popen() has not returned; it returns once the main thread has said "interrupted"
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        released.wait(120)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    module = f"mutdoor66_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "from statemachine import State, StateChart\n\n\nclass Door(StateChart):\n"
        "    closed = State(initial=True)\n    open_ = State()\n"
        "    press = closed.to(open_) | open_.to(closed)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    # (the unmutated run passes at once; a mutant's sleeps until killed, never waited out)
    command = (f"{sys.executable} -c \"import os, time; "
               f"os.environ.get('CALEXEC_CHART_MUTANT') and time.sleep(600)\"")
    try:
        assert cli(["charts", "mutate", "--chart", f"{module}:Door", "--test-cmd", command,
                    "--jobs", "1", "--timeout", "600"]) == 130
        assert "calexec charts mutate: interrupted" in capsys.readouterr().err
        released.set()
        assert len(started) == 1
        assert started[0].wait(timeout=60) == -signal.SIGKILL, "the mutant's command runs on"
    finally:
        released.set()
        for proc in started:
            if proc.poll() is None:  # (the old code's leak: not left to this run)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_bench_server_starts_its_api_process_out_of_the_terminal_s_ctrl_c(monkeypatch, capsys):
    """``calexec bench server``'s API process (the ``api_process_floor`` side) ran in the
    bench's process group, so a Ctrl-C at the terminal reached it too: before it ignored
    SIGINT (while Python imported uvicorn) or after uvicorn restored the handler, it printed
    a ``KeyboardInterrupt`` traceback of its own on the bench's terminal. It now runs in a
    session of its own, which the terminal's Ctrl-C does not reach; the bench ends it by
    closing its stdin, as before."""
    from calexec.drivers.tools.bench import server_overhead as bench_server

    real = subprocess.Popen
    sessions: list[int] = []

    def popen(args, *rest, **kwargs):
        proc = real(args, *rest, **kwargs)
        if "calexec.drivers.tools.bench.api_floor" in list(args):
            sessions.append(os.getsid(proc.pid))
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    assert bench_server.main(["bench", "server", "--json", "--requests", "2", "--max-tokens",
                              "2", "--decode-us", "0", "--concurrency", "1",
                              "--loadgen", "thread", "--no-stream", "--rounds", "1"]) == 0
    assert len(sessions) == 1
    assert sessions[0] != os.getsid(0), "the API process shares the terminal's Ctrl-C"


@pytest.mark.parametrize("argv", [["--help"], ["accept", "--help"], ["bench", "logits", "--help"]])
def test_help_on_an_ascii_stdout_writes_what_it_cannot_encode_escaped(argv):
    """``PYTHONIOENCODING=ascii calexec accept --help`` (stdout in ASCII, as a console's code
    page or a CI runner's setting makes it) failed on the help's first ``\u00a7``: the
    command's help was ``internal error: UnicodeEncodeError``, exit 70, and ``calexec --help``
    a traceback, exit 1. What the encoding cannot take is now written escaped (``\\xa7``, as
    Python writes it to stderr), the rest as it was, exit 0."""
    env = {**os.environ, "PYTHONIOENCODING": "ascii"}
    done = subprocess.run([sys.executable, "-m", "calexec.cli", *argv], capture_output=True,
                          env=env, timeout=120)
    assert (done.returncode, done.stderr) == (0, b""), done.stderr.decode(errors="replace")
    assert b"\\xa7" in done.stdout and b"usage: calexec" in done.stdout
    done.stdout.decode("ascii")  # (nothing but ASCII written)


def test_a_command_s_output_on_an_ascii_stdout_keeps_every_line(tmp_path, monkeypatch):
    """In process: print() of non-ASCII text to an ASCII stdout writes it escaped, and the
    lines around it, through ``calexec.cli.main``'s stdout."""
    import io

    from calexec import cli as cli_module

    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii", errors="strict", write_through=True)
    monkeypatch.setattr(sys, "stdout", stream)
    module = f"cafe66_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "from statemachine import State, StateChart\n\n\nclass Door(StateChart):\n"
        "    ferm\u00e9 = State(initial=True)\n    ouvert = State()\n"
        "    press = ferm\u00e9.to(ouvert) | ouvert.to(ferm\u00e9)\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli_module.main(["charts", "paths", f"{module}:Door"]) == 0
    stream.flush()
    out = raw.getvalue().decode("ascii")
    assert "ferm\\xe9" in out and "ouvert" in out, out


def test_an_interrupt_inside_popen_of_the_browser_shot_ends_the_browser(tmp_path, monkeypatch):
    """``calexec diagrams live``: a Ctrl-C (or a SIGTERM made one) landing inside ``Popen()``
    of headless Chromium, the browser started in a session of its own but its ``Popen`` not
    yet returned, raised with nothing to end: the browser ran on after exit 130 and wrote its
    PNG then. The interrupt is now held until the browser is recorded, then ends it."""
    from calexec.drivers.tools.live_screenshots import chromium_capture

    fake = tmp_path / "bin" / "chromium"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexec sleep 600\n")  # (killed, never waited out)
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    real = subprocess.Popen
    started: list[subprocess.Popen] = []

    def popen(*args, **kwargs):
        proc = real(*args, **kwargs)
        started.append(proc)
        signal.raise_signal(signal.SIGINT)  # (inside Popen(), the child started)
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        with pytest.raises(KeyboardInterrupt):
            chromium_capture("http://127.0.0.1:9/", str(tmp_path), timeout=600.0)
        assert len(started) == 1
        assert started[0].poll() is not None, "the browser started inside Popen() runs on"
    finally:
        for proc in started:
            if proc.poll() is None:  # (the old code's leak: not left to this run)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize(("argv", "said"), [
    (["bench", "charts", "--json", "--iters", "0"], "argument --iters: must be >= 1, got 0"),
    (["accept", "--json", "--gates", "nope"], "'nope' is not a gate"),
    (["bench", "recovery", "--json", "--calbin", "{tmp}/x.calbin"], "not a calbin"),
    (["conform", "--json", "--runtime-lib", "{tmp}/nope.so"], "nope.so"),
])
def test_a_json_command_that_fails_before_its_result_prints_nothing_on_stdout(
        argv, said, tmp_path, capsys):
    """README: with ``--json`` a command that fails before its result prints no JSON error
    object, nothing on stdout: its one line on stderr and the exit code (until stop 66 this
    was said nowhere, and a script reading stdout could not know what to expect)."""
    (tmp_path / "x.calbin").write_text("root:x:0:0\n")
    assert cli([a.format(tmp=tmp_path) for a in argv]) == 2
    out, err = capsys.readouterr()
    assert out == "", out
    lines = [line for line in err.splitlines() if line.startswith("calexec ")]
    assert len(lines) == 1 and said in lines[0], err


@pytest.mark.parametrize("value", ["off", "false", "no", "00"])
def test_a_transition_gate_variable_that_is_not_0_or_1_is_refused_naming_it(tmp_path, value):
    """``CALEXEC_TRANSITION_GATE=off pytest`` in a project with ``chart_coverage_min``: only
    ``0`` turned the gate off, so ``off`` or ``false`` kept it on, silently, and a partial
    suite failed the gate the user had turned off. Another value than 0 or 1 is now one usage
    error naming the variable and its value (pytest's exit 4)."""
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\ntestpaths = tests\nchart_coverage =\n    calexec.machines.charts:KvTxnChart\n"
        "chart_coverage_min = 100\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_sample.py").write_text("def test_nothing():\n    pass\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env["CALEXEC_TRANSITION_GATE"] = value
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    output = done.stdout + done.stderr
    assert done.returncode == 4, output
    assert (f"CALEXEC_TRANSITION_GATE={value!r}: give 0 to turn the configured "
            f"chart_coverage_min gate off, or 1 (or unset it) to keep it") in output, output
