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
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from calexec.contracts.status import Status
from calexec.drivers.calrt.runtime import Did, Fault, FaultMode, Stage
from calexec.drivers.synthetic import calbin as cb
from calexec.drivers.synthetic import oracle
from calexec.machines.chart_contracts import enable_contracts
from calexec.machines.charts import DECLARED
from calexec.machines.job import InferenceResult, job_of
from calexec.machines.tuning import HotPathTuning
from executor_harness import (
    SEED,
    deadline,
    decode,
    make_executor,
    oracle_golden,
    prefill,
    write_calbin,
)

# CI size 1200 (docs/testing.md: a longer run sets CALEXEC_STATEFUL_EXAMPLES)
EXAMPLES = int(os.environ.get("CALEXEC_STATEFUL_EXAMPLES", "1200" if os.environ.get("CI") else "300"))
SEQS = (1, 2, 3)
# KV-capacity faults (CAN_ALLOCATE_FALSE, APPLY_FALSE) make admission wait out its deadline;
# in this single-threaded machine that wait could only time out, so they are proven by the
# FI04 and stress tests instead, and jobs here get deadlines no step can reach: every
# outcome, and so every precondition, is then independent of how fast the machine runs
# (hypothesis requires the same draws and rule choices when it replays an example).
FAULTS = ("SUBMIT_RC", "WAIT_RC", "CCU_EXCEPTION", "OUTPUT_NAN", "OUTPUT_SHORT", "UNKNOWN_CSR",
          "SLICE_FAIL")
DEADLINE_S = 30.0
CALBIN: dict[str, str] = {}
CALBIN_SHA: dict[str, str] = {}
OTHER_SEED = SEED ^ 0x5A5A5A5A


class Recorder:
    """Wraps a runtime object, recording which executor function called ``names``."""

    def __init__(self, inner, names: tuple[str, ...], log: list[str]) -> None:
        self._inner, self._names, self._log = inner, names, log

    def __getattr__(self, attr):
        value = getattr(self._inner, attr)
        if attr not in self._names:
            return value

        def recorded(*args, **kwargs):
            self._log.append(sys._getframe(1).f_code.co_name)
            return value(*args, **kwargs)

        return recorded


