"""The executor's submitter waiting in the native relay (``ExecutorConfig.native_relay``,
machines/device_api.py ``SubmitRelay``; docs/architecture.md "Native hand-offs") on the
bundled emulator, with real threads and the C relay.

Whether its answers equal the plain path's for every history is the differential test's
(tests/test_differential.py, the ``relay_*`` variants, on the relay's Python twin
``ClockRelay``); these check what only the real thing shows: the C relay infers on the
submitter's thread, greedy ahead, pre-armed streams and adopted guesses go through it with
the oracle's tokens, a fault of a relayed job is answered as the plain path answers it, and
shutdown closes the relay with nothing left behind.
"""

from __future__ import annotations

import pytest

from calexec.contracts.status import Status
from calexec.drivers.calrt.runtime import CalRT, NativeSubmitRelay
from calexec.machines.clock import SYSTEM
from calexec.machines.device_api import RELAY_CLOSED, RELAY_TIMEOUT, RELAY_WAKE
from calexec.machines.job import InferenceResult
from executor_harness import (
    arm,
    deadline,
    decode,
    expected_greedy,
    greedy,
    prefill,
    running_job_path,
    settle,
    write_calbin,
)

PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def relay_executor(calbin, decode_us: int = 2000, **config):
    """A running job path with the native relay on a device that decodes in ``decode_us``
    (the shortcuts only arm for a device that is not instant)."""
    return running_job_path(calbin, f"decode_us={decode_us}", native_relay=True, **config)


def open_stream(ex, seq: int, steps: int, **kw):
    ex.kvc.reset_sequence(seq)
    result = ex.enqueue(prefill(seq, PROMPT, kv_reserve_len=len(PROMPT) + steps)).wait_until(
        deadline())
    assert isinstance(result, InferenceResult), result
    return ex.decode_stream(seq, result.kv_len, deadline(), **kw), result.argmax


def released(ex) -> None:
    snap = settle(ex)
    assert snap["pending_tokens"] == 0 and snap["inflight"] == 0, snap
    assert snap["dispatch"]["relayed"] == 0 and snap["dispatch"]["handing_off"] == 0
    assert ex.pool.counts()["Leased"] == 0 and ex.pool.counts()["InFlight"] == 0
    assert ex.locks.violations == []


def test_the_runtime_offers_its_relay_only_for_the_hosts_clock():
    class Virtual:
        real = False

    rt = CalRT.load()
    assert rt.submit_relay(Virtual()) is None
    relay = rt.submit_relay(SYSTEM)
    assert isinstance(relay, NativeSubmitRelay)
    assert relay.wait(0) == (RELAY_TIMEOUT, 0, 0)
    relay.wake()
    assert relay.wait(0) == (RELAY_WAKE, 0, 0)
    assert relay.close() == []
    assert relay.wait(0) == (RELAY_CLOSED, 0, 0)
    relay.free()


@pytest.mark.parametrize("ahead", [True, False], ids=["greedy_ahead", "prearmed"])
def test_stream_steps_go_through_the_relay_with_the_oracles_tokens(calbin, ahead):
    steps = 16
    with relay_executor(calbin) as ex:
        direct = greedy(ex, 1, PROMPT, steps)
        stream, token = open_stream(ex, 2, steps, greedy_ahead=ahead, max_steps=steps)
        out = [token]
        with stream:
            for _ in range(steps):
                result = stream.step(out[-1])
                assert isinstance(result, InferenceResult), result
                out.append(result.argmax)
        assert out == direct == expected_greedy(PROMPT, steps)
        # fired steps the submitter would take at once went through the relay (which one
        # depends on the host's timing; on a 2 ms device most do)
        assert ex.counters["relay_submitted"] >= 1, ex.counters
        assert ex.infer_threads == {"calexec-submitter"}  # invariant 2: in C, same thread
        assert ex.wait_threads == {"calexec-completion"}
        assert ex.kvc.seqs[2].committed_len == len(PROMPT) + steps
        released(ex)


def test_adopted_guesses_go_through_the_relay(calbin):
    """enqueue callers with implicit pre-arms: the guess adopted by the request that came
    is fired and, the submitter being idle, inferred from the relay."""
    steps = 12
    with relay_executor(calbin) as ex:
        ex.kvc.reset_sequence(3)
        result = ex.enqueue(prefill(3, PROMPT, kv_reserve_len=len(PROMPT) + steps)
                            ).wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        out, past = [result.argmax], result.kv_len
        for _ in range(steps):
            result = ex.enqueue(decode(3, out[-1], past)).wait_until(deadline())
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
            past += 1
        assert out == expected_greedy(PROMPT, steps)
        assert ex.counters["auto_prearmed"] >= 1 and ex.counters["relay_submitted"] >= 1
        released(ex)


