"""Stop 53's probe of bad command lines, bad files and the admin endpoints (docs/traceability.md,
"Found at stop 53 (cliadmin)")."""

from __future__ import annotations

import errno
import io
import json
import sys
from pathlib import Path

import pytest

from calexec import cli
from calexec.drivers.tools.accept import run as accept_run
from calexec.drivers.tools.conform import overlap_trace
from calexec.drivers.tools.conform import runner as conform_runner


def _conform_result(timeline: bool) -> dict:
    spans = [{"phase": "parallel", "engine": 0, "job": 1, "stage": "compute", "start_us": 0.0,
              "end_us": 10.0}] if timeline else []
    return {"runtime": "probe", "library": "probe.so", "bundled": True,
            "emulator_controls": True, "config": "", "quick": True, "questions": [],
            "settings": [], "experiments": {}, "timeline": spans}


def test_a_conform_report_replaces_the_older_report_whole(monkeypatch, tmp_path, capsys):
    """``conform --report DIR`` over the report of a run with a timeline, by a run without
    one (a library whose overlap experiment was inconclusive): the new conformance.json /
    .md sat beside the older run's trace.json and timing.png, which the new report does not
    list (``artifacts: []``) but a reader takes for its own; now the report's own files this
    run did not write are removed, and a file of the user's in DIR stays."""
    directory = tmp_path / "report"
    monkeypatch.setattr(overlap_trace, "write_png",
                        lambda path, spans, title: Path(path).write_bytes(b"png"))
    monkeypatch.setattr(conform_runner, "run", lambda *args, **kwargs: _conform_result(True))
    assert cli.main(["conform", "--quick", "--report", str(directory)]) == 0
    (directory / "notes.txt").write_text("mine")
    (directory / "timing.png.d").mkdir()  # (a name like one of the report's: not its file)
    monkeypatch.setattr(conform_runner, "run", lambda *args, **kwargs: _conform_result(False))
    assert cli.main(["conform", "--quick", "--report", str(directory)]) == 0, \
        capsys.readouterr().err
    assert sorted(p.name for p in directory.iterdir()) == [
        "conformance.json", "conformance.md", "notes.txt", "timing.png.d"]
    assert json.loads((directory / "conformance.json").read_text())["artifacts"] == []
    assert (directory / "notes.txt").read_text() == "mine"


def _accept_report(series: bool) -> dict:
    gate = {"passed": True, "metric": "m", "value": 1, "seconds": 0.1, "details": {}}
    latency = {"lengths_a": [1.0, 2.0, 3.0]} if series else {}
    return {"mode": "quick", "passed": True, "phases": ["a"], "started": "now", "seconds": 1,
            "gates": {"lengths_a": gate}, "sizes": {}, "environment": {},
            "series": {"latency_ms": latency, "rss_mib": {}}}


def test_an_accept_report_without_plots_removes_the_older_runs_plots(monkeypatch, tmp_path,
                                                                     capsys):
    """``accept --report DIR`` of gates with no latency series (``--gates soak``'s RSS only,
    say) kept the older run's latency.png next to a report.md that does not show it."""
    directory = tmp_path / "report"
    monkeypatch.setattr(accept_run, "run_accept", lambda *args, **kwargs: _accept_report(True))
    args = ["accept", "--gates", "lengths", "--phase", "a", "--report", str(directory)]
    assert cli.main(args) == 0, capsys.readouterr().err
    assert (directory / "latency.png").exists()
    (directory / "run.log").write_text("mine")
    monkeypatch.setattr(accept_run, "run_accept", lambda *args, **kwargs: _accept_report(False))
    assert cli.main(args) == 0, capsys.readouterr().err
    assert sorted(p.name for p in directory.iterdir()) == ["report.json", "report.md",
                                                           "run.log"]


def test_a_start_whose_golden_job_stops_the_device_logs_its_failure_once(tmp_path, caplog):
    """A runtime that answers the warm-up's ``Wait`` with a compatibility error (8
    DRIVER_INCOMPATIBLE: a vendor library on the wrong driver) fails the start: the fault
    controller's STOP failed the lifecycle, then the start that golden job failed did again,
    and the log said ``device lifecycle Failed`` twice above the command's one line; now
    once, with the first reason, and the start answers it."""
    import logging

    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode
    from calexec.drivers.synthetic import calbin
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    runtime = CalRT.load()
    open_device = runtime.open_device

    def open_incompatible(config: str = ""):
        rc, device = open_device(config)
        assert device is not None and device.emu is not None
        assert device.emu.set_fault(Fault.WAIT_RC, FaultMode.EVERY_K, 1, 0, 8) == 0
        return rc, device

    runtime.open_device = open_incompatible  # type: ignore[method-assign]
    path = tmp_path / "synthetic.calbin"
    calbin.write(str(path), calbin.default_spec())
    executor = DeviceExecutor(runtime, load_manifest(default_manifest_path()),
                              ExecutorConfig(calbin_path=str(path)))
    with caplog.at_level(logging.INFO):
        status = executor.start()
        executor.shutdown(5.0)
    assert not status.ok and status.code == "calrt.wait_failed", status
    said = [r.getMessage() for r in caplog.records
            if r.getMessage().startswith("device lifecycle Failed")]
    assert said == [f"device lifecycle Failed: {status}"], said
    assert executor.state == "Failed"


