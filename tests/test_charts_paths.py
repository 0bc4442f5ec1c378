"""Model-based paths: every declared transition, by its shortest path, on both chart forms.

Driving the bare charts along every path also takes every declared transition, which is what
brings the transition coverage gate to 100 %.
"""

from __future__ import annotations

from collections import deque

import pytest

from calexec.machines.compiled import CHARTS, JOB, compile_chart
from calexec.machines.coverage import TransitionListener, recording
from calexec.machines.paths import GuardTable, drive, transition_paths, winning_guards

ALL_PATHS = [(chart, path) for chart in CHARTS.values() for path in transition_paths(chart)]


def _id(param):
    chart, path = param
    return f"{chart.name}:{path.transition.source}-{path.transition.event}-{path.transition.target}"


@pytest.mark.parametrize("case", ALL_PATHS, ids=[_id(c) for c in ALL_PATHS])
def test_path_takes_its_transition_on_both_forms(case):
    chart, path = case
    assert path.steps[-1] is path.transition
    assert path.steps[0].source == chart.initial
    run = chart.run(GuardTable.for_chart(chart))
    visited = [run.state]
    for step, outcomes in zip(path.steps, path.guards):
        run.model.outcomes = dict(outcomes)
        assert run.select(step.event) is step
        visited.append(run.send(step.event))
    assert visited == [chart.initial] + [step.target for step in path.steps]

    model = GuardTable.for_chart(chart)
    machine = chart.declaration(model, listeners=[TransitionListener(chart)])
    for step, outcomes in zip(path.steps, path.guards):
        model.outcomes = dict(outcomes)
        machine.send(step.event)
    assert list(machine.configuration_values) == [path.target]


@pytest.mark.parametrize("chart", CHARTS.values(), ids=list(CHARTS))
def test_one_shortest_path_per_transition(chart):
    paths = transition_paths(chart)
    assert [p.transition for p in paths] == list(chart.transitions)
    # Independent BFS distance over the declared graph: each path is as short as possible.
    distance = {chart.initial: 0}
    queue = deque([chart.initial])
    while queue:
        state = queue.popleft()
        for t in chart.outgoing(state):
            if t.target not in distance:
                distance[t.target] = distance[state] + 1
                queue.append(t.target)
    for path in paths:
        assert len(path.steps) == distance[path.transition.source] + 1


def test_winning_guards_refuse_earlier_candidates():
    quarantine = next(
        t for t in JOB.transitions
        if (t.source, t.event, t.target) == ("Submitted", "wait_returned", "Quarantined")
    )
    assert dict(winning_guards(JOB, quarantine)) == {"runtime_finished_cleanly": False}


def test_drive_records_every_transition_of_a_path():
    path = max(transition_paths(JOB), key=lambda p: len(p.steps))
    with recording([JOB]) as recorder:
        assert drive(JOB.run(GuardTable.for_chart(JOB)), path) == path.target
    assert recorder.hits == {step.key for step in path.steps}


def test_a_shadowed_transition_is_named_as_source_event_target():
    """The message named the transition by its attrs repr (``Transition(source='a',
    event='go', ..., key=('Door', 1))``); it names it as the diagrams and coverage do, with
    the alternative that shadows it."""
    from statemachine import State, StateMachine

    class Door(StateMachine):
        shut = State(initial=True)
        ajar = State()
        gone = State(final=True)
        push = shut.to(ajar) | shut.to(gone)
        pull = ajar.to(gone)

    with pytest.raises(ValueError) as raised:
        transition_paths(Door)
    assert str(raised.value) == (
        "Door: transition shut --push--> gone can never be taken (shadowed by shut --push--> "
        "ajar, declared before it for the same state and event, whose guards cannot all be "
        "refused)")


