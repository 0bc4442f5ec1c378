"""Stop 63, second toolkit probe: a newcomer's own package (a library book loan, a chart in
``pkg/charts/loans.py`` importing a helper module relatively, its validator and actions named
on the model) driven through docs/framework.md word for word, and calexec installed without
its extras."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

import pytest

from calexec.cli import main as cli
from calexec.machines import chart_support
from calexec.machines.compiled import compiled
from calexec.machines.inspector import Inspector, inspector_app
from calexec.machines.paths import GuardTable, as_data, drive, transition_tour

RULES = '''
MAX_RENEWALS = 2


class LoanRejected(Exception):
    pass
'''

LOANS = '''
from statemachine import Event, HistoryState, State, StateChart

from ._rules import MAX_RENEWALS, LoanRejected


class BookLoan(StateChart):
    requested = State(initial=True)

    class on_loan(State.Compound, name="Checked out"):
        borrowed = State(initial=True)
        renewed = State()
        overdue = State()
        h = HistoryState()

        renew = borrowed.to(renewed, cond="renewals_left") | renewed.to.itself(
            cond="renewals_left", unless="reserved_by_other")
        fine_paid = overdue.to(borrowed, on="collect_fine")

    on_hold = State(enter="notify_member")
    returned = State(final=True)
    lost = State(final=True)

    checkout = requested.to(on_loan, validators="member_in_good_standing")
    overdue_timer = Event(
        on_loan.borrowed.to(on_loan.overdue) | on_loan.renewed.to(on_loan.overdue),
        name="Overdue timer fired")
    hold = on_loan.to(on_hold)
    resume = on_hold.to(on_loan.h)
    give_back = on_loan.to(returned, after="shelve")
    report_lost = returned.from_(on_hold) | lost.from_(on_loan)

    def shelve(self):
        return MAX_RENEWALS


class Member:
    """The model: the guards, the validator and two actions the chart names."""

    def __init__(self, banned=False):
        self.banned = banned
        self.renewals = 0
        self.fines = 0

    def renewals_left(self):
        return self.renewals < MAX_RENEWALS

    def reserved_by_other(self):
        return False

    def member_in_good_standing(self):
        if self.banned:
            raise LoanRejected("member is banned")

    def collect_fine(self):
        self.fines += 1

    def notify_member(self):
        pass
'''


def _package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``lib_<n>/charts/loans.py`` (with ``_rules.py`` beside it) as a package of a name of
    its own, imported from ``tmp_path``."""
    name = f"lib_{tmp_path.name.replace('-', '_')}"
    charts = tmp_path / name / "charts"
    charts.mkdir(parents=True)
    (tmp_path / name / "__init__.py").write_text("", encoding="utf-8")
    (charts / "__init__.py").write_text("", encoding="utf-8")
    (charts / "_rules.py").write_text(RULES, encoding="utf-8")
    (charts / "loans.py").write_text(LOANS, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(f"{name}.charts.loans")


def test_guard_table_answers_the_validator_and_actions_a_chart_names_on_its_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/framework.md step 3 word for word on a chart whose validator and actions are the
    model's (``validators="member_in_good_standing"``, ``on="collect_fine"``): every
    ``BookLoan(GuardTable.for_chart(BookLoan))`` was refused by python-statemachine,
    ``InvalidDefinition: ... Did not found name 'member_in_good_standing' from model or
    statemachine``, so the doc's tour test failed before its first step, and so did ``drive``
    of a compiled run on that table."""
    loans = _package(tmp_path, monkeypatch)
    chart = loans.BookLoan
    data = as_data(chart)
    for walk, end in zip(data["tour"], data["ends"]["tour"], strict=True):
        model = GuardTable.for_chart(chart)
        loan = chart(model)
        for step in walk:
            model.outcomes = step["guards"]
            loan.send(step["event"])
        assert {s.id for s in loan.configuration} == set(end.split(","))

    for walk in transition_tour(chart):
        drive(compiled(chart).run(GuardTable.for_chart(chart, outcomes=walk.start)), walk)

    # the real model still answers its own validator
    with pytest.raises(loans.LoanRejected, match="banned"):
        chart(loans.Member(banned=True)).send("checkout")
    # what the table answers with a no-op: not the chart's own method (``shelve``), nor a guard
    assert set(chart_support.model_callbacks(chart)) == {"notify_member", "collect_fine",
                                                         "member_in_good_standing"}


def test_inspector_app_without_starlette_names_the_extra_to_install(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """calexec installed without extras (``pip install calexec``): ``inspector_app`` was a
    bare ``ModuleNotFoundError: No module named 'starlette'``, naming neither the [server]
    extra docs/framework.md says it needs nor how to install it."""
    monkeypatch.setitem(sys.modules, "starlette.applications", None)
    inspector = Inspector()
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'calexec\[server\]'"):
        inspector_app(inspector)


def test_a_module_given_without_its_class_is_not_offered_as_a_class_of_its_package(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``calexec charts paths mypkg.charts.orders`` (the module, the class forgotten) answered
    ``did you mean 'mypkg.charts:orders'?``: a module offered as a chart class of its package,
    which the next run refuses again; the line now says the reference is a module and where
    its chart class goes. A dotted class (``mypkg.charts.orders.BookLoan``) is still given
    back with its colon."""
    loans = _package(tmp_path, monkeypatch)
    module = loans.__name__
    for argv in (["charts", "paths", module], ["charts", "draw", module]):
        assert cli(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert f"{module.rpartition('.')[0]}:loans" not in err, err
        assert f"{module!r} is a module: name a chart class it declares after a colon, " \
               f"{module}:CLASS" in err, err
    assert cli(["charts", "paths", f"{module}.BookLoan"]) == 2
    assert f"did you mean '{module}:BookLoan'?" in capsys.readouterr().err
