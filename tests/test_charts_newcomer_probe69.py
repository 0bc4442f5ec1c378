"""Stop 69's newcomer probe: a team from elsewhere points the toolkit at its own charts (a TCP
connection as a flat ``StateMachine`` with a model and naming-convention callbacks; a vending
machine ``StateChart`` three compound levels deep; a pipeline of python-statemachine 3
features) and at what it gets wrong. A refusal names the chart, the construct and what to
do; before, a delayed event and an abstract base chart were refused without the last."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest
from statemachine import Event, State, StateChart
from statemachine.transition_list import TransitionList

from calexec.cli import main as cli
from calexec.machines.chart_support import UnsupportedChart
from calexec.machines.compiled import compile_chart, compiled
from calexec.machines.paths import as_data


class Delayed(StateChart):
    idle = State(initial=True)
    armed = State()
    boom = State(final=True)
    arm = idle.to(armed)
    fire = Event(armed.to(boom), delay=250)


def test_a_delayed_event_is_refused_saying_what_to_do() -> None:
    """``fire = Event(armed.to(boom), delay=250)`` was refused ``Delayed: the compiled form
    does not support yet: delayed event 'fire' on transition armed --fire--> boom`` and no
    more, where an invoke's refusal says what to do instead."""
    for call in (lambda: compile_chart(Delayed), lambda: as_data(Delayed)):
        with pytest.raises(UnsupportedChart) as refused:
            call()
        message = str(refused.value)
        assert message.startswith("Delayed: the compiled form does not support yet: delayed "
                                  "event 'fire' on transition armed --fire--> boom ("), message
        assert "drop delay=250 from the Event" in message, message
        assert "have a timer of yours call send('fire') 250 ms later" in message, message
        assert "\n" not in message


class Kicker(StateChart):
    a = State(initial=True)
    b = State(final=True)
    kick = a.to(a, on="later")
    finish = a.to(b)

    def later(self) -> None:
        self.send("finish", delay=50)


def test_a_delayed_send_of_a_run_says_what_to_do() -> None:
    """A callback's ``self.send("finish", delay=50)`` and a run's own ``send("go",
    delay=50)`` were refused as ``not supported by a compiled run (no delayed sends)``
    alone."""
    run = compiled(Kicker).run(object())
    with pytest.raises(UnsupportedChart) as refused:
        run.send("kick")
    assert "send it without delay= and send_id= from a timer of yours" in str(refused.value)
    assert "or test an instance of Kicker" in str(refused.value)
    with pytest.raises(ValueError, match=r"\(no delayed or internal sends\): send it without "
                                         r"delay= and send_id=, from a timer of yours$"):
        compiled(Kicker).run(object()).send("finish", delay=50)
    with pytest.raises(ValueError, match=r": raise it from a callback with self.raise_$"):
        compiled(Kicker).run(object()).send("finish", internal=True)


class BaseFlow(StateChart):
    """An abstract base of charts: shared guards, no state."""

    def audit(self) -> bool:
        return True


class ConcreteFlow(BaseFlow):
    a = State(initial=True)
    b = State(final=True)
    go = a.to(b, cond="audit")


