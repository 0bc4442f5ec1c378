"""The declared charts: spec rules their guards enforce, forbidden transitions, finals.

Every check runs on both forms: the real python-statemachine instance and the compiled run.
"""

from __future__ import annotations

import pytest
from statemachine.exceptions import TransitionNotAllowed

from calexec.machines.compiled import (
    BUFFER_SLOT,
    CHARTS,
    JOB,
    KV_TXN,
    LIFECYCLE,
    GuardRejected,
    IllegalTransition,
)
from calexec.machines.coverage import TransitionListener
from calexec.machines.paths import GuardTable, winning_guards


def both(chart, state, outcomes=None):
    """(real statemachine, compiled run) in ``state`` answering guards from ``outcomes``."""
    machine = chart.declaration(
        GuardTable.for_chart(chart, outcomes=outcomes),
        start_value=state,
        listeners=[TransitionListener(chart)],
    )
    return machine, chart.run(GuardTable.for_chart(chart, outcomes=outcomes), state)


def state_of(machine) -> str:
    (value,) = machine.configuration_values
    return value


@pytest.mark.parametrize(
    ("chart", "state", "event", "outcomes", "expected"),
    [
        # §6.5 rc/status double check: a CCU exception after Wait -> Quarantined (FI07/FI08).
        (JOB, "Submitted", "wait_returned", {"runtime_finished_cleanly": False}, "Quarantined"),
        (JOB, "Submitted", "wait_returned", {"runtime_finished_cleanly": True}, "Completing"),
        # FI12: cancelled after submit, Wait returned: result discarded (Failed) or Quarantined.
        (JOB, "CancelRequested", "wait_returned", {"runtime_finished_cleanly": True}, "Failed"),
        (JOB, "CancelRequested", "wait_returned", {"runtime_finished_cleanly": False}, "Quarantined"),
        # §9.1: execution timeout keeps buffers with the runtime.
        (JOB, "Submitted", "execution_timeout", {}, "Quarantined"),
        # FI15: returning a slot without UndoSlice quarantines it.
        (BUFFER_SLOT, "Leased", "give_back", {"undo_slice_done": False}, "Quarantined"),
        (BUFFER_SLOT, "Leased", "give_back", {"undo_slice_done": True}, "Free"),
        # §4.2: dropping a lease while Submitted quarantines.
        (BUFFER_SLOT, "InFlight", "drop_in_flight", {}, "Quarantined"),
    ],
)
def test_guarded_choice(chart, state, event, outcomes, expected):
    machine, run = both(chart, state, outcomes)
    machine.send(event)
    assert state_of(machine) == expected
    assert run.send(event) == expected


@pytest.mark.parametrize(
    ("chart", "state", "event", "outcomes"),
    [
        # §5.1-7/FI12: a cancelled job is never delivered, even with valid output.
        (JOB, "Completing", "deliver", {"not_cancelled": False, "output_validated": True}),
        # §6.5: invalid output is never delivered.
        (JOB, "Completing", "deliver", {"not_cancelled": True, "output_validated": False}),
        # FI12: a job cancelled after submit still waits; it cannot end Failed before Wait.
        (JOB, "CancelRequested", "fail", {"runtime_not_using_buffers": False}),
        # FI11: a job whose cancel flag is set does not advance towards the device.
        (JOB, "Preparing", "enqueue", {"not_cancelled": False}),
        # §5.1-6: KV commits only when the device finished and the output is valid.
        (KV_TXN, "Submitted", "commit", {"device_finished_and_output_valid": False}),
        # §9.2: Ready only after the golden check; recovery only when drained and reset.
        (LIFECYCLE, "Warming", "warmed", {"golden_passed": False}),
        (LIFECYCLE, "Draining", "recover", {"all_submitted_drained": False}),
        (LIFECYCLE, "Recovering", "reconfigure", {"reset_confirmed": False}),
        (LIFECYCLE, "Configuring", "configured", {"generation_advanced": False}),
        # §5.1-4: the host buffer stays in flight until the runtime is done with it.
        (BUFFER_SLOT, "InFlight", "device_done", {"runtime_done": False}),
    ],
)
def test_guard_refuses(chart, state, event, outcomes):
    machine, run = both(chart, state, outcomes)
    with pytest.raises(TransitionNotAllowed):
        machine.send(event)
    with pytest.raises(GuardRejected, match=event) as caught:
        run.send(event)
    assert set(caught.value.guards) & set(outcomes)
    assert run.state == state_of(machine) == state


@pytest.mark.parametrize("state", ["Created", "Admitted", "Preparing", "Queued", "Submitted",
                                   "Completing"])
def test_cancel_is_recorded_as_cancel_requested(state):
    # §5.1-7/FI11/FI12: a cancel of a job that has not ended moves it to CancelRequested, from
    # where it still waits for the runtime (after submit) before it may end.
    machine, run = both(JOB, state)
    machine.send("cancel")
    assert state_of(machine) == "CancelRequested"
    assert run.send("cancel") == "CancelRequested"


