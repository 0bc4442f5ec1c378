"""Small gaps found by stop 67's probes, closed at stop 67 (docs/traceability.md, "Found at stop
67 (gaps)")."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from statemachine import State, StateMachine

from calexec.machines.chart_contracts import ContractViolation, enable_contracts, invariant
from calexec.machines.chartref import load_chart

PRET = '''
from statemachine import State, StateChart


class Prêt(StateChart):
    rangé = State(initial=True)
    perdu = State(final=True)

    perdre = rangé.to(perdu)
'''


def test_a_non_ascii_class_name_is_found_whatever_the_locale_decoded_it_as(tmp_path):
    """``pret:Prêt`` decoded under an ASCII locale (surrogateescape: 'Pr\\udcc3\\udcaat') was
    "module 'pret' has no attribute": the class part is now taken as its UTF-8 bytes."""
    (tmp_path / "pret.py").write_text(PRET, encoding="utf-8")
    escaped = "pret:" + "Prêt".encode().decode("ascii", "surrogateescape")
    assert load_chart(escaped, str(tmp_path)).__name__ == "Prêt"


def test_charts_paths_of_a_non_ascii_class_runs_under_an_ascii_locale(tmp_path):
    """``LC_ALL=C PYTHONUTF8=0 calexec charts paths pret:Prêt`` was exit 2, "has no
    attribute 'Pr\\udcc3\\udcaat'" (every chart command: they share ``load_chart``)."""
    (tmp_path / "pret.py").write_text(PRET, encoding="utf-8")
    env = {**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0"}
    env.pop("PYTHONIOENCODING", None)
    code = ("import sys; from calexec.cli import main\n"
            "assert sys.getfilesystemencoding() == 'ascii', sys.getfilesystemencoding()\n"
            "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", code, "charts", "paths", "pret:Prêt"],
                          cwd=tmp_path, env=env, capture_output=True, timeout=120)
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, err
    assert b"perdre" in done.stdout, done.stdout


class Bare(StateMachine):
    """A chart that declares no contract."""

    off = State(initial=True)
    on = State()
    flip = off.to(on) | on.to(off)


class Checked(StateMachine):
    """A chart whose invariant every run breaks on entering ``on``."""

    off = State(initial=True)
    on = State()
    flip = off.to(on) | on.to(off)

    @invariant("on")
    def never_on(model: object) -> bool:
        return False


def test_enable_contracts_of_a_chart_declaring_none_is_refused_naming_it() -> None:
    """``enable_contracts(Bare)`` of a chart with no contract returned a monitor that checked
    nothing, silently (docs/framework.md "Contracts on a chart"); it is now a ``ValueError``
    naming the chart, as ``--chart-contracts`` and the explorer's ``charts`` refuse it, and a
    refusal leaves no chart given with it enabled."""
    with pytest.raises(ValueError, match=r"^enable_contracts\(Bare\): Bare declares no "
                                         r"contracts, so none would be checked \(declare them"):
        enable_contracts(Bare)
    with pytest.raises(ValueError, match="Bare declares no contracts"):
        enable_contracts(Checked, Bare)
    Checked().send("flip")  # (Checked was not enabled by the refused call: no violation)
    monitor = enable_contracts()  # no chart: a monitor checking nothing, as the explorer asks
    monitor.disable()
    monitor = enable_contracts(Checked)  # the control: a chart with a contract is checked
    try:
        with pytest.raises(ContractViolation, match="never_on"):
            Checked().send("flip")
    finally:
        monitor.disable()