def test_accept_on_a_calbin_with_no_pinned_golden_is_refused_before_the_run(tmp_path,
                                                                           capsys):
    """``accept --calbin X`` with a synthetic calbin no golden is pinned for (``calexec sim
    write-calbin --seed 7``): every gate's executor failed to start (``golden.unpinned``),
    and the run printed ``FAIL lengths_a lengths_correct = 0`` and ``accept quick: FAILED``,
    exit 1, as if the executor had failed its gates (the reason only in --json or the
    report); now one line naming --calbin and the command that pins its golden, exit 2,
    before any gate runs."""
    from calexec.drivers.synthetic import calbin

    path = tmp_path / "seed7.calbin"
    calbin.write(str(path), calbin.default_spec(seed=7))
    report = tmp_path / "report"
    code = cli.main(["accept", "--quick", "--gates", "lengths", "--phase", "a", "--calbin",
                     str(path), "--report", str(report)])
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    [line] = captured.err.splitlines()
    assert line.startswith(f"calexec accept: --calbin={str(path)!r}: no golden is pinned "
                           "for it (sha256 "), line
    assert line.endswith(f"run `calexec golden record --calbin {path}` first"), line
    assert not report.exists()  # (made for the run, removed empty since stop 64)


def _request(authorization: str):
    from starlette.requests import Request

    return Request({"type": "http", "method": "POST", "path": "/admin/drain",
                    "headers": [(b"authorization", authorization.encode("latin-1"))]})


def test_the_admin_token_is_read_from_the_header_as_the_api_key_is():
    """``Authorization: Bearer  TOKEN`` (two spaces: RFC 9110 allows more than one after
    the scheme; a script's ``"Bearer  $(cat token)"``) was the API key on ``/v1`` but a 403
    ``admin token does not match`` on ``/admin/*`` and ``/debug/jobs/{id}``, with the right
    token; now the admin token is read as the API key is."""
    from calexec.drivers.serving import openai_api
    from calexec.drivers.serving.admin import admin_refusal
    from calexec.drivers.serving.server import ServerConfig

    token = "probe53-admin-token"
    config = ServerConfig(admin_token=token, api_key=token)
    for header in (f"Bearer {token}", f"Bearer  {token}", f"bearer {token} ",
                   f"Bearer \t{token}"):
        assert openai_api.auth_refusal(_request(header), config.api_key) is None, header
        assert admin_refusal(_request(header), config) is None, header
    for header, code in (("Bearer   ", 401), ("Bearer", 401), (f"Bearer {token}x", 403),
                         (f"Basic {token}", 401)):
        refused = admin_refusal(_request(header), config)
        assert refused is not None and refused.status_code == code, header


class _Unwritable(io.StringIO):
    """A stdout whose every write fails as ``error`` says (its reader left, a full disk)."""

    def __init__(self, error: OSError) -> None:
        super().__init__()
        self.error = error

    def write(self, text: str) -> int:
        raise self.error


@pytest.mark.parametrize("error, code, said", [
    (BrokenPipeError(errno.EPIPE, "Broken pipe"), 141, ""),
    (OSError(errno.ENOSPC, "No space left on device"), 2,
     "calexec serve: cannot write to stdout: No space left on device\n"),
])
def test_serve_once_with_a_stdout_it_cannot_write_ends_as_any_command(monkeypatch, capsys,
                                                                       error, code, said):
    """``calexec serve --once | head -1`` (and ``> /dev/full``): the sample's thread printed
    the banner, the write failed, and the thread died in a ``BrokenPipeError`` (or
    ``StdoutError``) traceback, then ``the sample request failed (see above)`` although no
    request had failed; now, once the server drained, the exit is the console script's for a
    stdout that cannot be written: 141 and nothing said (the reader left), or one line, 2."""
    monkeypatch.setattr(sys, "stdout", _Unwritable(error))
    assert cli.main(["serve", "--once"]) == code
    assert capsys.readouterr().err == said


def _goldens_file(tmp_path: Path) -> Path:
    from calexec.contracts.goldens import PinnedGolden, pin

    out = tmp_path / "model.goldens.toml"
    pin(out, PinnedGolden("0" * 64, (1, 2), 1, (3, 4), "kept"))
    return out


