"""Asynchrony of the emulator: infer returns before execution, Wait timeouts, the GIL, the
DMA guard, stepped mode, parallel mode and overlap, queue depth, resets."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from calexec.drivers.calrt.runtime import (
    CalRT,
    Did,
    Fault,
    FaultMode,
    JobStatus,
    Overlap,
    Rc,
    Scope,
    Stage,
    TaskType,
)
from calexec.drivers.direct import DirectRunner, check
from calexec.drivers.synthetic import calbin, oracle

SEED = 0x1234
D = calbin.DECODE


@pytest.fixture
def runner(tmp_path):
    path = tmp_path / "q.calbin"
    calbin.write(str(path), calbin.default_spec(seed=SEED))
    r = DirectRunner(CalRT.load(), str(path))
    yield r
    r.close()


def _decode_ref(tokens: list[int]) -> np.ndarray:
    ref = oracle.OracleSequence(SEED)
    ref.run(tokens[:-1])
    return ref.decode(tokens[-1])[0, 0]


def test_infer_returns_before_execution_and_wait_times_out_then_succeeds(runner):
    check(runner.device.emu.set_latency(decode_us=150_000), "latency")
    assert runner.submit(D, 0, 0, tokens=[3]) == Rc.SUCCESS
    out = runner.slot(D).outbuf
    rc, status = out.get_status()
    assert rc == 0 and status in (JobStatus.PENDING, JobStatus.RUNNING)
    assert out.wait(0) == Rc.ERR_TIMEOUT
    assert out.wait(1_000) == Rc.ERR_TIMEOUT
    assert out.valid_bytes() == (0, 0)
    assert out.wait(-1) == Rc.SUCCESS
    assert out.get_status() == (0, JobStatus.DONE)
    assert out.valid_bytes() == (0, calbin.VOCAB * 2)
    assert np.array_equal(runner.slot(D).logits[0, 0], _decode_ref([3]))
    assert out.wait(0) == Rc.SUCCESS  # a finished job stays finished


def test_wait_releases_the_gil(runner):
    check(runner.device.emu.set_latency(decode_us=300_000), "latency")
    ticks = []
    waiting = threading.Event()
    stop = threading.Event()

    def ticker():
        waiting.wait()
        while not stop.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.002)

    t = threading.Thread(target=ticker)
    t.start()
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    waiting.set()
    start = time.monotonic()
    rc = runner.slot(D).outbuf.wait(-1)
    end = time.monotonic()
    stop.set()
    t.join()
    assert rc == 0
    during = [x for x in ticks if start < x < end]
    # A GIL held for the whole Wait would leave no ticks inside it.
    assert len(during) >= 10


def test_dma_guard_counts_host_input_and_output_writes_in_flight(runner):
    emu = runner.device.emu
    check(emu.set_stepped(True), "stepped")
    s = runner.slot(D)
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    s.inputs["input_ids"][0, 0] = 4  # reused too early: the device reads it at H2D
    assert emu.step(0, Stage.H2D) == (0, Did.H2D)
    assert emu.step(0, Stage.COMPUTE) == (0, Did.COMPUTE)
    s.logits[0, 0, 0] ^= 1  # host writes the output while in flight
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    c = emu.counters()
    assert (c["dma_input_violations"], c["dma_output_violations"]) == (1, 1)
    # The corruption is real: the device computed with the token that was there at H2D.
    assert np.array_equal(s.logits[0, 0], _decode_ref([4]))


def test_dma_guard_is_fixed_per_job_when_it_is_submitted(runner):
    """The knob is read at infer(): turning it on while a job submitted without it is queued
    counts nothing for that job, and turning it off does not stop checking a guarded job."""
    emu = runner.device.emu
    s = runner.slot(D)
    check(emu.set_knob("dma_guard", 0), "guard off")
    check(emu.set_stepped(True), "stepped")
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    check(emu.set_knob("dma_guard", 1), "guard on")  # while the job is queued
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    c = emu.counters()
    assert (c["dma_input_violations"], c["dma_output_violations"]) == (0, 0)
    assert runner.finish(D) == JobStatus.DONE
    assert np.array_equal(s.logits[0, 0], _decode_ref([3]))
    # Submitted with the guard on, then turned off: the job's writes in flight still count.
    assert runner.submit(D, 0, 1, tokens=[5]) == 0
    check(emu.set_knob("dma_guard", 0), "guard off")
    s.inputs["input_ids"][0, 0] = 6
    assert emu.step(0, Stage.H2D) == (0, Did.H2D)
    assert emu.step(0, Stage.COMPUTE) == (0, Did.COMPUTE)
    s.logits[0, 0, 0] ^= 1
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    c = emu.counters()
    assert (c["dma_input_violations"], c["dma_output_violations"]) == (1, 1)


def test_clean_run_has_no_dma_violations(runner):
    for past in range(3):
        runner.run(D, 0, past, tokens=[past + 1])
    c = runner.device.emu.counters()
    assert c["dma_input_violations"] == 0 and c["dma_output_violations"] == 0
    assert c["jobs_submitted"] == c["jobs_executed"] == 3


def test_stepped_mode_advances_stage_by_stage(runner):
    emu = runner.device.emu
    assert emu.step(0) == (Rc.ERR_INVALID_VALUE, Did.NOTHING)  # not in stepped mode
    check(emu.set_stepped(True), "stepped")
    assert emu.step(0) == (0, Did.NOTHING)
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    out = runner.slot(D).outbuf
    assert emu.pending(0) == (0, 1, Stage.H2D)
    assert emu.step(0, Stage.COMPUTE)[0] == Rc.ERR_INVALID_VALUE  # not the next stage
    assert out.get_status() == (0, JobStatus.PENDING)
    assert emu.step(0) == (0, Did.H2D)
    assert out.get_status() == (0, JobStatus.RUNNING)
    assert emu.step(0) == (0, Did.COMPUTE)
    assert runner.kv.seq_len(0) == (0, 1)  # compute commits the KV
    assert emu.step(0) == (0, Did.D2H)
    assert out.wait(0) == Rc.ERR_TIMEOUT
    assert emu.step(0) == (0, Did.SIGNAL)
    assert out.wait(0) == 0 and out.get_status() == (0, JobStatus.DONE)
    assert emu.pending(0) == (0, 0, Stage.NONE)
    assert np.array_equal(runner.slot(D).logits[0, 0], _decode_ref([3]))


def test_stepped_mode_returns_once_no_stage_is_in_progress(runner):
    """``set_stepped(True)`` returns once the device's own threads are out of their stages,
    so the caller's next step owns the engine. Found by CI's hypothesis run (stop 72): a
    recovery run unstepped the device for a moment, an engine thread began the queued job's
    compute, and the test's next ``step`` met 17 (another thread stepping the engine)."""
    emu = runner.device.emu
    check(emu.set_latency(decode_us=300_000), "latency")
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    out = runner.slot(D).outbuf
    for _ in range(2000):  # bounded: until the engine's thread is inside the job's compute
        if out.get_status() == (0, JobStatus.RUNNING) and emu.pending(0)[2] == Stage.COMPUTE:
            break
        time.sleep(0.001)
    check(emu.set_stepped(True), "stepped")
    rc, did = emu.step(0, Stage.JOB)
    assert rc == 0 and did == Did.SIGNAL, (rc, did)
    assert out.wait(0) == 0 and out.get_status() == (0, JobStatus.DONE)
    assert np.array_equal(runner.slot(D).logits[0, 0], _decode_ref([3]))


