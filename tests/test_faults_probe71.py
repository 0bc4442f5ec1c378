"""Stop 71 (faults): seeded fault schedules under load, and faults met at awkward moments
(a model switch's golden run, a recovery in progress, a cancel, two faults back to back).

1. A recovery drained the old generation for ``RecoveryPolicy.drain_grace_s`` (5 s) before
   its reset even when all that was left on the device was a job the executor had already
   declared hung (``device.hung``: still held after its execution deadline and
   ``timeout_grace_s``), which only that reset ends: every hung job cost the server the whole
   drain grace of 503s (or of requests waiting for Ready), beside the grace the device was
   given to let go. The drain now ends, undrained, once nothing but such jobs is left, and the
   reset follows at once.

2. The reference server's worker pools (``drivers/serving/threads.py`` ``WorkerPool``: decode
   bursts, sequence releases, request steps) never let an idle thread go: after a soak at 64
   clients (``calexec bench soak --clients 64``) 32 ``calexec-worker``, 30 ``calexec-burst``
   and 7 ``calexec-seq-release`` threads stayed idle for the life of the server (anyio's
   worker threads, which the steps ran on until stop 70, end after 10 s idle). A worker idle
   for ``idle_s`` now ends while another idle worker is left: the pool shrinks back to one.
3. A recovery a shutdown stopped in its drain said ``0 jobs on the device`` (log line and
   Status) in Phase B while a hung job was still there (the completion thread goes on without
   a job the runtime keeps after its failed Wait); it counts those jobs too.

Bundled emulator, seeded fault plans; every wait bounded; no timing threshold (the drain grace
is made far longer than any bounded wait of the test, so the old code fails by never
recovering within it).
"""

from __future__ import annotations

import logging
import shutil
import threading

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import Device
from calexec.drivers.serving.threads import IDLE_S, WorkerPool
from calexec.drivers.tools.interleave import explore_threads
from calexec.machines.clock import Clock
from calexec.machines.faults import RecoveryPolicy
from executor_harness import (
    arm,
    deadline,
    decode,
    expected_greedy,
    fired,
    greedy,
    prefill,
    running_executor,
    settle,
    until,
    write_calbin,
)

PROMPT = [1, 2, 3]
#: a drain grace no bounded wait of these tests reaches: a drain that waits for a job
#: already declared hung never ends within them
ENDLESS_DRAIN = RecoveryPolicy(drain_grace_s=100_000.0)
HUNG = dict(recovery=ENDLESS_DRAIN, execution_timeout_s=0.5, timeout_grace_s=0.05,
            golden_timeout_s=2.0)


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("faults71"))


