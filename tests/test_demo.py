"""``calexec demo`` (README's first command) runs through the executor and matches the oracle."""

from calexec.drivers.tools import demo


def test_demo_runs_through_the_executor_and_matches_the_oracle(capsys):
    assert demo.main(["demo", "--seqs", "2", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "oracle match: yes" in out and "lifecycle Stopped" in out
    assert out.count("seq ") == 2 and "generation 1, lifecycle Ready" in out
