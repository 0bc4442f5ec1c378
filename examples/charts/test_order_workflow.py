"""Tests of the order workflow through calexec's public API only (docs/framework.md): the
business rules, every state and transition by generated paths, a hypothesis stateful test
comparing python-statemachine with the compiled run, the diagram's staleness check, the
transition coverage gate and chart mutation testing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test
from order_workflow import Order, OrderWorkflow
from statemachine.exceptions import TransitionNotAllowed

from calexec.machines.chart_contracts import ContractViolation, contracts_checked, enable_contracts
from calexec.machines.compiled import ChartTransitionError, compiled
from calexec.machines.paths import GuardTable, as_data

HERE = Path(__file__).resolve().parent
#: set in the nested runs below (coverage gate, mutation), which must not start runs again
NESTED = "ORDER_WORKFLOW_NESTED"
nested_only = pytest.mark.skipif(bool(os.environ.get(NESTED)), reason="inside a nested run")


def order_in(state: str) -> tuple[OrderWorkflow, Order]:
    """A workflow driven to ``state`` the shortest way (``charts paths``' data)."""
    order = Order(items=["book"], authorized=True, stock=1)
    workflow = OrderWorkflow(order)
    for step in as_data(OrderWorkflow)["states"][state]:
        if step["guards"].get("refund_issued"):
            order.refunded = True
        workflow.send(step["event"])
    return workflow, order


# ---- the business rules -----------------------------------------------------------------
def test_an_order_goes_from_cart_to_delivered():
    order = Order(items=["book", "pen"], authorized=True, stock=2)
    workflow = OrderWorkflow(order)
    for event in ("place", "pay", "ship", "deliver"):
        workflow.send(event)
    assert workflow.delivered.is_active


@pytest.mark.parametrize(
    ("state", "event", "unmet"),
    [
        ("cart", "place", {"items": []}),
        ("placed", "pay", {"authorized": False}),
        ("paid", "ship", {"stock": 0}),
        ("paid", "cancel", {"refunded": False}),
    ],
    ids=["empty-cart", "unauthorized-payment", "out-of-stock", "paid-without-refund"],
)
def test_a_rule_that_does_not_hold_refuses_the_event(state, event, unmet):
    workflow, order = order_in(state)
    for name, value in unmet.items():
        setattr(order, name, value)
    with pytest.raises(TransitionNotAllowed):
        workflow.send(event)
    assert list(workflow.configuration_values) == [state]


@pytest.mark.parametrize(("state", "event"), [("shipped", "cancel"), ("cart", "pay"),
                                              ("placed", "ship"), ("paid", "deliver")])
def test_events_out_of_order_are_refused(state, event):
    workflow, _ = order_in(state)
    with pytest.raises(TransitionNotAllowed):
        workflow.send(event)


@pytest.mark.parametrize("state", ["cart", "placed", "paid"])
def test_an_order_is_cancelled_before_it_ships(state):
    workflow, order = order_in(state)
    order.refunded = True
    workflow.send("cancel")
    assert workflow.cancelled.is_active


@pytest.mark.parametrize("final", ["delivered", "cancelled"])
def test_final_states_take_no_event(final):
    workflow, _ = order_in(final)
    assert workflow.is_terminated
    for event in compiled(OrderWorkflow).events:
        with pytest.raises(TransitionNotAllowed):
            workflow.send(event)


@pytest.mark.parametrize("kind", ["statemachine", "compiled"])
def test_an_order_emptied_after_it_was_placed_breaks_the_contract(kind):
    order = Order(items=["book"], authorized=True)
    with contracts_checked(OrderWorkflow):  # instances created from here on are checked
        run = OrderWorkflow(order) if kind == "statemachine" else compiled(OrderWorkflow).run(order)
        run.send("place")
        order.items.clear()  # a bug elsewhere in the shop
        with pytest.raises(ContractViolation, match="orders_past_the_cart_have_items") as caught:
            run.send("pay")
    assert caught.value.transition == "placed --pay--> paid" and "items=[]" in caught.value.data


# ---- generated paths: every state, every transition ---------------------------------------
PATHS = as_data(OrderWorkflow)


@pytest.mark.parametrize("state", list(PATHS["states"]))
def test_shortest_path_reaches_each_state(state):
    model = GuardTable.for_chart(OrderWorkflow)
    workflow = OrderWorkflow(model)
    for step in PATHS["states"][state]:
        model.outcomes = step["guards"]
        workflow.send(step["event"])
    assert list(workflow.configuration_values) == [state]


@pytest.mark.parametrize("walk", PATHS["tour"], ids=lambda walk: "-".join(s["event"] for s in walk))
def test_transition_tour_takes_every_transition(walk):
    model = GuardTable.for_chart(OrderWorkflow)
    workflow = OrderWorkflow(model)
    for step in walk:
        model.outcomes = step["guards"]
        assert list(workflow.configuration_values) == [step["from"]]
        workflow.send(step["event"])
        assert list(workflow.configuration_values) == [step["to"]]


# ---- hypothesis: python-statemachine and the compiled run agree ---------------------------
class OrderStateful(RuleBasedStateMachine):
    """Random events and model changes on one order: the python-statemachine instance and the
    compiled run (the same chart, the same model) take or refuse the same events."""

    def __init__(self) -> None:
        super().__init__()
        # the chart's contracts, checked on both runs (recorded, reported by an invariant)
        self.contracts = enable_contracts(OrderWorkflow, raise_on_violation=False)
        self.order = Order()
        self.workflow = OrderWorkflow(self.order)
        self.run = compiled(OrderWorkflow).run(self.order)

    def teardown(self) -> None:
        self.contracts.disable()

    @rule(item=st.sampled_from(["book", "pen"]))
    def add_item(self, item):
        self.order.items.append(item)

    @rule(authorized=st.booleans(), stock=st.integers(0, 3), refunded=st.booleans())
    def shop_changes(self, authorized, stock, refunded):
        self.order.authorized, self.order.stock, self.order.refunded = authorized, stock, refunded

    @rule(event=st.sampled_from(compiled(OrderWorkflow).events))
    def send(self, event):
        allowed = self.run.can(event)
        try:
            self.workflow.send(event)
        except TransitionNotAllowed:
            assert not allowed, f"{event}: the compiled run would take it"
            with pytest.raises(ChartTransitionError):
                self.run.send(event)
        else:
            assert allowed, f"{event}: the compiled run would refuse it"
            self.run.send(event)

    @invariant()
    def same_state(self):
        assert list(self.workflow.configuration_values) == [self.run.state]

    @invariant()
    def no_contract_violated(self):
        assert self.contracts.violations == [], [str(v) for v in self.contracts.violations]

    @invariant()
    def shipped_orders_are_paid_for(self):
        if self.run.state in ("shipped", "delivered"):
            assert self.order.has_items()


TestOrderStateful = OrderStateful.TestCase
TestOrderStateful.settings = settings(max_examples=60, stateful_step_count=15, deadline=None)


class EmptiedAfterPlacing(OrderStateful):
    """A shop with a bug: a placed order may lose its items and still be paid for."""

    @rule()
    def empty_and_pay(self):
        if self.run.state == "placed":
            self.order.items.clear()
            self.order.authorized = True
            self.send("pay")


def test_the_stateful_test_reports_a_broken_contract():
    """The stateful test's ``no_contract_violated`` fails once some run breaks the chart's
    contract (an order emptied after placing, then paid)."""
    with pytest.raises(AssertionError, match="orders_past_the_cart_have_items"):
        run_state_machine_as_test(EmptiedAfterPlacing, settings=settings(
            max_examples=300, stateful_step_count=15, deadline=None, database=None,
            phases=[Phase.generate]))


# ---- the toolkit's commands, as a user's CI runs them -------------------------------------
def test_committed_diagram_is_current():
    """``calexec charts draw order_workflow:OrderWorkflow --out diagrams`` wrote it."""
    done = subprocess.run([sys.executable, "-m", "calexec", "charts", "draw",
                           "order_workflow:OrderWorkflow", "--out", "diagrams", "--check"],
                          cwd=HERE, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.fixture
def project(tmp_path):
    """A copy of this example as a project of its own (its own pytest.ini)."""
    for name in ("order_workflow.py", "test_order_workflow.py"):
        shutil.copy(HERE / name, tmp_path / name)
    shutil.copytree(HERE / "diagrams", tmp_path / "diagrams")
    (tmp_path / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
    env[NESTED] = "1"
    return tmp_path, env


@nested_only
def test_coverage_gate_passes_at_100_percent(project):
    root, env = project
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "--chart-coverage=order_workflow:OrderWorkflow", "--chart-coverage-min=100"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300)
    n = len(compiled(OrderWorkflow).transitions)
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"transition coverage OrderWorkflow: {n}/{n}" in done.stdout


#: a deterministic sample of the mutants by default (each is a pytest run of this file: the
#: whole set takes about a minute on a 2-core machine); CALEXEC_EXAMPLE_MUTANTS=all runs every
#: one, a number another sample size
_MUTANTS = os.environ.get("CALEXEC_EXAMPLE_MUTANTS", "6")
MUTANT_SAMPLE = [] if _MUTANTS == "all" else ["--sample", _MUTANTS]


@nested_only
def test_mutation_testing_kills_every_mutant(project):
    root, env = project
    # the stateful test compares two runs of the same (mutated) chart: it cannot kill a mutant
    command = (f"{sys.executable} -m pytest -q -x -p no:cacheprovider test_order_workflow.py "
               "-k 'not Stateful'")
    done = subprocess.run(
        [sys.executable, "-m", "calexec", "charts", "mutate", "--chart",
         "order_workflow:OrderWorkflow", "--test-cmd", command, "--cwd", str(root),
         "--targets-per-transition", "1", *MUTANT_SAMPLE,
         "--fail-on-survivor", "--json"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    assert '"survived": 0' in done.stdout
