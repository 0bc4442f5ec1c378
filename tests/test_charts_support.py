"""Nothing is silently dropped (issue 26): a construct the toolkit does not support yet is
refused by every tool with an error naming the construct and where it is declared; actions and
StateChart semantics, which only a compiled *run* would get wrong, are refused by the run alone."""

from __future__ import annotations

import textwrap

import pytest
from statemachine import HistoryState, State, StateChart, StateMachine

from calexec.cli import main as cli
from calexec.machines import diagrams, mutants
from calexec.machines.chart_support import UnsupportedChart, actions, unsupported
from calexec.machines.compiled import compile_chart
from calexec.machines.coverage import TransitionRecorder, track
from calexec.machines.paths import GuardTable, transition_paths


class Compound(StateChart):
    class busy(State.Compound):
        working = State(initial=True)
        resting = State()
        h = HistoryState()
        pause = working.to(resting)

    idle = State(initial=True)
    done = State(final=True)
    start = idle.to(busy)
    stop = busy.to(done)


class Parallel(StateChart):
    class both(State.Parallel):
        class left(State.Compound):
            l1 = State(initial=True)
            l2 = State(final=True)
            go_left = l1.to(l2)

        class right(State.Compound):
            r1 = State(initial=True)
            r2 = State(final=True)
            go_right = r1.to(r2)

    off = State(initial=True)
    switch = off.to(both)


class Validated(StateMachine):
    cart = State(initial=True)
    paid = State(final=True)
    pay = cart.to(paid, validators="amount_is_positive")

    def amount_is_positive(self, amount: int = 0) -> None:
        if amount <= 0:
            raise ValueError("amount must be positive")


class Eventless(StateMachine):
    a = State(initial=True)
    b = State(final=True)
    a.to(b, cond="ready")  # no event: taken as soon as ready() holds


class ExpressionGuard(StateMachine):
    a = State(initial=True)
    b = State(final=True)
    go = a.to(b, cond="ready and willing")


class WithActions(StateMachine):
    a = State(initial=True, enter="greet")
    b = State(final=True)
    go = a.to(b, on="log_go")

    def greet(self) -> None: ...

    def log_go(self) -> None: ...

    def on_exit_a(self) -> None: ...


class FlatStateChart(StateChart):
    a = State(initial=True)
    b = State(final=True)
    go = a.to(b)


@pytest.mark.parametrize(
    ("chart", "named"),
    [
        (Compound, ["compound state 'busy'", "history state 'h' in 'busy'"]),
        (Parallel, ["parallel state 'both'", "compound state 'left'", "compound state 'right'"]),
        (Validated, ["validator 'amount_is_positive' on transition cart --pay--> paid"]),
        (Eventless, ["eventless transition a --(eventless)--> b"]),
    ],
    ids=["compound-history", "parallel", "validator", "eventless"],
)
def test_unsupported_constructs_are_refused_by_every_tool_with_their_names(chart, named):
    assert [n for n in named if n not in unsupported(chart)] == []
    for tool, call in [("the compiled form", lambda: compile_chart(chart)),
                       ("the compiled form", lambda: diagrams.render_chart_dot(chart)),
                       ("the compiled form", lambda: transition_paths(chart)),
                       ("the compiled form", lambda: track(chart, TransitionRecorder())),
                       ("chart mutation", lambda: mutants.derive(chart))]:
        with pytest.raises(UnsupportedChart) as refused:
            call()
        message = str(refused.value)
        assert message.startswith(f"{chart.__name__}: {tool} does not support yet: ")
        assert all(n in message for n in named), message
        assert "\n" not in message


def test_a_guard_expression_is_refused_naming_it_and_its_transition():
    with pytest.raises(ValueError, match=r"guard 'ready and willing' on transition a --go--> b: "
                                         r"the compiled form supports named guards only"):
        compile_chart(ExpressionGuard)


def test_actions_are_drawn_and_pathed_but_a_compiled_run_refuses_naming_them():
    assert actions(WithActions) == [
        "enter action 'greet' of state 'a'",
        "exit action 'on_exit_a' of state 'a'",
        "on action 'log_go' on transition a --go--> b",
    ]
    chart = compile_chart(WithActions)
    assert "Go" in diagrams.render_chart_dot(chart) and len(transition_paths(chart)) == 1
    with pytest.raises(UnsupportedChart, match="a compiled run calls no action .* 'greet'"):
        chart.run(GuardTable.for_chart(chart))


def test_a_statechart_is_drawn_but_a_compiled_run_refuses_its_semantics():
    chart = compile_chart(FlatStateChart)
    assert len(chart.transitions) == 1 and chart.unrunnable
    with pytest.raises(UnsupportedChart, match="FlatStateChart is a StateChart"):
        chart.run(GuardTable.for_chart(chart))


def test_calexec_charts_are_supported_and_runnable():
    from calexec.machines.charts import DECLARED
    from calexec.machines.compiled import CHARTS

    assert all(unsupported(chart) == [] and actions(chart) == [] for chart in DECLARED.values())
    assert all(chart.unrunnable == () for chart in CHARTS.values())


@pytest.mark.parametrize("command", ["draw", "paths"])
def test_commands_refuse_an_unsupported_chart_in_one_line(tmp_path, monkeypatch, capsys, command):
    (tmp_path / "nested_chart.py").write_text(textwrap.dedent("""
        from statemachine import State, StateChart


        class Nested(StateChart):
            class outer(State.Compound):
                inner = State(initial=True)

            start = State(initial=True)
            enter = start.to(outer)
    """))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli(["charts", command, "nested_chart:Nested"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"calexec charts {command}: Nested: the compiled form does not support yet: "
                   "compound state 'outer'"]
