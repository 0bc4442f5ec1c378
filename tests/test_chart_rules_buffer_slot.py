"""The buffer-slot chart's rules, proved through the executor (issue 24: every chart rule is one
an executor test depends on, not only the tests of the chart alone).

Each test drives the real executor, stepped (``threads=False``), on the bundled emulator, and
reads only what the executor shows (``snapshot()["slots"]``, the pool's ``counts()``, the
lifecycle, a job's result). The runtime is the emulator behind a thin double that makes one
runtime answer disagree with the executor's own bookkeeping: that is where the chart's guards
(asked of the runtime, never assumed) decide, and where a wrong chart would reuse or tear down
a buffer the runtime still uses. ``calexec charts mutate`` runs this file (its default test
command); the mutants each test kills are named in its docstring.
"""

from __future__ import annotations

import pytest

from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.job import InferenceResult
from executor_harness import arm, deadline, prefill, running_job_path, write_calbin

PROMPT = [5, 3, 8, 1, 9, 2]


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("chart_rules_slot"))


class LyingInfer:
    """The runtime device, except that the next ``infer()`` it accepts is answered with an
    error (18, UNAVAILABLE) although the job was queued and runs: a runtime whose return code
    and ``GetStatus`` disagree. Everything else is the device itself."""

    def __init__(self, device) -> None:
        self._device = device
        self.lie = False

    def __getattr__(self, name):
        return getattr(self._device, name)

    def infer(self, *args):
        rc = self._device.infer(*args)
        if self.lie and rc == 0:
            self.lie = False
            return 18
        return rc


class FailingUndo:
    """A slot's input buffer whose ``UndoSlice`` fails (rc 14); the rest is the buffer."""

    def __init__(self, inbuf) -> None:
        self._inbuf = inbuf

    def __getattr__(self, name):
        return getattr(self._inbuf, name)

    def undo_slice(self, name):
        return 14



class FailingStatus:
    """A slot's output buffer whose ``GetStatus`` fails (rc 18) though it names DONE."""

    def __init__(self, outbuf) -> None:
        self._outbuf = outbuf

    def __getattr__(self, name):
        return getattr(self._outbuf, name)

    def get_status(self):
        return 18, int(DeviceJobStatus.DONE)


def test_a_get_status_that_failed_is_never_the_runtime_letting_go(calbin):
    """``runtime_done`` (the guard of ``device_done`` and ``retire``, and what ``reap_held``
    asks) reads the runtime's status only when ``GetStatus`` itself succeeded: a failed
    call says nothing about the buffers, whatever status it carries, so a held slot stays
    held and a quarantined one is not torn down (found by a hand mutant of
    ``runtime_done``, stop 48)."""
    with running_job_path(calbin, threads=False) as ex:
        slot = ex.pool.slots[0]
        real = slot.outbuf
        assert slot.runtime_let_go()  # idle: the runtime's own answer
        slot.outbuf = FailingStatus(real)
        try:
            assert not slot.runtime_let_go()
            assert slot.runtime_answer == (18, DeviceJobStatus.DONE)
        finally:
            slot.outbuf = real

def test_a_slot_whose_undo_slice_failed_is_quarantined_not_reused(calbin):
    """FI15/§6.5: a slot goes back to the free list only after every SliceTensor was undone;
    a slot returned with a slice still active is quarantined (never leased again), while the
    job's valid result is still delivered. The runtime here fails UndoSlice, so the slot
    really comes back sliced (the emulator still counts its active slices).

    Kills ``guard-true:Leased-give_back->Free:undo_slice_done`` (the slot goes Free),
    ``drop:Leased-give_back->Quarantined`` (the release raises), and
    ``target:Leased-give_back->Quarantined:Leased|Retired`` (the slot stays leased for ever,
    or is retired in a generation that still serves)."""
    with running_job_path(calbin, threads=False) as ex:
        slots = ex.snapshot()["slots"]
        assert slots["Free"] == len(ex.pool.slots)
        for slot in ex.pool.slots:
            slot.inbuf = FailingUndo(slot.inbuf)
        handle = ex.enqueue(prefill(1, PROMPT))
        assert ex.submit_one() and ex.complete_one()
        result = handle.wait_until(deadline())
        assert isinstance(result, InferenceResult), result  # FI15: the result stands
        slots = ex.snapshot()["slots"]
        assert slots["Quarantined"] == 1, slots
        assert slots["Free"] == len(ex.pool.slots) - 1, slots
        assert slots["Leased"] == slots["InFlight"] == slots["Retired"] == 0, slots
        slot = next(s for s in ex.pool.slots if s.run.state == "Quarantined")
        rc, active = slot.inbuf.active_slices()  # the emulator's ground truth
        assert rc == 0 and active == 2
        codes = [status.code for status in ex.faults.reports]
        assert "internal.undo_slice_missing" in codes, codes
        # the runtime's own error is reported as it first answered: the first tensor undone
        undo = next(status for status in ex.faults.reports if status.raw == 14)
        assert "UndoSlice('input_ids')" in undo.message, undo


