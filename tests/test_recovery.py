"""Recovery and fault control (spec §8, §9, §12): the fault controller applies the §8 table,
the lifecycle chart drives generation+1 rebuilds proved by the golden, model switches roll
back, stale completions never touch the new generation; FI06, FI07, FI08, FI10, FI14; one
scenario per §8 category ending Ready (golden passed) or Failed with the reason; every
declared lifecycle transition reached through the executor."""

from __future__ import annotations

import logging
import re
import shutil
import sys
import threading
import time

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import CalRT, Device, Did, Fault, Stage
from calexec.drivers.synthetic import calbin as cb
from calexec.drivers.synthetic import oracle
from calexec.machines.clock import Clock
from calexec.machines.compiled import LIFECYCLE
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.faults import Action, FaultController, RecoveryPolicy
from calexec.machines.job import InferenceResult
from calexec.machines.pool import BufferPool
from executor_harness import (
    MANIFEST,
    SEED,
    arm,
    deadline,
    decode,
    fired,
    greedy,
    oracle_golden,
    prefill,
    running_executor,
    settle,
    until,
    write_calbin,
)
from test_executor_paths import recording

PROMPT = [7, 7, 8, 9, 10]
OTHER_SEED = SEED ^ 0xABCDEF


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("recovery")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    cb.write(other, cb.default_spec(seed=OTHER_SEED))
    return {"main": main, "other": other, "missing": str(directory / "missing.calbin")}


def wait_state(ex, states, seconds=10.0):
    """Wait for the recovery thread to bring the lifecycle to one of ``states``."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if ex.state in states and not ex.life.recovery_active:
            return ex.state
        time.sleep(0.005)
    raise AssertionError(f"lifecycle stuck in {ex.state} (wanted {states})")


def serves_oracle(ex, seq=1, seed=SEED):
    ref = oracle.OracleSequence(seed)
    ref.run(PROMPT)
    out = greedy(ex, seq, PROMPT, 2)
    want = [ref.next_token()]
    for _ in range(2):
        ref.run([want[-1]])
        want.append(ref.next_token())
    return out == want


def last_action(ex):
    return ex.faults.last().action


@pytest.fixture
def infers(monkeypatch):
    """Every job the device accepted, as the driver saw it: (KvManager, sequence id) of each
    ``Device.infer`` / ``infer_with_fixed_task_type`` call (wrapped by the test)."""
    calls: list[tuple[object, int]] = []
    for name in ("infer", "infer_with_fixed_task_type"):
        real = getattr(Device, name)

        def recorded(self, model, kv, seq, *args, real=real):
            calls.append((kv, seq))  # list.append: atomic
            return real(self, model, kv, seq, *args)

        monkeypatch.setattr(Device, name, recorded)
    return calls


@pytest.fixture
def resets(monkeypatch):
    """Every device reset the driver saw, by kind (``Device.reset``/``reset_ccu`` wrapped by
    the test): a recovery provably reset the device or provably did not, not only what the
    executor's recovery record says. (``reset_configuration`` is not counted: every
    generation's teardown calls it, the inverse of its ``configure``.)"""
    calls: list[str] = []
    for name in ("reset", "reset_ccu"):
        real = getattr(Device, name)

        def recorded(self, *args, real=real, name=name):
            calls.append(name)  # list.append: atomic
            return real(self, *args)

        monkeypatch.setattr(Device, name, recorded)
    return calls


def golden_jobs(ex, infers) -> int:
    """Jobs of the §9.2 golden run the device accepted for the current generation (its own
    KvManager, the golden's sequence): the golden provably ran, not only ``golden_passed``."""
    seq = ex.config.golden_seq_id
    return sum(1 for kv, s in infers if kv is ex.kv and s == seq)


# ---- FI06, FI07, FI08, FI10, FI14 ----------------------------------------------------------------
def test_fi06_submit_unavailable_stops_admission_and_recovers(calbins):
    with running_executor(calbins["main"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=18)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 18 and res.category == Category.DEVICE
        assert last_action(ex) is Action.RESET_REBUILD
        assert wait_state(ex, ("Ready",)) == "Ready"
        assert ex.gen.id == 2 and ex.recoveries[-1]["ok"] and ex.recoveries[-1]["reset"]
        assert serves_oracle(ex)


def test_fi07_wait_timeout_quarantines_without_logits(calbins):
    with running_executor(calbins["main"], "decode_us=30000") as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "WAIT_RC")  # Wait says TIMEOUT while the job still runs on the device
        out = np.full(151936, 5.0, dtype=np.float32)
        res = ex.enqueue(decode(1, 3, len(PROMPT)), logits_out=out).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 13
        assert np.all(out == 5.0)
        assert ex.kvc.seqs[1].unknown_reason == res.code
        assert [s.run.state for s in ex.pool.slots].count("Quarantined") == 1
        # transient: admission reduced, no recovery below the threshold
        assert last_action(ex) is Action.REDUCE_ADMISSION and ex.faults.admission_factor() < 1
        assert wait_state(ex, ("Ready",)) == "Ready" and ex.gen.id == 1


@pytest.mark.parametrize("capacity", [1, 2])
def test_sequence_of_a_job_still_on_the_device_cannot_be_reset_until_it_lets_go(calbins,
                                                                               capacity):
    """FI07 follow-up: Wait failed but the device still runs the job and will still write the
    sequence's KV. Releasing that KV now (reset_sequence) let the late job write it afterwards,
    and the sequence's next job met KV it did not expect: an unexplained CCU exception (found
    by the acceptance injections in Phase B). The reset is refused until the device lets go."""
    with running_executor(calbins["main"], inflight_capacity=capacity,
                          timeout_grace_s=30.0) as ex:
        greedy(ex, 1, PROMPT, 0)
        ex.device.emu.set_latency(0, 0, 1_500_000, 0)  # the next decode runs 1.5 s
        arm(ex, "WAIT_RC")  # Wait says TIMEOUT while the job still runs on the device
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 13
        refused = ex.kvc.reset_sequence(1)
        assert refused.code == "kv.sequence_on_device" and refused.seq_id == 1
        assert refused.category is Category.UNAVAILABLE
        assert ex.kvc.truncate(1, 0).code == "kv.sequence_busy"
        assert ex.kvc.seqs[1].on_device == 1
        # a bounded wait ends when the completion thread sees the device let go
        assert ex.kvc.reset_sequence(1, wait_s=10.0).ok
        assert ex.kvc.seqs[1].on_device == 0
        ex.device.emu.set_latency(0, 0, 0, 0)
        assert serves_oracle(ex)  # a fresh prefill + decodes on seq 1, as the oracle says
        assert ex.device.emu.counters()["ccu_exceptions"] == 0