class ExecutorMachine(RuleBasedStateMachine):
    CAPACITY = 1  # Phase A
    @initialize()
    def start(self):
        self.seeds = {CALBIN["path"]: SEED, CALBIN["other"]: OTHER_SEED}
        self.seed = SEED
        # 64 blocks of 16 tokens: more than an example can reserve (25 steps x <= 20 tokens)
        self.ex = make_executor(CALBIN["path"], "kv_blocks=64;kv_block_size=16",
                                inflight_capacity=self.CAPACITY, threads=False,
                                slots_per_kind=len(SEQS), check_lock_order=True,
                                timeout_grace_s=0.0,
                                # no rule hangs a golden run: its deadline is no timing
                                # threshold (2 s failed a start on a loaded CI host)
                                golden_timeout_s=30.0,
                                goldens={CALBIN_SHA[CALBIN["other"]]: oracle_golden(OTHER_SEED)},
                                # a guess expires by real time (50 ms by default): in this
                                # stepped machine only the rules may decide, or hypothesis's
                                # replay of an example would depend on how loaded the host is
                                tuning=HotPathTuning(auto_idle_s=DEADLINE_S))
        ex = self.ex
        self.infer_callers: list[str] = []
        self.wait_callers: list[str] = []
        self.emu = ex.device.emu
        ex.device = Recorder(ex.device, ("infer", "infer_with_fixed_task_type"),
                             self.infer_callers)
        self.host: dict = {}
        self.pools: list = []
        self.instrument_generation()
        assert self.emu.set_stepped(True) == 0
        self.oracles = {seq: oracle.OracleSequence(self.seed) for seq in SEQS}
        self.jobs: list = []  # (handle, seq, tokens, past, want)
        self.checked: set[int] = set()
        self.streams: dict = {}  # seq -> DecodeStream (issue 17: the next job pre-armed)
        self.cancelled: dict = {}  # seq -> the stream stream_close cancelled (another thread's)
        # this example's view of the chart contracts (the session checks them too)
        self.contracts = enable_contracts(*DECLARED.values(), raise_on_violation=False)

    def instrument_generation(self):
        """Wrap the current generation's output buffers and remember its host storage."""
        pool = self.ex.pool
        if pool is None or pool in self.pools:
            return
        self.pools.append(pool)
        for slot in pool.slots:
            slot.outbuf = Recorder(slot.outbuf, ("wait",), self.wait_callers)
            self.host[(pool.generation_id, slot.slot_id)] = (
                slot, id(slot.host_input), slot.host_input.ctypes.data,
                slot.host_output.ctypes.data, slot.host_output.nbytes)

    def teardown(self):
        contracts = getattr(self, "contracts", None)
        if contracts is not None:
            contracts.disable()
        ex = getattr(self, "ex", None)
        if ex is None:
            return
        self.emu.set_stepped(False)
        was_ready = ex.state == "Ready"
        status = ex.shutdown(grace=5.0)
        assert ex.state in ("Stopped", "Failed")
        assert status.ok or ex.state == "Failed", status
        if was_ready:  # FI13: a serving executor drains within the grace and ends Stopped
            assert status.ok and ex.state == "Stopped", (ex.state, status)
        for pool in self.pools:  # nothing leased, nothing left in flight, in any generation
            assert pool.counts()["Leased"] == 0 and pool.counts()["InFlight"] == 0
        for handle, *_ in self.jobs:  # the lifecycle never leaves a job waiting forever
            assert handle.done, handle

    # ---- helpers ---------------------------------------------------------------------------
    def committed(self, seq: int) -> int:
        view = self.ex.kvc.seqs.get(seq) if self.ex.gen is not None else None
        return 0 if view is None else view.committed_len

    def live_jobs(self):
        """Jobs not resolved yet, the pre-armed ones (holding a slot, no token yet) too."""
        self.track_ahead()
        return [job_of(h) for h, *_ in self.jobs if not h.done] + list(self.ex.dispatch.armed_jobs())

    def track_ahead(self):
        """Jobs a greedy-ahead stream's completion fired (not submitted by a rule) join the
        checked jobs as soon as they exist: one the caller never takes may still commit."""
        tracked = {id(job_of(h)) for h, *_ in self.jobs}
        for seq, stream in self.streams.items():
            ahead = stream.ahead
            if ahead is not None and ahead[1] is not None and id(job_of(ahead[1])) not in tracked:
                job = job_of(ahead[1])
                self.jobs.append((ahead[1], seq, [ahead[0]], job.request.past_len, None))

    def settle_results(self):
        """Check resolved jobs against the oracle and advance the oracle on commits."""
        self.track_ahead()
        for handle, seq, tokens, past, want in self.jobs:
            job = job_of(handle)
            if not handle.done or job.job_id in self.checked:
                continue
            self.checked.add(job.job_id)
            txn = job.txn
            if txn is not None and txn.run.state == "Committed":
                ref = self.oracles[seq]
                ref.run(list(tokens), past)
                if isinstance(job.result, InferenceResult):
                    logits = oracle.bf16_to_f32(oracle.logits_bf16(ref.states[-1]))
                    assert job.gen is None or job.generation_id == job.gen.id
                    base, count = want if want is not None else (0, logits.shape[0])
                    assert np.array_equal(job.result.logits, logits[base:base + count])
            elif isinstance(job.result, InferenceResult):
                raise AssertionError(f"result delivered without a KV commit: {job!r}")

    # ---- rules: the public operations --------------------------------------------------------
    def serving(self) -> bool:
        return self.ex.gen is not None

    def pick_seq(self, data) -> int:
        """Mostly a sequence with no open job (a busy one must be refused: kv.sequence_busy).
        The draws do not depend on the executor's state, only their mapping onto it."""
        free = [s for s in SEQS if self.ex.kvc.seqs.get(s) is None
                or self.ex.kvc.seqs[s].open_txn is None]
        busy_on_purpose = data.draw(st.integers(0, 9)) == 0
        index = data.draw(st.integers(0, len(SEQS) - 1))
        pool = SEQS if busy_on_purpose or not free else free
        return pool[index % len(pool)]

    @precondition(lambda self: self.serving())
    @rule(n=st.integers(1, 20), rewind=st.booleans(),
          want=st.one_of(st.none(), st.tuples(st.integers(0, 151000), st.integers(1, 900))),
          data=st.data())
    def enqueue_prefill(self, n, rewind, want, data):
        seq = self.pick_seq(data)
        past = 0 if rewind else self.committed(seq)
        tokens = data.draw(st.lists(st.integers(0, 151935), min_size=n, max_size=n))
        handle = self.ex.enqueue(prefill(seq, tokens, past, seconds=DEADLINE_S, want_logits=want))
        self.jobs.append((handle, seq, tokens, past, want))

    @precondition(lambda self: self.serving())
    @rule(token=st.integers(0, 151935), data=st.data())
    def enqueue_decode(self, token, data):
        seq = self.pick_seq(data)
        past = self.committed(seq)
        handle = self.ex.enqueue(decode(seq, token, past, seconds=DEADLINE_S))
        self.jobs.append((handle, seq, [token], past, None))

    @precondition(lambda self: self.serving() and bool(self.jobs))
    @rule(token=st.integers(0, 151935), steps=st.integers(1, 4))
    def decode_sync_run(self, token, steps):
        """A llama.cpp-style loop on the sequence of the last job: ``steps`` decodes, each
        enqueued once the one before resolved, driven like ``decode_sync``; the second and
        later ones take the submitter's implicit pre-arm (machines/autoarm.py) when it was
        armed, and every result is checked against the oracle like any other."""
        seq = self.jobs[-1][1]
        for _ in range(steps):
            past = self.committed(seq)
            handle = self.ex.enqueue(decode(seq, token, past, seconds=DEADLINE_S))
            self.jobs.append((handle, seq, [token], past, None))
            for _ in range(64):  # bounded: each turn submits, arms, fails or completes a job
                if handle.done:
                    break
                if self.ex.submit_one():
                    continue
                if not self.ex.completing:
                    break
                self.finish_head_on_device()
                self.ex.complete_one()
            self.settle_results()
            result = job_of(handle).result
            if not isinstance(result, InferenceResult):
                break
            token = result.argmax

    # ---- rules: the pre-armed decode stream (machines/stream.py) ----------------------------
    @precondition(lambda self: self.serving())
    @rule(seq=st.sampled_from(SEQS), ahead=st.booleans())
    def stream_open(self, seq, ahead=False):
        old = self.streams.get(seq)
        if old is not None and not old.closed:
            return
        self.streams[seq] = self.ex.decode_stream(seq, self.committed(seq), deadline(DEADLINE_S),
                                                  greedy_ahead=ahead)

    @rule(seq=st.sampled_from(SEQS), token=st.integers(0, 151935), follow=st.booleans())
    def stream_submit(self, seq, token, follow=False):
        stream = self.streams.get(seq)
        if stream is None or stream.current is not None:
            return
        self.track_ahead()
        ahead = stream.ahead
        if follow and ahead is not None and ahead[1] is not None:
            token = ahead[0]  # the caller steps with the argmax: takes the job fired ahead
        past = stream.past_len
        handle = stream.submit(token)
        if isinstance(handle, Status):
            assert stream.closed
            assert ahead is None or ahead[0] != token or stream.ahead is None
            return
        job = job_of(handle)
        if self.cancelled.get(seq) is stream:
            # cancelled (stream_close): the step goes the plain path's way, cancelled as it
            # is created; a step fired ahead is not adopted (found by CI at stop 73: the
            # model expected it adopted)
            assert ahead is None or ahead[1] is None or job is not job_of(ahead[1])
            self.jobs.append((handle, seq, [token], past, None))
            return
        if ahead is not None and ahead[1] is not None:
            assert job_of(handle) is job_of(ahead[1]) and ahead[0] == token  # greedy ahead: adopted
            assert job.request.past_len == past
            return  # tracked since it was fired
        # the token went in, unless the armed job was released before it came (fence, cancel:
        # then its handle carries why)
        assert job.request.tokens[0] == token or (job.done and job.timings.queued_us == 0)
        self.jobs.append((handle, seq, [token], past, None))

    @rule(seq=st.sampled_from(SEQS))
    def stream_wait(self, seq):
        stream = self.streams.get(seq)
        if stream is None or stream.current is None or not stream.current.done:
            return  # stepped: only a resolved step is waited for (the rules move the device)
        result = stream.wait()
        # a failed step closes the stream; a step in flight when it closed still delivers
        assert not isinstance(result, Status) or stream.closed
        self.settle_results()

    @precondition(lambda self: self.serving())
    @rule(seq=st.sampled_from(SEQS), token=st.integers(0, 151935), ahead=st.booleans(),
          follow=st.booleans())
    def stream_step(self, seq, token, ahead, follow):
        """A whole step compressed into one rule (open if needed, submit, run the device
        until it resolves, bounded; wait), so histories reach pre-armed steps often; with
        ``follow`` a greedy-ahead stream is stepped with the token it fired ahead."""
        stream = self.streams.get(seq)
        if stream is None or stream.closed:
            self.stream_open(seq, ahead)
        self.stream_submit(seq, token, follow)
        stream = self.streams[seq]
        for _ in range(6):  # bounded: a few queued jobs may go first
            if stream.current is None or stream.current.done:
                break
            self.submit_and_complete()
        self.stream_wait(seq)
        self.submit()  # the submitter, idle now, arms the next job

    @rule(seq=st.sampled_from(SEQS), cancel=st.booleans())
    def stream_close(self, seq, cancel):
        stream = self.streams.get(seq)
        if stream is not None:
            armed = stream.armed
            if cancel:  # another thread's cancel: the submitter releases the armed job
                stream.cancel()
                self.cancelled[seq] = stream
            else:
                stream.close()
                assert armed is None or (armed.done and armed.run.state == "Failed")

    @invariant()
    def prearmed_jobs_hold_exactly_a_slot_and_a_reserved_txn(self):
        armed = list(self.ex.dispatch.armed_jobs())
        assert len({id(j) for j in armed}) == len(armed)
        for job in armed:
            assert job.run.state in ("Preparing", "CancelRequested") and not job.done
            assert job.lease.held and job.lease.slot.run.state == "Leased"
            assert job.txn.run.state == "Reserved" and job.budget_taken
            assert job.gen is self.ex.gen  # fencing: never a job of a retired generation
            view = job.gen.kvc.seqs[job.request.seq_id]
            assert job.txn in (view.open_txn, view.next_txn)
        for stream in self.streams.values():
            # released by the submitter (cancel, deadline, fence): resolved, the stream learns
            # it at its next step; else still armed in the executor
            assert stream.armed is None or stream.armed in armed or stream.armed.done
            if stream.closed:
                assert stream.armed is None and stream.ahead is None
            elif stream.ahead is not None:  # fired ahead: queued, on the device or ended
                job = job_of(stream.ahead[1])
                assert job.done or job.run.state in ("Queued", "Submitted", "Completing",
                                                     "CancelRequested")

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

    @precondition(lambda self: bool(self.ex.completing))
    @rule()
    def complete(self):
        self.finish_head_on_device()
        assert self.ex.complete_one()
        self.settle_results()

    @rule()
    def submit_and_complete(self):
        """The common case compressed into one rule, so long histories stay cheap."""
        if self.ex.submit_one() and self.ex.completing:
            self.finish_head_on_device()
            assert self.ex.complete_one()
        self.settle_results()

    def finish_head_on_device(self):
        """Run the oldest submitted job to its end on its own engine (PING/PONG in Phase B);
        in Phase B the other engine's job may have to finish first (overlap knob)."""
        engine = max(0, int(self.ex.completion.head().lease.slot.engine))
        for _ in range(16):  # bounded: a job has four stages, at most two jobs in flight
            rc, did = self.emu.step(engine, Stage.JOB)
            assert rc == 0
            if did in (Did.NOTHING, Did.SIGNAL):
                break
            if did == Did.BLOCKED:
                self.emu.step(1 - engine, Stage.JOB)

    @rule(point=st.sampled_from(FAULTS), nth=st.integers(1, 3))
    def arm_fault(self, point, nth):
        assert self.emu.set_fault(Fault[point], FaultMode.NTH, nth, 0, 0) == 0

    @precondition(lambda self: self.serving())
    @rule(seq=st.sampled_from(SEQS))
    def reset_sequence(self, seq):
        status = self.ex.kvc.reset_sequence(seq)
        if status.ok:
            self.oracles[seq] = oracle.OracleSequence(self.seed)
        else:
            assert status.code in ("kv.sequence_busy", "kv.sequence_on_device")

    @precondition(lambda self: self.ex.life.recovery_pending)
    @rule()
    def run_recovery(self):
        """The controller asked for a recovery (reset/rebuild/rollback): run it."""
        self.recover_with(lambda: self.ex.life.run_pending_recovery())

    @precondition(lambda self: self.ex.state == "Ready")
    @rule(to_other=st.booleans(), golden_ok=st.booleans())
    def switch_model(self, to_other, golden_ok):
        path = CALBIN["other"] if to_other else CALBIN["path"]
        sha = CALBIN_SHA[path]
        if not golden_ok:  # a recorded golden that this calbin cannot meet: refused
            self.ex.goldens[sha] = (1, 2, 3)
        before = self.ex.gen.calbin_path
        status = self.recover_with(lambda: self.ex.switch_model(path))
        if not golden_ok:
            del self.ex.goldens[sha]
            assert not status.ok
            if self.ex.state == "Ready":  # rolled back: the previous calbin serves again
                assert self.ex.gen.calbin_path == before or path == before
            if path != before:  # §9.2: the last good calbin is known, so the switch rolls back
                assert self.ex.state == "Ready" and self.ex.gen.calbin_path == before, \
                    (self.ex.state, status)

    def recover_with(self, action):
        """Recovery drains through Wait(): let the device run by itself meanwhile. Faults
        armed for traffic are cleared first (a fault firing inside the golden is covered by
        test_recovery.py); the golden's own deadline bounds it either way."""
        assert self.emu.clear_all_faults() == 0
        assert self.emu.set_stepped(False) == 0
        before = self.ex.gen
        status = action()
        assert self.emu.set_stepped(True) == 0
        self.settle_results()
        self.instrument_generation()
        # a new generation: a fresh KvManager, every sequence empty. A recovery dropped because
        # a switch already replaced its generation leaves the serving one (and its KV) alone
        if self.ex.gen is not None and self.ex.gen is not before:
            self.seed = self.seeds[self.ex.gen.calbin_path]
            self.oracles = {seq: oracle.OracleSequence(self.seed) for seq in SEQS}
        return status

    @invariant()
    def implicit_prearms_are_armed_jobs_or_queued_guesses(self):
        """machines/autoarm.py: each guess is queued for the submitter or holds one armed,
        uncounted job of its sequence at the guessed position (stepped: never mid-arming)."""
        for entry in self.ex.dispatch.guesses():
            seq = entry.seq_id
            assert not entry.dropped and not self.ex.snapshot()["dispatch"]["arming"]
            job = entry.job
            if job is None:
                assert self.ex.dispatch.scheduled(entry)
            else:
                assert job in self.ex.dispatch.armed_jobs() and job.auto is entry and job.uncounted
                assert job.request.seq_id == seq and job.request.past_len == entry.past
        self.auto_seen = max(getattr(self, "auto_seen", 0), self.ex.counters["auto_prearmed"])

    @invariant()
    def lifecycle_is_ready_or_failed_between_rules(self):
        assert self.ex.state in ("Ready", "Failed"), self.ex.state
        if self.ex.state == "Failed":
            assert self.ex.failure is not None and not self.ex.failure.ok

    # ---- §5.1 invariants ---------------------------------------------------------------------------
    @invariant()
    def inv1_executor_owns_device_calbin_kv(self):
        gen = self.ex.gen
        if gen is not None:
            assert all(slot.model in gen.models.values() for slot in gen.pool.slots)
            assert gen.kvc.kv is gen.kv and self.ex.kv is gen.kv

    @invariant()
    def inv2_only_submitter_infers_only_completion_waits(self):
        assert set(self.infer_callers) <= {"_infer"}  # called only from _submit
        assert set(self.wait_callers) <= {"_complete", "_runtime_still_holds"}

    @invariant()
    def inv3_slot_belongs_to_at_most_one_job(self):
        owners: dict[tuple[int, int], int] = {}
        for job in self.live_jobs():
            if job.lease is not None and job.lease.held:
                slot = job.lease.slot
                key = (slot.generation_id, slot.slot_id)
                assert key not in owners, f"slot {key} held by {owners[key]} and {job.job_id}"
                owners[key] = job.job_id
        for pool in self.pools:
            for slot in pool.slots:
                if slot.run.state in ("Leased", "InFlight"):
                    assert (slot.generation_id, slot.slot_id) in owners, \
                        f"{slot!r} leased but owned by no live job"

    @invariant()
    def inv4_host_storage_never_moves_while_mapped(self):
        for (slot, *seen) in self.host.values():
            if slot.run.state == "Retired":  # unmapped: its runtime buffers are destroyed
                continue
            assert seen == [id(slot.host_input), slot.host_input.ctypes.data,
                            slot.host_output.ctypes.data, slot.host_output.nbytes]

    @invariant()
    def inv5_job_generation_matches_pool(self):
        for job in self.live_jobs():
            # a live job belongs to the serving generation: a recovery resolves every job of
            # the generation it tears down before opening the next one
            assert job.gen is self.ex.gen and job.generation_id == job.gen.id
            if job.lease is not None and job.lease.held:
                assert job.lease.slot.generation_id == job.generation_id

    @invariant()
    def inv6_kv_commit_only_after_device_done_and_valid(self):
        gen = self.ex.gen
        for seq in SEQS if gen is not None else ():
            view = gen.kvc.seqs.get(seq)
            if view is None or view.unknown_reason is not None:
                continue
            if view.open_txn is None or view.open_txn.__class__.__name__ == "_Claim" or \
                    view.open_txn.run.state == "Reserved":
                rc, device_len = gen.kv.seq_len(seq)
                assert rc == 0 and device_len == view.committed_len, (seq, device_len, view)
        # Its one-chart half, "a txn is Committed only once the device finished and the
        # output was valid", is a contract of the KV txn chart (machines/charts.py
        # ``commits_only_after_device_done_and_valid``), checked at the commit itself by every
        # run while contracts are on (tests/conftest.py): see contract_violations_reported.

    @invariant()
    def inv7_cancel_never_frees_device_held_buffers(self):
        for job in self.live_jobs():
            if job.txn is not None and job.txn.run.state == "Submitted":
                assert job.lease.held and job.lease.slot.run.state == "InFlight"

    @invariant()
    def inv8_old_generation_slots_quarantined(self):
        current = self.ex.pool
        for pool in self.pools:
            if pool is not current:
                assert all(slot.run.state in ("Quarantined", "Retired") for slot in pool.slots)

    @invariant()
    def contract_violations_reported(self):
        # machines/charts.py's contracts (the one-chart §5.1 invariants) raise from the send
        # that breaks them; one raised on a thread the executor catches is still recorded
        assert self.contracts.violations == [], [str(v) for v in self.contracts.violations]

    @invariant()
    def lock_order_respected(self):
        assert self.ex.locks.violations == []

    @invariant()
    def inflight_within_capacity(self):
        assert 0 <= self.ex.snapshot()["inflight"] <= self.ex.config.inflight_capacity

    @invariant()
    def resolved_jobs_rest_in_the_final_state_of_their_result(self):
        # §4.2: a delivered result is Succeeded; an error value is Failed (nothing held by the
        # runtime) or Quarantined (failed after submit); never a resolved job in a live state.
        for handle, *_ in self.jobs:
            if handle.done:
                expected = (("Succeeded",) if isinstance(job_of(handle).result, InferenceResult)
                            else ("Failed", "Quarantined"))
                assert handle.state in expected, (handle.state, job_of(handle).result)
                txn = job_of(handle).txn  # §7: and it leaves no open KV transaction
                assert txn is None or txn.run.final, txn

    @invariant()
    def failures_are_values_with_context(self):
        for handle, *_ in self.jobs:
            result = job_of(handle).result
            if isinstance(result, Status):
                assert result.job_id == handle.job_id and result.category is not None


