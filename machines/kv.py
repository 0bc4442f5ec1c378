"""KV coordinator: bounded admission waits and KV transactions (spec §7, S01, S02, FI04).

``reserve`` replaces the old ``do { ok = Apply(); } while (!ok)`` busy loop (S01): it asks
``canAllocate`` first, calls ``Apply`` once, and when either says no it waits on a condition
variable until capacity is released, the deadline passes, the job is cancelled or the
executor shuts down. Each wake-up retries ``Apply`` exactly once. A fresh reservation that had
to wait is served first come, first served (``_fifo``: only the head tries, a later one never
overtakes it); growing a reservation already held is never queued. A capacity *epoch* counter,
bumped under ``admission_mu`` whenever capacity is given back, closes the window between a
failed ``Apply`` and the wait: no release can be missed, and no thread spins. A refusal of
blocks the coordinator's own books (``_applied``: every Apply and release it made) show free
is the runtime's, not a shortage: no release need come to end it (on an idle device none
does), so it is reported (``kv.refused``, §8 TRANSIENT, once a reservation; not a pre-arm's,
a guess nobody asked for: ``speculative``) and retried after the fault sink's back-off,
``refusal_retries`` times at most, before the wait is for a release alone.

A successful reserve opens a ``KvTxn``: a run of the declared ``KvTxnChart`` (Reserved ->
Submitted -> Committed | Unknown; Reserved -> RolledBack). The coordinator keeps one view per
sequence: committed length, whether a txn is open (one at a time per sequence), and whether the
sequence is Unknown. After any failure past submit the sequence is Unknown (§7) and every new
reserve on it is refused until ``reset_sequence`` releases it on the device.

Locking: ``admission_mu`` (rank 1) guards the sequence table, the epoch and the condition; it
is never held across a runtime call. Runtime KvManager calls are serialised by ``_kv_call_mu``,
a leaf lock (nothing else is acquired while holding it), since 0.7.6 documents no thread
safety for KvManager.

No use after destroy (issue 13): ``close()`` ends the KvManager's life for the coordinator
under ``_kv_call_mu``, so once it returns no KvManager call is running and none starts: every
later call answers without the device (a reserve ends UNAVAILABLE, a reset or a rollback
succeeds: the sequence's KV died with its KvManager). ``Generation.release`` closes the
coordinator before it destroys the KvManager.

No hold and wait (§7, issue 13 defect 7): ``reserve`` applies the largest of the job's target,
what the sequence already holds and the request's ``kv_reserve_len`` (what the whole request
needs to finish) in one ``Apply``, all or nothing; a request whose whole KV exceeds the
KvManager's capacity is refused at once (``kv.exceeds_capacity``), not at its deadline. A
request that reserved up front never waits for KV again, so two requests that each fit alone
both complete when sent together: the second waits, holding nothing, for the first to release.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import attrs

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.chart_names import (
    KV_COMMITTED,
    KV_EV_COMMIT,
    KV_EV_MARK_SUBMITTED,
    KV_EV_MARK_UNKNOWN,
    KV_EV_ROLLBACK,
    KV_SUBMITTED,
)
from calexec.machines.compiled import KV_TXN, GuardRejected
from calexec.machines.device_api import KvManagerApi
from calexec.machines.locks import ADMISSION, KV_CALL, LockOrder

if TYPE_CHECKING:
    from calexec.machines.job import Job


@attrs.define(slots=True, eq=False)
class SeqView:
    """What the coordinator knows about one sequence."""

    seq_id: int
    committed_len: int = 0
    reserved_len: int = 0
    #: the open transaction, or a claim holding the sequence during a KvManager call
    open_txn: KvTxn | _Claim | None = None
    unknown_reason: str | None = None
    #: jobs of this sequence the runtime still runs after their Wait failed (§9.1): the device
    #: may still write this sequence's KV, so it cannot be reset or truncated yet
    on_device: int = 0
    #: a pre-armed decode stream's next txn (``reserve_next``), Reserved behind ``open_txn``;
    #: it becomes the open txn when that one commits, and is rolled back otherwise
    next_txn: KvTxn | None = None


#: the ``what`` of a ``_wait_for_capacity`` ticket in ``KvCoordinator._fifo``
_QUEUED = "waiting its turn for KV capacity"


class _Claim:
    """Placeholder holding a sequence while a KvManager call for it runs outside the lock: a
    reserve waiting for capacity (not a txn yet), a reset or a truncation. Any other job,
    reset or truncation of the sequence meanwhile gets ``kv.sequence_busy``."""

    __slots__ = ("seq_id", "what")

    def __init__(self, seq_id: int, what: str = "waiting for KV capacity") -> None:
        self.seq_id = seq_id
        self.what = what

    def __repr__(self) -> str:
        return f"{self.what} (seq {self.seq_id})"


class KvTxn:
    """One KV reservation (§7 ``KvReservation``); its state is a ``KvTxnChart`` run."""

    __slots__ = ("seq_id", "old_len", "target_len", "old_reserved", "generation_id",
                 "evidence", "run")

    def __init__(self, seq_id: int, old_len: int, target_len: int, old_reserved: int,
                 generation_id: int) -> None:
        self.seq_id = seq_id
        self.old_len = old_len
        self.target_len = target_len
        self.old_reserved = old_reserved
        self.generation_id = generation_id
        #: the job whose device run this txn stands for (set at mark_submitted): the commit
        #: guard asks it what the runtime answered and whether the output was validated
        self.evidence: Job | None = None
        self.run = KV_TXN.run(self)

    @property
    def state(self) -> str:
        return self.run.state

    def finished(self) -> None:
        """Final state reached: break the txn <-> run and txn <-> job (``evidence``, the job
        holds its txn) cycles, so reference counting frees both: no job of the hot path is
        left to the cyclic garbage collector (issue 17: its collections were ~100 us pauses
        every few dozen tokens)."""
        self.run.model = None
        self.evidence = None

    def device_finished_and_output_valid(self) -> bool:
        """Guard of ``commit`` (§5.1-6): the runtime's own answers (Wait rc 0 and status
        DONE) and the output check of the job, read from the job, never set for the guard."""
        job = self.evidence
        return (job is not None and job.runtime_finished_cleanly()
                and job.output_validated())

    def __repr__(self) -> str:
        return (f"KvTxn(seq={self.seq_id}, {self.old_len}->{self.target_len}, "
                f"gen={self.generation_id}, {self.run.state})")


class KvCoordinator:
    """Admission of KV capacity for one KvManager of one generation."""

    def __init__(self, kv: KvManagerApi, generation_id: int, locks: LockOrder) -> None:
        self.kv = kv
        self.generation_id = generation_id
        self.admission_mu = locks.lock(ADMISSION)
        self.clock = locks.clock
        self._changed = self.clock.condition(self.admission_mu, "kv")
        self._kv_call_mu = locks.lock(KV_CALL)  # a leaf: KvManager calls only
        self._epoch = 0
        self._closed = False
        self._waiting = 0  # threads in reserve's capacity wait (admission_mu)
        #: fresh reservations waiting for capacity, in arrival order (admission_mu)
        self._fifo: list[_Claim] = []
        self._kv_closed = False  # under _kv_call_mu: no KvManager call after close()
        self.seqs: dict[int, SeqView] = {}
        # Observability: how often waiters woke and retried Apply (FI04 proves no spinning).
        self.wakeups = 0
        self.apply_calls = 0
        #: the executor's hook (``DeviceExecutor._drop_armed``): before an operation on a
        #: sequence, release the jobs it armed for that sequence ahead of any request (an
        #: implicit pre-arm, a decode stream's next step), so a guess never makes the
        #: sequence busy for a request
        self.on_busy: Callable[[int], None] | None = None
        #: sequences whose KV went with an earlier generation (a recovery or model switch),
        #: not used in this one since: seq_id -> (that generation, its committed length).
        #: Set by the lifecycle before this generation admits anything (``carry_dropped``);
        #: a job past the committed length of one is told which generation dropped its KV
        self.dropped: dict[int, tuple[int, int]] = {}
        #: the blocks each sequence holds on the KvManager as the coordinator asked for them
        #: (under ``_kv_call_mu``, set by every Apply and release it made): the host's books,
        #: against which a refusal is read (``_try_apply``)
        self._applied: dict[int, int] = {}
        #: the executor's hooks for a refusal the books contradict (``refusals_to``): the
        #: fault sink's ``report``, its back-off and how many retries a reservation makes
        self.on_refused: Callable[[Status], None] | None = None
        self.refusal_backoff: Callable[[int], float] = lambda attempt: 0.001
        self.refusal_retries = 0

    def refusals_to(self, report: Callable[[Status], None], backoff: Callable[[int], float],
                    retries: int) -> None:
        """Where a KvManager refusal that the host's books contradict goes (§8 TRANSIENT):
        ``report`` (the fault sink) once per reservation, and ``retries`` bounded retries
        after ``backoff(attempt)`` seconds each before the reservation waits for a release
        alone (FI04)."""
        self.on_refused, self.refusal_backoff, self.refusal_retries = report, backoff, retries

    def gone_with_it(self) -> dict[int, tuple[int, int]]:
        """What a generation replacing this one is told (``dropped``): this generation's
        sequences with KV, and those it was told of and never used."""
        with self.admission_mu:
            gone = dict(self.dropped)
            gone.update({seq: (self.generation_id, view.committed_len)
                         for seq, view in self.seqs.items() if view.committed_len > 0})
        return gone

    def carry_dropped(self, gone: dict[int, tuple[int, int]]) -> None:
        """The generation this one replaces answered ``gone_with_it``: ``gone``."""
        with self.admission_mu:
            self.dropped = dict(gone)

    # ---- helpers -----------------------------------------------------------------------------
    def blocks_for(self, tokens: int) -> int:
        size = self.kv.block_size
        return -(-tokens // size)

    def _view(self, seq_id: int) -> SeqView:
        view = self.seqs.get(seq_id)
        if view is None:
            view = self.seqs[seq_id] = SeqView(seq_id)
        return view

    def _apply(self, seq_id: int, target: int) -> bool | None:
        """Apply on the KvManager; None once the coordinator is closed (no device call)."""
        with self._kv_call_mu:
            return self._apply_locked(seq_id, target)

    def _apply_locked(self, seq_id: int, target: int) -> bool | None:
        """``_apply`` with ``_kv_call_mu`` held; the books follow a granted Apply."""
        if self._kv_closed:
            return None
        self.apply_calls += 1
        granted = bool(self.kv.apply(seq_id, target))
        if granted:
            self._applied[seq_id] = self.blocks_for(target)
        return granted

    def _try_apply(self, seq_id: int, target: int, needed: int) -> tuple[bool, int | None]:
        """``canAllocate(needed)`` then one ``Apply`` (§7), under one hold of
        ``_kv_call_mu``: (granted, None), or (False, the blocks the host's books show free)
        when the KvManager said no to blocks the books show free: it refused what no
        sequence the coordinator knows of holds (the books follow every Apply and release
        the coordinator made, under this lock, so none is half-counted)."""
        with self._kv_call_mu:
            if self._kv_closed:
                return False, None
            if self.kv.can_allocate(needed) and self._apply_locked(seq_id, target):
                return True, None
            capacity = self.capacity_blocks()
            if capacity is None:  # the runtime does not say: the books cannot tell
                return False, None
            free = capacity - sum(self._applied.values())
            return False, (free if free >= needed else None)

    @property
    def waiting(self) -> int:
        """Threads blocked in ``reserve`` for KV capacity right now (admission_mu)."""
        with self.admission_mu:
            return self._waiting

    @property
    def closed(self) -> bool:
        """True once :meth:`close` ran: the KvManager is (about to be) destroyed."""
        return self._closed

    def capacity_blocks(self) -> int | None:
        """The KvManager's total blocks (None when the runtime object does not say)."""
        blocks: int | None = getattr(self.kv, "capacity_blocks", None)  # optional member
        return blocks

    def usage(self) -> tuple[int, list[int]]:
        """(blocks reserved by all sequences, the sequence ids holding KV reserved or
        committed, sorted): the host-side view, no KvManager call, both of one moment (read
        under ``admission_mu``: until stop 68 the blocks were summed after it was released,
        from views another thread's reservation was changing)."""
        with self.admission_mu:
            views = [(view.seq_id, view.reserved_len) for view in self.seqs.values()
                     if view.reserved_len > 0 or view.committed_len > 0]
        return (sum(self.blocks_for(reserved) for _, reserved in views),
                sorted(seq_id for seq_id, _ in views))

    def max_seqs(self) -> int | None:
        """The KvManager's sequence ids are ``0..max_seqs-1`` (None when the runtime object
        does not say)."""
        seqs: int | None = getattr(self.kv, "max_seqs", None)  # optional member
        return seqs

    def _bump(self) -> None:
        """Capacity was given back (a release, a shrink), or a job a reset waits for let go:
        wake the waiters (caller holds admission_mu). Never for a change that gives nothing
        back (a commit, a txn opened or ended without growing): FI04, waiters are woken by
        releases, never by the other sequences' jobs."""
        self._epoch += 1
        self._changed.notify_all()

    def wake(self) -> None:
        """A cancel or shutdown happened: let waiters re-check their stop condition."""
        with self.admission_mu:
            self._changed.notify_all()

    def close(self) -> None:
        """Shutdown or teardown: every current and future wait ends with UNAVAILABLE, and
        once this returns no KvManager call runs or starts (the caller may destroy it)."""
        with self.admission_mu:
            self._closed = True
            self._changed.notify_all()
        with self._kv_call_mu:  # waits for a call in progress; admission_mu is not held
            self._kv_closed = True

    # ---- the transaction -----------------------------------------------------------------------
    def reserve(self, seq_id: int, past_len: int, token_count: int, deadline: float,
                stop: Callable[[], Status | None] = lambda: None,
                reserve_len: int | None = None, speculative: bool = False) -> KvTxn | Status:
        """Reserve capacity so ``seq_id`` can hold ``past_len + token_count`` tokens, and at
        least ``reserve_len`` tokens (the request's ``kv_reserve_len``: everything it needs to
        finish, applied all or nothing so it never holds part of the KV while waiting for the
        rest).

        Waits (condition variable, no polling) until capacity frees up, ``deadline``
        (absolute ``time.monotonic()``) passes, or ``stop()`` returns a Status (cancel).
        A reservation only grows: a job with ``past_len`` below the committed length rewinds
        on the device (which keeps a state per position) without shrinking anything first,
        so a rollback never has to undo a truncation.

        ``speculative``: a guess nobody asked for yet (a pre-arm, which never waits): a
        refusal the host's books contradict is not reported nor retried (``_refused``); the
        request, if it comes, reserves the ordinary way and meets it (reported once), as a
        guess's other faults are not reported (``JobOutcomes.fail_before_submit``)."""
        target = past_len + token_count
        ctx = {"seq_id": seq_id, "generation": self.generation_id}
        if self.on_busy is not None:
            self.on_busy(seq_id)
        max_seqs = self.max_seqs()
        if max_seqs is not None and not 0 <= seq_id < max_seqs:
            # Apply would only say "false" (0.7.6 gives no reason): refuse now, not at the deadline
            return Status.failure("kv.seq_id_out_of_range", Category.INVALID_REQUEST,
                                  Phase.ADMISSION, f"seq_id={seq_id} outside the KvManager's "
                                  f"[0, max_seqs={max_seqs})", **ctx)
        wanted = max(target, reserve_len or 0)
        capacity = self.capacity_blocks()
        if capacity is not None and self.blocks_for(wanted) > capacity:
            # it would wait for capacity that can never exist: refuse now, not at the deadline
            return Status.failure(
                "kv.exceeds_capacity", Category.INVALID_REQUEST, Phase.ADMISSION,
                f"sequence {seq_id} needs {wanted} tokens of KV ({self.blocks_for(wanted)} "
                f"blocks of {self.kv.block_size}) > the KvManager's capacity of {capacity} "
                "blocks; shorten the prompt or max_tokens", **ctx)
        with self.admission_mu:
            view = self._view(seq_id)
            if view.unknown_reason is not None:
                # INVALID_REQUEST (400), not UNAVAILABLE (503, "retry"): no retry of it is
                # ever served until the caller acts (§8 names no row for it: its 503 is for
                # a device that recovers, and a recovery's generation starts it empty)
                return Status.failure(
                    "kv.sequence_unknown", Category.INVALID_REQUEST, Phase.ADMISSION,
                    f"sequence {seq_id} is Unknown after '{view.unknown_reason}' (a job of it "
                    "failed after submit: its KV on the device is not known); "
                    f"release_sequence({seq_id}) resets it, then prefill it again from "
                    "past_len=0; until then every request on it is refused so", **ctx)
            if view.open_txn is not None or view.next_txn is not None:
                return Status.failure(
                    "kv.sequence_busy", Category.INVALID_REQUEST, Phase.ADMISSION,
                    f"sequence {seq_id} is busy ({view.open_txn or view.next_txn!r}); a "
                    "sequence runs one job at a time", **ctx)
            if past_len > view.committed_len:
                gone = self.dropped.get(seq_id) if not view.committed_len else None
                why = "" if gone is None else (
                    f": its KV ({gone[1]} tokens committed in generation {gone[0]}) went with "
                    f"generation {gone[0]}, replaced by generation {self.generation_id} (a "
                    "recovery or model switch); prefill it again from past_len=0")
                return Status.failure(
                    "kv.past_len_beyond_committed", Category.INVALID_REQUEST, Phase.ADMISSION,
                    f"past_len={past_len} is beyond the committed length {view.committed_len} "
                    f"of sequence {seq_id}{why}", **ctx)
            # Claim the sequence while waiting so a second job cannot interleave with this one.
            view.open_txn = claim = _Claim(seq_id)
            old_reserved = view.reserved_len
        apply_target = max(wanted, old_reserved)
        try:
            ended = None
            if self.blocks_for(apply_target) > self.blocks_for(old_reserved):
                ended = self._wait_for_capacity(seq_id, apply_target, old_reserved, deadline,
                                                stop, ctx, speculative)
        except BaseException:
            self._unclaim(seq_id, claim)
            raise
        if ended is not None:
            self._unclaim(seq_id, claim)
            return ended
        with self.admission_mu:
            view = self.seqs[seq_id]
            view.reserved_len = apply_target
            txn = KvTxn(seq_id, past_len, target, old_reserved, self.generation_id)
            view.open_txn = txn
            self.dropped.pop(seq_id, None)  # used in this generation: its own from now
        return txn

    def _unclaim(self, seq_id: int, claim: _Claim) -> None:
        with self.admission_mu:
            view = self.seqs[seq_id]
            if view.open_txn is claim:
                view.open_txn = None
            self._bump()

    def _wait_for_capacity(self, seq_id: int, target: int, reserved: int, deadline: float,
                           stop: Callable[[], Status | None], ctx: dict[str, Any],
                           speculative: bool = False) -> Status | None:
        """None when Apply succeeded; else the Status that ended the wait.

        A fresh reservation (the sequence holds no block) is admitted first come, first
        served: once one had to wait, a later fresh one neither overtakes it nor tries
        before it is at the head of ``_fifo`` (else small requests arriving all the time
        kept a large one out until its deadline, though it fits alone). A sequence growing
        a reservation it holds is never queued: it gives its KV back once it ends."""
        needed = self.blocks_for(target) - self.blocks_for(reserved)
        fresh = self.blocks_for(reserved) == 0
        ticket = _Claim(seq_id, "reserving KV capacity")
        try:
            return self._wait_in_turn(seq_id, target, needed, fresh, ticket, deadline, stop,
                                      ctx, speculative)
        finally:
            if ticket.what == _QUEUED:  # set under admission_mu when it joined the queue
                with self.admission_mu:
                    self._fifo.remove(ticket)
                    if self._fifo:
                        self._bump()  # the next in turn tries now

    def _wait_in_turn(self, seq_id: int, target: int, needed: int, fresh: bool,
                      ticket: _Claim, deadline: float, stop: Callable[[], Status | None],
                      ctx: dict[str, Any], speculative: bool = False) -> Status | None:
        waited = False  # it waited for KV: its deadline passing is the KV's answer
        refusals = 0  # refusals the host's books contradicted (retried after a back-off)
        while True:
            retry_at = None  # a contradicted refusal's retry: no release need come
            with self.admission_mu:
                closed = self._closed
                epoch = self._epoch
                # a fresh reservation waits its turn behind the ones that waited before it
                behind = fresh and bool(self._fifo) and self._fifo[0] is not ticket
            stopped = stop()
            if stopped is not None:  # the owner's words first (a shutdown closes the KV)
                if (waited and stopped.category == Category.DEADLINE
                        and self.clock.monotonic() >= deadline):
                    # the owner's deadline check saw it first (woken by a release or the
                    # queue moving, not by the timeout): the same wait, the same answer
                    return self._kv_deadline(seq_id, target, needed, ctx)
                return stopped
            if closed:
                return Status.unavailable(Phase.ADMISSION, "the KvManager was closed (its "
                                          "generation ends); not admitting", **ctx)
            if not behind:
                granted, free = self._try_apply(seq_id, target, needed)
                if granted:
                    return None
                if free is not None and not speculative:  # (a guess: not reported)
                    refusals += 1
                    retry_at = self._refused(seq_id, target, needed, free, refusals, ctx)
            with self.admission_mu:
                if fresh and ticket.what != _QUEUED:
                    if self._fifo:
                        self._bump()  # the head retries: its "no" may have been transient
                        epoch = self._epoch
                    self._fifo.append(ticket)
                    ticket.what = _QUEUED
                    if behind and self._fifo[0] is ticket:
                        # the ones it saw before it left meanwhile (leaving an empty queue
                        # wakes no one): its turn, and it has not tried: try now, not wait
                        continue
                while self._epoch == epoch and not self._closed:
                    now = self.clock.monotonic()
                    remaining = deadline - now
                    if remaining <= 0:
                        return self._kv_deadline(seq_id, target, needed, ctx)
                    if stop() is not None:
                        break
                    if retry_at is not None:
                        if now >= retry_at:
                            break  # its back-off passed: ask the KvManager again
                        remaining = min(remaining, retry_at - now)
                    waited = True
                    self._waiting += 1
                    try:
                        self.clock.wait(self._changed, remaining)
                    finally:
                        self._waiting -= 1
                    self.wakeups += 1

    def _refused(self, seq_id: int, target: int, needed: int, free: int, refusals: int,
                 ctx: dict[str, Any]) -> float | None:
        """The KvManager refused ``needed`` blocks the host's books show free (``free`` of
        them): no release the wait is woken by need come (on an idle device none does), so
        the refusal is the runtime's, not a shortage: §8 TRANSIENT (the KvManager's booleans
        carry no CalRT code: raw None), reported once per reservation, and retried after a
        back-off at most ``refusal_retries`` times (then the wait is for a release alone,
        to the deadline: FI04). When the next retry is due (``clock.monotonic()``), or None."""
        if refusals == 1 and self.on_refused is not None:
            capacity = self.capacity_blocks()
            self.on_refused(Status.failure(
                "kv.refused", Category.TRANSIENT, Phase.ADMISSION,
                f"the KvManager refused {needed} more blocks for seq {seq_id} "
                f"(target_len={target}) while the host's books show {free} of {capacity} "
                "blocks free: retried after a back-off "
                f"(at most {self.refusal_retries} times), then waiting for KV given back "
                "until the deadline", **ctx))
        if refusals > self.refusal_retries:
            return None
        return self.clock.monotonic() + self.refusal_backoff(refusals)

    @staticmethod
    def _kv_deadline(seq_id: int, target: int, needed: int, ctx: dict[str, Any]) -> Status:
        """The deadline passed while the reservation waited for KV: ``kv.deadline``
        (RESOURCE_EXHAUSTED, 429: retry later or smaller), however the waiter woke."""
        return Status.failure(
            "kv.deadline", Category.RESOURCE_EXHAUSTED, Phase.ADMISSION,
            f"KV capacity for seq {seq_id} (target_len={target}, {needed} more blocks) not "
            "available before the deadline", **ctx)

    def reserve_next(self, prev: KvTxn, token_count: int) -> KvTxn | Status:
        """Pre-arm (a decode stream): a txn for the job after ``prev`` of the same sequence,
        from ``prev.target_len`` to ``+ token_count``, opened while ``prev`` is still open
        (Reserved or Submitted: its job queued or on the device). Never waits and never
        calls the KvManager: only within the reservation the sequence already holds (the
        request's ``kv_reserve_len``); else ``kv.prearm_beyond_reservation`` and the caller
        reserves when it submits. The txn is Reserved; it becomes the sequence's open txn
        when ``prev`` commits; if ``prev`` does not commit, the sequence is Unknown and the
        owner rolls this one back (``rollback``: nothing to give back)."""
        seq_id, target = prev.seq_id, prev.target_len + token_count
        ctx = {"seq_id": seq_id, "generation": self.generation_id}
        with self.admission_mu:
            view = self.seqs.get(seq_id)
            if self._closed or view is None:
                return Status.unavailable(Phase.ADMISSION, "KV coordinator closed", **ctx)
            if view.unknown_reason is not None:
                return Status.failure("kv.sequence_unknown", Category.INVALID_REQUEST,
                                      Phase.ADMISSION, f"sequence {seq_id} is Unknown after "
                                      f"'{view.unknown_reason}'; release_sequence({seq_id}) "
                                      "resets it", **ctx)
            if self.blocks_for(target) > self.blocks_for(view.reserved_len):
                return Status.failure("kv.prearm_beyond_reservation",
                                      Category.RESOURCE_EXHAUSTED, Phase.ADMISSION,
                                      f"sequence {seq_id}: {target} tokens > the "
                                      f"{view.reserved_len} reserved", **ctx)
            txn = KvTxn(seq_id, prev.target_len, target, view.reserved_len, self.generation_id)
            if view.open_txn is prev and view.next_txn is None:
                view.next_txn = txn
            elif (view.open_txn is None and view.next_txn is None
                  and prev.run.state == KV_COMMITTED and view.committed_len == prev.target_len):
                view.open_txn = txn  # prev already committed: this one is open at once
            else:
                txn.run.send(KV_EV_ROLLBACK)
                txn.finished()
                return Status.failure("kv.sequence_busy", Category.INVALID_REQUEST,
                                      Phase.ADMISSION, f"sequence {seq_id} is busy "
                                      f"({view.open_txn or view.next_txn!r}) or moved on "
                                      f"from {prev!r}", **ctx)
            # within the blocks already applied: the bookkeeping follows, the KvManager not
            view.reserved_len = max(view.reserved_len, target)
        return txn

    def is_open(self, txn: KvTxn) -> bool:
        """Whether ``txn`` is its sequence's open transaction on a sequence that is not
        Unknown: every job of the sequence before it committed. A txn chained behind another
        (``reserve_next``) becomes open only when that one commits; a job whose txn is not
        open must not reach the device (its predecessor still runs, or failed)."""
        with self.admission_mu:
            view = self.seqs.get(txn.seq_id)
            return (view is not None and view.open_txn is txn
                    and view.unknown_reason is None and not self._closed)

    def mark_submitted(self, txn: KvTxn, evidence: Job | None = None) -> None:
        """infer() accepted the job ``evidence`` (which answers the commit guard later)."""
        txn.evidence = evidence
        txn.run.send(KV_EV_MARK_SUBMITTED)

    def rollback(self, txn: KvTxn) -> Status:
        """Before submit only (the chart refuses it after): give back what reserve grew."""
        txn.run.send(KV_EV_ROLLBACK)
        txn.finished()
        with self.admission_mu:
            view = self.seqs[txn.seq_id]
            if view.next_txn is txn:  # pre-armed behind an open txn: it never grew anything
                view.next_txn = None  # (no capacity back: no waiter is woken)
                return Status.OK
        ok, shrunk = True, False
        if self.blocks_for(txn.old_reserved) < self.blocks_for(self.seqs[txn.seq_id].reserved_len):
            # None: closed, the KvManager (and what it reserved) is gone: nothing to give back
            applied = self._apply(txn.seq_id, txn.old_reserved)
            ok, shrunk = applied is not False, applied is True
        with self.admission_mu:
            view = self.seqs[txn.seq_id]
            if ok:
                view.reserved_len = txn.old_reserved
            view.open_txn = None
            if shrunk:  # capacity given back: the waiters try again
                self._bump()
        if not ok:
            return Status.failure("kv.apply_refused", Category.UNKNOWN, Phase.ADMISSION,
                                  f"Apply({txn.seq_id}, {txn.old_reserved}) refused a shrink",
                                  seq_id=txn.seq_id, generation=txn.generation_id)
        return Status.OK

    def settle(self, txn: KvTxn, reason: str, on_device: bool = False) -> bool:
        """After the device run: commit if the chart's guard finds the runtime finished
        cleanly and the output valid, else the sequence is Unknown (§7) with ``reason``.
        The guard decides; True when committed."""
        try:
            self.commit(txn)
            return True
        except GuardRejected:
            self.mark_unknown(txn, reason, on_device)
            return False

    def commit(self, txn: KvTxn) -> None:
        """Device finished and output validated (guarded by the chart: ``GuardRejected``
        otherwise, the txn unchanged)."""
        txn.run.send(KV_EV_COMMIT)
        txn.finished()
        with self.admission_mu:
            view = self.seqs[txn.seq_id]
            view.committed_len = txn.target_len
            view.open_txn, view.next_txn = view.next_txn, None  # a pre-armed txn goes next
            # no capacity given back: no waiter is woken (every commit woke every KV waiter,
            # which asked canAllocate again and slept on: one wake-up per waiter per token)

    def mark_unknown(self, txn: KvTxn, reason: str, on_device: bool = False) -> None:
        """Any failure after submit: the device KV of this sequence is Unknown (§7).
        ``on_device``: the runtime still runs the job (its Wait failed); the sequence stays
        un-resettable until :meth:`device_let_go`."""
        if txn.run.state == KV_SUBMITTED:
            txn.run.send(KV_EV_MARK_UNKNOWN)
        txn.finished()
        with self.admission_mu:
            view = self.seqs[txn.seq_id]
            view.unknown_reason = reason
            view.open_txn = None
            view.on_device += on_device  # (no capacity back: its reset gives it back)

    def device_let_go(self, seq_id: int) -> None:
        """The runtime finished a job of ``seq_id`` that was marked ``on_device``."""
        with self.admission_mu:
            view = self._view(seq_id)
            view.on_device = max(0, view.on_device - 1)
            self._bump()

    def reset_sequence(self, seq_id: int, wait_s: float = 0.0) -> Status:
        """Release a sequence on the device (clears Unknown); refused while a job is open.

        While the runtime still runs one of its jobs after a failed Wait (``on_device``),
        releasing the KV would let that job write it afterwards, and the sequence's next job
        would meet KV it does not expect (a CCU exception on the device). The reset then waits
        up to ``wait_s`` seconds (condition variable: the completion thread signals when the
        device lets go) and is refused with ``kv.sequence_on_device`` (UNAVAILABLE: retry
        later) if the device still holds the job."""
        deadline = self.clock.monotonic() + wait_s
        max_seqs = self.max_seqs()
        if max_seqs is not None and not 0 <= seq_id < max_seqs:
            # the KvManager's release said only INVALID_VALUE (rc 4): the golden run of an
            # ``ExecutorConfig.golden_seq_id`` the device has not failed every start so
            return Status.failure("kv.seq_id_out_of_range", Category.INVALID_REQUEST,
                                  Phase.ADMISSION, f"seq_id={seq_id} outside the KvManager's "
                                  f"[0, max_seqs={max_seqs})", seq_id=seq_id,
                                  generation=self.generation_id)
        if self.on_busy is not None:
            self.on_busy(seq_id)
        with self.admission_mu:
            view = self._view(seq_id)
            while view.on_device and not self._closed:
                remaining = deadline - self.clock.monotonic()
                if remaining <= 0:
                    break
                self.clock.wait(self._changed, remaining)
                view = self._view(seq_id)
            if view.open_txn is not None or view.next_txn is not None:
                return Status.failure("kv.sequence_busy", Category.INVALID_REQUEST,
                                      Phase.ADMISSION, f"sequence {seq_id} is busy "
                                      f"({view.open_txn or view.next_txn!r}); cannot reset it "
                                      "now", seq_id=seq_id)
            if self._closed:  # torn down (or shutting down): its KV dies with the KvManager
                self.seqs[seq_id] = SeqView(seq_id)
                self._bump()
                return Status.OK
            if view.on_device:
                return Status.failure("kv.sequence_on_device", Category.UNAVAILABLE,
                                      Phase.ADMISSION, f"sequence {seq_id}: the device still "
                                      f"runs a job of it after a failed Wait (waited {wait_s}s); "
                                      "it can be reset once the device lets go or after a "
                                      "device reset", seq_id=seq_id)
            # Hold the sequence through the release: a job admitted between the check above
            # and the fresh view below would otherwise lose its txn to the fresh view (two jobs
            # of one sequence at once: seen in the stress test) and its KV to the release.
            view.open_txn = claim = _Claim(seq_id, "being reset")
        try:
            with self._kv_call_mu:
                rc = 0 if self._kv_closed else self.kv.release(seq_id)
                if rc == 0:
                    self._applied.pop(seq_id, None)
        except BaseException:
            self._unclaim(seq_id, claim)
            raise
        if rc != 0:
            self._unclaim(seq_id, claim)
            return Status.from_calrt(rc, Phase.ADMISSION, f"KvManager release of seq {seq_id}",
                                     seq_id=seq_id)
        with self.admission_mu:
            self.seqs[seq_id] = SeqView(seq_id)
            self.dropped.pop(seq_id, None)  # released by its owner: nothing to tell
            self._bump()
        return Status.OK

    def truncate(self, seq_id: int, length: int) -> Status:
        """Keep the first ``length`` tokens (llama's seq_rm to the end); refused while the
        sequence is busy or Unknown. The reservation shrinks with it."""
        if self.on_busy is not None:
            self.on_busy(seq_id)
        with self.admission_mu:
            view = self._view(seq_id)
            if (view.open_txn is not None or view.next_txn is not None
                    or view.unknown_reason is not None or view.on_device):
                return Status.failure("kv.sequence_busy", Category.INVALID_REQUEST,
                                      Phase.ADMISSION, f"sequence {seq_id} is busy or Unknown",
                                      seq_id=seq_id)
            if length > view.committed_len:
                return Status.failure("kv.truncate_beyond_committed", Category.INVALID_REQUEST,
                                      Phase.ADMISSION, f"truncate length={length} is beyond the "
                                      f"committed length {view.committed_len}", seq_id=seq_id)
            view.open_txn = claim = _Claim(seq_id, "being truncated")  # as in reset_sequence
        try:
            applied = self._apply(seq_id, length)
        except BaseException:
            self._unclaim(seq_id, claim)
            raise
        with self.admission_mu:
            if applied:
                view.committed_len = view.reserved_len = length
            if view.open_txn is claim:
                view.open_txn = None
            self._bump()
        if applied is None:
            return Status.unavailable(Phase.ADMISSION, f"sequence {seq_id}: the KvManager of "
                                      f"generation {self.generation_id} is closed", seq_id=seq_id)
        if not applied:
            return Status.failure("kv.apply_refused", Category.UNKNOWN, Phase.ADMISSION,
                                  f"Apply({seq_id}, {length}) refused a truncation", seq_id=seq_id)
        return Status.OK
