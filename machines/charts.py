"""The declared statecharts: the single source of truth for every state and transition.

Four separate ``StateMachine`` classes (StateMachine semantics: an event with no enabled
transition raises ``TransitionNotAllowed``, callback errors propagate; never ``StateChart``,
which swallows both). They are separate machines, so their state ids are chart-local (Job and
KV txn both have ``Submitted``).

Guards are *names*, resolved on the model object the owner passes in; each is named after the
spec rule it enforces and documented below with its spec section. Where one event has several
transitions from a state, the first whose guards pass wins (declaration order), and a guardless
last transition is the fallback.

The hot path never runs these classes directly: ``calexec.machines.compiled`` derives a
transition table from them at import time (see there).

The §5.1 invariants that are properties of one chart's run are declared here as contracts
(``calexec.machines.chart_contracts``: ``@invariant(state)``), a function of the run's model
each. Each asks the model only what the chart's own guards ask (its answers are the facts;
the chart-alone tests answer the guards from a table, ``paths.GuardTable``, and the contracts
hold there too): a state reached while the model's answer says otherwise (a guard skipped, a
forced or mutated guard, a state set by hand) is a violation. They are checked by every
compiled and python-statemachine run while contracts are enabled (calexec's tests enable them
for the whole session, tests/conftest.py; production does not). The invariants that relate
several components (a slot and the job leasing it, the pools of two generations) stay in
tests/test_executor_stateful.py.
"""

from __future__ import annotations

from typing import Protocol

from statemachine import State, StateMachine

from calexec.machines.contract_decl import invariant


class _JobModel(Protocol):
    def runtime_finished_cleanly(self) -> bool: ...

    def output_validated(self) -> bool: ...


class _KvTxnModel(Protocol):
    def device_finished_and_output_valid(self) -> bool: ...


class _LifecycleModel(Protocol):
    def generation_advanced(self) -> bool: ...

    def golden_passed(self) -> bool: ...

    def never_opened(self) -> bool: ...

    def shutdown_requested(self) -> bool: ...

    def all_submitted_drained(self) -> bool: ...


class _SlotModel(Protocol):
    def undo_slice_done(self) -> bool: ...

    def reset_confirmed(self) -> bool: ...

# Guard rules (the model object answers each by a zero-argument method of the same name).
GUARD_RULES: dict[str, str] = {
    # Job (§4.2, §5.1, §6)
    "not_cancelled": (
        "§6.2/§6.4: the job's atomic cancel flag is not set; a job only advances towards the "
        "device, and a result is only delivered (§5.1-7), while nobody asked to cancel it"
    ),
    "runtime_not_using_buffers": (
        "§4.2 BufferLease/§6.2: a job may end Failed (its buffers go back to the pool) only when "
        "the runtime holds none of them: infer() never returned success, or Wait() returned"
    ),
    "runtime_finished_cleanly": (
        "§6.5: Wait() returned CalrtSuccess and GetStatus() is DONE (not DONE_CCU_EXCEPTION): "
        "the rc/status double check"
    ),
    "output_validated": (
        "§6.5/§5.1-6: output tensor shape/size checked and logits finite; only then is the "
        "result delivered (and the KV committed)"
    ),
    # KV txn (§7)
    "device_finished_and_output_valid": (
        "§5.1-6/§7: a KV reservation commits only once the device finished and the output "
        "passed validation"
    ),
    # Lifecycle (§9.2)
    "generation_advanced": (
        "§9.2: recovery and bring-up need generation+1 with a freshly created Calbin, "
        "KvManager and buffer pool before warming"
    ),
    "golden_passed": "§9.2: the fixed prefill+decode golden check passed; only then take traffic",
    "last_good_known": (
        "§8 Artifact row / §9.2 model switch: a previously Ready calbin other than the refused "
        "one is known, so the switch can roll back to it"
    ),
    "all_submitted_drained": (
        "§9.1/§5.1-7: every submitted job has returned from Wait() (or been handed to a "
        "verified reset); no DMA buffer is released before that"
    ),
    "never_opened": (
        "FI13: shutdown before start: no device was opened and no generation exists, so "
        "there is nothing to drain and the exit is orderly (Stopped, not Failed)"
    ),
    "shutdown_requested": (
        "FI13: shutdown() was called: nothing is configured from then on, so a recovery or "
        "model switch that already tore the old generation down ends there (Stopped once "
        "drained) instead of configuring a generation only for the shutdown to tear it down"
    ),
    "reset_confirmed": (
        "§9.1/§9.2: after the drain or the vendor-confirmed reset, the runtime no longer "
        "touches any old-generation buffer (its own answer, never assumed)"
    ),
    # Buffer slot (§4.2, §5.1-3/4/8, FI15)
    "runtime_done": "§4.2/§5.1-4: the runtime finished with the slot's mapped host buffers",
    "undo_slice_done": (
        "FI15/§6.5: a slot goes back to the free list only after UndoSlice (reset slice/"
        "tensors); otherwise it is quarantined"
    ),
}


