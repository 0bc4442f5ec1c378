"""Stop 74's newcomer probe: a team from elsewhere points the toolkit at its own charts (a
brewing batch of compounds with final children, ``done.state`` transitions and guarded
eventless transitions in priority order, a library loan with validators under both
``StateMachine`` and ``StateChart``, states named by Python keywords and unicode, a chart in a
package with relative imports, a module with a ``__main__`` server) through every ``charts``
command and the API, and at what it gets wrong."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
from statemachine import State, StateChart

from calexec.machines.paths import (
    GuardTable,
    as_data,
    explore,
    state_paths,
    transition_paths,
)


class Fermenter(StateChart):
    """A flat chart waiting in ``fermenting`` for one of two guarded eventless transitions."""

    idle = State(initial=True)
    fermenting = State()
    spoiled = State(final=True)
    bottled = State(final=True)

    start = idle.to(fermenting)
    fermenting.to(bottled, cond="fermented")
    fermenting.to(spoiled, cond="is_contaminated")
    sample = fermenting.to.itself(internal=True)


class Brewery(StateChart):
    """The same wait in a compound entered by ``done.state`` of another, a child's eventless
    transitions tried before its parent's."""

    class mashing(State.Compound):
        heating = State(initial=True)
        mashed = State(final=True)
        heat_done = heating.to(mashed)

    class fermenting(State.Compound):
        primary = State(initial=True)
        fermented_out = State(final=True)
        primary.to(fermented_out, cond="fermented")

    spoiled = State(final=True)
    bottled = State(final=True)
    done_state_mashing = mashing.to(fermenting)
    done_state_fermenting = fermenting.to(bottled)
    fermenting.to(spoiled, cond="is_contaminated")
    sample = fermenting.to.itself(internal=True)


class StartsFermenting(StateChart):
    """The wait as the chart starts: a start step must refuse both."""

    class fermenting(State.Compound):
        primary = State(initial=True)
        fermented_out = State(final=True)
        primary.to(fermented_out, cond="fermented")

    spoiled = State(final=True)
    bottled = State(final=True)
    done_state_fermenting = fermenting.to(bottled)
    fermenting.to(spoiled, cond="is_contaminated")
    sample = fermenting.to.itself(internal=True)


def _drive_instance(chart: type, walk: list) -> str:
    model = GuardTable.for_chart(chart)
    steps = list(walk)
    if steps and steps[0]["event"] is None:
        model.outcomes = steps.pop(0)["guards"]
    machine = chart(model)
    for step in steps:
        model.outcomes = step["guards"]
        machine.send(step["event"])
    return ",".join(sorted(state.id for state in machine.configuration))


def test_a_state_waiting_on_two_guarded_eventless_transitions_has_paths_out_of_it() -> None:
    # until stop 74 paths merged one guarded eventless transition's outcomes at a time into a
    # step: none stays in a state two of them leave (both must be refused), so `sample` was
    # "taken from no reachable configuration", exit 2, though any instance whose model
    # answers False twice takes it
    for chart in (Fermenter, Brewery, StartsFermenting):
        taking = {(p.transition.source, p.transition.event): p for p in transition_paths(chart)}
        assert ("fermenting", "sample") in taking, chart.__name__
        assert state_paths(chart)["fermenting"].end.startswith("fermenting")
        data = as_data(chart)
        walks = [*data["tour"], *(t["path"] for t in data["transitions"]),
                 *data["states"].values()]
        ends = [*data["ends"]["tour"], *data["ends"]["transitions"],
                *data["ends"]["states"].values()]
        for walk, end in zip(walks, ends, strict=True):
            # every walk is followed by python-statemachine's own instance, to its end
            assert _drive_instance(chart, walk) == ",".join(sorted(end.split(","))), (
                chart.__name__, walk)


def test_exploring_a_hierarchical_chart_says_how_far_it_got() -> None:
    # until stop 74 `charts paths` of 60 compounds each left by guarded eventless transitions
    # explored for a minute and a half after its one announcement line, without a word;
    # explore() reports (explored, to go) while it runs, which the command prints every 5 s
    class Cellar(StateChart):  # a chart of its own: explored once per compiled chart
        class fermenting(State.Compound):
            primary = State(initial=True)
            fermented_out = State(final=True)
            primary.to(fermented_out, cond="fermented")

        spoiled = State(final=True)
        bottled = State(final=True)
        done_state_fermenting = fermenting.to(bottled)
        fermenting.to(spoiled, cond="is_contaminated")
        sample = fermenting.to.itself(internal=True)

    seen: list[tuple[int, int]] = []
    count = explore(Cellar, progress=lambda explored, to_go: seen.append((explored, to_go)),
                    every_s=0)
    assert count > 1 and seen and seen[0][0] == 0
    assert all(explored < count and to_go >= 1 for explored, to_go in seen)
    assert explore(Fermenter) >= 3 and explore(Cellar) == count  # explored once: cached
    with pytest.raises(TypeError, match="progress="):
        explore(StartsFermenting, progress=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="every_s="):
        explore(StartsFermenting, every_s=float("nan"))
    with pytest.raises(ValueError, match="max_configurations=0"):
        explore(Valve, max_configurations=0)


