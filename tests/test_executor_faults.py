"""DeviceExecutor Phase A against the emulator: correctness vs the oracle and the named fault
injections of spec §12 (FI02-FI05, FI07-FI13, FI15) with their expected results."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.prepare import TensorSlice
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import Fault, Stage
from calexec.drivers.synthetic import oracle
from calexec.machines.compiled import JOB
from calexec.machines.coverage import recording as recording_transitions
from calexec.machines.pool import BufferSlot
from executor_harness import (
    SEED,
    arm,
    deadline,
    decode,
    expected_greedy,
    fired,
    greedy,
    prefill,
    settle,
    until,
    write_calbin,
)
from executor_harness import running_job_path as running_executor
from thread_starts import OwnCpu

PROMPT = [11, 22, 33, 44, 55, 66, 77]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def device_len(executor, seq):
    rc, n = executor.kv.seq_len(seq)
    assert rc == 0
    return n


def slot_states(executor):
    """Slot states once the completion thread is done with the last job (a result is
    delivered before its lease goes back, in §6.5 order)."""
    settle(executor)
    return executor.pool.counts()


def test_greedy_matches_oracle_and_two_sequences_stay_independent(calbin):
    with running_executor(calbin) as ex:
        a = greedy(ex, 1, PROMPT, 6)
        b = greedy(ex, 2, PROMPT[::-1], 6)
        assert a == expected_greedy(PROMPT, 6)
        assert b == expected_greedy(PROMPT[::-1], 6)
        # interleaved: same answers
        ex.kvc.reset_sequence(1), ex.kvc.reset_sequence(2)
        r1 = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        r2 = ex.enqueue(prefill(2, PROMPT[::-1])).wait_until(deadline())
        assert [r1.argmax, r2.argmax] == [a[0], b[0]]
        assert device_len(ex, 1) == ex.kvc.seqs[1].committed_len == len(PROMPT)
        assert ex.locks.violations == []
        assert ex.infer_threads == {"calexec-submitter"}
        assert ex.wait_threads == {"calexec-completion"}


def test_logits_slice_lands_in_caller_array(calbin):
    with running_executor(calbin) as ex:
        out = np.full(100, -1.0, dtype=np.float32)
        res = ex.enqueue(prefill(3, PROMPT, want_logits=(1000, 100)), logits_out=out)
        res = res.wait_until(deadline())
        assert res.logits.base is out or res.logits is out or np.shares_memory(res.logits, out)
        ref = oracle.OracleSequence(SEED)
        row = ref.prefill(PROMPT, 16)[0, (len(PROMPT) - 1) % 16]
        assert np.array_equal(out, oracle.bf16_to_f32(row[1000:1100]))


def test_fi02_unknown_csr_fails_prepare_without_submit(calbin):
    with running_executor(calbin) as ex:
        submitted = ex.device.emu.counters()["jobs_submitted"]
        arm(ex, "UNKNOWN_CSR")
        res = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert isinstance(res, Status) and res.phase == Phase.CSR and res.raw == 4
        assert res.step == 7 and "cur_seq_len" in res.message
        assert ex.device.emu.counters()["jobs_submitted"] == submitted
        assert slot_states(ex)["Free"] == len(ex.pool.slots)
        assert ex.kvc.seqs[1].open_txn is None and ex.kvc.seqs[1].reserved_len == 0
        assert greedy(ex, 1, PROMPT, 1) == expected_greedy(PROMPT, 1)


def test_fi03_slice_beyond_bytesize_rejected_locally(calbin):
    with running_executor(calbin) as ex:
        arm(ex, "SLICE_FAIL", "NTH", 10**9)  # never fires; counts slice calls
        slot: BufferSlot = next(s for s in ex.pool.slots if s.kind == TaskKind.PREFILL_IDS)
        contract = slot.submodel.token_or_embed
        status = slot.slice_input(TensorSlice(contract.name, 0, contract.byte_size + 1))
        assert not status.ok and status.step == 6 and str(contract.byte_size) in status.message
        _, calls, _ = ex.device.emu.fault_stats(Fault.SLICE_FAIL)
        assert calls == 0
        # through a request: one token more than max_seq never reaches the device
        res = ex.enqueue(prefill(1, np.zeros(40961, np.int32))).wait_until(deadline())
        assert isinstance(res, Status) and res.category == Category.INVALID_REQUEST
        assert res.http_status == 400


def test_fi04_kv_shortage_waits_on_condition_until_deadline(calbin):
    own = OwnCpu()  # the executor's threads and this one, not those other tests left
    with running_executor(calbin) as ex:
        arm(ex, "CAN_ALLOCATE_FALSE", "ALWAYS")
        applies, wakeups = ex.kvc.apply_calls, ex.kvc.wakeups
        cpu0, wall0 = own.now(), time.monotonic()
        res = ex.enqueue(prefill(1, PROMPT, seconds=0.4)).wait_until(deadline())
        cpu, wall = own.spent(cpu0, own.now()), time.monotonic() - wall0
        assert isinstance(res, Status) and res.code == "kv.deadline" and res.http_status == 429
        assert wall >= 0.35  # (a floor: the wait lasted to its deadline)
        # no polling: the host's books show the KV free, so the refusal is the runtime's
        # (§8 TRANSIENT, reported once: ``kv.refused``) and is retried after a back-off a
        # bounded number of times (``kv_refusal_retries``), then one wait its deadline ended;
        # Apply never called
        retries = ex.config.recovery.kv_refusal_retries
        assert fired(ex, "CAN_ALLOCATE_FALSE") == 1 + retries
        assert ex.kvc.apply_calls == applies
        assert ex.kvc.wakeups == wakeups + 1 + retries
        assert [r.code for r in ex.faults.reports] == ["kv.refused"]
        # an idle wait: the own threads' CPU is what the enqueue took, a busy loop would burn
        # the whole interval (a load only takes CPU from them; others' threads not counted)
        assert cpu < wall / 2, (cpu, wall)
        assert slot_states(ex)["Free"] == len(ex.pool.slots)


def test_fi04_waiter_woken_when_capacity_released(calbin, tmp_path):
    # 4 blocks of 256 tokens: seq 1 takes all of them, seq 2 must wait for its release.
    with running_executor(calbin, "kv_blocks=4;kv_block_size=256") as ex:
        assert not isinstance(ex.enqueue(prefill(1, np.arange(1000) % 500)).wait_until(
            deadline()), Status)
        holder = {}
        t = threading.Thread(target=lambda: holder.update(
            r=ex.enqueue(prefill(2, PROMPT, seconds=10)).wait_until(deadline())))
        t.start()
        # parked in the KV capacity wait (``waiting`` counts the threads in it, under the
        # lock the wait gives up): a sleep here passed a host that had not reached the wait
        # yet, so the release below found nobody to wake and proved nothing
        until(lambda: ex.kvc.waiting == 1, what="seq 2's admission waiting for KV capacity")
        assert t.is_alive() and not holder  # waiting, not failed
        wakeups = ex.kvc.wakeups
        assert ex.kvc.reset_sequence(1).ok
        t.join(5)
        assert not isinstance(holder["r"], Status), holder["r"]
        # woken by the release (it was waiting: at least once), not by polling
        assert 1 <= ex.kvc.wakeups - wakeups <= 2


def test_submit_busy_is_retried_with_backoff_before_failing(calbin):
    with running_executor(calbin) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=17)  # busy once: the runtime did not run the graph
        res = ex.enqueue(decode(1, 5, len(PROMPT))).wait_until(deadline())
        assert not isinstance(res, Status) and ex.counters["submit_retries"] == 1


def test_fi05_submit_busy_rolls_back_without_wait(calbin):
    with running_executor(calbin) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "WAIT_RC", "NTH", 10**9)  # counts Wait calls, never fires
        arm(ex, "SUBMIT_RC", "ALWAYS", rc=17)
        res = ex.enqueue(decode(1, 5, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 17 and res.phase == Phase.SUBMIT
        assert res.category == Category.TRANSIENT
        assert ex.counters["submit_retries"] == ex.config.recovery.submit_retries
        assert ex.device.emu.clear_fault(Fault.SUBMIT_RC) == 0
        _, wait_calls, _ = ex.device.emu.fault_stats(Fault.WAIT_RC)
        assert wait_calls == 0
        assert ex.kvc.seqs[1].committed_len == len(PROMPT) == device_len(ex, 1)
        assert ex.kvc.seqs[1].open_txn is None and ex.kvc.seqs[1].unknown_reason is None
        assert slot_states(ex)["Free"] == len(ex.pool.slots)
        # the rollback gives the token budget and the in-flight permit back too (a mutant
        # keeping the budget passed this test before: stop 67, trace audit)
        snap = ex.snapshot()
        assert snap["pending_tokens"] == 0 and snap["inflight"] == 0, snap
        res = ex.enqueue(decode(1, 5, len(PROMPT))).wait_until(deadline())
        assert not isinstance(res, Status)


@pytest.mark.parametrize("point,code", [
    ("WAIT_RC", "calrt.wait_failed"),            # FI07
    ("CCU_EXCEPTION", "device.ccu_exception"),   # FI08
    ("OUTPUT_SHORT", "internal.output_short"),   # FI09
    ("OUTPUT_NAN", "internal.output_not_finite"),  # FI10
    ("OUTPUT_INF", "internal.output_not_finite"),  # FI10
])
def test_failure_after_submit_quarantines_and_marks_sequence_unknown(calbin, point, code):
    with running_executor(calbin) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, point)
        out = np.full(151936 + 64, 7.0, dtype=np.float32)  # a tail past the requested slice
        res = ex.enqueue(decode(1, 5, len(PROMPT)), logits_out=out).wait_until(deadline())
        settle(ex)
        assert isinstance(res, Status) and res.code == code, res
        assert fired(ex, point) == 1
        assert np.all(out[151936:] == 7.0)  # no write past the slice
        if code == "internal.output_not_finite":
            # the fused native pass stops at the block holding the NaN/Inf: the row before it
            # may be written (a failed job's row is not a result); the message names the index
            assert "at index" in res.message
        else:
            assert np.all(out == 7.0)  # no logits delivered
        assert ex.kvc.seqs[1].unknown_reason == code
        assert slot_states(ex)["Quarantined"] == 1
        assert ex.faults.reports[-1].code == code
        # an Unknown sequence is refused until reset; other sequences keep working
        again = ex.enqueue(decode(1, 5, len(PROMPT))).wait_until(deadline())
        assert isinstance(again, Status) and again.code == "kv.sequence_unknown"
        assert greedy(ex, 2, PROMPT, 1) == expected_greedy(PROMPT, 1)
        assert ex.kvc.reset_sequence(1).ok
        assert greedy(ex, 1, PROMPT, 1) == expected_greedy(PROMPT, 1)


def stepped(ex):
    assert ex.device.emu.set_stepped(True) == 0


def test_fi11_cancel_before_submit_never_reaches_device(calbin):
    """FI11: no device submit, and every resource released (spec: 无设备提交，资源释放): the
    slot, the KV reservation, the token budget. The mutant that dropped the budget's release
    from ``JobOutcomes.fail_before_submit`` passed this test before (stop 67, trace audit):
    the queued job's tokens stayed counted against ``max_pending_tokens`` for ever."""
    with running_executor(calbin, threads=False) as ex:
        submitted = ex.device.emu.counters()["jobs_submitted"]
        handle = ex.enqueue(prefill(1, PROMPT))
        assert handle.state == "Queued" and slot_states(ex)["Leased"] == 1
        assert ex.snapshot()["pending_tokens"] == len(PROMPT)  # (the control: it was taken)
        assert handle.cancel() and handle.cancel()  # idempotent
        assert ex.submit_one()
        res = handle.wait_until(deadline())
        assert isinstance(res, Status) and res.category == Category.CANCELLED
        assert handle.state == "Failed"
        assert ex.device.emu.counters()["jobs_submitted"] == submitted
        assert slot_states(ex)["Free"] == len(ex.pool.slots)
        assert ex.kvc.seqs[1].reserved_len == 0 and ex.kvc.seqs[1].open_txn is None
        snap = ex.snapshot()
        assert snap["pending_tokens"] == 0 and snap["inflight"] == 0, snap
        assert not handle.cancel()  # already resolved


