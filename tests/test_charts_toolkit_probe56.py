"""Stop 56's toolkit probe: a newcomer's own charts through every toolkit entry point; each
test is a defect found there."""

from __future__ import annotations

from statemachine import State, StateChart

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
