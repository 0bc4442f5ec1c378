"""The job chart's rules, proved through the executor (issue 24: every chart rule is one an
executor test depends on, not only the tests of the chart alone).

Each test drives the real executor, stepped (``threads=False``: the test's thread runs
admission, the submitter and the completion in a fixed order), on the bundled emulator, and
reads what the executor shows: the job's result, its trail (``job_trail``: the path the
executor's chart run took, with the guards that refused an event), the pool and the KV
coordinator. ``calexec charts mutate`` runs this file (its default test command); the mutants
each test kills are named in its docstring.
"""

from __future__ import annotations

import pytest

from calexec.contracts.status import Status
from calexec.machines.kv import KvCoordinator
from calexec.machines.pool import BufferPool
from executor_harness import deadline, prefill, running_job_path, write_calbin

PROMPT = [4, 6, 1, 7, 3]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("chart_rules_job"))


def steps(ex, handle):
    """The job's trail as (event, from, to, refused_by) tuples."""
    trail = ex.job_trail(handle.job_id)
    assert trail is not None, handle
    return [(s["event"], s["from"], s["to"], s["refused_by"]) for s in trail["trail"]]


def test_a_job_cancelled_during_its_kv_reservation_is_never_admitted(calbin, monkeypatch):
    """§6.2/FI11: admission checks the cancel flag after the KV reservation (``admit`` is
    guarded by ``not_cancelled``): a job cancelled while its KV was being reserved is not
    admitted, never leases a buffer slot, and gives its reservation back; it ends Failed
    with ``request.cancelled``. (The reservation itself checks the flag only when it has to
    wait for capacity; here it does not.)

    Kills ``guard-true:Created-admit->Admitted:not_cancelled`` (the job is admitted and leases
    a slot; only the next guard stops it)."""
    created, leased = [], []
    reserve, acquire = KvCoordinator.reserve, BufferPool.acquire

    def reserve_then_cancel(self, *args, **kwargs):
        txn = reserve(self, *args, **kwargs)
        for handle in created:
            handle.cancel()  # a cancel arriving while the KV was being reserved
        return txn

    def recording_acquire(self, kind, *args, owner=None, **kwargs):
        leased.append(owner)
        return acquire(self, kind, *args, owner=owner, **kwargs)

    with running_job_path(calbin, threads=False) as ex:
        monkeypatch.setattr(KvCoordinator, "reserve", reserve_then_cancel)
        monkeypatch.setattr(BufferPool, "acquire", recording_acquire)
        handle = ex.enqueue(prefill(1, PROMPT), on_created=created.append)
        result = handle.wait_until(deadline())
        assert isinstance(result, Status) and result.code == "request.cancelled", result
        assert handle.state == "Failed"
        assert handle.job_id not in leased  # never leased a slot
        assert steps(ex, handle)[0] == ("admit", "Created", None, ["not_cancelled"])
        view = ex.kvc.seqs[1]
        assert view.open_txn is None and view.reserved_len == 0  # the reservation went back
        assert ex.snapshot()["slots"]["Free"] == len(ex.pool.slots)