#: the module ``brewery74`` the CLI tests write: the same ``Brewery`` as above
BREWERY = "from statemachine import State, StateChart\n\n\n" + inspect.getsource(Brewery)


def _calexec(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | env
    return subprocess.run([sys.executable, "-m", "calexec", *args], cwd=cwd, env=environ,
                          text=True, capture_output=True, timeout=120, check=False)


def test_charts_paths_says_its_exploration_progress_as_progress_s_asks(tmp_path: Path) -> None:
    (tmp_path / "brewery74.py").write_text(BREWERY, encoding="utf-8")
    done = _calexec(["charts", "paths", "brewery74:Brewery"], tmp_path, CALEXEC_PROGRESS_S="0")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if "configuration(s) explored" in line]
    assert lines and lines[0].startswith("calexec charts paths: Brewery: 0 configuration(s) "
                                         "explored, 1 found still to explore (at most 5000"), lines
    assert "fermenting --sample--> fermenting" in done.stdout
    refused = _calexec(["charts", "paths", "brewery74:Brewery"], tmp_path,
                       CALEXEC_PROGRESS_S="soon")
    assert (refused.returncode, refused.stdout) == (2, "")
    assert refused.stderr.strip().splitlines() == [
        "calexec charts paths: CALEXEC_PROGRESS_S='soon': must be a number of seconds >= 0 and "
        "at most 1e+06"], refused.stderr


GATE = '''
"""A chart whose module is also the program: `python gate74.py` checks it and exits."""
import sys

from statemachine import State, StateMachine


class Gate(StateMachine):
    closed = State(initial=True)
    opened = State()

    open_ = closed.to(opened)
    close = opened.to(closed)


if __name__ == "__main__":
    gate = Gate()
    gate.send("open_")
    ok = gate.opened.is_active
    gate.send("close")
    sys.exit(0 if ok and gate.closed.is_active else 1)
'''


@pytest.mark.parametrize("program", [["gate74.py"], ["-m", "gate74"]])
def test_cover_of_a_chart_run_as_the_main_program_names_no_reference_it_refuses(
        tmp_path: Path, program: list[str]) -> None:
    (tmp_path / "gate74.py").write_text(GATE, encoding="utf-8")
    done = _calexec(["charts", "cover", "--chart", "gate74:Gate", "--", sys.executable,
                     *program], tmp_path)
    assert done.returncode == 0, done.stderr
    # until stop 74: "name the chart as it imports it (--chart=__main__:Gate)", which every
    # command refuses, `module '__main__' has no attribute 'Gate'`, exit 2
    assert "--chart=__main__" not in done.stdout, done.stdout
    assert ("transition coverage Gate: the command ran its file as its main program (python "
            "gate74.py: module '__main__'), another class whose runs are not counted, and no "
            "--chart names a main program: run those checks from a test or script that "
            "imports gate74 (from gate74 import Gate), or move the __main__ block into a file "
            "of its own") in done.stdout, done.stdout
    assert "transition coverage Gate: 0/2 (0.0 %)" in done.stdout


def test_mutate_of_a_chart_run_as_the_main_program_says_why_no_mutant_applies(
        tmp_path: Path) -> None:
    (tmp_path / "gate74.py").write_text(GATE, encoding="utf-8")
    done = _calexec(["charts", "mutate", "gate74:Gate", "--test-cmd", "python gate74.py",
                     "--jobs", "1", "--json"], tmp_path)
    hint = ("the command runs gate74.py as its main program, module '__main__': a class of "
            "its own, which no mutant reaches (and no --chart names): run the checks from a "
            "test or script that imports gate74, or move the __main__ block into a file of "
            "its own")
    # until stop 74 each mutant's error said to "give --chart as they import it", and the
    # warning to "Give --chart as the tests import it": __main__:Gate, refused
    assert "The " + hint[4:] in done.stderr, done.stderr
    assert hint in done.stdout and "give --chart as they import it" not in done.stdout, (
        done.stdout)


