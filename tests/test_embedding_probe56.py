"""Found at stop 56 by an embedder writing its own server on the executor (docs/embedding.md):
misuse of the documented API that the page's promises did not survive (errors are values,
never an exception for a request's value; a done callback that calls back in is refused,
never a stalled executor). Every case runs on the bundled emulator through the public API.

No timing threshold: every wait is bounded, and a bound that is reached fails the test.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import threading
from pathlib import Path

import numpy as np
import pytest

from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.job import InferenceResult
from executor_harness import (
    MANIFEST,
    deadline,
    decode,
    expected_greedy,
    prefill,
    running_executor,
    until,
    write_calbin,
)

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
BOUND_S = 30.0  # a hang guard: reaching it fails the test


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


# ---- a request naming no sequence -------------------------------------------------------------
def test_a_request_naming_no_sequence_is_refused_at_step_3_not_raised(calbin):
    """``InferenceRequest(seq_id=[])`` is built (a list of ids is taken so that §6.3 step 3,
    ``seq_count == 1``, can refuse it as a value), but ``enqueue`` and ``decode_sync`` raised
    ``IndexError: tuple index out of range`` (the job's context read ``request.seq_id``), the
    job they had created left unresolved; before ``start`` too. Now the step-3 Status."""
    idle = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(calbin_path=calbin))
    early = idle.enqueue(prefill([], PROMPT)).wait_until(deadline(BOUND_S))
    assert isinstance(early, Status) and early.code == "lifecycle.unavailable", early
    assert idle.shutdown(5.0).ok
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill([], PROMPT))
        assert handle.done
        answer = handle.wait_until(deadline(BOUND_S))
        assert isinstance(answer, Status) and answer.code == "request.invalid", answer
        assert answer.step == 3 and "seq_count=0" in answer.message, answer
        code, status = ex.decode_sync(prefill([], PROMPT))
        assert code == -1 and isinstance(status, Status) and status.step == 3, status
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result  # the executor serves on
        assert ex.release_sequence(1, 1.0).ok
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


# ---- a decode stream from a past_len no s32 holds ---------------------------------------------
@pytest.mark.parametrize("past_len", [2**31, 2**40, -(2**40)])
def test_a_stream_from_a_past_len_no_int32_holds_is_closed_naming_it(calbin, past_len):
    """docs/embedding.md: a stream whose first step's request fails the §6.3 checks (a
    ``past_len`` beyond ``max_seq``) is returned closed, its ``status`` that
    ``request.invalid``. A ``past_len`` beyond the int32 range raised ``OverflowError: Python
    integer ... out of bounds for int32`` out of ``decode_stream`` (and, with a ``max_len``
    that kept the stream open, out of ``submit``)."""
    with running_executor(calbin) as ex:
        first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first
        stream = ex.decode_stream(1, past_len, deadline(BOUND_S))
        assert stream.closed and stream.status is not None
        assert stream.status.code == "request.invalid" and stream.status.step == 2
        assert f"past_len={past_len}" in stream.status.message, stream.status
        kept_open = ex.decode_stream(1, past_len, deadline(BOUND_S), max_len=16)
        kept_open.cancel()  # a cancelled stream's step is built another way: the same answer
        step = kept_open.submit(first.argmax)
        answer = step if isinstance(step, Status) else kept_open.wait()
        assert isinstance(answer, Status), answer
        stream = ex.decode_stream(1, past_len, deadline(BOUND_S), max_len=16)
        step = stream.submit(first.argmax)
        assert isinstance(step, Status) and step.code == "request.invalid", step
        assert f"past_len={past_len}" in step.message, step
        with pytest.raises(TypeError, match="past_len=None"):
            ex.decode_stream(1, None, deadline(BOUND_S))  # type: ignore[arg-type]
        assert ex.release_sequence(1, 1.0).ok


# ---- a decode stream stepped from a done callback ---------------------------------------------
def _prefilled_stream(ex):
    """Sequence 1 prefilled with ``PROMPT`` and a decode stream opened after it."""
    first = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
    assert isinstance(first, InferenceResult), first
    return first, ex.decode_stream(1, first.kv_len, deadline(BOUND_S))


def _calling_back(call):
    """A done callback that runs ``call()`` and records, in ``seen``, its thread and either
    its ``answer`` or the RuntimeError's text (``error``); ``ran`` is set once it ran."""
    seen: dict[str, object] = {}
    ran = threading.Event()

    def callback(_handle) -> None:
        seen["thread"] = threading.current_thread().name
        try:
            seen["answer"] = call()
        except RuntimeError as exc:
            seen["error"] = str(exc)
        finally:
            ran.set()

    return seen, ran, callback