ExecutorMachine.TestCase.settings = settings(
    max_examples=EXAMPLES, stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


@pytest.fixture(scope="module", autouse=True)
def _calbin(tmp_path_factory):
    directory = tmp_path_factory.mktemp("stateful")
    CALBIN["path"] = write_calbin(directory)
    CALBIN["other"] = str(directory / "other.calbin")
    CALBIN_SHA[CALBIN["path"]] = cb.write(str(directory / "again.calbin"), cb.default_spec())
    CALBIN_SHA[CALBIN["other"]] = cb.write(CALBIN["other"], cb.default_spec(seed=OTHER_SEED))


TestExecutorStateful = ExecutorMachine.TestCase


class PhaseBMachine(ExecutorMachine):
    """The same rules and invariants with two jobs in flight on PING/PONG (§6.4 Phase B)."""

    CAPACITY = 2


PhaseBMachine.TestCase.settings = settings(
    max_examples=max(EXAMPLES // 4, 50), stateful_step_count=25, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPhaseBStateful = PhaseBMachine.TestCase


def test_a_recovery_dropped_after_a_switch_leaves_the_serving_generations_kv_alone():
    """Found by a randomised run of TestPhaseBStateful (stop 59), replayed step by step: a CCU
    exception asks for a recovery of generation 1, a refused switch rolls back to generation
    3, and the pending recovery is then dropped (generation 3 serves since). The model reset
    its sequences at every recovery, so it expected sequence 2 empty where generation 3 had
    committed a token, and failed on the stream's next step (past 1 beyond length 0)."""
    state = PhaseBMachine()
    try:
        state.start()
        state.stream_step(ahead=False, follow=False, seq=2, token=0)
        state.arm_fault(nth=1, point="CCU_EXCEPTION")
        state.decode_sync_run(steps=1, token=0)
        state.switch_model(golden_ok=False, to_other=True)
        state.decode_sync_run(steps=1, token=0)
        state.stream_submit(follow=False, seq=2, token=0)
        assert state.ex.life.recovery_pending  # generation 1's, asked before the switch
        serving = state.ex.gen
        state.run_recovery()
        assert state.ex.gen is serving  # dropped: the generation and its KV stay
        state.device_stage()
        state.submit_and_complete()
        assert state.committed(2) == 2 and state.oracles[2].length == 2
    finally:
        state.teardown()


class _Draws:
    """Stands in for hypothesis's ``data`` in a step-by-step replay: answers each draw in
    turn (a callable is asked for its answer)."""

    def __init__(self, *answers) -> None:
        self.answers = list(answers)

    def draw(self, strategy):
        answer = self.answers.pop(0)
        return answer() if callable(answer) else answer


def test_a_dropped_recovery_leaves_the_device_stepped_with_no_stage_running():
    """Found by CI's run of TestExecutorStateful (stop 72's CI, the mutation step's unmutated
    run), replayed step by step: a decode sits queued on the stepped device when a pending
    recovery is run and dropped (a switch replaced its generation). ``recover_with`` lets the
    device run by itself for that moment; an engine thread began the queued job's compute,
    and the stream's next step met 17 (the engine busy in another thread). The emulator's
    ``set_stepped(True)`` now returns only once no stage is in progress."""
    state = ExecutorMachine()
    try:
        state.start()
        state.stream_open(ahead=False, seq=1)
        state.stream_submit(follow=False, seq=1, token=729)
        state.stream_step(ahead=False, follow=False, seq=3, token=11276)
        state.arm_fault(nth=2, point="CCU_EXCEPTION")
        state.arm_fault(nth=1, point="OUTPUT_SHORT")
        state.cancel(_Draws(lambda: next(h for h, *_ in state.jobs if h.done)))
        state.enqueue_decode(data=_Draws(1, 0), token=20037)
        state.decode_sync_run(steps=2, token=65535)
        state.submit_and_complete()
        state.arm_fault(nth=1, point="UNKNOWN_CSR")
        state.device_stage()
        state.arm_fault(nth=3, point="OUTPUT_SHORT")
        state.stream_submit(follow=False, seq=3, token=11721)
        state.switch_model(golden_ok=True, to_other=True)
        state.reset_sequence(seq=2)
        state.stream_close(cancel=False, seq=3)
        state.enqueue_prefill(data=_Draws(8, 2, [4009, 962, 604, 590, 151934, 71518, 2721, 1557]),
                              n=8, rewind=False, want=(4541, 269))
        state.submit()
        assert state.ex.life.recovery_pending and state.emu.pending(0)[1] == 1
        state.run_recovery()
        state.stream_wait(seq=3)
        state.enqueue_decode(data=_Draws(5, 0), token=55213)
        state.stream_step(ahead=False, follow=False, seq=2, token=438)
    finally:
        state.teardown()


def test_a_cancelled_greedy_stream_answers_its_next_step_the_plain_way():
    """Found by CI's run of TestExecutorStateful (stop 73), replayed: a greedy-ahead stream
    fired its next step, another thread cancelled the stream, and its owner's next submit
    went the plain path's way (a cancelled step), not adopting the step fired ahead: the
    model expected it adopted."""
    state = ExecutorMachine()
    try:
        state.start()
        state.enqueue_prefill(data=_Draws(0, 0, [0]), n=1, rewind=False, want=None)
        state.submit()
        state.stream_step(ahead=True, follow=False, seq=2, token=0)
        assert state.streams[2].ahead is not None
        state.stream_close(cancel=True, seq=2)
        state.stream_step(ahead=False, follow=False, seq=2, token=0)
        handle = state.jobs[-1][0]
        assert handle.done and isinstance(job_of(handle).result, Status)
    finally:
        state.teardown()