def test_fi12_cancel_after_submit_still_waits_and_releases_after_completion(calbin):
    """FI12: Wait still happens (the emulator's own count of Wait calls, not a set the
    executor fills), the slot is released only after it, and the result is discarded: the
    caller's ``logits_out`` is not written (§5.1-7: cancel stops delivery).

    The job's own chart path is pinned too: Submitted --cancel--> CancelRequested
    --wait_returned--> Failed, never Completing. The mutant that dropped the completion's
    ``job.run.send(JOB_EV_CANCEL)`` after Wait (``Completion._complete``) passed this test
    before (stop 67, trace audit): the job then ran Completing, its KV committed and its
    output checked as a live job's, and only the ``deliver`` guard turned it back."""
    with running_executor(calbin, threads=False) as ex:
        stepped(ex)
        row = np.full(ex.generation.vocab_size, -7.0, np.float32)
        arm(ex, "WAIT_RC", param=10**9)  # armed far ahead: the emulator counts Wait calls
        waits_before = ex.device.emu.fault_stats(Fault.WAIT_RC)[1]
        handle = ex.enqueue(prefill(1, PROMPT), logits_out=row)
        assert ex.submit_one() and handle.state == "Submitted"
        assert handle.cancel()
        assert slot_states(ex)["InFlight"] == 1  # cancel frees nothing the device holds
        rc, did = ex.device.emu.step(0, Stage.JOB)
        assert rc == 0
        assert ex.device.emu.fault_stats(Fault.WAIT_RC)[1] == waits_before  # not yet waited
        assert slot_states(ex)["InFlight"] == 1
        with recording_transitions([JOB]) as recorder:  # this job's completion only
            assert ex.complete_one()
        taken = {(t.source, t.event, t.target) for t in JOB.transitions
                 if t.key in recorder.hits}
        assert taken == {("Submitted", "cancel", "CancelRequested"),
                         ("CancelRequested", "wait_returned", "Failed")}, taken
        res = handle.wait_until(deadline())
        assert isinstance(res, Status) and res.category == Category.CANCELLED
        assert handle.state == "Failed"
        assert ex.device.emu.fault_stats(Fault.WAIT_RC)[1] == waits_before + 1  # Wait happened
        assert np.all(row == -7.0), "a cancelled job wrote the caller's logits_out"
        assert slot_states(ex)["Free"] == len(ex.pool.slots)
        # the device executed the job: the KV truth is committed, not rolled back
        assert ex.kvc.seqs[1].committed_len == len(PROMPT) == device_len(ex, 1)


