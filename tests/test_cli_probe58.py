"""What the CLI probe of stop 58 found in the command-line entry points, each pinned
(docs/traceability.md, "Found at stop 58 (cli)")."""

from __future__ import annotations

import pytest

from calexec import cli


@pytest.mark.parametrize("seconds", ["0.01", "2.99"])
def test_a_chaos_gate_too_short_to_judge_is_refused_not_passed(
        capsys: pytest.CaptureFixture[str], seconds: str):
    """``accept --gates chaos --chaos-seconds 0.01`` ran one scheduled fault into ~16 requests
    and printed ``PASS chaos_a``, exit 0: a verdict on nearly nothing. Refused now before any
    gate runs, naming the flag, the value and the least it takes (as a soak too short to judge
    is), exit 2."""
    code = cli.main(["accept", "--gates", "chaos", "--phase", "a", "--json",
                     "--chaos-seconds", seconds])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"calexec accept: --chaos-seconds={seconds}: the chaos gate "
                               "needs at least 3 s "), lines
    assert captured.out == ""


def test_an_output_directory_that_takes_no_file_is_named_not_the_scratch_one(
        capsys: pytest.CaptureFixture[str]):
    """``charts names --out /proc/x.py`` (a directory that exists but takes no new file: a
    read-only mount, one the user may not write) said ``cannot write '/proc/.partial-3m707l3l'``,
    the name of the scratch directory the output is staged in, which the user never gave nor
    will find; it names the output the flag gave now."""
    code = cli.main(["charts", "names", "--out", "/proc/x.py"])
    captured = capsys.readouterr()
    assert code == 2, captured.err
    lines = captured.err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("calexec charts names: --out='/proc/x.py': cannot write it: "), lines
    assert ".partial-" not in lines[0]
    assert captured.out == ""
