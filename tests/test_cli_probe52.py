"""Stop 52's probe of bad command lines and interruptions (docs/traceability.md, "Found at stop
52 (cliadmin)"): a Ctrl-C while a report is written leaves no report that looks complete, and
a Ctrl-C at the terminal (the whole process group) is the parent's to handle, never a line
from a child process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from calexec import cli, cliargs
from calexec.contracts.files import new_file_mode, process_umask
from calexec.drivers.tools.accept import report as accept_report
from calexec.drivers.tools.accept import run as accept_run
from calexec.drivers.tools.conform import isolate, overlap_trace
from calexec.drivers.tools.conform import runner as conform_runner


def _old_report(directory: Path, names: tuple[str, ...]) -> dict[str, str]:
    """A previous run's report in ``directory``: what must still be there, unchanged."""
    directory.mkdir(parents=True, exist_ok=True)
    files = {name: f"previous run's {name}\n" for name in names}
    for name, text in files.items():
        (directory / name).write_text(text)
    return files


def _contents(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir()}


def _interrupt(*args: object, **kwargs: object) -> None:
    raise KeyboardInterrupt


def _conform_result() -> dict:
    """A finished conform run with a timeline (so its report has trace.json and timing.png)."""
    span = {"phase": "parallel", "engine": 0, "job": 1, "stage": "compute", "start_us": 0.0,
            "end_us": 10.0}
    return {"runtime": "probe", "library": "probe.so", "bundled": True,
            "emulator_controls": True, "config": "", "quick": True, "questions": [],
            "settings": [], "experiments": {}, "timeline": [span]}


def test_conform_interrupted_while_its_report_is_written_leaves_the_previous_report(
        monkeypatch, tmp_path, capsys):
    """``conform --report DIR`` wrote trace.json, then rendered timing.png, then the JSON and
    the Markdown: a Ctrl-C during the PNG (about a second of matplotlib) left the new
    trace.json beside the previous run's conformance.json and .md (or, with no previous run,
    a trace.json alone); now the files replace the old ones together or not at all."""
    directory = tmp_path / "report"
    old = _old_report(directory, ("conformance.json", "conformance.md", "trace.json"))
    monkeypatch.setattr(conform_runner, "run", lambda *args, **kwargs: _conform_result())
    monkeypatch.setattr(overlap_trace, "write_png", _interrupt)
    code = cli.main(["conform", "--quick", "--report", str(directory)])
    assert code == 130, capsys.readouterr().err
    assert capsys.readouterr().err.strip() == "calexec conform: interrupted"
    assert _contents(directory) == old  # nothing new, nothing half written, no scratch left


def test_conform_report_written_whole_replaces_the_previous_one(monkeypatch, tmp_path, capsys):
    directory = tmp_path / "report"
    _old_report(directory, ("conformance.json",))
    monkeypatch.setattr(conform_runner, "run", lambda *args, **kwargs: _conform_result())
    monkeypatch.setattr(overlap_trace, "write_png",
                        lambda path, spans, title: Path(path).write_bytes(b"png"))
    assert cli.main(["conform", "--quick", "--report", str(directory)]) == 0
    assert sorted(p.name for p in directory.iterdir()) == [
        "conformance.json", "conformance.md", "timing.png", "trace.json"]
    assert json.loads((directory / "conformance.json").read_text())["runtime"] == "probe"


def _accept_report() -> dict:
    gate = {"passed": True, "metric": "m", "value": 1, "seconds": 0.1, "details": {}}
    return {"mode": "quick", "passed": True, "phases": ["a"], "started": "now", "seconds": 1,
            "gates": {"lengths_a": gate}, "sizes": {}, "environment": {},
            "series": {"latency_ms": {}, "rss_mib": {}}}


