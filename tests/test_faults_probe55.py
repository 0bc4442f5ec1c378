"""Stop 55 (faults): the control core's fault handling and lifecycle, each defect replayed with
its interleaving forced (the stepped emulator holds jobs on the device; gates hold a thread at
the point a race needs it) rather than hoped for. Real executor on the bundled emulator,
loopback servers only; every wait is a bounded poll of a condition; nothing asserts a
duration.
"""

from __future__ import annotations

import threading

import pytest

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402

from calexec.contracts.errors import Category  # noqa: E402
from calexec.contracts.status import Phase, Status  # noqa: E402
from calexec.drivers.calrt.runtime import CalRT, Stage  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.machines.executor import DeviceExecutor, ExecutorConfig  # noqa: E402
from calexec.machines.faults import Action, RecoveryPolicy  # noqa: E402
from executor_harness import (  # noqa: E402
    MANIFEST,
    arm,
    deadline,
    decode,
    jobs_on_device,
    make_executor,
    prefill,
    recover_in_thread,
    running_executor,
    until,
    write_calbin,
)
from test_recovery import SteppedRuntime  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    metric_value,
    started_executor,
    wait_for,
)

DEVICE_FAULT = Status.failure("device.ccu_exception", Category.DEVICE, Phase.RECOVERY,
                              "the test's reason")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe55"))






