"""Stop 59 (embedder): an int too large for a float (``10**400``), a number like any other
to Python, given where the embedding API takes seconds or a deadline. Each place converted
it with ``float()`` or compared it with a float and raised ``OverflowError: int too large to
convert to float``, naming neither the call, the field nor the value (and from
``release_sequence``, whose refusals are values, an exception). Real executor on the bundled
emulator; every wait is bounded; nothing asserts a duration."""

from __future__ import annotations

import asyncio
import threading

import attrs
import pytest

from calexec.contracts.status import Status
from calexec.machines.executor import ExecutorConfig
from calexec.machines.job import InferenceResult
from executor_harness import deadline, prefill, running_executor, until, write_calbin

HUGE = 10**400  # beyond the largest float (about 1.8e308)


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe59"))


_NUMBER_FIELDS = [f.name for f in attrs.fields(ExecutorConfig)
                  if f.type in ("int", "float", int, float)]


def test_every_numeric_setting_is_found():
    assert {"max_pending_tokens", "execution_timeout_s", "golden_seq_id"} <= set(_NUMBER_FIELDS)


@pytest.mark.parametrize("name", _NUMBER_FIELDS)
@pytest.mark.parametrize("value", [HUGE, -HUGE], ids=["huge", "minus_huge"])
def test_a_setting_beyond_a_float_is_refused_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^ExecutorConfig\.{name}={value}: must be finite"):
        ExecutorConfig(calbin_path="model.calbin", **{name: value})


@pytest.mark.parametrize("value", [HUGE, -HUGE], ids=["huge", "minus_huge"])
def test_a_request_deadline_beyond_a_float_is_request_invalid(calbin, value):
    """A deadline beyond any float is as an infinite one: ``request.invalid`` (docs/
    embedding.md §2), never an exception of the converter that names nothing."""
    request = attrs.evolve(prefill(1, [3, 14, 15]), deadline=value)
    assert request.deadline == (float("inf") if value > 0 else float("-inf"))
    with running_executor(calbin) as ex:
        answer = ex.enqueue(request).result(10.0)
        assert isinstance(answer, Status) and answer.code == "request.invalid", answer
        stream = ex.decode_stream(1, 0, value)
        assert stream.closed and stream.status is not None
        assert stream.status.code == "request.invalid", stream.status


def test_a_wait_beyond_a_float_waits_without_limit_and_one_before_any_looks(calbin):
    """``wait_until(10**400)`` is a deadline that never passes (as ``1e300`` or ``math.inf``),
    ``result(10**400)`` a timeout that never ends, ``-10**400`` one passed already."""
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(1, [3, 14, 15]))
        first = handle.result(10.0)
        assert isinstance(first, InferenceResult), first
        for wait in (lambda: handle.wait_until(HUGE), lambda: handle.result(HUGE),
                     lambda: handle.wait_until(-HUGE), lambda: handle.result(-HUGE),
                     lambda: asyncio.run(handle.wait_async(HUGE)),
                     lambda: asyncio.run(handle.wait_async(-HUGE))):
            assert wait() is first


def test_release_with_a_wait_beyond_a_float_is_request_invalid_naming_it(calbin):
    with running_executor(calbin) as ex:
        answer = ex.release_sequence(1, HUGE)
        assert answer.code == "request.invalid", answer
        assert f"wait_s={HUGE}" in answer.message
        assert ex.release_sequence(1, 1.0).ok


def test_a_shutdown_grace_beyond_a_float_raises_naming_it_and_stops_nothing(calbin):
    with running_executor(calbin) as ex:
        with pytest.raises(ValueError, match=rf"^shutdown: grace={HUGE}: expected a finite"):
            ex.shutdown(HUGE)
        assert ex.state == "Ready"
        assert isinstance(ex.enqueue(prefill(1, [3, 14, 15])).wait_until(deadline()),
                          InferenceResult)
        assert ex.shutdown(5.0).ok


SHA = "ba8b41c989a906f22add01ea65f9c47b956b0fe6520025e74c03263c0b48a168"


@pytest.mark.parametrize("key", [SHA.upper(), SHA[:63], "sha256:" + SHA, "model.calbin"],
                         ids=["upper_case", "a_digit_short", "prefixed", "a_path"])
def test_a_goldens_key_that_is_no_sha256_is_refused_naming_it(key):
    """``ExecutorConfig.goldens`` overrides the goldens pinned next to the manifest, by calbin
    sha256; the lifecycle looks the calbin's lower-case hex digest up in it. A key that can
    never be one (upper case, as some tools print it, a digit short, ``sha256:``-prefixed, a
    path) was taken silently: the override never applied, and the warm-up checked the pinned
    golden instead (or refused the calbin ``golden.unpinned``) as if it had not been given.
    The goldens file refuses such a key ("must be 64 lower-case hex digits"); so does the
    config, naming the key."""
    with pytest.raises(ValueError, match=r"^ExecutorConfig\.goldens\[.*64 lower-case hex"):
        ExecutorConfig(calbin_path="model.calbin", goldens={key: (1, 2, 3)})
    assert ExecutorConfig(calbin_path="model.calbin", goldens={SHA: (1, 2, 3)}).goldens


def test_closing_a_stream_whose_step_waits_for_kv_ends_that_step(calbin):
    """A server's disconnect handler closes the stream while its owner's ``step`` waits for
    the KV block the next token needs (docs/embedding.md §3: close, then release). ``close()``
    returned at once and ``quiet`` said nothing was left, but the step went on waiting until
    the stream's deadline (then ``kv.deadline``), holding the owner's thread and the
    sequence: ``release_sequence`` answered ``kv.sequence_busy`` ("a bug in the order", the id
    withheld) though the caller had closed everything it held. ``cancel()`` reached that step
    (stop 53); ``close()`` now does too: the step answers CANCELLED, close waits for it
    (bounded), and the release answers OK."""
    with running_executor(calbin, "kv_blocks=2;kv_block_size=16;max_seqs=8") as ex:
        for seq in (1, 2):  # each holds one full block of the two: the next token needs one
            code, result = ex.decode_sync(prefill(seq, [3] * 16))
            assert code == 0, result
        stream = ex.decode_stream(1, 16, deadline(20.0))
        answers: list[object] = []
        owner = threading.Thread(target=lambda: answers.append(stream.step(7)), daemon=True)
        owner.start()
        until(lambda: ex.snapshot()["pending_tokens"] == 1, what="the step admitting")
        assert stream.close().code == "request.cancelled"
        assert stream.quiet
        released = ex.release_sequence(1, 1.0)
        assert released.ok, released
        owner.join(10.0)
        assert not owner.is_alive()
        assert isinstance(answers[0], Status) and answers[0].code == "request.cancelled", answers