@pytest.mark.parametrize("capacity", [1, 2])
def test_a_recovery_from_a_hung_job_resets_once_the_job_is_declared_hung(calbin, capacity):
    """The request's job hangs: ``execution.deadline``, then ``device.hung`` after the grace;
    the recovery resets the device and serves generation 2 without waiting its drain grace
    for the hung job (on the old code: 100,000 s)."""
    with running_executor(calbin, inflight_capacity=capacity, **HUNG) as ex:
        arm(ex, "HANG")
        res = ex.enqueue(prefill(1, PROMPT, seconds=30)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "execution.deadline", res
        until(lambda: ex.recoveries and ex.state == "Ready" and not ex.health(), 30,
              "the recovery's end (its drain waited for a job declared hung)")
        record = ex.recoveries[-1]
        assert record["ok"] and record["reset"] and record["to_generation"] == 2, record
        codes = [d.status.code for d in ex.faults.decisions]
        assert codes == ["execution.deadline", "device.hung"], codes
        assert greedy(ex, 2, PROMPT, 2) == expected_greedy(PROMPT, 2)
        snap = settle(ex)
        assert snap["inflight"] == 0 and snap["pending_tokens"] == 0, snap
        assert ex.dispatch.held() == []


@pytest.mark.parametrize("how", ["recover", "switch"])
def test_a_golden_job_that_hangs_is_reset_once_declared_hung(calbin, tmp_path, how):
    """A recovery's (or a model switch's) golden job hangs: the refused generation is torn
    down after the reset its hung job needs, without waiting the drain grace for it, and the
    next attempt serves."""
    other = str(tmp_path / "other.calbin")
    shutil.copyfile(calbin, other)
    with running_executor(calbin, **HUNG) as ex:
        arm(ex, "HANG")  # the next job on the device: the golden's first
        out: list[Status] = []
        if how == "recover":
            call = lambda: ex.recover(Status.failure(  # noqa: E731
                "device.ccu_exception", Category.DEVICE, Phase.RECOVERY, "the test's reason"))
        else:
            call = lambda: ex.switch_model(other)  # noqa: E731
        thread = threading.Thread(target=lambda: out.append(call()), name="test-golden-hang",
                                  daemon=True)
        thread.start()
        thread.join(30)
        assert out, "the recovery still drains a generation whose golden job was declared hung"
        assert out[0].ok or (how == "switch" and out[0].code == "recovery.rolled_back"), out
        assert fired(ex, "HANG") == 1
        until(lambda: ex.state == "Ready" and not ex.health(), 30, "Ready")
        assert len(ex.recoveries[-1]["refused"]) == 1, ex.recoveries[-1]
        assert greedy(ex, 3, PROMPT, 2) == expected_greedy(PROMPT, 2)


def test_an_idle_pool_shrinks_back_to_one_worker_and_grows_again():
    """Under the explorer's virtual clock (no real sleep): three calls held at once start
    three workers; once they ran and the pool idled ``IDLE_S`` (virtual) seconds, one worker
    is left, idle, ready for the next call without a thread start; three calls held at once
    again start the two missing workers (the keeper, as before, the only starter), and every
    thread ends at the shutdown. On the old code the three workers stay."""
    seen: list[dict[str, int]] = []

    def scenario(clock: Clock):
        pool = WorkerPool(3, "t-idle", clock=clock)
        state = {"running": 0}
        gate = clock.semaphore(0)
        all_in = clock.semaphore(0)

        def held() -> int:
            state["running"] += 1
            if state["running"] == 3:
                all_in.release()
            gate.acquire()
            state["running"] -= 1
            return 1

        def driver() -> None:
            for round_ in range(2):
                futures = [pool.submit(held) for _ in range(3)]
                all_in.acquire()  # three calls run at once: three workers
                seen.append({"round": round_, "busy": pool.workers})
                for _ in range(3):
                    gate.release()
                for future in futures:
                    while not future.done():
                        clock.sleep(0.001)
                clock.sleep(3 * IDLE_S)  # idle (virtual time)
                seen.append({"round": round_, "idle": pool.workers})
            pool.shutdown()

        clock.start_thread(driver, "driver")

        def final() -> bool | str:
            return pool.workers == 0 or f"{pool.workers} workers after the shutdown"
        return final

    found = explore_threads(scenario, seeds=range(20), horizon_s=600.0)
    assert found.failure is None, found.failure.message
    assert seen[:4] == [{"round": 0, "busy": 3}, {"round": 0, "idle": 1},
                        {"round": 1, "busy": 3}, {"round": 1, "idle": 1}], seen[:4]


def test_an_idle_time_that_is_no_number_of_seconds_is_refused_naming_it():
    for bad in (0, -1.0, float("nan"), "10", True):
        with pytest.raises(ValueError, match=f"idle_s must be a number of seconds > 0, got "
                                             f"{bad!r}"):
            WorkerPool(1, "t-bad", idle_s=bad)



@pytest.mark.parametrize("capacity", [1, 2])
def test_a_recovery_a_shutdown_stopped_names_the_hung_job_still_on_the_device(calbin, caplog,
                                                                              capacity):
    """A shutdown stops the recovery while it drains a job that hangs (its grace not over):
    the recovery's line and its Status name the job still on the device. In Phase B the
    completion thread goes on without a job the runtime keeps after its failed Wait, and
    both said ``0`` jobs (then the shutdown answered ``shutdown.not_drained``)."""
    caplog.set_level(logging.INFO, logger="calexec")
    with running_executor(calbin, inflight_capacity=capacity, recovery=ENDLESS_DRAIN,
                          execution_timeout_s=0.3, timeout_grace_s=100_000.0) as ex:
        arm(ex, "HANG")
        res = ex.enqueue(prefill(1, PROMPT, seconds=30)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "execution.deadline", res
        until(lambda: ex.state == "Draining", 30, "the recovery's drain")
        status = ex.shutdown(0.2)
        assert status.code == "shutdown.not_drained", status
        lines = [r.getMessage() for r in caplog.records
                 if "stopped by the shutdown while it drained" in r.getMessage()
                 or "stopped by shutdown() while it drained" in r.getMessage()]
        assert lines and all("(1 jobs on the device)" in line
                             or "jobs still on the device: 1)" in line for line in lines), lines


# ---- faults at awkward moments that were already handled (kept as regression tests) ----------
@pytest.fixture
def held_reset(monkeypatch):
    """The driver's full reset held until the test opens ``gate`` (bounded), as
    tests/test_fi06_admission.py holds it: requests provably arrive while a recovery runs."""
    entered, gate = threading.Event(), threading.Event()
    real = Device.reset

    def reset(self):
        entered.set()
        gate.wait(20.0)
        return real(self)

    monkeypatch.setattr(Device, "reset", reset)
    yield entered, gate
    gate.set()


def test_a_deadline_or_a_cancel_ends_a_wait_for_ready_while_the_recovery_runs(calbin,
                                                                              held_reset):
    """``ready_queue_max``: a request arriving while the recovery after a CCU exception sits
    in its reset waits for Ready; its deadline ends the wait (``admission.deadline``) and so
    does a cancel from another thread, both while the recovery still runs; then Ready, every
    resource back, the oracle's tokens."""
    entered, gate = held_reset
    with running_executor(calbin, ready_queue_max=2) as ex:
        first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert not isinstance(first, Status), first
        arm(ex, "CCU_EXCEPTION")
        failed = ex.enqueue(decode(1, first.argmax, first.kv_len)).wait_until(deadline())
        assert isinstance(failed, Status) and failed.code == "device.ccu_exception", failed
        assert entered.wait(20), "the recovery never reached its reset"
        short = ex.enqueue(prefill(2, PROMPT, seconds=0.2)).wait_until(deadline())
        assert isinstance(short, Status) and short.code == "admission.deadline", short
        assert ex.state == "Recovering"
        handles: list = []
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("h", ex.enqueue(
            prefill(3, PROMPT, seconds=60), on_created=handles.append)), daemon=True)
        thread.start()
        until(lambda: handles and ex.snapshot()["waiting_for_ready"] == 1, 20, "a waiter")
        assert handles[0].cancel()
        thread.join(20)
        res = out["h"].wait_until(deadline())
        assert isinstance(res, Status) and res.code == "request.cancelled", res
        assert ex.state == "Recovering" and ex.snapshot()["waiting_for_ready"] == 0
        gate.set()
        until(lambda: ex.state == "Ready" and not ex.health(), 30, "Ready")
        assert greedy(ex, 4, PROMPT, 2) == expected_greedy(PROMPT, 2)
        snap = settle(ex)
        assert snap["inflight"] == snap["queued"] == snap["pending_tokens"] == 0, snap


@pytest.mark.parametrize("second", ["OUTPUT_NAN", "OUTPUT_SHORT", "WAIT_RC", "HANG"])
def test_two_faults_back_to_back_a_request_and_the_recoverys_golden(calbin, second):
    """A request's CCU exception, then a fault of the recovery's golden run: generation 2 is
    refused, generation 3 serves the oracle's tokens; both faults reported, nothing held."""
    with running_executor(calbin, **HUNG) as ex:
        arm(ex, "CCU_EXCEPTION")
        arm(ex, second, param=2)  # its point's second call: the golden's first job
        res = ex.enqueue(prefill(1, PROMPT, seconds=30)).wait_until(deadline(30))
        assert isinstance(res, Status) and res.code == "device.ccu_exception", res
        until(lambda: ex.recoveries and ex.state == "Ready" and not ex.health(), 30, "Ready")
        (record,) = ex.recoveries
        assert record["ok"] and record["to_generation"] == 3 and len(record["refused"]) == 1, \
            record
        assert fired(ex, second) == 1
        assert greedy(ex, 2, PROMPT, 2) == expected_greedy(PROMPT, 2)
        assert settle(ex)["inflight"] == 0 and ex.dispatch.held() == []


def test_a_shrink_refused_while_rolling_back_a_reservation_is_logged(calbin, caplog):
    """Found at stop 71 (the faults probe, left; fixed by the lead): a job failed before
    submit (a refused CSR write) rolls its KV reservation back; when the KvManager then
    refuses the shrink (``Apply`` false), ``KvCoordinator.rollback`` answers
    ``kv.apply_refused`` and the sequence keeps the larger reservation until released (the
    books agree with the runtime: nothing leaks), but nothing said so: no line, no count.
    Now a WARNING on ``calexec.executor`` names the sequence and the refusal."""
    with running_executor(calbin, "kv_block_size=4") as ex, \
            caplog.at_level(logging.WARNING, logger="calexec.executor"):
        arm(ex, "UNKNOWN_CSR")
        arm(ex, "APPLY_FALSE", param=2)
        result = ex.enqueue(prefill(1, [1, 2, 3, 4, 5, 6])).wait_until(deadline(10.0))
        assert isinstance(result, Status) and result.code == "calrt.csr_failed", result
        assert fired(ex, "APPLY_FALSE") == 1
    lines = [r.getMessage() for r in caplog.records if "kv.apply_refused" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    assert "seq 1" in lines[0] and "refused a shrink" in lines[0], lines[0]