class JobChart(StateMachine):
    """One inference job (§4.2 ``JobState``, all ten states; §6 call flow; §9 cancel/timeout).

    Happy path: Created -admit-> Admitted -begin_preparation-> Preparing -enqueue-> Queued
    -infer_accepted-> Submitted -wait_returned-> Completing -deliver-> Succeeded.

    - Failure before submit (including infer() returning an error, FI05): ``fail`` -> Failed,
      resources released in reverse order by the owner.
    - Cancel before submit (FI11): ``cancel`` -> CancelRequested, then ``fail`` -> Failed
      without touching the device.
    - Cancel after submit (FI12): ``cancel`` -> CancelRequested; the job still goes through
      Wait(); ``wait_returned`` ends it Failed (result discarded) when the runtime finished
      cleanly, Quarantined otherwise. ``fail`` is refused until Wait() returned.
    - Failure after submit (Wait error, DONE_CCU_EXCEPTION: ``wait_returned`` fallback; bad
      output: ``fault``) -> Quarantined (buffers quarantined, KV Unknown).
    - Execution timeout (§9.1) -> Quarantined.
    """

    Created = State(initial=True)
    Admitted = State()
    Preparing = State()
    Queued = State()
    Submitted = State()
    Completing = State()
    CancelRequested = State("CancelRequested")
    Succeeded = State(final=True)
    Failed = State(final=True)
    Quarantined = State(final=True)

    # §6.2: deadline/cancel check, then admission reserved KV + token budget.
    admit = Created.to(Admitted, cond="not_cancelled")
    # §6.2: buffer lease acquired; copying inputs, slices, CSRs (§6.3 checks) starts.
    begin_preparation = Admitted.to(Preparing, cond="not_cancelled")
    # §6.2: prepared job pushed on the submit queue.
    enqueue = Preparing.to(Queued, cond="not_cancelled")
    # §6.4: infer() returned CalrtSuccess; from here the runtime owns the buffers, so no guard
    # can refuse this fact. (The submitter checks the cancel flag before calling infer().)
    infer_accepted = Queued.to(Submitted)
    # §6.5: Wait() returned. rc/status double check decides; a cancelled job's result is
    # discarded (FI12).
    wait_returned = (
        Submitted.to(Completing, cond="runtime_finished_cleanly")
        | Submitted.to(Quarantined)
        | CancelRequested.to(Failed, cond="runtime_finished_cleanly")
        | CancelRequested.to(Quarantined)
    )
    # §6.5: validated output delivered, KV committed, lease released.
    deliver = Completing.to(Succeeded, cond=["output_validated", "not_cancelled"])
    # §6.5: failure after submit discovered after Wait (shape/size, NaN/Inf: FI09, FI10).
    fault = Completing.to(Quarantined)
    # §9.1: execution deadline passed before Wait() returned; buffers stay with the runtime.
    execution_timeout = Submitted.to(Quarantined) | CancelRequested.to(Quarantined)
    # §5.1-7: cancel only stops delivery; it never releases resources by itself.
    cancel = (
        Created.to(CancelRequested)
        | Admitted.to(CancelRequested)
        | Preparing.to(CancelRequested)
        | Queued.to(CancelRequested)
        | Submitted.to(CancelRequested)
        | Completing.to(CancelRequested)
    )
    # §6.2: any failure before submit releases what was acquired in reverse order; also the
    # end of a cancelled job once the runtime holds none of its buffers.
    fail = (
        Created.to(Failed, cond="runtime_not_using_buffers")
        | Admitted.to(Failed, cond="runtime_not_using_buffers")
        | Preparing.to(Failed, cond="runtime_not_using_buffers")
        | Queued.to(Failed, cond="runtime_not_using_buffers")
        | CancelRequested.to(Failed, cond="runtime_not_using_buffers")
    )

    @invariant("Completing")
    def completes_only_after_a_clean_wait(job: _JobModel) -> bool:  # noqa: N805 (the model)
        """§6.5: a job completes only when Wait() returned CalrtSuccess and the status is
        DONE, the runtime's own answers."""
        return job.runtime_finished_cleanly()

    @invariant("Succeeded")
    def delivers_only_validated_output(job: _JobModel) -> bool:  # noqa: N805
        """§5.1-6: a result is delivered only once its output passed validation."""
        return job.output_validated()


