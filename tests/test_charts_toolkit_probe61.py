"""Stop 61 (toolkit): stop 60's leftovers (a guard expression drawn raw while paths write
``[!x]``; the live inspector's history resume shown as the pseudo-state; final child states
with transitions out of them) and a newcomer's own chart, a print spooler with a compound
``printing`` state (paper-jam sub-states, shallow history) beside toner and paper regions,
through every command as docs/framework.md tells it."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

import pytest

from calexec.cli import main as cli
from calexec.machines.compiled import compiled
from calexec.machines.coverage import describe
from calexec.machines.diagrams import render_chart_dot, render_path_svg, svg_from_dot
from calexec.machines.inspector import Inspector
from calexec.machines.paths import as_data

SPOOLER = '''
from statemachine import HistoryState, State, StateChart


class Spool:
    def __init__(self):
        self.jobs, self.pages_left, self.toner, self.paper = 1, 0, 100, 50

    def has_job(self):
        return self.jobs > 0

    def more_pages(self):
        return self.pages_left > 0

    def toner_empty(self):
        return self.toner <= 0

    def paper_out(self):
        return self.paper <= 0

    def door_closed(self):
        return True


class PrintSpooler(StateChart):
    class device(State.Parallel):
        class job(State.Compound):
            idle = State(initial=True)

            class printing(State.Compound):
                feeding = State(initial=True)
                imaging = State()

                class jammed(State.Compound):
                    detected = State(initial=True)
                    door_open = State()
                    open_door = detected.to(door_open)

                h = HistoryState()
                feed = feeding.to(imaging, cond="not paper_out")
                page_done = imaging.to(feeding, cond="more_pages")
                jam = feeding.to(jammed) | imaging.to(jammed)
                clear = jammed.to(feeding, cond="door_closed and not paper_out")

            paused = State()
            submit = idle.to(printing, cond="has_job and not toner_empty")
            finish = printing.to(idle, unless="more_pages or paper_out")
            pause = printing.to(paused)
            resume = paused.to(printing.h, cond="not toner_empty")

        class toner(State.Compound):
            toner_ok = State(initial=True)
            toner_low = State()
            toner_warn = toner_ok.to(toner_low)
            toner_refill = toner_low.to(toner_ok)

        class paper(State.Compound):
            loaded = State(initial=True)
            tray_empty = State()
            paper_gone = loaded.to(tray_empty)
            paper_refill = tray_empty.to(loaded)

    off = State(final=True)
    power_off = device.to(off)
'''


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> ModuleType:
    """``source`` as a module of a name of its own (the import is cached), the commands run
    from its directory."""
    name = f"spool_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


def test_a_guard_expression_is_drawn_and_named_as_paths_write_its_outcomes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found at stop 60, left: ``cond="has_job and not toner_empty"`` was drawn ``Submit
    [has_job and not toner_empty]`` (and listed so by coverage, refused so by a run) while
    ``charts paths`` writes the step ``submit[has_job,!toner_empty]`` and the diagram's legend
    reads ``[g, h]`` and ``!g``; an ``unless`` expression was drawn ``[!more_pages or
    paper_out]``, which reads as ``(not more_pages) or paper_out``. One notation now."""
    chart = _module(tmp_path, monkeypatch, SPOOLER).PrintSpooler
    dot = render_chart_dot(chart)
    assert 'label="Submit [has_job, !toner_empty]' in dot, dot
    assert 'label="Clear [door_closed, !paper_out]' in dot, dot
    assert 'label="Finish [!more_pages, !paper_out]' in dot, dot
    edges = [line for line in dot.splitlines() if " -> " in line]
    assert not [line for line in edges if " and " in line or " not " in line], edges
    table = compiled(chart)
    submit = next(t for t in table.transitions if t.event == "submit")
    assert describe(submit) == "idle --submit [has_job, !toner_empty]--> printing"
    data = as_data(chart)
    assert next(t for t in data["transitions"] if t["event"] == "submit")["guards"] == [
        "has_job", "!toner_empty"]
    assert data["states"]["printing"][0]["guards"] == {"has_job": True, "toner_empty": False}


