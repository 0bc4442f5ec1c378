"""What the CLI probe of stop 57 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 57 (cli)")."""

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
from calexec.drivers.device_spec import emulated_latency_us, with_emulated_latency
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.machines.executor import ExecutorConfig
from executor_harness import GOLDEN_DEADLINE_PRE, short_golden_deadline
from proc_table import stat_rows

#: an emulated prefill of 0.12 s per token: the warm-up's 17-token golden prefill takes 2.04 s,
#: past the golden job's deadline (``ExecutorConfig.golden_timeout_s``), which these tests make
#: 1 s (``short_golden_deadline``): as 0.59 s a token past the default 10 s, in a fifth of the time
SLOW_PREFILL = "prefill_per_token_us=120000"


def test_emulated_latency_moves_the_deadlines_out_by_the_job_it_costs():
    base = ExecutorConfig(calbin_path="model.calbin",
                          device_config="h2d_us=1000;decode_us=20000000;d2h_us=2000;"
                                        "prefill_per_token_us=500000;kv_blocks=64")
    assert emulated_latency_us(base.device_config) == {
        "h2d_us": 1000, "decode_us": 20000000, "d2h_us": 2000, "prefill_per_token_us": 500000}
    config = with_emulated_latency(base)
    # the golden's longest job: the transfers and the slower of a decode (20 s) and the
    # 17-token prefill (8.5 s)
    assert config.golden_timeout_s == pytest.approx(base.golden_timeout_s + 20.003)
    assert config.execution_timeout_s == pytest.approx(base.execution_timeout_s + 20.003)
    assert config.execution_timeout_per_token_s == pytest.approx(
        base.execution_timeout_per_token_s + 0.5)
    plain = ExecutorConfig(calbin_path="model.calbin", device_config="kv_blocks=64;decode_us=x")
    assert with_emulated_latency(plain) == plain


