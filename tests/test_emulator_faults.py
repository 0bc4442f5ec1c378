"""The emulator's fault plan: every point fires as configured (NTH, EVERY_K, seeded PROB,
ALWAYS, OFF), and the KV knob after failed jobs."""

from __future__ import annotations

import numpy as np
import pytest

from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode, JobStatus, KvPolicy, Rc
from calexec.drivers.direct import DirectRunner, check
from calexec.drivers.synthetic import calbin, oracle

SEED = 77
D = calbin.DECODE


def _fire_pattern(r: DirectRunner, point: int, calls: int) -> list[bool]:
    """Which of `calls` consecutive calls at a cheap API point fired."""
    s = r.slot(D)
    fired = []
    for _ in range(calls):
        if point == Fault.UNKNOWN_CSR:
            fired.append(s.inbuf.set_csr("cur_seq_len", 1) == Rc.ERR_INVALID_VALUE)
        elif point == Fault.CAN_ALLOCATE_FALSE:
            fired.append(not r.kv.can_allocate(1))
        elif point == Fault.APPLY_FALSE:
            fired.append(not r.kv.apply(0, 1))
        elif point == Fault.MAP_FAIL:
            fired.append(s.outbuf.map("logits", s.logits) != 0)
        elif point == Fault.SLICE_FAIL:
            fired.append(r.slot(calbin.PREFILL_IDS).inbuf.slice("input_ids", 0, 1) != 0)
        else:
            raise AssertionError(point)
    return fired


CHEAP_POINTS = [Fault.UNKNOWN_CSR, Fault.CAN_ALLOCATE_FALSE, Fault.APPLY_FALSE, Fault.MAP_FAIL, Fault.SLICE_FAIL]


@pytest.mark.parametrize("point", CHEAP_POINTS)
def test_nth_every_k_always_off(runner, point):
    emu = runner.device.emu
    runner.slot(calbin.PREFILL_IDS)  # map the buffers before arming
    runner.slot(D)
    check(emu.set_fault(point, FaultMode.NTH, 3), "nth")
    assert _fire_pattern(runner, point, 6) == [False, False, True, False, False, False]
    assert emu.fault_stats(point) == (0, 6, 1)
    check(emu.set_fault(point, FaultMode.EVERY_K, 2), "every")
    assert _fire_pattern(runner, point, 6) == [False, True] * 3
    check(emu.set_fault(point, FaultMode.ALWAYS), "always")
    assert _fire_pattern(runner, point, 3) == [True] * 3
    check(emu.clear_fault(point), "clear")
    assert _fire_pattern(runner, point, 3) == [False] * 3
    assert emu.fault_stats(point) == (0, 3, 3)  # counts survive clear


def test_prob_mode_is_seeded_and_deterministic(calbin_path):
    patterns = []
    for seed in (11, 11, 12):
        r = DirectRunner(CalRT.load(), calbin_path)
        r.slot(D)
        check(r.device.emu.set_fault(Fault.CAN_ALLOCATE_FALSE, FaultMode.PROB, 300_000, seed), "prob")
        patterns.append(_fire_pattern(r, Fault.CAN_ALLOCATE_FALSE, 200))
        r.close()
    assert patterns[0] == patterns[1]
    assert patterns[0] != patterns[2]
    assert 20 < sum(patterns[0]) < 120  # ~30% of 200


def test_fault_set_rejects_bad_arguments(runner):
    emu = runner.device.emu
    assert emu.set_fault(Fault.COUNT, FaultMode.ALWAYS) == Rc.ERR_INVALID_VALUE
    assert emu.set_fault(Fault.HANG, 99) == Rc.ERR_INVALID_VALUE
    assert emu.set_fault(Fault.HANG, FaultMode.NTH, 0) == Rc.ERR_INVALID_VALUE
    assert emu.set_fault(Fault.HANG, FaultMode.PROB, 1_000_001) == Rc.ERR_INVALID_VALUE


def test_submit_rc_returns_the_chosen_code_without_enqueueing(runner):
    emu = runner.device.emu
    check(emu.set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 1, rc=Rc.ERR_DEVICE_UNAVAILABLE), "submit")
    assert runner.submit(D, 0, 0, tokens=[3]) == Rc.ERR_DEVICE_UNAVAILABLE
    assert emu.pending(0)[1] == 0 and emu.counters()["jobs_submitted"] == 0
    check(emu.set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 1), "submit default")
    assert runner.submit(D, 0, 0, tokens=[3]) == Rc.ERR_DEVICE_BUSY
    assert runner.submit(D, 0, 0, tokens=[3]) == 0
    assert runner.finish(D) == JobStatus.DONE


def test_wait_rc_and_kv_after_failed_wait_partial(runner):
    emu = runner.device.emu
    check(emu.set_knob("kv_after_failed_wait", KvPolicy.PARTIAL), "policy")
    check(emu.set_fault(Fault.WAIT_RC, FaultMode.NTH, 1, rc=Rc.ERR_DEVICE_CRASH), "wait")
    tokens = list(range(1, 11))
    assert runner.submit(calbin.PREFILL_IDS, 0, 0, tokens=tokens) == 0
    assert runner.slot(calbin.PREFILL_IDS).outbuf.wait(-1) == Rc.ERR_DEVICE_CRASH
    assert runner.finish(calbin.PREFILL_IDS) == JobStatus.DONE  # the device did run it
    assert runner.kv.seq_len(0) == (0, 5)  # PARTIAL: past + cur / 2
    assert emu.fault_stats(Fault.WAIT_RC) == (0, 2, 1)