def test_alternatives_whose_guards_share_names_are_each_taken_where_some_outcome_selects_it():
    """A newcomer's triage: ``referred`` is taken when ``bleeding`` and ``stable`` both hold
    (``urgent`` needs ``stable`` false, ``routine`` needs ``bleeding`` false). The greedy
    choice refused ``urgent`` by ``bleeding`` false, then could not refuse ``routine``: paths
    named ``referred`` "can never be taken" and the command exited 2 on a valid chart."""
    from statemachine import State, StateMachine

    class Triage(StateMachine):
        waiting = State(initial=True)
        urgent = State(final=True)
        routine = State(final=True)
        referred = State(final=True)

        assess = (waiting.to(urgent, cond="bleeding", unless="stable")
                  | waiting.to(routine, unless="bleeding")
                  | waiting.to(referred, cond="stable"))

    paths = {p.target: p for p in transition_paths(Triage)}
    assert paths["referred"].guards == ({"stable": True, "bleeding": True},)
    for target, path in paths.items():
        assert drive(compile_chart(Triage).run(GuardTable.for_chart(Triage)), path) == target


def test_paths_of_a_large_chart_index_the_transitions_once(monkeypatch):
    """A newcomer's 200-state chart took 5 s in ``charts paths`` and a 400-state one 30 s:
    every breadth-first search called ``CompiledChart.outgoing``, which scans every
    transition, once per state it visited, and the tour runs one search per transition it
    takes. Now the transitions are indexed by source once per call: ``outgoing`` is not
    needed per state (measured without a clock: the calls to it are counted)."""
    from statemachine import State, StateMachine

    from calexec.machines.compiled import CompiledChart, compile_chart
    from calexec.machines.paths import as_data

    size = 60
    body: dict[str, object] = {f"s{i}": State(initial=i == 0, final=i == size - 1)
                               for i in range(size)}
    for i in range(size - 1):
        body[f"next{i}"] = body[f"s{i}"].to(body[f"s{i + 1}"], cond=f"g{i}")
        if i:
            body[f"back{i}"] = body[f"s{i}"].to(body[f"s{i // 2}"])
    chart = compile_chart(type("Corridor", (StateMachine,), body))
    calls = [0]
    original = CompiledChart.outgoing

    def counted(self: CompiledChart, state: str) -> tuple:
        calls[0] += 1
        return original(self, state)

    monkeypatch.setattr(CompiledChart, "outgoing", counted)
    data = as_data(chart)
    assert sum(len(walk) for walk in data["tour"]) >= len(chart.transitions)
    assert calls[0] <= len(chart.states), calls[0]


def test_a_flat_chart_s_steps_name_only_guards_a_model_can_answer():
    """A flat chart whose guards include a callable and an expression (it takes the general
    run) had steps requiring ``{"<lambda>": True}`` and ``{"ready and not busy": True}``:
    outcomes no model can be given. Those were then left out of the steps, silently (a run
    following them took other transitions); now an expression is set by the names inside it
    and a callable is refused, naming it."""
    from statemachine import State, StateMachine

    from calexec.machines.paths import as_data

    class Desk(StateMachine):
        idle = State(initial=True)
        busy = State()
        done = State(final=True)
        take = idle.to(busy, cond=lambda: True)
        check = idle.to(busy, cond="ready and not busy_now")
        finish = busy.to(done, cond="signed")

        def ready(self) -> bool:
            return True

        def busy_now(self) -> bool:
            return False

        def signed(self) -> bool:
            return True

    # the callable: no path can set it, so paths refuse the chart naming it (they dropped it)
    with pytest.raises(ValueError, match=r"guard 'lambda: True' \(a callable\) on transition "
                                         r"idle --take--> busy: a path cannot set it"):
        as_data(Desk)
    class Desk2(StateMachine):
        idle = State(initial=True)
        busy = State()
        done = State(final=True)
        check = idle.to(busy, cond="ready and not busy_now")
        finish = busy.to(done, cond="signed")

    data = as_data(Desk2)
    every = [step["guards"] for walk in data["tour"] for step in walk]
    every += [step["guards"] for t in data["transitions"] for step in t["path"]]
    assert all(name.isidentifier() for guards in every for name in guards), every
    # the expression is set by the names inside it (it was left out of the step)
    assert {"ready": True, "busy_now": False} in every and {"signed": True} in every


def _fresh_compound_chart(index: int) -> type:
    """A new hierarchical chart class (a compound state): explored by configuration."""
    from statemachine import State, StateChart

    class Outer(State.Compound):
        inner = State(initial=True)
        deeper = State()
        step = inner.to(deeper)

    namespace = {"outer": Outer, "done": State(final=True)}
    namespace["leave"] = namespace["outer"].to(namespace["done"])
    return type(f"Explored{index}", (StateChart,), namespace)


