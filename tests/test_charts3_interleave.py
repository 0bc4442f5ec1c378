"""The interleaving explorer on a newcomer's charts (stop 46, charts3): ``charts=`` names
the charts whose contracts an exploration checks; a chart that declares none, or something
that is not a chart, is refused before a schedule runs (as ``--chart-contracts`` refuses it),
rather than explore schedules that look checked and check nothing."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from statemachine import State, StateChart

from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.chart_contracts import precondition
from calexec.machines.chartref import load_chart
from calexec.machines.clock import Clock

FIXTURES = Path(__file__).parent / "data" / "charts3"


class Till:
    def __init__(self) -> None:
        self.paid = False


class Checkout(StateChart):
    """The order flow's billing, with a contract: a sale is closed only once paid."""

    open = State(initial=True)
    paid = State()
    closed = State(final=True)
    pay = open.to(paid, on="take")
    close = paid.to(closed) | open.to(closed)

    def take(self, model: Till) -> None:
        model.paid = True

    @precondition("close")
    def closes_only_paid_sales(till: Till) -> bool:
        return till.paid


def _racing_till(clock: Clock) -> object:
    """A payer and a closer: closing first breaks the contract."""
    sale = Checkout(model=Till())
    lock = clock.lock()

    def payer() -> None:
        with lock:
            sale.send("pay")

    def closer() -> None:
        with lock:
            sale.send("close")

    clock.start_thread(payer, "payer")
    clock.start_thread(closer, "closer")
    return None


def test_the_explorer_names_a_contract_a_hierarchical_charts_race_breaks() -> None:
    found = explore_threads(_racing_till, seeds=range(40), charts=[Checkout])
    assert found.failure is not None
    assert "closes_only_paid_sales" in found.failure.message
    again = replay_threads(_racing_till, found.failure.choices, charts=[Checkout])
    assert again is not None  # the same contract on the same transition (another model object)
    assert again.message.split("; model:")[0] == found.failure.message.split("; model:")[0]


def test_a_chart_without_contracts_given_to_the_explorer_is_refused_naming_it() -> None:
    load_chart("order_flow:OrderFlow", cwd=str(FIXTURES))
    order_flow = importlib.import_module("order_flow").OrderFlow
    with pytest.raises(ValueError, match="charts: OrderFlow declares no contracts, so none "
                                         "would be checked"):
        explore_threads(_racing_till, seeds=range(3), charts=[order_flow])
    with pytest.raises(ValueError, match="OrderFlow declares no contracts"):
        replay_threads(_racing_till, [], charts=[order_flow])


@pytest.mark.parametrize("charts", [["order_flow:OrderFlow"], [object], "Checkout"])
def test_what_is_not_a_chart_given_to_the_explorer_is_refused_naming_charts(charts: object
                                                                            ) -> None:
    with pytest.raises(TypeError, match="charts"):
        explore_threads(_racing_till, seeds=range(3), charts=charts)  # type: ignore[arg-type]


def test_an_exploration_answers_as_its_schedules_run_one_at_a_time() -> None:
    """``explore_threads`` enables the charts' contracts once for all its schedules (enabling
    them walks the heap for the charts' instances): each seed's schedule, and the first
    failure (seed, choices, message), are what one exploration per seed answers."""
    alone = {seed: explore_threads(_racing_till, seeds=[seed], charts=[Checkout]).failure
             for seed in range(40)}
    passing = [seed for seed, failure in alone.items() if failure is None]
    failing = [seed for seed, failure in alone.items() if failure is not None]
    assert len(passing) >= 5 and failing  # both kinds of schedule, or this proves nothing
    together = explore_threads(_racing_till, seeds=passing + [failing[-1]], charts=[Checkout])
    assert together.schedules == len(passing) + 1
    found, expected = together.failure, alone[failing[-1]]
    assert found is not None and expected is not None
    assert (found.seed, found.choices) == (expected.seed, expected.choices)
    assert found.message.split("; model:")[0] == expected.message.split("; model:")[0]
    assert "closes_only_paid_sales" in found.message


def test_a_contract_broken_between_two_schedules_fails_neither() -> None:
    """A violation reported while no schedule runs (here by ``progress``, between two
    schedules) is not the next schedule's: only those reported from its start count."""
    broken: list[int] = []

    def progress(schedules: int, seed: int) -> None:
        if not broken:
            broken.append(seed)
            Checkout(model=Till()).send("close")  # unpaid: breaks closes_only_paid_sales

    passing = [seed for seed in range(40)
               if explore_threads(_racing_till, seeds=[seed], charts=[Checkout]).failure is None]
    found = explore_threads(_racing_till, seeds=passing[:3], charts=[Checkout], progress=progress)
    assert broken == passing[:1]
    assert found.failure is None and found.schedules == 3