def test_phase_b_a_job_behind_one_the_device_keeps_is_completed_without_its_grace(calbins):
    """Phase B (found by the explorer's Phase B scenarios): job A hangs on one engine and its
    Wait ends at its execution deadline with the device still holding it; job B, finished on
    the other engine, is the completion thread's next job. It must be delivered then, not
    after A's ``timeout_grace_s`` (the completion thread used to wait that grace in Wait);
    A's permit still comes back only once the device lets go (here: the reset)."""
    # 2 s: A, hung, misses it by far; B and the jobs before have seconds of margin
    with running_executor(calbins["main"], inflight_capacity=2, execution_timeout_s=2.0,
                          timeout_grace_s=30.0,
                          recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        greedy(ex, 1, PROMPT, 0)
        greedy(ex, 2, PROMPT, 0)
        arm(ex, "HANG")  # the next accepted job: A
        a = ex.enqueue(decode(1, 3, len(PROMPT)))
        b = ex.enqueue(decode(2, 3, len(PROMPT)))
        result = b.wait_until(deadline(10.0))
        assert isinstance(result, InferenceResult), result  # not after a 30 s grace
        status = a.wait_until(deadline(10.0))
        assert isinstance(status, Status) and status.code == "execution.deadline", status
        assert ex.snapshot()["inflight"] >= 1 or ex.state != "Ready"  # A's permit kept


def test_execution_timeout_of_a_hung_job_resets_and_rebuilds(calbins):
    policy = RecoveryPolicy(drain_grace_s=0.2)
    # 2 s for the hung decode (it never ends: it misses them by far); a healthy job (the
    # golden run's, the oracle check's decodes) has seconds of margin on a loaded host, and a
    # prefill 50 ms more per token
    with running_executor(calbins["main"], execution_timeout_s=2.0, timeout_grace_s=0.1,
                          execution_timeout_per_token_s=0.05, recovery=policy) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "HANG")
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.code == "execution.deadline"
        assert wait_state(ex, ("Ready",)) == "Ready"
        # §9.1: admission stopped, the buffers kept through the grace, then the reset
        assert ex.recoveries[-1]["reason"] == "execution.deadline" and ex.gen.id == 2
        assert ex.recoveries[-1]["reset_kind"] == "reset"
        assert ex.device.emu.counters()["jobs_aborted"] >= 1
        assert serves_oracle(ex)


@pytest.mark.parametrize("point", ["CCU_EXCEPTION", "OUTPUT_NAN"])  # FI08, FI10
def test_fi08_fi10_device_and_output_faults_rebuild_the_generation(calbins, point, infers):
    with running_executor(calbins["main"]) as ex:
        at_start = golden_jobs(ex, infers)
        assert at_start == 1 + ex.config.golden_decode_steps  # the prefill and each decode
        greedy(ex, 1, PROMPT, 0)
        old_pool: BufferPool = ex.pool
        arm(ex, point)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and fired(ex, point) == 1
        assert wait_state(ex, ("Ready",)) == "Ready"
        assert ex.gen.id == 2 and ex.life.golden_passed()
        # the golden re-ran on generation 2's device state (§9.2, FI10 "golden 复测"): a
        # recovery that went Ready without it passed ``golden_passed`` (stop 59's audit)
        assert golden_jobs(ex, infers) == at_start
        # invariant 8: every old-generation slot was quarantined and retired
        assert all(s.run.state == "Retired" for s in old_pool.slots)
        assert serves_oracle(ex)


def test_fi14_stale_completion_after_reset_never_touches_the_new_generation(calbins):
    # 2 s: the hung job misses it by far; the recovery's golden and the oracle check after
    # it have seconds of margin on a loaded host
    with running_executor(calbins["main"], "stale_delay_us=20000", execution_timeout_s=2.0,
                          timeout_grace_s=0.05, recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "HANG")
        arm(ex, "STALE_COMPLETION")
        stale = ex.enqueue(decode(1, 3, len(PROMPT)))
        res = stale.wait_until(deadline())
        assert isinstance(res, Status)
        old_slot = next(s for s in ex.pool.slots if s.run.state == "Quarantined")
        old_slot.host_output[:] = 0x1234  # a marker: the stale DMA must overwrite it
        assert wait_state(ex, ("Ready",)) == "Ready"
        new_gen = ex.gen
        end = time.monotonic() + 5
        while ex.device.emu.counters()["stale_completions"] < 1 and time.monotonic() < end:
            time.sleep(0.005)
        assert ex.device.emu.counters()["stale_completions"] == 1
        # the stale D2H landed in the old generation's host buffer, kept alive for it
        assert not np.all(old_slot.host_output == 0x1234)
        assert old_slot.generation_id == 1 and new_gen.id == 2
        assert stale.wait_until(deadline()) is res  # resolved once, with its failure
        assert serves_oracle(ex)
        settle(ex)
        assert all(s.run.state == "Free" for s in new_gen.pool.slots)
        assert ex.counters["stale_completions"] == 0  # nothing counted as new-generation work


# ---- one scenario per §8 category ------------------------------------------------------------------
@pytest.mark.parametrize("rc,category,action,end", [
    (14, Category.REQUEST_ARTIFACT, Action.RECORD, "Ready"),
    (16, Category.LIFECYCLE, Action.REBUILD, "Ready"),
    (19, Category.ARTIFACT, Action.ROLLBACK, "Ready"),
    (8, Category.COMPATIBILITY, Action.STOP, "Failed"),
    (18, Category.DEVICE, Action.RESET_REBUILD, "Ready"),
    (27, Category.PROGRAMMING, Action.DISABLE_FEATURE, "Ready"),
    (20, Category.UNKNOWN, Action.RESET_REBUILD, "Ready"),
    (26, Category.UNKNOWN, Action.RESET_REBUILD, "Ready"),
])
def test_each_category_ends_ready_with_golden_or_failed_with_reason(calbins, rc, category,
                                                                    action, end, infers,
                                                                    resets):
    with running_executor(calbins["main"]) as ex:
        at_start = golden_jobs(ex, infers)
        resets_at_start = len(resets)
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=rc)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == rc and res.category == category
        assert last_action(ex) is action
        assert wait_state(ex, (end,)) == end
        # §8: only the Device row (and Unknown, "treated as a tainted device generation")
        # resets the device, once, with the policy's reset; "no reset" for the request/
        # artifact and programming rows, and none for a drain and rebuild, a rollback or a
        # stop (counted at the driver)
        assert resets[resets_at_start:] == (["reset"] if action is Action.RESET_REBUILD
                                            else []), resets
        if end == "Ready":
            assert ex.life.golden_passed()
            rebuilt = action not in (Action.RECORD, Action.DISABLE_FEATURE)
            assert ex.gen.id == (2 if rebuilt else 1)
            # a rebuilt generation ran its own golden on the device (§8 "each ending Ready
            # (golden)"); one not rebuilt keeps generation 1's
            assert golden_jobs(ex, infers) == at_start > 0
            assert serves_oracle(ex, seq=2)
        else:
            assert ex.failure is not None and ex.failure.raw == rc
            refused = ex.enqueue(prefill(2, PROMPT)).wait_until(deadline())
            assert isinstance(refused, Status) and refused.http_status == 503
    if action is Action.RECORD:
        assert list(ex.faults.manifest_differences)[-1].raw == rc
    if action is Action.DISABLE_FEATURE:
        assert "submit" in ex.faults.disabled_features