class Valve(StateChart):
    """``primed`` is reached only once ``p`` holds after ``go`` arrived in ``waiting`` (``p``
    must not hold as ``go`` is sent: ``idle`` would leave for ``gone``), and stayed in only
    while neither of its two guarded eventless transitions is taken."""

    idle = State(initial=True)
    gone = State(final=True)
    waiting = State()
    primed = State()
    left = State(final=True)
    right = State(final=True)
    done = State(final=True)

    idle.to(gone, cond="p")
    go = idle.to(waiting)
    waiting.to(primed, cond="p")
    primed.to(left, cond="q")
    primed.to(right, cond="r")
    e = primed.to(done)


def test_a_state_settled_into_by_eventless_transitions_is_reached_or_named_why_not() -> None:
    # until stop 74: "state(s) primed, left, right, done never entered from idle", though
    # go[!p] then e[p,!q,!r] reaches done through primed on any instance; left and right, final
    # states a run enters only by eventless transitions before an event that then takes no
    # transition, have no path (made of transitions taken) and are named so
    with pytest.raises(ValueError) as refused:
        state_paths(Valve)
    assert str(refused.value) == (
        "Valve: state(s) left, right never entered from idle by a step that takes a transition "
        "(left, right: entered only as a run in waiting takes eventless transitions before the "
        "next event sent, under [p] for left, and that event then takes no transition there: "
        "a path is made of transitions taken, so none ends there; test them with a model of "
        "your own that answers so in waiting, sending any event)")
    with pytest.raises(ValueError, match="left, right: entered only as a run in waiting"):
        transition_paths(Valve)
    model = GuardTable.for_chart(Valve, outcomes={"p": False})
    machine = Valve(model)
    machine.send("go")
    model.outcomes = {"p": True, "q": False, "r": False}
    machine.send("e")
    assert [state.id for state in machine.configuration] == ["done"]


def guarded_chain(length: int) -> type:
    """``go`` into ``s0``; each ``s<i>`` left by two guarded eventless transitions, on to
    ``s<i+1>`` under ``g<i>`` or to ``bad`` under ``h<i>``, and poked by an internal event."""
    body: dict[str, object] = {"idle": State(initial=True), "bad": State(final=True),
                               "end": State(final=True)}
    states = [State() for _ in range(length + 1)]
    body.update({f"s{i}": state for i, state in enumerate(states)})
    body["go"] = body["idle"].to(states[0])  # type: ignore[attr-defined]
    for i in range(length):
        states[i].to(states[i + 1], cond=f"g{i}")  # eventless: bound to no name
        states[i].to(body["bad"], cond=f"h{i}")  # type: ignore[arg-type]
        body[f"poke{i}"] = states[i].to.itself(internal=True)
    body["fin"] = states[length].to(body["end"])
    return type("Chain", (StateChart,), body)


def test_a_chain_of_states_each_left_by_guarded_eventless_transitions_has_every_path() -> None:
    # each state of the chain is held only under outcomes refusing both transitions out of it
    # after taking every `g` before it: until stop 74 no poke had a path (exit 2); refining
    # every outcome again at every way the macrostep went took minutes for 12 states (as many
    # outcomes as subsets of the chain's guards), so each is refined from where it diverged
    chain = guarded_chain(12)
    taking = {p.transition.event: p for p in transition_paths(chain)}
    assert {f"poke{i}" for i in range(12)} <= set(taking)
    for i in (0, 5, 11):
        walk = taking[f"poke{i}"]
        assert walk.end == f"s{i}"
        # (sent in s<i>: neither transition out of it taken first)
        assert {walk.guards[-1][f"g{i}"], walk.guards[-1][f"h{i}"]} == {False}
    data = as_data(chain)
    for path, end in zip((t["path"] for t in data["transitions"]), data["ends"]["transitions"],
                         strict=True):
        assert _drive_instance(chain, path) == end, path


def test_a_directory_named_like_the_module_file_is_named_so_not_offered_as_itself(
        tmp_path: Path) -> None:
    (tmp_path / "door74.py").mkdir()  # (a checkout gone wrong, an unpacked archive's folder)
    done = _calexec(["charts", "paths", "door74:Door"], tmp_path)
    # until stop 74: "No module named 'door74'); did you mean 'door74'?" (pkgutil lists such
    # a directory as a module of that name, which import does not find)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.strip().endswith(
        "(ModuleNotFoundError: No module named 'door74'); door74.py there is a directory, not "
        "a module file"), done.stderr