def test_accept_interrupted_while_its_report_is_written_leaves_the_previous_report(
        monkeypatch, tmp_path, capsys):
    """``accept --report DIR`` wrote report.json before report.md: a Ctrl-C between them left
    the new report.json (the machine-read one, complete) beside the previous run's report.md;
    now neither is replaced unless both are written."""
    directory = tmp_path / "report"
    old = _old_report(directory, ("report.json", "report.md"))
    monkeypatch.setattr(accept_run, "run_accept", lambda *args, **kwargs: _accept_report())
    monkeypatch.setattr(accept_report, "markdown", _interrupt)
    code = cli.main(["accept", "--gates", "lengths", "--phase", "a", "--report",
                     str(directory)])
    assert code == 130, capsys.readouterr().err
    assert _contents(directory) == old


def test_a_staged_report_is_all_or_nothing(tmp_path):
    directory = tmp_path / "out"
    old = _old_report(directory, ("a.json", "b.md"))
    with pytest.raises(KeyboardInterrupt):
        with cliargs.staged_report("--report", directory, ("a.json", "b.md")) as scratch:
            Path(scratch, "a.json").write_text("new")
            raise KeyboardInterrupt
    assert _contents(directory) == old
    # a file of the report that cannot replace its old one (a directory there): none moves
    os.remove(directory / "b.md")
    (directory / "b.md").mkdir()
    with pytest.raises(cliargs.UserError) as refused:
        with cliargs.staged_report("--report", directory, ("a.json", "b.md")) as scratch:
            Path(scratch, "a.json").write_text("new")
            Path(scratch, "b.md").write_text("new")
    assert str(refused.value) == (f"--report={str(directory)!r}: cannot write "
                                  f"{str(directory / 'b.md')!r}: Is a directory")
    assert (directory / "a.json").read_text() == old["a.json"]
    assert sorted(p.name for p in directory.iterdir()) == ["a.json", "b.md"]
    os.rmdir(directory / "b.md")
    with cliargs.staged_report("--report", directory, ("a.json", "b.md")) as scratch:
        Path(scratch, "a.json").write_text("new a")
        Path(scratch, "b.md").write_text("new b")
    assert _contents(directory) == {"a.json": "new a", "b.md": "new b"}


def test_an_isolated_experiment_ignores_the_terminals_ctrl_c():
    """A Ctrl-C at the terminal reaches conform's experiment child too (one process group):
    the child died of it and printed ``Process SpawnProcess-N:`` under the parent's
    ``interrupted``; now the child ignores SIGINT (the parent stops the run and kills it)."""
    sent: list[int] = []

    def ctrl_c(pid: int) -> None:
        os.kill(pid, signal.SIGINT)
        sent.append(pid)

    outcome = isolate.run_isolated("os:getpid", {}, 60.0, on_start=ctrl_c)
    assert outcome.status == isolate.OK, outcome
    assert outcome.result == sent[0]


@pytest.fixture
def synthetic_calbin(tmp_path: Path) -> str:
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "synthetic.calbin"
    calbin.write(str(path), calbin.default_spec())
    return str(path)


def test_golden_record_keeps_the_goldens_files_mode(synthetic_calbin, tmp_path, capsys):
    """``golden record`` wrote the goldens file through ``mkstemp`` and renamed it over the
    old one: a goldens file that was 0644 (read by a server running as another user) became
    0600, and a new one was 0600 whatever the umask; now the file keeps its mode, and a new
    one gets what ``open()`` would give it."""
    kept = tmp_path / "kept.goldens.toml"
    assert cli.main(["golden", "record", "--calbin", synthetic_calbin, "--out", str(kept)]) == 0
    assert kept.stat().st_mode & 0o777 == new_file_mode()
    kept.chmod(0o644)
    assert cli.main(["golden", "record", "--calbin", synthetic_calbin, "--out", str(kept),
                     "--note", "again"]) == 0
    assert kept.stat().st_mode & 0o777 == 0o644
    assert 'note = "again"' in kept.read_text()