def test_fi13_shutdown_cancels_queued_and_drains_submitted(calbin):
    with running_executor(calbin, "decode_us=300000") as ex:
        greedy(ex, 1, PROMPT, 0), greedy(ex, 2, PROMPT, 0)
        submitted = ex.enqueue(decode(1, 5, len(PROMPT)))
        until(lambda: submitted.state == "Submitted", what="the first job on the device")
        queued = ex.enqueue(decode(2, 5, len(PROMPT)))
        assert submitted.state == "Submitted" and queued.state == "Queued"
        pool = ex.pool
        assert ex.shutdown(grace=5.0).ok
        assert not isinstance(submitted.wait_until(deadline()), Status)
        res = queued.wait_until(deadline())
        assert isinstance(res, Status) and res.category == Category.CANCELLED
        assert ex.state == "Stopped"
        assert pool.counts()["Leased"] == pool.counts()["InFlight"] == 0


def test_fi15_missing_undo_slice_quarantines_the_slot(calbin, monkeypatch):
    with running_executor(calbin) as ex:
        monkeypatch.setattr(BufferSlot, "undo_slices", lambda self: Status.OK)
        res = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        settle(ex)
        assert not isinstance(res, Status)  # the result was valid and is delivered
        quarantined = [s for s in ex.pool.slots if s.run.state == "Quarantined"]
        assert len(quarantined) == 1
        rc, active = quarantined[0].inbuf.active_slices()  # the emulator's ground truth
        assert rc == 0 and active == 2
        assert ex.faults.reports[-1].code == "internal.undo_slice_missing"



