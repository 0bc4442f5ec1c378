"""Stop 58 (toolkit): a newcomer's own charts (a parcel locker, a pedestrian light with a
fault state and history) through every command, as docs/framework.md tells it."""

from __future__ import annotations

from pathlib import Path

import pytest

from calexec.machines.chartref import ChartRefError, load_chart

LOCKER = '''
from statemachine import State, StateMachine

class ParcelLocker(StateMachine):
    empty = State(initial=True)
    loaded = State()
    drop = empty.to(loaded)
    collect = loaded.to(empty)

class Parcel:
    pass
'''


@pytest.mark.parametrize("ref, hint", [
    ("locker58:Parcellocker", "; did you mean 'ParcelLocker'?"),
    ("locker58:ParcelLockr", "; did you mean 'ParcelLocker'?"),
    ("locker58:Door", "; its chart classes: ParcelLocker"),
    ("locker58:Parcel", "; its chart classes: ParcelLocker"),
    ("Locker58:ParcelLocker", "; did you mean 'locker58'?"),
    ("lockr58:ParcelLocker", "; did you mean 'locker58'?"),
    ("pkg58.lockers:ParcelLocker", "; did you mean 'pkg58.locker'?"),
])
def test_a_typo_in_the_module_or_class_of_a_chart_reference_says_what_is_there(
        tmp_path: Path, ref: str, hint: str) -> None:
    """Found at stop 58: ``locker:Parcellocker`` (a case slip) was refused as ``module
    'locker' has no attribute 'Parcellocker'`` and ``lockr:ParcelLocker`` as ``No module named
    'lockr'``, leaving the newcomer to find the name; ``locker:Parcel`` (a plain class of the
    module) said only that it is no chart. Each now ends with the near name (``did you mean
    'ParcelLocker'?``), or, with none near, the module's chart classes."""
    (tmp_path / "locker58.py").write_text(LOCKER, encoding="utf-8")
    (tmp_path / "pkg58").mkdir()
    (tmp_path / "pkg58" / "__init__.py").write_text("", encoding="utf-8")
    (tmp_path / "pkg58" / "locker.py").write_text(LOCKER, encoding="utf-8")
    with pytest.raises(ChartRefError) as raised:
        load_chart(ref, cwd=str(tmp_path))
    assert str(raised.value).endswith(hint), str(raised.value)
    assert load_chart("locker58:ParcelLocker", cwd=str(tmp_path)).__name__ == "ParcelLocker"


def test_a_general_run_on_a_model_an_instance_started_says_to_make_the_run_first() -> None:
    """Found at stop 58: the stateful test of docs/framework.md (an instance and a compiled
    run on one model) on a hierarchical chart, written in the doc's order (the instance
    first), was refused ``the model already holds state=OrderedSet(['running', 'green'])
    ...; give it a model whose state is None``, which a test that wants both on one model
    cannot do. The message now says the way that works: make the run first (a general run
    writes no ``state``), and so done, both runs agree."""
    from statemachine import HistoryState, State, StateChart

    from calexec.machines.chart_support import UnsupportedChart
    from calexec.machines.compiled import compiled

    class Crossing:
        pressed = False

        def button_pressed(self) -> bool:
            return self.pressed

    class PedLight58(StateChart):
        class running(State.Compound):
            green = State(initial=True)
            yellow = State()
            h = HistoryState()
            tick = green.to(yellow, cond="button_pressed") | yellow.to(green)

        fault = State()
        broken = running.to(fault)
        fixed = fault.to(running.h)

    model = Crossing()
    machine = PedLight58(model)
    with pytest.raises(UnsupportedChart) as refused:
        compiled(PedLight58).run(model)
    assert "make the run before the python-statemachine instance" in str(refused.value), str(
        refused.value)
    model = Crossing()
    run = compiled(PedLight58).run(model)  # first, as the message says
    machine = PedLight58(model)
    model.pressed = True
    for event in ["tick", "broken", "fixed"]:
        machine.send(event)
        run.send(event)
        assert set(machine.configuration_values) == set(run.state.split(",")), event
    assert set(run.state.split(",")) == {"running", "yellow"}