def test_a_transient_fault_reduces_the_executors_admission_budget(calbins):
    """§8 Transient row, column "new admission": reduced. A busy/timeout fault below the
    threshold halves (``reduced_admission``) the token budget the executor admits against:
    a 20-token prefill admitted before it is refused RESOURCE_EXHAUSTED (429) naming the
    reduced budget, a 16-token one still served. (``test_fi07_*`` only read the controller's
    ``admission_factor()``: admission could ignore it and no test failed.)"""
    policy = RecoveryPolicy(submit_retries=0, transient_window_s=3600.0)
    twenty = [7 + (i % 9) for i in range(20)]
    with running_executor(calbins["main"], recovery=policy, max_pending_tokens=32) as ex:
        before = ex.enqueue(prefill(2, twenty)).wait_until(deadline())
        assert not isinstance(before, Status), before
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=17)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 17 and res.category == Category.TRANSIENT
        assert last_action(ex) is Action.REDUCE_ADMISSION and ex.state == "Ready"
        refused = ex.enqueue(prefill(2, twenty)).wait_until(deadline())
        assert isinstance(refused, Status) and refused.category is Category.RESOURCE_EXHAUSTED
        assert refused.http_status == 429 and "> 16 (max_pending_tokens=32" in refused.message
        served = ex.enqueue(prefill(2, twenty[:16])).wait_until(deadline())
        assert not isinstance(served, Status), served
        assert ex.gen.id == 1  # below the threshold: no recovery


def test_an_artifact_fault_rolls_back_to_the_last_known_good_other_calbin(calbins, resets):
    """§8 Artifact row (4, 5, 19, 10-12): refuse the generation and roll back to the last
    known good model. After a switch from ``main`` to ``other`` (both passed their golden),
    an invalid-calbin fault on ``other`` brings ``main`` back as generation 3, golden first,
    no reset; it serves ``main``'s oracle. (The one-scenario-per-category test runs on the
    only calbin it started with, where a rollback and a rebuild of the same calbin look the
    same: the rollback target was never checked.)"""
    path = calbins["other"] + ".rollback"
    other_sha = cb.write(path, cb.default_spec(seed=OTHER_SEED))
    with running_executor(calbins["main"], goldens={other_sha: oracle_golden(OTHER_SEED)}) as ex:
        assert ex.switch_model(path).ok and ex.gen.calbin_path == path and ex.gen.id == 2
        assert serves_oracle(ex, seq=2, seed=OTHER_SEED)
        resets_before = len(resets)
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=19)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 19 and res.category == Category.ARTIFACT
        assert last_action(ex) is Action.ROLLBACK
        assert wait_state(ex, ("Ready",)) == "Ready"
        assert ex.gen.id == 3 and ex.gen.calbin_path == calbins["main"], ex.gen.calbin_path
        assert ex.life.golden_passed() and resets[resets_before:] == []
        assert serves_oracle(ex, seq=2, seed=SEED)


def test_submit_busy_retries_sleep_a_bounded_exponential_backoff(calbins, monkeypatch):
    """§8 Transient row, automatic action "bounded backoff": each retry of a busy ``infer()``
    is preceded by a sleep of ``backoff_base_s * 2**(attempt-1)`` capped at
    ``backoff_max_s`` (no jitter here: exact), then the job fails TRANSIENT after
    ``submit_retries``. The sleeps are read where the submitter takes them (the clock's
    ``sleep`` called from ``_after_infer``): a retry without a pause, or a backoff growing
    past its cap, failed no test (the retry test counted retries only)."""
    policy = RecoveryPolicy(submit_retries=4, backoff_base_s=0.001, backoff_max_s=0.004,
                            jitter=0.0)
    with running_executor(calbins["main"], recovery=policy) as ex:
        greedy(ex, 1, PROMPT, 0)
        slept: list[float] = []
        real = type(ex.clock).sleep

        def recorded(self, seconds, *args, **kwargs):
            if sys._getframe(1).f_code.co_name == "_after_infer":
                slept.append(seconds)
            return real(self, seconds, *args, **kwargs)

        monkeypatch.setattr(type(ex.clock), "sleep", recorded)
        arm(ex, "SUBMIT_RC", "ALWAYS", rc=17)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert ex.device.emu.clear_fault(Fault.SUBMIT_RC) == 0
        monkeypatch.undo()
        assert isinstance(res, Status) and res.raw == 17 and res.category == Category.TRANSIENT
        assert slept == [0.001, 0.002, 0.004, 0.004], slept


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_the_backoff_is_exponential_capped_and_jittered_within_its_fraction(seed):
    """``FaultController.backoff``: attempt n waits ``min(max, base * 2**(n-1))`` times a
    factor in ``[1 - jitter, 1 + jitter]`` (seeded), never negative, never past the cap
    plus its jitter."""
    policy = RecoveryPolicy(backoff_base_s=0.001, backoff_max_s=0.02, jitter=0.5)
    controller = FaultController(policy, seed=seed)
    for attempt in range(1, 12):
        nominal = min(0.02, 0.001 * 2 ** (attempt - 1))
        got = controller.backoff(attempt)
        assert 0.5 * nominal <= got <= 1.5 * nominal, (attempt, got)


@pytest.mark.parametrize(("rc", "action", "words"), [
    (14, "record", "a manifest difference: the runtime refused what the manifest's checks passed"),
    (17, "reduce_admission", "transient: calrt.submit_failed"),
])
def test_a_fault_that_only_records_or_reduces_admission_still_has_its_log_line(
        calbins, caplog, rc, action, words):
    """§8: the request/artifact row "records the manifest difference", the transient row
    reduces admission; neither drains nor resets, and neither wrote a line (the record was a
    Python deque no operator reads): a ``calexec serve`` whose runtime refused a shape or a
    bound gave its client a 500 and its log nothing. Each is the controller's one WARNING
    fault line now (docs/operations.md), with the raw code and the action."""
    caplog.set_level(logging.WARNING, logger="calexec.faults")
    with running_executor(calbins["main"], recovery=RecoveryPolicy(submit_retries=0)) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=rc)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == rc
        assert last_action(ex).value == action and ex.state == "Ready" and ex.gen.id == 1
        lines = [r.getMessage() for r in caplog.records if r.name == "calexec.faults"]
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith(f"INJECTED fault calrt.submit_failed [{res.category.value}/submit]")
    for part in (f"job_id={res.job_id}", "seq_id=1", f"raw={rc})", f"-> {action} (", words):
        assert part in line, (part, line)