def test_a_failed_undo_slice_is_reported_itself_before_the_quarantine_it_causes(
        calbin, monkeypatch):
    """UndoSlice answering an error after a good job: the result stands, the runtime's own
    error is reported (its category decides the recovery, here DEVICE), then the slot's
    quarantine for the slices left (FI15). Reporting only the quarantine (INTERNAL) hid
    the runtime's answer from the fault controller (a hand mutant of ``_complete``, stop
    48)."""
    from calexec.contracts.codes import CalrtCode

    with running_executor(calbin) as ex:
        monkeypatch.setattr(BufferSlot, "undo_slices", lambda self: Status.from_calrt(
            CalrtCode.DEVICE_CRASH, Phase.RELEASE, "UndoSlice failed"))
        res = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        settle(ex)
        assert not isinstance(res, Status)  # the result was valid and is delivered
        undo, missing = list(ex.faults.reports)[-2:]
        assert (undo.raw, undo.category, undo.seq_id) == (
            CalrtCode.DEVICE_CRASH, Category.DEVICE, 1), undo
        assert missing.code == "internal.undo_slice_missing", missing

def test_admission_refuses_when_not_ready_and_token_budget(calbin):
    with running_executor(calbin, max_pending_tokens=8) as ex:
        res = ex.enqueue(prefill(1, list(range(9)))).wait_until(deadline())
        assert isinstance(res, Status) and res.code == "queue.full" and res.http_status == 429
    res = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
    assert isinstance(res, Status) and res.http_status == 503


