"""Stop 64, a newcomer's own charts through the toolkit: a lambda guard drawn and named by its
source text (it was ``<lambda>``), a guard mutant's id in the diagrams' notation (it was the
guard's text as written), a ``done_state_<typo>`` transition named by ``charts paths`` (it was
offered as an event a test sends), a guard name the model does not answer said nothing of
what to do; and a differential test of two charts of shapes a team writes (a guarded
``done.state`` leaving a compound that a shallow history restores; an eventless retry loop
whose action changes the model)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from statemachine import HistoryState, State, StateChart
from statemachine.exceptions import TransitionNotAllowed

import needs
from calexec.cli import main as cli
from calexec.machines.compiled import ChartTransitionError, compiled
from calexec.machines.diagrams import render_chart_dot
from calexec.machines.mutants import apply, derive
from calexec.machines.paths import as_data


def _module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str,
            stem: str = "loans") -> ModuleType:
    """``source`` as a module of a name of its own (the import is cached), the commands run
    from its directory."""
    name = f"{stem}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return importlib.import_module(name)


LOANS = '''
from statemachine import State, StateMachine


class LoanApproval(StateMachine):
    applied = State(initial=True)
    screening = State()
    approved = State(final=True)
    rejected = State(final=True)

    screen = applied.to(screening, cond=lambda: True)
    decide = (
        screening.to(approved, cond="identity_verified and not  on_blacklist",
                     unless=lambda model: model.amount > 20000)
        | screening.to(approved, cond=lambda model: model.score >= 650, unless=lambda: False)
        | screening.to(rejected)
    )
'''


def test_a_lambda_guard_is_drawn_by_its_source_text(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found at stop 64: every lambda guard was drawn ``[<lambda>]`` (python-statemachine's
    name for any lambda), so a reviewer read nothing of the rule and two lambdas of one
    transition alike; a lambda changed in the chart left ``charts draw --check`` passing. Each
    is now drawn by its source text, two on one line told apart."""
    chart = _module(tmp_path, monkeypatch, LOANS).LoanApproval
    dot = render_chart_dot(chart)
    assert "<lambda>" not in dot, dot
    assert 'label="Screen [lambda: True]' in dot, dot
    assert ("Decide #1 [identity_verified, !on_blacklist, !(lambda model: model.amount > "
            "20000)]") in dot, dot
    assert "Decide #2 [lambda model: model.score >= 650, !(lambda: False)]" in dot, dot


def test_a_changed_lambda_makes_the_drawing_stale(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``charts draw --check`` sees a lambda's rule change (until stop 64 both were
    ``<lambda>``: the committed diagram stayed "up to date")."""
    needs.tool("dot")  # (charts draw renders the SVG beside the DOT)
    module = _module(tmp_path, monkeypatch, LOANS)
    ref = f"{module.__name__}:LoanApproval"
    assert cli(["charts", "draw", ref]) == 0
    path = tmp_path / f"{module.__name__}.py"
    path.write_text(LOANS.replace("20000", "25000"), encoding="utf-8")
    sys.modules.pop(module.__name__)
    capsys.readouterr()
    assert cli(["charts", "draw", ref, "--check"]) == 1
    assert "stale: diagrams/LoanApproval.dot: differs from the declared chart" in \
        capsys.readouterr().err


def test_a_lambda_without_source_is_named_by_where_it_was_made() -> None:
    """A lambda ``inspect`` cannot read (a chart made by ``exec``) is named by its file and
    line, the same in every process, never an address."""
    namespace: dict[str, object] = {}
    exec(compile("from statemachine import State, StateMachine\n"  # noqa: S102
                 "class Made(StateMachine):\n"
                 "    a = State(initial=True)\n"
                 "    b = State(final=True)\n"
                 "    go = a.to(b, cond=lambda: True)\n", "<made>", "exec"), namespace)
    chart = namespace["Made"]
    assert "Go [lambda at <made>:5]" in render_chart_dot(chart)  # type: ignore[arg-type]
    assert [m.id for m in derive(chart)][:2] == [  # type: ignore[arg-type]
        "guard-true:a-go->b:lambda at <made>:5", "guard-false:a-go->b:lambda at <made>:5"]


def test_a_guard_mutant_id_is_the_guard_in_the_diagrams_notation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found at stop 64: a guard mutant's id held the guard's text as written,
    ``guard-true:screening-decide->approved:identity_verified and not  on_blacklist`` (its
    spacing, its spelling: an id in an ``--equivalent`` list broke when the text was
    reformatted) and every lambda ``<lambda>`` (two on one transition ``<lambda>`` and
    ``<lambda>#2``). The id now names the guard as the diagram draws it."""
    chart = _module(tmp_path, monkeypatch, LOANS).LoanApproval
    ids = [m.id for m in derive(chart) if m.kind == "guard-true"]
    assert ids == [
        "guard-true:applied-screen->screening:lambda: True",
        "guard-true:screening-decide->approved:identity_verified,!on_blacklist",
        "guard-true:screening-decide->approved:!(lambda model: model.amount > 20000)",
        "guard-true:screening-decide->approved#2:lambda model: model.score >= 650",
        "guard-true:screening-decide->approved#2:!(lambda: False)",
    ], ids
    every = [m.id for m in derive(chart, 0)]
    assert len(every) == len(set(every)), every


