"""Stop 61 (core, second): the fast paths of a decode (a pre-armed stream, greedy ahead) as a
claim of equality. One scripted history per case, run on the plain path (``enqueue``), on a
pre-armed stream and on a greedy-ahead stream, on the stepped executor (the step fired ahead
sits in the queue when the history's event comes) and on the threaded one (it has ended on
the device first: a bounded wait for that condition); the answers (code, category, tokens)
must be equal. Real executor on the bundled emulator; nothing asserts a duration.
"""

from __future__ import annotations

import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.job import InferenceResult
from executor_harness import (
    deadline,
    decode,
    make_executor,
    prefill,
    until,
    write_calbin,
)

PROMPT = [1, 2, 3, 4]
PATHS = ("enqueue", "prearm", "greedy")


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("probe61b"))


def _drive(ex, handle) -> None:
    if not ex.config.threads:  # stepped: this thread is the submitter and the completion
        while not handle.done and (ex.submit_one() or ex.complete_one()):
            pass


def _answer(result) -> tuple:
    """What a differential compares: the code and category of a refusal, the token and
    length of a result."""
    if isinstance(result, InferenceResult):
        return ("ok", result.argmax, result.kv_len)
    assert isinstance(result, Status), result
    return (result.code, result.category)


class _Caller:
    """One caller's decode of sequence 1 on one path: ``step(token)`` answers as the path
    answers it."""

    def __init__(self, ex, path: str, past: int) -> None:
        self.ex, self.path, self.past = ex, path, past
        self.stream = (None if path == "enqueue" else
                       ex.decode_stream(1, past, deadline(), greedy_ahead=path == "greedy"))

    def step(self, token: int):
        if self.stream is None:
            handle = self.ex.enqueue(decode(1, token, self.past))
            _drive(self.ex, handle)
            result = handle.wait_until(deadline())
        else:
            result = self.stream.step(token)
        if isinstance(result, InferenceResult):
            self.past = result.kv_len
        return result

    def ahead_ended(self) -> bool:
        ahead = None if self.stream is None else self.stream.ahead
        return ahead is None or (ahead[1] is not None and ahead[1].done)


def _event(ex, calbin, caller: _Caller, event: str) -> None:
    if event == "switch":  # a completed model switch (to the same calbin)
        status = ex.switch_model(calbin)
    elif event == "recover":  # a completed recovery (a device fault's, reset made)
        status = ex.recover(Status.failure("test.ccu_fault", Category.DEVICE, Phase.RECOVERY,
                                           "a CCU fault the test reports"))
    elif event == "release":
        status = ex.release_sequence(1, wait_s=5.0)
    elif event == "shutdown":
        status = ex.shutdown(5.0)
    else:
        raise AssertionError(event)
    assert status.ok, (event, status)


def _history(calbin, path: str, event: str, threads: bool, before: int
             ) -> tuple[list[tuple], int]:
    """Prefill, ``before`` decode steps (greedy: until one fired its next step ahead, at most
    ``before``), ``event``, then up to two more steps with the argmax. The answers, and how
    many steps came before the event."""
    ex = make_executor(calbin, threads=threads)
    try:
        if threads:  # the caller waits for each step: the completion thread fires ahead
            assert ex.device.emu.set_latency(decode_us=20000) == 0
        first = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 16))
        _drive(ex, first)
        result = first.wait_until(deadline())
        assert isinstance(result, InferenceResult), result
        caller = _Caller(ex, path, result.kv_len)
        answers = []
        for _ in range(before):
            result = caller.step(result.argmax)
            answers.append(_answer(result))
            assert isinstance(result, InferenceResult), result
            if path == "greedy" and caller.stream.ahead is not None:
                break
        if path == "greedy":
            # fired ahead with the argmax: queued (stepped) or ended on the device (threads)
            ahead = caller.stream.ahead
            assert ahead is not None and ahead[1] is not None, "nothing was fired ahead"
            if threads:
                until(caller.ahead_ended, what="the step fired ahead ended")
            else:  # nobody drives the stepped executor: it waits in the queue
                assert not ahead[1].done
        taken = len(answers)
        _event(ex, calbin, caller, event)
        for _ in range(2):
            result = caller.step(result.argmax)
            answers.append(_answer(result))
            if not isinstance(result, InferenceResult):
                break
        if caller.stream is not None:
            caller.stream.close()
        return answers, taken
    finally:
        ex.shutdown(5.0)


def _differential(calbin, event: str, threads: bool) -> dict[str, list[tuple]]:
    """The history on the three paths: the greedy one first (how many steps it took until
    one was fired ahead: the others take as many before the event)."""
    greedy, taken = _history(calbin, "greedy", event, threads, before=8)
    answers = {path: _history(calbin, path, event, threads, before=taken)[0]
               for path in PATHS if path != "greedy"}
    answers["greedy"] = greedy
    return answers


@pytest.mark.parametrize("threads", [False, True], ids=["stepped", "threads"])
@pytest.mark.parametrize("event", ["switch", "recover"])
def test_a_step_after_a_completed_generation_change_answers_as_the_plain_path(
        calbin, event, threads):
    """A greedy stream's step taken after a completed ``switch_model`` (or recovery) adopted
    the job fired ahead before it: ``lifecycle.unavailable`` "device recovering after
    lifecycle.model_switch; retry later" when that job was still queued (the switch refused
    it), though the switch had finished, and the old generation's ``OK`` (a token decoded on
    KV that went with it) when it had ended first; ``enqueue`` and a pre-armed stream answer
    ``kv.past_len_beyond_committed`` ("prefill it again"). Now all three answer alike."""
    answers = _differential(calbin, event, threads)
    plain = answers["enqueue"]
    assert plain[1][0] == "kv.past_len_beyond_committed", plain
    for path in PATHS:
        assert answers[path] == plain, (path, answers)


@pytest.mark.parametrize(("event", "threads"), [("release", True), ("shutdown", False),
                                                ("shutdown", True)])
def test_a_step_after_a_release_or_a_shutdown_answers_as_the_plain_path(calbin, event,
                                                                        threads):
    """The same differential across a ``release_sequence`` of the stream's sequence and a
    completed ``shutdown()``, each made while the step fired ahead waits in the queue
    (stepped) or after it ended (threads). (A release on the stepped executor finds the
    sequence busy on every path but the plain one: the queued step ahead, or the armed one,
    leaves only when whoever drives the executor runs it; docs/embedding.md §3.)"""
    answers = _differential(calbin, event, threads)
    plain = answers["enqueue"]
    for path in PATHS:
        assert answers[path] == plain, (path, answers)
