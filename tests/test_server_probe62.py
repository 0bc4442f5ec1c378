"""Stop 62's server probe (docs/traceability.md "Found at stop 62 (server)"): a flag given
twice on a command line, and what the HTTP server answers to adversarial input. Loopback
servers on the bundled emulator; every wait bounded."""

from __future__ import annotations

import contextlib
import io

import pytest

from calexec import cli, cliargs


# ---- a single-value flag given twice -----------------------------------------------------------
def _run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's exit, as the console script sees it
            code = int(exc.code or 0)
    return code, out.getvalue(), err.getvalue()


#: a calbin that is not there: on the old code each command line below ended at once (no server
#: started, no device opened) with another refusal, so the test fails there rather than serves
ABSENT = ["--calbin", "/nonexistent/probe62.calbin"]


@pytest.mark.parametrize(("argv", "said"), [
    (["serve", *ABSENT, "--host", "127.0.0.1", "--host", "0.0.0.0"],
     "--host given twice with different values ('127.0.0.1', then '0.0.0.0')"),
    (["serve", *ABSENT, "--port", "1", "--port=2"], "--port given twice with different values (1, then 2)"),
    (["serve", *ABSENT, "--po", "1", "--port", "2"], "--port given twice with different values (1, then 2)"),
    (["serve", *ABSENT, "--port", "8000", "--grace", "1", "--port", "8001"],
     "--port given twice with different values (8000, then 8001)"),
    (["golden", "record", *ABSENT, "--out", "a.json", "--out", "b.json"],
     "--out given twice with different values ('a.json', then 'b.json')"),
    (["demo", *ABSENT, "--seqs", "1", "--seqs", "2"], "--seqs given twice with different values (1, then 2)"),
], ids=["serve-host", "serve-port-equals", "serve-port-abbreviated", "serve-port-apart",
        "golden-out", "demo-seqs"])
def test_a_single_value_flag_given_twice_with_different_values_is_refused_naming_both(argv, said):
    """``serve --host 127.0.0.1 --host 0.0.0.0`` (an operator's wrapper script appending a
    flag the command line already had) bound 0.0.0.0 without a word: argparse keeps the last
    value. Every command (``cliargs.Parser``) now refuses it in one line naming the flag and
    both values, exit 2, before anything starts."""
    code, out, err = _run(argv)
    assert code == cliargs.EXIT_CONFIG, err
    assert out == ""
    assert said in err and "give it once" in err
    assert err.count("\n") == 1


def test_the_same_value_twice_and_a_collecting_flag_repeated_are_taken():
    """What a repetition cannot make ambiguous is taken as before: the same value given twice,
    a switch given twice, a flag that collects (``action="append"``) given several times."""
    p = cliargs.parser("probe", None)
    p.add_argument("--port", type=cliargs.port, default=8000)
    p.add_argument("--once", action="store_true")
    p.add_argument("--only", action="append", default=[])
    args = p.parse_args(["--port", "1", "--once", "--port", "1", "--once",
                         "--only", "a", "--only", "b"])
    assert (args.port, args.once, args.only) == (1, True, ["a", "b"])
    args = p.parse_args([])
    assert (args.port, args.once, args.only) == (8000, False, [])


def test_a_switch_and_its_opposite_given_together_are_refused():
    """``--x`` and ``--no-x`` (one destination) given together: refused, naming both."""
    p = cliargs.parser("probe", None)
    p.add_argument("--stream", dest="stream", action="store_true")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    with pytest.raises(SystemExit) as exc, contextlib.redirect_stderr(io.StringIO()) as err:
        p.parse_args(["--stream", "--no-stream"])
    assert exc.value.code == cliargs.EXIT_CONFIG
    assert "--stream/--no-stream given twice with different values (True, then False)" in (
        err.getvalue())

