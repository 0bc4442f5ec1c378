"""Model-based test of the executor over the real cffi driver and emulator (spec §5).

Both sides run stepped: the executor without threads (``submit_one`` / ``complete_one`` are
rules) and the emulator in its stepped mode (device stages are rules), so hypothesis chooses
and shrinks the interleavings of enqueue, cancel, submit, device progress, completion, fault
plan changes and sequence resets. One ``@invariant`` per §5.1 invariant (1-8) plus the lock
order and the in-flight bound. Every delivered result is checked against the numpy oracle,
which mirrors each sequence's committed KV.

The invariants see the runtime calls through an instrumented driver: the device and every
output buffer are wrapped so that the executor function calling ``infer`` / ``Wait`` is
recorded (invariant 2: only the submitter step infers, only the completion step waits).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.status import Status
from calexec.drivers import oracle
from calexec.drivers.runtime import Did, Fault, FaultMode, Stage
from calexec.machines.job import InferenceResult
from executor_harness import SEED, decode, make_executor, prefill, write_calbin

EXAMPLES = int(os.environ.get("CALEXEC_STATEFUL_EXAMPLES", "2000" if os.environ.get("CI") else "300"))
SEQS = (1, 2, 3)
FAULTS = ("SUBMIT_RC", "WAIT_RC", "CCU_EXCEPTION", "OUTPUT_NAN", "OUTPUT_SHORT", "UNKNOWN_CSR",
          "CAN_ALLOCATE_FALSE", "APPLY_FALSE", "SLICE_FAIL")
CALBIN: dict[str, str] = {}


class Recorder:
    """Wraps a runtime object, recording which executor function called ``name``."""

    def __init__(self, inner, name: str, log: list[str]) -> None:
        self._inner, self._name, self._log = inner, name, log

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        if attr != self._name:
            return value

        def recorded(*args, **kwargs):
            self._log.append(sys._getframe(1).f_code.co_name)
            return value(*args, **kwargs)

        return recorded


class ExecutorMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.ex = make_executor(CALBIN["path"], "kv_blocks=10;kv_block_size=16", threads=False,
                                slots_per_kind=len(SEQS), check_lock_order=True,
                                timeout_grace_s=0.0)
        ex = self.ex
        self.infer_callers: list[str] = []
        self.wait_callers: list[str] = []
        ex.device = Recorder(ex.device, "infer", self.infer_callers)
        for slot in ex.pool.slots:
            slot.outbuf = Recorder(slot.outbuf, "wait", self.wait_callers)
        self.host = {slot.slot_id: (id(slot.host_input), slot.host_input.ctypes.data,
                                    slot.host_output.ctypes.data, slot.host_output.nbytes)
                     for slot in ex.pool.slots}
        self.emu = ex.device.emu
        assert self.emu.set_stepped(True) == 0
        self.oracles = {seq: oracle.OracleSequence(SEED) for seq in SEQS}
        self.jobs: list = []  # (handle, seq, tokens, past, want)
        self.checked: set[int] = set()

    def teardown(self):
        ex = getattr(self, "ex", None)
        if ex is None:
            return
        self.emu.set_stepped(False)
        status = ex.shutdown(grace=5.0)
        assert status.ok, status
        assert ex.pool.counts()["Leased"] == 0 and ex.pool.counts()["InFlight"] == 0

    # ---- helpers ---------------------------------------------------------------------------
    def committed(self, seq: int) -> int:
        view = self.ex.kvc.seqs.get(seq)
        return 0 if view is None else view.committed_len

    def live_jobs(self):
        return [h._job for h, *_ in self.jobs if not h.done]

    def settle_results(self):
        """Check resolved jobs against the oracle and advance the oracle on commits."""
        for handle, seq, tokens, past, want in self.jobs:
            job = handle._job
            if not handle.done or job.job_id in self.checked:
                continue
            self.checked.add(job.job_id)
            txn = job.txn
            if txn is not None and txn.run.state == "Committed":
                ref = self.oracles[seq]
                ref.run(list(tokens), past)
                if isinstance(job.result, InferenceResult):
                    logits = oracle.bf16_to_f32(oracle.logits_bf16(ref.states[-1]))
                    base, count = want if want is not None else (0, logits.shape[0])
                    assert np.array_equal(job.result.logits, logits[base:base + count])
            elif isinstance(job.result, InferenceResult):
                raise AssertionError(f"result delivered without a KV commit: {job!r}")

    # ---- rules: the public operations --------------------------------------------------------
    def pick_seq(self, data) -> int:
        """Mostly a sequence with no open job (a busy one must be refused: kv.sequence_busy)."""
        free = [s for s in SEQS if self.ex.kvc.seqs.get(s) is None
                or self.ex.kvc.seqs[s].open_txn is None]
        busy_on_purpose = data.draw(st.integers(0, 9)) == 0
        return data.draw(st.sampled_from(SEQS if busy_on_purpose or not free else free))

    @rule(n=st.integers(1, 20), rewind=st.booleans(),
          want=st.one_of(st.none(), st.tuples(st.integers(0, 151000), st.integers(1, 900))),
          data=st.data())
    def enqueue_prefill(self, n, rewind, want, data):
        seq = self.pick_seq(data)
        past = 0 if rewind else self.committed(seq)
        tokens = data.draw(st.lists(st.integers(0, 151935), min_size=n, max_size=n))
        handle = self.ex.enqueue(prefill(seq, tokens, past, seconds=0.02, want_logits=want))
        self.jobs.append((handle, seq, tokens, past, want))

    @rule(token=st.integers(0, 151935), data=st.data())
    def enqueue_decode(self, token, data):
        seq = self.pick_seq(data)
        past = self.committed(seq)
        handle = self.ex.enqueue(decode(seq, token, past, seconds=0.02))
        self.jobs.append((handle, seq, [token], past, None))

    @rule(data=st.data())
    def cancel(self, data):
        if self.jobs:
            handle = data.draw(st.sampled_from([h for h, *_ in self.jobs]))
            was_done = handle.done
            assert handle.cancel() is (not was_done)

    @rule()
    def submit(self):
        self.ex.submit_one()
        self.settle_results()

    @rule()
    def device_stage(self):
        rc, _did = self.emu.step(0, Stage.NONE)
        assert rc == 0

    @precondition(lambda self: bool(self.ex._completion_q))
    @rule()
    def complete(self):
        self.finish_head_on_device()
        assert self.ex.complete_one()
        self.settle_results()

    @rule()
    def submit_and_complete(self):
        """The common case compressed into one rule, so long histories stay cheap."""
        if self.ex.submit_one() and self.ex._completion_q:
            self.finish_head_on_device()
            assert self.ex.complete_one()
        self.settle_results()

    def finish_head_on_device(self):
        for _ in range(8):  # bounded: a job has four stages
            rc, did = self.emu.step(0, Stage.JOB)
            assert rc == 0
            if did in (Did.NOTHING, Did.SIGNAL):
                break

    @rule(point=st.sampled_from(FAULTS), nth=st.integers(1, 3))
    def arm_fault(self, point, nth):
        assert self.emu.set_fault(Fault[point], FaultMode.NTH, nth, 0, 0) == 0

    @rule(seq=st.sampled_from(SEQS))
    def reset_sequence(self, seq):
        status = self.ex.kvc.reset_sequence(seq)
        if status.ok:
            self.oracles[seq] = oracle.OracleSequence(SEED)
        else:
            assert status.code == "kv.sequence_busy"

    # ---- §5.1 invariants ---------------------------------------------------------------------------
    @invariant()
    def inv1_executor_owns_device_calbin_kv(self):
        ex = self.ex
        assert all(slot.model in ex._models.values() for slot in ex.pool.slots)
        assert ex.kvc.kv is ex.kv

    @invariant()
    def inv2_only_submitter_infers_only_completion_waits(self):
        assert set(self.infer_callers) <= {"_submit"}
        assert set(self.wait_callers) <= {"_complete", "_runtime_still_holds"}

    @invariant()
    def inv3_slot_belongs_to_at_most_one_job(self):
        owners: dict[int, int] = {}
        for job in self.live_jobs():
            if job.lease is not None and job.lease.held:
                sid = job.lease.slot.slot_id
                assert sid not in owners, f"slot {sid} held by {owners[sid]} and {job.job_id}"
                owners[sid] = job.job_id
        for slot in self.ex.pool.slots:
            if slot.run.state in ("Leased", "InFlight"):
                assert slot.slot_id in owners, f"{slot!r} leased but owned by no live job"

    @invariant()
    def inv4_host_storage_never_moves_while_mapped(self):
        for slot in self.ex.pool.slots:
            assert self.host[slot.slot_id] == (id(slot.host_input), slot.host_input.ctypes.data,
                                               slot.host_output.ctypes.data,
                                               slot.host_output.nbytes)

    @invariant()
    def inv5_job_generation_matches_pool(self):
        gen = self.ex.pool.generation_id
        for job in self.live_jobs():
            assert job.generation_id == gen
            if job.lease is not None and job.lease.held:
                assert job.lease.slot.generation_id == gen

    @invariant()
    def inv6_kv_commit_only_after_device_done_and_valid(self):
        for seq in SEQS:
            view = self.ex.kvc.seqs.get(seq)
            if view is None or view.unknown_reason is not None:
                continue
            if view.open_txn is None or view.open_txn.__class__.__name__ == "_Claim" or \
                    view.open_txn.run.state == "Reserved":
                rc, device_len = self.ex.kv.seq_len(seq)
                assert rc == 0 and device_len == view.committed_len, (seq, device_len, view)
        for handle, *_ in self.jobs:
            job = handle._job
            if job.txn is not None and job.txn.run.state == "Committed":
                assert job.device_status == DeviceJobStatus.DONE and job.wait_rc == 0
                assert job.output_status is not None and job.output_status.ok

    @invariant()
    def inv7_cancel_never_frees_device_held_buffers(self):
        for job in self.live_jobs():
            if job.txn is not None and job.txn.run.state == "Submitted":
                assert job.lease.held and job.lease.slot.run.state == "InFlight"

    @invariant()
    def inv8_old_generation_slots_quarantined(self):
        gen = self.ex.pool.generation_id
        for slot in self.ex.pool.slots:
            assert slot.generation_id == gen or slot.run.state in ("Quarantined", "Retired")

    @invariant()
    def lock_order_respected(self):
        assert self.ex.locks.violations == []

    @invariant()
    def inflight_within_capacity(self):
        assert 0 <= self.ex._inflight <= self.ex.config.inflight_capacity

    @invariant()
    def failures_are_values_with_context(self):
        for handle, *_ in self.jobs:
            result = handle._job.result
            if isinstance(result, Status):
                assert result.job_id == handle.job_id and result.category is not None


ExecutorMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _calbin(tmp_path_factory):
    CALBIN["path"] = write_calbin(tmp_path_factory.mktemp("stateful"))


TestExecutorStateful = ExecutorMachine.TestCase