@pytest.mark.parametrize("point", ["SUBMIT_RC", "CCU_EXCEPTION"])
def test_a_fault_of_a_relayed_job_is_answered_as_the_plain_path_answers_it(calbin, point):
    """A pre-armed step whose infer is refused (FI05) or whose job faults on the device:
    the step fails with the code the plain path gives, the stream's other steps are the
    plain path's, and nothing is held. (Pre-armed, not greedy ahead: the fault armed before
    a step then hits that step's job, whatever the host's timing.)"""
    answers = {}
    for relay in (False, True):
        with running_job_path(calbin, "decode_us=2000", native_relay=relay) as ex:
            stream, token = open_stream(ex, 4, 8)
            out, codes = [token], []
            with stream:
                for i in range(6):
                    if i == 3:  # the next job the device runs faults
                        arm(ex, point, rc=18 if point == "SUBMIT_RC" else 0)
                    result = stream.step(out[-1])
                    if isinstance(result, Status):
                        codes.append(result.code)
                        break
                    out.append(result.argmax)
            answers[relay] = (out, codes)
            settle(ex)
            assert ex.pool.counts()["InFlight"] == 0 and ex.pool.counts()["Leased"] == 0
            assert ex.snapshot()["dispatch"]["relayed"] == 0
            if relay:
                assert ex.counters["relay_submitted"] >= 1, ex.counters
    assert answers[True] == answers[False], answers
    assert answers[True][1] and len(answers[True][0]) == 4, answers


def test_shutdown_closes_the_relay_with_nothing_left(calbin):
    with relay_executor(calbin) as ex:
        stream, token = open_stream(ex, 5, 6, greedy_ahead=True)
        result = stream.step(token)
        assert isinstance(result, InferenceResult)
        stream.close()
        assert ex.relay_active
    assert not ex.relay_active  # closed and freed by stop_threads
    assert ex.snapshot()["dispatch"]["relayed"] == 0


def test_without_native_relay_nothing_goes_through_a_relay(calbin):
    with running_job_path(calbin, "decode_us=2000") as ex:
        stream, token = open_stream(ex, 6, 6, greedy_ahead=True)
        out = [token]
        with stream:
            for _ in range(6):
                result = stream.step(out[-1])
                assert isinstance(result, InferenceResult)
                out.append(result.argmax)
        assert ex.counters["relay_submitted"] == 0
        assert out == expected_greedy(PROMPT, 6)


class _Full:
    """The C relay, full: every ``fire`` answers False (``SubmitRelay.fire``: "closed or
    full"), so every fired job takes the path a relay that fills up sends it down, the
    submitter's Python (``Dispatch.relay_refused``), rare on a quiet host; the relay's waits
    are the C relay's."""

    def __init__(self, inner) -> None:
        self.inner, self.refused = inner, 0

    def fire(self, *args) -> bool:
        self.refused += 1
        return False

    def wake(self) -> None:
        self.inner.wake()

    def wait(self, timeout_s: float) -> tuple[int, int, int]:
        return self.inner.wait(timeout_s)

    def close(self) -> list[int]:
        return self.inner.close()

    def free(self) -> None:
        self.inner.free()


class _Raising(_Full):
    """The C relay whose every ``fire`` raises (a handle it cannot pass, a bug in a
    runtime's relay): the job was never queued in it, as when it is full."""

    def fire(self, *args) -> bool:
        self.refused += 1
        raise RuntimeError("the relay's fire raised")


@pytest.mark.parametrize("relay_kind", [_Full, _Raising], ids=["full", "raising"])
@pytest.mark.parametrize("ahead", [True, False], ids=["greedy_ahead", "prearmed"])
def test_a_job_the_relay_refuses_is_submitted_by_the_submitters_python(calbin, monkeypatch,
                                                                       ahead, relay_kind):
    """A fired job the relay does not take (full, or its fire raised) is the submitter's to
    submit in Python: the stream's steps are the oracle's, and nothing is held. (A fire that
    raised was handed to the submitter and raised on to the thread that fired: the caller's
    step raised, or, fired ahead, the caller admitted the step again, kv.sequence_busy.)"""
    relays = []
    made = CalRT.submit_relay

    def full(self, clock):
        relay = made(self, clock)
        if relay is not None:
            relay = relay_kind(relay)
            relays.append(relay)
        return relay
    monkeypatch.setattr(CalRT, "submit_relay", full)
    steps = 16
    with relay_executor(calbin) as ex:
        stream, token = open_stream(ex, 7, steps, greedy_ahead=ahead, max_steps=steps)
        out = [token]
        with stream:
            for _ in range(steps):
                result = stream.step(out[-1])
                assert isinstance(result, InferenceResult), result
                out.append(result.argmax)
        assert out == expected_greedy(PROMPT, steps)
        [relay] = relays
        # fired steps the submitter would take at once were offered to the relay (which
        # ones is the host's timing; on a 2 ms device most are), and none went through it
        assert relay.refused >= 1 and ex.counters["relay_submitted"] == 0, ex.counters
        assert ex.infer_threads == {"calexec-submitter"}
        assert ex.kvc.seqs[7].committed_len == len(PROMPT) + steps
        released(ex)
