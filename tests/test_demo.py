"""``calexec demo`` (README's first command) runs through the executor and matches the oracle."""

from calexec.drivers.tools import demo
from executor_harness import short_golden_deadline


def test_demo_runs_through_the_executor_and_matches_the_oracle(capsys):
    assert demo.main(["demo", "--seqs", "2", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "oracle match: yes" in out and "lifecycle Stopped" in out
    assert out.count("seq ") == 2 and "generation 1, lifecycle Ready" in out


def test_demo_runs_a_decode_slower_than_the_warm_up_deadline(capsys):
    """``--decode-us`` takes 0..60 s, but the warm-up's golden jobs waited 10 s each: a decode
    of 10.5 s failed the start (exit 3, ``wait.deadline``, the flag not named). The deadlines
    now follow the flag, and a run this slow says each step on stderr. (Here the same against
    a 1 s golden deadline and decodes of 1.5 s: a fifth of the time.)"""
    with short_golden_deadline(1.0):
        assert demo.main(["demo", "--seqs", "1", "--tokens", "1", "--decode-us", "1500000"]) == 0
    captured = capsys.readouterr()
    assert "oracle match: yes" in captured.out, captured.err
    assert "calexec demo: warm-up: a prefill and 2 decode steps of 1.5 s each" in captured.err
    assert "calexec demo: seq 1: prefill_ids at position 0" in captured.err
