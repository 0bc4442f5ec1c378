"""Greedy ahead on the pre-armed decode stream (issue 17, machines/stream.py): the completion
thread fires the armed next job with the argmax of the job it just finished, so the caller's
wake-up and token choice leave the critical path; the caller's ``step(result.argmax)`` takes
the job already fired.

Tokens identical to the oracle and the enqueue path; stop tokens and ``max_steps`` end the
firing; a different token is refused; a step fired ahead that the caller never takes is
cancelled and waited for by ``close()``; a device fault on it closes the stream; nothing is
leaked (lease, KV txn, budget, permit). Stepped mode pins the order exactly; the threaded
tests run the real completion and submitter threads. No timing threshold.
"""

from __future__ import annotations

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Status
from calexec.drivers.synthetic import oracle
from calexec.machines.job import InferenceResult
from executor_harness import (
    SEED,
    arm,
    deadline,
    expected_greedy,
    fired,
    greedy,
    prefill,
    running_job_path,
    settle,
    until,
    write_calbin,
)
from test_executor_stream import PROMPT, assert_released, open_stream


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def open_stepped(ex, seq: int, steps: int, **kw):
    handle = ex.enqueue(prefill(seq, PROMPT, kv_reserve_len=len(PROMPT) + steps + 1))
    while not handle.done and (ex.submit_one() or ex.complete_one()):
        pass
    result = handle.wait_until(deadline())
    assert isinstance(result, InferenceResult), result
    return ex.decode_stream(seq, result.kv_len, deadline(), greedy_ahead=True, **kw), \
        result.argmax


def drain_stepped(ex) -> None:
    while ex.submit_one() or ex.complete_one():
        pass


def oracle_logits(prompt, tokens) -> np.ndarray:
    """FP32 logits after ``prompt`` and then ``tokens`` decoded (the numpy oracle)."""
    ref = oracle.OracleSequence(SEED)
    ref.run(list(prompt) + list(tokens))
    return oracle.bf16_to_f32(oracle.logits_bf16(ref.states[-1]))


def test_stepped_completion_fires_every_next_step_and_tokens_match(calbin):
    """Stepped mode: the completion of step k (the caller waiting for it) fires step k+1
    with its argmax; every step after the first is fired ahead. Each result is delivered in
    the caller's row (a step fired ahead is copied there when the caller takes it), with the
    oracle's logits, as a plain decode would write them."""
    steps = 10
    with running_job_path(calbin, threads=False) as ex:
        row = np.empty(ex.generation.vocab_size, np.float32)
        stream, token = open_stepped(ex, 1, steps, logits_out=row, max_steps=steps)
        out = [token]
        for _k in range(steps):
            result = stream.step(out[-1])
            assert isinstance(result, InferenceResult), result
            assert np.shares_memory(result.logits, row)
            assert np.array_equal(row, oracle_logits(PROMPT, out))
            out.append(result.argmax)
        assert out == expected_greedy(PROMPT, steps)
        assert stream.steps == steps and stream.ahead_steps == steps - 1
        assert stream.ahead is None  # max_steps: nothing fired beyond the last step
        stream.close()
        drain_stepped(ex)
        assert_released(ex, 1)
        assert ex.snapshot()["failed"] == 0 and ex.snapshot()["cancelled"] == 0


@pytest.mark.parametrize("taken", [1, 2, 3])
def test_a_step_fired_ahead_and_never_taken_never_writes_the_caller_row(calbin, taken):
    """Issue 24 defect 4: the caller takes ``taken`` steps and closes; the step fired ahead
    after them completes (cancelled, result discarded) but the caller's ``logits_out`` still
    holds the last step it took (it used to be overwritten by the discarded step)."""
    with running_job_path(calbin, threads=False) as ex:
        row = np.empty(ex.generation.vocab_size, np.float32)
        stream, token = open_stepped(ex, 1, 8, logits_out=row)
        out = [token]
        for _ in range(taken):
            result = stream.step(out[-1])
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
        assert stream.ahead is not None  # the next step was fired ahead
        ahead = stream.ahead[1]
        kept = row.copy()
        assert np.array_equal(kept, oracle_logits(PROMPT, out[:-1]))
        stream.close()
        drain_stepped(ex)  # the discarded step runs to its end
        assert ahead.done and isinstance(ahead.wait_until(deadline()), Status)
        assert np.array_equal(row, kept), "a step the caller never took wrote its logits_out"
        assert_released(ex, 1)


