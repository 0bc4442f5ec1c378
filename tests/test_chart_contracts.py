"""Contracts on charts (issue 26, machines/chart_contracts.py): invariants per state and
pre/postconditions per event, declared in the chart's class, checked by compiled runs and by
python-statemachine instances alike while enabled, reported as a ``ContractViolation`` naming
the chart, the contract, the transition and the model; and calexec's own one-chart §5.1
invariants, now contracts of machines/charts.py, caught on both run kinds."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
from statemachine import State, StateChart, StateMachine

from calexec.machines.chart_contracts import (
    ContractViolation,
    check_invariants,
    contracts_checked,
    declared_contracts,
    invariant,
    postcondition,
    precondition,
)
from calexec.machines.charts import BufferSlotChart, KvTxnChart
from calexec.machines.compiled import compiled


@dataclass
class Account:
    balance: int = 0
    frozen: bool = False
    audited: bool = True

    def can_spend(self) -> bool:
        return True  # the seeded bug: never looks at the balance


class Wallet(StateMachine):
    open = State(initial=True)
    spent = State()
    closed = State(final=True)

    spend = open.to(spent, cond="can_spend")
    refill = spent.to(open)
    close = open.to(closed) | spent.to(closed)

    @invariant("spent")
    def never_overdrawn(account: Account) -> bool:  # noqa: N805
        return account.balance >= 0

    @precondition("close")
    def only_unfrozen_accounts_close(account: Account) -> bool:  # noqa: N805
        return not account.frozen

    @postcondition("refill")
    def refills_are_audited(account: Account) -> bool:  # noqa: N805
        return account.audited


def spend_psm(account: Account) -> None:
    account.balance -= 5
    Wallet(account).send("spend")


def spend_compiled(account: Account) -> None:
    account.balance -= 5
    compiled(Wallet).run(account).send("spend")


@pytest.mark.parametrize("spend", [spend_psm, spend_compiled], ids=["psm", "compiled"])
def test_a_violated_invariant_is_reported_by_both_run_kinds(spend):
    with contracts_checked(Wallet) as monitor:
        with pytest.raises(ContractViolation) as caught:
            spend(Account(balance=3))
    violation = caught.value
    assert (violation.chart, violation.contract, violation.kind) == (
        "Wallet", "never_overdrawn", "invariant")
    assert violation.transition == "open --spend--> spent" and violation.state == "spent"
    assert "balance=-2" in violation.data and "never_overdrawn" in str(violation)
    assert monitor.violations == [violation]


@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_pre_and_postconditions_are_checked_on_their_events(kind):
    account = Account(balance=10, frozen=True)
    with contracts_checked(Wallet, raise_on_violation=False) as monitor:
        if kind == "psm":
            wallet = Wallet(account)
            wallet.send("spend")
            account.audited = False
            wallet.send("refill")
            wallet.send("close")
        else:
            run = compiled(Wallet).run(account)
            for event in ("spend", "refill", "close"):
                if event == "refill":
                    account.audited = False
                run.send(event)
    found = [(v.kind, v.contract, v.transition) for v in monitor.violations]
    assert found == [
        ("postcondition", "refills_are_audited", "spent --refill--> open"),
        ("precondition", "only_unfrozen_accounts_close", "open --close--> closed"),
    ]


def test_contracts_are_off_unless_enabled():
    account = Account(balance=-1)
    Wallet(account).send("spend")  # nothing checks: no raise
    compiled(Wallet).run(Account(balance=-1)).send("spend")  # (account holds "spent" now)
    assert compiled(Wallet).checker is None
    with contracts_checked(Wallet):
        assert compiled(Wallet).checker is not None
    assert compiled(Wallet).checker is None
    assert check_invariants(Wallet, "spent", account)[0].contract == "never_overdrawn"
    assert check_invariants(Wallet, "open", account) == []


def test_a_contract_naming_an_unknown_state_is_refused_by_name():
    class Typo(StateMachine):
        a = State(initial=True)
        b = State(final=True)
        go = a.to(b)

        @invariant("c")
        def c_holds(model: object) -> bool:  # noqa: N805
            return True

    with pytest.raises(ValueError, match=r"@invariant\('c'\) on c_holds: 'c' is not a state"):
        declared_contracts(Typo)
    with pytest.raises(ValueError, match="name at least one state"):
        invariant()


def test_a_contract_naming_an_unknown_event_is_refused_by_name():
    class Typo(StateMachine):
        a = State(initial=True)
        b = State(final=True)
        go = a.to(b)

        @precondition("gone")
        def ready(model: object) -> bool:  # noqa: N805
            return True

    # it said "'gone' is not a event of the chart"
    with pytest.raises(ValueError, match=r"@precondition\('gone'\) on ready: 'gone' is not an "
                                         r"event of the chart \(one of go\)"):
        declared_contracts(Typo)


# ---- calexec's own charts: the one-chart §5.1 invariants as contracts ----------------------
class Evidence:
    """A KV txn model whose commit guard says yes (as a mutant forcing it would) while the
    device's answers say the job did not finish cleanly."""

    def __init__(self) -> None:
        self.calls = 0

    def device_finished_and_output_valid(self) -> bool:
        self.calls += 1
        return self.calls == 1  # the guard passes; the invariant checked after it does not