def test_transient_faults_past_the_threshold_drain_and_rebuild(calbins):
    policy = RecoveryPolicy(transient_threshold=3, submit_retries=0)
    with running_executor(calbins["main"], recovery=policy) as ex:
        greedy(ex, 1, PROMPT, 0)
        for _ in range(3):
            # armed once per job: the rebuild's own golden jobs must not meet the fault (with
            # ALWAYS, clearing it after the third failure raced the recovery thread's golden)
            arm(ex, "SUBMIT_RC", "NTH", 1, rc=17)
            res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
            assert isinstance(res, Status) and res.raw == 17
            if ex.state != "Ready":
                break
        assert last_action(ex) is Action.REBUILD
        assert wait_state(ex, ("Ready",)) == "Ready" and ex.gen.id == 2


def test_escalation_past_max_recoveries_ends_failed(calbins):
    policy = RecoveryPolicy(max_recoveries=2)
    with running_executor(calbins["main"], recovery=policy) as ex:
        for _attempt in range(3):
            greedy(ex, 1, PROMPT, 0)
            arm(ex, "CCU_EXCEPTION")
            ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
            state = wait_state(ex, ("Ready", "Failed"))
        assert state == "Failed" and "escalation" in ex.faults.last().reason


def test_one_hung_job_spends_one_recovery_of_the_escalation_budget(calbins):
    """``max_recoveries=2``: two hung jobs are two recoveries (Ready again each time), the
    third escalates to Failed. A hung job is reported twice, ``execution.deadline`` at its
    deadline and ``device.hung`` after ``timeout_grace_s`` while its recovery drains, and
    both counted as recoveries: the second hung job ended the lifecycle Failed after one
    recovery (``max_recoveries=5``: Failed at the third hung job, after two). The second
    report now belongs to the recovery under way: not counted, no escalation."""
    policy = RecoveryPolicy(drain_grace_s=1.0, max_recoveries=2)
    # the execution deadline is only a bound for the golden jobs (a hung job misses any):
    # 1.5 s was passed by a recovery's golden job on a loaded host (load 11-15), which
    # failed the recovery; 5 s costs each hung job's wait 3.5 s more
    with running_executor(calbins["main"], recovery=policy, execution_timeout_s=5.0,
                          timeout_grace_s=0.05) as ex:
        states = []
        for _incident in range(3):
            arm(ex, "HANG")
            status = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
            assert isinstance(status, Status) and status.code == "execution.deadline", status
            states.append((wait_state(ex, ("Ready", "Failed")), len(ex.recoveries)))
        assert states == [("Ready", 1), ("Ready", 2), ("Failed", 2)], states
        stops = [d for d in ex.faults.decisions if d.action is Action.STOP]
        assert len(stops) == 1 and "escalation" in stops[0].reason, stops
        assert stops[0].status.code == "execution.deadline", stops
        hung = [d for d in ex.faults.decisions if d.status.code == "device.hung"]
        assert all("not counted" in d.reason for d in hung), [d.reason for d in hung]


@pytest.mark.parametrize("max_recoveries", [0, 1])
def test_a_recovery_the_fault_controller_escalates_meanwhile_answers_a_status(calbins,
                                                                             max_recoveries):
    """A device that stops finishing jobs (the emulator in stepped mode, never stepped): the
    recovery's golden job times out; tearing its generation down resets the device, which
    aborts that job (``recovery.job_aborted``: a knock-on, nothing to act on), and a device
    fault reported meanwhile (here beside that report; until stop 55 it was the aborted job's own
    ``device.status_not_done``) makes the fault controller, past ``max_recoveries``, end the
    lifecycle Failed while the recovery works outside the lifecycle's lock. Its next step
    raised IllegalTransition out of ``recover()`` ("event 'roll_back' is not allowed in state
    'Failed'"); it answers the failure that ended the lifecycle, and the executor still shuts
    down."""
    policy = RecoveryPolicy(max_recoveries=max_recoveries, drain_grace_s=0.3)
    # 2 s: the recovery's golden (never stepped) misses it by far; the start's has the margin
    with running_executor(calbins["main"], recovery=policy, golden_timeout_s=2.0,
                          execution_timeout_s=60.0, timeout_grace_s=60.0) as ex:
        report = ex.faults.report
        meanwhile = Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                                   "another job's fault, reported meanwhile")

        def also_a_device_fault(status, job=None):
            report(status, job)
            if status.code == "recovery.job_aborted":
                report(meanwhile)

        ex.faults.report = also_a_device_fault
        assert ex.device.emu.set_stepped(True) == 0
        status = ex.recover(Status.failure("device.ccu_exception", Category.DEVICE,
                                           Phase.RECOVERY, "the test's reason"))
        assert status == meanwhile, status
        assert ex.state == "Failed" and ex.failure is not None
        assert "escalation" in ex.faults.last().reason
        assert ex.recoveries[-1]["ok"] is False and ex.recoveries[-1]["lifecycle"] == "Failed"
        assert not ex.shutdown(2.0).ok  # Failed stays Failed; no exception either


def test_no_safe_reset_ends_failed_for_the_supervisor(calbins):
    policy = RecoveryPolicy(reset_kind="none", drain_grace_s=0.2)
    with running_executor(calbins["main"], recovery=policy, execution_timeout_s=2.0,
                          timeout_grace_s=0.05) as ex:  # the hung job misses it by far
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "HANG")
        ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert wait_state(ex, ("Failed",)) == "Failed"
        assert ex.failure.code == "recovery.not_drained"
        assert "supervisor" in ex.failure.message


def test_device_fault_without_a_safe_reset_fails_from_recovering(calbins):
    policy = RecoveryPolicy(reset_kind="none")
    with running_executor(calbins["main"], recovery=policy) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "CCU_EXCEPTION")
        ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert wait_state(ex, ("Failed",)) == "Failed"
        assert ex.failure.code == "recovery.no_safe_reset"


