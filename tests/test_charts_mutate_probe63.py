"""``calexec charts mutate`` on a user's chart whose module a mutant makes unimportable (stop
63, found by a newcomer's probe): a chart module that declares a subclass of the chart
(``ReferenceLoan(BookLoan)``) is refused by python-statemachine as it is imported once a
mutant left a state unreachable in the base. With the coverage plugin configured as
docs/framework.md step 4 recommends (``chart_coverage`` in the pytest configuration), the
plugin's import of that module was a pytest usage error (exit 4), which the runner judges an
**error** ("exit code 4", no reason): 11 of 42 mutants of the probe's chart. The tests cannot
run against such a mutant, so it is killed, as it is without the plugin (a collection error)."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from calexec.drivers.tools import charts_mutate

LOAN = '''
from statemachine import State, StateMachine


class Loan(StateMachine):
    shelved = State(initial=True)
    lent = State()
    lost = State(final=True)

    checkout = shelved.to(lent)
    give_back = lent.to(shelved)
    write_off = lent.to(lost)


class ReferenceLoan(Loan):
    """Declared in the chart's own module: python-statemachine checks it as it is made."""
'''

LOAN_TESTS = '''
from loan import Loan


def test_a_loan_goes_out_and_comes_back():
    loan = Loan()
    loan.checkout()
    loan.give_back()
    assert loan.shelved.is_active
'''


@pytest.fixture(autouse=True)
def _forget_loan(monkeypatch):
    """The runner imports --chart modules from --cwd: undo that after each test."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield
    sys.modules.pop("loan", None)


@pytest.mark.parametrize("plugin", [True, False], ids=["chart_coverage", "no-plugin"])
def test_a_mutant_that_makes_the_chart_module_unimportable_is_killed(tmp_path, capsys, plugin):
    (tmp_path / "loan.py").write_text(textwrap.dedent(LOAN))
    (tmp_path / "test_loan.py").write_text(textwrap.dedent(LOAN_TESTS))
    if plugin:  # docs/framework.md step 4: the plugin configured in the user's pytest.ini
        (tmp_path / "pytest.ini").write_text("[pytest]\nchart_coverage = loan:Loan\n")
    dropped = "drop:shelved-checkout->lent"  # lent, then lost: unreachable
    status, out = charts_mutate.main([
        "charts", "mutate", "--cwd", str(tmp_path), "--json", "--chart", "loan:Loan",
        "--test-cmd", f"{sys.executable} -m pytest -q -p no:cacheprovider test_loan.py",
        "--mutant", dropped]), capsys.readouterr()
    report = json.loads(out.out)
    (mutant,) = report["mutants"]
    assert (mutant["id"], mutant["status"]) == (dropped, "killed"), (mutant, out.err)
    assert status == 0, out.err
