"""An order workflow, declared once with python-statemachine and checked with calexec's
statechart toolkit (docs/framework.md, "Your own chart in ten minutes").

Six states, two of them final; the guards are business rules, each a zero-argument method of
the model (``Order``) named after the rule it enforces.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from statemachine import State, StateMachine

from calexec.machines.chart_contracts import invariant


class OrderWorkflow(StateMachine):
    """cart -place-> placed -pay-> paid -ship-> shipped -deliver-> delivered; an order is
    cancelled before it ships (a paid one only once the refund went out)."""

    cart = State(initial=True)
    placed = State()
    paid = State()
    shipped = State()
    delivered = State(final=True)
    cancelled = State(final=True)

    place = cart.to(placed, cond="has_items")
    pay = placed.to(paid, cond="payment_authorized")
    ship = paid.to(shipped, cond="in_stock")
    deliver = shipped.to(delivered)
    cancel = (
        cart.to(cancelled)
        | placed.to(cancelled)
        | paid.to(cancelled, cond="refund_issued")
    )

    # A contract (calexec.machines.chart_contracts): checked, while enabled, after every
    # transition into these states, by python-statemachine and compiled runs alike. An order
    # emptied after it was placed is reported at its next step.
    @invariant("placed", "paid", "shipped", "delivered")
    def orders_past_the_cart_have_items(order: Order) -> bool:  # noqa: N805 (the model)
        return bool(order.items)


@dataclass
class Order:
    """The model the guards ask: what the shop knows about one order."""

    items: list[str] = field(default_factory=list)
    authorized: bool = False
    stock: int = 0
    refunded: bool = False

    def has_items(self) -> bool:
        return bool(self.items)

    def payment_authorized(self) -> bool:
        return self.authorized

    def in_stock(self) -> bool:
        return self.stock >= len(self.items)

    def refund_issued(self) -> bool:
        return self.refunded