def _extra_decode_bufs(r: DirectRunner, token: int, past: int):
    """A second buffer set for the decode model (so two decode jobs can be in flight)."""
    model = r.models[D]
    rc, inb = model.create_input_buf()
    check(rc, "inbuf")
    rc, outb = model.create_output_buf()
    check(rc, "outbuf")
    ids = np.array([[token]], dtype=np.int32)
    pos = np.array([[past]], dtype=np.int32)
    logits = np.zeros((1, 1, calbin.VOCAB), dtype=np.uint16)
    for rc in (inb.map("input_ids", ids), inb.map("positions", pos), outb.map("logits", logits),
               inb.set_csr("cur_seq_len", 1), inb.set_csr("total_seq_len", past + 1)):
        check(rc, "prepare")
    return inb, outb, logits, (ids, pos)


def test_parallel_mode_runs_two_engines(runner):
    emu = runner.device.emu
    assert runner.submit(D, 0, 0, tokens=[3], task=TaskType.PONG) == Rc.ERR_UNSUPPORTED
    check(runner.device.enable_parallel_mode(True), "parallel")
    check(emu.set_stepped(True), "stepped")
    assert runner.kv.apply(1, 1)
    inb, outb, logits, _keep = _extra_decode_bufs(runner, 9, 0)
    assert runner.submit(D, 0, 0, tokens=[3], task=TaskType.PING) == 0
    assert runner.device.infer_with_fixed_task_type(runner.models[D], runner.kv, 1, inb, outb, TaskType.PONG) == 0
    assert emu.pending(0)[1] == 1 and emu.pending(1)[1] == 1
    assert runner.device.enable_parallel_mode(False) == Rc.ERR_DEVICE_BUSY
    assert emu.step(1, Stage.JOB) == (0, Did.SIGNAL)
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    assert np.array_equal(logits[0, 0], _decode_ref([9]))
    assert np.array_equal(runner.slot(D).logits[0, 0], _decode_ref([3]))


