"""What the second CLI probe of stop 65 found with bad input, each pinned (docs/traceability.md,
"Found at stop 65 (cli2)"): a manifest or goldens file saved with a byte order mark, a chart
file named from its own directory, a Ctrl-C landing inside ``Popen()``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from calexec import cliargs
from calexec.cli import main as cli
from calexec.contracts.files import read_toml
from calexec.contracts.goldens import load_goldens
from calexec.contracts.manifest import load_manifest
from calexec.drivers.tools.bench import subproc
from test_cli import calexec

MANIFESTS = Path(__file__).resolve().parents[1] / "contracts" / "manifests"
BOM = b"\xef\xbb\xbf"


def _with_bom(tmp_path: Path) -> Path:
    """The bundled manifest and its goldens copied to ``tmp_path``, each as Notepad saves a
    UTF-8 file: a byte order mark first."""
    for name in ("qwen3_synthetic.toml", "qwen3_synthetic.goldens.toml"):
        (tmp_path / name).write_bytes(BOM + (MANIFESTS / name).read_bytes())
    return tmp_path / "qwen3_synthetic.toml"


def test_a_manifest_and_its_goldens_saved_with_a_byte_order_mark_load_as_without(tmp_path):
    """``--manifest m.toml`` (and the goldens next to it) saved with a UTF-8 byte order mark,
    as Notepad saves one, was refused as ``not valid TOML: Invalid statement (at line 1,
    column 1)``, naming nothing the user could see; it now reads as the same file without."""
    manifest = _with_bom(tmp_path)
    plain = load_manifest(MANIFESTS / "qwen3_synthetic.toml")
    read = load_manifest(manifest)
    assert (read.name, read.calrt_version, read.calbin_sha256, read.vocab_size,
            read.hidden_size, dict(read.submodels), read.ignored_models) == (
        plain.name, plain.calrt_version, plain.calbin_sha256, plain.vocab_size,
        plain.hidden_size, dict(plain.submodels), plain.ignored_models)
    assert dict(read.goldens) == dict(plain.goldens) != {}
    assert dict(load_goldens(tmp_path / "qwen3_synthetic.goldens.toml")) == dict(plain.goldens)


def test_demo_runs_on_a_manifest_saved_with_a_byte_order_mark(tmp_path):
    manifest = _with_bom(tmp_path)
    done = calexec("demo", "--seqs", "1", "--tokens", "1", "--manifest", str(manifest),
                   timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr)


def test_only_a_leading_mark_is_dropped_and_a_bad_byte_is_counted_from_the_file_start(
        tmp_path):
    """The mark is the encoding's only at the start (elsewhere it is text, and TOML refuses it
    there); a byte that is no UTF-8 is named at its place in the file, the mark counted
    (``utf-8-sig`` counted from after the mark: byte 2 for the file's byte 5)."""
    path = tmp_path / "x.toml"
    path.write_bytes(b'a = 1\n\xef\xbb\xbfb = 2\n')
    with pytest.raises(tomllib.TOMLDecodeError):
        read_toml(path)
    path.write_bytes(BOM + b"a=\xff")
    with pytest.raises(UnicodeDecodeError) as err:
        read_toml(path)
    assert err.value.start == 5
    with pytest.raises(cliargs.UserError, match="at byte 5"):
        cliargs.read_small_text("--x", path, 64, "a token")


def test_a_conformance_report_saved_with_a_byte_order_mark_is_read(tmp_path):
    """``--conform-report conformance.json`` opened and saved in an editor that writes a byte
    order mark was refused as ``invalid JSON: Unexpected UTF-8 BOM``; the mark is now
    dropped as the TOML inputs' is."""
    from calexec.drivers.calrt.conformance import load_run

    report = {"questions": [{"id": "reset.soft.aborts_jobs", "verdict": "proven"}]}
    (tmp_path / "conformance.json").write_bytes(BOM + json.dumps(report).encode())
    assert load_run(str(tmp_path))["questions"] == report["questions"]


@pytest.mark.parametrize("ref", ["doors.py:Door", "./doors.py:Door"])
def test_a_chart_file_named_from_its_own_directory_is_told_to_drop_the_py(
        tmp_path, monkeypatch, capsys, ref):
    """``calexec charts paths doors.py:Door`` run from the directory that holds doors.py
    was told to "run from the directory that holds it": where the user already was. It is
    now told to name the module without the .py (``doors:Door``), which imports from there."""
    (tmp_path / "doors.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)
    assert cli(["charts", "paths", ref]) == 2
    err = capsys.readouterr().err
    assert "run from the directory" not in err, err
    without = ".py" if ref == "doors.py:Door" else "the path and .py"
    assert (f"{ref.partition(':')[0]!r} is a file path, not a module name: name the module, "
            f"without {without}: doors:Door (imported from {tmp_path}, where the file is)"
            ) in err, err


def test_a_chart_file_path_that_names_no_file_says_so(tmp_path, monkeypatch, capsys):
    """``charts paths src/nope.py:Door`` with no such file was told to run from the directory
    that holds it (there is none); it is now told the file is not there."""
    (tmp_path / "src").mkdir()
    monkeypatch.chdir(tmp_path)
    assert cli(["charts", "paths", "src/nope.py:Door"]) == 2
    err = capsys.readouterr().err
    assert f"'src/nope.py' is no file in {tmp_path} (nor a module name)" in err, err
    assert "nope:Door for nope.py" in err, err


@pytest.fixture
def landing_in_popen(monkeypatch):
    """``subprocess.Popen`` whose child is started, then a signal raised in this process before
    the call returns: a Ctrl-C (or a SIGTERM made one) landing inside ``Popen()``, where it
    waits for the child's exec. Yields the started children; ends any left after the test."""
    real = subprocess.Popen
    started: list[subprocess.Popen] = []
    raised: list[int] = [signal.SIGINT]

    def popen(*args, **kwargs):
        proc = real(*args, **kwargs)
        started.append(proc)
        signal.raise_signal(raised[0])
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen)
    try:
        yield started, raised
    finally:
        for proc in started:
            if proc.poll() is None:  # (the old code's leak: not left to this run)
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize("call", ["run_group", "call_group"])
@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_interrupt_inside_popen_ends_the_child_it_started(landing_in_popen, call, sig):
    """A Ctrl-C (or a SIGTERM that ``calexec`` turns into one) landing inside ``Popen()``, the
    child started but its ``Popen`` not yet returned, raised out of ``run_group`` (make's
    build) or ``call_group`` (``charts cover``'s command) with no group to end: the child ran
    on after calexec had exited 130. The signal is now held until the child is recorded, then
    delivered: the group ends and the interrupt is raised as before."""
    started, raised = landing_in_popen
    raised[0] = getattr(signal, sig)
    argv = [sys.executable, "-c", "import time; time.sleep(600)"]  # (killed, never waited out)
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with cliargs.sigterm_interrupts(), pytest.raises(KeyboardInterrupt):
        if call == "run_group":
            subproc.run_group(argv, timeout=600)
        else:
            subproc.call_group(argv)
    assert len(started) == 1
    assert started[0].poll() is not None, "the child started inside Popen() runs on"
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_a_run_group_uninterrupted_keeps_its_result_and_the_handlers():
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    done = subproc.run_group([sys.executable, "-c", "print('out')"], timeout=120)
    assert (done.returncode, done.stdout) == (0, "out\n")
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before


def test_an_interrupt_inside_popen_of_charts_mutate_ends_the_command(
        landing_in_popen, tmp_path, monkeypatch, capsys):
    """``calexec charts mutate --test-cmd CMD``: a Ctrl-C landing inside the unmutated run's
    ``Popen()`` raised before the command was recorded to end, and CMD (calexec's whole suite
    by default) ran on after the interrupt. It is now ended as one landing after."""
    started, _ = landing_in_popen
    module = f"mutdoor_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(
        "from statemachine import State, StateChart\n\n\nclass Door(StateChart):\n"
        "    closed = State(initial=True)\n    open_ = State()\n"
        "    press = closed.to(open_) | open_.to(closed)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    command = f"{sys.executable} -c 'import time; time.sleep(600)'"  # (killed, never waited out)
    assert cli(["charts", "mutate", "--chart", f"{module}:Door", "--test-cmd", command]) == 130
    assert "calexec charts mutate: interrupted" in capsys.readouterr().err
    assert len(started) == 1
    assert started[0].wait(timeout=60) == -signal.SIGKILL, "the command runs on"
