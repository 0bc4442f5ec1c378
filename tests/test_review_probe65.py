"""Stop 65 review of the merged work: a slotted model's saved state (read since stop 65) is
looked for once per model class, not at each run (calexec's ``Job``, buffer slot and KV
transaction are slotted and make a run each); a slotted base's ``state`` beneath a subclass's
``__dict__`` is read as the slot it is; a chart file that is not there is not offered back
with ``py`` as its class."""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from statemachine import State, StateMachine

from calexec.machines.compiled import compiled


class Door(StateMachine):
    closed = State(initial=True)
    locked = State()

    lock = closed.to(locked)
    unlock = locked.to(closed)


def test_the_state_slot_is_looked_for_once_per_model_class(monkeypatch) -> None:
    # each run of a slotted model (JOB.run(job) for every job) looked for a `state` slot with
    # inspect.getattr_static, some ten times a flat run's cost
    class Slotted:
        __slots__ = ("note",)

    looked: list[type] = []
    real = inspect.getattr_static

    def counting(obj, name, *default):
        if name == "state" and obj is Slotted:
            looked.append(obj)
        return real(obj, name, *default)

    monkeypatch.setattr(inspect, "getattr_static", counting)
    chart = compiled(Door)
    for _ in range(50):
        assert chart.run(Slotted()).state == "closed"
    assert len(looked) <= 1, len(looked)


def test_a_slotted_bases_state_beneath_a_dict_is_where_the_run_starts() -> None:
    # a subclass without __slots__ of a slotted dataclass has a __dict__ (here holding
    # `note`), its `state` in the base's slot: the run started `closed` where the instance
    # restores `locked`, and started `locked` once the __dict__ was empty
    @dataclass(slots=True)
    class Base:
        state: object = None

    class Ticket(Base):
        def __init__(self, state: object) -> None:
            Base.__init__(self, state)
            self.note = "kept in __dict__"

    assert list(Door(Ticket("locked")).configuration_values) == ["locked"]
    run = compiled(Door).run(Ticket("locked"))
    assert run.state == "locked"
    run.send("unlock")
    assert run.state == "closed"
    assert compiled(Door).run(Ticket(None)).state == "closed"


def test_a_chart_file_that_is_not_there_is_not_offered_with_py_as_its_class(
        tmp_path, monkeypatch, capsys) -> None:
    # `calexec charts paths nodoors.py` (a typo of doors.py) still answered "did you mean
    # 'nodoors:py'?": stop 65 named an existing file as one, a missing one not
    from calexec.cli import main as cli

    monkeypatch.chdir(tmp_path)
    for given, stem in (("nodoors.py", "nodoors"), ("src/nodoors.py", "nodoors")):
        assert cli(["charts", "paths", given]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "did you mean" not in line and ":py" not in line, line
        assert line.endswith(f"{given!r} is no file in {tmp_path} (nor a module): name the "
                             f"module that declares the chart, as imported from there, and "
                             f"the class after a colon, e.g. {stem}:CLASS for {stem}.py"), line