# ---- 1. a job the executor's own reset aborts --------------------------------------------------
def test_a_job_the_recovery_s_own_reset_aborts_ends_retryable_and_downgrades_nothing(calbin):
    """Phase B, two jobs on a device that finishes nothing (stepped): a recovery's drain grace
    runs out and its reset aborts both. Each ended ``device.status_not_done`` (UNKNOWN, 500:
    "an unknown outcome"), the fault controller was told two more tainted generations, and
    the two counted as Phase B failures after submit: capacity downgraded to 1 for good by one
    recovery. The executor aborted them itself: ``recovery.job_aborted``, UNAVAILABLE (503,
    retry), nothing for the fault controller to act on, no downgrade (the pool their
    quarantine exhausts is reported as before: a knock-on the controller does not count)."""
    with running_executor(calbin, inflight_capacity=2, execution_timeout_s=60.0,
                          timeout_grace_s=60.0,
                          recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        try:
            handles = [ex.enqueue(prefill(seq, [1, 2, 3])) for seq in (1, 2)]
            until(lambda: jobs_on_device(ex, 2), 20, "both jobs on the device")
            decided = len(ex.faults.decisions)
            thread, out = recover_in_thread(ex, DEVICE_FAULT, "probe55-recover")
            until(lambda: all(h.done for h in handles), 30, "the reset to abort both jobs")
        finally:
            emu.set_stepped(False)  # the recovery's golden run goes on
        thread.join(30)
        statuses = [h.wait_until(None) for h in handles]
        for status in statuses:
            assert isinstance(status, Status), status
            assert status.code == "recovery.job_aborted", status
            assert status.category is Category.UNAVAILABLE and status.http_status == 503
            assert status.generation == 1 and "reset" in status.message
        assert out and out[0].ok, out
        assert ex.state == "Ready" and ex.gen.id == 2
        assert ex.recoveries[-1]["reset_kind"] == "reset"
        jobs = {status.job_id for status in statuses}
        told = [(d.status.code, d.action) for d in list(ex.faults.decisions)[decided:]
                if d.status.job_id in jobs]
        assert told == [("recovery.job_aborted", Action.NONE)] * 2, told
        assert list(ex.downgrades) == [] and ex.snapshot()["inflight_capacity"] == 2


def test_a_request_whose_job_the_recovery_s_reset_aborted_gets_503_without_resumes(tmp_path):
    """``max_resumes`` 0: a request whose job is on the device when a recovery's reset aborts
    it got 500 ``device.status_not_done`` (an unknown outcome, not to be retried); it gets 503
    ``recovery.job_aborted`` with Retry-After, as the recovery's other knock-ons."""
    executor = started_executor(tmp_path, execution_timeout_s=60.0, timeout_grace_s=60.0,
                                recovery=RecoveryPolicy(drain_grace_s=0.2))
    app = create_app(executor, ServerConfig(max_resumes=0))
    emu = executor.device.emu
    responses: list[httpx.Response] = []
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert emu.set_stepped(True) == 0
            try:
                request = threading.Thread(target=lambda: responses.append(http.post(
                    "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})),
                    daemon=True)
                request.start()
                wait_for(lambda: jobs_on_device(executor, 1), 30,
                         "the request's job on the device")
                thread, out = recover_in_thread(executor, DEVICE_FAULT, "probe55-recover")
                request.join(30)
            finally:
                emu.set_stepped(False)
            thread.join(30)
            assert responses, "no answer"
            response = responses[0]
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "recovery.job_aborted", response.text
            assert response.headers.get("Retry-After"), response.headers
            assert out and out[0].ok, out
            wait_for(lambda: http.get("/ready").status_code == 200, 30, "ready again")
    finally:
        executor.shutdown(5.0)


# ---- 2. two reports of one incident -----------------------------------------------------------
def test_two_fault_reports_racing_before_the_recovery_is_pending_count_once(calbin):
    """Two device faults of one incident (Phase B's two jobs, say) reported at once: the
    second was decided after the first counted its recovery and before that recovery was
    marked pending (the controller asks for it outside its lock), so it counted too; with
    ``max_recoveries=1`` the second escalated to Failed at the first incident. Forced here: the
    first report's ``request_recovery`` waits until the second report was decided. The second
    belongs to the recovery the first asked for: not counted, the lifecycle recovers."""
    ex = make_executor(calbin, threads=False, recovery=RecoveryPolicy(max_recoveries=1))
    try:
        first, second = (Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                                        f"job {name}'s fault", generation=1)
                         for name in ("A", "B"))
        request = ex.request_recovery
        raced: list[threading.Thread] = []

        def gated(decision) -> None:  # the first report, between its decision and its request
            if not raced:
                raced.append(threading.Thread(target=ex.faults.report, args=(second,),
                                              daemon=True))
                raced[0].start()
                raced[0].join(30)
                assert not raced[0].is_alive(), "the second report blocked"
            request(decision)

        ex.request_recovery = gated
        ex.faults.report(first)
        decisions = [(d.status.message, d.action, "not counted" in d.reason)
                     for d in ex.faults.decisions]
        assert decisions == [("job A's fault", Action.RESET_REBUILD, False),
                             ("job B's fault", Action.RESET_REBUILD, True)], decisions
        assert ex.state == "Ready" and ex.life.recovery_pending, (ex.state, ex.failure)
        assert ex.life.run_pending_recovery().ok
        assert ex.state == "Ready" and ex.gen.id == 2 and len(ex.recoveries) == 1
    finally:
        ex.shutdown(5.0)


# ---- 3. a recovery decided just before a model switch -----------------------------------------
def test_a_recovery_decided_for_a_generation_a_model_switch_replaced_is_dropped(calbin):
    """The fault controller asks for a recovery of generation 1 and, before its thread takes
    the recovery lock, a ``switch_model`` takes it and goes live (generation 2). The recovery
    then ran on generation 2: a second drain, reset and golden run of a fresh, healthy
    generation (generation 3). Stepped mode gives the same order every time: the decision
    pending, the switch, then the recovery's turn. It is dropped, logged and counted."""
    ex = make_executor(calbin, threads=False)
    try:
        ex.faults.report(Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                                        "a fault of generation 1", generation=1))
        assert ex.life.recovery_pending and ex.gen.id == 1
        assert ex.switch_model(calbin).ok  # took the lock first; generation 2 serves
        assert ex.state == "Ready" and ex.gen.id == 2
        assert ex.life.run_pending_recovery() is None
        assert ex.gen.id == 2 and len(ex.recoveries) == 1, ex.recoveries
        assert ex.life.dropped_recoveries == 1 and not ex.life.recovery_under_way()
        assert ex.state == "Ready" and ex.life.admitting
        assert ex.snapshot()["recoveries_dropped"] == 1
        text = create_app(ex).state.service.metrics.exposition().decode()
        assert metric_value(text, "calexec_recoveries_dropped_total") == 1, text
    finally:
        ex.shutdown(5.0)


def test_a_fault_of_the_switched_generation_is_not_covered_by_the_stale_recovery(calbin):
    """The same order, and a fault of generation 2 reported before the stale recovery's
    turn: it is not "covered" by the decision pending for generation 1 (dropped when its turn
    comes): it counts against the escalation budget as any first fault of an incident does,
    replaces the stale decision, and generation 2 is recovered once."""
    ex = make_executor(calbin, threads=False)
    try:
        ex.faults.report(Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                                        "a fault of generation 1", generation=1))
        assert ex.switch_model(calbin).ok and ex.gen.id == 2
        assert not ex.life.recovery_under_way()  # the stale decision covers no fault of 2
        ex.faults.report(Status.failure("device.ccu_exception", Category.DEVICE, Phase.STATUS,
                                        "a fault of generation 2", generation=2))
        assert "not counted" not in ex.faults.last().reason, ex.faults.last()
        assert not ex.life.admitting  # stopped at once for generation 2's own fault
        assert ex.life.run_pending_recovery().ok
        assert ex.gen.id == 3 and len(ex.recoveries) == 2, ex.recoveries
        assert ex.recoveries[-1]["from_generation"] == 2 and ex.life.dropped_recoveries == 0
        assert ex.life.run_pending_recovery() is None and ex.state == "Ready"
    finally:
        ex.shutdown(5.0)