def test_a_stream_step_from_a_done_callback_raises_naming_it_and_the_executor_serves_on(calbin):
    """A done callback runs on ``calexec-completion`` and must not call back in (section 4),
    which ``enqueue`` and ``decode_sync`` there enforce with a RuntimeError. A decode stream's
    ``step`` there (a callback chaining the next token) was taken: its ``wait`` waited for a
    job only that same thread completes, past the stream's deadline and on for the cancelled
    job's bound, every other job stalled behind it: an unrelated request ended
    ``submit.deadline`` and ``shutdown`` answered ``shutdown.not_drained`` (Failed). Now
    ``submit`` raises naming ``DecodeSteps.submit()`` and the thread, changing nothing."""
    with running_executor(calbin) as ex:
        first, stream = _prefilled_stream(ex)
        seen, ran, callback = _calling_back(lambda: stream.step(first.argmax))

        other = ex.enqueue(prefill(2, PROMPT), on_created=lambda h: h.add_done_callback(callback))
        assert isinstance(other.wait_until(deadline(BOUND_S)), InferenceResult)
        assert ran.wait(BOUND_S)
        assert seen["thread"] == "calexec-completion" and "answer" not in seen, seen
        assert "DecodeSteps.submit()" in str(seen["error"])
        assert "calexec-completion" in str(seen["error"])
        third = ex.enqueue(prefill(3, PROMPT)).wait_until(deadline(5.0))
        assert isinstance(third, InferenceResult), third  # nothing stalled behind it
        step = stream.step(first.argmax)  # the stream is as it was: its owner steps it
        assert isinstance(step, InferenceResult), step
        assert [first.argmax, step.argmax] == expected_greedy(PROMPT, 1)
        assert stream.close().code == "request.cancelled"
        assert all(ex.release_sequence(s, 1.0).ok for s in (1, 2, 3))
        status = ex.shutdown(5.0)
        assert status.ok and ex.state == "Stopped", status


def test_a_stream_wait_from_a_done_callback_for_a_step_in_flight_raises_naming_it(calbin):
    """The step's ``wait`` from a callback of another job (on ``calexec-completion``) while
    the step is still unresolved: only that thread resolves it, so the wait is refused naming
    ``DecodeSteps.wait()``, and the owner takes the step afterwards. (The prefill before it
    is slowed, so the step is queued behind it when its callback runs.)"""
    with running_executor(calbin) as ex:
        first, stream = _prefilled_stream(ex)
        seen, ran, callback = _calling_back(stream.wait)

        assert ex.device.emu.set_knob("prefill_per_token_us", 150_000) == 0  # 1.2 s
        slow = ex.enqueue(prefill(2, PROMPT), on_created=lambda h: h.add_done_callback(callback))
        handle = stream.submit(first.argmax)
        assert not isinstance(handle, Status), handle
        assert not slow.done  # the step is queued behind the slow prefill
        assert ran.wait(BOUND_S)
        assert ex.device.emu.set_knob("prefill_per_token_us", 0) == 0
        assert "answer" not in seen, seen
        assert "DecodeSteps.wait()" in str(seen["error"]), seen
        step = stream.wait()
        assert isinstance(step, InferenceResult), step
        assert [first.argmax, step.argmax] == expected_greedy(PROMPT, 1)
        stream.close()
        assert all(ex.release_sequence(s, 1.0).ok for s in (1, 2))
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


