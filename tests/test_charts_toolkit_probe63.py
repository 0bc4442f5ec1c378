"""Stop 63 (toolkit): a newcomer's own charts (a document approval workflow: a compound review
with a shallow history, a parallel legal + finance sign-off joined on both done, final states;
a Raft node: an eventless election, a region leaving its parallel state, an election timeout)
through every command as docs/framework.md tells it. What python-statemachine does by naming
convention (an action of the model, the chart's ``prepare_event``, an ``on_invoke_<state>``)
or through ``invoke=timeout(...)`` must be done by a compiled run too, or refused naming it."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from calexec.cli import main as cli
from calexec.machines.chart_support import unsupported
from calexec.machines.compiled import UnsupportedChart, compile_chart, compiled

#: a flat chart whose model answers python-statemachine's naming conventions: an instance
#: calls ``on_enter_loading``, ``after_start`` and ``before_transition`` of its model
FLAT = '''
from statemachine import State, StateMachine


class Fetch(StateMachine):
    idle = State(initial=True)
    loading = State()
    ready = State(final=True)
    start = idle.to(loading)
    finish = loading.to(ready, cond="complete")


class Model:
    def __init__(self):
        self.log = []

    def complete(self):
        return True

    def before_transition(self, event):
        self.log.append(("before", event))

    def on_enter_loading(self):
        self.log.append(("enter", "loading"))

    def after_start(self):
        self.log.append(("after", "start"))


class Invoking:
    """A model starting work as ``loading`` is entered (python-statemachine runs it in a
    thread and sends ``done.invoke.loading`` when it returns)."""

    def complete(self):
        return True

    def on_invoke_loading(self, **kwargs):
        return 42
'''

#: a flat chart preparing every event's data itself (``prepare_event``), which its guard reads
PREPARED = '''
from statemachine import State, StateMachine


class Gate(StateMachine):
    shut = State(initial=True)
    opened = State()
    go = shut.to(opened, cond="allowed")
    close = opened.to(shut)

    def prepare_event(self):
        return {"badge": 7}


class Reader:
    def allowed(self, badge=0):
        return badge == 7
'''

#: an invoke declared by naming convention on the chart (``on_invoke_<state>``) and one given
#: python-statemachine's own election timeout (``statemachine.contrib.timeout``)
INVOKED = '''
from statemachine import State, StateChart
from statemachine.contrib.timeout import timeout


class Fetcher(StateChart):
    idle = State(initial=True)
    loading = State()
    ready = State(final=True)
    start = idle.to(loading)
    done_invoke_loading = loading.to(ready)

    def on_invoke_loading(self, **kwargs):
        return 42


class Election(StateChart):
    follower = State(initial=True, invoke=timeout(0.15, on="election_timeout"))
    candidate = State()
    leader = State(final=True)
    election_timeout = follower.to(candidate)
    won = candidate.to(leader)
'''


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, stem: str):
    """``source`` as a module of a name of its own (the import is cached), imported, the
    commands run from its directory."""
    name = f"{stem}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name, importlib.import_module(name)


def test_a_flat_charts_run_calls_the_naming_convention_actions_of_its_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The flat fast path decided from the chart class alone: a model answering
    ``on_enter_loading``/``after_start``/``before_transition`` (python-statemachine calls them
    on an instance's model) was never called by ``compiled(Chart).run(model)``, the run
    taking the same transitions with none of the model's actions."""
    _, mod = _module(tmp_path, monkeypatch, FLAT, "fetch")
    on_instance, on_run = mod.Model(), mod.Model()
    machine = mod.Fetch(on_instance)
    run = compiled(mod.Fetch).run(on_run)
    for event in ("start", "finish"):
        machine.send(event)
        run.send(event)
    assert on_instance.log == [("before", "start"), ("enter", "loading"), ("after", "start"),
                               ("before", "finish")]
    assert on_run.log == on_instance.log
    assert run.state == "ready" and run.final


def test_a_state_given_to_a_run_of_a_model_with_convention_actions_is_refused_naming_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _, mod = _module(tmp_path, monkeypatch, FLAT, "fetch")
    with pytest.raises(ValueError, match=r"Fetch: state='loading': .*'after_start', "
                                         r"'before_transition', 'on_enter_loading'"):
        compiled(mod.Fetch).run(mod.Model(), state="loading")


