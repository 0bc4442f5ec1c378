"""Stop 61, second toolkit probe: a guard no instance can parse refused alike by every tool;
mutant ids of guard expressions; a newcomer's car-park barrier (a parallel barrier/payment
lane beside a compound ``fault`` state with a deep history) through the toolkit's commands."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from calexec.cli import main as cli
from calexec.machines.compiled import compiled
from calexec.machines.inspector import Inspector
from calexec.machines.mutants import apply, derive
from calexec.machines.paths import GuardTable

BROKEN = '''
from statemachine import State, StateChart


class Broken(StateChart):
    idle = State(initial=True)
    busy = State()
    go = idle.to(busy, cond="has_job and")
    back = busy.to(idle, unless="user.age")
'''


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> ModuleType:
    """``source`` as a module of a name of its own (the import is cached), the commands run
    from its directory."""
    name = f"park_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


GUARD = ("Broken: guard 'has_job and' (cond) on transition idle --go--> busy is no boolean "
         "expression python-statemachine reads (invalid syntax): every instance of Broken "
         "fails (InvalidDefinition)")
UNLESS = ("guard 'user.age' (unless) on transition busy --back--> idle is no boolean "
          "expression python-statemachine reads")


@pytest.mark.parametrize("command", [
    ["charts", "draw", "{ref}"],
    ["charts", "paths", "{ref}"],
    ["charts", "cover", "--chart", "{ref}", "--", sys.executable, "-c", "pass"],
    ["charts", "mutate", "--chart", "{ref}", "--test-cmd", f"{sys.executable} -c pass"],
])
def test_a_guard_no_instance_can_parse_is_refused_alike_by_every_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        command: list[str]) -> None:
    """Found at stop 61: ``cond="has_job and"`` (python-statemachine takes the class and
    refuses every instance, ``InvalidDefinition``) was drawn as written by ``charts draw``,
    counted by ``cover`` and mutated by ``mutate`` without a word, while ``paths`` refused it
    as a guard it cannot set. Every command now refuses it the same way, exit 2, one line
    naming the chart, the transition and the text."""
    module = _module(tmp_path, monkeypatch, BROKEN)
    ref = f"{module.__name__}:Broken"
    assert cli([part.format(ref=ref) for part in command]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert GUARD in lines[0] and UNLESS in lines[0], lines[0]
    assert not (tmp_path / "diagrams").exists()


def test_a_guard_no_instance_can_parse_is_refused_by_the_api_and_the_inspector(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same refusal from the public API: compiling, deriving mutants, registering the
    chart with the live inspector (which took it: its page drew the chart)."""
    chart = _module(tmp_path, monkeypatch, BROKEN).Broken
    for attempt in (lambda: compiled(chart), lambda: derive(chart),
                    lambda: Inspector().register(chart, counts=dict)):
        with pytest.raises(ValueError, match=r"guard 'has_job and' \(cond\) on transition"):
            attempt()


GATE = '''
from statemachine import State, StateChart


class Gate(StateChart):
    shut = State(initial=True)
    up = State()
    lift = shut.to(up, cond="!motor_hot", unless="motor_hot")
    drop = up.to(shut, unless="car_in_loop or ticket_held")
'''


def _gate_ids(chart: type) -> list[str]:
    return [m.id for m in derive(chart) if m.kind == "guard-true"]