@pytest.mark.parametrize("kind", ["instance", "compiled"])
def test_the_inspector_names_the_state_a_history_resume_entered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    """Found at stop 60, left: a followed run resuming ``paused --resume--> h`` was shown
    ``"to": "h"``, the history pseudo-state, where no run ever is; the step now says the state
    it entered (``imaging``, what ``h`` recorded) and ``via`` the history, and the run's page
    still draws the path (its edge is the declared one, to ``h``)."""
    module = _module(tmp_path, monkeypatch, SPOOLER)
    chart = module.PrintSpooler
    inspector = Inspector()
    inspector.register(chart, counts=dict)
    try:
        run = chart(module.Spool()) if kind == "instance" else compiled(chart).run(module.Spool())
        inspector.paths.follow("job-1", run)
        for event in ("submit", "feed", "pause", "resume"):
            run.send(event)
        record = inspector.paths.record("job-1")
    finally:
        inspector.close()
    assert record is not None
    steps = [(s["event"], s["from"], s["to"], s["via"]) for s in record["trail"]]
    assert steps == [("submit", "idle", "printing", None), ("feed", "feeding", "imaging", None),
                     ("pause", "printing", "paused", None),
                     ("resume", "paused", "imaging", "h")], steps


@pytest.mark.requires_tool("dot")
def test_the_run_page_draws_a_step_that_entered_through_a_history(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run page's path of such a step: its edge is the declared ``paused -> h`` (``via``),
    the state filled the one entered (``imaging``, not the compound ``printing``)."""
    chart = _module(tmp_path, monkeypatch, SPOOLER).PrintSpooler
    steps = [{"event": "submit", "from": "idle", "to": "printing"},
             {"event": "feed", "from": "feeding", "to": "imaging"},
             {"event": "pause", "from": "printing", "to": "paused"},
             {"event": "resume", "from": "paused", "to": "imaging", "via": "h"}]
    table = compiled(chart)
    taken = frozenset(t.id for t in table.transitions
                      if t.event in ("submit", "feed", "pause", "resume"))
    assert render_path_svg(chart, steps) == svg_from_dot(render_chart_dot(chart, "imaging", taken))
    with pytest.raises(ValueError, match="paused --resume--> imaging is not a declared"):
        render_path_svg(chart, [{**steps[-1], "via": None}])


KILN = '''
from statemachine import State, StateChart

class Kiln(StateChart):
    class firing(State.Compound):
        heating = State(initial=True)
        cooled = State(final=True)
        cool = heating.to(cooled)
        reheat = cooled.to(heating)
    idle = State(initial=True)
    start = idle.to(firing)
    unload = firing.to(idle)
'''


def test_a_transition_a_run_takes_out_of_a_final_child_state_is_a_declaration_bug(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found at stop 60, left: ``cooled = State(final=True)`` inside ``firing`` with
    ``reheat = cooled.to(heating)``: entering ``cooled`` raises ``done.state.firing`` (firing
    is done), then ``reheat`` takes firing on, so "final" is untrue (SCXML's ``<final>``
    declares no transition; python-statemachine refuses one only out of the chart's own final
    states). ``charts paths`` offered its path, exit 0; it is now named, exit 2, one line."""
    module = _module(tmp_path, monkeypatch, KILN)
    assert cli(["charts", "paths", f"{module.__name__}:Kiln"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert ("Kiln: transition(s) cooled --reheat--> heating out of cooled, a final state of "
            "firing: entering cooled raises done.state.firing (the compound is done), yet this "
            "transition takes firing on from there, so cooled is no final state (make cooled "
            "no final state, or drop the transition)") in lines[0], lines[0]
    with pytest.raises(ValueError, match="cooled --reheat--> heating out of cooled"):
        as_data(module.Kiln)


def test_a_paths_step_into_a_history_names_the_state_a_run_is_in_after_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found at stop 61: ``as_data``'s (``charts paths --json``) step ``resume`` said ``"to":
    "h"``, the history pseudo-state, which no configuration holds, so a newcomer's tour test
    checking each step's ``to`` against ``configuration_values`` (step 3's, on a hierarchical
    chart) failed on the one step it was right to take. It now says the state the history
    re-enters on that walk, ``via`` the history."""
    module = _module(tmp_path, monkeypatch, SPOOLER)
    chart = module.PrintSpooler
    from calexec.machines.paths import GuardTable

    resumed = []
    for walk in as_data(chart)["tour"]:
        model = GuardTable.for_chart(chart)
        spooler = chart(model)
        for step in walk:
            model.outcomes = step["guards"]
            spooler.send(step["event"])
            assert set(step["to"].split(",")) <= set(spooler.configuration_values), step
            if "via" in step:
                resumed.append((step["to"], step["via"]))
    assert resumed and all(via == "h" for _, via in resumed), resumed
