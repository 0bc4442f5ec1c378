"""Stop 70's newcomer probe: a team from elsewhere points the toolkit at its own charts (charts
made by a factory from a list of stage names, a subclass adding states to a concrete base, a
chart with async callbacks used from asyncio, a generated workflow of 163 states and 640
transitions, states with ``value=`` read from a DB column through a custom ``state_field``)
and at what it gets wrong."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from statemachine import State, StateChart, StateMachine

from calexec.machines.chart_support import UnsupportedChart
from calexec.machines.compiled import compiled


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
