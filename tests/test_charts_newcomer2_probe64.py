"""Stop 64, a second newcomer's charts (async callbacks, enum states, ``Event`` objects with
ids and names, event data, charts whose ``__init__`` takes arguments): a callback reading an
attribute the chart's own ``__init__`` sets (``self.total = 0``, the pattern of
python-statemachine's docs) failed in a compiled run, which makes the chart without its
``__init__``; under ``StateChart`` semantics silently (the ``AttributeError`` became
``error.execution``, the run stayed where the instance moved on), under ``StateMachine``
semantics as a bare ``AttributeError``. It is now ``UnsupportedInit``, one line naming the
chart, the callback, the attribute and what to do. And a model's state that no state's
``value=`` matches was refused listing the state ids (``state='on' is the value of none of the
chart's states ('off', 'on', 'broken')``, the word refused among them); the values are
listed now. ``charts draw flags`` (a module of charts, its class not named) and ``ticket:Ticket``
named from inside its package (its relative imports failing) now say what to name."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
from statemachine import Event, State, StateChart, StateMachine

from calexec.machines.chartref import ChartRefError, load_chart
from calexec.machines.compiled import compile_chart, compiled
from calexec.machines.statechart_run import UnsupportedInit


class Vending(StateChart):
    idle = State(initial=True)
    has_coin = State()
    vending = State(final=True)

    insert = Event(idle.to(has_coin) | has_coin.to.itself(), name="Insert coin")
    go = Event(has_coin.to(vending, cond="enough"), id="vend_now", name="Go")

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.total = 0
        super().__init__(*args, **kwargs)

    def enough(self, price: int = 5) -> bool:
        return self.total >= price

    def on_insert(self, amount: int = 1) -> None:
        self.total += amount


class Limited(StateMachine):
    pending = State(initial=True)
    accepted = State(final=True)

    pay = pending.to(accepted, cond="within")

    def __init__(self, model: object = None, *, limit: int = 10) -> None:
        self.limit = limit
        super().__init__(model)

    def within(self, amount: int = 0) -> bool:
        return amount <= self.limit


class Tagged(StateChart):
    """An ``__init__`` whose attributes no callback reads, and a callback's own mistake."""

    pending = State(initial=True)
    accepted = State()
    broken = State(final=True)

    pay = pending.to(accepted)
    error_execution = accepted.to(broken)
    poke = accepted.to.itself(on="typo")

    def __init__(self, *args: object, tag: str = "", **kwargs: object) -> None:
        self.tag = tag
        super().__init__(*args, **kwargs)

    def typo(self) -> None:
        self.not_set_anywhere += 1  # type: ignore[attr-defined]


def test_an_action_reading_what_the_charts_init_sets_is_refused_not_silently_dropped() -> None:
    sm = Vending()
    sm.send("insert", amount=5)
    assert sm.configuration_values == {"has_coin"} and sm.total == 5
    run = compiled(Vending).run(None)
    with pytest.raises(UnsupportedInit) as caught:
        run.send("insert", amount=5)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("Vending: callback 'on_insert' read self.total, which "
                              "Vending.__init__ (test_charts_newcomer2_probe64.py:")
    assert "keep such state on the model (self.model.total" in message


def test_a_statemachine_guard_reading_what_its_init_sets_names_it() -> None:
    sm = Limited(limit=10)
    sm.send("pay", amount=5)
    assert sm.configuration_values == {"accepted"}
    run = compiled(Limited).run(None)
    with pytest.raises(UnsupportedInit, match=r"^Limited: callback 'within' read self\.limit, "
                       r"which Limited\.__init__ \(.*\) sets; .*test an instance of Limited$"):
        run.send("pay", amount=5)
    with pytest.raises(UnsupportedInit, match="self.limit"):
        compiled(Limited).run(None).can("pay", amount=5)


def test_an_init_no_callback_reads_and_a_callbacks_own_mistake_run_as_an_instance() -> None:
    sm = Tagged(tag="t")
    run = compiled(Tagged).run(None)
    for event in ("pay", "poke"):
        sm.send(event)
        run.send(event)
        assert list(run.configuration) == sorted(sm.configuration_values)
    assert list(run.configuration) == ["broken"]  # the typo became error.execution, in both


class Switch(StateMachine):
    off = State(initial=True, value="OFF")
    on = State(value="ON")
    broken = State(final=True, value=99)

    flip = off.to(on) | on.to(off)
    smash = off.to(broken) | on.to(broken)


def test_a_state_value_no_state_has_is_refused_naming_the_values_not_only_the_ids() -> None:
    chart = compiled(Switch)
    assert chart.run(SimpleNamespace(state="ON")).state == "on"
    with pytest.raises(ValueError) as caught:
        chart.run(SimpleNamespace(state="on"))
    assert str(caught.value) == ("Switch: the model's state='on' is the value of none of the "
                                 "chart's states (off='OFF', on='ON', broken=99)")

    class Parked(Switch):
        start_configuration_values = ["on"]

    with pytest.raises(ValueError, match=r"\(off='OFF', on='ON', broken=99\)$"):
        compile_chart(Parked)


def test_a_module_named_without_its_class_or_from_inside_its_package_says_what_to_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stem = f"flags_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{stem}.py").write_text(
        "from statemachine import State, StateChart\n\n\nclass Lenient(StateChart):\n"
        "    a = State(initial=True)\n    b = State(final=True)\n    go = a.to(b)\n",
        encoding="utf-8")
    package = tmp_path / f"pkg_{stem}" / "charts"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("", encoding="utf-8")
    (package / "__init__.py").write_text("", encoding="utf-8")
    (package / "rules.py").write_text("LIMIT = 100\n", encoding="utf-8")
    (package / f"ticket_{stem}.py").write_text(
        "from statemachine import State, StateChart\n\nfrom .rules import LIMIT\n\n\n"
        "class Ticket(StateChart):\n    a = State(initial=True)\n    b = State(final=True)\n"
        "    go = a.to(b)\n", encoding="utf-8")
    with pytest.raises(ChartRefError) as caught:
        load_chart(stem, cwd=str(tmp_path))
    assert str(caught.value).endswith(f"; {stem!r} is a module: name a chart class it declares "
                                      f"after a colon, {stem}:CLASS")
    monkeypatch.syspath_prepend(str(package))  # (removed again: no other test imports it)
    with pytest.raises(ChartRefError) as caught:
        load_chart(f"ticket_{stem}:Ticket", cwd=str(package))
    dotted = f"pkg_{stem}.charts.ticket_{stem}"
    assert str(caught.value).endswith(
        f"attempted relative import with no known parent package); ticket_{stem} is module "
        f"{dotted} of a package: run from {tmp_path} and name {dotted}:Ticket")
    assert load_chart(f"{dotted}:Ticket", cwd=str(tmp_path)).__name__ == "Ticket"
