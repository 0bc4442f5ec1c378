"""No job of the hot path is left to the cyclic garbage collector (issue 17): a finished job,
its KV txn and their charts are freed by reference counting. Before the fix every job formed
a Job <-> KvTxn cycle (``txn.evidence``), so ~17 objects per token waited for the collector,
whose collections (~100 us, ~600 us for generation 1 on a 2-core VM) landed on tokens' P99.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest

from calexec.machines.job import InferenceResult, Job
from calexec.machines.kv import KvTxn
from executor_harness import deadline, decode, running_job_path, write_calbin
from test_executor_stream import open_stream


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def cyclic_garbage(run) -> list:
    """Objects of the control core that only the cyclic collector would free, left by
    ``run()`` (the collector is off meanwhile)."""
    gc.collect()
    gc.disable()
    try:
        run()
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        return [o for o in gc.garbage if isinstance(o, (Job, KvTxn))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


def test_finished_jobs_and_their_kv_txns_are_freed_without_the_cyclic_collector(calbin):
    with running_job_path(calbin) as ex:
        row = np.empty(ex.generation.vocab_size, np.float32)
        stream, token = open_stream(ex, 1, 24, logits_out=row, greedy_ahead=True,
                                    max_steps=12)

        def run() -> None:
            result, out = None, token
            for _ in range(12):  # the stream, greedy ahead
                result = stream.step(out)
                assert isinstance(result, InferenceResult), result
                out = result.argmax
            stream.close()
            past = result.kv_len
            for _ in range(8):  # one enqueue per token
                result = ex.enqueue(decode(1, out, past), logits_out=row).wait_until(deadline())
                assert isinstance(result, InferenceResult), result
                out, past = result.argmax, result.kv_len
            del result

        left = cyclic_garbage(run)
        assert left == [], f"{len(left)} jobs/txns left in reference cycles: {left[:4]}"