def test_a_guard_mutant_id_reads_one_way_and_names_one_mutant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found at stop 61: a guard mutant's id was python-statemachine's text of the guard, where
    ``!`` marks an ``unless`` (docs/testing.md): ``cond="!motor_hot"`` and ``unless=
    "motor_hot"`` were both ``guard-true:shut-lift->up:!motor_hot`` (forcing the first true
    lets ``lift`` go, the second refuses it), one id for two opposite mutants, of which
    ``--mutant``, ``apply`` and the equivalent list reached only the first; ``unless="car_in_loop
    or ticket_held"`` read ``!car_in_loop or ticket_held``, ``(not car_in_loop) or
    ticket_held``."""
    chart = _module(tmp_path, monkeypatch, GATE).Gate
    ids = _gate_ids(chart)
    assert ids == [
        "guard-true:shut-lift->up:(!motor_hot)", "guard-true:shut-lift->up:!motor_hot",
        "guard-true:up-drop->shut:!(car_in_loop or ticket_held)",
    ], ids
    every = [m.id for m in derive(chart, 0)]
    assert len(every) == len(set(every)), every


@pytest.mark.parametrize(("mutant", "hot", "taken"), [
    ("guard-true:shut-lift->up:(!motor_hot)", False, True),  # cond forced true: unless decides
    ("guard-true:shut-lift->up:!motor_hot", True, False),  # unless forced true: refused
    ("guard-false:shut-lift->up:!motor_hot", True, False),  # the cond still refuses it
])
def test_each_guard_mutant_id_applies_its_own_mutant(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mutant: str, hot: bool,
        taken: bool) -> None:
    """Each id applies the mutant it names (the unless's, not the cond's first)."""
    chart = _module(tmp_path, monkeypatch, GATE).Gate
    assert apply(chart, mutant).id == mutant

    class Motor:
        def motor_hot(self) -> bool:
            return hot

        def car_in_loop(self) -> bool:
            return False

        def ticket_held(self) -> bool:
            return False

    gate = chart(Motor())
    gate.send("lift")
    assert ("up" in gate.configuration_values) is taken, gate.configuration_values


def test_a_mutant_id_of_before_is_still_taken_by_apply_mutant_and_the_equivalent_list(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The ids of before stop 61 (``!car_in_loop or ticket_held``) still name their mutant:
    in ``apply``, in ``--mutant`` and in an ``--equivalent`` list, the report saying the id
    of today."""
    module = _module(tmp_path, monkeypatch, GATE)
    old = "guard-true:up-drop->shut:!car_in_loop or ticket_held"
    new = "guard-true:up-drop->shut:!(car_in_loop or ticket_held)"
    (tmp_path / "equivalent.toml").write_text(
        f'[[mutant]]\nchart = "Gate"\nid = "{old}"\nreason = "no test drives drop"\n',
        encoding="utf-8")
    code = cli(["charts", "mutate", "--chart", f"{module.__name__}:Gate", "--mutant", old,
                "--equivalent", "equivalent.toml", "--json", "--jobs", "1",
                "--test-cmd", f"{sys.executable} -c 'import {module.__name__}'"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert [(m["id"], m["status"]) for m in report["mutants"]] == [(new, "equivalent")], report
    assert apply(module.Gate, old).id == new


CARPARK = '''
from statemachine import HistoryState, State, StateChart


class CarPark(StateChart):
    class operating(State.Compound):
        class lane(State.Parallel):
            class barrier(State.Compound):
                closed = State(initial=True)
                opening = State()
                raise_ = closed.to(opening, cond="ticket_valid and (paid or season_pass)")
                lower = opening.to(closed, unless="car_in_loop")

            class payment(State.Compound):
                unpaid = State(initial=True)
                paid_ = State("Paid")
                pay = unpaid.to(paid_, cond="card_ok")

        class fault(State.Compound):
            jammed = State(initial=True)
            power_loss = State()
            brown_out = jammed.to(power_loss)

        h = HistoryState(type="deep")
        break_down = lane.to(fault)
        repair = fault.to(h, cond="!motor_hot")
    out_of_service = State(final=True)
    retire = operating.to(out_of_service)
'''


def test_a_history_without_default_entered_from_inside_its_compound_is_a_declaration_bug(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found at stop 61 on a newcomer's car park: ``repair = fault.to(h)``, ``h`` a deep
    history of ``operating`` without a default, sent before ``operating`` was ever left:
    python-statemachine leaves the instance in ``fault,jammed`` without ``operating`` (no
    configuration a chart can be in). ``charts paths`` refused a history entering nothing only
    when the configuration came out empty; here it offered the step, ``"to": ""``, the walk
    ending in ``fault,jammed``, exit 0. It is the same declaration bug, named, exit 2."""
    module = _module(tmp_path, monkeypatch, CARPARK)
    machine = module.CarPark(GuardTable.for_chart(module.CarPark, outcomes={"motor_hot": False}))
    machine.send("break_down")
    machine.send("repair")
    assert sorted(machine.configuration_values) == ["fault", "jammed"]  # what a run is left in
    assert cli(["charts", "paths", f"{module.__name__}:CarPark", "--json"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and not captured.out and "Traceback" not in captured.err, captured
    assert ("CarPark: fault --repair--> h (walk: break_down repair) leaves fault,jammed active "
            "without operating (the parent state of fault): it enters history state 'h' of "
            "'operating' before anything was recorded there, and no default is declared"
            ) in lines[0], lines[0]