@pytest.mark.parametrize("text", [
    "identity_verified and not on_blacklist", "identity_verified and !on_blacklist",
    "(identity_verified) and not (on_blacklist)", "identity_verified ^ !on_blacklist",
])
def test_a_guard_mutant_id_does_not_change_with_the_spelling_of_the_guard(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    chart = _module(tmp_path, monkeypatch, LOANS.replace(
        "identity_verified and not  on_blacklist", text)).LoanApproval
    assert "guard-false:screening-decide->approved:identity_verified,!on_blacklist" in {
        m.id for m in derive(chart)}


def test_a_mutant_id_of_before_stop_64_is_still_taken(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The ids of before (the text as written, ``<lambda>``) still name their mutant in
    ``apply``, ``--mutant`` and an ``--equivalent`` list, the report saying today's id."""
    module = _module(tmp_path, monkeypatch, LOANS)
    old = "guard-true:screening-decide->approved:identity_verified and not  on_blacklist"
    new = "guard-true:screening-decide->approved:identity_verified,!on_blacklist"
    (tmp_path / "equivalent.toml").write_text(
        f'[[mutant]]\nchart = "LoanApproval"\nid = "{old}"\nreason = "no test decides"\n',
        encoding="utf-8")
    code = cli(["charts", "mutate", "--chart", f"{module.__name__}:LoanApproval", "--mutant",
                old, "--equivalent", "equivalent.toml", "--json", "--jobs", "1",
                "--test-cmd", f"{sys.executable} -c 'import {module.__name__}'"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    report = json.loads(captured.out)
    assert [(m["id"], m["status"]) for m in report["mutants"]] == [(new, "equivalent")], report
    assert apply(module.LoanApproval, old).id == new
    assert apply(_module(tmp_path, monkeypatch, LOANS, stem="again").LoanApproval,
                 "guard-false:screening-decide->approved#2:!<lambda>").id == \
        "guard-false:screening-decide->approved#2:!(lambda: False)"


BUILD = '''
from statemachine import State, StateChart


class Build(StateChart):
    idle = State(initial=True)

    class compiling(State.Compound):
        parsing = State(initial=True)
        linked = State(final=True)
        link = parsing.to(linked)

    released = State(final=True)
    start = idle.to(compiling)
    done_state_compilng = compiling.to(released)
'''


def test_paths_name_a_done_state_event_of_no_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Found at stop 64: ``done_state_compilng = compiling.to(released)`` (a typo of
    ``compiling``) is never raised, so no run leaves ``compiling`` for ``released``; ``charts
    paths`` offered ``start done.state.compilng`` (a test sending the event itself), exit 0,
    and the tour test built on it passed. It is now a declaration bug, named with the state
    meant, exit 2."""
    module = _module(tmp_path, monkeypatch, BUILD, stem="build")
    assert cli(["charts", "paths", f"{module.__name__}:Build"]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert ("Build: state(s) released never entered from idle (done.state.compilng: Build has "
            "no state 'compilng' (did you mean 'compiling'?)") in lines[0], lines[0]
    assert "name the state: done_state_compiling" in lines[0], lines[0]
    fixed = _module(tmp_path, monkeypatch, BUILD.replace("compilng", "compiling"),
                    stem="fixed")
    assert as_data(fixed.Build)["ends"]["tour"] == ["released"]


def test_a_guard_name_the_model_does_not_answer_says_the_name_meant() -> None:
    """Found at stop 64: a guard's name mistyped in the chart (``cond="has_cerdit"``, the
    model answering ``has_credit``) was, from the flat run's ``send``, ``the model, Machine,
    has no attribute 'has_cerdit'``: the chart, event, state and guard, but nothing of what
    to do (a python-statemachine instance refuses that model as it is made). It now names
    the model's name it resembles and both fixes."""
    from statemachine import StateMachine

    class Vending(StateMachine):
        idle = State(initial=True)
        vending = State()
        select = idle.to(vending, cond="has_cerdit")
        done = vending.to(idle)

    class Machine:
        def has_credit(self) -> bool:
            return True

    run = compiled(Vending).run(Machine())
    for attempt in (lambda: run.send("select"), lambda: run.send("select", 1),
                    lambda: run.can("select")):
        with pytest.raises(AttributeError) as raised:
            attempt()
        text = str(raised.value)
        assert text.startswith("Vending: event 'select' "), text
        assert ("guard 'has_cerdit': the model, Machine, has no attribute 'has_cerdit'") in text
        assert text.endswith("; did you mean 'has_credit'? (a python-statemachine instance "
                             "refuses this model as it is made, InvalidDefinition: give Machine "
                             "a method has_cerdit, or correct the guard's name in the chart)"), text
    assert run.state == "idle"


# --- a differential test of two charts a team writes -----------------------------------


class Order:
    def __init__(self) -> None:
        self.items, self.paid, self.stock, self.fraud = 1, True, True, False
        self.log: list[str] = []

    def has_items(self) -> bool:
        return self.items > 0

    def payment_ok(self) -> bool:
        return self.paid

    def in_stock(self) -> bool:
        return self.stock

    def is_fraud(self) -> bool:
        return self.fraud


class Fulfilment(StateChart):
    """A guarded ``done.state`` leaves a compound whose shallow history a ``resume`` restores;
    a refused payment goes back inside the nested compound."""

    draft = State(initial=True)

    class processing(State.Compound):
        class checkout(State.Compound):
            reviewing = State(initial=True)
            charging = State()
            charged = State(final=True)
            confirm = reviewing.to(charging)
            charge = (charging.to(charged, cond="payment_ok")
                      | charging.to(reviewing, unless="payment_ok"))
        picking = State()
        packing = State()
        h = HistoryState()
        done_state_checkout = checkout.to(picking, cond="in_stock")
        pack = picking.to(packing)

    on_hold = State()
    shipped = State(final=True)
    cancelled = State(final=True)

    submit = draft.to(processing, cond="has_items")
    hold = processing.to(on_hold)
    resume = on_hold.to(processing.h)
    ship = processing.to(shipped, cond="in_stock and not is_fraud")
    cancel = draft.to(cancelled) | processing.to(cancelled) | on_hold.to(cancelled)

    def on_enter_packing(self) -> None:
        self.model.log.append("packing")


class Batch:
    def __init__(self) -> None:
        self.retries, self.stock, self.paid, self.items, self.fraud = 0, True, True, 1, False
        self.log: list[str] = []

    def healthy(self) -> bool:
        return self.paid

    def can_retry(self) -> bool:
        return self.retries < 3


class BatchJob(StateChart):
    """Eventless transitions out of a state a ``done.state`` enters, and an eventless retry
    loop whose entry action changes what its guard reads."""

    queued = State(initial=True)

    class running(State.Compound):
        fetching = State(initial=True)
        computing = State()
        finished = State(final=True)
        fetched = fetching.to(computing)
        computed = computing.to(finished)

    checking = State()
    succeeded = State(final=True)
    failed = State(final=True)
    retrying = State()

    start = queued.to(running)
    done_state_running = running.to(checking)
    checking.to(succeeded, cond="healthy")
    checking.to(retrying, unless="healthy")
    retrying.to(running, cond="can_retry")
    retrying.to(failed, unless="can_retry")
    crash = running.to(retrying)

    def on_enter_retrying(self) -> None:
        self.model.retries += 1
        self.model.log.append(f"retry {self.model.retries}")


def _outcome(machine: object, event: str) -> str:
    """How ``machine`` (an instance or a compiled run) answers ``event``."""
    try:
        machine.send(event)  # type: ignore[attr-defined]
    except (TransitionNotAllowed, ChartTransitionError):
        return "refused"
    return "taken"


_STEP = st.tuples(st.sampled_from(["submit", "confirm", "charge", "pack", "hold", "resume",
                                   "ship", "cancel", "start", "fetched", "computed", "crash"]),
                  st.booleans(), st.booleans(), st.booleans(), st.booleans())


@pytest.mark.parametrize(("chart", "model"), [(Fulfilment, Order), (BatchJob, Batch)])
def test_the_compiled_run_equals_python_statemachine_on_a_teams_charts(
        chart: type[StateChart], model: type) -> None:
    """Random events, and the model's answers changed between them, sent to an instance and
    to the compiled run: the same configuration, refusals and model after every event."""

    @settings(max_examples=80, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(_STEP, max_size=20))
    def check(steps: list[tuple[str, bool, bool, bool, bool]]) -> None:
        ours, theirs = model(), model()
        run = compiled(chart).run(ours)  # (first: the instance writes its state into a model)
        machine = chart(theirs)
        for event, paid, stock, fraud, empty in steps:
            for one in (ours, theirs):
                one.paid, one.stock, one.fraud, one.items = paid, stock, fraud, int(not empty)
            assert _outcome(run, event) == _outcome(machine, event), (event, steps)
            assert list(run.configuration) == [s.id for s in machine.configuration], steps
            assert (ours.log, getattr(ours, "retries", 0)) == (
                theirs.log, getattr(theirs, "retries", 0)), steps

    check()


def test_a_done_state_mutant_is_labelled_by_the_event_python_statemachine_raises() -> None:
    """Found at stop 64: the mutants of ``done_state_checkout = checkout.to(picking, ...)``
    were labelled by both names python-statemachine registers,
    ``checkout-done_state_checkout+done.state.checkout->picking``, where coverage and paths
    name the transition ``checkout --done.state.checkout--> picking``; the label is now the
    event raised, the id of before still taken."""
    ids = [m.id for m in derive(Fulfilment) if m.transition.startswith("checkout-")]
    assert ids == [
        "guard-true:checkout-done.state.checkout->picking:in_stock",
        "guard-false:checkout-done.state.checkout->picking:in_stock",
        "drop:checkout-done.state.checkout->picking",
        "target:checkout-done.state.checkout->picking:checkout",
        "target:checkout-done.state.checkout->picking:packing",
    ], ids
    every = [m.id for m in derive(Fulfilment, 0)]
    known = every + [alias for m in derive(Fulfilment, 0) for alias in m.aliases]
    assert len(known) == len(set(known)), known

    class Copy(StateChart):  # a class of its own to mutate in place
        idle = State(initial=True)

        class work(State.Compound):
            busy = State(initial=True)
            done = State(final=True)
            finish = busy.to(done)

        over = State(final=True)
        start = idle.to(work)
        done_state_work = work.to(over)

    assert apply(Copy, "drop:work-done_state_work+done.state.work->over").id == \
        "drop:work-done.state.work->over"
    machine = Copy()
    machine.send("start")
    machine.send("finish")
    assert "over" not in machine.configuration_values