def _two_engine_jobs(runner: DirectRunner, overlap: int):
    emu = runner.device.emu
    check(emu.set_knob("overlap", overlap), "overlap")
    check(runner.device.enable_parallel_mode(True), "parallel")
    check(emu.set_stepped(True), "stepped")
    assert runner.kv.apply(1, 1)
    extra = _extra_decode_bufs(runner, 9, 0)
    assert runner.submit(D, 0, 0, tokens=[3], task=TaskType.PING) == 0
    inb, outb = extra[0], extra[1]
    assert runner.device.infer_with_fixed_task_type(runner.models[D], runner.kv, 1, inb, outb, TaskType.PONG) == 0
    return emu, extra


def test_overlap_none_gives_the_device_to_one_job_at_a_time(runner):
    emu, extra = _two_engine_jobs(runner, Overlap.NONE)
    assert emu.step(0) == (0, Did.H2D)
    assert emu.step(1) == (0, Did.BLOCKED)  # engine 0 owns the device until its job ends
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    assert emu.step(1, Stage.JOB) == (0, Did.SIGNAL)
    assert np.array_equal(extra[2][0, 0], _decode_ref([9]))


@pytest.mark.parametrize("overlap,engine1_compute", [(Overlap.DMA, Did.BLOCKED), (Overlap.FULL, Did.COMPUTE)])
def test_overlap_dma_serialises_compute_only(runner, overlap, engine1_compute):
    check(runner.device.emu.set_fault(Fault.HANG, FaultMode.NTH, 1), "hang")  # engine 0's CCU hangs
    emu, _extra = _two_engine_jobs(runner, overlap)
    assert emu.step(0) == (0, Did.H2D)
    assert emu.step(0) == (0, Did.HUNG)
    assert emu.step(1) == (0, Did.H2D)  # DMA of the other engine overlaps in both modes
    assert emu.step(1) == (0, engine1_compute)
    assert runner.device.reset_ccu() == 0
    assert emu.pending(0)[1] == 0 and emu.pending(1)[1] == 0


def test_queue_depth_returns_device_busy(runner):
    emu = runner.device.emu
    check(emu.set_knob("queue_depth", 1), "depth")
    check(emu.set_stepped(True), "stepped")
    assert runner.kv.apply(1, 1)
    inb, outb, _logits, _keep = _extra_decode_bufs(runner, 9, 0)
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    assert runner.device.infer(runner.models[D], runner.kv, 1, inb, outb) == Rc.ERR_DEVICE_BUSY
    assert runner.submit(D, 0, 0, tokens=[3]) == Rc.ERR_DEVICE_BUSY  # outbuf already in flight
    assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    assert runner.device.infer(runner.models[D], runner.kv, 1, inb, outb) == 0


def _hung_job(runner: DirectRunner) -> None:
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=[1, 2, 3])
    check(runner.device.emu.set_fault(Fault.HANG, FaultMode.NTH, 1), "hang")
    assert runner.submit(D, 0, 3, tokens=[4]) == 0
    assert runner.slot(D).outbuf.wait(20_000) == Rc.ERR_TIMEOUT