@pytest.mark.parametrize("policy,expect_len", [(KvPolicy.UNCHANGED, 4), (KvPolicy.PARTIAL, 7)])
def test_ccu_exception_fault_and_kv_policy(runner, policy, expect_len):
    emu = runner.device.emu
    runner.run(calbin.PREFILL_IDS, 0, 0, tokens=[1, 2, 3, 4])
    check(emu.set_knob("kv_after_failed_wait", policy), "policy")
    check(emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1), "ccu")
    assert runner.submit(calbin.PREFILL_IDS, 0, 4, tokens=[5, 6, 7, 8, 9, 10]) == 0
    assert runner.finish(calbin.PREFILL_IDS) == JobStatus.DONE_CCU_EXCEPTION
    assert runner.slot(calbin.PREFILL_IDS).outbuf.valid_bytes() == (0, 0)
    assert runner.kv.seq_len(0) == (0, expect_len)


def test_kv_policy_unknown_keeps_a_seeded_length_with_corrupted_states(runner):
    emu = runner.device.emu
    check(emu.set_knob("kv_after_failed_wait", KvPolicy.UNKNOWN), "policy")
    tokens = list(range(1, 9))
    lengths = set()
    kept = corrupted = 0
    for _ in range(12):
        check(emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1), "ccu")
        assert runner.submit(calbin.PREFILL_IDS, 0, 0, tokens=tokens) == 0
        assert runner.finish(calbin.PREFILL_IDS) == JobStatus.DONE_CCU_EXCEPTION
        rc, n = runner.kv.seq_len(0)
        assert rc == 0 and 0 <= n <= len(tokens)
        lengths.add(n)
        if n >= 1:  # the state the device kept at n is not the true one
            kept += 1
            row = runner.run(D, 0, n, tokens=[3])
            ref = oracle.OracleSequence(SEED)
            ref.run(tokens[:n])
            corrupted += not np.array_equal(row, ref.decode(3)[0, 0])
            assert runner.kv.apply(0, len(tokens))
    assert len(lengths) > 1  # the committed length is not predictable
    assert kept >= 1 and corrupted == kept


@pytest.mark.parametrize("point,bits", [(Fault.OUTPUT_NAN, 0x7FC0), (Fault.OUTPUT_INF, 0x7F80)])
def test_output_nan_inf_in_the_valid_row(runner, point, bits):
    check(runner.device.emu.set_fault(point, FaultMode.NTH, 1), "fault")
    tokens = list(range(1, 20))  # 19 tokens: valid row 2 of the last tile
    row = runner.run(calbin.PREFILL_IDS, 0, 0, tokens=tokens)
    assert np.count_nonzero(row == bits) == 1
    f = oracle.bf16_to_f32(row)
    assert np.count_nonzero(~np.isfinite(f)) == 1
    good = oracle.OracleSequence(SEED).prefill(tokens, 16)[0, oracle.valid_row(19, 16)]
    assert np.count_nonzero(row != good) == 1


def test_output_short_writes_half_and_reports_valid_bytes(runner):
    check(runner.device.emu.set_fault(Fault.OUTPUT_SHORT, FaultMode.NTH, 1), "short")
    s = runner.slot(D)
    s.logits[...] = 0xFFFF
    row = runner.run(D, 0, 0, tokens=[3])
    rc, valid = s.outbuf.valid_bytes()
    assert rc == 0 and valid == calbin.VOCAB  # half of VOCAB * 2 bytes
    half = calbin.VOCAB // 2
    ref = oracle.OracleSequence(SEED).decode(3)[0, 0]
    assert np.array_equal(row[:half], ref[:half])
    assert (row[half:] == 0xFFFF).all()  # never written by the device


def test_latency_profile_is_bounded_like_the_knobs():
    rc, dev = CalRT.load().open_device("")
    assert rc == 0
    assert dev.emu.set_latency(decode_us=60_000_001) == 4  # beyond the knobs' 60 s range
    assert dev.emu.set_latency(decode_us=60_000_000) == 0
    assert dev.emu.set_latency() == 0 and dev.close() == 0


def test_wait_failure_after_compute_still_applies_the_kv_policy(tmp_path):
    """An injected Wait failure that hits a job between compute and D2H follows
    kv_after_failed_wait like one that hits it earlier (stepped mode pins the moment)."""
    from calexec.drivers.calrt.runtime import Stage
    from calexec.drivers.direct import DirectRunner
    from calexec.drivers.synthetic import calbin as cb
    path = str(tmp_path / "c.calbin")
    cb.write(path, cb.default_spec())
    r = DirectRunner(CalRT.load(), path, "kv_after_failed_wait=unchanged")
    emu = r.device.emu
    r.run(cb.PREFILL_IDS, 1, 0, tokens=[1, 2, 3])
    assert r.kv.seq_len(1) == (0, 3)
    assert emu.set_stepped(True) == 0
    r.submit(cb.DECODE, 1, 3, tokens=[4])
    for stage in (Stage.H2D, Stage.COMPUTE):
        assert emu.step(0, stage)[0] == 0
    assert r.kv.seq_len(1) == (0, 4)  # committed at the end of compute
    assert emu.set_fault(Fault.WAIT_RC, FaultMode.NTH, 1, 0, 0) == 0
    assert r.slot(cb.DECODE).outbuf.wait(0) == Rc.ERR_TIMEOUT
    assert r.kv.seq_len(1) == (0, 3)  # unchanged: back to the job's past_len
    assert emu.set_stepped(False) == 0
    r.close()
