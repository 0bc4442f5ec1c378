"""Stop 56's toolkit probe: a newcomer's own charts through every toolkit entry point; each
test is a defect found there."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from statemachine import State, StateChart

from calexec.cli import main as cli
from calexec.drivers.tools import charts_mutate
from calexec.machines import mutants
from calexec.machines.compiled import compile_chart
from calexec.machines.coverage import TransitionListener, TransitionRecorder, recording, report
from calexec.machines.paths import GuardTable, as_data, drive, transition_tour


def _brewer() -> type[StateChart]:
    """``off`` goes to ``done`` as the chart starts when ``broken`` holds (a guarded eventless
    transition out of the initial state): every other transition needs ``broken`` refused
    before the chart starts, so every walk to them begins with a start step."""

    class Brewer(StateChart):
        off = State(initial=True)
        on = State()
        done = State(final=True)
        power = off.to(on)
        shutdown = on.to(done)
        off.to(done, cond="broken")

    return Brewer


def test_a_tour_takes_the_transition_the_chart_takes_as_it_starts_when_every_walk_refuses_it():
    """The tour counted what the start where every guard holds takes as taken by every walk;
    here each walk began with ``(start)[!broken]``, so none took ``off --> done``, and the
    tour a test drives (docs/framework.md step 3) left coverage at 2/3 under a gate of 100."""
    chart = compile_chart(_brewer())
    tour = transition_tour(chart)
    with recording([chart]) as recorder:
        for walk in tour:
            run = chart.run(GuardTable.for_chart(chart, outcomes=walk.start))
            assert drive(run, walk) == walk.end  # type: ignore[arg-type]
    coverage = report([chart], recorder)[0]
    assert coverage.complete, coverage.untaken
    assert [(w.events, dict(w.start)) for w in tour] == [
        (("power", "shutdown"), {"broken": False}), ((), {})]


def test_the_tour_as_data_takes_every_transition_on_python_statemachine_instances():
    """The same, the way docs/framework.md has a test iterate ``as_data``'s tour on instances."""
    declaration = _brewer()
    chart = compile_chart(declaration)
    recorder = TransitionRecorder()
    data = as_data(chart)
    for walk, end in zip(data["tour"], data["ends"]["tour"], strict=True):
        model = GuardTable.for_chart(chart)
        steps = list(walk)
        if steps and steps[0]["event"] is None:
            model.outcomes = steps.pop(0)["guards"]
        machine = declaration(model, listeners=[TransitionListener(chart, recorder)])
        for step in steps:
            model.outcomes = step["guards"]
            machine.send(step["event"])
        assert ",".join(machine.configuration_values) == end
    coverage = report([chart], recorder)[0]
    assert coverage.complete, coverage.untaken


def test_a_strict_guard_table_refuses_outcomes_naming_no_guard_of_the_chart():
    """A typo in hand-written outcomes (``{"brokn": False}``) was taken silently: the guard
    answered the default and the test drove another path than it meant. That stays so by
    default (under a mutant the guard a test sets may be gone); ``strict=True`` refuses it,
    naming it and the guard it resembles."""
    chart = compile_chart(_brewer())
    GuardTable.for_chart(chart).outcomes = {"brokn": False}  # taken, as documented
    table = GuardTable.for_chart(chart, strict=True)
    table.outcomes = {"broken": False}
    with pytest.raises(ValueError, match=r"GuardTable for Brewer: outcomes name 'brokn', no "
                                         r"guard of the chart \(did you mean 'broken'\?\)"):
        table.outcomes = {"brokn": False}
    assert table.outcomes == {"broken": False}
    with pytest.raises(ValueError, match="outcomes name 'brokn'"):
        GuardTable.for_chart(chart, outcomes={"brokn": False}, strict=True)
    with pytest.raises(ValueError, match=r"strict=True needs the chart"):
        GuardTable(strict=True)
    with pytest.raises(TypeError, match="strict='yes'"):
        GuardTable.for_chart(chart, strict="yes")  # type: ignore[arg-type]


def test_a_strict_guard_table_takes_a_guard_a_mutant_forced_away():
    """Under a mutant the chart's guard may be gone (forced to a constant, dropped with its
    transition): a strict table refusing the name then would kill the mutant for the wrong
    reason. In a process whose chart a mutant changed, the check is left to the unmutated
    run ``charts mutate`` makes first."""
    declaration = _brewer()
    assert not mutants.mutated(declaration)
    mutants.apply(declaration, "guard-true:off-->done:broken")
    assert mutants.mutated(declaration)
    chart = compile_chart(declaration)
    assert "broken" not in chart.guard_names
    table = GuardTable.for_chart(chart, strict=True)
    table.outcomes = {"broken": False}
    assert table.outcomes == {"broken": False}


LATIN1_CHART = b"""
from statemachine import State, StateChart


class Kettle(StateChart):
    cold = State(initial=True)
    hot = State(final=True)
    heat = cold.to(hot)
"""


def _latin1_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A chart module in a file whose name is Latin-1, not UTF-8 (``caf\\xe9.py`` on a disk
    written by an old tool): Python imports it as a module whose name holds a lone surrogate.
    A name of its own per test (the import is cached)."""
    module = f"caf\udce9_{tmp_path.name.replace('-', '_')}"
    with open(os.fsencode(tmp_path / f"{module}.py"), "wb") as out:
        out.write(LATIN1_CHART)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return module


@pytest.mark.requires_tool("dot")
def test_a_chart_in_a_file_whose_name_is_no_utf8_is_drawn(tmp_path, monkeypatch, capsys):
    """``charts draw`` of it was ``internal error: UnicodeEncodeError`` (exit 70): the DOT's
    title names the file, and the DOT is UTF-8. The byte reads ``?`` there."""
    module = _latin1_module(tmp_path, monkeypatch)
    assert cli(["charts", "draw", f"{module}:Kettle"]) == 0, capsys.readouterr().err
    dot = (tmp_path / "diagrams" / "Kettle.dot").read_text(encoding="utf-8")
    assert f"declared in caf?_{tmp_path.name.replace('-', '_')}.py" in dot
    assert cli(["charts", "draw", f"{module}:Kettle", "--check"]) == 0


def test_mutants_of_a_chart_in_a_file_whose_name_is_no_utf8_are_applied(tmp_path, monkeypatch,
                                                                       capsys):
    """``charts mutate`` of it judged every mutant an error, "never applied": the test process
    failed writing the acknowledgement (the module's name is no UTF-8 text), and the unmutated
    run's report of what it imported was lost the same way (a warning that it never imported
    the chart). Both are written and read back with the surrogate kept."""
    module = _latin1_module(tmp_path, monkeypatch)
    # (the command is ASCII: the module's name as a Python literal, its surrogate escaped)
    command = f"{sys.executable} -c \"import sys; sys.path.insert(0, ''); __import__({module!r})\""
    status = charts_mutate.main(["charts", "mutate", f"{module}:Kettle", "--test-cmd", command,
                                 "--cwd", str(tmp_path), "--kind", "drop", "--json"])
    out = capsys.readouterr()
    assert status == 0, out.err
    assert "never imported" not in out.err, out.err
    (outcome,) = json.loads(out.out)["mutants"]
    assert outcome["status"] == "survived", outcome
