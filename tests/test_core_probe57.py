"""Stop 57 (core): the control core's lifecycle, job handles and sequence ownership, each
defect replayed with its interleaving forced (a device proxy or a done callback holds a thread
at the point a race needs it) rather than hoped for. Real executor on the bundled emulator;
every wait is a bounded poll of a condition; nothing asserts a duration.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.synthetic import calbin as cb
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.faults import RecordingFaultSink, RecoveryPolicy
from executor_harness import (
    MANIFEST,
    arm,
    deadline,
    decode,
    prefill,
    running_executor,
    until,
    write_calbin,
)

OTHER_SEED = 4242


@pytest.fixture(scope="module")
def calbins(tmp_path_factory):
    directory = tmp_path_factory.mktemp("probe57")
    main = write_calbin(directory)
    other = str(directory / "other.calbin")
    other_sha = cb.write(other, cb.default_spec(seed=OTHER_SEED))
    return {"main": main, "other": other, "other_sha": other_sha}


# ---- 1. a shutdown during a model switch's roll back ---------------------------------------
class _HookedDevice:
    """The bundled device, recording each calbin load (and whether a shutdown had begun),
    whose ``reset_configuration`` (a generation's teardown) runs ``hook`` first once
    ``skip`` more teardowns went by."""

    def __init__(self, device, stopping: Callable[[], bool]) -> None:
        self._device = device
        self._stopping = stopping
        self.loads: list[tuple[str, bool]] = []
        self.hook: Callable[[], None] | None = None
        self.skip = 0

    def load_calbin(self, path):
        self.loads.append((path, self._stopping()))
        return self._device.load_calbin(path)

    def reset_configuration(self):
        if self.hook is not None and self.skip > 0:
            self.skip -= 1
        elif self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return self._device.reset_configuration()

    def __getattr__(self, name):
        return getattr(self._device, name)


class _HookedRuntime:
    def __init__(self, runtime: CalRT) -> None:
        self._runtime = runtime
        self.device: _HookedDevice | None = None
        self.executor: DeviceExecutor | None = None

    def open_device(self, config):
        rc, device = self._runtime.open_device(config)
        if rc == 0:
            self.device = device = _HookedDevice(
                device, lambda: self.executor is not None and self.executor.life.stopping)
        return rc, device

    def __getattr__(self, name):
        return getattr(self._runtime, name)


def test_a_shutdown_during_a_switch_s_roll_back_configures_no_fallback(calbins):
    """A model switch whose golden is refused tears the refused generation down and rolls
    back to the previous calbin. A ``shutdown`` that began during that teardown (it
    interrupts the switch at half its grace) did not stop the roll back: the fallback
    calbin was loaded, configured and mapped, its golden refused (admission stopped), and
    the shutdown tore it down again. Nothing is configured once the shutdown began: the
    switch answers that the shutdown stopped it before the roll back, the lifecycle ends
    Stopped (Warming -> Stopped, as a recovery whose golden the shutdown stopped), and the
    shutdown answers OK."""
    runtime = _HookedRuntime(CalRT.load())
    ex = DeviceExecutor(runtime, MANIFEST, ExecutorConfig(
        calbin_path=calbins["main"], goldens={calbins["other_sha"]: (1, 2, 3)}))
    runtime.executor = ex
    assert ex.start().ok
    device = runtime.device
    shutdowns: list[Status] = []
    thread = threading.Thread(target=lambda: shutdowns.append(ex.shutdown(2.0)),
                              name="probe57-shutdown", daemon=True)

    def shutdown_begins() -> None:  # on the switch's thread, tearing generation 2 down
        thread.start()
        until(lambda: ex.life.stopping, 20, "the shutdown interrupting the switch")

    try:
        device.hook, device.skip = shutdown_begins, 1  # not generation 1's: generation 2's
        status = ex.switch_model(calbins["other"])  # its golden differs: refused
        thread.join(30)
        assert device.hook is None, "the refused generation was never torn down"
        after = [path for path, stopping in device.loads if stopping]
        assert after == [], f"calbins loaded once the shutdown began: {after}"
        assert not status.ok and "shutdown() began" in status.message, status
        assert "golden.mismatch" in status.message and calbins["main"] in status.message
        assert shutdowns and shutdowns[0].ok and ex.state == "Stopped", (shutdowns, ex.state)
        assert ex.gen is None
    finally:
        thread.join(30) if thread.is_alive() else None
        ex.shutdown(5.0)


# ---- 2. a done callback waiting for another job ---------------------------------------------
def test_a_done_callback_s_wait_for_another_job_is_refused_a_look_is_not(calbins):
    """A done callback (on ``calexec-completion``) that waited for another job with
    ``wait_until`` or ``result`` stalled that thread until its deadline: the job it waited
    for is completed only by that very thread, and every other job stood behind it.
    ``enqueue``, ``decode_sync`` and a stream's ``submit``/``wait`` already raised
    RuntimeError there; the handle's waits now do too, naming the call and the thread. A
    callback may still read what is at hand: its own (resolved) handle answers at once, and
    so does a look at another (``result(0)``: a ``wait.deadline`` Status)."""
    with running_executor(calbins["main"]) as ex:
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0  # the device finishes nothing until released
        seen: dict[str, object] = {}
        try:
            first = ex.enqueue(prefill(1, [1, 2, 3]))
            second = ex.enqueue(prefill(2, [4, 5, 6]))

            def on_done(handle) -> None:  # calexec-completion
                seen["thread"] = threading.current_thread().name
                seen["own"] = handle.wait_until(deadline())
                seen["look"] = second.result(0)
                for name, wait in (("wait_until", lambda: second.wait_until(deadline(5.0))),
                                   ("result", lambda: second.result(5.0)),
                                   ("no_limit", lambda: second.result(None))):
                    try:
                        seen[name] = wait()
                    except RuntimeError as exc:
                        seen[name] = exc

            first.add_done_callback(on_done)
            assert not first.done
        finally:
            assert emu.set_stepped(False) == 0
        until(lambda: "no_limit" in seen and second.done, 30, "the callback and both jobs")
        assert seen["thread"] == "calexec-completion", seen
        assert not isinstance(seen["own"], Status), seen["own"]
        assert isinstance(seen["look"], Status) and seen["look"].code == "wait.deadline"
        for name, call in (("wait_until", "wait_until"), ("result", "result"),
                           ("no_limit", "result")):
            refused = seen[name]
            assert isinstance(refused, RuntimeError), (name, refused)
            assert f"JobHandle.{call}()" in str(refused), refused
            assert "calexec-completion" in str(refused), refused
        assert not isinstance(second.wait_until(deadline()), Status)


# ---- 3. release_sequence beside an open greedy stream ---------------------------------------
def _release_beside_an_open_stream(ex: DeviceExecutor, api: str) -> list:
    """Seq 1: a prefill, one decode step taken through ``api``, then ``release_sequence(1)``
    with the stream (if any) still open, the next step, the stream closed and a fresh
    prefill. The answers, as codes and tokens."""
    first = ex.enqueue(prefill(1, [1, 2, 3], kv_reserve_len=12)).wait_until(deadline())
    assert not isinstance(first, Status), first
    stream = None
    if api == "enqueue":
        step = ex.enqueue(decode(1, first.argmax, first.kv_len)).wait_until(deadline())
    else:
        stream = ex.decode_stream(1, first.kv_len, deadline(), max_len=12,
                                  greedy_ahead=api == "ahead")
        assert not isinstance(stream.submit(first.argmax), Status)
        step = stream.wait()
    assert not isinstance(step, Status), step
    answers: list = [step.argmax, ex.release_sequence(1, 5.0).code]
    if stream is None:
        after = ex.enqueue(decode(1, step.argmax, step.kv_len)).wait_until(deadline())
    else:
        submitted = stream.submit(step.argmax)
        after = submitted if isinstance(submitted, Status) else stream.wait()
        stream.close()
    answers.append(after.code if isinstance(after, Status) else after.argmax)
    fresh = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
    answers.append(fresh.code if isinstance(fresh, Status) else fresh.argmax)
    answers.append(ex.release_sequence(1, 5.0).code)
    return answers


def test_release_sequence_beside_an_open_greedy_stream_answers_as_the_plain_path(calbins):
    """``release_sequence(1)`` after the caller took a decode step, its decode stream still
    open: the plain path (``enqueue``) and a stream without greedy ahead released the
    sequence (OK; the stream's armed next job is a guess, released first, and its next step
    finds the sequence empty: ``kv.past_len_beyond_committed``); with greedy ahead the step
    the completion thread fired ahead still ran on the device, and the release answered
    ``kv.sequence_busy`` (the next step then ran on the sequence as if nothing happened). The
    release now lets that discarded step leave first, as a request of the sequence does: the
    same answers on every path. Each decode step takes 0.5 s on the device, so the step fired
    ahead is on it when the release comes."""
    answers = {}
    for api in ("enqueue", "stream", "ahead"):
        with running_executor(calbins["main"], device_config="decode_us=500000") as ex:
            answers[api] = _release_beside_an_open_stream(ex, api)
    assert answers["enqueue"][1:] == ["ok", "kv.past_len_beyond_committed",
                                      answers["enqueue"][3], "ok"], answers
    assert answers["stream"] == answers["enqueue"], answers
    assert answers["ahead"] == answers["enqueue"], answers


# ---- 4. release_sequence of an id the device has not ----------------------------------------
def test_release_sequence_of_an_id_beyond_max_seqs_is_refused_naming_the_range(calbins):
    """``release_sequence(8)`` on a device of ``max_seqs=8`` (an off-by-one of the embedder's
    free list, ``range(1, max_seqs + 1)``) answered OK: "released", while ``enqueue`` on that
    id answers ``kv.seq_id_out_of_range``. It is refused so, naming ``seq_id``, the value and
    the range, and nothing is released: the ids that hold KV keep it."""
    with running_executor(calbins["main"],
                          device_config="kv_blocks=16;kv_block_size=16;max_seqs=8") as ex:
        first = ex.enqueue(prefill(7, [1, 2, 3])).wait_until(deadline())
        assert not isinstance(first, Status), first
        request = ex.enqueue(prefill(8, [1, 2, 3])).wait_until(deadline())
        assert isinstance(request, Status) and request.code == "kv.seq_id_out_of_range"
        for bad in (8, 9, 1 << 20):
            status = ex.release_sequence(bad)
            assert status.code == "kv.seq_id_out_of_range", (bad, status)
            assert status.category is Category.INVALID_REQUEST and status.http_status == 400
            assert f"seq_id={bad}" in status.message and "max_seqs=8" in status.message, status
        for bad in (-1, "7", 7.0, True):  # no sequence id at all: as before
            status = ex.release_sequence(bad)
            assert status.code == "request.invalid" and f"seq_id={bad!r}" in status.message
        after = ex.enqueue(decode(7, first.argmax, first.kv_len)).wait_until(deadline())
        assert not isinstance(after, Status), after  # seq 7 kept its KV
        assert ex.release_sequence(7).ok and ex.release_sequence(0).ok


# (5, the category of a request on an Unknown sequence: tests/test_faults_probe56.py::
# test_a_request_on_an_unknown_sequence_names_release_sequence, which it extends)


# ---- 6. a greedy stream closed after its deadline ---------------------------------------------
def _close_after_the_deadline(ex: DeviceExecutor, greedy_ahead: bool) -> list:
    """Seq 1: a prefill, a stream whose deadline falls while the step after the caller's
    would run (each decode step takes 1 s): the caller's step taken, the deadline passed,
    the stream closed, then ``release_sequence(1)`` and a fresh prefill, as section 3 of
    docs/embedding.md orders them. The answers, as codes and tokens."""
    first = ex.enqueue(prefill(1, [1, 2, 3], kv_reserve_len=12)).wait_until(deadline())
    assert not isinstance(first, Status), first
    stream = ex.decode_stream(1, first.kv_len, deadline(1.5), max_len=12,
                              greedy_ahead=greedy_ahead)
    assert not isinstance(stream.submit(first.argmax), Status)
    step = stream.wait()
    assert not isinstance(step, Status), step
    until(lambda: time.monotonic() > stream.deadline, 10, "the stream's deadline passed")
    stream.close()
    answers: list = [step.argmax, ex.release_sequence(1, 5.0).code]
    fresh = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
    answers.append(fresh.code if isinstance(fresh, Status) else fresh.argmax)
    return answers


def test_a_greedy_stream_closed_after_its_deadline_leaves_its_sequence_free(calbins):
    """An embedder following docs/embedding.md section 3 (last step resolved, stream closed,
    then ``release_sequence``) with a greedy stream whose deadline passed after its last step:
    ``close()`` waited for the step fired ahead and never taken only until the stream's
    deadline, i.e. not at all, and the release answered ``kv.sequence_busy`` ("a bug in the
    order above": the id is withheld for good), the next prefill on it too. Without greedy
    ahead nothing of the stream runs then: OK. The step fired ahead is now waited for after
    the deadline too (bounded as ``wait()`` waits for a step it cancelled at the deadline):
    the same answers."""
    answers = {}
    for greedy_ahead in (False, True):
        with running_executor(calbins["main"], device_config="decode_us=1000000") as ex:
            answers[greedy_ahead] = _close_after_the_deadline(ex, greedy_ahead)
    assert answers[False][1] == "ok" and isinstance(answers[False][2], int), answers
    assert answers[True] == answers[False], answers


# ---- 7. a RecoveryPolicy.reset_kind that is none of the resets ----------------------------------
@pytest.mark.parametrize("value", ["bogus", None, "RESET", 1])
def test_a_reset_kind_that_is_no_reset_is_refused_naming_the_field(value):
    """``RecoveryPolicy(reset_kind="bogus")`` (in ``ExecutorConfig(recovery=...)``) raised
    attrs' own ValueError, whose text is a tuple holding the message, the whole ``Attribute``
    repr, the options and the value, where every other field of the policy (and of
    ``ExecutorConfig`` and ``HotPathTuning``) names ``Owner.field=value`` in one line. It
    names ``RecoveryPolicy.reset_kind=...`` and the resets it takes, when built and when
    assigned: a ValueError for a str, a TypeError for another type, as the other fields."""
    error = ValueError if isinstance(value, str) else TypeError
    with pytest.raises(error) as built:
        RecoveryPolicy(reset_kind=value)
    text = str(built.value)
    assert text.startswith(f"RecoveryPolicy.reset_kind={value!r}: "), text
    assert "'reset_ccu'" in text and "'none'" in text and "Attribute(" not in text, text
    policy = RecoveryPolicy()
    with pytest.raises(error, match=r"^RecoveryPolicy\.reset_kind="):
        policy.reset_kind = value
    assert policy.reset_kind == "reset"


# ---- 8. a golden_seq_id the device has not ----------------------------------------------------
def test_a_golden_seq_id_beyond_max_seqs_fails_the_start_naming_the_range(calbins):
    """``ExecutorConfig(golden_seq_id=7)`` on a device of ``max_seqs=4``: the start failed
    ``calrt.admission_failed`` "CalRT admission returned 4 (INVALID_VALUE): KvManager release
    of seq 7", the KvManager's word for it, naming no range. The reset of a sequence the
    KvManager cannot hold is refused ``kv.seq_id_out_of_range`` before it is called, as a
    request on it is, so the start names the setting, the value and ``max_seqs``."""
    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(
        calbin_path=calbins["main"], device_config="max_seqs=4", golden_seq_id=7))
    try:
        status = ex.start()
        assert status.code == "kv.seq_id_out_of_range" and ex.state == "Failed", status
        assert "ExecutorConfig.golden_seq_id=7" in status.message, status
        assert "max_seqs=4" in status.message, status
    finally:
        ex.shutdown(5.0)


# ---- 9. a done callback releasing its sequence with a wait -----------------------------------
def test_a_done_callback_s_release_that_would_wait_is_refused_one_that_does_not_answers(calbins):
    """The natural callback of a failed job: release its sequence. A job whose ``Wait``
    failed while the device still ran it (``WAIT_RC``, 1.5 s decode) leaves its sequence on
    the device; ``release_sequence(1, 10.0)`` from its done callback waited on
    ``calexec-completion`` for the device to let go, which only that thread (or the
    submitter's poll) notices: the thread stood still the whole 10 s, every job behind it,
    and the release answered ``kv.sequence_on_device`` though the device had let go after
    1.5 s. Such a release is refused there (RuntimeError naming it, as a handle's waits); one
    with ``wait_s`` 0 answers at once, and from a thread of the caller's the wait works."""
    with running_executor(calbins["main"], timeout_grace_s=30.0,
                          fault_sink=RecordingFaultSink()) as ex:
        first = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
        assert not isinstance(first, Status), first
        # the completion thread is held in another job's done callback while the failing job
        # is enqueued and given its callback: a loaded host once let the failing job end
        # between enqueue() and add_done_callback(), which then ran the callback on the
        # caller's thread (the blocker is held on the stepped device until its callback is
        # in place, so that callback runs on calexec-completion)
        emu = ex.device.emu
        entered, gate = threading.Event(), threading.Event()

        def hold(handle) -> None:  # calexec-completion, until the failing job has its callback
            entered.set()
            gate.wait(30.0)

        assert emu.set_stepped(True) == 0
        try:
            blocker = ex.enqueue(prefill(2, [4, 5]))
            blocker.add_done_callback(hold)
        finally:
            assert emu.set_stepped(False) == 0
        assert entered.wait(30.0), "the blocker's callback did not run"
        ex.device.emu.set_latency(0, 0, 1_500_000, 0)  # the next decode runs 1.5 s
        seen: dict[str, object] = {}

        def on_done(handle) -> None:  # calexec-completion
            seen["thread"] = threading.current_thread().name
            try:
                seen["waiting"] = ex.release_sequence(1, 10.0)
            except RuntimeError as exc:
                seen["waiting"] = exc
            seen["look"] = ex.release_sequence(1)

        try:
            arm(ex, "WAIT_RC")  # Wait says TIMEOUT while the job still runs on the device
            failed = ex.enqueue(decode(1, first.argmax, first.kv_len))
            failed.add_done_callback(on_done)
            gate.set()
            assert isinstance(failed.wait_until(deadline()), Status)
            until(lambda: "look" in seen, 30, "the callback")
        finally:
            gate.set()
            ex.device.emu.set_latency(0, 0, 0, 0)
        assert seen["thread"] == "calexec-completion", seen
        refused = seen["waiting"]
        assert isinstance(refused, RuntimeError), refused
        assert "release_sequence()" in str(refused) and "calexec-completion" in str(refused)
        assert isinstance(seen["look"], Status), seen["look"]
        assert seen["look"].code in ("ok", "kv.sequence_on_device"), seen["look"]
        assert ex.release_sequence(1, 10.0).ok
