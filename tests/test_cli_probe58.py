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
