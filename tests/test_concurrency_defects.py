"""Issue 13's executor defects, each reproduced through the public API with real threads and
the real driver (each of these failed, hung or crashed on the tree before the fix):

1. a thread that raised died silently and everything after it hung (supervision barrier,
   argument validation at enqueue);
2. enqueue raced a recovery: a request thread paused in preparation or before the queue push
   reached a torn-down generation (generation fencing);
3. a generation refused while its golden job hung was torn down under the job (teardown only
   after the runtime let go);
4. a queued job kept its KV and slot past its deadline until it reached the queue's head;
8. retired host memory was dropped by count while a stale DMA into it was still pending.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.faults import RecoveryPolicy
from calexec.machines.pool import BufferSlot
from executor_harness import (
    SEED,
    arm,
    deadline,
    decode,
    expected_greedy,
    greedy,
    oracle_golden,
    prefill,
    running_executor,
    settle,
    until,
    write_calbin,
)

PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("concurrency")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    other_sha = cb.write(other, cb.default_spec(seed=SEED ^ 0x5A5A5A))
    # §9.2: a switch needs the new calbin's golden pinned (the oracle's tokens)
    return {"main": main, "other": other,
            "goldens": {other_sha: oracle_golden(SEED ^ 0x5A5A5A)}}


def ready_again(ex, seconds=10.0):
    until(lambda: ex.state == "Ready" and not ex.life.recovery_active,
          seconds, f"lifecycle Ready (is {ex.state})")


def still_serves(ex, seq=3):
    assert greedy(ex, seq, PROMPT, 2) == expected_greedy(PROMPT, 2)
    ex.kvc.reset_sequence(seq)


# ---- defect 1: supervision and argument validation -----------------------------------------------
@pytest.mark.parametrize("bad", [
    np.zeros(10, np.float32),                    # too small for the vocab
    np.zeros(200_000, np.float64),               # wrong dtype
    np.zeros((2, 151936), np.float32),           # 2-D
    np.zeros(400_000, np.float32)[::2],          # not contiguous
    "not an array",
])
def test_a_bad_logits_out_fails_that_caller_only(calbins, bad):
    with running_executor(calbins["main"]) as ex:
        res = ex.enqueue(prefill(1, PROMPT), logits_out=bad).wait_until(deadline(5))
        assert isinstance(res, Status) and res.category == Category.INVALID_REQUEST, res
        assert "logits_out" in res.message
        assert ex.health() == [] and all(ex.threads_alive().values())
        still_serves(ex)


def test_a_read_only_logits_out_is_refused(calbins):
    buf = np.zeros(151936, np.float32)
    buf.flags.writeable = False
    with running_executor(calbins["main"]) as ex:
        res = ex.enqueue(prefill(1, PROMPT), logits_out=buf).wait_until(deadline(5))
        assert isinstance(res, Status) and "read-only" in res.message


def test_a_non_finite_deadline_is_refused(calbins):
    with running_executor(calbins["main"]) as ex:
        req = prefill(1, PROMPT)
        import attrs
        res = ex.enqueue(attrs.evolve(req, deadline=float("nan"))).wait_until(deadline(5))
        assert isinstance(res, Status) and res.category == Category.INVALID_REQUEST
        assert "deadline" in res.message


@pytest.mark.parametrize("where", ["postprocess", "_infer"])
def test_an_exception_in_an_executor_thread_is_a_fault_not_a_dead_thread(calbins, where):
    """The completion thread (postprocess) or the submitter (infer) raises once: the job it
    held resolves INTERNAL, the thread lives, the generation is rebuilt, serving goes on."""
    with running_executor(calbins["main"]) as ex:
        owner = ex.completion if where == "postprocess" else ex
        original = getattr(owner, where)
        calls = {"n": 0}

        def boom(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 1:
                raise ValueError("injected bug")
            return original(*args, **kwargs)

        setattr(owner, where, boom)
        res = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(5))
        assert isinstance(res, Status), res
        assert res.code == "internal.thread_exception" and "injected bug" in res.message
        assert ex.thread_faults and ex.thread_faults[-1]["error"] == "ValueError: injected bug"
        ready_again(ex)
        assert ex.gen.id == 2  # INTERNAL: reset and rebuild, golden re-run
        assert all(ex.threads_alive().values())
        still_serves(ex)
        snap = settle(ex)
        assert snap["inflight"] == 0 and snap["pending_tokens"] == 0


def test_health_names_a_dead_thread(calbins):
    with running_executor(calbins["main"]) as ex:
        assert ex.health() == []
        ex.completion.stop()  # stop the threads as a crash would, without shutdown
        ex.dispatch.stop()
        until(lambda: not any(ex.threads_alive().values()), 5, "threads to stop")
        assert any("calexec-completion is not running" in r for r in ex.health())


# ---- defect 2: generation fencing ------------------------------------------------------------------
@pytest.mark.parametrize("pause", ["before_prepare", "before_push"])
def test_enqueue_racing_a_recovery_never_reaches_the_new_generation(calbins, pause,
                                                                     monkeypatch):
    """A request thread holds a leased slot of generation 1 and is paused (inside
    preparation, or after it, before the queue push) while a recovery opens generation 2.
    The recovery waits for it to leave; its job ends UNAVAILABLE (retryable), nothing
    leaks, and both generations' threads keep serving."""
    with running_executor(calbins["main"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        original = BufferSlot.prepare
        paused, go = threading.Event(), threading.Event()

        def prepare(slot, request):
            if pause == "before_prepare":
                paused.set()
                go.wait(10)
            status = original(slot, request)
            if pause == "before_push":
                paused.set()
                go.wait(10)
            return status

        monkeypatch.setattr(BufferSlot, "prepare", prepare)
        out = {}
        requester = threading.Thread(
            target=lambda: out.setdefault("res", ex.enqueue(decode(1, 3, len(PROMPT)))
                                          .wait_until(deadline(10))))
        requester.start()
        assert paused.wait(5)
        monkeypatch.setattr(BufferSlot, "prepare", original)
        recovery = threading.Thread(target=lambda: out.setdefault(
            "rec", ex.recover(Status.failure("test.recover", Category.DEVICE,
                                             Phase.RECOVERY,
                                             "test"))))
        recovery.start()
        until(lambda: ex.gen is not None and ex.gen.closing, 5, "the recovery to fence gen 1")
        go.set()
        requester.join(10)
        recovery.join(10)
        res = out["res"]
        assert isinstance(res, Status) and res.category == Category.UNAVAILABLE, res
        assert out["rec"].ok, out["rec"]
        assert ex.state == "Ready" and ex.gen.id == 2
        assert not ex.thread_faults and all(ex.threads_alive().values())
        snap = settle(ex)
        assert snap["pending_tokens"] == 0 and snap["inflight"] == 0
        still_serves(ex)


# ---- defect 3: a refused generation is torn down only after the runtime let go --------------------
def switch_with_hung_golden(ex, other):
    arm(ex, "HANG")  # the next job, the new calbin's golden prefill, hangs on the device
    return ex.switch_model(other)


def test_a_switch_whose_golden_hangs_rolls_back_after_a_reset(calbins):
    policy = RecoveryPolicy(drain_grace_s=0.2)
    # 2 s: the hung golden misses them by far, and the start's golden, the rollback's and the
    # jobs around them have seconds of margin on a loaded host (0.3 s was missed by a healthy job)
    with running_executor(calbins["main"], execution_timeout_s=2.0, timeout_grace_s=0.05,
                          golden_timeout_s=2.0, recovery=policy,
                          goldens=calbins["goldens"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        status = switch_with_hung_golden(ex, calbins["other"])
        assert status.code == "recovery.rolled_back", status
        assert ex.state == "Ready" and ex.gen.calbin_path == calbins["main"]
        assert not ex.thread_faults and all(ex.threads_alive().values())
        refused = [g for g in ex.life.retired if g.calbin_path == calbins["other"]]
        assert all(g.released for g in refused)  # torn down only after the reset freed it
        still_serves(ex)


def test_a_switch_whose_golden_hangs_without_safe_reset_ends_failed_keeping_the_buffers(calbins):
    """§9.1: no safe reset and a job still on the device: the refused generation is never
    torn down (its buffers stay mapped), the lifecycle ends Failed with the reason."""
    policy = RecoveryPolicy(drain_grace_s=0.2, reset_kind="none")
    # 2 s: the hung golden misses them by far, and the start's golden, the rollback's and the
    # jobs around them have seconds of margin on a loaded host (0.3 s was missed by a healthy job)
    with running_executor(calbins["main"], execution_timeout_s=2.0, timeout_grace_s=0.05,
                          golden_timeout_s=2.0, recovery=policy,
                          goldens=calbins["goldens"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        status = switch_with_hung_golden(ex, calbins["other"])
        assert status.code == "recovery.generation_on_device", status
        assert ex.state == "Failed" and ex.failure.code == "recovery.generation_on_device"
        kept = [g for g in ex.life.retired if g.calbin_path == calbins["other"]]
        assert kept and not kept[-1].released
        assert all(s.inbuf is not None and s.host_output is not None
                   for s in kept[-1].pool.slots)
        assert not ex.thread_faults
        assert any("Failed" in r for r in ex.health())
        ex.device.reset()  # let the hung job go so the test's shutdown can drain


def test_a_switch_while_a_job_hangs_resets_and_goes_live(calbins):
    """Found by the chaos soak: a model switch asks for no reset, so a job hung on the device
    made its drain fail and the lifecycle end Failed. A job still on the device after the
    drain grace now gets the safe reset whatever the recovery's cause."""
    policy = RecoveryPolicy(drain_grace_s=0.2)
    with running_executor(calbins["main"], execution_timeout_s=30, recovery=policy,
                          goldens=calbins["goldens"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "HANG")
        hung = ex.enqueue(decode(1, 3, len(PROMPT)))
        until(lambda: hung.state == "Submitted", 5, "the job to hang on the device")
        status = ex.switch_model(calbins["other"])
        assert status.ok, status
        assert ex.state == "Ready" and ex.gen.calbin_path == calbins["other"]
        assert ex.recoveries[-1]["reset_kind"] == "reset"
        res = hung.wait_until(deadline(5))
        assert isinstance(res, Status)  # aborted by the reset: a failure, never a hang


def test_a_reload_of_the_serving_calbin_that_fails_to_open_retries_it(calbins):
    """Found by the chaos soak: reloading the calbin that serves excluded that very calbin
    from the rollback, so one failed open ended the lifecycle Failed."""
    with running_executor(calbins["main"]) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "MAP_FAIL", rc=24)  # the new generation's first MapBuf fails
        status = ex.switch_model(calbins["main"])
        assert status.ok, status
        assert ex.state == "Ready" and ex.gen.calbin_path == calbins["main"]
        assert ex.recoveries[-1]["refused"] and ex.gen.id == 3
        still_serves(ex)


# ---- defect 4: queued jobs expire at their deadline, wherever they stand ----------------------------
def test_a_queued_job_fails_at_its_deadline_and_gives_back_its_kv_and_slot(calbins):
    with running_executor(calbins["main"], "decode_us=1500000") as ex:
        greedy(ex, 1, PROMPT, 0)
        greedy(ex, 2, PROMPT, 0)
        slow = ex.enqueue(decode(1, 3, len(PROMPT)))  # 1.5 s on the device
        until(lambda: slow.state == "Submitted", 5, "the slow job to be in flight")
        short = ex.enqueue(decode(2, 3, len(PROMPT), seconds=0.2))
        res = short.wait_until(deadline(10))
        assert isinstance(res, Status) and res.category == Category.DEADLINE, res
        # it ended while the job ahead of it was still on the device, its KV given back
        assert not slow.done
        assert ex.kvc.seqs[2].open_txn is None
        assert ex.snapshot()["pending_tokens"] == 1  # only the slow job's token
        assert not isinstance(slow.wait_until(deadline(10)), Status)


# ---- defect 8: retired host memory is freed on proof, not by count -----------------------------------
def hang_with_stale_dma(ex, stale_delay_us):
    """A hung job aborted by the recovery's reset; its stale DMA lands ``stale_delay_us``
    after the reset. Returns the generation it will write into."""
    ex.device.emu.set_knob("stale_delay_us", stale_delay_us)
    greedy(ex, 1, PROMPT, 0)
    arm(ex, "HANG")
    arm(ex, "STALE_COMPLETION")
    victim = ex.gen
    res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
    assert isinstance(res, Status)
    ready_again(ex)
    return victim


def test_retired_memory_is_kept_while_a_stale_dma_is_pending(calbins):
    """Four model switches right after: the old ring of 4 dropped the generation the stale
    DMA will write into; now it stays alive while the device says the write is pending."""
    policy = RecoveryPolicy(drain_grace_s=0.2, max_recoveries=20)
    # 2 s: the hung job misses it by far; the switches' goldens and the jobs after it have
    # seconds of margin on a loaded host
    with running_executor(calbins["main"], execution_timeout_s=2.0, timeout_grace_s=0.05,
                          recovery=policy, goldens=calbins["goldens"]) as ex:
        victim = hang_with_stale_dma(ex, 60_000_000)  # lands in 60 s: pending throughout
        for path in ("other", "main", "other", "main"):
            assert ex.switch_model(calbins[path]).ok
        assert ex.device.emu.counters()["stale_pending"] == 1
        assert victim in ex.life.retired and victim.released
        assert all(s.host_output is not None for s in victim.pool.slots)
        still_serves(ex)  # (closing the device at shutdown drops the pending write)


def test_retired_memory_is_dropped_once_the_device_proves_no_dma_is_pending(calbins):
    policy = RecoveryPolicy(drain_grace_s=0.2, max_recoveries=20)
    # 2 s: the hung job misses it by far; the switches' goldens and the jobs after it have
    # seconds of margin on a loaded host
    with running_executor(calbins["main"], execution_timeout_s=2.0, timeout_grace_s=0.05,
                          recovery=policy, goldens=calbins["goldens"]) as ex:
        victim = hang_with_stale_dma(ex, 1000)
        until(lambda: ex.device.emu.counters()["stale_pending"] == 0, 10, "the stale DMA")
        assert ex.switch_model(calbins["other"]).ok
        assert victim not in ex.life.retired
        assert all(s.host_output is None for s in victim.pool.slots)
        assert len(ex.life.retired) == 0  # everything retired so far is proven free


# ---- queue through recovery (issue 16's executor half) ------------------------------------------
def recovery_held_in_warming(ex):
    """Start a recovery whose golden run waits for the returned event: the lifecycle stays
    in Warming until the test sets it."""
    held, release = threading.Event(), threading.Event()
    warm_up = ex.life.warm_up

    def slow_warm_up():
        held.set()
        release.wait(10)
        return warm_up()

    ex.life.warm_up = slow_warm_up
    reason = Status.failure("test.recover", Category.DEVICE,
                            Phase.RECOVERY, "test")
    thread = threading.Thread(target=ex.recover, args=(reason,))
    thread.start()
    assert held.wait(10)
    return release, thread


def test_requests_arriving_during_a_recovery_wait_for_ready_and_complete(calbins):
    with running_executor(calbins["main"], ready_queue_max=2) as ex:
        release, recovery = recovery_held_in_warming(ex)
        assert ex.state == "Warming"
        out = {}
        client = threading.Thread(target=lambda: out.setdefault(
            "tokens", greedy(ex, 4, PROMPT, 1)))
        client.start()
        until(lambda: ex.snapshot()["waiting_for_ready"] == 1, 5, "the request to queue")
        release.set()
        recovery.join(10)
        client.join(10)
        assert out["tokens"] == expected_greedy(PROMPT, 1)
        assert ex.snapshot()["waiting_for_ready"] == 0


def test_a_full_ready_queue_and_a_failed_lifecycle_answer_unavailable(calbins):
    with running_executor(calbins["main"], ready_queue_max=1) as ex:
        release, recovery = recovery_held_in_warming(ex)
        results = []
        waiter = threading.Thread(target=lambda: results.append(
            ex.enqueue(prefill(4, PROMPT)).wait_until(deadline(10))))
        waiter.start()
        until(lambda: ex.snapshot()["waiting_for_ready"] == 1, 5, "the first request to queue")
        full = ex.enqueue(prefill(5, PROMPT)).wait_until(deadline(5))
        assert isinstance(full, Status) and full.category == Category.UNAVAILABLE
        assert "already wait for Ready" in full.message
        ex.life.fail(Status.failure("test.failed", Category.COMPATIBILITY,
                                Phase.RECOVERY, "test"))
        waiter.join(10)
        assert isinstance(results[0], Status) and results[0].category == Category.UNAVAILABLE
        release.set()
        recovery.join(10)


def test_without_a_ready_queue_requests_during_recovery_are_refused_at_once(calbins):
    with running_executor(calbins["main"]) as ex:
        release, recovery = recovery_held_in_warming(ex)
        res = ex.enqueue(prefill(4, PROMPT)).wait_until(deadline(5))
        assert isinstance(res, Status) and res.category == Category.UNAVAILABLE
        release.set()
        recovery.join(10)



def test_a_request_cancelled_while_it_waits_for_ready_ends_cancelled_at_once(calbins):
    """A request queued through a recovery (``ready_queue_max``) whose caller cancels it
    ends CANCELLED at once, before Ready, its admission thread free again; it does not
    wait on for Ready or its deadline (found by a hand mutant of ``wait_for_ready``, stop
    48)."""
    with running_executor(calbins["main"], ready_queue_max=2) as ex:
        release, recovery = recovery_held_in_warming(ex)
        handles, out = [], []
        client = threading.Thread(target=lambda: out.append(ex.enqueue(
            prefill(4, PROMPT, seconds=60), on_created=handles.append)), daemon=True)
        try:
            client.start()
            until(lambda: ex.snapshot()["waiting_for_ready"] == 1, 5, "the request to queue")
            assert handles[0].cancel()
            client.join(10)
            assert not client.is_alive(), "the cancelled request still waits for Ready"
            res = out[0].wait_until(deadline())
            assert isinstance(res, Status) and res.category == Category.CANCELLED, res
            assert ex.state == "Warming" and ex.snapshot()["waiting_for_ready"] == 0
        finally:
            release.set()
            recovery.join(10)
            client.join(10)

# ---- a released pre-armed job makes its sequence busy for its own next step (CI, bench faults) -------
class _Delegate:
    """Forwards every attribute to the wrapped runtime object (``open_device``/``create_kv``
    are wrapped on the way, so the test can stop one KvManager call)."""

    def __init__(self, inner, gate) -> None:
        self._inner, self._gate = inner, gate

    def __getattr__(self, name):
        return getattr(self._inner, name)


class _GatedRuntime(_Delegate):
    def open_device(self, config: str = ""):
        rc, device = self._inner.open_device(config)
        return rc, (_GatedDevice(device, self._gate) if rc == 0 else device)


class _GatedDevice(_Delegate):
    def create_kv(self, calbin):
        rc, kv = self._inner.create_kv(calbin)
        return rc, (_GatedKv(kv, self._gate) if rc == 0 else kv)


class _GatedKv(_Delegate):
    def apply(self, seq_id, target):
        self._gate.pass_through()
        return self._inner.apply(seq_id, target)


class _Gate:
    """Stops the first KvManager ``Apply`` the ``holder`` thread makes once armed, until
    another thread blocks in a wait of the executor's clock (``_GateClock``), bounded."""

    def __init__(self) -> None:
        self.holder: threading.Thread | None = None
        self.holding = threading.Event()
        self.opened = threading.Event()

    def pass_through(self) -> None:
        if threading.current_thread() is self.holder and not self.opened.is_set():
            self.holding.set()
            self.opened.wait(10.0)

    def another_thread_waits(self) -> None:
        if self.holding.is_set() and threading.current_thread() is not self.holder:
            self.opened.set()


def _gate_clock(gate):
    from calexec.machines.clock import Clock

    class _GateClock(Clock):
        __slots__ = ()

        def wait(self, cond, timeout):
            gate.another_thread_waits()
            return super().wait(cond, timeout)

        def wait_event(self, event, timeout):
            gate.another_thread_waits()
            return super().wait_event(event, timeout)

    return _GateClock()


def test_a_stream_step_waits_for_the_release_of_its_reclaimed_armed_job(calbins):
    """CI's bench faults: a client got ``kv.sequence_busy`` on its own sequence, whose open
    txn was already RolledBack. A decode stream's armed job was reclaimed by another
    request's admission (short of token budget); while that thread was still rolling the
    job's KV txn back (here: the KvManager Apply giving back the block the armed job had
    grown, stopped by the gate), the stream's step found its armed job gone and admitted the
    step the ordinary way: its reserve met the half-released txn and refused. The plain path
    (no armed job) admits that step, so the step must wait for the release, not fail."""
    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink

    gate = _Gate()
    block = 16  # the emulator's KV block (device knob); the prompt fills exactly one
    prompt = [(5 + i) % 97 for i in range(block)]
    ex = DeviceExecutor(_GatedRuntime(CalRT.load(), gate),
                        load_manifest(default_manifest_path()),
                        ExecutorConfig(calbin_path=calbins["main"], threads=False,
                                       device_config=f"kv_block_size={block}",
                                       check_lock_order=True, strict_lock_order=False,
                                       auto_prearm=False, max_pending_tokens=len(prompt)),
                        fault_sink=RecordingFaultSink(), clock=_gate_clock(gate))
    assert ex.start().ok
    other = None
    try:
        assert ex.kvc.kv.block_size == block
        code, first = ex.decode_sync(prefill(1, prompt))
        assert code == 0 and not isinstance(first, Status), first
        stream = ex.decode_stream(1, first.kv_len, deadline(10))
        # its step's job, armed: its token of budget taken, a second KV block applied
        assert stream.armed is not None and ex.snapshot()["pending_tokens"] == 1
        # another request needing the whole budget: its admission reclaims the armed job and
        # stops in the Apply that gives back the block, the job's txn RolledBack, not cleared
        answers = {}
        other = threading.Thread(target=lambda: answers.setdefault(
            "other", ex.enqueue(prefill(2, prompt))), name="reclaimer", daemon=True)
        gate.holder = other
        other.start()
        assert gate.holding.wait(10.0), "the reclaim never reached the KvManager"
        handle = stream.submit(first.argmax)  # the stream's own next step
        assert not isinstance(handle, Status), handle
        result = stream.wait()
        assert not isinstance(result, Status), result
        assert [first.argmax, result.argmax] == expected_greedy(prompt, 1)
        gate.opened.set()
        other.join(10.0)
        assert not other.is_alive()
        stream.close()
        # the reclaimer went on after its release; the step's token of budget was taken by
        # then, so it is refused for budget (as on the plain path with that step admitted)
        reclaimer = answers["other"].wait_until(deadline())
        assert isinstance(reclaimer, Status) and reclaimer.code == "queue.full", reclaimer
        snap = ex.snapshot()
        assert snap["pending_tokens"] == 0 and snap["dispatch"]["armed"] == 0, snap
    finally:
        gate.opened.set()
        if other is not None:
            other.join(10.0)
        ex.shutdown(grace=5.0)