def test_decode_sync_maps_status_and_logs_context(calbin, caplog):
    with running_executor(calbin) as ex:
        code, res = ex.decode_sync(prefill(1, PROMPT))
        assert code == 0 and res.argmax == expected_greedy(PROMPT, 0)[0]
        arm(ex, "SUBMIT_RC", rc=18)
        with caplog.at_level(logging.WARNING, logger="calexec.executor"):
            code, res = ex.decode_sync(decode(1, 5, len(PROMPT)))
        assert code == -2 and res.raw == 18
        line = caplog.records[-1].getMessage()
        for part in (f"job_id={res.job_id}", "seq_id=1", "generation=1", "raw=18",
                     "phase=submit"):
            assert part in line
        code, _ = ex.decode_sync(prefill(1, []))
        assert code == -1


def test_sequence_id_beyond_kv_manager_is_refused_at_once(calbin):
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(ex.kv.max_seqs, PROMPT, seconds=30))
        res = handle.wait_until(deadline())
        # refused, not waited to its deadline (that would answer wait.deadline)
        assert isinstance(res, Status) and res.code == "kv.seq_id_out_of_range"
        assert res.http_status == 400 and str(ex.kv.max_seqs) in res.message


def test_decode_sync_past_its_deadline_cancels_the_job_so_it_never_writes_logits_out(calbin):
    """A llama.cpp-style caller whose decode_sync returned ``wait.deadline`` may reuse its
    logits row at once: the job, still on the device then, is cancelled (its result is
    nobody's) and never writes the row when it completes (found by the differential test:
    the row changed under the caller's next request)."""
    with running_executor(calbin, "decode_us=200000") as ex:
        first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        row = np.full(ex.generation.vocab_size, -7.0, np.float32)
        code, status = ex.decode_sync(decode(1, first.argmax, len(PROMPT), seconds=0.05),
                                      logits_out=row)
        assert code != 0 and status.code == "wait.deadline", status
        settle(ex)  # the job ends on the device (0.2 s)
        assert np.all(row == -7.0), "a job whose caller gave up wrote its logits_out"
        assert ex.snapshot()["cancelled"] >= 1