def test_threads_tokens_identical_and_steps_fired_by_the_completion_thread(calbin):
    steps = 16
    with running_job_path(calbin) as ex:
        direct = greedy(ex, 1, PROMPT, steps)
        assert ex.device.emu.set_latency(decode_us=3000) == 0  # the caller waits: fired ahead
        row = np.empty(ex.generation.vocab_size, np.float32)
        stream, token = open_stream(ex, 2, steps, logits_out=row, greedy_ahead=True,
                                    max_steps=steps)
        out = [token]
        with stream:
            for _ in range(steps):
                result = stream.step(out[-1])
                assert isinstance(result, InferenceResult), result
                out.append(result.argmax)
        assert out == direct == expected_greedy(PROMPT, steps)
        assert stream.ahead_steps >= 1
        assert ex.infer_threads == {"calexec-submitter"}  # invariant 2 unchanged
        assert ex.wait_threads == {"calexec-completion"}
        assert_released(ex, 2)
        snap = ex.snapshot()
        assert snap["failed"] == 0 and snap["cancelled"] == 0
        assert ex.kvc.seqs[2].committed_len == len(PROMPT) + steps


def test_no_step_fired_after_a_stop_token(calbin):
    steps = 8
    expected = expected_greedy(PROMPT, steps)
    stop = expected[4]  # the argmax of the 4th decode step
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stepped(ex, 1, steps, stop_tokens=[stop])
        out = [token]
        for _ in range(4):
            result = stream.step(out[-1])
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
        assert out[-1] == stop and stream.ahead is None  # not fired past the stop token
        assert stream.ahead_steps == 3
        stream.close()
        drain_stepped(ex)
        assert_released(ex, 1)


def test_a_different_token_is_refused_by_name_and_everything_is_released(calbin):
    steps = 6
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stepped(ex, 1, steps)
        first = stream.step(token)
        assert isinstance(first, InferenceResult)
        assert stream.ahead is not None  # step 2 already fired with first.argmax
        other = (first.argmax + 1) % ex.generation.vocab_size
        status = stream.step(other)
        assert isinstance(status, Status) and status.category is Category.INVALID_REQUEST
        assert f"token={other}" in status.message and str(first.argmax) in status.message
        assert stream.closed and stream.ahead is None
        drain_stepped(ex)
        assert_released(ex, 1)
        assert ex.kvc.reset_sequence(1).ok


def test_close_cancels_and_waits_for_a_step_fired_ahead(calbin):
    """The caller stops (a stop string, a disconnect) while the step fired ahead runs: close()
    returns only once it ended, so the sequence can be reset at once."""
    with running_job_path(calbin) as ex:
        assert ex.device.emu.set_latency(decode_us=20000) == 0
        stream, token = open_stream(ex, 1, 8, greedy_ahead=True)
        result = stream.step(token)
        assert isinstance(result, InferenceResult), result
        until(lambda: stream.ahead is not None, what="a step fired ahead")
        ahead = stream.ahead[1]
        status = stream.close()
        assert status.category is Category.CANCELLED
        assert ahead.done  # close waited for it
        assert isinstance(ahead.wait_until(deadline()), Status)  # cancelled: result discarded
        assert_released(ex, 1)
        assert ex.kvc.reset_sequence(1).ok


def on_device(ahead) -> bool:
    """A step fired ahead whose infer() was accepted (past Queued)."""
    return ahead is not None and ahead[1] is not None and ahead[1].state != "Queued"