def test_golden_record_with_an_emulated_prefill_slower_than_the_warm_up_deadline(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    """``golden record --device-config prefill_per_token_us=590000`` (the emulator takes up to
    60 s) failed its warm-up, exit 3, ``wait.deadline ... (job_id=1 seq_id=0 ...)``, neither
    the flag nor the key named: each golden job waited ``golden_timeout_s`` (10 s) whatever
    latency the device was asked for. The deadlines now grow by it. (Here 1 s and 0.12 s a
    token: ``SLOW_PREFILL``.)"""
    calbin = tmp_path / "model.calbin"
    calbin.write_bytes(calbin_fmt.dumps(calbin_fmt.default_spec()))
    out = tmp_path / "model.goldens.toml"
    with short_golden_deadline(1.0):
        code = cli.main(["golden", "record", "--calbin", str(calbin), "--out", str(out),
                         "--device-config", SLOW_PREFILL])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert out.exists() and "wait.deadline" not in captured.err


def test_serve_once_with_an_emulated_prefill_slower_than_the_warm_up_deadline():
    """``serve --once --device-config prefill_per_token_us=590000``: the same warm-up failure,
    exit 3 (``executor failed to start: wait.deadline``); now the server starts and its
    sample request (16 prompt tokens, 9.4 s) is answered. (Here against a 1 s golden deadline,
    ``SLOW_PREFILL``: the warm-up's prefill 2.04 s, the sample request 1.92 s.)"""
    code = (f"{GOLDEN_DEADLINE_PRE.format(seconds=1.0)}\nimport sys\nfrom calexec.cli import main\n"
            f"sys.exit(main(['serve', '--once', '--device-config', {SLOW_PREFILL!r}]))")
    run = subprocess.run([sys.executable, "-c", code],
                         capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert run.returncode == 0, run.stderr
    assert "drained: executor Stopped; exit 0" in run.stdout


def test_conform_timeout_is_said_as_given(capsys: pytest.CaptureFixture[str]):
    """``conform --timeout 0.04``: the experiment's evidence said ``did not finish within 0.0 s
    (child killed)``, a timeout of nothing, not the one given."""
    code = cli.main(["conform", "--quick", "--only", "parallel", "--timeout", "0.04", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    evidence = {q["evidence"] for q in report["questions"] if q["id"].startswith("parallel.")}
    assert evidence == {"experiment did not finish within 0.04 s (child killed): the runtime hung"}


@pytest.mark.parametrize("argv", [
    ["bench", "faults", "--faults", "1"],
    ["bench", "soak", "--requests", "10", "--faults", "0"],
    ["diagrams", "live", "--seconds", "1", "--job-out", ""],
])
def test_clients_beyond_what_a_load_command_starts_are_refused(argv: list[str]):
    """``--clients 100000`` was taken: ``bench faults`` then started a hundred thousand client
    threads before its first fault, minutes without a line (``bench soak`` the same, after
    one progress line), where ``bench server --concurrency`` takes 1..256; now the same bound,
    one line naming the flag, exit 2, before anything starts. (A subprocess, bounded: the old
    code ran on.)"""
    run = subprocess.run([sys.executable, "-m", "calexec.cli", *argv, "--clients", "257"],
                         capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert run.returncode == 2, run.stderr
    assert run.stderr.splitlines() == [
        f"calexec {' '.join(argv[:2])}: error: argument --clients: must be in 1..256, got 257 "
        f"(see calexec {' '.join(argv[:2])} --help)"]


@pytest.mark.parametrize("argv", [
    ["demo", "--seqs", "1", "--tokens", "1"],
    ["bench", "recovery", "--recoveries", "1"],
    ["bench", "pingpong", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1"],
    ["accept", "--gates", "correctness"],
])
def test_a_calbin_the_manifest_does_not_describe_is_named_before_the_start(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]):
    """``sim write-calbin --hidden 63 c.calbin`` writes a synthetic calbin the packaged
    manifest (hidden 64) does not describe; ``demo --calbin c.calbin`` (and the benches, the
    gates) started the executor: exit 3 and two lines, the executor's ``device lifecycle
    Failed: manifest.tensor_mismatch ...`` log line and the Status again, the flag not named,
    where ``serve --calbin`` and ``golden record --calbin`` name it before the start. Now the
    same check and line, exit 3."""
    calbin = tmp_path / "h63.calbin"
    assert cli.main(["sim", "write-calbin", "--hidden", "63", str(calbin)]) == 0
    capsys.readouterr()
    code = cli.main([*argv, "--calbin", str(calbin)])
    captured = capsys.readouterr()
    assert code == 3, captured.err
    command = " ".join(argv[:2]) if argv[0] == "bench" else argv[0]
    assert captured.err.splitlines() == [
        f"calexec {command}: --calbin={str(calbin)!r}: not a valid calbin "
        "(calbin.manifest_mismatch): manifest.tensor_mismatch: model "
        "'qwen3_prefill_embeds_s40960_b1' tensor 'inputs_embeds': shape "
        "manifest=[1, 40960, 64] runtime=[1, 40960, 63]"]
    assert captured.out == ""


def test_conform_takes_the_library_of_calexec_calrt_lib(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch):
    """README: every command that opens a device, ``conform`` included, takes
    ``$CALEXEC_CALRT_LIB`` as its ``--runtime-lib``; ``conform`` built and measured the bundled
    emulator whatever the variable named (exit 0, a report of the wrong library). Now the
    variable's library is the one measured, named as the variable when it cannot load."""
    lib = tmp_path / "libvendor.so"
    lib.write_bytes(b"not a shared library")
    monkeypatch.setenv("CALEXEC_CALRT_LIB", str(lib))
    code = cli.main(["conform", "--quick", "--only", "parallel", "--json"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"calexec conform: $CALEXEC_CALRT_LIB={str(lib)!r}: cannot load it: "), captured.err
    assert captured.out == ""


def test_bench_charts_says_what_it_measures(capsys: pytest.CaptureFixture[str]):
    """``bench charts`` at its default size ran seconds (14 s on a loaded 2-core machine)
    without a line, where every other bench says what it runs on stderr; it now says each form
    as it starts it, and stdout is still the one JSON object."""
    assert cli.main(["bench", "charts", "--json", "--iters", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "bench charts: 3 jobs on the compiled charts",
        "bench charts: compiled charts: jobs 3/3",  # (each loop's count: stop 59)
        "bench charts: 3 jobs on python-statemachine (the baseline)",
        "bench charts: python-statemachine: jobs 3/3"]
    assert json.loads(captured.out)["iters"] == 3


def _alive(pid: int) -> bool:
    """The process runs (a zombie, ended but not reaped by a container's init, does not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _interrupt(proc: subprocess.Popen, pid_file: Path, sig: signal.Signals,
               start_s: float = 60.0) -> tuple[bool, str]:
    """Once the child calexec starts has written its pid to ``pid_file`` (bounded by
    ``start_s``), send ``sig`` to calexec; then (whether that child still ran 5 s after calexec
    ended, calexec's stderr). A child left running is killed here, not left to the machine
    (the old code's: it may hold calexec's stderr, read after it)."""
    try:
        deadline = time.monotonic() + start_s
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=60)
        child = int(pid_file.read_text())
        deadline = time.monotonic() + 5
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        alive = _alive(child)
        if alive:
            os.kill(child, signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    return alive, err


def _children(parent: int) -> list[int]:
    """The processes whose parent is ``parent``."""
    return [pid for pid, _, ppid, _ in stat_rows() if ppid == parent]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_during_the_unmutated_run_ends_the_test_command(
        tmp_path: Path, sig: signal.Signals):
    """``charts mutate`` runs the test command in a session of its own, so a Ctrl-C at the
    terminal reaches only calexec: during the unmutated run (calexec's whole suite by
    default) it left the command running after exit 130 (a SIGTERM: calexec ended at once,
    the command ran on). Now the command's process group is killed, as during the mutants'
    runs."""
    pid_file = tmp_path / "test-cmd.pid"
    script = tmp_path / "slow_test.py"
    script.write_text("import os, time\n"
                      f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "calexec.cli", "charts", "mutate",
                             "--chart", "job", "--sample", "1", "--cwd", str(tmp_path),
                             "--test-cmd", f"{sys.executable} {script}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    alive, err = _interrupt(proc, pid_file, sig)
    assert not alive, f"the test command ran on after the {sig.name}"
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "calexec charts mutate: interrupted"


def test_a_sigterm_during_conform_ends_its_experiment_child_quietly():
    """``timeout 60 calexec conform`` (a SIGTERM): calexec ended by the signal and its
    experiment child ran on, to the end of its experiment (up to its timeout, 120 s by
    default), then printed two ``BrokenPipeError`` tracebacks on the terminal. A SIGTERM is
    now an interrupt as a Ctrl-C is: the child is killed, exit 130, one line."""
    proc = subprocess.Popen([sys.executable, "-m", "calexec.cli", "conform", "--quick",
                             "--only", "parallel", "--config", "decode_us=2000000", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    children: list[int] = []
    try:
        assert proc.stderr is not None
        deadline = time.monotonic() + 120
        for line in proc.stderr:  # (bounded by the run's own timeout, 30 s per experiment)
            if line.startswith("[conform] experiment parallel ...") or time.monotonic() > deadline:
                break
        deadline = time.monotonic() + 30
        while not children and time.monotonic() < deadline:  # the experiment's spawn child
            children = _children(proc.pid)
            time.sleep(0.05)
        assert children, "no experiment child"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    deadline = time.monotonic() + 5
    while any(_alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = [pid for pid in children if _alive(pid)]
    for pid in left:  # (the old code's child: ended here, not left to the machine)
        os.kill(pid, signal.SIGKILL)
    assert not left, "the experiment's child ran on after the SIGTERM"
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.splitlines()[-1] == "calexec conform: interrupted"


def test_a_sigterm_during_the_browser_shot_ends_the_browser(tmp_path: Path):
    """``diagrams live`` runs headless Chromium in a session of its own; a Ctrl-C killed it
    (stop 56), but a SIGTERM ended calexec by the signal and left the browser running. A
    SIGTERM is now an interrupt: the browser is killed, exit 130."""
    pid_file = tmp_path / "browser.pid"
    fake = tmp_path / "bin" / "chromium"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-m", "calexec.cli", "diagrams", "live",
                             "--seconds", "0.5", "--clients", "1", "--job-out", "",
                             "--out", str(tmp_path / "live.png")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL, env=env)
    alive, err = _interrupt(proc, pid_file, signal.SIGTERM, start_s=90)
    assert not alive, "the browser ran on after the SIGTERM"
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "calexec diagrams live: interrupted"


def test_a_sigterm_during_charts_cover_ends_the_test_command(tmp_path: Path):
    """``timeout 600 calexec charts cover ... -- python -m pytest``: the SIGTERM ended calexec
    by the signal and left the test command running (a Ctrl-C at a terminal reaches both,
    and ``subprocess.call`` kills the command on it). A SIGTERM is now an interrupt: the
    command is killed, exit 130."""
    pid_file = tmp_path / "test-cmd.pid"
    script = tmp_path / "slow_test.py"
    script.write_text("import os, time\n"
                      f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
                      "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-m", "calexec.cli", "charts", "cover", "--chart",
                             "calexec.machines.charts:JobChart", "--", sys.executable,
                             str(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    alive, err = _interrupt(proc, pid_file, signal.SIGTERM)
    assert not alive, "the test command ran on after the SIGTERM"
    assert proc.returncode == 130, err
    assert err.splitlines()[-1] == "calexec charts cover: interrupted"