@pytest.mark.contract_violations_expected
@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_a_kv_commit_without_device_evidence_is_a_contract_violation(kind):
    """Stateful invariant 6's one-chart half (moved from tests/test_executor_stateful.py):
    a KV txn is Committed only when the device finished and the output was valid. The
    session's contracts (tests/conftest.py) are on; this test's own monitor sees it too."""
    model = Evidence()
    with contracts_checked(KvTxnChart, raise_on_violation=False) as monitor:
        if kind == "psm":
            txn = KvTxnChart(model)
            txn.send("mark_submitted")
            with pytest.raises(ContractViolation, match="commits_only_after_device_done"):
                txn.send("commit")
        else:
            run = compiled(KvTxnChart).run(model)
            run.send("mark_submitted")
            with pytest.raises(ContractViolation, match="commits_only_after_device_done"):
                run.send("commit")
    assert [(v.chart, v.state) for v in monitor.violations] == [("kv_txn", "Committed")]


class Slot:
    """A slot model whose UndoSlice check passes for the ``give_back`` guard and fails right
    after (as with the ``undo_slice_done`` force-true mutant: a sliced slot is freed)."""

    def __init__(self) -> None:
        self.calls = 0

    def undo_slice_done(self) -> bool:
        self.calls += 1
        return self.calls == 1

    def runtime_done(self) -> bool:
        return True

    def reset_confirmed(self) -> bool:
        return True


@pytest.mark.contract_violations_expected
@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_a_slot_freed_with_a_slice_left_is_a_contract_violation(kind):
    """FI15: a slot reaches the free list only with every slice undone."""
    model = Slot()
    run = BufferSlotChart(model) if kind == "psm" else compiled(BufferSlotChart).run(model)
    run.send("lease")
    with pytest.raises(ContractViolation, match="buffer_slot: invariant "
                       "'free_slots_carry_no_slice' violated on Leased --give_back--> Free"):
        run.send("give_back")


# ---- the pytest option: a user's project turns its chart's contracts on for a session -----
PROJECT_CHART = '''
from statemachine import State, StateChart, StateMachine

from calexec.machines.chart_contracts import invariant


class Door(StateMachine):
    shut = State(initial=True)
    open = State()
    swing = shut.to(open) | open.to(shut)

    @invariant("open")
    def opens_only_unlocked(door) -> bool:
        return not door.locked


class Lock:
    locked = True
'''

PROJECT_TEST = '''
from door_chart import Door, Lock


def test_swing_a_locked_door():
    door = Door(Lock())
    try:
        door.send("swing")
    except Exception:
        pass  # the code under test swallows errors: the session still fails
'''