def test_the_process_umask_is_read_without_being_changed():
    """The one reader of the umask (``contracts.files``; ``charts draw`` had a second one that
    set it to 0 and back, leaving another thread's new file world-writable meanwhile)."""
    code = ("import os\nos.umask(0o027)\n"
            "from calexec.contracts.files import new_file_mode, process_umask\n"
            "print(oct(process_umask()), oct(new_file_mode()), oct(os.umask(0o027)))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert run.stdout.split() == ["0o27", "0o640", "0o27"]
    assert new_file_mode() == 0o666 & ~process_umask()


def test_golden_record_out_naming_a_directory_by_its_slash_is_refused(synthetic_calbin,
                                                                        tmp_path, capsys):
    """``--out goldens/`` (a directory not made yet) wrote the goldens into a new file named
    ``goldens``, exit 0; now one line naming the flag, exit 2, before the warm-up runs."""
    out = f"{tmp_path / 'goldens'}/"
    code = cli.main(["golden", "record", "--calbin", synthetic_calbin, "--out", out])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err == (f"calexec golden record: --out={out!r}: names a directory; give the "
                   "goldens file to update (e.g. model.goldens.toml)\n")
    assert not (tmp_path / "goldens").exists()


def test_bench_servers_api_process_leaves_a_ctrl_c_to_the_bench(tmp_path):
    """``bench server``'s API process (``api_floor``) shares the terminal's process group: a
    Ctrl-C made it shut down and raise the signal again, a ``KeyboardInterrupt`` traceback
    under the bench's ``interrupted``; now it ignores SIGINT and ends when the bench closes
    its stdin, exit 0, nothing on stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "calexec.drivers.tools.bench.api_floor", "--socket",
         str(tmp_path / "engine.sock"), "--max-seconds", "120"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith("http://127.0.0.1:")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(input="", timeout=60)  # (stdin closed: the bench ended)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


@pytest.mark.parametrize("origin, said", [
    ("http://App.example", "the host must be written as a browser sends it, lowercase ASCII"),
    ("http://\u00e9t\u00e9.example", "the host must be written as a browser sends it"),
    ("http://app.example:80", "a browser leaves the default port 80 of http out of Origin: "
                              "write http://app.example"),
    ("https://app.example:443", "the default port 443 of https"),
    ("http://app.example:99999", "port 99999 is not a TCP port (1..65535)"),
    ("http://app.example:0", "port 0 is not a TCP port"),
    ("http://app.example:08080", "port 08080 is not a TCP port (1..65535) as a browser writes"),
])
def test_serve_refuses_a_cors_origin_no_browser_ever_sends(origin, said, capsys):
    """A browser writes ``Origin`` with a lowercase ASCII host (punycode) and without the
    scheme's default port, and the CORS middleware compares strings: these origins were
    taken and every page of them refused; now one line naming the flag, exit 2, before the
    server binds (as for an ``--api-key`` no request could carry)."""
    assert cli.main(["serve", "--once", "--cors-origin", origin]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"calexec serve: --cors-origin={origin!r}: ") and said in err, err
    assert len(err.splitlines()) == 1, err


@pytest.mark.parametrize("origin", ["*", "http://localhost:3000", "https://app.example",
                                    "http://127.0.0.1:5173", "https://xn--tt-bja.example:8443"])
def test_a_cors_origin_a_browser_sends_is_still_taken(origin):
    from calexec.drivers.serving.server import ServerConfig

    assert ServerConfig(cors_origins=(origin,)).cors_origins == (origin,)


def test_a_staged_report_names_a_file_that_cannot_be_written_as_the_reports(tmp_path):
    """A write that fails in the scratch directory (a full disk) is named as the report's
    file, never as the scratch file nobody asked for."""
    directory = tmp_path / "out"
    with pytest.raises(cliargs.UserError) as refused:
        with cliargs.staged_report("--report", directory, ("a.json", "b.md")) as scratch:
            raise OSError(28, "No space left on device", os.path.join(scratch, "a.json"))
    assert str(refused.value) == (f"--report={str(directory)!r}: cannot write "
                                  f"{str(directory / 'a.json')!r}: No space left on device")
    assert list(directory.iterdir()) == []