@pytest.mark.parametrize(("field", "value", "error"), [
    ("drain_grace_s", float("nan"), ValueError), ("drain_grace_s", -1.0, ValueError),
    ("drain_grace_s", "5", TypeError), ("recovery_window_s", 0, ValueError),
    ("recovery_window_s", float("inf"), ValueError), ("max_recoveries", -1, ValueError),
    ("max_recoveries", 2.5, TypeError), ("transient_threshold", 0, ValueError),
    ("transient_window_s", float("nan"), ValueError), ("reduced_admission", 0.0, ValueError),
    ("reduced_admission", 1.5, ValueError), ("submit_retries", -1, ValueError),
    ("backoff_base_s", float("inf"), ValueError), ("backoff_max_s", -0.1, ValueError),
    ("jitter", 2.0, ValueError), ("jitter", True, TypeError),
])
def test_a_recovery_policy_that_is_nonsense_is_refused_naming_the_field(field, value, error):
    """``RecoveryPolicy`` took any value (found at stop 50 by an embedder tuning recovery): a
    NaN ``drain_grace_s`` or window compares false with every time, so a drain never ends
    or a window never holds a fault; ``reduced_admission=0`` admits nothing after one
    transient fault; a str failed deep in the first recovery. Refused when built, naming the
    field and its value."""
    with pytest.raises(error, match=rf"^RecoveryPolicy\.{field}={re.escape(repr(value))}: "):
        RecoveryPolicy(**{field: value})


# ---- model switch (§9.2) ------------------------------------------------------------------------------
def test_model_switch_goes_live_after_its_golden(calbins):
    other_sha = cb.write(calbins["other"], cb.default_spec(seed=OTHER_SEED))
    with running_executor(calbins["main"], goldens={other_sha: oracle_golden(OTHER_SEED)}) as ex:
        assert ex.switch_model(calbins["other"]).ok
        assert ex.state == "Ready" and ex.gen.id == 2 and ex.gen.calbin_path == calbins["other"]
        assert serves_oracle(ex, seed=OTHER_SEED)
        assert ex.life.good_calbins == [calbins["main"], calbins["other"]]


def test_failed_switch_keeps_the_previous_model_serving(calbins):
    with running_executor(calbins["main"]) as ex:
        other_sha = cb.write(calbins["other"] + ".copy", cb.default_spec(seed=OTHER_SEED))
        ex.goldens[other_sha] = (1, 2, 3)  # a recorded golden the new model cannot meet
        status = ex.switch_model(calbins["other"] + ".copy")
        assert status.code == "recovery.rolled_back" and "golden.mismatch" in status.message
        assert ex.state == "Ready" and ex.gen.calbin_path == calbins["main"]
        assert serves_oracle(ex)
        status = ex.switch_model(calbins["missing"])  # cannot even load: rolled back too
        assert status.code == "recovery.rolled_back" and ex.state == "Ready"
        assert serves_oracle(ex)


def test_a_switch_to_something_not_a_path_is_refused_before_the_lifecycle_moves(calbins):
    """``switch_model(5)`` (or None, a typo'd variable) drained the executor, tore its
    generation down and then raised ``TypeError: expected str, bytes or os.PathLike object``
    from the open of generation 2: the executor stayed ``Configuring`` with no generation,
    refusing every request for good (found at stop 50 by an embedder). It is refused
    ``calbin.path_required`` (400) at once: the same generation serves on."""
    with running_executor(calbins["main"]) as ex:
        for bad in (5, None, b"main.calbin"):
            status = ex.switch_model(bad)
            assert status.code == "calbin.path_required", (bad, status)
            assert status.category is Category.INVALID_REQUEST and repr(bad) in status.message
            assert ex.state == "Ready" and ex.gen.id == 1 and ex.recoveries == []
        assert serves_oracle(ex)


class _WaitsRecorded(Clock):
    """The system clock, recording the deadline each wait of the thread ``on`` was given
    (sleeps, condition and event waits, thread joins): what a bounded call promised.

    A deadline is the thread's last reading of this clock plus the timeout: a timeout the
    code computed as ``deadline - monotonic()`` then records that very deadline, however long
    the host kept the thread from the wait meanwhile (it recorded ``monotonic() + timeout``
    at the wait: once a preemption between the two on a loaded host put a deadline 34 ms
    past the grace). ``first`` is the thread's first reading (a call's own start)."""

    __slots__ = ("on", "deadlines", "first", "_read")

    def __init__(self) -> None:
        self.on: threading.Thread | None = None
        self.deadlines: list[float] = []
        self.first: float | None = None
        self._read: float | None = None

    def monotonic(self) -> float:
        now = super().monotonic()
        if threading.current_thread() is self.on:
            if self.first is None:
                self.first = now
            self._read = now
        return now

    def _given(self, timeout: float | None) -> None:
        if threading.current_thread() is self.on and timeout is not None:
            read = self._read if self._read is not None else self.monotonic()
            self.deadlines.append(read + timeout)

    def sleep(self, seconds):
        self._given(seconds)
        super().sleep(seconds)

    def wait(self, cond, timeout):
        self._given(timeout)
        return super().wait(cond, timeout)

    def wait_event(self, event, timeout):
        self._given(timeout)
        return super().wait_event(event, timeout)

    def join(self, thread, timeout):
        self._given(timeout)
        return super().join(thread, timeout)