def test_close_without_wait_returns_at_once_while_a_discarded_step_hangs(calbin):
    """Issue 24 defect 6: a response must not wait for the step fired ahead that nobody
    takes. ``close(wait=False)`` cancels it and returns at once; ``quiet`` turns True only once
    it ended (here: never before the reset the hang needs), and a later ``close()`` waits for
    it as promised.

    The execution deadline ends the hung step and clears ``stream.ahead``: it must be long
    enough for this thread to see the step fired ahead under a loaded CI host (0.3 s was not:
    a late GIL hand-back missed the window once)."""
    with running_job_path(calbin, execution_timeout_s=2.0, timeout_grace_s=0.05) as ex:
        assert ex.device.emu.set_latency(decode_us=20000) == 0
        stream, token = open_stream(ex, 1, 8, greedy_ahead=True)
        result = stream.step(token)
        assert isinstance(result, InferenceResult), result
        # on the device before the fault is armed (fired is not yet accepted: under load the
        # submitter's infer came after the arm once, and the HANG hit this step instead)
        until(lambda: on_device(stream.ahead), what="a step fired ahead, on the device")
        arm(ex, "HANG")  # too late for the step on the device: hits the next accepted one
        result = stream.step(result.argmax)  # takes the step fired ahead; fires the next
        assert isinstance(result, InferenceResult), result
        until(lambda: stream.ahead is not None, what="a second step fired ahead")
        hanging = stream.ahead[1]
        until(lambda: hanging.state in ("Submitted", "CancelRequested"), what="on the device")
        status = stream.close(wait=False)
        assert status.category is Category.CANCELLED
        assert not hanging.done and not stream.quiet  # returned without waiting for it
        stream.close()  # waits (bounded by the execution deadline) for the discarded step
        assert hanging.done and stream.quiet
        assert isinstance(hanging.wait_until(deadline()), Status)
        ex.shutdown(grace=0.2)  # the hung job needs a reset: ends Failed, not drained


@pytest.mark.parametrize("point", ["OUTPUT_NAN", "WAIT_RC"])
def test_fault_on_a_step_fired_ahead_closes_the_stream(calbin, point):
    with running_job_path(calbin) as ex:
        assert ex.device.emu.set_latency(decode_us=3000) == 0
        stream, token = open_stream(ex, 1, 8, greedy_ahead=True)
        first = stream.step(token)
        assert isinstance(first, InferenceResult), first
        arm(ex, point)  # hits the next job to run: step 2 (may be on the device already) or 3
        result = stream.step(first.argmax)
        if isinstance(result, InferenceResult):
            result = stream.step(result.argmax)
        assert isinstance(result, Status), result
        assert fired(ex, point) == 1 and stream.closed
        view = ex.kvc.seqs[1]
        until(lambda: not ex.dispatch.armed_jobs() and not stream.arming and view.next_txn is None
              and stream.ahead is None, what="armed job released")
        settle(ex)
        assert view.unknown_reason is not None and view.open_txn is None
        counts = ex.pool.counts()
        assert counts["Leased"] == 0 and counts["InFlight"] == 0
        assert ex.snapshot()["pending_tokens"] == 0
        assert ex.kvc.reset_sequence(1).ok


def test_a_logits_slice_fires_the_token_id_not_the_index_in_the_slice(calbin):
    """With ``want_logits=(first, n)`` the argmax is an index in the slice: the step fired
    ahead carries ``first + argmax``, the token id the caller steps with."""
    steps, first = 4, 1000
    with running_job_path(calbin, threads=False) as ex:
        vocab = ex.generation.vocab_size
        stream, token = open_stepped(ex, 1, steps, want_logits=(first, vocab - first))
        out = [token]
        for _ in range(steps):
            result = stream.step(out[-1])
            assert isinstance(result, InferenceResult), result
            out.append(first + result.argmax)
            assert stream.ahead is None or stream.ahead[0] == out[-1]
        assert stream.ahead_steps == steps - 1  # each fired step was taken: same token id
        stream.close()
        drain_stepped(ex)
        assert_released(ex, 1)