class KvTxnChart(StateMachine):
    """One KV reservation (§7 ``KvTxnState``).

    Rollback only before submit; after submit the txn either commits (device finished and
    output valid, §5.1-6) or becomes Unknown (§7: "any error after a successful submit is
    Unknown by default"). Unknown is final for the txn: only a sequence reset, done by the KV
    coordinator, clears the sequence.
    """

    Reserved = State(initial=True)
    Submitted = State()
    Committed = State(final=True)
    RolledBack = State("RolledBack", final=True)
    Unknown = State(final=True)

    mark_submitted = Reserved.to(Submitted)
    commit = Submitted.to(Committed, cond="device_finished_and_output_valid")
    rollback = Reserved.to(RolledBack)
    mark_unknown = Submitted.to(Unknown)

    @invariant("Committed")
    def commits_only_after_device_done_and_valid(txn: _KvTxnModel) -> bool:  # noqa: N805
        """§5.1-6 (stateful invariant 6, its one-chart half): a KV reservation is committed
        only once the device finished (Wait rc 0, DONE) and the output was validated."""
        return txn.device_finished_and_output_valid()


class LifecycleChart(StateMachine):
    """The device/model lifecycle (§9.2).

    Ready -> Draining -> Recovering -> Configuring -> Warming -> Ready, with Failed reachable
    from every non-final state. A model switch takes the same path (drain, tear down the old
    generation, configure the new one). ``Stopped`` is added to the spec's diagram as the final
    state of a clean shutdown (FI13: queued jobs cancelled, submitted ones drained), so that an
    orderly exit is never confused with ``Failed`` (unrecoverable: the supervisor restarts).
    """

    Configuring = State(initial=True)
    Warming = State()
    Ready = State()
    Draining = State()
    Recovering = State()
    Failed = State(final=True)
    Stopped = State(final=True)

    configured = Configuring.to(Warming, cond="generation_advanced")
    warmed = Warming.to(Ready, cond="golden_passed")
    drain = Ready.to(Draining)
    recover = Draining.to(Recovering, cond="all_submitted_drained")
    reconfigure = Recovering.to(Configuring, cond="reset_confirmed")
    # a shutdown before start(): nothing was opened, so the exit is orderly (not Failed);
    # a shutdown that stopped a recovery's golden run (FI13: the golden's queued jobs are
    # cancelled like any others) drains what was submitted and ends as orderly; a shutdown
    # that began once a recovery or model switch tore the old generation down (Recovering),
    # or before it configured the next one (Configuring: a refused one torn down, no roll
    # back), ends it there: nothing is configured once a shutdown was requested
    stop = (Draining.to(Stopped, cond="all_submitted_drained")
            | Configuring.to(Stopped, cond="never_opened")
            | Warming.to(Stopped, cond="all_submitted_drained")
            | Recovering.to(Stopped, cond=["shutdown_requested", "all_submitted_drained"])
            | Configuring.to(Stopped, cond=["shutdown_requested", "all_submitted_drained"]))
    # §9.2 model switch: a generation that fails to configure or to pass its golden is
    # refused and the last known good calbin is configured again (as Triton keeps the old
    # model on a failed reload); the previous model keeps serving after its own golden.
    roll_back = (Warming.to(Configuring, cond="last_good_known")
                 # python-statemachine leaves TransitionList.itself unannotated
                 | Configuring.to.itself(cond="last_good_known"))  # type: ignore[no-untyped-call]
    fail = (
        Ready.to(Failed)
        | Draining.to(Failed)
        | Recovering.to(Failed)
        | Configuring.to(Failed)
        | Warming.to(Failed)
    )

    @invariant("Warming")
    def warms_only_a_fresh_generation(lifecycle: _LifecycleModel) -> bool:  # noqa: N805
        """§9.2: warming runs on a new generation (above every one that served), mapped."""
        return lifecycle.generation_advanced()

    @invariant("Ready")
    def serves_only_after_the_golden(lifecycle: _LifecycleModel) -> bool:  # noqa: N805
        """§9.2: traffic is taken only once the golden prefill+decode check passed."""
        return lifecycle.golden_passed()