# ---- 4. a shutdown's interrupt ends a golden wait ---------------------------------------------
def test_a_shutdown_ends_a_recovery_whose_golden_job_the_device_holds_within_its_grace(calbin):
    """``shutdown(2.0)`` while a recovery warms up with its golden job on a device that
    finishes nothing, ``golden_timeout_s`` 30: the shutdown interrupted the recovery at half
    its grace, but the golden run went on waiting for its job until its own timeout, so the
    shutdown answered ``shutdown.recovery_busy`` with nothing torn down (documented, as
    "left for a golden job the device itself still holds"). The interrupt now ends the
    golden wait: the job is left to the device (its generation kept), the recovery ends
    Failed naming the shutdown, and the shutdown answers that failure within its grace."""
    with running_executor(calbin, golden_timeout_s=30.0, execution_timeout_s=60.0,
                          timeout_grace_s=60.0,
                          recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing from now
        try:
            thread, out = recover_in_thread(ex, DEVICE_FAULT, "probe55-recover", reset=False)
            until(lambda: ex.state == "Warming" and jobs_on_device(ex, 1), 20,
                  "the golden job on the device")
            status = ex.shutdown(2.0)
            assert status.code != "shutdown.recovery_busy", status
            assert ex.state == "Failed" and status == ex.failure, (status, ex.state)
            thread.join(30)
            assert out and out[0] == ex.failure, out
            assert "stopped by shutdown()" in out[0].message, out[0]
            assert "the golden run was stopped by shutdown()" in out[0].message, out[0]
            assert ex.gen is not None and ex.gen.id == 2 and not ex.gen.released, \
                "the generation whose job is on the device was released"
        finally:
            emu.set_stepped(False)  # the device lets go: a later shutdown tears it down
        until(lambda: ex.snapshot()["completing"] == 0, 20, "the golden job ended, late")
        assert ex.shutdown(5.0) == ex.failure and ex.gen is None
        assert emu.counters() == {}, "the device was never closed"


def test_a_shutdown_ends_a_start_whose_golden_job_the_device_holds_within_its_grace(calbin):
    """The same for ``start()`` on another thread (a SIGTERM during the warm-up): its golden
    job on the device, ``golden_timeout_s`` 30, a drain grace of 20 s: ``shutdown(2.0)``
    answered ``shutdown.start_busy``. The interrupt ends the golden wait and the refused
    generation's drain ends with the shutdown's grace; the start ends Failed naming the
    shutdown, and the shutdown answers that."""
    ex = DeviceExecutor(SteppedRuntime(CalRT.load()), MANIFEST, ExecutorConfig(
        calbin_path=calbin, golden_timeout_s=30.0, execution_timeout_s=60.0,
        timeout_grace_s=60.0, recovery=RecoveryPolicy(drain_grace_s=20.0)))
    out: list[Status] = []
    start = threading.Thread(target=lambda: out.append(ex.start()), daemon=True)
    start.start()
    try:
        until(lambda: ex.state == "Warming" and jobs_on_device(ex, 1), 20,
              "the golden job on the device")
        status = ex.shutdown(2.0)
        assert status.code != "shutdown.start_busy", status
        start.join(30)
        assert out and not out[0].ok and "interrupted by shutdown()" in out[0].message, out
        assert status == out[0] and ex.state == "Failed", (status, ex.state)
    finally:
        if ex.device is not None:
            ex.device.emu.set_stepped(False)
        start.join(30)
        ex.shutdown(5.0)


# ---- 5. an embedder's decode after a model switch ----------------------------------------------
def test_a_decode_whose_kv_went_with_a_switched_generation_says_so(calbin):
    """An embedder's sequence with 5 tokens committed in generation 1, then ``switch_model``:
    its next decode answered ``kv.past_len_beyond_committed`` "past_len=5 is beyond the
    committed length 0 of sequence 1", true, but it reads as the embedder's own bookkeeping
    error. Same code (400-class, llama's -1: the job is refused as asked), and the message
    says the KV went with generation 1, replaced by generation 2, and to prefill again. A
    sequence prefilled again, or released, in generation 2 is its own again."""
    with running_executor(calbin) as ex:
        first = ex.enqueue(prefill(1, [1, 2, 3, 4, 5])).wait_until(deadline())
        assert not isinstance(first, Status), first
        assert ex.switch_model(calbin).ok and ex.gen.id == 2
        status = ex.enqueue(decode(1, first.argmax, first.kv_len)).wait_until(deadline())
        assert isinstance(status, Status) and status.code == "kv.past_len_beyond_committed"
        assert status.category is Category.INVALID_REQUEST
        assert "went with generation 1, replaced by generation 2" in status.message, status
        assert "5 tokens committed in generation 1" in status.message, status
        again = ex.enqueue(prefill(1, [1, 2, 3, 4, 5])).wait_until(deadline())
        assert not isinstance(again, Status), again
        beyond = ex.enqueue(decode(1, again.argmax, again.kv_len + 3)).wait_until(deadline())
        assert isinstance(beyond, Status) and "generation 1" not in beyond.message, beyond


# ---- 6. a recovery or model switch asked for from a done callback ------------------------------
@pytest.mark.parametrize("call", ["switch_model", "recover"])
def test_a_switch_or_recovery_from_a_done_callback_raises_naming_it_and_changes_nothing(
        calbin, call):
    """A done callback runs on ``calexec-completion``. ``switch_model()`` or ``recover()``
    there drained the generation while the job whose callback runs is still that thread's
    (the drain cannot end), waited out ``drain_grace_s``, reset the device, drained as long
    again and ended the lifecycle Failed (``recovery.not_drained``: the process should exit
    for its supervisor) for a call docs/embedding.md section 4 forbids, as it forbids
    ``shutdown()``, ``decode_sync()`` and ``enqueue()`` there, which raise at once. Both now
    raise the same RuntimeError naming the call and the thread, and the executor serves on."""
    with running_executor(calbin, recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        seen: dict[str, object] = {}
        ran = threading.Event()

        def callback(_handle) -> None:
            seen["thread"] = threading.current_thread().name
            try:
                seen["answer"] = (ex.switch_model(calbin) if call == "switch_model" else
                                  ex.recover(DEVICE_FAULT))
            except RuntimeError as exc:
                seen["error"] = str(exc)
            finally:
                ran.set()

        handle = ex.enqueue(prefill(1, [1, 2, 3]),
                            on_created=lambda h: h.add_done_callback(callback))
        first = handle.wait_until(deadline())
        assert not isinstance(first, Status), first
        assert ran.wait(30)
        assert seen["thread"] == "calexec-completion"
        assert "answer" not in seen, seen
        assert f"{call}()" in str(seen["error"]) and "calexec-completion" in str(seen["error"])
        assert ex.state == "Ready" and ex.gen.id == 1 and ex.recoveries == []
        again = ex.enqueue(prefill(2, [1, 2, 3])).wait_until(deadline())
        assert not isinstance(again, Status), again


def test_a_switch_from_a_done_callback_a_recovery_runs_raises_instead_of_waiting_for_itself(
        calbin):
    """Stepped mode: the recovery's drain completes a job on the thread running the recovery,
    and the job's done callback asks for ``switch_model``: it waited for the recovery lock
    that very thread holds, for ever (the lifecycle stuck in Draining). It raises a
    RuntimeError naming the call, and the recovery goes on."""
    ex = make_executor(calbin, threads=False, recovery=RecoveryPolicy(drain_grace_s=0.2))
    seen: dict[str, object] = {}

    def callback(_handle) -> None:
        try:
            seen["answer"] = ex.switch_model(calbin)
        except RuntimeError as exc:
            seen["error"] = str(exc)

    try:
        ex.enqueue(prefill(1, [1, 2, 3]), on_created=lambda h: h.add_done_callback(callback))
        thread, out = recover_in_thread(ex, DEVICE_FAULT, "probe55-recover")
        thread.join(30)
        assert not thread.is_alive(), "the recovery waits for itself"
        assert "answer" not in seen and "switch_model()" in str(seen["error"]), seen
        assert out and out[0].ok and ex.gen.id == 2 and ex.state == "Ready", out
    finally:
        if not thread.is_alive():
            ex.shutdown(5.0)


# ---- 7. a device fault met while a model switch drains -----------------------------------------
def test_a_device_fault_met_while_a_model_switch_drains_resets_the_device(calbin):
    """``switch_model`` drains the serving generation (no reset: a switch asks for none), and
    a job of it ends with a CCU exception meanwhile (§8 DEVICE: quarantine, reset, rebuild).
    The fault controller's recovery was refused (a recovery is under way: the switch) and the
    switch tore the generation down and configured the next one on the device without the
    reset the fault calls for. The switch under way now resets the device before the
    teardown, as the recovery it stands for would have."""
    with running_executor(calbin, execution_timeout_s=60.0, timeout_grace_s=60.0,
                          recovery=RecoveryPolicy(drain_grace_s=30.0)) as ex:
        emu = ex.device.emu
        arm(ex, "CCU_EXCEPTION")  # the next job submitted ends DONE_CCU_EXCEPTION
        assert emu.set_stepped(True) == 0  # ... when the test steps it
        try:
            handle = ex.enqueue(prefill(1, [1, 2, 3]))
            until(lambda: jobs_on_device(ex, 1), 20, "the job on the device")
            out: list[Status] = []
            thread = threading.Thread(target=lambda: out.append(ex.switch_model(calbin)),
                                      daemon=True)
            thread.start()
            until(lambda: ex.state == "Draining", 20, "the switch draining")
            assert emu.step(0, Stage.JOB)[0] == 0  # the job ends: a CCU exception
            status = handle.wait_until(deadline())
            assert isinstance(status, Status) and status.code == "device.ccu_exception", status
        finally:
            emu.set_stepped(False)
        thread.join(30)
        assert out and out[0].ok and ex.gen.id == 2, out
        record = ex.recoveries[-1]
        assert record["reason"] == "lifecycle.model_switch", record
        assert record["reset_kind"] == "reset", record
        assert ex.life.run_pending_recovery() is None and len(ex.recoveries) == 1


def test_a_device_fault_while_a_rebuild_without_reset_is_pending_gets_its_reset(calbin):
    """A LIFECYCLE fault asks for a rebuild without a reset (§8: drain and check the
    generation); a DEVICE fault reported before that rebuild ran was "covered" by it, and
    the rebuild ran without the reset the device fault calls for. It resets now."""
    ex = make_executor(calbin, threads=False)
    try:
        ex.faults.report(Status.failure("calrt.configure_failed", Category.LIFECYCLE,
                                        Phase.STATUS, "a lifecycle fault", generation=1))
        assert ex.life.recovery_pending and ex.faults.last().action is Action.REBUILD
        ex.faults.report(DEVICE_FAULT.with_context(generation=1))
        assert ex.life.run_pending_recovery().ok and ex.gen.id == 2
        record = ex.recoveries[-1]
        assert record["reason"] == "calrt.configure_failed" and record["reset_kind"] == "reset"
        assert len(ex.recoveries) == 1 and ex.life.run_pending_recovery() is None
    finally:
        ex.shutdown(5.0)