def test_explored_charts_are_not_kept_alive_by_the_graph_cache():
    """The graph cache held every compiled chart it explored for the process's lifetime (a
    mutation run, or a toolkit process given user charts, compiles hundreds): the cache is
    weak, a chart and its graph go once nothing else holds the chart."""
    import gc
    import weakref

    from calexec.machines import paths
    from calexec.machines.compiled import compile_chart

    gc.collect()
    before = paths.cached_graphs()
    refs = []
    for index in range(40):
        chart = compile_chart(_fresh_compound_chart(index))
        assert chart.general, "not explored by configuration: the cache is not exercised"
        found = transition_paths(chart)
        assert [p.transition for p in found] == list(chart.transitions)
        assert paths.cached_graphs() == before + 1  # cached while it lives
        refs.append(weakref.ref(chart))
    del chart, found
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    assert paths.cached_graphs() == before


def test_drive_raises_when_the_run_does_not_take_a_step():
    """Under ``StateChart`` semantics a refused event is ignored and an action's error becomes
    ``error.execution``: ``drive`` sent every step of a walk the run did not follow (here the
    ``before`` action needs the user's model, not a ``GuardTable``) and returned as if it had.
    It raises ``PathNotFollowed`` naming the first step not taken and where the run is."""
    from statemachine import State, StateChart

    from calexec.machines.compiled import compiled
    from calexec.machines.paths import PathNotFollowed, transition_tour

    class Kiosk(StateChart):
        idle = State(initial=True)
        serving = State()
        done = State(final=True)
        start = idle.to(serving)
        finish = serving.to(done)

        def before_start(self, model) -> None:
            model.served += 1  # a GuardTable has no ``served``

    (walk,) = transition_tour(Kiosk)
    run = compiled(Kiosk).run(GuardTable.for_chart(Kiosk))
    with pytest.raises(PathNotFollowed) as caught:
        drive(run, walk)
    assert str(caught.value) == (
        "Kiosk: step 1 of 2, idle --start--> serving, was not taken: the run is in 'idle' "
        "(a StateChart ignores a refused event and turns an action's error into "
        "error.execution)"), caught.value


def test_a_state_path_ends_where_the_state_is_active_when_some_outcome_keeps_it():
    """A state left at once by a guarded eventless transition (every guard holding, as a
    ``GuardTable`` answers by default) had the walk that passes through it as its path: the
    state's walk ended in the configuration after it (``queued``: no step, ends in
    ``job,running``; ``b``: ``go``, ends in ``c``), so the documented state test (drive the
    walk, assert the state is active) failed for it. The first configuration that holds the
    state is preferred now, as docs/framework.md says (a start step ``[!ready]``, a step
    ``go[!skip]``); a state no outcome keeps (a final child whose ``done.state`` leaves its
    parent) keeps the walk that enters it."""
    from statemachine import State, StateChart

    from calexec.machines.compiled import compiled
    from calexec.machines.paths import as_data

    class Queue(StateChart):
        class job(State.Compound):
            queued = State(initial=True)
            running = State()
            finished = State(final=True)
            queued.to(running, cond="ready")
            go = running.to(finished)
            later = queued.to(running)

        done = State(final=True)
        done_state_job = job.to(done)

    class Pass(StateChart):
        a = State(initial=True)
        b = State()
        c = State()
        go = a.to(b)
        b.to(c, cond="skip")
        back = c.to(a)

    for chart, expected in ((Queue, {"queued": "job,queued", "finished": "done"}),
                            (Pass, {"b": "b"})):
        data = as_data(chart)
        for state, walk in data["states"].items():
            model = GuardTable.for_chart(chart)
            steps = list(walk)
            if steps and steps[0]["event"] is None:
                model.outcomes = steps.pop(0)["guards"]
            run = compiled(chart).run(model)
            for step in steps:
                model.outcomes = step["guards"]
                run.send(step["event"])
            assert run.state == data["ends"]["states"][state], (chart.__name__, state)
            if state in expected:
                assert data["ends"]["states"][state] == expected[state], (state, data["ends"])
            if state != "finished":  # (left within the macrostep under every outcome)
                assert state in run.configuration, (chart.__name__, state, run.state)
