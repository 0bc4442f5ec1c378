"""Every declared Job and KV-transaction transition is reached through the real executor.

The test is parametrised over the charts' declared transitions (``compiled.JOB`` and
``compiled.KV_TXN``), not over a hand-written list: a transition added to a chart becomes a
new test case that fails until a scenario drives the executor through it. Each scenario
runs a real executor on the emulator (threads or stepped) with the fault plan or a
concurrent cancel that the transition's guards call for; the test asserts the transition was
taken by the executor's own chart runs (the coverage recorder, scoped to the scenario).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import pytest

from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import Stage
from calexec.machines.compiled import CHARTS, JOB, KV_TXN
from calexec.machines.completion import Completion
from calexec.machines.coverage import recording as recording_transitions
from calexec.machines.job import job_of
from calexec.machines.paths import transition_paths
from calexec.machines.pool import BufferPool, BufferSlot
from executor_harness import arm, deadline, decode, greedy, prefill, until, write_calbin
from executor_harness import running_job_path as running_executor

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("paths"))


@contextmanager
def recording():
    """A transition recorder of one scenario's own (the suite's keeps recording beside it)."""
    with recording_transitions(CHARTS.values()) as recorder:
        yield recorder.hits


# ---- scenarios: each drives the executor along one family of paths ----------------------------
def happy_path(calbin):
    with running_executor(calbin) as ex:
        greedy(ex, 1, PROMPT, 2)


def ended(handle, state: str):
    """The job's end state: §6.2, a failure before submit ends Failed (nothing held by the
    runtime); §6.5/§9.1, a failure after submit ends Quarantined; its KV txn is closed in the
    state §7 gives it: RolledBack when the job never reached the device, Committed when the
    device finished it cleanly (a job cancelled after submit too, FI12: the KV truth is the
    device's), Unknown after a failure after submit."""
    assert handle.done and handle.state == state, (handle.state, state)
    txn = job_of(handle).txn  # §7: a job that ended leaves no open KV transaction
    assert txn is None or txn.run.final, txn
    if txn is not None:
        submitted = handle.timings.submitted_us > 0
        want = {"Succeeded": "Committed", "Quarantined": "Unknown"}.get(
            state, "Committed" if submitted else "RolledBack")
        assert txn.state == want, (txn, want)


def invalid_request(calbin):
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(1, []))
        assert isinstance(handle.wait_until(deadline()), Status)
        ended(handle, "Failed")


def enqueue_in_thread(ex, request):
    """Enqueue from another thread; return (thread, box) once the handle exists."""
    box, created = {}, threading.Event()

    def on_created(handle):
        box["handle"] = handle
        created.set()

    thread = threading.Thread(target=lambda: box.update(
        result=ex.enqueue(request, on_created=on_created)))
    thread.start()
    assert created.wait(5)
    return thread, box


def cancel_while_waiting_for_kv(calbin):
    with running_executor(calbin) as ex:
        arm(ex, "CAN_ALLOCATE_FALSE", "ALWAYS")
        thread, box = enqueue_in_thread(ex, prefill(1, PROMPT))
        until(lambda: ex.kvc.seqs.get(1) is not None and ex.kvc.seqs[1].open_txn is not None,
              what="the job to wait for KV capacity")
        assert box["handle"].state == "Created"  # blocked in the KV wait
        assert box["handle"].cancel()
        thread.join(5)
        res = box["result"].wait_until(deadline())
        assert isinstance(res, Status) and res.code == "request.cancelled"
        ended(box["result"], "Failed")


def cancel_while_waiting_for_slot(calbin):
    with running_executor(calbin, threads=False, slots_per_kind=1) as ex:
        first = ex.enqueue(prefill(1, PROMPT))  # holds the only prefill slot (queued)
        thread, box = enqueue_in_thread(ex, prefill(2, PROMPT))
        until(lambda: box["handle"].state == "Admitted", what="the job to wait for a slot")
        assert box["handle"].cancel()
        thread.join(5)
        res = box["result"].wait_until(deadline())
        assert isinstance(res, Status) and res.code == "request.cancelled"
        ended(box["result"], "Failed")
        first.cancel()
        ex.submit_one()