# ---- a plain request on a greedy stream's sequence --------------------------------------------
@pytest.mark.parametrize("greedy_ahead", [False, True])
def test_a_plain_decode_on_a_greedy_streams_sequence_is_answered_as_without_greedy_ahead(
        calbin, greedy_ahead):
    """Another request of a stream's sequence releases what the stream armed, and a step the
    completion thread fired ahead (``greedy_ahead``) and the caller has not taken is
    discarded: "the caller's step is admitted again, after that request, as the plain path
    runs it" (machines/stream.py). The discarded step was cancelled but not waited for, so
    while the device still ran it the request answered ``kv.sequence_busy`` (400, "a
    sequence runs one job at a time", for a sequence whose caller had nothing in flight), and
    so did the stream's own next step, which closed the stream; without greedy ahead both
    are served. Now the request waits (bounded) for the discarded step to end, and both
    answers are the plain path's. (The decode is slowed so the step fired ahead is still on
    the device when the request comes.)"""
    with running_executor(calbin, device_config="decode_us=300000") as ex:
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=16)).wait_until(
            deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first
        stream = ex.decode_stream(1, first.kv_len, deadline(BOUND_S), greedy_ahead=greedy_ahead)
        step = stream.step(first.argmax)
        assert isinstance(step, InferenceResult), step
        assert (stream.ahead is not None) == greedy_ahead  # fired before step() returned
        plain = ex.enqueue(decode(1, step.argmax, step.kv_len)).wait_until(deadline(BOUND_S))
        assert isinstance(plain, InferenceResult), plain
        again = stream.step(step.argmax)  # the stream's step rewrites that position
        assert isinstance(again, InferenceResult), again
        expected = expected_greedy(PROMPT, 2)
        assert [first.argmax, step.argmax, plain.argmax] == expected
        assert again.argmax == plain.argmax and again.kv_len == plain.kv_len
        stream.close()
        assert ex.release_sequence(1, 1.0).ok
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


# ---- a greedy stream closed from a done callback ----------------------------------------------
def test_closing_a_greedy_stream_from_a_done_callback_never_holds_the_completion_thread(calbin):
    """A done callback of a stream's step that closes the stream (a stop condition of the
    embedder's own) runs on ``calexec-completion``, just after that thread fired the next step
    ahead. ``close()`` waited there, up to 10 s, for that step to end, which only that very
    thread can complete: every other job stood still behind it (an unrelated request with a
    5 s deadline ended ``submit.deadline``). On the executor's own threads ``close()`` now
    never waits, as ``close(wait=False)``; ``quiet`` tells when the discarded step ended."""
    with running_executor(calbin, device_config="decode_us=300000") as ex:
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=16)).wait_until(
            deadline(BOUND_S))
        assert isinstance(first, InferenceResult), first
        stream = ex.decode_stream(1, first.kv_len, deadline(BOUND_S), greedy_ahead=True)
        seen: dict[str, object] = {}

        def callback(_handle) -> None:
            seen["thread"] = threading.current_thread().name
            seen["ahead"] = stream.ahead is not None
            seen["closed"] = stream.close()

        handle = stream.submit(first.argmax)
        assert not isinstance(handle, Status), handle
        handle.add_done_callback(callback)  # the step runs 0.3 s: registered before it ends
        step = stream.wait()
        assert isinstance(step, InferenceResult), step
        other = ex.enqueue(prefill(2, PROMPT, seconds=5.0)).wait_until(deadline(BOUND_S))
        assert isinstance(other, InferenceResult), other  # nothing stood still behind it
        assert seen["thread"] == "calexec-completion" and seen["ahead"] is True, seen
        assert isinstance(seen["closed"], Status) and stream.closed
        until(lambda: stream.quiet, BOUND_S, "the discarded step to end")
        assert ex.release_sequence(1, 1.0).ok and ex.release_sequence(2, 1.0).ok
        assert ex.shutdown(5.0).ok and ex.state == "Stopped"


