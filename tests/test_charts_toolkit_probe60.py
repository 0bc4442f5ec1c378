"""Stop 60 (toolkit): a newcomer's own charts (a washing machine with parallel door-lock and
water regions and a deep history) through every command as docs/framework.md tells it, then
the broken charts a newcomer writes: each answer one line naming the chart, the transition or
state and what is wrong, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from calexec.cli import main as cli
from calexec.machines.chartref import ChartRefError, load_chart

#: a target made outside the class body: python-statemachine takes the class, and an instance
#: sending ``go`` is left in no state at all (``configuration_values`` empty)
OUTSIDE = '''
from statemachine import State, StateChart

voting = State()

class Coordinator(StateChart):
    idle = State(initial=True)
    done = State(final=True)
    go = idle.to(voting)
    end = idle.to(done)
'''

#: a target of another chart (of the same id as none of this one's): an instance sending
#: ``go`` fails with ``InvalidStateValue: 'voting' is not a valid state value``
OTHERS = '''
from statemachine import State, StateChart

class Participant(StateChart):
    ready = State(initial=True)
    voting = State(final=True)
    vote = ready.to(voting)

class Coordinator(StateChart):
    idle = State(initial=True)
    done = State(final=True)
    go = idle.to(Participant.voting)
    end = idle.to(done)
'''


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> str:
    """``source`` as a module of a name of its own (the import is cached), the commands run
    from its directory."""
    name = f"coord_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize("source", [OUTSIDE, OTHERS], ids=["made-outside", "another-charts"])
@pytest.mark.parametrize("command", [
    ["charts", "draw", "{ref}"],
    ["charts", "paths", "{ref}"],
    ["charts", "cover", "--chart", "{ref}", "--", "python", "-c", "pass"],
    ["charts", "mutate", "--chart", "{ref}", "--test-cmd", "true"],
], ids=["draw", "paths", "cover", "mutate"])
def test_a_transition_to_a_state_the_chart_does_not_declare_is_refused_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        source: str, command: list[str]) -> None:
    """Found at stop 60: ``go = idle.to(voting)`` with ``voting`` a State made outside the
    class (or another chart's) is taken by python-statemachine, and every command took it:
    ``draw`` drew a ``voting`` box, ``paths`` offered ``go (ends in )`` (or ``ends in
    voting``), exit 0, while an instance sending ``go`` is left in no state (or raises
    ``InvalidStateValue``). It is now refused by every tool, naming the chart, the transition
    and the state, exit 2, one line."""
    module = _module(tmp_path, monkeypatch, source)
    ref = f"{module}:Coordinator"
    assert cli([part.format(ref=ref) for part in command]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert ("Coordinator: transition idle --go--> voting goes to a state 'voting' "
            "Coordinator does not declare") in lines[0], lines[0]
    assert not (tmp_path / "diagrams").exists()


def test_compiling_a_chart_with_a_target_it_does_not_declare_is_a_value_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same through the API every tool shares (``compiled``)."""
    from calexec.machines.chart_support import UnsupportedChart
    from calexec.machines.compiled import compile_chart

    chart = load_chart(f"{_module(tmp_path, monkeypatch, OUTSIDE)}:Coordinator")
    with pytest.raises(UnsupportedChart, match=r"idle --go--> voting goes to a state 'voting' "
                                               r"Coordinator does not declare"):
        compile_chart(chart)


@pytest.mark.parametrize("declared", ['go = idle.to("voting")', 'go = idle.to(done, "voting")'],
                         ids=["a-name", "a-name-among-targets"])
def test_a_transition_to_a_state_given_by_its_name_names_the_transition(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, declared: str) -> None:
    """Found at stop 60: ``go = idle.to("voting")`` (a state named by a string, as some
    libraries take it) made python-statemachine refuse the class with ``AttributeError: 'str'
    object has no attribute 'transitions'``, naming neither the transition nor the state; the
    chart reference's refusal now ends with the cause."""
    source = ("from statemachine import State, StateChart\n\n"
              "class Coordinator(StateChart):\n"
              "    idle = State(initial=True)\n"
              "    voting = State()\n"
              "    done = State(final=True)\n"
              f"    {declared}\n"
              "    end = idle.to(done)\n"
              "    close = voting.to(done)\n")
    module = _module(tmp_path, monkeypatch, source)
    with pytest.raises(ChartRefError) as raised:
        load_chart(f"{module}:Coordinator")
    message = str(raised.value)
    assert "'str' object has no attribute 'transitions'" in message, message
    assert message.endswith(
        "; its cause may be: transition go of Coordinator goes to 'voting', a str, not a "
        "State: name the state itself (idle.to(voting))"), message


def test_a_module_without_any_chart_class_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found at stop 60: a module declaring no chart at all (a chart module mixed up with the
    model's) answered only ``module 'm' has no attribute 'Nope' (expected a chart class
    there)`` or ``Coordinator is type ..., not a python-statemachine chart class``, where a
    module with charts lists them; it now says the module declares none."""
    module = _module(tmp_path, monkeypatch, "class Coordinator:\n    pass\n")
    for name in ("Nope", "Coordinator"):
        assert cli(["charts", "paths", f"{module}:{name}"]) == 2
        line = capsys.readouterr().err.strip()
        assert line.endswith(f"; module {module!r} declares no chart class"), line


def test_a_transition_out_of_a_final_child_its_parent_leaves_at_once_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found at stop 60: a final child state with a transition out of it (python-statemachine
    refuses that on the chart's own final states only) whose compound is left by its
    ``done.state`` transition as soon as the child is entered: ``charts paths`` said only
    ``transition(s) got --revote--> waiting taken from no reachable configuration``, naming
    neither the final state nor the transition that leaves at once; it now says both."""
    source = ("from statemachine import State, StateChart\n\n"
              "class Coordinator(StateChart):\n"
              "    class collecting(State.Compound):\n"
              "        waiting = State(initial=True)\n"
              "        got = State(final=True)\n"
              "        vote = waiting.to(got)\n"
              "        revote = got.to(waiting)\n"
              "    done = State(final=True)\n"
              "    done_state_collecting = collecting.to(done)\n")
    module = _module(tmp_path, monkeypatch, source)
    assert cli(["charts", "paths", f"{module}:Coordinator"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert lines[0].endswith(
        "; got --revote--> waiting: out of got, a final state of collecting: entering it raises "
        "done.state.collecting, and collecting --done.state.collecting--> done leaves "
        "collecting at once, so no transition out of got is taken (make got no final state, "
        "or drop the transition)"), lines[0]


def test_a_state_entered_only_from_a_final_child_left_at_once_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same final child, its transition going to a state entered no other way: ``paths``
    said only ``state(s) recount never entered from waiting``."""
    source = ("from statemachine import State, StateChart\n\n"
              "class Coordinator(StateChart):\n"
              "    class collecting(State.Compound):\n"
              "        waiting = State(initial=True)\n"
              "        recount = State()\n"
              "        got = State(final=True)\n"
              "        vote = waiting.to(got) | recount.to(got)\n"
              "        revote = got.to(recount)\n"
              "    done = State(final=True)\n"
              "    done_state_collecting = collecting.to(done)\n")
    module = _module(tmp_path, monkeypatch, source)
    assert cli(["charts", "paths", f"{module}:Coordinator"]) == 2
    line = capsys.readouterr().err.strip()
    assert "state(s) recount never entered" in line and line.endswith(
        "; got --revote--> recount: out of got, a final state of collecting: entering it "
        "raises done.state.collecting, and collecting --done.state.collecting--> done leaves "
        "collecting at once, so no transition out of got is taken (make got no final state, "
        "or drop the transition)"), line


def test_a_contract_reading_model_data_on_a_guard_table_says_what_to_do() -> None:
    """Found at stop 60: the doc's step 3 drives generated paths on ``GuardTable.for_chart``,
    and "Contracts on a chart" turns contracts on for the whole session
    (``--chart-contracts``): with both, every path test failed ``ContractViolation ... (the
    check raised AttributeError("'GuardTable_Washer' object has no attribute
    'door_closed'"))`` (the example's own tests too: 7 of them), a GuardTable answering the
    chart's guards only. The violation now says so, and what to do."""
    from statemachine import State, StateChart

    from calexec.machines.chart_contracts import ContractViolation, contracts_checked, invariant
    from calexec.machines.paths import GuardTable

    class Washer60(StateChart):
        unlocked = State(initial=True)
        locked = State()
        engage = unlocked.to(locked, cond="door_is_closed")
        release = locked.to(unlocked)

        @invariant("locked")
        def locked_only_with_the_door_closed(laundry: object) -> bool:
            return bool(laundry.door_closed)  # type: ignore[attr-defined]

    model = GuardTable.for_chart(Washer60)
    washer = Washer60(model)
    with contracts_checked(Washer60), pytest.raises(ContractViolation) as raised:
        washer.send("engage")
    message = str(raised.value)
    assert "no attribute 'door_closed'" in message, message
    assert ("; the model is a GuardTable, which answers the chart's guards only (a generated "
            "path forces their outcomes): check contracts reading the model's data on runs of "
            "your own model") in message, message
