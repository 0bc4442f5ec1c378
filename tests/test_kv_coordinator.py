"""KvCoordinator races a whole executor rarely hits (§5 rule: one job per sequence at a time;
§7: the device KV is never released under a job), driven deterministically with a KvManager
whose calls block until the test lets them go."""

from __future__ import annotations

import threading
import time

import pytest

from calexec.contracts.codes import CalrtCode, DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.chart_names import KV_EV_COMMIT, KV_EV_MARK_SUBMITTED
from calexec.machines.clock import Clock
from calexec.machines.compiled import GuardRejected
from calexec.machines.job import Job
from calexec.machines.kv import KvCoordinator, KvTxn
from calexec.machines.locks import LockOrder


class GatedKv:
    """A KvManager whose apply/release wait for ``gate`` (set: they run at once)."""

    block_size = 16
    max_seqs = 8

    def __init__(self, capacity_blocks: int | None = None) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lens: dict[int, int] = {}
        self.calls = 0
        self.destroyed = False
        self.capacity_blocks = capacity_blocks

    def _used(self) -> int:
        return sum(-(-n // self.block_size) for n in self.lens.values())

    def can_allocate(self, blocks: int) -> bool:
        self.calls += 1
        assert not self.destroyed, "can_allocate on a destroyed KvManager"
        return self.capacity_blocks is None or self._used() + blocks <= self.capacity_blocks

    def _call(self) -> None:
        self.calls += 1
        assert not self.destroyed, "call on a destroyed KvManager"
        self.entered.set()
        assert self.gate.wait(10), "the test never let the call go"
        assert not self.destroyed, "destroyed while a call ran"

    def apply(self, seq: int, target: int) -> bool:
        self._call()
        grow = -(-target // self.block_size) - -(-self.lens.get(seq, 0) // self.block_size)
        if self.capacity_blocks is not None and self._used() + grow > self.capacity_blocks:
            return False  # all or nothing, as the 0.7.6 Apply
        self.lens[seq] = target
        return True

    def release(self, seq: int) -> int:
        self._call()
        self.lens.pop(seq, None)
        return 0


class _Finished:
    """A job whose device run finished cleanly with a validated output (the commit guard's
    evidence)."""

    def runtime_finished_cleanly(self) -> bool:
        return True

    def output_validated(self) -> bool:
        return True


FINISHED = _Finished()


class WatchedClock(Clock):
    """The system's clock, telling which threads entered one of its condition waits, and
    which wait to acquire one of its locks held by another thread: a test waits for that
    instead of sleeping and hoping the other thread got there."""

    __slots__ = ("entered", "waited", "blocked")

    def __init__(self) -> None:
        self.entered = threading.Condition()
        self.waited: set[threading.Thread] = set()
        self.blocked: set[threading.Thread] = set()  # waiting for a lock now

    def wait(self, cond: threading.Condition, timeout: float | None) -> bool:
        with self.entered:
            self.waited.add(threading.current_thread())
            self.entered.notify_all()
        return super().wait(cond, timeout)

    def lock(self) -> threading.Lock:
        return WatchedLock(self)  # type: ignore[return-value]


class WatchedLock:
    """A lock of a :class:`WatchedClock`: a thread that finds it held is in the clock's
    ``blocked`` until it has it."""

    def __init__(self, clock: WatchedClock) -> None:
        self._clock, self._lock = clock, threading.Lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.acquire(False):
            return True
        if not blocking:
            return False
        me, clock = threading.current_thread(), self._clock
        with clock.entered:
            clock.blocked.add(me)
            clock.entered.notify_all()
        try:
            return self._lock.acquire(True, timeout)
        finally:
            with clock.entered:
                clock.blocked.discard(me)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def coordinator(capacity_blocks: int | None = None) -> tuple[KvCoordinator, GatedKv]:
    kv = GatedKv(capacity_blocks)
    return KvCoordinator(kv, 1, LockOrder(checking=True, strict=True, clock=WatchedClock())), kv


def blocked(kvc: KvCoordinator, thread: threading.Thread) -> bool:
    """Whether ``thread`` waits (within 10 s) to acquire a lock of ``kvc``'s clock that
    another thread holds."""
    clock = kvc.clock
    with clock.entered:
        return clock.entered.wait_for(lambda: thread in clock.blocked, 10)


def parked(kvc: KvCoordinator, thread: threading.Thread) -> bool:
    """Whether ``thread`` reached a condition wait of ``kvc``'s clock (within 10 s) and still
    waits."""
    clock = kvc.clock
    with clock.entered:
        clock.entered.wait_for(lambda: thread in clock.waited or not thread.is_alive(), 10)
        return thread in clock.waited and thread.is_alive()


def reserve(kvc: KvCoordinator, seq: int, past: int = 0, tokens: int = 4, seconds: float = 5,
            **kw):
    return kvc.reserve(seq, past, tokens, time.monotonic() + seconds, **kw)


def in_thread(fn) -> tuple[threading.Thread, list]:
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_no_job_is_admitted_while_its_sequence_is_being_reset():
    """Before the fix the reset checked 'no job open', released the KV outside the lock and
    then replaced the sequence's view: a job admitted in between lost its txn to the fresh
    view, so a second job of the same sequence was admitted beside it."""
    kvc, kv = coordinator()
    txn = reserve(kvc, 1)
    kvc.rollback(txn)
    kv.gate.clear()
    kv.entered.clear()
    resetting, result = in_thread(lambda: kvc.reset_sequence(1))
    assert kv.entered.wait(5)  # the reset is inside KvManager release
    busy = reserve(kvc, 1)
    assert busy.code == "kv.sequence_busy" and "being reset" in busy.message
    assert kvc.reset_sequence(1).code == "kv.sequence_busy"
    assert kvc.truncate(1, 0).code == "kv.sequence_busy"
    kv.gate.set()
    resetting.join(5)
    assert result[0].ok
    txn = reserve(kvc, 1)
    assert isinstance(txn, KvTxn) and kvc.seqs[1].open_txn is txn
    assert reserve(kvc, 1).code == "kv.sequence_busy"  # one job at a time, still


def test_no_job_is_admitted_while_its_sequence_is_being_truncated():
    kvc, kv = coordinator()
    txn = reserve(kvc, 2, tokens=20)
    kvc.mark_submitted(txn, evidence=FINISHED)
    kvc.commit(txn)
    kv.gate.clear()
    kv.entered.clear()
    truncating, result = in_thread(lambda: kvc.truncate(2, 5))
    assert kv.entered.wait(5)
    assert reserve(kvc, 2, past=5).code == "kv.sequence_busy"
    kv.gate.set()
    truncating.join(5)
    assert result[0].ok and kvc.seqs[2].committed_len == 5 and kvc.seqs[2].open_txn is None
    assert isinstance(reserve(kvc, 2, past=5), KvTxn)


def test_reset_waits_for_the_device_to_let_go_of_a_failed_job():
    kvc, kv = coordinator()
    txn = reserve(kvc, 3)
    kvc.mark_submitted(txn)
    kvc.mark_unknown(txn, "calrt.wait_failed", on_device=True)
    refused = kvc.reset_sequence(3)
    assert refused.code == "kv.sequence_on_device" and refused.category is Category.UNAVAILABLE
    assert kvc.reset_sequence(3, wait_s=0.05).code == "kv.sequence_on_device"  # bounded
    waiting, result = in_thread(lambda: kvc.reset_sequence(3, wait_s=10))
    assert parked(kvc, waiting) and 3 in kv.lens  # waiting, KV not released under the job
    kvc.device_let_go(3)
    waiting.join(5)
    assert result[0].ok and 3 not in kv.lens and kvc.seqs[3].unknown_reason is None


def test_a_waiting_reset_ends_when_the_coordinator_closes():
    """Closed = the generation is torn down (or the executor stops): the sequence's KV dies
    with its KvManager, so the waiting reset ends at once, successfully, without calling it."""
    kvc, kv = coordinator()
    txn = reserve(kvc, 4)
    kvc.mark_submitted(txn)
    kvc.mark_unknown(txn, "calrt.wait_failed", on_device=True)
    waiting, result = in_thread(lambda: kvc.reset_sequence(4, wait_s=10))
    assert parked(kvc, waiting)  # the reset waits when the coordinator closes
    calls = kv.calls
    kvc.close()
    waiting.join(5)
    assert not waiting.is_alive() and result[0].ok
    assert kv.calls == calls and 4 in kv.lens  # not released on a KvManager being destroyed


# ---- issue 13: no use after destroy (defect 5) ---------------------------------------------------
def test_close_waits_for_a_kv_call_in_progress_and_fences_every_later_one():
    """Before the fix close() only flagged the waits: a reset already past its checks called
    release on a KvManager that Generation.release destroyed meanwhile (release -> 4, the id
    withheld for ever), and calls after close still reached the destroyed KvManager."""
    kvc, kv = coordinator()
    txn = reserve(kvc, 1)
    kvc.mark_submitted(txn, evidence=FINISHED)
    kvc.commit(txn)
    kv.gate.clear()
    kv.entered.clear()
    resetting, reset_result = in_thread(lambda: kvc.reset_sequence(1))
    assert kv.entered.wait(5)  # inside KvManager release
    closing, _ = in_thread(kvc.close)
    assert blocked(kvc, closing) and closing.is_alive()  # close() waits for the call ...
    kv.gate.set()
    closing.join(5)
    resetting.join(5)
    assert not closing.is_alive() and reset_result[0].ok
    kv.destroyed = True  # ... so the caller may destroy the KvManager once close() returned
    calls = kv.calls
    assert kvc.reset_sequence(2).ok  # a sequence of a torn-down generation: released, no call
    assert reserve(kvc, 3).category is Category.UNAVAILABLE
    assert kvc.truncate(1, 0).category is Category.UNAVAILABLE
    assert kv.calls == calls


def test_a_rollback_after_close_gives_back_nothing_on_the_device():
    kvc, kv = coordinator()
    txn = reserve(kvc, 5, tokens=40)
    kvc.close()
    kv.destroyed = True
    assert kvc.rollback(txn).ok and kvc.seqs[5].open_txn is None


# ---- issue 13: no hold and wait (defect 7) -------------------------------------------------------
def test_reserve_applies_the_whole_request_up_front_all_or_nothing():
    """6 blocks of 16 tokens; a request of 40 prompt + 30 new tokens needs 5. Before the fix
    each prefill took 3 blocks and each request then waited for the rest while holding its
    part (both failed at their deadline). Now the first takes all 5 at once, the second
    waits holding nothing and gets them when the first releases."""
    kvc, kv = coordinator(capacity_blocks=6)
    first = kvc.reserve(1, 0, 40, time.monotonic() + 5, reserve_len=70)
    assert isinstance(first, KvTxn) and kv.lens[1] == 70 and kvc.seqs[1].reserved_len == 70
    second, result = in_thread(lambda: kvc.reserve(2, 0, 40, time.monotonic() + 10,
                                                   reserve_len=70))
    assert parked(kvc, second) and 2 not in kv.lens  # waiting, holding nothing
    kvc.mark_submitted(first, evidence=FINISHED)
    kvc.commit(first)
    # the decodes of the first request never wait: their KV is already reserved
    calls = kv.calls
    for past in range(40, 69):
        txn = kvc.reserve(1, past, 1, time.monotonic() + 5, reserve_len=70)
        assert isinstance(txn, KvTxn)
        kvc.mark_submitted(txn, evidence=FINISHED)
        kvc.commit(txn)
    assert kv.calls == calls
    assert kvc.reset_sequence(1).ok
    second.join(5)
    assert isinstance(result[0], KvTxn) and kv.lens[2] == 70


def test_a_request_larger_than_the_whole_kv_is_refused_at_once():
    kvc, kv = coordinator(capacity_blocks=6)
    # a deadline an hour away: the refusal comes at once, before any KvManager call (waiting
    # for capacity would ask can_allocate first)
    refused = kvc.reserve(1, 0, 40, time.monotonic() + 3600, reserve_len=97)  # 7 blocks > 6
    assert refused.code == "kv.exceeds_capacity"
    assert refused.category is Category.INVALID_REQUEST and "97 tokens" in refused.message
    assert kv.calls == 0 and (1 not in kvc.seqs or kvc.seqs[1].open_txn is None)
    assert isinstance(kvc.reserve(1, 0, 40, time.monotonic() + 5, reserve_len=96), KvTxn)


def test_kv_reserve_len_is_checked_against_max_seq_and_sign():
    """A reservation the KvManager can never grant (beyond max_seq: Apply says no for ever)
    is a §6.3 step-2 refusal, not a wait to the deadline; a negative one a construction
    error."""
    import tempfile

    import numpy as np
    import pytest

    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.contracts.prepare import InferenceRequest, check_request
    from calexec.contracts.types import TaskKind
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.synthetic import calbin as cb
    manifest = load_manifest(default_manifest_path())
    with tempfile.TemporaryDirectory() as tmp:  # the generation's contracts, as at start
        path = f"{tmp}/c.calbin"
        cb.write(path, cb.default_spec())
        rc, device = CalRT.load().open_device("")
        assert rc == 0
        rc, calbin = device.load_calbin(path)
        assert rc == 0
        rc, models = calbin.models()
        gen = manifest.resolve([m.info for m in models], generation_id=1,
                               calbin_sha256=calbin.sha256)
        calbin.unload()
        device.close()
    max_seq = gen.submodels[TaskKind.PREFILL_IDS].max_seq

    def request(reserve):
        return InferenceRequest(seq_id=1, kind=TaskKind.PREFILL_IDS,
                                tokens=np.array([1, 2], np.int32),
                                positions=np.array([0, 1], np.int32), past_len=0,
                                deadline=time.monotonic() + 5, kv_reserve_len=reserve)
    assert check_request(request(max_seq), gen).ok
    refused = check_request(request(max_seq + 1), gen)
    assert refused.category is Category.INVALID_REQUEST and "kv_reserve_len" in refused.message
    with pytest.raises(ValueError):
        request(-1)


class _Failed(_Finished):
    def runtime_finished_cleanly(self) -> bool:  # e.g. Wait rc 0 but DONE_CCU_EXCEPTION
        return False


def test_the_commit_guard_decides_from_the_jobs_evidence():
    """§5.1-6: settle() asks the chart; a run the runtime did not finish cleanly never
    commits, whatever the caller tries (forcing the guard true fails this test)."""
    from calexec.machines.compiled import GuardRejected
    kvc, _ = coordinator()
    txn = reserve(kvc, 1)
    kvc.mark_submitted(txn, evidence=_Failed())
    with pytest.raises(GuardRejected):
        kvc.commit(txn)
    assert kvc.settle(txn, "ccu_exception") is False
    assert kvc.seqs[1].unknown_reason == "ccu_exception" and kvc.seqs[1].committed_len == 0
    good = reserve(kvc, 2)
    kvc.mark_submitted(good, evidence=FINISHED)
    assert kvc.settle(good, "unused") is True and kvc.seqs[2].committed_len == good.target_len


# ---- issue 17: a decode stream's next txn, chained behind the open one -------------------------
def test_reserve_next_chains_behind_the_open_txn_and_goes_next_on_commit():
    kvc, kv = coordinator()
    first = reserve(kvc, 1, tokens=4, reserve_len=32)  # the request's whole KV, as the server
    calls = kv.calls
    nxt = kvc.reserve_next(first, 1)
    assert isinstance(nxt, KvTxn) and (nxt.old_len, nxt.target_len) == (4, 5)
    view = kvc.seqs[1]
    assert view.open_txn is first and view.next_txn is nxt and kv.calls == calls  # no Apply
    # busy while chained: no other job, reset or truncation of the sequence
    assert reserve(kvc, 1, past=4, tokens=1).code == "kv.sequence_busy"
    assert kvc.reserve_next(first, 1).code == "kv.sequence_busy"  # one chained txn at most
    kvc.mark_submitted(first, evidence=FINISHED)
    kvc.commit(first)
    assert view.open_txn is nxt and view.next_txn is None and view.committed_len == 4
    assert kvc.reset_sequence(1).code == "kv.sequence_busy"
    kvc.mark_submitted(nxt, evidence=FINISHED)
    kvc.commit(nxt)
    assert view.committed_len == 5 and view.open_txn is None
    assert kv.calls == calls


def test_reserve_next_after_the_commit_opens_at_once_and_never_grows_the_reservation():
    kvc, kv = coordinator()
    first = reserve(kvc, 1, tokens=15)
    kvc.mark_submitted(first, evidence=FINISHED)
    kvc.commit(first)
    nxt = kvc.reserve_next(first, 1)  # the previous job committed before the pre-arm ran
    assert isinstance(nxt, KvTxn) and kvc.seqs[1].open_txn is nxt
    kvc.mark_submitted(nxt, evidence=FINISHED)
    kvc.commit(nxt)
    calls = kv.calls
    beyond = kvc.reserve_next(nxt, 1)  # 17 tokens need a second block: never applied here
    assert beyond.code == "kv.prearm_beyond_reservation" and kv.calls == calls
    assert kvc.seqs[1].open_txn is None and kvc.seqs[1].reserved_len == 16


def test_a_chained_txn_is_rolled_back_when_the_one_before_fails():
    kvc, kv = coordinator()
    first = reserve(kvc, 1, tokens=4, reserve_len=32)
    nxt = kvc.reserve_next(first, 1)
    kvc.mark_submitted(first)  # no evidence: the device run did not finish cleanly
    assert kvc.settle(first, "wait failed") is False
    view = kvc.seqs[1]
    assert view.unknown_reason == "wait failed" and view.next_txn is nxt
    assert kvc.reserve_next(nxt, 1).code == "kv.sequence_unknown"
    calls, reserved = kv.calls, view.reserved_len
    assert kvc.rollback(nxt).ok  # nothing to give back: it never grew the reservation
    assert nxt.run.state == "RolledBack" and view.next_txn is None and view.open_txn is None
    assert kv.calls == calls and view.reserved_len == reserved
    assert kvc.reset_sequence(1).ok


def test_rolling_back_the_open_txn_keeps_the_chained_one_until_its_owner_rolls_it_back():
    kvc, kv = coordinator()
    first = reserve(kvc, 1, tokens=4, reserve_len=32)
    nxt = kvc.reserve_next(first, 1)
    assert kvc.rollback(first).ok  # cancelled before submit
    view = kvc.seqs[1]
    assert view.open_txn is None and view.next_txn is nxt
    assert reserve(kvc, 1, tokens=1).code == "kv.sequence_busy"  # still held by the stream
    assert kvc.rollback(nxt).ok and view.next_txn is None
    assert isinstance(reserve(kvc, 1, tokens=1), KvTxn)


def test_reserve_next_on_a_committed_job_the_sequence_moved_on_from_is_refused():
    """A decode stream pre-arms on the job before it: when that job committed already, the
    next txn opens at once only if the sequence still ends where it did. Truncated since (or
    moved on another way), the armed job would start at a length the KV no longer holds:
    refused, nothing opened (found by a hand mutant of ``reserve_next``, stop 48)."""
    kvc, _ = coordinator()
    first = reserve(kvc, 1, tokens=8, reserve_len=32)
    kvc.mark_submitted(first, evidence=FINISHED)
    kvc.commit(first)
    assert kvc.truncate(1, 4).ok and kvc.seqs[1].committed_len == 4
    moved = kvc.reserve_next(first, 1)
    assert not isinstance(moved, KvTxn), moved
    assert moved.code == "kv.sequence_busy" and "moved on" in moved.message, moved
    assert kvc.seqs[1].open_txn is None and kvc.seqs[1].next_txn is None


def test_a_shrink_the_kv_manager_refused_leaves_the_reservation_it_holds():
    """A rollback gives back what its reserve grew; when the KvManager refuses that shrink,
    it still holds the grown reservation, and so does the coordinator's view (it answers
    ``kv.apply_refused``), whose ``reserved_len`` decides what later reserves apply and what
    a pre-arm may use (found by a hand mutant of ``rollback``, stop 48)."""
    kvc, kv = coordinator()
    txn = reserve(kvc, 1, tokens=20)  # two blocks of 16
    assert kv.lens[1] == 20 and kvc.seqs[1].reserved_len == 20
    apply = kv.apply
    kv.apply = lambda seq, target: False  # the shrink is refused
    try:
        status = kvc.rollback(txn)
    finally:
        kv.apply = apply
    assert status.code == "kv.apply_refused", status
    assert kv.lens[1] == 20 and kvc.seqs[1].reserved_len == 20
    assert kvc.seqs[1].open_txn is None


def test_a_truncation_beyond_the_committed_length_is_refused():
    """``truncate`` keeps a prefix of what was computed; a length beyond the committed one
    would claim KV never written (and grow the reservation): refused, nothing applied
    (found by a hand mutant of ``truncate``, stop 48)."""
    kvc, kv = coordinator()
    txn = reserve(kvc, 1, tokens=8)
    kvc.mark_submitted(txn, evidence=FINISHED)
    kvc.commit(txn)
    calls = kv.calls
    status = kvc.truncate(1, 9)
    assert status.code == "kv.truncate_beyond_committed" and "length=9" in status.message
    assert kv.calls == calls and kvc.seqs[1].committed_len == 8
    assert kvc.truncate(1, 8).ok  # the committed length itself is kept as it is


def _wait_until(predicate, seconds: float = 5.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_large_reservation_is_not_overtaken_by_smaller_ones_arriving_after_it():
    """8 blocks; two small requests hold 1 block each. A large one needing 7 waits; small
    ones keep arriving and each fitted at once, so whenever one small request ended another
    took its block: the large one waited until its deadline (429 ``kv.deadline``) though it
    fits alone (found with 4 looping clients on a loopback server). Now a fresh reservation
    waits its turn: the small ones that arrive after it wait behind it, and it gets its 7
    blocks once the two small ones gave theirs back."""
    kvc, kv = coordinator(capacity_blocks=8)
    small = [reserve(kvc, seq, tokens=16) for seq in (1, 2)]
    assert all(isinstance(txn, KvTxn) for txn in small)
    large, got = in_thread(lambda: reserve(kvc, 3, tokens=7 * 16, seconds=10))
    _wait_until(lambda: kvc.waiting == 1)
    later, got_later = in_thread(lambda: reserve(kvc, 4, tokens=16, seconds=10))
    _wait_until(lambda: kvc.waiting == 2)
    assert 4 not in kv.lens, "a later small reservation overtook the large one"
    for txn in small:
        kvc.mark_submitted(txn, evidence=FINISHED)
        kvc.commit(txn)
        assert kvc.reset_sequence(txn.seq_id).ok
    large.join(5)
    assert isinstance(got[0], KvTxn) and kv.lens[3] == 7 * 16
    later.join(5)  # its turn now: the eighth block
    assert isinstance(got_later[0], KvTxn) and kv.lens[4] == 16


def test_a_waiter_leaving_the_queue_lets_the_next_one_in_and_growth_is_never_queued():
    """The turn passes on when the head gives up (its deadline), and a sequence growing the
    reservation it already holds is not queued behind fresh ones (it gives its KV back once
    it ends: queueing it could wait for capacity only it can free)."""
    kvc, kv = coordinator(capacity_blocks=4)
    held = reserve(kvc, 1, tokens=16)
    assert isinstance(held, KvTxn)
    kvc.mark_submitted(held, evidence=FINISHED)
    kvc.commit(held)
    head, got_head = in_thread(lambda: reserve(kvc, 2, tokens=4 * 16, seconds=0.3))
    _wait_until(lambda: kvc.waiting == 1)
    grown = reserve(kvc, 1, past=16, tokens=16)  # seq 1 holds a block: grows past the head
    assert isinstance(grown, KvTxn) and kv.lens[1] == 32
    kvc.mark_submitted(grown, evidence=FINISHED)
    kvc.commit(grown)
    nxt, got_next = in_thread(lambda: reserve(kvc, 3, tokens=16, seconds=10))
    head.join(5)
    assert got_head[0].code == "kv.deadline"
    nxt.join(5)
    assert isinstance(got_next[0], KvTxn) and kv.lens[3] == 16


class _HeadGatedKv(GatedKv):
    """``GatedKv`` whose Apply for sequence 2 waits for ``head_gate`` (announced by
    ``head_in``)."""

    def __init__(self, capacity_blocks: int) -> None:
        super().__init__(capacity_blocks)
        self.head_in, self.head_gate = threading.Event(), threading.Event()

    def apply(self, seq: int, target: int) -> bool:
        if seq == 2:
            self.head_in.set()
            assert self.head_gate.wait(10), "the test never let the head's Apply go"
        return super().apply(seq, target)


def test_a_fresh_reservation_that_finds_the_queue_emptied_before_it_joins_tries_at_once():
    """The lead's review of the first-come-first-served queue: a fresh reservation that saw
    another at the queue's head did not try; if that head then got its KV and left before
    the newcomer joined (nothing else in the queue, so nothing woke anyone), the newcomer
    joined as the head without having tried and slept, KV free, until its deadline: a lost
    wake-up (FI04). Here the head was woken by a release before the newcomer looked, and
    runs its Apply only once the newcomer has decided to wait behind it."""
    kv = _HeadGatedKv(capacity_blocks=4)
    kvc = KvCoordinator(kv, 1, LockOrder(checking=True, strict=True))
    held = reserve(kvc, 1, tokens=4 * 16)
    assert isinstance(held, KvTxn)
    kvc.mark_submitted(held, evidence=FINISHED)
    kvc.commit(held)
    head, got_head = in_thread(lambda: reserve(kvc, 2, tokens=16, seconds=10))
    _wait_until(lambda: kvc.waiting == 1)
    assert kvc.reset_sequence(1).ok  # the release wakes the head, held in its Apply
    assert kv.head_in.wait(5)
    stopped_once: list[bool] = []

    def newcomer_stop():
        if not stopped_once:  # the newcomer saw the head in the queue and did not try
            stopped_once.append(True)
            kv.head_gate.set()  # the head gets its block and leaves the queue, now empty
            head.join(5)
        return None

    newcomer = reserve(kvc, 3, tokens=16, seconds=3, stop=newcomer_stop)
    head.join(5)
    assert isinstance(got_head[0], KvTxn) and kv.lens[2] == 16
    assert isinstance(newcomer, KvTxn), newcomer  # 3 blocks free: not kv.deadline
    assert kv.lens[3] == 16


class ShiftedClock(WatchedClock):
    """A :class:`WatchedClock` whose ``monotonic`` the test moves forward (``shift``): a
    deadline passes when the test says so, whatever the waits' own timeouts."""

    __slots__ = ("shift",)

    def __init__(self) -> None:
        super().__init__()
        self.shift = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.shift


def test_a_wait_for_kv_woken_after_its_deadline_answers_kv_deadline_however_it_woke():
    """An embedder's requests waiting for KV (enqueue from several threads, the KV held by
    another sequence) past their deadline got ``kv.deadline`` (429, retry later or smaller)
    or ``admission.deadline`` (504) at random: one whose timed wait ended answered the
    former, one woken just after its deadline by a release or the queue moving (another
    waiter joining or leaving) found the executor's deadline check first (found at stop 67:
    5 of 6 such requests answered 504). The same wait, past its deadline, is
    ``kv.deadline`` however it woke; a cancel or shutdown still answers as itself."""
    clock = ShiftedClock()
    kv = GatedKv(capacity_blocks=4)
    kvc = KvCoordinator(kv, 1, LockOrder(checking=True, strict=True, clock=clock))
    held = [kvc.reserve(seq, 0, 16, clock.monotonic() + 5) for seq in (1, 3)]
    assert all(isinstance(txn, KvTxn) for txn in held)
    deadline = clock.monotonic() + 10

    def stop() -> Status | None:  # as the executor's (DeviceExecutor._stop_reason)
        if clock.monotonic() >= deadline:
            return Status.deadline(Phase.ADMISSION, "admission deadline passed")
        return None

    waiter, got = in_thread(lambda: kvc.reserve(2, 0, 4 * 16, deadline, stop=stop))
    assert parked(kvc, waiter)
    clock.shift = 60.0  # its deadline passed; its timed wait has not ended yet
    kvc.rollback(held[1])
    assert kvc.reset_sequence(3).ok  # a block given back (not enough): the waiter wakes
    waiter.join(10)
    assert not waiter.is_alive()
    status = got[0]
    assert isinstance(status, Status), status
    assert (status.code, status.category, status.http_status) == (
        "kv.deadline", Category.RESOURCE_EXHAUSTED, 429), status
    assert "seq 2" in status.message and "before the deadline" in status.message


class _Evidence:
    """A job's three answers the KV commit guard reads (the real ``Job`` methods on them)."""

    runtime_finished_cleanly = Job.runtime_finished_cleanly
    output_validated = Job.output_validated

    def __init__(self, wait_rc, device_status, output_status):
        self.wait_rc, self.device_status, self.output_status = (wait_rc, device_status,
                                                                output_status)


_BAD_OUTPUT = Status.internal("output_short", Phase.OUTPUT_CHECK, "short")


@pytest.mark.parametrize("wait_rc", [0, int(CalrtCode.TIMEOUT)])
@pytest.mark.parametrize("device_status", [DeviceJobStatus.DONE,
                                           DeviceJobStatus.DONE_CCU_EXCEPTION,
                                           DeviceJobStatus.RUNNING])
@pytest.mark.parametrize("output", ["valid", "invalid", "unchecked"])
def test_the_kv_commit_needs_a_clean_wait_a_done_status_and_a_valid_output(
        wait_rc, device_status, output):
    """§5.1-6 / §7: the commit guard (``KvTxn.device_finished_and_output_valid``) asks all
    three facts: Wait rc 0, GetStatus DONE, the output checked valid. Each mutant dropping
    one of them (the ``runtime_finished_cleanly()`` half passed every test naming the row
    before, stop 67 trace audit: the executor's own paths never validate an output after an
    unclean Wait) commits where the spec says the KV stays uncommitted (Unknown)."""
    output_status = {"valid": Status.OK, "invalid": _BAD_OUTPUT, "unchecked": None}[output]
    txn = KvTxn(1, 0, 7, 0, 1)
    txn.evidence = _Evidence(wait_rc, device_status, output_status)
    txn.run.send(KV_EV_MARK_SUBMITTED)
    clean = wait_rc == 0 and device_status == DeviceJobStatus.DONE and output == "valid"
    assert txn.device_finished_and_output_valid() is clean
    if clean:
        txn.run.send(KV_EV_COMMIT)
        assert txn.state == "Committed"
    else:
        with pytest.raises(GuardRejected):
            txn.run.send(KV_EV_COMMIT)
        assert txn.state == "Submitted"