def test_golden_record_refuses_a_note_that_is_not_utf8_text(tmp_path, capsys):
    """``golden record --note $'\\xff'`` (a byte that is not UTF-8; Python hands it over as
    the lone surrogate U+DCFF) was written to the goldens file as ``"\\udcff"``, which TOML
    refuses: the whole file, every golden in it, became unreadable, and with the default
    ``--out`` (the packaged manifest's goldens) every command failed to load the manifest;
    now a usage error naming ``--note``, exit 2, the file untouched."""
    from calexec.contracts.goldens import load_goldens
    from calexec.drivers.synthetic import calbin

    out = _goldens_file(tmp_path)
    before = out.read_bytes()
    path = tmp_path / "synthetic.calbin"
    calbin.write(str(path), calbin.default_spec())
    code = cli.main(["golden", "record", "--calbin", str(path), "--out", str(out), "--note",
                     "x\udcff"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("calexec golden record: error: argument --note: 'x\\udcff': not "
                          "UTF-8 text (byte 0xff at character 2)"), err
    assert out.read_bytes() == before
    assert [g.note for g in load_goldens(out)["0" * 64]] == ["kept"]


def test_golden_record_of_a_calbin_whose_name_is_not_utf8_keeps_the_file_readable(
        tmp_path, capsys):
    """The default note, ``recorded from NAME``, of a calbin whose file name has a byte that
    is not UTF-8 made the goldens file unreadable the same way; now that byte is U+FFFD in
    the note (the sha256 names the calbin) and the file loads, its other goldens kept."""
    from calexec.contracts.goldens import PinnedGolden, load_goldens
    from calexec.drivers.synthetic import calbin

    out = _goldens_file(tmp_path)
    path = tmp_path / "model\udcff.calbin"  # (the file name's bytes: b"model\xff.calbin")
    calbin.write(str(path), calbin.default_spec())
    assert cli.main(["golden", "record", "--calbin", str(path), "--out", str(out)]) == 0, \
        capsys.readouterr().err
    goldens = load_goldens(out)
    assert [g.note for g in goldens["0" * 64]] == ["kept"]
    assert [g.note for sha, gs in goldens.items() if sha != "0" * 64 for g in gs] == [
        "recorded from model\ufffd.calbin"]
    with pytest.raises(ValueError, match=r"PinnedGolden.note='x\\udcff': not Unicode text"):
        PinnedGolden("0" * 64, (1,), 0, (2,), "x\udcff")


@pytest.mark.parametrize("body, code, where", [
    ('{"calbin\\udcff": 1}', "dcff", None),  # (a key: its "unknown parameter" answer was a 500)
    ('{"calbin": "/tmp/model.calbin\\ud800"}', "d800", "calbin"),
    ('{"calbin": "x", "\\udfff": 1}', "dfff", None),
])
def test_an_admin_reload_body_with_a_lone_surrogate_escape_is_a_400(tmp_path, body, code, where):
    """``POST /admin/reload`` with a ``\\udcff`` escape in a key (Python's JSON parser takes a
    lone surrogate; the API's bodies are refused for one, a 400): the "unknown parameter"
    answer named the key, its JSON could not be encoded, and the client got a 500
    ``server.unexpected_error`` with a traceback in the server's log; now a 400 ``body:``
    naming the escape, as the API answers, nothing checked or moved. (Since stop 60 the
    message names where the escape is, the value's field or the key, as the API's does.)"""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    from test_server_support import started_executor

    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token="probe53-admin-token"))
        with TestClient(app, raise_server_exceptions=False) as client:
            r = client.post("/admin/reload", content=body.encode("ascii"),
                            headers={"Authorization": "Bearer probe53-admin-token",
                                     "content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        said = f"the escape \\u{code} is a lone surrogate, no Unicode character"
        assert error["message"].startswith(f"{where}: {said}" if where else
                                           "a key of the body ("), error
        assert said in error["message"], error
        assert error["param"] == where
        assert executor.state == "Ready" and executor.gen is not None and executor.gen.id == 1
    finally:
        executor.shutdown(5.0)


def test_charts_mutate_survives_a_test_command_and_output_that_are_not_utf8(tmp_path, capsys):
    """``charts mutate --test-cmd CMD`` whose test run prints a byte that is not UTF-8 (a test
    printing binary) ended the run at once, ``internal error: UnicodeDecodeError``, exit 70;
    and a ``--test-cmd`` (or ``--cwd``) with such a byte ran every mutant, then failed writing
    mutation.md, exit 70, the run's result lost. Now the output is read with U+FFFD for such
    a byte and the command shown with ``\\xff`` in the report, which is written."""
    report = tmp_path / "report"
    command = "sh -c 'printf \"\\377\"; exit 0' #\udcff"
    code = cli.main(["charts", "mutate", "--chart", "lifecycle", "--test-cmd", command,
                     "--jobs", "1", "--report", str(report)])
    err = capsys.readouterr().err
    assert code == 1, err  # (the command never imports the chart: every mutant an error)
    assert "internal error" not in err, err
    data = json.loads((report / "mutation.json").read_text(encoding="utf-8"))
    assert data["command"] == "sh -c 'printf \"\\377\"; exit 0' #\\xff"
    assert "#\\xff" in (report / "mutation.md").read_text(encoding="utf-8")
