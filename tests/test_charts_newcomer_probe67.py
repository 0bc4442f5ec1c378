"""Stop 67's newcomer probe: a team using the toolkit's Python API directly (docs/framework.md
"Public API") with the arguments a newcomer gets wrong: an instance of the chart where the
class goes, the ``MODULE:CLASS`` text the commands take, one chart where a list goes, the
chart class where its compiled form goes. Each is a ``TypeError`` naming the argument and what
to pass, where it was an ``AttributeError`` from deep inside or a message that did not say
what was given."""

from __future__ import annotations

from pathlib import Path

import pytest
from statemachine import State, StateChart, StateMachine

from calexec.machines import chart_support, diagrams, mutants
from calexec.machines.chart_contracts import enable_contracts
from calexec.machines.chartref import load_chart
from calexec.machines.compiled import compile_chart, compiled
from calexec.machines.coverage import TransitionRecorder, recording, report, track
from calexec.machines.paths import (
    GuardTable,
    PathNotFollowed,
    as_data,
    drive,
    transition_tour,
)
from calexec.machines.statechart_run import StatechartRun


class Kiosk(StateMachine):
    """python-statemachine 2 style: ``State(initial=True)``, ``a.to(b)``."""

    idle = State(initial=True)
    paying = State()
    vending = State()

    touch = idle.to(paying)
    pay = paying.to(vending, cond="payment_ok") | paying.to(paying)
    dispense = vending.to(idle)


class Brewer(StateChart):
    """python-statemachine 3 style: a compound declared by the nested class syntax."""

    off = State(initial=True)

    class brewing(State.Compound):  # noqa: N801 - a state's id, as python-statemachine reads it
        grinding = State(initial=True)
        served = State(final=True)
        ground = grinding.to(served)

    ready = State()
    start = off.to(brewing) | ready.to(brewing)
    done_state_brewing = brewing.to(ready)


class Model:
    def payment_ok(self) -> bool:
        return True


def test_a_chart_instance_given_for_the_class_is_named_with_the_class_to_pass() -> None:
    """``as_data(Kiosk(model))`` (every function taking a chart) said ``Kiosk(model=<...
    object at 0x...>, state_field='state', configuration=['idle']) is not a python-statemachine
    chart class``, not that it is an instance nor what to pass; chart_support's documented
    ``unsupported``/``hierarchical``/``actions`` raised ``AttributeError``."""
    kiosk, brewer = Kiosk(Model()), Brewer()
    calls = [lambda: compiled(kiosk), lambda: compile_chart(kiosk),
             lambda: diagrams.render_chart_dot(kiosk), lambda: as_data(kiosk),
             lambda: GuardTable.for_chart(kiosk), lambda: mutants.derive(kiosk),
             lambda: track(kiosk, TransitionRecorder()), lambda: chart_support.unsupported(kiosk),
             lambda: chart_support.hierarchical(kiosk), lambda: chart_support.actions(kiosk)]
    for call in calls:
        with pytest.raises(TypeError, match=r"chart=<Kiosk instance>: an instance of the chart "
                           r"class Kiosk .*pass the class itself, Kiosk"):
            call()
    with pytest.raises(TypeError, match=r"chart=<Brewer instance>: .*pass the class itself, "
                       r"Brewer"):
        transition_tour(brewer)


def test_the_reference_text_given_for_the_class_says_to_import_or_load_it() -> None:
    """``compiled("kiosk:Kiosk")``, the text ``calexec charts`` takes, said only that it is
    no chart class; ``load_chart`` given no text raised ``AttributeError: ... 'partition'``."""
    with pytest.raises(TypeError, match=r"chart='kiosk:Kiosk' is not a python-statemachine chart"
                       r" class .*from kiosk import Kiosk.*load_chart\('kiosk:Kiosk'\)"):
        as_data("kiosk:Kiosk")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_chart\(ref=None\): expected the text "
                       r"'MODULE:CLASS'"):
        load_chart(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_chart\(ref=<class .*Kiosk'>\): a chart class "
                       r"already: use it as is"):
        load_chart(Kiosk)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"load_chart\(ref=.*Path\('kiosk.py'\)\): a path: give "
                       r"the module and class, 'MODULE:CLASS'"):
        load_chart(Path("kiosk.py"))  # type: ignore[arg-type]


