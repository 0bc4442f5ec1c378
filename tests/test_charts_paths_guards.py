"""``calexec charts paths`` on a newcomer's python-statemachine 3 charts whose guards are not
plain method names: a guard expression (``cond="has_items and not blocked"``), a callable
guard (``cond=card_ok``), and a guarded choice the chart makes as it starts (its initial
macrostep, before any event). The path file (``--json``) must say every outcome a run needs,
set on the names a model answers, or the command refuses the chart naming the guard and why;
it never leaves an outcome out (a run that follows the file then goes elsewhere)."""

from __future__ import annotations

import importlib
import json
import textwrap

import pytest

from calexec.cli import main as cli
from calexec.machines.compiled import compiled
from calexec.machines.coverage import TransitionRecorder, report, track
from calexec.machines.paths import GuardTable

CHARTS = """
    from statemachine import State, StateChart


    class Checkout(StateChart):
        cart = State(initial=True)
        review = State()
        paid = State(final=True)
        abandoned = State(final=True)

        submit = cart.to(review, cond="has_items and not blocked") | cart.to(abandoned)
        pay = review.to(paid, cond="card_valid or voucher") | review.to(cart, cond="!blocked")
        give_up = review.to(abandoned)


    class Turnstile(StateChart):
        locked = State(initial=True)
        unlocked = State(final=True)

        def coin_ok(self):
            return True

        coin = locked.to(unlocked, cond=coin_ok) | locked.to.itself()


    class PowerOn(StateChart):
        selftest = State(initial=True)
        running = State()
        failed = State(final=True)

        selftest.to(running, cond="healthy")
        selftest.to(failed, unless="healthy")
        halt = running.to(failed)


    class Boot(StateChart):
        check = State(initial=True)
        ok = State()
        degraded = State()
        off = State(final=True)

        check.to(ok, cond="disk and net")
        check.to(degraded, cond="disk")
        check.to(off)
        reboot = ok.to(check) | degraded.to(check)
        halt = ok.to(off) | degraded.to(off)


    class Compare(StateChart):
        idle = State(initial=True)
        busy = State(final=True)

        go = idle.to(busy, cond="load > 3")
"""


@pytest.fixture
def charts(tmp_path, monkeypatch):
    """The newcomer's module of charts, in a project directory the commands run from."""
    module = f"shop_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(CHARTS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


