"""KvCoordinator races a whole executor rarely hits (§5 rule: one job per sequence at a time;
§7: the device KV is never released under a job), driven deterministically with a KvManager
whose calls block until the test lets them go."""

from __future__ import annotations

import threading
import time

from calexec.contracts.errors import Category
from calexec.machines.kv import KvCoordinator, KvTxn
from calexec.machines.locks import LockOrder


class GatedKv:
    """A KvManager whose apply/release wait for ``gate`` (set: they run at once)."""

    block_size = 16
    max_seqs = 8

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.lens: dict[int, int] = {}

    def can_allocate(self, blocks: int) -> bool:
        return True

    def _call(self) -> None:
        self.entered.set()
        assert self.gate.wait(10), "the test never let the call go"

    def apply(self, seq: int, target: int) -> bool:
        self._call()
        self.lens[seq] = target
        return True

    def release(self, seq: int) -> int:
        self._call()
        self.lens.pop(seq, None)
        return 0


def coordinator() -> tuple[KvCoordinator, GatedKv]:
    kv = GatedKv()
    return KvCoordinator(kv, 1, LockOrder(checking=True, strict=True)), kv


def reserve(kvc: KvCoordinator, seq: int, past: int = 0, tokens: int = 4):
    return kvc.reserve(seq, past, tokens, time.monotonic() + 5)


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
    txn.device_finished = txn.output_valid = True
    kvc.mark_submitted(txn)
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
    time.sleep(0.05)
    assert waiting.is_alive() and 3 in kv.lens  # waiting, KV not released under the job
    kvc.device_let_go(3)
    waiting.join(5)
    assert result[0].ok and 3 not in kv.lens and kvc.seqs[3].unknown_reason is None


def test_a_waiting_reset_ends_when_the_coordinator_closes():
    kvc, _ = coordinator()
    txn = reserve(kvc, 4)
    kvc.mark_submitted(txn)
    kvc.mark_unknown(txn, "calrt.wait_failed", on_device=True)
    waiting, result = in_thread(lambda: kvc.reset_sequence(4, wait_s=10))
    time.sleep(0.05)
    kvc.close()
    waiting.join(5)
    assert not waiting.is_alive() and result[0].code == "kv.sequence_on_device"