def test_drive_given_an_instance_or_none_for_the_run_names_run() -> None:
    """``drive(Kiosk(table), walk)`` (python-statemachine's own object, the usual slip) raised
    ``AttributeError: 'Kiosk' object has no attribute 'chart'``."""
    walk = transition_tour(Kiosk)[0]
    with pytest.raises(TypeError, match=r"drive\(run=<Kiosk instance>, path\): expected a "
                       r"compiled run, compiled\(Kiosk\)\.run\(GuardTable\.for_chart\(Kiosk, "
                       r"outcomes=path.start\)\); .*as_data\(Kiosk\)'s steps"):
        drive(Kiosk(GuardTable.for_chart(Kiosk)), walk)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"drive\(run=None, path\): expected a compiled run"):
        drive(None, walk)  # type: ignore[arg-type]
    model = GuardTable.for_chart(Kiosk)
    assert drive(compiled(Kiosk).run(model), walk) == walk.end  # the right call still drives


def test_one_chart_where_a_list_goes_and_no_recorder_name_the_argument() -> None:
    """``recording(Kiosk)`` raised ``'StateMachineMetaclass' object is not iterable``,
    ``report([Kiosk], None)`` ``'NoneType' object has no attribute 'charts'``, ``track(Kiosk,
    None)`` ``... no attribute 'claim'``."""
    with pytest.raises(TypeError, match=r"recording\(charts=Kiosk\): expected a list of chart "
                       r"classes .*recording\(\[Kiosk\]\)"):
        with recording(Kiosk):  # type: ignore[arg-type]
            pass
    with pytest.raises(TypeError, match=r"report\(charts=<Kiosk instance>\): .*report\(\[Kiosk\]"
                       r", recorder\)"):
        report(Kiosk(Model()), TransitionRecorder())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"report\(\.\.\., recorder=None\): expected a "
                       r"TransitionRecorder"):
        report([Kiosk], None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"track\(\.\.\., recorder=None\): expected a "
                       r"TransitionRecorder"):
        track(Kiosk, None)  # type: ignore[arg-type]
    with recording([Kiosk]) as recorder:  # the right call still records
        compiled(Kiosk).run(Model()).send("touch")
    assert report([Kiosk], recorder)[0].covered == 1


def test_statechart_run_given_the_class_says_to_compile_it() -> None:
    """``StatechartRun(Brewer, model)`` (docs: ``StatechartRun(compiled(Chart), model)``)
    raised ``AttributeError: type object 'Brewer' has no attribute 'refuse_runs'``."""
    with pytest.raises(TypeError, match=r"StatechartRun\(chart=Brewer\): expected its "
                       r"CompiledChart, StatechartRun\(compiled\(Brewer\), model\)"):
        StatechartRun(Brewer, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"StatechartRun\(chart=<Brewer instance>\)"):
        StatechartRun(Brewer(), None)  # type: ignore[arg-type]
    run = StatechartRun(compiled(Brewer), None)
    run.send("start")
    run.send("ground")
    assert run.state == "ready"


def test_values_of_the_wrong_type_name_their_argument() -> None:
    """``compile_chart(Kiosk, name=3)`` and ``GuardTable.for_chart(Kiosk, default=None)`` were
    taken (a chart named 3 in coverage; every guard not set answering None, falsy);
    ``render_chart_dot(Kiosk, active_state=3)`` said ``'int' object is not iterable``,
    ``svg_from_dot(None)`` ``'NoneType' object has no attribute 'encode'``;
    ``enable_contracts([Kiosk])`` said the list is no chart class."""
    with pytest.raises(TypeError, match=r"name=3: expected a str"):
        compile_chart(Kiosk, name=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"name=' ': expected a non-blank str"):
        compile_chart(Kiosk, name=" ")
    with pytest.raises(TypeError, match=r"GuardTable: default=None: expected True or False"):
        GuardTable.for_chart(Kiosk, default=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"active_state=3: 3 is no state id"):
        diagrams.render_chart_dot(Kiosk, active_state=3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"active_state=\['idle', 2\]: 2 is no state id"):
        diagrams.render_chart_dot(Kiosk, active_state=["idle", 2])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"svg_from_dot\(dot=None\): expected DOT text"):
        diagrams.svg_from_dot(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"png_from_dot\(dot=3\): expected DOT text"):
        diagrams.png_from_dot(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"enable_contracts\(\[<class .*Kiosk'>\]\): give the "
                       r"chart classes as arguments, not in a list"):
        enable_contracts([Kiosk])  # type: ignore[arg-type]
    # a generator of ids is read once, as before
    dot = diagrams.render_chart_dot(Kiosk, active_state=(s for s in ["paying"]))
    assert dot == diagrams.render_chart_dot(Kiosk, active_state="paying")