def lease_deadline(calbin):
    with running_executor(calbin, threads=False, slots_per_kind=1) as ex:
        ex.enqueue(prefill(1, PROMPT))
        handle = ex.enqueue(prefill(2, PROMPT, seconds=0.05))
        res = handle.wait_until(deadline())
        assert isinstance(res, Status) and res.code == "admission.deadline"
        ended(handle, "Failed")


def cancel_while_preparing(calbin, monkeypatch):
    original = BufferSlot.slice_input

    def slice_then_cancel(self, planned):
        for handle in created:
            handle.cancel()  # a cancel arriving while the job is being prepared
        return original(self, planned)

    created = []

    monkeypatch.setattr(BufferSlot, "slice_input", slice_then_cancel)
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(1, PROMPT), on_created=created.append)
        res = handle.wait_until(deadline())
        assert isinstance(res, Status) and res.code == "request.cancelled"
        ended(handle, "Failed")


def csr_failure(calbin):
    with running_executor(calbin) as ex:
        arm(ex, "UNKNOWN_CSR")
        handle = ex.enqueue(prefill(1, PROMPT))
        assert isinstance(handle.wait_until(deadline()), Status)
        ended(handle, "Failed")


def cancel_queued_and_submit_failure(calbin):
    with running_executor(calbin, threads=False) as ex:
        handle = ex.enqueue(prefill(1, PROMPT))
        handle.cancel()
        ex.submit_one()
        ended(handle, "Failed")
        arm(ex, "SUBMIT_RC", rc=18)  # unavailable: not retried
        handle = ex.enqueue(prefill(1, PROMPT))
        ex.submit_one()
        assert isinstance(handle.wait_until(deadline()), Status)
        ended(handle, "Failed")


def cancel_submitted(calbin):
    with running_executor(calbin, threads=False) as ex:
        assert ex.device.emu.set_stepped(True) == 0
        handle = ex.enqueue(prefill(1, PROMPT))
        ex.submit_one()
        handle.cancel()
        ex.device.emu.step(0, Stage.JOB)
        ex.complete_one()
        assert isinstance(handle.wait_until(deadline()), Status)
        ended(handle, "Failed")  # FI12: Wait returned cleanly, the result is discarded
        # cancelled after submit and Wait fails with the device done: Quarantined
        handle = ex.enqueue(prefill(2, PROMPT))
        ex.submit_one()
        handle.cancel()
        ex.device.emu.step(0, Stage.JOB)
        arm(ex, "WAIT_RC")
        ex.complete_one()
        assert handle.state == "Quarantined"


def cancel_submitted_then_wait_fails_while_running(calbin):
    with running_executor(calbin, threads=False, timeout_grace_s=0.0) as ex:
        assert ex.device.emu.set_stepped(True) == 0
        handle = ex.enqueue(prefill(1, PROMPT))
        ex.submit_one()
        handle.cancel()
        arm(ex, "WAIT_RC")
        ex.complete_one()  # Wait fails while the job is still queued on the device
        assert handle.state == "Quarantined"
        ex.device.emu.set_stepped(False)


def failures_after_submit(calbin):
    with running_executor(calbin, timeout_grace_s=2.0) as ex:
        greedy(ex, 1, PROMPT, 0)
        for point in ("CCU_EXCEPTION", "OUTPUT_NAN"):
            arm(ex, point)
            handle = ex.enqueue(decode(1, 1, len(PROMPT)))
            assert isinstance(handle.wait_until(deadline()), Status)
            ended(handle, "Quarantined")
            ex.kvc.reset_sequence(1)
            greedy(ex, 1, PROMPT, 0)
    with running_executor(calbin, "decode_us=50000", timeout_grace_s=2.0) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "WAIT_RC")  # Wait fails while the device still runs the job: keep buffers
        handle = ex.enqueue(decode(1, 1, len(PROMPT)))
        assert isinstance(handle.wait_until(deadline()), Status)
        ended(handle, "Quarantined")