class BufferSlotChart(StateMachine):
    """One host buffer slot of the pool (§4.2 ``BufferSlot``/``BufferLease``, §5.1-3/4/8).

    A slot is leased to at most one job; InFlight while the runtime may DMA it; never
    InFlight -> Free directly. Dropping a lease while InFlight quarantines (§4.2). Returning
    a slot checks UndoSlice happened, else it is quarantined (FI15). A reset quarantines every
    old-generation slot (§5.1-8); a quarantined slot is retired (destroyed, never reused) only
    once the reset is confirmed.
    """

    Free = State(initial=True)
    Leased = State()
    InFlight = State("InFlight")
    Quarantined = State()
    Retired = State(final=True)

    lease = Free.to(Leased)
    submit = Leased.to(InFlight)
    device_done = InFlight.to(Leased, cond="runtime_done")
    give_back = Leased.to(Free, cond="undo_slice_done") | Leased.to(Quarantined)
    drop_in_flight = InFlight.to(Quarantined)
    quarantine = Free.to(Quarantined) | Leased.to(Quarantined) | InFlight.to(Quarantined)
    retire = Quarantined.to(Retired, cond="reset_confirmed")

    @invariant("Free")
    def free_slots_carry_no_slice(slot: _SlotModel) -> bool:  # noqa: N805
        """FI15/§6.5: a slot is on the free list only with every slice undone."""
        return slot.undo_slice_done()

    @invariant("Retired")
    def retires_only_what_the_runtime_let_go(slot: _SlotModel) -> bool:  # noqa: N805
        """§5.1-8: a slot's buffers are destroyed only once the runtime, asked after the
        reset, says it no longer uses them."""
        return slot.reset_confirmed()


#: chart name -> declaration, in a fixed order (diagrams, coverage and compiled use it).
DECLARED: dict[str, type[StateMachine]] = {
    "job": JobChart,
    "kv_txn": KvTxnChart,
    "lifecycle": LifecycleChart,
    "buffer_slot": BufferSlotChart,
}
