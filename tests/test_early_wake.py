"""Early wake-ups (issue 17): a thread that slept through a decode job's device time wakes
``HotPathTuning.prewake_s`` before the job's expected end so the hand-off after it finds a warm thread. The
early wake must never change what a wait returns: the caller then waits on for the result
(bounded by its deadline), and the submitter's early wake submits nothing by itself.
"""

from __future__ import annotations

import time

import attrs
import numpy as np
import pytest

from calexec.contracts.status import Status
from calexec.machines.job import InferenceResult, job_of
from calexec.machines.tuning import HotPathTuning
from executor_harness import (
    deadline,
    decode,
    expected_greedy,
    prefill,
    running_job_path,
    write_calbin,
)

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def test_a_caller_woken_early_waits_on_for_its_result_and_tokens_match(calbin):
    steps = 8
    with running_job_path(calbin) as ex:
        assert ex.device.emu.set_latency(decode_us=20000) == 0
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        out, past, early, averages = [result.argmax], result.kv_len, [], []
        for _ in range(steps):
            # the average the plan is made from: no decode runs between this read and the
            # enqueue (the completion thread updates it before it resolves the job)
            averages.append(ex.completion.decode_exec_us)
            handle = ex.enqueue(decode(1, out[-1], past))
            early.append(job_of(handle).early_wake_s)
            # a wake planned far before the end: the wait must go on past it
            job_of(handle).early_wake_s = min(job_of(handle).early_wake_s, 0.001) or 0.001
            result = handle.wait_until(deadline())
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
            past = result.kv_len
        assert out == expected_greedy(PROMPT, steps)
        # planned from the moving average of decode jobs' device time, less prewake_s, once
        # that average reaches prewake_min_us
        tuning = ex.config.tuning
        want = [avg / 1e6 - tuning.prewake_s if avg >= tuning.prewake_min_us else 0.0
                for avg in averages]
        assert early == pytest.approx(want), (early, averages)
        # the average climbs from the golden run's zero-latency jobs towards the 20 ms profile:
        # each decode took at least its 20 ms, so after seven it is past 17 ms (a loaded host
        # only lengthens a job: no upper bound)
        assert averages[-1] > 15000 and early[-1] > early[0] and ex.completion.decode_exec_us > 15000


def test_an_early_wake_never_outlasts_the_deadline(calbin):
    """The early wake is bounded by the caller's deadline like the wait itself: a deadline
    before the job's end answers a wait.deadline Status at the deadline, not later."""
    with running_job_path(calbin) as ex:
        assert ex.device.emu.set_latency(decode_us=50000) == 0
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        handle = ex.enqueue(decode(1, result.argmax, result.kv_len))
        job_of(handle).early_wake_s = 30.0  # absurd plan: the deadline must still bound it
        status = handle.wait_until(deadline(0.01))
        assert isinstance(status, Status) and status.code == "wait.deadline", status
        assert isinstance(handle.wait_until(deadline()), InferenceResult)


def test_off_when_prewake_is_zero(calbin):
    with running_job_path(calbin, tuning=HotPathTuning(prewake_s=0.0)) as ex:
        assert ex.device.emu.set_latency(decode_us=5000) == 0
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        row = np.empty(ex.generation.vocab_size, np.float32)
        for _ in range(3):
            handle = ex.enqueue(decode(1, result.argmax, result.kv_len), logits_out=row)
            assert job_of(handle).early_wake_s == 0.0
            result = handle.wait_until(deadline())
            assert isinstance(result, InferenceResult), result
        # the caller is woken before the completion thread pops the job from its queue (the
        # lease goes back after the resolve): until then the head is that job and
        # ``prewake_at`` answers its end (seen once on a loaded CI machine); wait, bounded,
        # until the queue is empty, as the test below does
        until = time.monotonic() + 10.0
        while len(ex.completion) and time.monotonic() < until:
            time.sleep(0.001)
        assert len(ex.completion) == 0
        assert ex.completion.prewake_at(ex.clock.monotonic(), ex.config.tuning.prewake_s) is None


def test_the_submitter_reading_a_queue_the_completion_thread_just_emptied_does_not_raise(
        calbin):
    """``Completion.prewake_at`` reads the completion queue's head without completion_mu: the
    completion thread may pop it at any moment. ``Completion.head()`` answers None for an
    empty queue (never an IndexError, which would be a submitter thread fault), and with
    nothing on the device there is no early wake."""
    with running_job_path(calbin) as ex:
        # the golden run's last job may still be on its way out of the completion queue when
        # start() returns (seen on a loaded CI machine): wait, bounded, until it is empty
        until = time.monotonic() + 10.0
        while len(ex.completion) and time.monotonic() < until:
            time.sleep(0.001)
        assert ex.completion.head() is None and len(ex.completion) == 0
        assert ex.completion.prewake_at(ex.clock.monotonic(), ex.config.tuning.prewake_s) is None


@pytest.mark.parametrize("field", [f.name for f in attrs.fields(HotPathTuning)])
def test_an_infinite_or_non_numeric_timing_is_refused_naming_it(field):
    """``HotPathTuning(ahead_yield_s=math.inf)`` was taken, and the completion thread's first
    yield raised ``OverflowError: timestamp out of range for platform time_t``: an INTERNAL
    fault and a recovery, the stream's step failed (found at stop 50 by an embedder). Every
    timing must be finite and a number: refused when built, naming the field."""
    import math

    with pytest.raises(ValueError, match=rf"^HotPathTuning\.{field}=inf: must be finite"):
        HotPathTuning(**{field: math.inf})
    with pytest.raises(TypeError, match=rf"^HotPathTuning\.{field}='1': expected a number"):
        HotPathTuning(**{field: "1"})