@pytest.mark.parametrize(
    ("chart", "state", "event"),
    [
        (KV_TXN, "Submitted", "rollback"),  # §7: rollback only before submit
        (KV_TXN, "Reserved", "commit"),  # §5.1-6: reserve is not commit
        (JOB, "CancelRequested", "infer_accepted"),  # FI11: no submit after cancel
        (JOB, "Submitted", "fail"),  # §6.2: after submit only completion/recovery end it
        (JOB, "Queued", "deliver"),
        (BUFFER_SLOT, "InFlight", "give_back"),  # never InFlight -> Free
        (BUFFER_SLOT, "Free", "retire"),  # only quarantined slots are destroyed
        (LIFECYCLE, "Configuring", "warmed"),
    ],
)
def test_spec_forbidden_transitions(chart, state, event):
    machine, run = both(chart, state)
    with pytest.raises(TransitionNotAllowed):
        machine.send(event)
    with pytest.raises(IllegalTransition, match=f"{event!r} is not allowed in state {state!r}"):
        run.send(event)


@pytest.mark.parametrize("chart", CHARTS.values(), ids=list(CHARTS))
def test_every_undeclared_pair_raises_on_both_forms(chart):
    for state in chart.states:
        for event in chart.events:
            if (state, event) in chart.table:
                continue
            machine, run = both(chart, state)
            with pytest.raises(TransitionNotAllowed):
                machine.send(event)
            with pytest.raises(IllegalTransition):
                run.send(event)
            assert run.state == state


@pytest.mark.parametrize("chart", CHARTS.values(), ids=list(CHARTS))
def test_each_guard_blocks_its_transition_when_false(chart):
    guarded = [t for t in chart.transitions if t.conds or t.unless]
    assert guarded, f"{chart.name} declares no guards"
    for transition in guarded:
        winning = winning_guards(chart, transition)
        flips = [(n, False) for n in transition.conds] + [(n, True) for n in transition.unless]
        for name, blocking in flips:
            run = chart.run(GuardTable.for_chart(chart, outcomes={**winning, name: blocking}),
                            transition.source)
            try:
                taken = run.select(transition.event)
            except GuardRejected:
                continue
            assert taken is not transition, f"{transition} taken although {name}={blocking}"


@pytest.mark.parametrize("chart", CHARTS.values(), ids=list(CHARTS))
def test_finals_are_final(chart):
    assert chart.finals
    for state in chart.finals:
        assert chart.run(GuardTable.for_chart(chart), state).final
        assert chart.outgoing(state) == ()
        machine, run = both(chart, state)
        for event in chart.events:
            with pytest.raises(IllegalTransition):
                run.send(event)
            with pytest.raises(TransitionNotAllowed):
                machine.send(event)
    non_final = set(chart.states) - chart.finals
    assert not any(chart.run(GuardTable.for_chart(chart), s).final for s in non_final)


def test_declared_shapes_match_the_spec():
    assert set(JOB.states) == {
        "Created", "Admitted", "Preparing", "Queued", "Submitted", "Completing",
        "Succeeded", "Failed", "CancelRequested", "Quarantined",
    }  # §4.2 JobState, all ten
    assert set(KV_TXN.states) == {"Reserved", "Submitted", "Committed", "RolledBack", "Unknown"}
    assert JOB.finals == {"Succeeded", "Failed", "Quarantined"}
    assert KV_TXN.finals == {"Committed", "RolledBack", "Unknown"}
    assert LIFECYCLE.initial == "Configuring" and LIFECYCLE.finals == {"Failed", "Stopped"}
    # §9.2: Failed reachable from every non-final lifecycle state.
    assert {t.source for t in LIFECYCLE.transitions if t.target == "Failed"} == {
        "Ready", "Draining", "Recovering", "Configuring", "Warming",
    }


def test_unknown_event_and_bad_state_are_named():
    run = JOB.run(GuardTable.for_chart(JOB))
    with pytest.raises(IllegalTransition, match="'no_such_event'"):
        run.send("no_such_event")
    assert not run.can("no_such_event")
    with pytest.raises(ValueError, match="state='Nowhere'"):
        JOB.run(GuardTable.for_chart(JOB), "Nowhere")


def test_can_evaluates_guards_without_moving():
    model = GuardTable.for_chart(JOB, outcomes={"not_cancelled": False})
    run = JOB.run(model)
    assert not run.can("admit") and run.can("cancel") and run.state == "Created"
    model.outcomes["not_cancelled"] = True
    assert run.can("admit") and run.state == "Created"


def test_every_guard_names_its_spec_rule():
    from calexec.machines.charts import GUARD_RULES

    used = set().union(*(chart.guard_names for chart in CHARTS.values()))
    assert used == set(GUARD_RULES)
    assert all("§" in rule or "FI" in rule for rule in GUARD_RULES.values())
