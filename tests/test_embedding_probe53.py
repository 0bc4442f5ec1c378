"""Found at stop 53 by an embedder writing its own server on the executor (docs/embedding.md):
what the page promises, checked with small programs on the bundled emulator through the public
API (``DeviceExecutor``, ``ExecutorConfig``, ``InferenceRequest``, handles, decode streams).

No timing threshold: every wait is bounded, and a bound that is reached fails the test.
"""

from __future__ import annotations

import threading

import pytest

from calexec.contracts.status import Status
from calexec.machines.job import InferenceResult
from executor_harness import (
    deadline,
    prefill,
    running_executor,
    until,
    write_calbin,
)

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
BOUND_S = 30.0  # a hang guard: reaching it fails the test
#: a prefill of PROMPT takes 8 x 60 ms of device time: long enough to shut down beside it
SLOW_PREFILL = "prefill_per_token_us=60000"


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


# ---- two shutdowns at once ---------------------------------------------------------------------
def test_a_shutdown_beside_another_threads_shutdown_waits_for_it_not_for_a_recovery(calbin):
    """docs/embedding.md section 6: shutdown is idempotent, and ``shutdown.recovery_busy``
    means a recovery or model switch outlived the grace and nothing was torn down. A second
    ``shutdown`` called while another thread's drained a job (a SIGTERM handler's beside a
    ``finally``) found ``recovery_mu`` held by that shutdown and answered
    ``shutdown.recovery_busy`` ("a recovery or model switch still runs ...; nothing was torn
    down") though no recovery ran and the other call was tearing everything down: a server
    exiting on it (exit 3) reported a state that never was. It now waits for the other
    shutdown within its grace: past it ``shutdown.in_progress``; within it, the answer of a
    call after it (OK, Stopped)."""
    with running_executor(calbin, device_config=SLOW_PREFILL) as ex:
        job = ex.enqueue(prefill(1, PROMPT, seconds=BOUND_S))
        until(lambda: ex.snapshot()["inflight"] == 1, BOUND_S, "the prefill on the device")
        answers: dict[str, Status] = {}

        def shut(name: str, grace: float) -> None:
            answers[name] = ex.shutdown(grace)

        first = threading.Thread(target=shut, args=("first", BOUND_S), name="shutdown-first")
        first.start()
        until(lambda: ex.state == "Draining" or "first" in answers, BOUND_S,
              "the first shutdown draining")
        short = threading.Thread(target=shut, args=("short", 0.05), name="shutdown-short")
        patient = threading.Thread(target=shut, args=("patient", BOUND_S),
                                   name="shutdown-patient")
        short.start()
        patient.start()
        for thread in (first, short, patient):
            thread.join(BOUND_S)
            assert not thread.is_alive(), thread.name
        assert answers["first"].ok, answers["first"]
        assert ex.state == "Stopped"
        assert isinstance(job.wait_until(deadline(BOUND_S)), InferenceResult)
        # the short one gave up waiting while the first drained: it says so, not "recovery"
        short_answer = answers["short"]
        assert short_answer.code == "shutdown.in_progress", short_answer
        assert "recovery" not in short_answer.message, short_answer
        # the patient one waited for the first and answers as a call after it
        assert answers["patient"].ok, answers["patient"]
        assert ex.shutdown(1.0).ok  # and later calls too