# ---- hand mutants of stops 47 and 48 (docs/testing.md) ------------------------------
def test_a_job_queued_while_shutdown_closes_its_generation_never_reaches_the_device(
        calbin, monkeypatch):
    """Shutdown cancels the queued jobs, then closes the generation to request threads and
    waits for those inside. A request thread that queues its job between the two (its
    preparation ran across the cancel) must not have it submitted: the submitter refuses a
    job of a closing generation (``generation ... retired before submit``), as the queue
    itself does from the close on, and reports no fault (UNAVAILABLE is the shutdown's, not
    the device's). Without the check the job ran on the device during the shutdown drain
    (found by a hand mutant of ``_unsubmittable``, stop 47; the report by one of
    ``fail_before_submit``, stop 48)."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.clock import Clock
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from calexec.machines.pool import BufferSlot
    from executor_harness import MANIFEST

    holding, opened, queued = threading.Event(), threading.Event(), threading.Event()
    box: dict = {}

    def gated_prepare(slot, request, prepare=BufferSlot.prepare):
        if threading.current_thread() is box.get("thread") and not opened.is_set():
            holding.set()
            opened.wait(10.0)
        return prepare(slot, request)

    class _ReadyHook(threading.Condition):
        def notify_all(self):
            # shutdown wakes the Ready waiters after it cancelled the queued jobs (the KV
            # coordinator is closed by then): the held request thread queues its job now
            ex = box.get("ex")
            if (ex is not None and holding.is_set() and not opened.is_set()
                    and threading.current_thread() is not box.get("thread")
                    and ex.kvc.closed):
                opened.set()
                queued.wait(10.0)
            super().notify_all()

    class _HookClock(Clock):
        __slots__ = ()

        def condition(self, lock, name=""):
            return _ReadyHook(lock) if name == "ready_cv" else super().condition(lock, name)

    monkeypatch.setattr(BufferSlot, "prepare", gated_prepare)
    ex = DeviceExecutor(CalRT.load(), MANIFEST,
                        ExecutorConfig(calbin_path=calbin, threads=False, auto_prearm=False),
                        fault_sink=RecordingFaultSink(), clock=_HookClock())
    assert ex.start().ok
    box["ex"] = ex

    def request() -> None:
        box["handle"] = ex.enqueue(prefill(1, PROMPT, seconds=60.0))
        queued.set()

    thread = box["thread"] = threading.Thread(target=request, name="request", daemon=True)
    try:
        thread.start()
        assert holding.wait(10.0), "the request never reached its preparation"
        assert ex.shutdown(grace=5.0).ok
        thread.join(10.0)
        assert queued.is_set() and box["handle"].state == "Failed", box["handle"].state
        result = box["handle"].wait_until(deadline())
        assert isinstance(result, Status) and result.category == Category.UNAVAILABLE, result
        assert "retired before submit" in result.message, result
        # refused for the shutdown, not for a fault: nothing reported to the fault sink
        assert list(ex.faults.reports) == [], list(ex.faults.reports)
    finally:
        opened.set()
        queued.set()
        thread.join(10.0)
        if not ex.lifecycle.final:
            ex.shutdown(grace=5.0)



class _SkippingClock:
    """The executor's clock, ``skipped`` seconds ahead of the system's once a test moves
    it; with ``jump_waits`` a timed wait runs out at once (time jumps past its end)."""

    def __new__(cls):
        from calexec.machines.clock import Clock

        class _Clock(Clock):
            __slots__ = ("skipped", "jump_waits")

            def __init__(self) -> None:
                self.skipped = 0.0
                self.jump_waits = False

            def monotonic(self):
                return super().monotonic() + self.skipped

            def now_us(self):
                return super().now_us() + int(self.skipped * 1e6)

            def wait(self, cond, timeout):
                if self.jump_waits and timeout is not None:
                    self.skipped += timeout + 1.0
                    return False
                return super().wait(cond, timeout)

        return _Clock()


@pytest.mark.parametrize("cause", ["cancelled", "queue deadline", "no buffer slot"])
def test_a_failure_before_submit_that_is_the_callers_is_never_a_fault(calbin, cause):
    """A job that fails before submit for a reason of its own caller (cancelled while
    queued; its deadline passed in the queue or while it waited for a buffer slot)
    releases what it held and is not reported to the fault sink: the device did nothing
    wrong (a controller counting them would take a client's cancels and deadlines for
    device trouble). Found by hand mutants of ``fail_before_submit`` (stops 47 and 48):
    CANCELLED or DEADLINE dropped from its list of the caller's categories passed every
    test."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST

    clock = _SkippingClock()
    ex = DeviceExecutor(CalRT.load(), MANIFEST,
                        ExecutorConfig(calbin_path=calbin, threads=False, auto_prearm=False),
                        fault_sink=RecordingFaultSink(), clock=clock)
    assert ex.start().ok
    try:
        reports = list(ex.faults.reports)
        if cause == "no buffer slot":  # every prefill slot leased by a queued job
            held = [ex.enqueue(prefill(seq, PROMPT)) for seq in (1, 2)]
            assert [h.state for h in held] == ["Queued", "Queued"]
            clock.jump_waits = True  # its wait for a slot runs to its deadline
            handle = ex.enqueue(prefill(3, PROMPT))
            expected = Category.DEADLINE
        else:
            handle = ex.enqueue(prefill(1, PROMPT))
            assert handle.state == "Queued"
            if cause == "cancelled":
                assert handle.cancel()
                expected = Category.CANCELLED
            else:
                clock.skipped = 60.0  # past the job's deadline (10 s)
                expected = Category.DEADLINE
            assert ex.submit_one()
        res = handle.wait_until(clock.monotonic() + 10.0)
        assert isinstance(res, Status) and res.category == expected, res
        assert list(ex.faults.reports) == reports
    finally:
        clock.jump_waits = False
        ex.shutdown(grace=5.0)