def cancel_while_completing(calbin, monkeypatch):
    original = Completion.postprocess

    def postprocess_then_cancel(self, job, defer=False):
        if not job.internal:  # leave the start-up golden run alone
            job.cancel_flag = True  # a cancel arriving between Wait() and delivery
        return original(self, job, defer)

    monkeypatch.setattr(Completion, "postprocess", postprocess_then_cancel)
    with running_executor(calbin) as ex:
        handle = ex.enqueue(prefill(1, PROMPT))
        res = handle.wait_until(deadline())
        assert isinstance(res, Status) and res.code == "request.cancelled"
        ended(handle, "Failed")


def test_cancel_after_the_lease_prepares_nothing(calbin, monkeypatch):
    """§6.2/FI11: a job cancelled once its slot is leased never writes the slot's inputs: the
    ``not_cancelled`` guard of ``begin_preparation`` refuses it and it ends Failed."""
    created, sliced = [], []
    acquire, slice_input = BufferPool.acquire, BufferSlot.slice_input

    def acquire_then_cancel(self, *args, **kwargs):
        lease = acquire(self, *args, **kwargs)
        for handle in created:
            handle.cancel()  # a cancel arriving just after the lease
        return lease

    def recording_slice(self, planned):
        sliced.append(planned)
        return slice_input(self, planned)

    monkeypatch.setattr(BufferPool, "acquire", acquire_then_cancel)
    monkeypatch.setattr(BufferSlot, "slice_input", recording_slice)
    with running_executor(calbin) as ex:
        sliced.clear()  # the start-up golden run prepared its own jobs
        handle = ex.enqueue(prefill(1, PROMPT), on_created=created.append)
        res = handle.wait_until(deadline())
    assert isinstance(res, Status) and res.code == "request.cancelled"
    assert sliced == []
    ended(handle, "Failed")


def test_reset_quarantines_a_slot_still_leased(calbin):
    """§5.1-8 (invariant 8): a reset quarantines every slot of the old generation, a slot still
    leased to a request in preparation included (``Leased --quarantine--> Quarantined``, which
    the single-threaded tests never reach: there a lease is only held inside one call)."""
    with running_executor(calbin, threads=False) as ex:
        lease = ex.pool.acquire(TaskKind.PREFILL_IDS, deadline(), owner=0)
        slot = lease.slot
        assert slot.run.state == "Leased"
        ex.pool.quarantine_all()
        assert slot.run.state == "Quarantined"
        assert not lease.release().ok  # the request thread finds its slot gone
        assert slot.run.state == "Quarantined"


SCENARIOS = [happy_path, invalid_request, cancel_while_waiting_for_kv,
             cancel_while_waiting_for_slot, lease_deadline, cancel_while_preparing, csr_failure,
             cancel_queued_and_submit_failure, cancel_submitted,
             cancel_submitted_then_wait_fails_while_running, failures_after_submit,
             cancel_while_completing]


@pytest.fixture(scope="module")
def taken(calbin):
    """Run every scenario once, recording the transitions the executor's runs take."""
    hits = set()
    for scenario in SCENARIOS:
        with recording() as scoped, pytest.MonkeyPatch.context() as monkeypatch:
            if "monkeypatch" in scenario.__code__.co_varnames[:scenario.__code__.co_argcount]:
                scenario(calbin, monkeypatch)
            else:
                scenario(calbin)
        hits |= scoped
    return hits


@pytest.mark.parametrize("transition", [t for c in (JOB, KV_TXN) for t in c.transitions],
                         ids=lambda t: f"{t.key[0]}:{t.source}-{t.event}->{t.target}")
def test_declared_transition_reached_through_executor(taken, transition):
    path = next(p for p in transition_paths(JOB if transition.key[0] == "job" else KV_TXN)
                if p.transition == transition)
    assert transition.key in taken, (
        f"no executor scenario takes {transition.source} --{transition.event}--> "
        f"{transition.target} (chart path: {' -> '.join(path.events)}); add one to SCENARIOS")

