"""FI06 (§12): ``infer()`` answers DeviceUnavailable (18) -> admission stops, recovery.

The §8 DEVICE row says "new admission: stop at once". The test holds the recovery inside its
device reset (the driver's ``Device.reset`` is wrapped by the test and waits for a gate), so
requests provably arrive *while the recovery runs*, with no timing assumption:

- before the caller even sees the failed job, admission is stopped: a request sent right
  after it, and one sent while the recovery sits in Recovering, are refused UNAVAILABLE
  (``ready_queue_max=0``), or wait for Ready (``ready_queue_max=1``: one waits, the next is
  refused because the queue is full);
- the failing generation admits nothing: the device accepts no job between the failure and
  the reset (the emulator's own ``jobs_submitted``), and the request that waited is served by
  generation 2;
- then the recovery: reset, generation 2, its golden, Ready; every resource back (slots Free,
  no budget, no permit), the failed job's sequence usable again with the oracle's tokens.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import Device
from calexec.machines.faults import Action
from calexec.machines.job import InferenceResult
from executor_harness import (
    arm,
    deadline,
    decode,
    expected_greedy,
    prefill,
    running_executor,
    until,
    write_calbin,
)

PROMPT = [7, 7, 8, 9, 10]
RECOVERING = ("Draining", "Recovering", "Configuring", "Warming")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("fi06"))


@pytest.fixture
def held_reset(monkeypatch):
    """The driver's full reset, held until the test opens ``gate`` (bounded)."""
    entered, gate = threading.Event(), threading.Event()
    real = Device.reset

    def reset(self):
        entered.set()
        gate.wait(10.0)
        return real(self)

    monkeypatch.setattr(Device, "reset", reset)
    yield entered, gate
    gate.set()


def submitted(ex) -> int:
    return ex.device.emu.counters()["jobs_submitted"]


def is_unavailable(res) -> bool:
    return (isinstance(res, Status) and res.category is Category.UNAVAILABLE
            and res.phase is Phase.ADMISSION and res.http_status == 503)