def _path_file(ref: str, capsys: pytest.CaptureFixture[str]) -> dict:
    assert cli(["charts", "paths", ref, "--json"]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def _follow(chart_class: type, walk: list[dict]) -> list[str]:
    """A real python-statemachine instance on a ``GuardTable``, driven as the path file says:
    a start step (``"event": null``) gives the outcomes to set before the chart starts."""
    model = GuardTable.for_chart(chart_class)
    steps = list(walk)
    if steps and steps[0]["event"] is None:
        model.outcomes = dict(steps.pop(0)["guards"])
    machine = chart_class(model)
    if walk and walk[0]["event"] is None:
        assert sorted(machine.configuration_values) == sorted(walk[0]["to"].split(","))
    for step in steps:  # (a step's "to" is its transition's target: the macrostep goes on)
        model.outcomes = dict(step["guards"])
        machine.send(step["event"])
    return list(machine.configuration_values)


def _every_walk_is_followed(module: str, name: str, data: dict) -> None:
    chart_class = getattr(importlib.import_module(module), name)
    chart = compiled(chart_class)
    recorder = TransitionRecorder()
    undo = track(chart, recorder)
    try:
        for walk in data["tour"]:
            _follow(chart_class, walk)
    finally:
        undo()
    assert report([chart], recorder)[0].complete, report([chart], recorder)[0].untaken
    for entry in data["transitions"]:
        recorder = TransitionRecorder()
        undo = track(chart, recorder)
        try:
            _follow(chart_class, entry["path"])
        finally:
            undo()
        taken = {chart.transitions[i] for _, i in recorder.hits}
        assert any((t.source, t.event, t.target) == (entry["from"], entry["event"], entry["to"])
                   for t in taken), entry
    for walk in data["states"].values():  # (a state may be entered and left at once)
        _follow(chart_class, walk)


def test_an_expression_guard_is_set_by_the_names_inside_it(charts, capsys):
    """``cond="has_items and not blocked"`` was one opaque guard: its outcome was left out of
    the file (a name a model cannot answer), so the step to ``abandoned`` said nothing and a
    run went to ``review``. The file sets the names the expression reads."""
    data = _path_file(f"{charts}:Checkout", capsys)
    every = [step["guards"] for walk in data["tour"] for step in walk]
    every += [step["guards"] for t in data["transitions"] for step in t["path"]]
    assert all(name.isidentifier() for guards in every for name in guards), every
    to_abandoned = next(t for t in data["transitions"]
                        if (t["from"], t["event"], t["to"]) == ("cart", "submit", "abandoned"))
    guards = to_abandoned["path"][-1]["guards"]
    assert guards in ({"has_items": False}, {"has_items": True, "blocked": True}), guards
    _every_walk_is_followed(charts, "Checkout", data)


def test_a_guard_table_answers_the_names_of_an_expression(charts):
    chart_class = importlib.import_module(charts).Checkout
    model = GuardTable.for_chart(chart_class)
    for name in ("has_items", "blocked", "card_valid", "voucher"):
        assert callable(getattr(model, name)), name


def test_a_callable_guard_is_refused_naming_it_and_why(charts, capsys):
    """``cond=coin_ok`` (a function, not a name): python-statemachine calls it, not the
    model a path drives, so no path can set it. The file said ``{"coin_ok": false}`` for the
    self-loop, an outcome nothing applies."""
    assert cli(["charts", "paths", f"{charts}:Turnstile", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "guard 'coin_ok' (a callable) on transition locked --coin--> unlocked" in lines[0]
    assert "cond=\"coin_ok\"" in lines[0], lines[0]


def test_an_expression_no_outcome_can_set_is_refused_naming_it_and_why(charts, capsys):
    assert cli(["charts", "paths", f"{charts}:Compare"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "guard 'load > 3' on transition idle --go--> busy" in err[0], err
    assert "comparison" in err[0], err


def test_outcomes_before_the_first_event_are_a_start_step(charts, capsys):
    """``selftest`` is left as the chart starts, for ``running`` when ``healthy`` holds and for
    ``failed`` when it does not. Paths assumed every guard holds at the start and refused the
    chart ('taken from no reachable configuration'). The file now starts such a walk with a
    start step (``"event": null``) whose guards are set before the chart starts."""
    data = _path_file(f"{charts}:PowerOn", capsys)
    start = next(t for t in data["transitions"] if (t["from"], t["to"]) == ("selftest", "failed"))
    assert start["path"] == [{"event": None, "from": None, "to": "failed",
                              "guards": {"healthy": False}}]
    assert data["states"]["running"] == []  # the start as it is: no step
    _every_walk_is_followed(charts, "PowerOn", data)
    assert cli(["charts", "paths", f"{charts}:PowerOn"]) == 0
    assert "(start)[!healthy]" in capsys.readouterr().out


def test_a_three_way_choice_at_the_start_on_an_expression_is_toured(charts, capsys):
    """The start goes to ``ok``, ``degraded`` or ``off`` by ``disk and net`` and ``disk``:
    each is a start step of its own, and each walk is followed by a real run."""
    data = _path_file(f"{charts}:Boot", capsys)
    starts = {t["to"]: t["path"][0] for t in data["transitions"] if t["from"] == "check"
              and t["path"] and t["path"][0]["event"] is None}
    assert set(starts) == {"degraded", "off"}, starts
    assert starts["off"]["guards"] == {"disk": False}, starts
    _every_walk_is_followed(charts, "Boot", data)