def test_reset_ccu_aborts_hung_job_keeps_kv_and_configuration(runner):
    _hung_job(runner)
    assert runner.device.reset_ccu() == 0
    out = runner.slot(D).outbuf
    assert out.wait(-1) == 0 and out.get_status() == (0, JobStatus.ABORTED)
    c = runner.device.emu.counters()
    assert (c["hangs"], c["jobs_aborted"], c["resets_ccu"]) == (1, 1, 1)
    assert runner.kv.seq_len(0) == (0, 3)
    row = runner.run(D, 0, 3, tokens=[4])  # still configured, KV intact
    assert np.array_equal(row, _decode_ref([1, 2, 3, 4]))


def test_reset_configuration_and_full_reset(runner):
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=[1, 2, 3])
    assert runner.device.reset_configuration() == 0
    assert runner.submit(D, 0, 3, tokens=[4]) == Rc.ERR_MISSING_CONFIG
    assert runner.kv.seq_len(0) == (0, 3)
    assert runner.device.configure(runner.calbin) == 0
    assert runner.device.configure(runner.calbin) == Rc.ERR_ALREADY_CONFIGURED
    assert runner.device.reset() == 0
    assert runner.kv.seq_len(0) == (0, 0)
    assert runner.kv.free_blocks() == (0, runner.kv.capacity_blocks)
    assert runner.submit(D, 0, 0, tokens=[4]) == Rc.ERR_MISSING_CONFIG
    assert runner.device.emu.counters()["resets_full"] == 1


def test_reset_scope_knob_changes_what_reset_ccu_does(runner):
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=[1, 2, 3])
    check(runner.device.emu.set_knob("reset_ccu_scope", Scope.JOBS | Scope.KV), "scope")
    assert runner.device.reset_ccu() == 0
    assert runner.kv.seq_len(0) == (0, 0)
    assert runner.device.emu.get_knob("reset_ccu_scope") == (0, Scope.JOBS | Scope.KV)


def test_stale_completion_lands_in_old_host_buffer_after_reset(runner):
    emu = runner.device.emu
    first = runner.run(D, 0, 0, tokens=[3]).copy()  # device memory now holds these logits
    logits = runner.slot(D).logits
    logits[...] = 0
    check(emu.set_stepped(True), "stepped")
    check(emu.set_fault(Fault.HANG, FaultMode.ALWAYS), "hang")
    check(emu.set_fault(Fault.STALE_COMPLETION, FaultMode.ALWAYS), "stale")
    assert runner.submit(D, 0, 1, tokens=[5]) == 0
    assert emu.step(0) == (0, Did.H2D)
    assert emu.step(0) == (0, Did.HUNG)
    assert runner.device.reset_ccu() == 0
    assert emu.counters()["stale_pending"] == 1
    assert not logits.any()  # nothing landed yet
    assert emu.step(0) == (0, Did.STALE)
    assert np.array_equal(logits[0, 0], first)  # the old job's D2H wrote the old buffer
    c = emu.counters()
    assert (c["stale_completions"], c["stale_pending"]) == (1, 0)


def test_stale_completion_is_delivered_by_the_device_thread(runner):
    emu = runner.device.emu
    check(emu.set_knob("stale_delay_us", 0), "delay")
    check(emu.set_fault(Fault.HANG, FaultMode.ALWAYS), "hang")
    check(emu.set_fault(Fault.STALE_COMPLETION, FaultMode.ALWAYS), "stale")
    assert runner.submit(D, 0, 0, tokens=[5]) == 0
    assert runner.slot(D).outbuf.wait(10_000) == Rc.ERR_TIMEOUT
    assert runner.device.reset_ccu() == 0
    deadline = time.monotonic() + 10.0
    while emu.counters()["stale_completions"] == 0 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert emu.counters()["stale_completions"] == 1


def test_close_wakes_a_blocked_wait_and_invalidates_the_buffer(runner):
    check(runner.device.emu.set_fault(Fault.HANG, FaultMode.ALWAYS), "hang")
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    out = runner.slot(D).outbuf
    result = []
    waiter = threading.Thread(target=lambda: result.append(out.wait(-1)))
    waiter.start()
    while runner.device.emu.counters()["hangs"] == 0:
        time.sleep(0.001)
    time.sleep(0.05)  # let the waiter block in C (if it has not, it sees a stale handle)
    assert runner.device.close() == 0
    waiter.join()  # close never leaves a waiter blocked on a freed device
    assert result[0] in (Rc.ERR_DEVICE_UNAVAILABLE, Rc.ERR_INVALID_VALUE)
    assert out.wait(0) == Rc.ERR_INVALID_VALUE
