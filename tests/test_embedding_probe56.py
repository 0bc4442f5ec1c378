"""Found at stop 56 by an embedder writing its own server on the executor (docs/embedding.md):
misuse of the documented API that the page's promises did not survive (errors are values,
never an exception for a request's value; a done callback that calls back in is refused,
never a stalled executor). Every case runs on the bundled emulator through the public API.

No timing threshold: every wait is bounded, and a bound that is reached fails the test.
"""

from __future__ import annotations

import pytest

from calexec.contracts.status import Status
from calexec.drivers.calrt.runtime import CalRT
from calexec.machines.executor import DeviceExecutor, ExecutorConfig
from calexec.machines.job import InferenceResult
from executor_harness import (
    MANIFEST,
    deadline,
    prefill,
    running_executor,
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