@pytest.mark.parametrize("ready_queue_max", [0, 1])
def test_fi06_submit_unavailable_stops_admission_while_the_recovery_runs(calbin, held_reset,
                                                                        ready_queue_max):
    entered, gate = held_reset
    with running_executor(calbin, ready_queue_max=ready_queue_max) as ex:
        try:
            first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
            assert isinstance(first, InferenceResult), first
            jobs = submitted(ex)
            arm(ex, "SUBMIT_RC", rc=18)
            res = ex.enqueue(decode(1, first.argmax, first.kv_len)).wait_until(deadline())
            assert isinstance(res, Status), res
            assert (res.code, res.category, res.phase, res.raw) == (
                "calrt.submit_failed", Category.DEVICE, Phase.SUBMIT, 18), res
            assert ex.faults.last().action is Action.RESET_REBUILD
            # admission stopped before the caller saw the failure (the §8 DEVICE row)
            waiter: dict = {}
            if ready_queue_max == 0:
                right_after = ex.enqueue(prefill(2, PROMPT))
                assert right_after.done and is_unavailable(right_after.wait_until(deadline())), \
                    f"admitted right after the failure: {right_after.wait_until(deadline())}"
            else:
                def wait_for_ready():
                    waiter["result"] = ex.enqueue(prefill(2, PROMPT)).wait_until(deadline(20.0))

                thread = threading.Thread(target=wait_for_ready, name="fi06-waiter")
                thread.start()
                until(lambda: ex.snapshot()["waiting_for_ready"] == 1 or "result" in waiter,
                      what="a request waiting")
                assert "result" not in waiter, f"admitted right after the failure: {waiter}"
            assert any("not admitting" in reason for reason in ex.health())

            assert entered.wait(10.0), "the recovery never reached its reset"
            snap = ex.snapshot()
            assert snap["lifecycle"] == "Recovering" and snap["generation"] == 1, snap
            during = ex.enqueue(prefill(3, PROMPT))  # while the recovery runs
            assert during.done and is_unavailable(during.wait_until(deadline())), \
                during.wait_until(deadline())
            if ready_queue_max:
                assert "already wait for Ready" in during.wait_until(deadline()).message
                assert ex.snapshot()["waiting_for_ready"] == 1 and "result" not in waiter
            # the failing generation admitted nothing: the device accepted no job since
            assert submitted(ex) == jobs
            assert ex.snapshot()["queued"] == 0 and ex.snapshot()["inflight"] == 0

            gate.set()  # the recovery goes on: reset, generation 2, golden, Ready
            # (the record is appended once the recovery returns, after generation 2 is Ready)
            until(lambda: ex.snapshot()["generation"] == 2 and not ex.health()
                  and ex.recoveries, 20.0, "generation 2 Ready and its recovery recorded")
            record = ex.recoveries[-1]
            assert record["ok"] and record["reset"] and record["reset_kind"] == "reset"
            assert record["reason"] == "calrt.submit_failed" and record["to_generation"] == 2
            if ready_queue_max:
                thread.join(20.0)
                assert not thread.is_alive()
                queued = waiter["result"]
                assert isinstance(queued, InferenceResult), queued
                assert queued.generation == 2  # admitted into the new generation, not the old
                assert queued.argmax == expected_greedy(PROMPT, 0)[0]
            # since the failure the device ran generation 2's golden (prefill + decodes) and,
            # with the queue, the request that waited: nothing else
            golden_jobs = ex.config.golden_decode_steps + 1
            assert submitted(ex) == jobs + golden_jobs + ready_queue_max
            # everything back; the failed job's sequence (its KV died with generation 1) serves
            until(lambda: (lambda s: s["pending_tokens"] == 0 and s["inflight"] == 0
                           and s["slots"]["Free"] == sum(s["slots"].values()))(ex.snapshot()),
                  what="every resource back")
            assert ex.release_sequence(1).ok
            again = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
            assert isinstance(again, InferenceResult) and again.generation == 2
            result = ex.enqueue(decode(1, again.argmax, again.kv_len)).wait_until(deadline())
            assert isinstance(result, InferenceResult)
            assert [again.argmax, result.argmax] == expected_greedy(PROMPT, 1)
        finally:
            gate.set()  # never leave the recovery parked (shutdown waits for it)


def test_fi06_admission_is_stopped_before_the_recovery_begins(calbin):
    """§8 DEVICE row, "new admission: stop at once": on a stepped executor (no recovery
    thread: the test runs the pending recovery itself), a request sent after ``infer()``
    answered DeviceUnavailable and before the recovery has begun is refused UNAVAILABLE and
    never reaches the device. The mutant dropping ``admitting = False`` from
    ``DeviceLifecycle.request_recovery`` passed every FI06 test before (stop 67, trace
    audit): their recovery thread stopped admission itself before their next request came;
    here the request was queued and submitted to the faulted generation."""
    with running_executor(calbin, threads=False) as ex:
        arm(ex, "SUBMIT_RC", rc=18)
        failing = ex.enqueue(prefill(1, PROMPT))
        assert ex.submit_one()
        res = failing.wait_until(deadline())
        assert isinstance(res, Status) and res.raw == 18 and res.category == Category.DEVICE
        assert ex.life.recovery_pending and ex.state == "Ready"  # decided, not begun
        submitted = ex.device.emu.counters()["jobs_submitted"]
        late = ex.enqueue(prefill(2, PROMPT))
        ex.submit_one()  # (a submitter step: nothing may reach the device)
        refused = late.wait_until(deadline())
        assert isinstance(refused, Status) and refused.category == Category.UNAVAILABLE, refused
        assert refused.http_status == 503
        assert ex.device.emu.counters()["jobs_submitted"] == submitted
        assert ex.life.run_pending_recovery().ok
        assert ex.state == "Ready" and ex.gen.id == 2
        served = ex.enqueue(prefill(2, PROMPT))
        while not served.done and (ex.submit_one() or ex.complete_one()):
            pass
        result = served.wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        assert result.argmax == expected_greedy(PROMPT, 1)[0]
