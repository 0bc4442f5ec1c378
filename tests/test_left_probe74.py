"""Stop 74 (left): defects stop 73 found and left, each proven here.

* numbers a command reads itself (``bench soak --max-tokens LO-HI``, its ``--decode-us``
  phases, ``bench overhead --decode-us``, ``bench server --concurrency``, ``charts mutate
  --timeout``/``--error-codes``, a coverage gate's percentage, ``$CALEXEC_EXPLORE_WATCHDOG_S``,
  the load generator's flags) went through Python's ``int()``/``float()``, which read ``1_0``
  as 10 and ``٣`` (an Arabic-Indic digit) as 3, where every other number of the command line
  is refused unless written in ASCII digits;
"""

from __future__ import annotations

import contextlib
import io

import pytest

#: what Python's int() and float() read that the command line does not: an underscore between
#: digits, and a Unicode digit that is not ASCII (ARABIC-INDIC DIGIT THREE)
NOT_ASCII = ["1_0", "\u0663"]


def _cli(argv: list[str]) -> tuple[int, str, str]:
    from calexec import cli
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


# ---- 1. numbers a command reads itself, in ASCII digits ------------------------------------
@pytest.mark.parametrize("value", NOT_ASCII)
@pytest.mark.parametrize(("flag", "template"), [
    ("--max-tokens", "{v}"), ("--max-tokens", "4-{v}"), ("--max-tokens", "{v}-8"),
    ("--decode-us", "{v}"), ("--decode-us", "0,{v}"), ("--decode-us", "0:{v},2000"),
    ("--rss-bound-mib", "{v}"),
])
def test_bench_soak_refuses_a_number_not_in_ascii_digits_naming_flag_and_value(
        flag, template, value):
    """``bench soak --max-tokens 1_0-2_0`` ran requests of 10 to 20 tokens and
    ``--decode-us 0:٣`` gave the first phase a share of 3: refused before the run, exit 2, one
    line naming the flag and the value."""
    given = template.format(v=value)
    code, out, err = _cli(["bench", "soak", "--json", flag, given])
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err and (repr(given) in err or given in err), err


def test_bench_soak_still_takes_its_numbers_written_in_ascii():
    from calexec.drivers.tools.bench import soak
    assert soak.parse_range(" 4-8") == (4, 8)
    phases = soak.parse_phases("0:1.5, 2000:0.5")
    assert [(p.decode_us, p.share) for p in phases] == [(0, 0.75), (2000, 0.25)]


@pytest.mark.parametrize("value", NOT_ASCII)
@pytest.mark.parametrize("argv", [
    ["bench", "overhead", "--decode-us", "2000,{v}"],
    ["bench", "server", "--concurrency", "1,{v}"],
    ["charts", "mutate", "--timeout", "{v}"],
    ["charts", "mutate", "--error-codes", "3,{v}"],
    ["charts", "mutate", "--fail-under", "{v}"],
    ["charts", "cover", "--chart", "calexec.machines.charts:JobChart", "--min", "{v}", "--",
     "true"],
])
def test_every_list_or_percentage_a_command_reads_refuses_what_is_not_ascii(argv, value):
    """The comma lists and percentages a command parses itself took ``1_0`` and ``٣``;
    now refused as a flag's integer is, exit 2, one line naming the flag."""
    argv = [a.format(v=value) for a in argv]
    flag = next(a for a in argv if "{v}" not in a and a.startswith("--") and
                argv[argv.index(a) + 1].endswith(value))
    code, out, err = _cli(argv)
    assert code == 2 and out == "", (code, out, err)
    assert len(err.strip().splitlines()) == 1, err
    assert flag in err, err


@pytest.mark.parametrize("value", [*NOT_ASCII, "9\u0660", "5_0%"])
def test_a_coverage_gate_refuses_a_percentage_not_in_ascii_digits(value):
    """``--chart-coverage-min``, ``chart_coverage_min`` (pyproject), ``charts cover --min``
    and ``charts mutate --fail-under`` read ``1_0`` as 10 %."""
    from calexec.machines.coverage import gate_percentage
    assert gate_percentage(value) is None
    assert gate_percentage(" 90 % ") == 90.0 and gate_percentage("1e1") == 10.0


@pytest.mark.parametrize("value", NOT_ASCII)
def test_the_explorer_watchdog_variable_refuses_a_number_not_in_ascii(monkeypatch, value):
    from calexec.drivers.tools import explore
    monkeypatch.setattr(explore, "WATCHDOG_S", None)
    monkeypatch.setenv(explore.WATCHDOG_ENV, value)
    with pytest.raises(ValueError, match=rf"^{explore.WATCHDOG_ENV}="):
        explore.watchdog_s()
    monkeypatch.setenv(explore.WATCHDOG_ENV, " 120 ")
    assert explore.watchdog_s() == 120.0


@pytest.mark.parametrize("value", NOT_ASCII)
@pytest.mark.parametrize("argv", [
    ["--url", "http://127.0.0.1:1", "--requests", "{v}", "--concurrency", "1",
     "--max-tokens", "1"],
    ["--url", "http://127.0.0.1:1", "--requests", "1", "--concurrency", "1",
     "--max-tokens", "1", "--warmup", "{v}"],
])
def test_the_load_generator_refuses_a_count_not_in_ascii(argv, value, capsys):
    """``python -m calexec.drivers.tools.bench.loadgen`` (docs/benchmarks.md) read its counts
    with ``int()``."""
    from calexec.drivers.tools.bench import loadgen
    with pytest.raises(SystemExit) as exc:
        loadgen.main([a.format(v=value) for a in argv])
    assert exc.value.code == 2
    assert "not an integer" in capsys.readouterr().err


def test_the_api_floor_refuses_seconds_not_in_ascii(capsys):
    from calexec.drivers.tools.bench import api_floor
    with pytest.raises(SystemExit) as exc:
        api_floor.main(["--socket", "/nonexistent", "--max-seconds", "1_0"])
    assert exc.value.code == 2
    assert "--max-seconds" in capsys.readouterr().err
