"""Stop 71's newcomer probe: a team from elsewhere points the toolkit at its own charts (a
traffic light with timer guards and Unicode names, an order workflow in a package with
relative imports, compound, parallel, history and final states, an Enum's states, a chart
made by a factory, a generated chain of 200 states, async callbacks) through every ``charts``
command and the API, and at what it gets wrong."""

from __future__ import annotations

import pytest
from statemachine import State, StateChart, StateMachine

from calexec.machines.compiled import compiled
from calexec.machines.paths import GuardTable, PathNotFollowed, drive, state_paths


class Checkout(StateMachine):
    cart = State(initial=True)
    placed = State()
    paid = State()
    shipped = State(final=True)

    place = cart.to(placed, cond="has_items")
    pay = placed.to(paid)
    ship = paid.to(shipped)


class Parcel(StateChart):
    class moving(State.Compound):
        packed = State(initial=True)
        sorted_ = State()
        sort = packed.to(sorted_)

    delivered = State(final=True)
    deliver = moving.sorted_.to(delivered)


def _not_followed(run: object, walk: object) -> str:
    with pytest.raises(PathNotFollowed) as missed:
        drive(run, walk)  # type: ignore[arg-type]
    return str(missed.value)


def test_driving_a_path_on_a_restored_run_names_the_step_and_where_the_run_began():
    """A run restored from its model's saved state (``model.state = "paid"``, as a
    python-statemachine instance restores it), made with ``state=``, or one a path was driven
    on before (replayed): ``drive`` raised the run's bare ``IllegalTransition`` ("event 'place'
    is not allowed in state 'paid'"), naming no step of the path, nor that the run was not
    where every path starts. It is now ``PathNotFollowed`` naming the step, its event, the
    state the run was in when drive began and the fresh run to drive."""
    walk = state_paths(Checkout)["shipped"]
    table = GuardTable.for_chart(Checkout)
    table.state = "paid"  # type: ignore[attr-defined]  # a saved state: the run restores it
    message = _not_followed(compiled(Checkout).run(table), walk)
    assert message.startswith("Checkout: step 1 of 3, cart --place--> placed, was not taken: "
                              "the run is in 'paid' ("), message
    assert "drive began on a run in 'paid', not in 'cart' where the path starts" in message
    assert "IllegalTransition" in message and "compiled(Checkout).run(" in message, message

    made_there = compiled(Checkout).run(GuardTable.for_chart(Checkout), state="placed")
    assert "drive began on a run in 'placed'" in _not_followed(made_there, walk)

    replayed = compiled(Checkout).run(GuardTable.for_chart(Checkout))
    assert drive(replayed, walk) == "shipped"
    message = _not_followed(replayed, walk)  # the same run, driven again
    assert "the run is in 'shipped'" in message, message
    assert "drive began on a run in 'shipped', not in 'cart'" in message, message


def test_a_statechart_run_driven_twice_says_it_began_elsewhere_not_that_a_statechart_ignores():
    """A ``StateChart`` ignores the refused event, so ``drive`` of a path on a run it drove
    before said only "a StateChart ignores a refused event and turns an action's error into
    error.execution": no error of the chart's; it now says where the run began."""
    walk = state_paths(Parcel)["delivered"]
    run = compiled(Parcel).run(GuardTable.for_chart(Parcel))
    drive(run, walk)
    message = _not_followed(run, walk)
    assert "drive began on a run in 'delivered', not in 'moving,packed' where the path " \
           "starts" in message, message
    assert "StateChart ignores" not in message, message