class _ChangesTheBytesBeforeConverting:
    """The runtime's fused postprocess, except that before the ``when``-th conversion that
    follows a check (greedy ahead's deferred conversion) it writes a new maximum into the
    checked BF16 slice: memory changed behind the executor's back between the two passes."""

    def __init__(self, fused, when: int) -> None:
        self.fused, self.when, self.checked, self.changed = fused, when, None, 0
        self.NONFINITE, self.RC_NAMES = fused.NONFINITE, fused.RC_NAMES

    def check(self, src, base, n, dst):
        self.checked = (src, base, n)
        return self.fused.check(src, base, n, dst)

    def __call__(self, src, base, n, dst):
        if self.checked == (src, base, n):
            self.checked = None
            self.when -= 1
            if self.when == 0:
                src[base + (self.fused.argmax + 1) % n] = 0x7F00  # a larger finite value
                self.changed += 1
        return self.fused(src, base, n, dst)

    @property
    def argmax(self):
        return self.fused.argmax

    @property
    def first_nonfinite(self):
        return self.fused.first_nonfinite


class _Runtime:
    """The emulator's runtime with ``_ChangesTheBytesBeforeConverting`` as its postprocess."""

    def __init__(self, runtime, when: int) -> None:
        self._runtime = runtime
        self.postprocess = _ChangesTheBytesBeforeConverting(runtime.logits_postprocessor(), when)

    def logits_postprocessor(self):
        return self.postprocess

    def __getattr__(self, name):
        return getattr(self._runtime, name)


def test_a_deferred_conversion_that_answers_otherwise_fails_its_step_not_the_stream_s_bytes(
        calbin):
    """Greedy ahead checks job N's slice and fires N+1 with its argmax, then converts N's row
    (stop 42). Both passes read bytes the lease still holds, so they answer alike; if they did
    not (memory written behind the executor's back), N must not be delivered with a row that
    disagrees with the token already fired: N fails ``output_changed`` (an internal error
    naming both answers) and everything is released as after any failed step."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST

    runtime = _Runtime(CalRT.load(), when=3)
    ex = DeviceExecutor(runtime, MANIFEST, ExecutorConfig(calbin_path=calbin, threads=False),
                        fault_sink=RecordingFaultSink())
    assert ex.start().ok
    try:
        row = np.empty(ex.generation.vocab_size, np.float32)
        stream, token = open_stepped(ex, 1, 8, logits_out=row)
        out, failed = [token], None
        for _ in range(5):
            result = stream.step(out[-1])
            if isinstance(result, Status):
                failed = result
                break
            assert np.array_equal(row, oracle_logits(PROMPT, out))  # the steps before: intact
            out.append(result.argmax)
        assert runtime.postprocess.changed == 1
        assert failed is not None and failed.code == "internal.output_changed", failed
        assert failed.category == Category.INTERNAL and "argmax=" in failed.message
        assert len(out) == 3  # steps 1 and 2 delivered, step 3 failed
        stream.close()
        drain_stepped(ex)
        assert_released(ex, 1)
    finally:
        ex.shutdown(grace=5.0)


def test_a_step_cancelled_on_the_device_fires_nothing_ahead(calbin):
    """The caller cancels the step it submitted (its handle, not the stream) while the job is
    on the device: Wait returns, the result is discarded (FI12), and the completion thread
    fires no next step with the argmax of a result nobody gets. (Found at stop 47 by a hand
    mutant: firing whatever the job's end answered left every test green.)"""
    from calexec.machines.job import JobHandle
    with running_job_path(calbin, threads=False) as ex:
        stream, token = open_stepped(ex, 1, 6)
        handle = stream.submit(token)
        assert isinstance(handle, JobHandle), handle
        ex.submit_one()  # infer: the job is on the device
        assert handle.state == "Submitted", handle.state
        ex.submit_one()  # the submitter arms the step after it (nothing else to submit)
        assert stream.armed is not None
        assert handle.cancel()
        assert ex.complete_one()
        result = handle.wait_until(deadline())
        assert isinstance(result, Status) and result.category is Category.CANCELLED, result
        assert stream.ahead is None and stream.ahead_steps == 0  # nothing fired ahead
        stream.close()
        drain_stepped(ex)
        assert_released(ex, 1)