def test_a_shutdown_that_meets_a_recovery_and_a_hung_job_waits_within_its_grace(calbins):
    """``shutdown(2.0)`` while a recovery warms up with its golden job hung on the device
    (no safe reset): the shutdown waits for the recovery (half its grace), then drained the
    hung job for the whole grace again and joined the completion thread, stuck in that
    Wait(), 5 s more: 7 s for a grace of 2. Every wait it makes now comes out of the one
    grace: no deadline it gives a wait lies past ``start + grace`` (the drain's 2 ms poll
    aside). Deadlines, not durations: a slow host cannot fail it."""
    clock = _WaitsRecorded()
    policy = RecoveryPolicy(reset_kind="none", drain_grace_s=0.2)
    # golden 5 s: the start's golden has the margin, and the recovery's (never stepped) is
    # still on the device when the shutdown comes, however slow the host (a shutdown ends a
    # golden wait at once: the test is no longer for it)
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(
        calbin_path=calbins["main"], golden_timeout_s=5.0, execution_timeout_s=60.0,
        timeout_grace_s=60.0, recovery=policy), clock=clock)
    assert ex.start().ok
    try:
        assert ex.device.emu.set_stepped(True) == 0  # the device finishes nothing from now
        out: list[Status] = []
        recovery = threading.Thread(target=lambda: out.append(ex.recover(Status.failure(
            "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "the test's reason"),
            reset=False)), daemon=True)
        recovery.start()
        until(lambda: ex.state == "Warming" and ex.snapshot()["inflight"] == 1, 20,
              "the golden job on the device")
        clock.on = threading.current_thread()
        status = ex.shutdown(2.0)
        clock.on = None
        assert not status.ok and ex.state == "Failed", (status, ex.state)
        assert clock.deadlines, "the shutdown made no wait through its clock"
        # the shutdown's own start: its first reading of the clock (the test's reading
        # before the call lay before it by however long the host delayed the call)
        start = clock.first
        assert start is not None
        late = [round(d - start, 3) for d in clock.deadlines if d > start + 2.0 + 0.01]
        assert not late, (f"{len(late)} waits given deadlines past the grace (s after the "
                          f"call; the first, the last): {late[:3]}, {late[-1:]}")
        recovery.join(20)
        assert out and not out[0].ok
    finally:
        ex.device.emu.set_stepped(False)


class SteppedRuntime:
    """The bundled runtime whose devices finish nothing from their open (stepped mode; also
    used by test_faults_probe55.py)."""

    def __init__(self, runtime: CalRT) -> None:
        self._runtime = runtime

    def open_device(self, config):
        rc, device = self._runtime.open_device(config)
        if rc == 0:
            assert device.emu.set_stepped(True) == 0
        return rc, device

    def __getattr__(self, name):
        return getattr(self._runtime, name)


class _JoinsRecorded(_WaitsRecorded):
    """``_WaitsRecorded``, also keeping the timeout of each thread join of the thread ``on``."""

    __slots__ = ("joins",)

    def __init__(self) -> None:
        super().__init__()
        self.joins: list[float] = []

    def join(self, thread, timeout):
        if threading.current_thread() is self.on and timeout is not None:
            self.joins.append(timeout)
        return super().join(thread, timeout)


def test_a_start_whose_golden_job_the_device_holds_waits_for_no_thread_it_cannot_join(calbins):
    """A start whose golden job the device never finishes, with no safe reset: the golden
    times out, the refused generation is kept (its job still on the device) and the start
    ends Failed. It then waited the default 5 s to join the completion thread, which is in
    that job's Wait() until the device answers (here 60 s): a ``shutdown`` waiting for the
    start meanwhile answered ``shutdown.start_busy``. Drained, the idle threads get
    ``THREADS_EXIT_S``; with a job left on the device no join waits at all. The job ends
    late, and a shutdown then tears the kept generation down and closes the device."""
    clock = _JoinsRecorded()
    clock.on = threading.current_thread()
    policy = RecoveryPolicy(reset_kind="none", drain_grace_s=0.2)
    ex = DeviceExecutor(SteppedRuntime(CalRT.load()), MANIFEST, ExecutorConfig(
        calbin_path=calbins["main"], golden_timeout_s=0.3, execution_timeout_s=60.0,
        timeout_grace_s=60.0, recovery=policy), clock=clock)
    status = ex.start()
    clock.on = None
    emu = ex.device.emu
    try:
        assert not status.ok and ex.state == "Failed", status
        assert [gen.released for gen in ex.life.retired] == [False]  # its job on the device
        assert clock.joins, "the start joined no thread"
        assert max(clock.joins) <= 0.0, f"the start waited {max(clock.joins):.2f}s for a thread"
        assert emu.step(0, Stage.JOB) == (0, Did.SIGNAL)  # the device lets go, late
        until(lambda: ex.snapshot()["completing"] == 0, 20, "the late golden job completed")
        assert ex.shutdown(5.0).code == status.code
        assert [gen.released for gen in ex.life.retired] in ([], [True])
        assert emu.counters() == {}, "the device was never closed"
    finally:
        emu.set_stepped(False)


def test_a_recovery_a_shutdown_stopped_with_its_golden_job_on_the_device_says_so(calbins):
    """A shutdown interrupts a recovery whose golden job the device holds (stepped, never
    stepped): the golden run ends (since stop 55 at the interrupt, no longer at its timeout),
    nothing can drain, and the lifecycle ends Failed, as documented. Its failure (what
    ``calexec serve`` prints as it exits 3) read
    ``wait.deadline`` "wait_until deadline passed; the job continues", a DEADLINE that named
    no shutdown; it now says the shutdown stopped the recovery with its golden job on the
    device (``lifecycle.unavailable``, the golden's own Status in the message), as an
    interrupted start says."""
    with running_executor(calbins["main"], recovery=RecoveryPolicy(drain_grace_s=0.2),
                          golden_timeout_s=3.0, execution_timeout_s=60.0,
                          timeout_grace_s=60.0) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        out: list[Status] = []
        recovery = threading.Thread(target=lambda: out.append(ex.recover(Status.failure(
            "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "the test's reason"),
            reset=False)), daemon=True)
        try:
            recovery.start()
            until(lambda: ex.state == "Warming" and ex.snapshot()["inflight"] == 1, 20,
                  "the golden job on the device")
            ex.shutdown(2.0)  # interrupts the recovery halfway, before its golden times out
            recovery.join(20)
            assert out and ex.state == "Failed", (out, ex.state)
            for status in (out[0], ex.failure):
                assert status.code == "lifecycle.unavailable", status
                assert "stopped by shutdown()" in status.message, status
                assert "the golden run was stopped by shutdown()" in status.message, status
        finally:
            emu.set_stepped(False)


def _refused_with_its_golden_job_on_the_device(ex):
    """A recovery whose golden job the device holds (stepped, never stepped) with no safe
    reset: the refused generation is kept, never released, and the lifecycle ends Failed
    (``recovery.generation_on_device``). Returns that generation."""
    assert ex.device.emu.set_stepped(True) == 0
    status = ex.recover(Status.failure("lifecycle.test", Category.LIFECYCLE, Phase.RECOVERY,
                                       "the test's reason"), reset=False)
    assert status.code == "recovery.generation_on_device", status
    assert ex.state == "Failed" and ex.gen is None
    kept = [gen for gen in ex.life.retired if not gen.released]
    assert [gen.id for gen in kept] == [2], ex.life.retired
    return kept[0]


def _finish_the_job_on_the_device(ex):
    assert ex.device.emu.step(0, Stage.JOB) == (0, Did.SIGNAL)
    until(lambda: ex.snapshot()["completing"] == 0
          and ex.snapshot()["dispatch"]["held_by_runtime"] == 0, 20,
          "the late job completed")


def test_a_generation_kept_for_its_golden_job_is_torn_down_once_the_device_let_go(calbins):
    """A generation refused while its golden job was on the device (no safe reset) is kept
    mapped and the lifecycle ends Failed, as §9.1 asks. A ``shutdown`` while the job is still
    there keeps everything; the job then ends late, and its completion counts as a stale
    completion (its generation is no longer the current one), never as a success; a
    ``shutdown`` after that tore down nothing either: the generation stayed mapped and the
    device open (its engine threads running), however often it was called. It now releases
    the generation and closes the device once the drain finds nothing on it."""
    policy = RecoveryPolicy(reset_kind="none", drain_grace_s=0.2)
    # golden 2 s: the recovery's (never stepped) misses it by far; the start's has the margin
    with running_executor(calbins["main"], recovery=policy, golden_timeout_s=2.0,
                          execution_timeout_s=60.0, timeout_grace_s=60.0) as ex:
        emu = ex.device.emu
        kept = _refused_with_its_golden_job_on_the_device(ex)
        before = dict(ex.counters)
        status = ex.shutdown(0.3)  # the golden job still on the device: nothing released
        assert status.code == "recovery.generation_on_device" and ex.state == "Failed"
        assert not kept.released and emu.counters(), "released while the device held a job"
        _finish_the_job_on_the_device(ex)
        late = {k: ex.counters[k] - before[k] for k in ("succeeded", "stale_completions")}
        assert late == {"succeeded": 0, "stale_completions": 1}, late
        status = ex.shutdown(0.3)
        assert status.code == "recovery.generation_on_device" and ex.state == "Failed"
        assert kept.released, "the kept generation was never torn down"
        assert emu.counters() == {}, "the device was never closed"
        assert ex.shutdown(0.3).code == "recovery.generation_on_device"  # idempotent


def test_a_late_fault_of_a_retired_generation_reports_no_exhausted_pool(calbins):
    """The golden job of a generation refused while it ran (no safe reset: Failed) ends late
    with a NaN row: its own fault is reported; ``pool.exhausted`` is not (its generation,
    one slot per kind, is no longer the one serving: no rebuild is asked for it)."""
    policy = RecoveryPolicy(reset_kind="none", drain_grace_s=0.2)
    # golden 2 s: the recovery's (never stepped) misses it by far; the start's has the margin
    with running_executor(calbins["main"], recovery=policy, golden_timeout_s=2.0,
                          execution_timeout_s=60.0, timeout_grace_s=60.0,
                          slots_per_kind=1) as ex:
        arm(ex, "OUTPUT_NAN")  # the next job the device accepts: the golden's first
        _refused_with_its_golden_job_on_the_device(ex)
        _finish_the_job_on_the_device(ex)
        codes = [decision.status.code for decision in ex.faults.decisions]
        assert codes == ["internal.output_not_finite"], codes


def test_check_calbin_takes_a_pathlib_path_as_switch_model_does(calbins):
    """``check_calbin`` answers whether ``switch_model`` can start, and ``switch_model`` takes
    a ``pathlib.Path``; ``check_calbin(Path(p))`` refused it ``calbin.path_required`` ("a
    non-empty string is required"), so an embedder's pre-check refused what the switch
    itself would have taken. Bad values are still refused as before."""
    import pathlib

    other_sha = cb.write(calbins["other"], cb.default_spec(seed=OTHER_SEED))
    with running_executor(calbins["main"], goldens={other_sha: oracle_golden(OTHER_SEED)}) as ex:
        assert ex.check_calbin(pathlib.Path(calbins["other"])).ok
        assert ex.check_calbin(pathlib.Path(calbins["missing"])).code == "calbin.not_found"
        for bad in (5, None, b"main.calbin", ""):
            assert ex.check_calbin(bad).code == "calbin.path_required", bad
        assert ex.switch_model(pathlib.Path(calbins["other"])).ok
        assert ex.gen.calbin_path == calbins["other"]


def test_requests_during_recovery_get_unavailable_not_dropped(calbins):
    with running_executor(calbins["main"], "decode_us=20000",
                          recovery=RecoveryPolicy(drain_grace_s=1.0)) as ex:
        greedy(ex, 1, PROMPT, 0)
        greedy(ex, 2, PROMPT, 0)
        arm(ex, "CCU_EXCEPTION")
        faulted = ex.enqueue(decode(1, 3, len(PROMPT)))
        queued = ex.enqueue(decode(2, 3, len(PROMPT)))  # waits for the in-flight permit
        assert isinstance(faulted.wait_until(deadline()), Status)
        refused = queued.wait_until(deadline())
        assert isinstance(refused, Status) and refused.category == Category.UNAVAILABLE
        assert refused.http_status == 503  # the client retries after Retry-After
        assert wait_state(ex, ("Ready",)) == "Ready"
        assert serves_oracle(ex, seq=2)  # the same request succeeds on generation 2


# ---- the lifecycle chart, transition by transition, through the executor --------------------------------
def lifecycle_scenarios(calbins):
    # start (configured, warmed), drain/recover/reconfigure via a device fault, stop
    with running_executor(calbins["main"]) as ex:
        arm(ex, "CCU_EXCEPTION")
        greedy_failure = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert isinstance(greedy_failure, Status)
        wait_state(ex, ("Ready",))
        # roll_back from Warming (golden refused) and from Configuring (load failed)
        sha = cb.write(calbins["other"] + ".bad", cb.default_spec(seed=OTHER_SEED))
        ex.goldens[sha] = (0,)
        ex.switch_model(calbins["other"] + ".bad")
        ex.switch_model(calbins["missing"])
    # a switch whose rollback fails too ends Failed with the reason (§9.2): the last good
    # calbin was written over in place, and there is nothing left to roll back to (removed,
    # or a new file renamed over it, the file that served is held open and restored: stop 73);
    # since stop 75 such a switch is refused before anything moves unless without_rollback
    with running_executor(calbins["main"]) as ex:
        copy = calbins["main"] + ".copy"
        shutil.copyfile(calbins["main"], copy)
        assert ex.switch_model(copy).ok
        with open(copy, "wb") as f:  # (the same file: its bytes are gone)
            f.write(b"not a calbin any more\n")
        status = ex.switch_model(calbins["missing"])
        assert status.code == "calbin.rollback_changed" and ex.state == "Ready", status
        status = ex.switch_model(calbins["missing"], without_rollback=True)
        assert not status.ok and ex.state == "Failed", (status, ex.state)
    # Ready -> Failed (compatibility)
    with running_executor(calbins["main"]) as ex:
        arm(ex, "SUBMIT_RC", rc=9)
        ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        wait_state(ex, ("Failed",))
    # Draining -> Failed (hung device, no safe reset)
    test_no_safe_reset_ends_failed_for_the_supervisor(calbins)
    # Recovering -> Failed (device fault, no safe reset)
    test_device_fault_without_a_safe_reset_fails_from_recovering(calbins)
    # Configuring -> Failed (FI01 at start: one character changed in the manifest)
    import attrs

    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    manifest = load_manifest(default_manifest_path())
    bad = attrs.evolve(manifest, submodels={
        kind: attrs.evolve(s, exact_name=s.exact_name.replace("decode", "dekode"))
        for kind, s in manifest.submodels.items()})
    ex = DeviceExecutor(CalRT.load(), bad, ExecutorConfig(calbin_path=calbins["main"]))
    status = ex.start()
    assert not status.ok and ex.state == "Failed" and "dekode" in status.message
    # Warming -> Failed (no pinned golden for this calbin, allow_unpinned_golden not set)
    ex = DeviceExecutor(CalRT.load(), manifest, ExecutorConfig(calbin_path=calbins["other"]))
    status = ex.start()
    assert status.code == "golden.unpinned" and ex.state == "Failed"
    # Configuring -> Stopped (shutdown before start: nothing was opened)
    ex = DeviceExecutor(CalRT.load(), manifest, ExecutorConfig(calbin_path=calbins["main"]))
    assert ex.shutdown(grace=1.0).ok and ex.state == "Stopped"
    # Warming -> Stopped (a shutdown stops a recovery's golden run, here waiting for KV:
    # with no retry of a refusal, one refusal leaves it waiting for a release)
    with running_executor(calbins["main"],
                          recovery=RecoveryPolicy(kv_refusal_retries=0)) as ex:
        arm(ex, "CCU_EXCEPTION")
        arm(ex, "CAN_ALLOCATE_FALSE", param=2)  # the request's reserve, then the golden's
        assert isinstance(ex.enqueue(prefill(1, PROMPT)).wait_until(deadline()), Status)
        until(lambda: ex.state == "Warming" and ex.kvc is not None and ex.kvc.waiting == 1,
              what="the recovery's golden waiting for KV")
        assert ex.shutdown(grace=1.0).ok and ex.state == "Stopped"
    # Recovering -> Stopped (a shutdown began once a switch tore the old generation down)
    from lifecycle_hooks import shutdown_at_a_refused_configure, shutdown_once_torn_down
    other_sha = cb.write(calbins["other"], cb.default_spec(seed=OTHER_SEED))
    shutdown_once_torn_down(calbins["main"], calbins["other"],
                            {other_sha: oracle_golden(OTHER_SEED)}, "switch_model")
    # Configuring -> Stopped (a shutdown began at the switch's refused configure)
    garbage = calbins["main"] + ".garbage"
    with open(garbage, "wb") as out:
        out.write(b"not a calbin" * 64)
    shutdown_at_a_refused_configure(calbins["main"], garbage)
    # ... but Warming -> Failed when the stopped golden's job is still on the device (hung)
    # golden 5 s: the start's has the margin, and the recovery's (hung) is still on the
    # device when the shutdown comes, however slow the host (the shutdown ends its wait)
    with running_executor(calbins["main"], golden_timeout_s=5.0) as ex:
        arm(ex, "HANG")
        recovery = threading.Thread(target=ex.recover, args=(Status.failure(
            "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "a fault"),), daemon=True)
        recovery.start()
        until(lambda: ex.state == "Warming" and ex.snapshot()["inflight"] == 1,
              what="the recovery's golden prefill on the device")
        assert not ex.shutdown(grace=0.2).ok
        recovery.join(10)
        assert ex.state == "Failed", ex.state


@pytest.fixture(scope="module")
def lifecycle_taken(calbins):
    with recording() as hits:
        lifecycle_scenarios(calbins)
    return hits


@pytest.mark.parametrize("transition", LIFECYCLE.transitions,
                         ids=lambda t: f"{t.source}-{t.event}->{t.target}")
def test_lifecycle_transition_reached_through_executor(lifecycle_taken, transition):
    assert transition.key in lifecycle_taken, (
        f"no executor scenario takes {transition.source} --{transition.event}--> "
        f"{transition.target}; add one to lifecycle_scenarios")


def test_transient_failures_that_quarantine_every_slot_trigger_a_rebuild(calbins):
    """Two Wait timeouts quarantine both decode slots; transient faults alone would not
    recover, so the pool's exhaustion asks for reset + generation+1 (§13.2: golden passes
    or explicit Failed, never Ready-but-unable-to-serve)."""
    with running_executor(calbins["main"], "decode_us=20000") as ex:
        greedy(ex, 1, PROMPT, 0)
        greedy(ex, 2, PROMPT, 0)
        for seq in (1, 2):
            # the first job is held until the device lets go, its grace waited in Wait() by
            # the completion thread (Phase A): arm only after that, or that Wait() takes the
            # fault meant for the next job (which then succeeds)
            until(lambda: ex.dispatch.snapshot()["held_by_runtime"] == 0,
                  what="the runtime let go of the failed job")
            arm(ex, "WAIT_RC")
            res = ex.enqueue(decode(seq, 3, len(PROMPT))).wait_until(deadline())
            assert isinstance(res, Status)
            if ex.state != "Ready" or ex.life.recovery_pending:
                break
        assert wait_state(ex, ("Ready",)) == "Ready" and ex.gen.id == 2
        # the pool's exhaustion, or (when the device was still busy after the grace) the
        # device-hung report, asked for the reset + rebuild; a transient alone never does
        assert ex.recoveries[-1]["reason"] in ("pool.exhausted", "device.hung")
        assert serves_oracle(ex, seq=3)


def test_injected_faults_are_marked_injected_in_the_log(calbins, caplog):
    """#15 §6: an operator reading the log tells an injected fault from a real one. The arm is
    logged (``calexec.injected``) and the fault controller's line for the fault it caused says
    INJECTED; the same kind of fault without an armed plan (a job past its deadline is never
    injected) is not marked."""
    caplog.set_level(logging.WARNING)
    with running_executor(calbins["main"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=18)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 18
        assert wait_state(ex, ("Ready",)) == "Ready"
        armed = [r.getMessage() for r in caplog.records if r.name == "calexec.injected"]
        assert armed and armed[0].startswith("INJECTED fault armed: point=SUBMIT_RC mode=NTH")
        faults = [r.getMessage() for r in caplog.records if r.name == "calexec.faults"
                  and "-> " in r.getMessage()]
        assert faults and faults[-1].startswith("INJECTED fault "), faults
        # the same point armed again (the emulator resets its fired counter): marked again
        caplog.clear()
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "SUBMIT_RC", rc=18)
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 18
        assert wait_state(ex, ("Ready",)) == "Ready"
        faults = [r.getMessage() for r in caplog.records if r.name == "calexec.faults"
                  and "-> " in r.getMessage()]
        assert faults and faults[-1].startswith("INJECTED fault "), faults
        # a fault the plan did not fire: reported directly, no fired counter moved
        caplog.clear()
        ex.faults.report(Status.failure("device.test_real", Category.DEVICE, Phase.WAIT, "real"))
        real = [r.getMessage() for r in caplog.records if r.name == "calexec.faults"]
        assert real and real[-1].startswith("fault "), real
        assert wait_state(ex, ("Ready",)) == "Ready"