def test_an_abstract_base_chart_names_the_subclasses_to_give(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The API said ``BaseFlow: declaration BaseFlow declares no states`` and the commands
    ``name the subclass that declares them`` without naming one, where the module declares
    it beside the base."""
    with pytest.raises(ValueError) as refused:
        compiled(BaseFlow)
    assert str(refused.value) == (
        "BaseFlow: declaration BaseFlow declares no states (a base class of charts? name a "
        "subclass that declares them: ConcreteFlow)")
    (tmp_path / "flows69.py").write_text(textwrap.dedent("""
        from statemachine import State, StateChart

        class Base(StateChart):
            def audit(self):
                return True

        class Flow(Base):
            a = State(initial=True)
            b = State(final=True)
            go = a.to(b, cond="audit")
        """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flows69", raising=False)
    assert cli(["charts", "paths", "flows69:Base"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("calexec charts paths: 'flows69:Base': Base declares no states (a base "
                   "class of charts? name a subclass that declares them: flows69:Flow)"), err


class Stages(StateChart):
    idle = State(initial=True)

    class running(State.Compound):  # noqa: N801 - a state's id, as python-statemachine reads it
        fetch = State(initial=True)
        check = State()
        ok = State(final=True)
        advance = fetch.to(check)
        check.to(ok, cond="valid")  # eventless

    done = State(final=True)
    start = idle.to(running)
    done_state_running = running.to(done)

    def valid(self) -> bool:
        return True


@pytest.mark.skipif(shutil.which("dot") is None, reason="the run's page draws it: graphviz")
def test_the_live_page_of_a_run_names_an_eventless_step() -> None:
    """The live view's page of a followed run (``/charts/runs/j0``) listed the step of an
    eventless transition with an empty event cell, where the diagram and ``charts paths`` say
    ``(eventless)``: a reader saw a step taken on no event at all."""
    pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
    from starlette.testclient import TestClient

    from calexec.machines.inspector import Inspector, inspector_app

    inspector = Inspector()
    job = Stages()
    inspector.register(Stages, runs=lambda: [job])
    inspector.paths.follow("j0", job)
    job.send("start")
    job.send("advance")
    assert job.done.is_active
    client = TestClient(inspector_app(inspector))
    trail = client.get("/runs/j0?format=json").json()["trail"]
    assert [(s["event"], s["from"], s["to"]) for s in trail] == [
        ("start", "idle", "running"), ("advance", "fetch", "check"), ("", "check", "ok"),
        ("done.state.running", "running", "done")]
    page = client.get("/runs/j0")
    assert page.status_code == 200
    assert ("<td>(eventless)</td><td>check</td><td>ok</td>" in page.text), page.text[:2000]


def _flow(module: str, states: tuple[str, str]) -> type[StateChart]:
    """A chart class ``Flow`` declared in ``module`` (two teams' charts of one name)."""
    first, second = states
    body = {first: State(initial=True), second: State(final=True), "__module__": module}
    body["go"] = body[first].to(body[second])
    return type(StateChart)("Flow", (StateChart,), body)


@pytest.mark.skipif(shutil.which("dot") is None, reason="the chart's drawing: graphviz")
def test_registering_a_second_chart_of_one_name_says_which_and_what_to_give() -> None:
    """``inspector.register(billing.Flow, ...)`` after ``register(shop.Flow, ...)`` said
    ``a chart named 'Flow' is already registered`` whether it was the same chart twice or
    another of that name, naming neither nor the ``name=`` that shows both."""
    pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
    from starlette.testclient import TestClient

    from calexec.machines.inspector import Inspector, inspector_app

    shop, billing = _flow("shop69", ("a", "b")), _flow("billing69", ("x", "y"))
    inspector = Inspector()
    inspector.register(shop, counts=lambda: {"a": 1})
    with pytest.raises(ValueError) as refused:
        inspector.register(billing, counts=lambda: {"x": 2})
    assert str(refused.value) == (
        "register: a chart named 'Flow' is already registered: shop69:Flow; billing69:Flow is "
        "another chart of that name, which the page and its URLs could not tell apart: "
        "register it with another name=, e.g. register(Flow, ..., name='billing69.Flow')")
    with pytest.raises(ValueError, match=r"already registered: shop69:Flow, registered already; "
                                         r"register a chart once"):
        inspector.register(shop, counts=lambda: {})
    inspector.register(billing, counts=lambda: {"x": 2}, name="billing69.Flow")  # as it says
    client = TestClient(inspector_app(inspector))
    live = client.get("/live.json").json()["charts"]
    assert live["Flow"]["counts"]["a"] == 1 and live["billing69.Flow"]["counts"]["x"] == 2
    assert client.get("/billing69.Flow.svg").status_code == 200
    inspector.close()


def test_a_state_left_bound_to_a_loop_variable_is_named_as_one_state_of_two_names() -> None:
    """A ``TransitionList`` built in a loop in the class body (``for _s in (idle, lambda_):
    _abort = _abort | _s.to(finished)``) leaves ``_s`` bound to ``lambda_``:
    python-statemachine names that state ``_s`` and lists it twice. Every tool refused it as
    ``2 states with id '_s' (in 'Looped', 'Looped')``: two states, where the chart declares
    one and no state ``_s`` at all."""

    class Looped(StateChart):
        idle = State(initial=True)
        lambda_ = State(name="lambda")
        finished = State(final=True)
        go = idle.to(lambda_)
        _abort = TransitionList()
        for _s in (idle, lambda_):
            _abort = _abort | _s.to(finished)
        abort = Event(_abort)

    with pytest.raises(UnsupportedChart) as refused:
        compile_chart(Looped)
    assert str(refused.value) == (
        "Looped: the compiled form does not support yet: state '_s' is one State bound to 2 "
        "names in Looped's class body (lambda_, _s): an alias, or a loop variable left there "
        "(for s in (a, b): ...); python-statemachine names it after the last, '_s', and lists "
        "it 2 times: del _s after the loop, or keep one name")


class Keywords(StateChart):
    """States named like Python keywords, by ``name=`` (their ids end in ``_``)."""

    idle = State(initial=True)
    class_ = State(name="class")
    lambda_ = State(name="lambda", final=True)
    classify = idle.to(class_)
    finish = class_.to(lambda_)


@pytest.mark.skipif(shutil.which("dot") is None, reason="the chart's drawing: graphviz")
def test_a_state_named_by_its_name_in_the_live_view_says_to_give_its_id() -> None:
    """``class_ = State(name="class")`` is drawn ``class (class_)``; the live view given
    ``class`` (``?active=class``, a ``counts`` or ``active`` function answering it) said
    ``not a state of "Keywords" (its states, by id: ...)`` and no word that it is that
    state's name, where a state's value gets ``is the value of state ...: answer its id``."""
    pytest.importorskip("starlette", reason="the inspector's ASGI app needs the [server] extra")
    from starlette.testclient import TestClient

    from calexec.machines.inspector import Inspector, inspector_app

    inspector = Inspector()
    inspector.register(Keywords, counts=lambda: {"class": 1}, active=lambda: "lambda")
    client = TestClient(inspector_app(inspector))
    answer = client.get("/Keywords.svg?active=idle,class")
    assert answer.status_code == 400
    assert answer.json()["error"].endswith(
        '; "class" is the name of state class_: give its id, class_'), answer.json()
    error = client.get("/live.json").json()["charts"]["Keywords"]["error"]
    assert error.endswith('; "class" is the name of state class_: answer its id, class_'), error
    inspector = Inspector()
    inspector.register(Keywords, counts=lambda: {"class_": 1}, active=lambda: "lambda")
    error = TestClient(inspector_app(inspector)).get("/live.json").json()["charts"]["Keywords"]
    assert error["error"].endswith(
        '; "lambda" is the name of state lambda_: answer its id, lambda_'), error
    inspector.close()


def test_a_contract_naming_a_state_or_event_by_its_name_says_to_give_its_id() -> None:
    """``@invariant("class")`` on a chart with ``class_ = State(name="class")``,
    ``@precondition("start job")`` of ``start = Event(..., name="start job")`` and
    ``@precondition("classify")`` of ``classify = Event(..., id="job.classify")`` (what the
    diagram draws, and the attribute the class declares) were each refused ``... is not a
    state (an event) of the chart (one of ...)`` alone."""
    from calexec.machines.chart_contracts import check_invariants, declared_contracts, invariant
    from calexec.machines.chart_contracts import precondition as pre

    def chart(contract: object) -> type[StateChart]:
        body: dict[str, object] = {"__module__": __name__, "idle": State(initial=True),
                                   "class_": State(name="class"), "end": State(final=True)}
        body["start"] = Event(body["idle"].to(body["class_"]), name="start job")
        body["classify"] = Event(body["class_"].to(body["end"]), id="job.classify")
        body["rule"] = contract
        return type(StateChart)("Tagged", (StateChart,), body)

    def holds(_model: object) -> bool:
        return True

    for contract, hint in [
            (invariant("class")(holds),
             "; 'class' is the name of state class_: give its id, class_"),
            (pre("start job")(holds), "; 'start job' is the name of event 'start': give its "
                                      "id, start"),
            (pre("classify")(holds), "; 'classify' is the attribute declaring event "
                                     "'job.classify': give its id, job.classify")]:
        with pytest.raises(ValueError) as refused:
            declared_contracts(chart(contract))
        assert str(refused.value).endswith(hint), str(refused.value)
    with pytest.raises(ValueError, match=r"; 'class' is the name of state class_: give its id"):
        check_invariants(chart(invariant("class_")(holds)), "class", object())
    with pytest.raises(ValueError, match=r"\(one of start, job.classify\); did you mean "
                                         r"'job.classify'\?$"):
        declared_contracts(chart(pre("job.clasify")(holds)))  # a typo