def test_a_flat_charts_own_prepare_event_is_called_by_its_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``prepare_event`` defined on a flat chart (docs/framework.md lists it among what every
    tool takes): the instance's guard got ``badge=7`` and opened; the flat fast path never
    called it, and the compiled run refused ``go`` (``GuardRejected``)."""
    _, mod = _module(tmp_path, monkeypatch, PREPARED, "gate")
    machine = mod.Gate(mod.Reader())
    machine.send("go")
    assert list(machine.configuration_values) == ["opened"]
    assert "prepare_event" in " ".join(compiled(mod.Gate).general)
    run = compiled(mod.Gate).run(mod.Reader())
    run.send("go")
    assert run.state == "opened"


def test_an_invoke_by_naming_convention_is_refused_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``def on_invoke_loading`` on the chart: an instance runs it as ``loading`` is entered
    and, once it returns, takes ``done.invoke.loading`` to ``ready``; every tool took the chart
    (``charts draw`` exit 0) and a compiled run stayed in ``loading`` without a word."""
    name, mod = _module(tmp_path, monkeypatch, INVOKED, "fetcher")
    assert unsupported(mod.Fetcher) == ["invoke 'on_invoke_loading' on state 'loading'"]
    with pytest.raises(UnsupportedChart, match="invoke 'on_invoke_loading' on state 'loading'"):
        compile_chart(mod.Fetcher)
    assert cli(["charts", "draw", f"{name}:Fetcher", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "Fetcher: " in err and "invoke 'on_invoke_loading' on state 'loading'" in err


def test_an_invoke_of_the_model_by_naming_convention_is_refused_by_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``on_invoke_loading`` of the model: an instance runs it as ``loading`` is entered; the
    flat fast path (and a general run) never did, without a word."""
    _, mod = _module(tmp_path, monkeypatch, FLAT, "fetch")
    with pytest.raises(UnsupportedChart,
                       match=r"Fetch: .*invoke 'on_invoke_loading' of the model or a listener "
                             r"on state 'loading'"):
        compiled(mod.Fetch).run(mod.Invoking())


def test_an_invoked_timeout_is_named_as_declared(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``invoke=timeout(0.15, on="election_timeout")`` (python-statemachine's contrib) was
    named by the private class of the handler, ``invoke '_Timeout'``."""
    name, mod = _module(tmp_path, monkeypatch, INVOKED, "election")
    assert unsupported(mod.Election) == [
        "invoke timeout(0.15, on='election_timeout') on state 'follower'"]
    assert cli(["charts", "draw", f"{name}:Election", "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "invoke timeout(0.15, on='election_timeout') on state 'follower'" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "d").exists()


#: a game character's weapon: ``fire`` out of ammo goes to ``empty``, and so does an eventless
#: transition under the same guard, which python-statemachine takes first (after the shot that
#: spent the last round, before any ``fire`` is sent again)
WEAPON = '''
from statemachine import State, StateChart


class Hero(StateChart):
    class alive(State.Parallel):
        class movement(State.Compound):
            standing = State(initial=True)
            running = State()
            run = standing.to(running)
            stop = running.to(standing)

        class weapon(State.Compound):
            loaded = State(initial=True)
            empty = State()
            fire = loaded.to(loaded, cond="has_ammo") | loaded.to(empty, unless="has_ammo")
            reload = empty.to(loaded)
            loaded.to(empty, unless="has_ammo")

    dead = State(final=True)
    die = alive.to(dead)
'''


def test_a_transition_an_eventless_one_always_leaves_first_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``charts paths`` refused ``fire [!has_ammo]`` as "taken from no reachable
    configuration" alone, while ``loaded`` is reached by every walk: the newcomer was not told
    that the eventless ``loaded --(eventless) [!has_ammo]--> empty`` leaves first."""
    name, _ = _module(tmp_path, monkeypatch, WEAPON, "hero")
    assert cli(["charts", "paths", f"{name}:Hero"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert ("loaded --fire--> empty: loaded is reached, but under the outcomes fire needs "
            "(!has_ammo) the eventless loaded --(eventless) [!has_ammo]--> empty leaves loaded "
            "first") in err, err


@pytest.fixture(autouse=True)
def _forget_modules() -> object:
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith(("fetch", "gate", "election", "hero")):
            del sys.modules[name]
