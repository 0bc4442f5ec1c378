"""What the CLI probe of stop 56 found in the commands other than ``serve`` and ``charts``,
each pinned (docs/traceability.md, "Found at stop 56 (cli)")."""

from __future__ import annotations

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
    line naming ``--calbin``, exit 2 (a bad flag, as the command's help says), no file
    written."""
    path = tmp_path / "model.calbin"
    if content is None:
        whole = calbin_fmt.dumps(calbin_fmt.default_spec())
        content = whole[:len(whole) // 2].rsplit(b"\n", 1)[0] + b"\n"
    path.write_bytes(content)
    out = tmp_path / "model.goldens.toml"
    code_ = cli.main(["golden", "record", "--calbin", str(path), "--out", str(out)])
    captured = capsys.readouterr()
    assert code_ == 2, captured.err
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
