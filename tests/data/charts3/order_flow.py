"""An order workflow (StateChart): ``done.state`` from final children of a compound and of a
parallel state, ``error.execution`` handling, a validator that raises, eventless transitions
(automatic and guarded), a model object."""

from __future__ import annotations

from statemachine import State, StateChart


class Order:
    def __init__(self) -> None:
        self.log: list[tuple[object, ...]] = []
        self.items = 1
        self.fraud = False
        self.vip = False

    def has_items(self) -> bool:
        return self.items > 0

    def is_fraud(self) -> bool:
        return self.fraud

    def is_vip(self) -> bool:
        return self.vip


class OrderFlow(StateChart):
    draft = State(initial=True)

    class checking(State.Compound):
        screening = State(initial=True)
        cleared = State(final=True)
        flagged = State()
        # eventless: automatic (unless) and guarded
        screening.to(flagged, cond="is_fraud")
        screening.to(cleared, unless="is_fraud")
        review = flagged.to(cleared)

    class fulfilment(State.Parallel):
        class packing(State.Compound):
            picking = State(initial=True)
            packed = State(final=True)
            pack = picking.to(packed, validators="check_weight")

        class billing(State.Compound):
            invoicing = State(initial=True)
            charged = State(final=True)
            charge = invoicing.to(charged, on="take_payment")

    shipped = State()
    closed = State(final=True)
    broken = State()

    submit = draft.to(checking, cond="has_items")
    done_state_checking = checking.to(fulfilment)
    done_state_fulfilment = fulfilment.to(shipped)
    # a vip order closes itself once shipped (guarded eventless)
    shipped.to(closed, cond="is_vip")
    deliver = shipped.to(closed)
    error_execution = fulfilment.to(broken, on="note_error")
    retry = broken.to(fulfilment)

    def check_weight(self, weight: int = 1) -> None:
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")

    def take_payment(self, model: Order, amount: int = 10) -> None:
        model.log.append(("charge", amount))
        if amount < 0:
            raise RuntimeError(f"card declined for {amount}")

    def note_error(self, model: Order, error: Exception | None = None) -> None:
        model.log.append(("error", type(error).__name__ if error else None))

    def on_enter_state(self, model: Order, state: State) -> None:
        model.log.append(("enter", state.id))
