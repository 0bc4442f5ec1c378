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
from calexec.drivers.calrt.runtime import Stage
from calexec.machines.job import JobHandle
from calexec.machines.kv import KvCoordinator
from calexec.machines.pool import BufferPool, BufferSlot
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


def cancel_on(monkeypatch, owner, method, created, before: bool = False):
    """Patch ``owner.method`` so that every handle in ``created`` is cancelled when it is
    called (``before``: ahead of the original call, else right after it)."""
    original = getattr(owner, method)

    def cancelling(self, *args, **kwargs):
        if before:
            for handle in created:
                handle.cancel()
        result = original(self, *args, **kwargs)
        if not before:
            for handle in created:
                handle.cancel()
        return result

    monkeypatch.setattr(owner, method, cancelling)


#: the job's state when the cancel reaches it
WHERE = ("Created", "Admitted", "Preparing", "Queued", "Submitted")


@pytest.mark.parametrize("where", WHERE)
def test_a_cancel_is_recorded_as_cancel_requested_wherever_it_lands(calbin, monkeypatch, where):
    """§4.2/§6.2/FI11/FI12: a cancel never ends a job by itself (§5.1-7: it stops delivery,
    it releases nothing): the job goes to CancelRequested wherever the cancel lands, and ends
    Failed from there, by ``fail`` once what it holds is released (before submit) or by
    ``wait_returned`` once the runtime finished cleanly (after submit: FI12, the result is
    discarded). The executor's record of the job's path (``job_trail``) shows it; the caller
    gets ``request.cancelled``.

    Kills ``target:<S>-cancel->CancelRequested:<S>`` for S in Created, Admitted, Preparing,
    Queued (the cancel leaves no trace and ``fail`` ends the job from S) and
    ``target:CancelRequested-wait_returned->Failed:CancelRequested`` (after a clean Wait the job
    stays CancelRequested and only the executor's fallback ``fail`` ends it). For these the
    executor's answer and the resources it releases are the same as the chart's; only the
    path it records differs."""
    created = []
    with running_job_path(calbin, threads=False) as ex:
        if where == "Admitted":  # just before the slot is leased
            cancel_on(monkeypatch, BufferPool, "acquire", created, before=True)
        elif where == "Preparing":  # while the inputs are sliced
            cancel_on(monkeypatch, BufferSlot, "slice_input", created)
        if where == "Submitted":
            assert ex.device.emu.set_stepped(True) == 0
        on_created = created.append
        if where == "Created":  # before admission starts (its first checkpoint)
            on_created = JobHandle.cancel
        handle = ex.enqueue(prefill(1, PROMPT), on_created=on_created)
        if where == "Queued":
            assert handle.state == "Queued" and handle.cancel()
            assert ex.submit_one()
        if where == "Submitted":
            assert ex.submit_one() and handle.state == "Submitted"
            assert handle.cancel()
            assert ex.device.emu.step(0, Stage.JOB)[0] == 0
            assert ex.complete_one()
        result = handle.wait_until(deadline())
        assert isinstance(result, Status) and result.code == "request.cancelled", result
        assert handle.state == "Failed"
        path = [step for step in steps(ex, handle) if step[2] is not None]  # taken ones
        recorded = ("cancel", where, "CancelRequested", None)
        assert recorded in path, path
        cancel = path.index(recorded)
        end = "wait_returned" if where == "Submitted" else "fail"
        assert path[cancel + 1:] == [(end, "CancelRequested", "Failed", None)], path
        assert ex.snapshot()["slots"]["Free"] == len(ex.pool.slots)
