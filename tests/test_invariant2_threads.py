"""§5.1 invariant 2, recorded from outside the executor: only the submitter thread calls
``infer()`` and only the completion thread calls ``Wait()``.

The executor's own ``infer_threads`` / ``wait_threads`` are sets it fills itself inside
``_submit`` and ``_complete``, so a call from anywhere else (a caller's thread polling a
buffer, a helper that submits inline) would never show there. Here the runtime's driver
classes are wrapped by the test (``Device.infer``, ``Device.infer_with_fixed_task_type``,
``OutputBuf.wait`` of every buffer of every generation, the start's golden included), each
call recording ``threading.current_thread()``'s name and ident; the executor's two threads are
identified independently, as the threads named ``calexec-submitter`` / ``calexec-completion``
that appear in ``threading.enumerate()`` across ``start()``.

Traffic: real threads, many jobs, every path that prepares a job off the caller's thread:
plain ``enqueue`` decode loops (implicit pre-arms, machines/autoarm.py), ``decode_sync``,
``decode_stream`` (pre-armed steps) and ``decode_stream(greedy_ahead=True)`` (steps fired by
the completion thread), concurrently, in Phase A and Phase B. The test also checks that each
of those paths actually ran, and that the wrappers saw every job the device accepted.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import Device, OutputBuf
from calexec.machines.job import InferenceResult
from executor_harness import (
    deadline,
    decode,
    expected_greedy,
    greedy,
    make_executor,
    prefill,
    write_calbin,
)
from thread_starts import ThreadStarts, recording_thread_starts

PROMPT = [11, 12, 13, 14, 15]
STEPS = 16
EXECUTOR_THREADS = ("calexec-submitter", "calexec-completion")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("inv2"))


@pytest.fixture
def runtime_calls(monkeypatch):
    """Every infer / Wait call on any device or output buffer: (call, thread name, ident)."""
    calls: list[tuple[str, str, int]] = []

    def wrap(cls, name):
        real = getattr(cls, name)

        def recorded(self, *args, **kwargs):
            thread = threading.current_thread()
            calls.append((name, thread.name, thread.ident))  # list.append: atomic
            return real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, recorded)

    wrap(Device, "infer")
    wrap(Device, "infer_with_fixed_task_type")
    wrap(OutputBuf, "wait")
    return calls


def executor_threads(starts: ThreadStarts) -> dict[str, int]:
    """The executor's threads, found by name among the threads the test's thread started
    (tests/thread_starts.py): other executors of the process may use the same names, and
    another test's leftover one may start a thread meanwhile."""
    found = {t.name: t.ident for t in starts.ours() if t.name in EXECUTOR_THREADS}
    assert set(found) == set(EXECUTOR_THREADS), found
    return found


def plain_loop(ex, seq: int, out: dict) -> None:
    """prefill + decodes by ``enqueue`` (consecutive decodes of one sequence: implicit
    pre-arms), tokens checked against the oracle."""
    out[seq] = greedy(ex, seq, PROMPT, STEPS)


def sync_loop(ex, seq: int, out: dict) -> None:
    result = ex.enqueue(prefill(seq, PROMPT)).wait_until(deadline())
    assert isinstance(result, InferenceResult), result
    tokens, past = [result.argmax], result.kv_len
    for _ in range(STEPS):
        code, result = ex.decode_sync(decode(seq, tokens[-1], past))
        assert code == 0, result
        tokens.append(result.argmax)
        past = result.kv_len
    out[seq] = tokens


def stream_loop(ex, seq: int, out: dict, ahead: bool, streams: dict) -> None:
    result = ex.enqueue(prefill(seq, PROMPT, kv_reserve_len=len(PROMPT) + STEPS)).wait_until(
        deadline())
    assert isinstance(result, InferenceResult), result
    tokens = [result.argmax]
    stream = ex.decode_stream(seq, result.kv_len, deadline(), greedy_ahead=ahead,
                              max_len=len(PROMPT) + STEPS, max_steps=STEPS if ahead else None)
    streams[seq] = stream
    with stream:
        for _ in range(STEPS):
            result = stream.step(tokens[-1])
            assert isinstance(result, InferenceResult), result
            tokens.append(result.argmax)
    out[seq] = tokens


