"""What the CLI probe of stop 56 found in the commands other than ``serve`` and ``charts``,
each pinned (docs/traceability.md, "Found at stop 56 (cli)")."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from calexec import cli
from calexec.drivers.synthetic import calbin as calbin_fmt


@pytest.mark.parametrize(("content", "code", "said"), [
    (b"garbage", "calbin.invalid", "the loader refused it (ERR_FILE_FORMAT)"),
    (b"", "calbin.empty", "the file is empty"),
    (None, "calbin.invalid", "the loader refused it (ERR_INVALID_CALBIN)"),  # cut short
])
def test_golden_record_of_a_calbin_the_loader_refuses_names_it_before_the_warm_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None, code: str,
        said: str):
    """``golden record --calbin X`` with X garbage, empty or a synthetic calbin cut short
    started the executor: exit 3 and two lines, the executor's ``device lifecycle Failed:
    calrt.calbin_load_failed ... returned 12 (FILE_FORMAT)`` log line and the same Status
    again, the flag not named; now the check ``serve --calbin`` and a model switch run, one
    line naming ``--calbin``, exit 3 (a runtime refusal, as ``serve --calbin`` exits for it),
    no file written."""
    path = tmp_path / "model.calbin"
    if content is None:
        whole = calbin_fmt.dumps(calbin_fmt.default_spec())
        content = whole[:len(whole) // 2].rsplit(b"\n", 1)[0] + b"\n"
    path.write_bytes(content)
    out = tmp_path / "model.goldens.toml"
    code_ = cli.main(["golden", "record", "--calbin", str(path), "--out", str(out)])
    captured = capsys.readouterr()
    assert code_ == 3, captured.err
    assert captured.err.splitlines() == [
        f"calexec golden record: --calbin={str(path)!r}: not a valid calbin ({code}): "
        f"{'not a calbin the runtime loads: ' if code == 'calbin.invalid' else ''}{said}"]
    assert captured.out == "" and not out.exists()


def test_pingpong_trace_that_cannot_be_written_is_refused_before_the_run(
        capsys: pytest.CaptureFixture[str]):
    """``bench pingpong --trace /proc/x.json`` (a directory that exists but takes no new file:
    /proc, a read-only mount, one the user may not write in) ran every overlap setting, then
    failed writing the trace, exit 2 after the whole run (every setting at the default sizes); the
    check before the run looked only for a directory in the way or a missing parent."""
    trace = "/proc/calexec-probe56-trace.json"
    code = cli.main(["bench", "pingpong", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1",
                     "--trace", trace])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    assert captured.err.splitlines() == [  # (no progress line: nothing ran)
        f"calexec bench pingpong: --trace={trace!r}: cannot write it: No such file or directory"]
    assert captured.out == ""


def _alive(pid: int) -> bool:
    """``pid`` runs (not gone, not a zombie no one reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_ctrl_c_during_the_browser_shot_ends_the_browser(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch):
    """``calexec diagrams live`` runs headless Chromium in a session of its own, so a Ctrl-C
    at the terminal reaches only calexec: the KeyboardInterrupt left the browser (and its
    helpers) running after exit 130, writing its PNG later. Now it is killed, as on its
    timeout."""
    from calexec.drivers.tools.live_screenshots import chromium_capture

    pid_file = tmp_path / "browser.pid"
    fake = tmp_path / "bin" / "chromium"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}")
    main = threading.get_ident()

    def interrupt() -> None:  # the terminal's SIGINT, to the main thread blocked on the browser
        # (bounded by the capture's own timeout below: under load the fake browser took more
        # than the 20 s this allowed to start, the signal never came and the capture timed out)
        deadline = time.monotonic() + 150
        while not pid_file.exists() or not pid_file.read_text().strip():
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)
        signal.pthread_kill(main, signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        chromium_capture("http://127.0.0.1:9/", str(tmp_path), timeout=180.0)
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(pid)
    if alive:  # (the old code's browser: ended here, not left to the machine)
        os.kill(pid, signal.SIGKILL)
    assert not alive, "the browser ran on after the Ctrl-C"


@pytest.mark.parametrize(("argv", "said"), [
    (["--soak-seconds", "1"], "--soak-seconds=1: the soak gate needs at least 3 s in quick mode"),
    (["--full", "--soak-seconds", "30"],
     "--soak-seconds=30: the soak gate needs at least 60 s in full mode"),
])
def test_a_soak_too_short_to_judge_is_refused_not_failed(
        capsys: pytest.CaptureFixture[str], argv: list[str], said: str):
    """``accept --gates soak --soak-seconds 1`` ran the soak and failed it, exit 1, the RSS
    check "growing" on one sample per third (3 samples after the warm-up: noise); a shorter
    soak still was "only 2 samples after warm-up", failed too. Refused now before any gate
    runs, naming the flag and the least it takes, exit 2."""
    code = cli.main(["accept", "--gates", "soak", "--phase", "a", *argv])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"calexec accept: {said} "), lines
    assert captured.out == ""
