"""Stop 68 (faultacct): how faults are handled and counted where stop 67 left three open.

1. The KvManager saying no once (``canAllocate`` or ``Apply`` false: the emulator's
   ``CAN_ALLOCATE_FALSE``/``APPLY_FALSE``) on an idle device: the reservation waited for a
   release, and on an idle device none comes, so the request waited its whole deadline and
   answered 429 ``kv.deadline``, and the refusal was neither logged nor counted as a fault.
   A refusal of blocks the host's books show free is the runtime's (§8 TRANSIENT), not a
   shortage: reported once, retried after a back-off, a bounded number of times.
3. A recovery's golden run whose CSR write the runtime refused (``UNKNOWN_CSR``: rc 4,
   ``calrt.csr_failed``, §8 ARTIFACT) before its job reached the device: the lifecycle
   refused that generation and configured another, but the fault controller was never told
   (a golden job's failure before submit was not reported), so the fault had no line in the
   log and no count in ``calexec_device_faults_total``, where the same golden job's fault on
   the device (a CCU exception) had both.

Bundled emulator, seeded fault plans; every wait bounded; no timing threshold.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from calexec.contracts.status import Status
from calexec.machines.faults import FaultController
from executor_harness import (
    arm,
    deadline,
    fired,
    prefill,
    running_executor,
    until,
    write_calbin,
)

PROMPT = [1, 2, 3, 4]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("faultacct"))


def _kv_fault_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "calexec.faults" and "fault kv.refused" in r.getMessage()]


@pytest.mark.parametrize("point", ["CAN_ALLOCATE_FALSE", "APPLY_FALSE"])
def test_a_one_off_kv_refusal_on_an_idle_device_is_retried_and_counted_once(calbin, caplog,
                                                                             point):
    """Nothing holds KV, so no release will wake the wait: on the old code the request
    answered ``kv.deadline`` at its deadline and no fault was reported or logged."""
    caplog.set_level(logging.INFO, logger="calexec")
    with running_executor(calbin) as ex:
        assert isinstance(ex.faults, FaultController)
        arm(ex, point)  # the next call of the point says no, once
        res = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(30))
        assert not isinstance(res, Status), res
        assert fired(ex, point) == 1
        assert ex.faults.reported() == [("transient", "kv.refused", None, 1)]
        lines = _kv_fault_lines(caplog)
        assert len(lines) == 1, lines
        assert "INJECTED" in lines[0] and "-> reduce_admission" in lines[0], lines
        assert "seq 1" in lines[0] and "blocks free" in lines[0], lines
        assert ex.state == "Ready"


def test_a_refusal_that_persists_is_retried_a_bounded_number_of_times_then_waits(calbin,
                                                                                caplog):
    """The KvManager refusing for good (FI04's mock): reported once, retried
    ``kv_refusal_retries`` times after a back-off, then a wait for a release to the deadline:
    ``kv.deadline``, never a poll to the deadline."""
    caplog.set_level(logging.INFO, logger="calexec")
    with running_executor(calbin) as ex:
        retries = ex.config.recovery.kv_refusal_retries
        arm(ex, "CAN_ALLOCATE_FALSE", "ALWAYS")
        applies = ex.kvc.apply_calls
        # (2 s: the retries, milliseconds apart, all come before it on a loaded host)
        res = ex.enqueue(prefill(1, PROMPT, seconds=2.0)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "kv.deadline", res
        assert fired(ex, "CAN_ALLOCATE_FALSE") == 1 + retries
        assert ex.kvc.apply_calls == applies
        assert ex.faults.reported() == [("transient", "kv.refused", None, 1)]
        assert len(_kv_fault_lines(caplog)) == 1


def test_a_real_shortage_is_no_fault_and_waits_for_the_release(calbin, caplog):
    """The books agree with the KvManager (another sequence holds every block): a shortage,
    not a fault; the reservation asks once and waits for a release (FI04), as before."""
    caplog.set_level(logging.INFO, logger="calexec")
    with running_executor(calbin, "kv_blocks=4;kv_block_size=256") as ex:
        assert not isinstance(ex.enqueue(prefill(1, np.arange(1000) % 500)).wait_until(
            deadline(30)), Status)
        applies, wakeups = ex.kvc.apply_calls, ex.kvc.wakeups
        res = ex.enqueue(prefill(2, PROMPT, seconds=0.4)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "kv.deadline", res
        assert ex.kvc.apply_calls == applies  # canAllocate said no: no Apply
        assert ex.kvc.wakeups == wakeups + 1  # one wait, ended by its deadline
        assert ex.faults.reported() == []
        assert _kv_fault_lines(caplog) == []


def test_a_refused_csr_write_of_a_recoverys_golden_run_is_reported_once(calbin, caplog):
    """The request's job meets a CCU exception; the recovery's golden prefill (sequence 0 of
    generation 2) meets the refused CSR write: the recovery configures generation 3, and the
    refusal is one fault line with its raw code 4, counted once."""
    caplog.set_level(logging.INFO, logger="calexec")
    with running_executor(calbin) as ex:
        arm(ex, "CCU_EXCEPTION")
        arm(ex, "UNKNOWN_CSR", param=3)  # the request's two CSR writes, then the golden's
        res = ex.enqueue(prefill(1, PROMPT, seconds=5.0)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "device.ccu_exception", res
        until(lambda: ex.recoveries and ex.state == "Ready", 30, "the recovery's end")
        assert fired(ex, "UNKNOWN_CSR") == 1
        (record,) = ex.recoveries
        assert record["ok"] and record["refused"] == ["calrt.csr_failed"], record
        assert ex.faults.reported() == [("artifact", "calrt.csr_failed", 4, 1),
                                        ("device", "device.ccu_exception", None, 1)]
        lines = [r.getMessage() for r in caplog.records if r.name == "calexec.faults"
                 and "fault calrt.csr_failed" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "seq_id=0 generation=2 raw=4" in lines[0], lines


def test_a_refusal_a_streams_pre_armed_guess_met_is_reported_once_by_its_step(calbin, caplog):
    """``decode_stream`` arms its first step at once, a guess nobody asked for yet (no wait:
    its deadline is now). The KvManager refusing its growth was reported ``kv.refused`` by
    the guess, and again by the step the caller then submitted, which reserved the ordinary
    way and met the same refusal: two faults and two lines for one step (twice as fast to
    the transient threshold's rebuild), and one for a stream whose step never came. A guess
    reports nothing (as ``JobOutcomes.fail_before_submit`` does not report a guess's fault):
    the step reports the refusal it meets, once."""
    caplog.set_level(logging.INFO, logger="calexec")
    with running_executor(calbin, "kv_block_size=4") as ex:
        first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(30))
        assert not isinstance(first, Status), first
        arm(ex, "CAN_ALLOCATE_FALSE", "ALWAYS")  # step 1 (position 4) needs a second block
        stream = ex.decode_stream(1, first.kv_len, deadline(2.0))
        try:
            until(lambda: fired(ex, "CAN_ALLOCATE_FALSE") >= 1, 30, "the guess's reservation")
            assert ex.faults.reported() == []  # the guess: nobody asked for it
            step = stream.submit(first.argmax)
            res = step if isinstance(step, Status) else step.wait_until(deadline(30))
        finally:
            stream.close()
        assert isinstance(res, Status) and res.code == "kv.deadline", res
        assert ex.faults.reported() == [("transient", "kv.refused", None, 1)]
        assert len(_kv_fault_lines(caplog)) == 1, _kv_fault_lines(caplog)