# ---- the example server: a long prompt, an id no int32 holds -----------------------------------
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "asyncio_server.py"


def _example():
    spec = importlib.util.spec_from_file_location("asyncio_server_example56", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def _ask(port: int, line: bytes) -> list[dict]:
    """One request line on a fresh loopback connection: every line answered, up to the last
    (an answer that is no token), or up to the connection's end."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(line + b"\n")
        await writer.drain()
        answers: list[dict] = []
        while raw := await asyncio.wait_for(reader.readline(), BOUND_S):
            answers.append(json.loads(raw))
            if "token" not in answers[-1]:
                break
        return answers
    finally:
        writer.close()


def test_the_example_server_takes_a_context_long_prompt_and_names_what_it_refuses(calbin):
    """examples/asyncio_server.py, the page's server to copy: a prompt of 40,000 ids (the
    model's context is 40,960) is a ~240 KB line, past asyncio's 64 KiB default line limit:
    the connection handler raised ("Separator is not found, and chunk exceed the limit") and
    the client's connection was dropped with no answer, as for any prompt of more than about
    10,000 ids. A prompt id no int32 holds (``10**12``) raised OverflowError out of
    ``np.asarray(prompt, np.int32)``: dropped too. Now the long prompt is served, a line over
    the (1 MiB) limit and the id are refused with an error line naming them, and the
    sequence ids all come back."""
    example = _example()
    from calexec.machines.executor import ExecutorConfig as Config

    async def main():
        executor = DeviceExecutor(CalRT.load(), MANIFEST, Config(calbin_path=calbin))
        embedding = example.Embedding(executor, 2)
        assert (await embedding.call(executor.start)).ok
        server = example.JsonLineServer(embedding)
        await server.start()
        try:
            long_prompt = await _ask(server.port, json.dumps(
                {"prompt": [5] * 40_000, "max_tokens": 2}).encode())
            huge_id = await _ask(server.port, b'{"prompt": [1000000000000], "max_tokens": 2}')
            too_long = await _ask(server.port, b'{"prompt": [' + b"1, " * 400_000 + b"1]}")
            after = await _ask(server.port, json.dumps(
                {"prompt": PROMPT, "max_tokens": 2}).encode())
        finally:
            status = await server.drain(BOUND_S)
        return long_prompt, huge_id, too_long, after, status, embedding

    long_prompt, huge_id, too_long, after, status, embedding = asyncio.run(main())
    assert long_prompt and long_prompt[-1].get("done") is True, long_prompt
    assert len(long_prompt[-1]["tokens"]) == 2
    assert huge_id and huge_id[-1]["error"]["code"] == "request.invalid", huge_id
    assert "prompt[0]=1000000000000" in huge_id[-1]["error"]["message"]
    assert too_long and too_long[-1]["error"]["code"] == "request.invalid", too_long
    assert "longer than" in too_long[-1]["error"]["message"]
    assert after[-1] == {"done": True, "finish_reason": "length",
                         "tokens": expected_greedy(PROMPT, 1)}
    assert status.ok and embedding.ex.state == "Stopped"
    assert embedding.free.qsize() == 2 and not embedding.withheld


# ---- a bool where a deadline belongs ----------------------------------------------------------
@pytest.mark.parametrize("flag", [True, False, np.bool_(True)], ids=["True", "False", "np.True_"])
def test_a_bool_deadline_is_refused_at_construction_naming_it(flag):
    """``InferenceRequest(deadline=True)`` (a flag where the deadline belongs) was taken as
    1.0, a monotonic time long past, and answered ``admission.deadline`` (504, "the deadline
    passed"), where every other field refuses a bool ("a bool is no int here") and so do a
    handle's waits and ``shutdown``'s grace; now a TypeError naming ``deadline``."""
    with pytest.raises(TypeError, match=r"InferenceRequest\.deadline=.*got bool"):
        InferenceRequest(seq_id=1, kind=TaskKind.DECODE, tokens=np.zeros(1, np.int32),
                         positions=np.zeros(1, np.int32), past_len=0, deadline=flag)