def test_a_slot_the_runtime_still_runs_is_quarantined_and_never_torn_down(calbin):
    """§4.2/§5.1-4: a slot whose job failed at ``infer()`` goes back to the pool only once the
    runtime itself says it is done with the slot's buffers (``runtime_done``: GetStatus,
    asked, never assumed from the return code); a lease released while the runtime still runs
    the slot quarantines it (``drop_in_flight``). §9.1/§5.1-8: a generation is torn down (its
    slots retired, their buffers destroyed) only once the runtime confirms it let go of every
    slot (``reset_confirmed``); otherwise the rebuild is refused and the lifecycle ends Failed
    for the supervisor, the slot's buffers still mapped.

    The runtime answers one ``infer()`` with an error although it queued the job, which hangs
    on the device: the executor's own bookkeeping (no permit held, nothing to drain) says the
    slot is free; only the runtime's answer says otherwise.

    Kills ``guard-true:InFlight-device_done->Leased:runtime_done`` (the slot goes Free while
    the device runs it), ``drop:InFlight-drop_in_flight->Quarantined`` and
    ``target:InFlight-drop_in_flight->Quarantined:InFlight|Retired`` (the release raises,
    leaves the slot InFlight for ever, or retires it in a generation that still serves), and
    ``guard-true:Quarantined-retire->Retired:reset_confirmed`` (the rebuild tears down a
    buffer the device still runs a job on)."""
    with running_job_path(calbin, threads=False, execution_timeout_s=1.0,
                          golden_timeout_s=2.0) as ex:
        device = ex.device = LyingInfer(ex.device)
        arm(ex, "HANG")  # the next accepted job never ends until a reset
        device.lie = True
        handle = ex.enqueue(prefill(1, PROMPT))
        assert ex.submit_one()
        status = handle.wait_until(deadline())
        assert isinstance(status, Status) and status.raw == 18 and status.phase is Phase.SUBMIT
        pool = ex.pool
        running = [s for s in pool.slots if s.outbuf.get_status() in (
            (0, DeviceJobStatus.PENDING), (0, DeviceJobStatus.RUNNING))]
        assert len(running) == 1  # the runtime's answer: it runs the job on this slot
        slot = running[0]
        snap = ex.snapshot()
        assert snap["inflight"] == 0  # the executor believes the runtime holds nothing
        assert slot.run.state == "Quarantined", slot
        assert snap["slots"]["Quarantined"] == 1, snap["slots"]
        assert snap["slots"]["Free"] == len(pool.slots) - 1, snap["slots"]
        assert snap["slots"]["InFlight"] == snap["slots"]["Retired"] == 0, snap["slots"]

        # a rebuild without a reset (a LIFECYCLE rebuild, a model switch): the executor's drain
        # passes, the runtime's answer does not
        status = ex.recover(Status.failure("test.rebuild", Category.LIFECYCLE, Phase.RECOVERY,
                                           "rebuild without a reset"), reset=False)
        assert status.code == "recovery.buffers_in_use", status
        assert ex.state == "Failed"
        assert slot.run.state == "Quarantined" and slot.outbuf is not None
        # the slots the runtime let go of are retired; the one it runs keeps its buffers
        assert pool.counts()["Quarantined"] == 1
        assert pool.counts()["Retired"] == len(pool.slots) - 1
        assert device.reset() == 0  # let the emulator abort the hung job