def test_the_pytest_option_turns_a_projects_contracts_on(tmp_path):
    """``--chart-contracts=MODULE:CLASS`` (the plugin installed with calexec): the same
    project's tests pass without it and fail with it, naming the contract."""
    (tmp_path / "door_chart.py").write_text(PROJECT_CHART)
    (tmp_path / "test_door.py").write_text(PROJECT_TEST)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "test_door.py"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    off = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert off.returncode == 0, off.stdout[-2000:]
    on = subprocess.run([*command, "--chart-contracts=door_chart:Door"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=120)
    assert on.returncode == 1, on.stdout[-2000:]
    assert "chart contracts: 1 violation(s); the first: Door: invariant 'opens_only_unlocked'" \
        in on.stdout
    bad = subprocess.run([*command, "--chart-contracts=door_chart:Nope"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 4 and ("--chart-contracts='door_chart:Nope': module 'door_chart' "
                                    "has no attribute 'Nope'") in bad.stderr, bad.stderr[-500:]


def test_the_pytest_option_on_a_chart_without_contracts_says_so(tmp_path):
    """stop 44: ``--chart-contracts`` naming a chart that declares none ran the session as if
    it checked something, silently. It is a usage error, one line naming it (exit 4, as for
    any bad value of the option)."""
    (tmp_path / "bare_chart.py").write_text(
        "from statemachine import State, StateMachine\n\n"
        "class Bare(StateMachine):\n"
        "    idle = State(initial=True)\n"
        "    done = State(final=True)\n"
        "    go = idle.to(done)\n")
    (tmp_path / "test_bare.py").write_text("def test_nothing():\n    pass\n")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
         "no:hypothesispytest", "test_bare.py", "--chart-contracts=bare_chart:Bare"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
        text=True, timeout=120)
    assert run.returncode == 4, (run.stdout[-1000:], run.stderr[-1000:])
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert errors == ["ERROR: --chart-contracts='bare_chart:Bare': Bare declares no contracts, "
                      "so none would be checked (declare them in the class with @invariant, "
                      "@precondition or @postcondition from calexec.machines.chart_contracts)"], \
        run.stderr


NOT_CHECKABLE = '''
from statemachine import State, StateChart

from calexec.machines.chart_contracts import invariant


class Aio(StateChart):
    idle = State(initial=True)
    done = State(final=True)
    go = idle.to(done)

    async def on_go(self):
        return 1


class Typo(StateChart):
    idle = State(initial=True)
    done = State(final=True)
    go = idle.to(done)

    @invariant("dnoe")
    def finished(model) -> bool:
        return True
'''


@pytest.mark.parametrize(("chart", "reason"), [
    # (an async action: its instances are checked since stop 70; a chart with none declared
    # is still refused)
    ("Aio", "Aio declares no contracts, so none would be checked (declare them in the class "
            "with @invariant, @precondition or @postcondition from "
            "calexec.machines.chart_contracts)"),
    ("Typo", "Typo: @invariant('dnoe') on finished: 'dnoe' is not a state of the chart "
             "(one of idle, done); did you mean 'done'?"),
])
def test_a_chart_the_contracts_option_cannot_check_is_named_by_the_option_s_value(
        tmp_path, chart, reason):
    """``--chart-contracts=odd_charts:Aio`` (an async action) or a chart whose contract names
    no state said ``--chart-contracts: Aio: ...``: not the value given (nor, of several values,
    which one), where ``--chart-coverage`` says ``--chart-coverage='odd_charts:Aio': ...``.
    Both read ``--flag='value': <why>``."""
    (tmp_path / "odd_charts.py").write_text(NOT_CHECKABLE)
    (tmp_path / "test_nothing.py").write_text("def test_nothing():\n    pass\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "-p", "no:hypothesispytest", "test_nothing.py",
               f"--chart-contracts=odd_charts:{chart}"]
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 4, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.strip().splitlines() == [
        f"ERROR: --chart-contracts='odd_charts:{chart}': {reason}"], done.stderr[-1000:]


class Hatch(StateMachine):
    """A hierarchical chart (compound ``closed``): its compiled run is the general one."""

    class closed(State.Compound):  # noqa: N801 - python-statemachine's declaration style
        latched = State(initial=True)
        unlatched = State()
        unlatch = latched.to(unlatched)

    opened = State(final=True)
    open = closed.to(opened)

    @precondition("open")
    def only_unfrozen_hatches_open(account: Account) -> bool:  # noqa: N805
        return not account.frozen


@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_contracts_are_checked_by_the_general_run_of_a_hierarchical_chart(kind):
    assert compiled(Hatch).general  # not the flat fast path
    account = Account(frozen=True)
    with contracts_checked(Hatch):
        run = Hatch(account) if kind == "psm" else compiled(Hatch).run(account)
        with pytest.raises(ContractViolation) as caught:
            run.send("open")
    assert caught.value.contract == "only_unfrozen_hatches_open"


def test_an_invariant_is_checked_after_an_eventless_transition_of_an_instance():
    """python-statemachine calls listeners with ``event=None`` for an eventless transition;
    the contract listener looked it up as ``"None"``, so an instance entering a state by one
    never had that state's invariant checked (the compiled run did check it)."""
    from statemachine import StateChart

    class Kettle(StateChart):
        cold = State(initial=True)
        boiling = State()
        whistling = State(final=True)
        heat = cold.to(boiling)
        boiling.to(whistling)  # eventless: as soon as it boils

        @invariant("whistling")
        def has_water(account: Account) -> bool:
            return account.balance > 0

    with contracts_checked(Kettle, raise_on_violation=False) as monitor:
        Kettle(Account(balance=0)).send("heat")
    assert [(v.contract, v.transition) for v in monitor.violations] == [
        ("has_water", "boiling --(eventless)--> whistling")], monitor.violations


class Workshop(StateChart):
    """A compound state entered through its parent: ``bench`` is entered by ``start``, whose
    target is ``work``; ``tools`` is a region of a parallel state entered by ``equip``."""

    idle = State(initial=True)

    class work(State.Compound):  # noqa: N801 - python-statemachine's declaration style
        bench = State(initial=True)
        lathe = State()
        turn = bench.to(lathe)

    class kit(State.Parallel):  # noqa: N801
        class tools(State.Compound):  # noqa: N801
            boxed = State(initial=True)
        class gloves(State.Compound):  # noqa: N801
            worn = State(initial=True)

    start = idle.to(work)
    equip = idle.to(kit)

    @invariant("bench", "boxed")
    def bench_needs_power(account: Account) -> bool:  # noqa: N805
        return account.balance > 0

    @invariant("work")
    def work_is_audited(account: Account) -> bool:  # noqa: N805
        return account.audited


@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_an_invariant_of_a_state_entered_by_its_parents_transition_is_checked(kind):
    """A transition into ``work`` enters ``bench`` too (its initial child), and one into the
    parallel ``kit`` enters ``boxed``: their invariants were never checked (only the
    transition's target's were), so a run sat in a state breaking its invariant unnoticed."""
    for event, state in (("start", "bench"), ("equip", "boxed")):
        with contracts_checked(Workshop, raise_on_violation=False) as monitor:
            run = Workshop(Account()) if kind == "psm" else compiled(Workshop).run(Account())
            run.send(event)
        assert [(v.contract, v.state) for v in monitor.violations] == [
            ("bench_needs_power", state)], monitor.violations


@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_an_invariant_is_checked_after_a_transition_within_its_state(kind):
    """The invariant of a compound state holds while the run is in it: a transition between
    its children (``bench -> lathe``) checks it too."""
    account = Account(balance=1)
    with contracts_checked(Workshop, raise_on_violation=False) as monitor:
        run = Workshop(account) if kind == "psm" else compiled(Workshop).run(account)
        run.send("start")
        account.audited = False
        run.send("turn")
    assert [(v.contract, v.state, v.transition) for v in monitor.violations] == [
        ("work_is_audited", "work", "bench --turn--> lathe")], monitor.violations


class Gate(StateChart):
    """``StateChart`` semantics: a callback's error becomes ``error.execution``."""

    shut = State(initial=True)
    ajar = State()
    broken = State(final=True)
    swing = shut.to(ajar)
    error_execution = shut.to(broken) | ajar.to(broken)

    @precondition("swing")
    def swings_only_unfrozen(account: Account) -> bool:  # noqa: N805
        return not account.frozen

    @invariant("ajar")
    def ajar_only_funded(account: Account) -> bool:  # noqa: N805
        return account.balance > 0


@pytest.mark.parametrize("kind", ["psm", "compiled"])
@pytest.mark.parametrize("broken", ["precondition", "invariant"])
def test_a_violation_is_raised_from_send_under_statechart_semantics(kind, broken):
    """python-statemachine turns a callback's (a listener's) exception into the internal
    ``error.execution`` event under ``StateChart`` semantics: the violation was swallowed
    (not raised from ``send``) and it sent the chart down its own error transition."""
    account = Account(balance=0 if broken == "invariant" else 1, frozen=broken == "precondition")
    with contracts_checked(Gate):
        run = Gate(account) if kind == "psm" else compiled(Gate).run(account)
        with pytest.raises(ContractViolation) as caught:
            run.send("swing")
    assert caught.value.kind == broken
    configuration = (list(run.configuration_values) if kind == "psm"
                     else list(run.configuration))
    assert "broken" not in configuration, configuration


class Batch(StateChart):
    """``done_state_job``: the transition python-statemachine takes on ``done.state.job``."""

    class job(State.Compound):  # noqa: N801 - python-statemachine's declaration style
        running = State(initial=True)
        finished = State(final=True)
        finish = running.to(finished)

    archived = State(final=True)
    done_state_job = job.to(archived)

    @precondition("done_state_job")
    def archives_only_audited(account: Account) -> bool:  # noqa: N805
        return account.audited


@pytest.mark.parametrize("kind", ["psm", "compiled"])
def test_a_contract_on_a_done_state_event_by_its_declared_name_is_checked(kind):
    """A precondition on ``done_state_job`` (the name the chart declares, which the contract
    check accepts) was never checked: the transition is taken on ``done.state.job``."""
    account = Account(audited=False)
    with contracts_checked(Batch, raise_on_violation=False) as monitor:
        run = Batch(account) if kind == "psm" else compiled(Batch).run(account)
        run.send("finish")
    assert [(v.contract, v.transition) for v in monitor.violations] == [
        ("archives_only_audited", "job --done.state.job--> archived")], monitor.violations


def test_a_transition_an_invariant_broke_after_is_counted_at_once_by_the_general_run():
    """The invariant is checked after the state changed: the run is in ``ajar`` when the
    violation is raised, and the flat run has counted the transition. The general run kept
    it pending until its next ``send``: coverage, the inspector's rates and a followed path
    missed it (and stamped it later, after whatever came next)."""
    from collections import deque

    chart = compiled(Gate)
    swing = next(t for t in chart.transitions if t.event == "swing")
    before = chart.taken[swing.id]
    with contracts_checked(Gate):
        run = chart.run(Account(balance=0))
        trail: deque[object] = deque()
        run.keep_trail(trail, lambda: 1.0)
        with pytest.raises(ContractViolation):
            run.send("swing")
    assert list(run.configuration) == ["ajar"]
    assert chart.taken[swing.id] == before + 1
    assert [step[:3] for step in trail] == [("swing", "shut", "ajar")]  # type: ignore[index]