def run_callers(targets) -> dict[str, int]:
    """Start one named caller thread per target, join them (bounded); their idents."""
    errors: list[BaseException] = []

    def guarded(fn, *args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(fn, *args), name=f"caller-{i}")
               for i, (fn, *args) in enumerate(targets)]
    for thread in threads:
        thread.start()
    idents = {thread.name: thread.ident for thread in threads}
    for thread in threads:
        thread.join(30.0)
    assert not any(thread.is_alive() for thread in threads), "a caller thread hung"
    assert not errors, errors
    return idents


@pytest.mark.parametrize("capacity", [1, 2], ids=["phase_a", "phase_b"])
def test_only_the_submitter_infers_and_only_the_completion_thread_waits(calbin, runtime_calls,
                                                                         capacity):
    # the golden's calls at start recorded too; a slot per stream and one to arm with
    with recording_thread_starts() as starts:
        ex = make_executor(calbin, inflight_capacity=capacity, slots_per_kind=4)
    try:
        owners = executor_threads(starts)
        base = ex.snapshot()
        # decode jobs of >= 2 ms: implicit pre-arms and greedy ahead need a device that is
        # not instant (machines/autoarm.py, machines/stream.py)
        assert ex.device.emu.set_latency(decode_us=2000) == 0
        out: dict[int, list[int]] = {}
        streams: dict = {}
        # alone first: a plain loop (consecutive decodes of one sequence arm guesses) and a
        # greedy-ahead stream (the submitter arms its next step while it has nothing else
        # to submit, and the completion thread fires it)
        callers = run_callers([(plain_loop, ex, 1, out)])
        callers |= run_callers([(stream_loop, ex, 2, out, True, streams)])
        # then every path at once
        callers |= run_callers([(plain_loop, ex, 3, out), (sync_loop, ex, 4, out),
                                (stream_loop, ex, 5, out, False, streams),
                                (stream_loop, ex, 6, out, True, streams)])
        want = expected_greedy(PROMPT, STEPS)
        assert all(out[seq] == want for seq in range(1, 7)), out
        snap = ex.snapshot()
        # every path ran: implicit pre-arms taken, pre-armed and fired-ahead stream steps
        assert snap["auto_prearmed"] > base["auto_prearmed"]
        assert streams[2].ahead_steps > 0
        assert streams[5].prearmed_steps + streams[6].prearmed_steps > 0
        assert snap["failed"] == base["failed"]

        infers = [c for c in runtime_calls if c[0].startswith("infer")]
        waits = [c for c in runtime_calls if c[0] == "wait"]
        assert {c[0] for c in infers} == ({"infer"} if capacity == 1 else
                                          {"infer_with_fixed_task_type"})
        callers_and_main = set(callers.values()) | {threading.main_thread().ident}
        wrong_infer = [c for c in infers if c[2] != owners["calexec-submitter"]]
        wrong_wait = [c for c in waits if c[2] != owners["calexec-completion"]]
        assert not wrong_infer, f"infer() from other threads: {sorted(set(wrong_infer))}"
        assert not wrong_wait, f"Wait() from other threads: {sorted(set(wrong_wait))}"
        assert not {c[2] for c in runtime_calls} & callers_and_main
        # the wrappers saw every job the device accepted (golden and traffic), each waited once
        assert len(infers) == ex.device.emu.counters()["jobs_submitted"]
        assert len(waits) == len(infers)
    finally:
        status = ex.shutdown(grace=5.0)
    assert status.ok, status


def test_the_recorder_sees_a_wait_from_a_caller_thread(calbin, runtime_calls):
    """The recording itself: a Wait() made from the test's own thread on an executor's buffer
    is recorded under that thread (so the test above would see one)."""
    ex = make_executor(calbin)
    try:
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline())
        assert isinstance(result, InferenceResult)
        slot = next(s for s in ex.pool.slots if s.kind == TaskKind.PREFILL_IDS)
        slot.outbuf.wait(0)
        me = threading.current_thread()
        assert runtime_calls[-1] == ("wait", me.name, me.ident)
    finally:
        ex.shutdown(grace=5.0)
