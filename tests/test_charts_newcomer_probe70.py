"""Stop 70's newcomer probe: a team from elsewhere points the toolkit at its own charts (charts
made by a factory from a list of stage names, a subclass adding states to a concrete base, a
chart with async callbacks used from asyncio, a generated workflow of 163 states and 640
transitions, states with ``value=`` read from a DB column through a custom ``state_field``)
and at what it gets wrong."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
from statemachine import State, StateChart, StateMachine
from statemachine.exceptions import InvalidStateValue

from calexec.cli import main as cli
from calexec.machines import mutants
from calexec.machines.chart_contracts import (
    ContractViolation,
    contracts_checked,
    invariant,
    precondition,
)
from calexec.machines.chart_support import UnsupportedChart
from calexec.machines.compiled import compile_chart, compiled
from calexec.machines.coverage import ChartCoverage, TransitionRecorder, report, track
from calexec.machines.inspector import Inspector
from calexec.machines.paths import as_data


class Ticket(StateMachine):
    new = State(initial=True, value=10)
    triaged = State(value=20)
    in_progress = State(value=30)
    closed = State(final=True, value=50)

    triage = new.to(triaged)
    start = triaged.to(in_progress)
    close = in_progress.to(closed) | new.to(closed)


class Shipment(StateChart):
    class active(State.Compound):
        packing = State(initial=True, value=1)
        in_transit = State(value=2)
        move = packing.to(in_transit)

    delivered = State(final=True, value=9)
    arrive = active.in_transit.to(delivered)


def _row(status: object = None) -> SimpleNamespace:
    # a DB row: the chart's state in the column ``status``; ``state`` is the customer's US state
    return SimpleNamespace(status=status, state="CA")


def test_a_run_reads_the_state_field_an_instance_is_given() -> None:
    """``Ticket(row, state_field="status")`` restores the row's ``status``; the compiled run
    had no ``state_field``: ``compiled(Ticket).run(row)`` read ``row.state`` and was refused
    (``the model's state='CA' is the value of none of the chart's states``), and with no
    ``state`` attribute it started in ``new``, where the instance is in ``in_progress``."""
    row = _row(status=30)
    instance = Ticket(row, state_field="status")
    run = compiled(Ticket).run(row, state_field="status")
    assert [run.state] == [s.id for s in instance.configuration] == ["in_progress"]
    run.send("close")
    assert run.state == "closed"
    assert row.status == 30  # (the run writes no state)
    bare = SimpleNamespace(status=20)
    assert compiled(Ticket).run(bare, state_field="status").state == "triaged"

    class Record:  # the column read through a property, as an ORM's descriptor answers it
        def __init__(self, status: int) -> None:
            self._row = {"status": status}

        @property
        def status(self) -> int:
            return self._row["status"]

        @status.setter
        def status(self, value: int) -> None:
            self._row["status"] = value

    assert [s.id for s in Ticket(Record(30), state_field="status").configuration] == [
        "in_progress"]
    assert compiled(Ticket).run(Record(30), state_field="status").state == "in_progress"
    with pytest.raises(ValueError) as refused:
        compiled(Ticket).run(_row(status=30))
    assert str(refused.value).endswith(
        "(a model keeping the chart's state in another attribute, as Chart(model, "
        "state_field='status') reads it: run(model, state_field='status'))")
    with pytest.raises(ValueError, match=r"^Ticket: the model's status=99 is the value of none"):
        compiled(Ticket).run(_row(status=99), state_field="status")
    with pytest.raises(ValueError, match=r"^Ticket: state_field='': expected the name of"):
        compiled(Ticket).run(_row(), state_field="")


def test_a_run_starts_at_the_start_value_an_instance_is_given() -> None:
    """``Ticket(row, state_field="status", start_value=20)`` starts in ``triaged`` when the row
    holds no state; the run had no ``start_value`` (``run(model, state=20)`` is refused: a
    state id is expected there)."""
    row = _row()
    assert [s.id for s in Ticket(row, state_field="status", start_value=20).configuration] == [
        "triaged"]
    assert compiled(Ticket).run(_row(), state_field="status", start_value=20).state == "triaged"
    # a saved state wins over start_value, as on an instance
    assert compiled(Ticket).run(_row(status=30), state_field="status",
                                start_value=20).state == "in_progress"
    with pytest.raises(ValueError) as refused:
        compiled(Ticket).run(_row(), state_field="status", start_value="triaged")
    assert str(refused.value) == (
        "Ticket: start_value='triaged' is the value of none of the chart's states (new=10, "
        "triaged=20, in_progress=30, closed=50); 'triaged' is the id of state triaged: give "
        "its value, 20")


def test_the_general_run_takes_state_field_and_start_value() -> None:
    """A hierarchical chart's general run: a model whose ``state`` is its own (``'CA'``) was
    refused as holding a saved state, and the run could not start where ``start_value`` puts
    an instance."""
    row = _row()
    instance = Shipment(row, state_field="status", start_value=2)
    run = compiled(Shipment).run(_row(), state_field="status", start_value=2)
    assert list(run.configuration) == [s.id for s in instance.configuration] == [
        "active", "in_transit"]
    run.send("arrive")
    assert list(run.configuration) == ["delivered"]
    with pytest.raises(UnsupportedChart, match=r"^Shipment: the model already holds status=2 "):
        compiled(Shipment).run(_row(status=2), state_field="status")
    with pytest.raises(UnsupportedChart, match=r"state_field='status'\)\), or, to run both"):
        compiled(Shipment).run(_row())
    with pytest.raises(ValueError, match=r"^Shipment: start_value=7 is the value of none"):
        compiled(Shipment).run(_row(), state_field="status", start_value=7)


_FACTORY = '''
from statemachine import State, StateMachine


def make_pipeline(name, stages):
    attrs = {"draft": State(initial=True), "done": State(final=True)}
    attrs.update({stage: State() for stage in stages})
    order = ["draft", *stages, "done"]
    advance = attrs[order[0]].to(attrs[order[1]])
    for a, b in zip(order[1:], order[2:]):
        advance = advance | attrs[a].to(attrs[b])
    attrs.update(advance=advance, __module__=__name__)
    return type(name, (StateMachine,), attrs)


Hotfix = make_pipeline("Pipeline", ["patch", "verify"])
Feature = make_pipeline("Pipeline", ["design", "build", "review"])
Release = make_pipeline("Release", ["build"])
'''


@pytest.fixture
def factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    (tmp_path / "stages70.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "stages70", raising=False)
    return importlib.import_module("stages70")


@pytest.mark.requires_tool("dot")
def test_two_charts_a_factory_made_in_one_module_do_not_replace_each_others_diagrams(
        factory: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """``Hotfix`` and ``Feature``, both made by ``make_pipeline("Pipeline", ...)`` in one
    module, draw to ``Pipeline.dot``: ``charts draw stages70:Feature`` replaced Hotfix's
    diagram without a word (the check of another chart's file compared the module only), and
    ``--check`` of Hotfix then named a fix that replaced Feature's in turn."""
    assert cli(["charts", "draw", "stages70:Hotfix", "--out", "d"]) == 0
    hotfix = Path("d/Pipeline.dot").read_text()
    assert 'label="Pipeline (declared in stages70.py as Hotfix)"' in hotfix
    capsys.readouterr()
    assert cli(["charts", "draw", "stages70:Feature", "--out", "d"]) == 2
    assert capsys.readouterr().err.strip() == (
        "calexec charts draw: stages70:Feature: d/Pipeline.dot is the diagram of another chart "
        "named Pipeline, declared in stages70.py as Hotfix (this one is declared in stages70.py "
        "as Feature); draw one of them into another --out, or delete d/Pipeline.dot to "
        "replace it")
    assert Path("d/Pipeline.dot").read_text() == hotfix
    assert cli(["charts", "draw", "stages70:Hotfix", "--out", "d", "--check"]) == 0
    assert cli(["charts", "draw", "stages70:Feature", "--out", "d", "--check"]) == 1
    assert "the diagram of another chart named Pipeline, declared in stages70.py as Hotfix" in (
        capsys.readouterr().err)
    # a chart bound under its own class name is titled as before
    assert cli(["charts", "draw", "stages70:Release", "--out", "d"]) == 0
    assert 'label="Release (declared in stages70.py)"' in Path("d/Release.dot").read_text()


def test_two_charts_a_factory_made_are_named_by_the_names_their_module_gives_them(
        factory: ModuleType) -> None:
    """Coverage and the live view refused the second factory chart of one class name naming
    both ``stages70:Pipeline``, a reference that imports neither, and the inspector suggested
    ``register(Pipeline, ..., name='stages70.Pipeline')``; ``as_data``'s ``class`` was that
    reference too. They are named as their module binds them, the references the commands
    take."""
    hotfix, feature = factory.Hotfix, factory.Feature
    recorder = TransitionRecorder()
    undo = track(hotfix, recorder)
    try:
        with pytest.raises(ValueError) as refused:
            track(feature, recorder)
    finally:
        undo()
    assert str(refused.value).startswith(
        "two chart classes named Pipeline, stages70:Hotfix and stages70:Feature: ")
    inspector = Inspector()
    inspector.register(hotfix, counts=lambda: {})
    with pytest.raises(ValueError) as refused:
        inspector.register(feature, counts=lambda: {})
    assert str(refused.value) == (
        "register: a chart named 'Pipeline' is already registered: stages70:Hotfix; "
        "stages70:Feature is another chart of that name, which the page and its URLs could not "
        "tell apart: register it with another name=, e.g. register(Feature, ..., "
        "name='stages70.Feature')")
    inspector.register(feature, counts=lambda: {}, name="stages70.Feature")
    assert as_data(feature)["class"] == "stages70:Feature"
    assert as_data(factory.Release)["class"] == "stages70:Release"


class Machine(StateMachine):
    idle = State(initial=True)
    running = State()
    stopped = State(final=True)
    start = idle.to(running)
    stop = running.to(stopped) | idle.to(stopped)


class PausableMachine(Machine):
    paused = State()
    pause = Machine.running.to(paused)
    resume = paused.to(Machine.running)
    halt = paused.to(Machine.stopped)


def test_a_transition_a_subclass_added_to_its_base_chart_is_named_as_such() -> None:
    """``PausableMachine(Machine)`` adding ``pause = Machine.running.to(paused)`` adds it to
    ``Machine``'s own ``running`` (python-statemachine shares the State objects): every tool
    refused ``Machine`` saying ``goes to a state 'paused' Machine does not declare (chart
    PausableMachine's state ...); declare the state in Machine and go to that one``, a remedy
    that puts the subclass's state into the base the team meant to keep without it, and
    nothing said the subclass did it."""
    machine = Machine()
    machine.send("start")
    with pytest.raises(InvalidStateValue):
        machine.send("pause")  # what python-statemachine does with it
    with pytest.raises(UnsupportedChart) as refused:
        compile_chart(Machine)
    message = str(refused.value)
    assert ("transition running --pause--> paused goes to a state 'paused' Machine does not "
            "declare: its subclass PausableMachine added it to Machine's own state 'running' "
            "(pause = Machine.running.to(paused) in PausableMachine's class body; "
            "python-statemachine shares a base chart's states with its subclasses") in message
    assert message.endswith(
        "a subclass may add transitions out of its own states only: make both charts from one "
        f"factory, or declare PausableMachine whole, or name {__name__}:PausableMachine, which "
        "takes it"), message
    assert "declare the state in Machine" not in message
    assert compiled(PausableMachine).run(None).state == "idle"  # the subclass is taken


class Fetcher(StateChart):
    idle = State(initial=True)
    fetching = State()
    ready = State()
    failed = State(final=True)

    fetch = idle.to(fetching, cond="has_url")
    got = fetching.to(ready, cond="payload_ok") | fetching.to(failed)
    retry = ready.to(fetching)

    async def on_enter_fetching(self) -> None:
        await asyncio.sleep(0)
        self.model.log.append("fetching")

    async def has_url(self) -> bool:
        await asyncio.sleep(0)
        return bool(self.model.url)


class FetchJob:
    def __init__(self, url: str = "http://x", ok: bool = True) -> None:
        self.url, self.ok, self.log = url, ok, []

    def payload_ok(self) -> bool:
        return self.ok


def test_coverage_and_the_live_view_follow_an_async_charts_instances() -> None:
    """A chart with an async guard and an async action, used from asyncio as
    python-statemachine documents it (``await sm.activate_initial_state()``, ``await
    sm.send(...)``): coverage (``track``, so the pytest plugin and ``charts cover``) and the live
    view's ``register`` and ``paths.follow`` refused it (``transition coverage does not support
    yet: async callback 'has_url' ...``), though they listen to python-statemachine instances,
    which the async engine calls as the sync one does: an async team could neither gate its
    tests' coverage nor show its chart live. A compiled run of it is still refused."""
    recorder = TransitionRecorder()
    undo = track(Fetcher, recorder)
    inspector = Inspector()
    machines: list[Fetcher] = []
    inspector.register(Fetcher, runs=lambda: machines)

    async def main() -> None:
        for job, events in ((FetchJob(), ("fetch", "got", "retry")),
                            (FetchJob(ok=False), ("fetch", "got")),
                            (FetchJob(url=""), ("fetch",))):
            machine = Fetcher(job)
            await machine.activate_initial_state()
            machines.append(machine)
            inspector.paths.follow(f"f{len(machines)}", machine)
            for event in events:
                await machine.send(event)

    try:
        asyncio.run(main())
    finally:
        undo()
    assert report([Fetcher], recorder) == [
        ChartCoverage(chart="Fetcher", declared=4, covered=4, untaken=())]
    live = inspector.live()["charts"]["Fetcher"]
    assert live["counts"] == {"idle": 1, "fetching": 1, "ready": 0, "failed": 1}
    record = inspector.paths.record("f1")
    assert record is not None
    assert [(step["event"], step["from"], step["to"]) for step in record["trail"]] == [
        ("fetch", "idle", "fetching"), ("got", "fetching", "ready"),
        ("retry", "ready", "fetching")]
    with pytest.raises(UnsupportedChart, match=r"^Fetcher: the compiled form does not support "
                       r"yet: async callback 'has_url' on transition idle --fetch--> fetching"):
        compiled(Fetcher).run(FetchJob())


def test_a_factory_or_its_class_name_given_for_a_chart_says_what_to_name(
        factory: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """``charts paths stages70:make_pipeline`` (the factory, not a chart it made) said
    ``make_pipeline is function <function make_pipeline at 0x7f...>, not a python-statemachine
    chart class``; ``stages70:Pipeline``, the class name the diagrams, coverage lines and live
    page show for ``Hotfix`` and ``Feature``, said ``module 'stages70' has no attribute
    'Pipeline'`` with no word that it is their class name."""
    assert cli(["charts", "paths", "stages70:make_pipeline"]) == 2
    assert capsys.readouterr().err.strip() == (
        "calexec charts paths: 'stages70:make_pipeline': make_pipeline is a function, not a "
        "python-statemachine chart class (a StateMachine or StateChart subclass): a chart a "
        "function makes is named by the name its module binds it to (Chart = "
        "make_pipeline(...), then stages70:Chart); its chart classes: Feature, Hotfix, Release")
    assert cli(["charts", "draw", "stages70:Pipeline", "--out", "d"]) == 2
    assert capsys.readouterr().err.strip() == (
        "calexec charts draw: 'stages70:Pipeline': module 'stages70' has no attribute "
        "'Pipeline' (expected a chart class there); 'Pipeline' is the class name of "
        "stages70:Feature, stages70:Hotfix (charts bound under other names, as a factory's "
        "are): name one so; its chart classes: Feature, Hotfix, Release")


@pytest.mark.requires_tool("dot")
def test_a_states_int_value_in_the_live_views_query_says_to_give_its_id() -> None:
    """``/charts/Ticket.svg?active=30`` of ``in_progress = State(value=30)`` (the DB column's
    value a team has in hand) said only ``not a state of "Ticket" (...)``, where a text value,
    ``?active=P`` of ``State(value="P")``, ends with the state it is the value of: a query holds
    text, which no int value equals."""
    pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
    from starlette.testclient import TestClient

    from calexec.machines.inspector import inspector_app

    inspector = Inspector()
    inspector.register(Ticket, counts=lambda: {"in_progress": 2})
    client = TestClient(inspector_app(inspector))
    answer = client.get("/Ticket.svg", params={"active": "30"})
    assert answer.status_code == 400
    assert answer.json()["error"] == (
        'active="30": not a state of "Ticket" (its states, by id: new, triaged, in_progress, '
        'closed); "30" is the value of state in_progress: give its id, in_progress')
    assert client.get("/Ticket.svg", params={"active": "in_progress"}).status_code == 200


class AsyncDoor(StateChart):
    closed = State(initial=True)
    opened = State()
    open = closed.to(opened, cond="unlocked")
    close = opened.to(closed)

    async def on_open(self) -> None:
        await asyncio.sleep(0)
        self.model.opened += 1

    async def unlocked(self) -> bool:
        await asyncio.sleep(0)
        return True

    @invariant("opened")
    def opened_at_most_once(door: DoorModel) -> bool:
        return door.opened < 2

    @precondition("close")
    def not_jammed(door: DoorModel) -> bool:
        return not door.jammed


class DoorModel:
    def __init__(self, jammed: bool = False) -> None:
        self.opened, self.jammed = 0, jammed


def test_contracts_and_mutation_take_an_async_charts_instances() -> None:
    """``enable_contracts(AsyncDoor)`` (``--chart-contracts``) and ``charts mutate`` refused a
    chart with async callbacks (``... does not support yet: async callback 'on_open' ...``),
    though a contract listener is called by the async engine as by the sync one, and a mutant
    changes the declaration the test command's instances run; the refusal that remains (a
    compiled run) said nothing of what to do."""
    async def main(model: DoorModel, events: tuple[str, ...]) -> list[str]:
        door = AsyncDoor(model)
        await door.activate_initial_state()
        for event in events:
            await door.send(event)
        return [state.id for state in door.configuration]

    with contracts_checked(AsyncDoor) as monitor:
        assert asyncio.run(main(DoorModel(), ("open", "close"))) == ["closed"]
        with pytest.raises(ContractViolation, match=r"invariant 'opened_at_most_once' violated"):
            asyncio.run(main(DoorModel(), ("open", "close", "open")))
        with pytest.raises(ContractViolation, match=r"precondition 'not_jammed' violated"):
            asyncio.run(main(DoorModel(jammed=True), ("open", "close")))
    assert len(monitor.violations) == 2
    assert {mutant.id for mutant in mutants.derive(AsyncDoor)} >= {
        "guard-true:closed-open->opened:unlocked", "drop:opened-close->closed"}
    with pytest.raises(UnsupportedChart) as refused:
        compiled(AsyncDoor).run(DoorModel())
    assert str(refused.value).endswith(
        "(a compiled run of it is refused: test instances of AsyncDoor, which "
        "python-statemachine's async engine runs (await machine.send(...)) and coverage, "
        "contracts, the live view and mutation follow; diagrams and paths take the chart)")


def test_a_mutant_goes_to_the_chart_named_not_to_a_factory_chart_of_its_class_name(
        tmp_path: Path) -> None:
    """``charts mutate fac70:Pipeline`` of a module whose ``Hotfix = make_pipeline("Pipeline",
    ...)`` is made before ``Pipeline = make_pipeline("Pipeline", ...)``: the hook applying a
    mutant as its class is created took the first class named ``Pipeline``, Hotfix's, so
    ``drop:build-advance->test`` was applied to Hotfix and survived (and a mutant naming a state
    Hotfix lacks was "never applied"): 12 mutants, 0 killed, where the team's test kills all."""
    (tmp_path / "fac70.py").write_text(_FACTORY.replace(
        'Hotfix = make_pipeline("Pipeline", ["patch", "verify"])',
        'Hotfix = make_pipeline("Pipeline", ["build", "test"])').replace(
        'Feature = make_pipeline("Pipeline", ["design", "build", "review"])',
        'Pipeline = make_pipeline("Pipeline", ["build", "test", "stage"])'))
    code = ("from calexec.machines import mutants\n"
            "mutants.install_from_env()\n"
            "import fac70\n"
            "def edges(chart):\n"
            "    return sorted(f'{t.source.id}->{t.target.id}' for s in chart.states\n"
            "                  for t in s.transitions)\n"
            "print(edges(fac70.Hotfix))\n"
            "print(edges(fac70.Pipeline))\n")
    env = {**os.environ, mutants.ENV: "fac70:Pipeline@drop:build-advance->test",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    hotfix, pipeline = done.stdout.splitlines()
    assert "build->test" in hotfix  # untouched
    assert "build->test" not in pipeline and "test->stage" in pipeline


def test_the_other_import_hint_names_a_factory_chart_by_its_module_s_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``charts cover --chart app70.stages70b:Hotfix`` while the command imports the same file
    as ``stages70b`` (its directory on ``sys.path``): the hint named the reference to give by
    the class name the factory gave, ``--chart=stages70b:Pipeline``, which names no chart (the
    plugin's the same)."""
    package = tmp_path / "app70"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "stages70b.py").write_text(_FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    script = (f"import sys\nsys.path.insert(0, {str(package)!r})\n"
              "from stages70b import Hotfix\nHotfix().send('advance')\n")
    assert cli(["charts", "cover", "--chart", "app70.stages70b:Hotfix", "--",
                sys.executable, "-c", script]) == 0
    out = capsys.readouterr().out
    assert ("transition coverage Pipeline: the command imported its file as module 'stages70b' "
            "too, another class whose runs are not counted: name the chart as it imports it "
            "(--chart=stages70b:Hotfix, with PYTHONPATH=app70") in out, out