class Doorbell(StateChart):
    """An action sends an event itself (``self.send``), which the paths, running no callback,
    do not foresee: ``ring`` leaves ``idle`` for ``chiming`` at once."""

    idle = State(initial=True)
    chiming = State()
    quiet = State()

    ring = idle.to(idle, internal=True, on="chime")
    chime_now = idle.to(chiming)
    hush = idle.to(quiet) | chiming.to(quiet)
    wake = quiet.to(idle)

    def chime(self) -> None:
        self.send("chime_now")


def test_drive_names_the_step_whose_callback_sent_an_event_the_path_did_not() -> None:
    """A tour over ``Doorbell`` sends ``ring`` (idle -> idle, by the paths) and then an event
    from ``idle``; the run went to ``chiming`` on the ``chime_now`` its action sent, and
    ``drive`` said only ``was not taken: the run is in 'chiming' (a StateChart ignores a
    refused event ...)``, the refusal of a later step with no word of the step that left the
    path."""
    walk = next(w for w in transition_tour(Doorbell)
                if any(t.event == "ring" for t in w.steps[:-1]))
    run = compiled(Doorbell).run(GuardTable.for_chart(Doorbell))
    with pytest.raises(PathNotFollowed, match=r"the send of step \d+, idle --ring--> idle, also took "
                       r"idle --chime_now--> chiming: an event no step sent, which the chart's "
                       r"own callbacks sent or raised \(self.send, self.raise_\); paths run no "
                       r"callback"):
        drive(run, walk)


def test_mutate_says_how_many_mutants_run_and_about_how_long_before_they_do() -> None:
    """``calexec charts mutate bigchart:Big --test-cmd ...`` on a generated chart of 300 states
    and 1,000 transitions (3,400 mutants, 27 s a test run: some 13 hours on two workers)
    printed the unmutated run's line and then each mutant's as it ended, no word of the size
    of the run nor of ``--sample``; the line printed before the mutants run says both."""
    from calexec.drivers.tools.charts_mutate import mutation_plan

    assert mutation_plan(3400, 27.0, 2, sampled=False) == (
        "charts mutate: 3400 mutant(s) to run on 2 worker(s), about 12.8 h at the unmutated "
        "run's 27.0 s each; --sample N runs a deterministic sample of N of them (--kind, "
        "--mutant narrow it too)")
    assert mutation_plan(3, 27.0, 2, sampled=True) == (
        "charts mutate: 3 mutant(s) to run on 2 worker(s), about 54 s at the unmutated run's "
        "27.0 s each")
    sampled = mutation_plan(400, 27.0, 2, sampled=True)  # sampled already: no hint
    assert sampled.endswith("about 1.5 h at the unmutated run's 27.0 s each")


def test_mutate_prints_the_plan_after_the_unmutated_run(tmp_path, capsys) -> None:
    """The plan line comes on stderr after the unmutated run's, before the first mutant's."""
    import sys
    import textwrap

    from calexec.drivers.tools import charts_mutate

    (tmp_path / "plain.py").write_text(textwrap.dedent("""
        from statemachine import State, StateMachine


        class Plain(StateMachine):
            a = State(initial=True)
            b = State(final=True)
            go = a.to(b)
    """))
    status = charts_mutate.main(["charts", "mutate", "--cwd", str(tmp_path), "--json",
                                 "--chart", "plain:Plain", "--kind", "drop", "--test-cmd",
                                 f"{sys.executable} -c 'import plain'"])
    err = capsys.readouterr().err.splitlines()
    assert status == 0, err
    assert err[0].startswith("charts mutate: unmutated run of"), err
    assert err[1].startswith("charts mutate: 1 mutant(s) to run on 2 worker(s), about "), err
    assert err[2].startswith("  [1/1] survived Plain drop:a-go->b"), err
