"""Real-thread stress tests of the DeviceExecutor (spec §5, §6, §9.1, §12, §13.2).

Unlike ``test_executor_stateful.py`` (stepped, hypothesis-chosen interleavings), these run the
executor with its submitter and completion threads and the emulator free-running, with many
request threads, a cancelling thread and a seeded fault plan. They are bounded by job counts
(and a wall-clock cap per thread); they never gate on speed.

What each test proves:

* ``test_concurrent_requests_cancels_and_faults_keep_the_section5_invariants``: under
  concurrency, random cancels and faults at every API point, the §5 invariants hold at the end
  and during the run: in-flight never above capacity (sampled), only the submitter infers and
  only the completion thread waits, lock order respected, every delivered result equals the
  numpy oracle for that sequence's committed history, every failure is a Status carrying
  job_id/seq_id/generation and a category, jobs on a shared sequence are refused
  (``kv.sequence_busy``) or served one at a time, KV view == device KV, nothing leaked.
* ``test_thousand_jobs_leave_no_leak``: §13.2 "RSS and leased count do not grow after warm-up;
  leased=0 after termination" over 1,000 jobs with cancels and faults; the executor's
  counters account for every job exactly once.
* ``test_kv_pressure_waiters_block_idle_and_all_finish``: FI04 with real threads: more
  sequences than the KV holds wait (condition variable: no CPU, no Apply polling while nothing
  is released) and all finish correctly once capacity frees; no deadlock.
"""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable

import numpy as np
import pytest

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.calrt.runtime import Fault
from calexec.drivers.memory import pin_mmap_threshold
from calexec.drivers.synthetic import oracle
from calexec.machines.clock import Clock
from calexec.machines.faults import RecordingFaultSink
from calexec.machines.job import InferenceResult, JobHandle, job_of
from executor_harness import (
    SEED,
    arm,
    decode,
    expected_greedy,
    fired,
    make_executor,
    prefill,
    settle,
    write_calbin,
)
from thread_starts import OwnCpu, recording_thread_starts

# Outcomes of one resolved job (each maps to exactly one executor counter).
DELIVERED = "succeeded"
CANCELLED = "cancelled"
AFTER_SUBMIT = "quarantined"  # failed after infer() accepted it: sequence Unknown
BEFORE_SUBMIT = "failed"  # refused or failed before the device took it: rolled back

# Failure codes the fault plans can produce (anything else is an executor bug).
BEFORE_SUBMIT_CODES = {"calrt.submit_failed", "calrt.csr_failed", "kv.deadline",
                       "kv.sequence_busy", "kv.sequence_unknown"}
AFTER_SUBMIT_CODES = {"device.ccu_exception", "internal.output_not_finite",
                      "calrt.wait_failed", "execution.deadline"}
AFTER_SUBMIT_PHASES = {Phase.WAIT, Phase.STATUS, Phase.OUTPUT_CHECK}
PRE_SUBMIT_FAULTS = ("SUBMIT_RC", "UNKNOWN_CSR", "CAN_ALLOCATE_FALSE")
POST_SUBMIT_FAULTS = ("CCU_EXCEPTION", "OUTPUT_NAN", "WAIT_RC")
RESOLVE_S = 30.0  # a job not resolved this long after enqueue is a liveness bug
VOCAB = oracle.VOCAB


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("stress"))


# ---- bookkeeping shared by the tests ------------------------------------------------------------
class Book:
    """Thread-safe record of a run: outcomes, failure codes, errors raised in worker threads,
    and (optionally) every handle, for the cancelling thread and the end-state checks."""

    def __init__(self, keep_handles: bool) -> None:
        self._mu = threading.Lock()
        self.keep_handles = keep_handles
        self.handles: list[JobHandle] = []
        self.recent: deque[JobHandle] = deque(maxlen=32)
        self.outcomes: Counter[str] = Counter()
        self.codes: Counter[str] = Counter()
        self.cancelled_after_submit = 0
        self.cancels_recorded = 0
        self.errors: list[str] = []

    def track(self, handle: JobHandle) -> None:
        if self.keep_handles:
            with self._mu:
                self.handles.append(handle)
                self.recent.append(handle)

    def record(self, outcome: str, result: InferenceResult | Status,
               committed: bool) -> int:
        """Count one outcome; returns how many jobs failed after submit so far."""
        with self._mu:
            self.outcomes[outcome] += 1
            if isinstance(result, Status):
                self.codes[result.code] += 1
            if outcome == CANCELLED and committed:
                self.cancelled_after_submit += 1
            return self.outcomes[AFTER_SUBMIT]

    def pick_recent(self, rng: random.Random) -> JobHandle | None:
        with self._mu:
            return rng.choice(self.recent) if self.recent else None

    def count_cancel(self) -> None:
        with self._mu:
            self.cancels_recorded += 1

    @property
    def enqueued(self) -> int:
        return sum(self.outcomes.values())

    def run(self, target: Callable[..., None], *args, name: str) -> threading.Thread:
        """Start a thread whose exceptions are kept in ``errors`` (asserted empty later)."""
        def body():
            try:
                target(*args)
            except BaseException:  # noqa: BLE001 - reported to the test thread
                with self._mu:
                    self.errors.append(f"{name}: {traceback.format_exc()}")
        thread = threading.Thread(target=body, name=name, daemon=True)
        thread.start()
        return thread


def txn_state(handle: JobHandle) -> str | None:
    """The job's KV transaction state (None: it failed before a reservation)."""
    txn = job_of(handle).txn
    return None if txn is None else txn.run.state


def oracle_logits(state: int) -> np.ndarray:
    return oracle.bf16_to_f32(oracle.logits_bf16(state))


def classify(handle: JobHandle, result: InferenceResult | Status, seq: int,
             generation: int) -> str:
    """Check one resolved job's result is well formed and say which outcome it is."""
    if isinstance(result, InferenceResult):
        assert (result.job_id, result.seq_id, result.generation) == (handle.job_id, seq,
                                                                     generation)
        assert txn_state(handle) == "Committed", (handle, txn_state(handle))
        return DELIVERED
    assert isinstance(result, Status) and not result.ok, result
    assert result.code != "wait.deadline", f"job never resolved within {RESOLVE_S}s: {handle!r}"
    assert (result.job_id, result.seq_id, result.generation) == (handle.job_id, seq,
                                                                 generation), result
    assert isinstance(result.category, Category) and result.phase is not None, result
    state = txn_state(handle)
    if result.category is Category.CANCELLED:
        assert handle.cancel_requested, result
        assert state in (None, "RolledBack", "Committed"), (result, state)
        return CANCELLED
    if state == "Unknown":
        assert result.code in AFTER_SUBMIT_CODES and result.phase in AFTER_SUBMIT_PHASES, result
        return AFTER_SUBMIT
    assert state in (None, "RolledBack"), (result, state)
    assert result.code in BEFORE_SUBMIT_CODES or result.category is Category.DEADLINE, result
    return BEFORE_SUBMIT


def wait_for(handle: JobHandle) -> InferenceResult | Status:
    return handle.wait_until(time.monotonic() + RESOLVE_S)


class SequenceClient:
    """One request thread's greedy conversation on its own sequence, mirrored by the oracle.

    Each ``step`` enqueues one job chosen from the mirror (prefill of the prompt on an empty
    sequence, sometimes a follow-up prefill, else a greedy decode), waits for it and updates
    the mirror from what the executor says happened: a committed KV txn (delivered, or
    cancelled after submit) extends the history; an Unknown sequence is reset and starts
    over; anything else left the KV untouched. Delivered logits must equal the oracle's."""

    def __init__(self, ex, seq: int, book: Book, rng: random.Random, *, decode_share: float,
                 restart_at: int, seconds: float, cancel_share: float = 0.0,
                 logits_out: np.ndarray | None = None) -> None:
        self.ex, self.seq, self.book, self.rng = ex, seq, book, rng
        self.decode_share, self.restart_at, self.seconds = decode_share, restart_at, seconds
        self.cancel_share = cancel_share
        self.logits_out = logits_out
        self.generation = ex.generation.generation_id
        self.prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(2, 20))]
        self.ref = oracle.OracleSequence(SEED)

    def restart(self) -> None:
        # a job of this sequence the device still runs after a failed Wait: wait for it
        status = self.ex.kvc.reset_sequence(self.seq, wait_s=RESOLVE_S)
        assert status.ok, status
        self.ref = oracle.OracleSequence(SEED)

    def next_request(self):
        if self.ref.length >= self.restart_at:
            self.restart()
        ref, rng = self.ref, self.rng
        if ref.length == 0:
            tokens = self.prompt
        elif rng.random() < self.decode_share:
            return [ref.next_token()], decode(self.seq, ref.next_token(), ref.length,
                                              seconds=self.seconds)
        else:
            tokens = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
        return tokens, prefill(self.seq, tokens, ref.length, seconds=self.seconds)

    def step(self) -> int:
        """Run one job; returns the number of after-submit failures of the run so far."""
        tokens, request = self.next_request()
        past = request.past_len
        cancel_early = self.rng.random() < self.cancel_share / 2
        cancel_late = self.rng.random() < self.cancel_share / 2

        def created(handle: JobHandle) -> None:
            self.book.track(handle)
            if cancel_early and handle.cancel():  # before admission (on_created hook)
                self.book.count_cancel()

        handle = self.ex.enqueue(request, logits_out=self.logits_out, on_created=created)
        if cancel_late and handle.cancel():
            self.book.count_cancel()
        result = wait_for(handle)
        outcome = classify(handle, result, self.seq, self.generation)
        committed = txn_state(handle) == "Committed"
        if committed:
            self.ref.run(tokens, past)
        if outcome == DELIVERED:
            assert result.kv_len == self.ref.length
            assert result.argmax == self.ref.next_token()
            assert np.array_equal(result.logits, oracle_logits(self.ref.states[-1]))
        view = self.ex.kvc.seqs.get(self.seq)
        if view is None:  # refused before its first KV reservation (e.g. the token budget)
            assert outcome != AFTER_SUBMIT and self.ref.length == 0, (outcome, result)
            return self.book.record(outcome, result, committed)
        if outcome == AFTER_SUBMIT:
            assert view.unknown_reason == result.code
            self.restart()
        else:
            assert view.unknown_reason is None and view.committed_len == self.ref.length
        return self.book.record(outcome, result, committed)


def kv_matches_device(ex) -> None:
    """KV view == device truth for every sequence the coordinator knows that is not Unknown."""
    for seq, view in ex.kvc.seqs.items():
        assert view.open_txn is None, view
        if view.unknown_reason is None:
            rc, device_len = ex.kv.seq_len(seq)
            assert rc == 0 and device_len == view.committed_len, (seq, device_len, view)


def assert_counters_add_up(ex, base: dict[str, int], book: Book, emu_base: int) -> None:
    """Each job lands in exactly one executor counter; golden jobs are in ``base``."""
    delta = {key: ex.counters[key] - base[key] for key in base}
    assert {k: delta[k] for k in (DELIVERED, CANCELLED, AFTER_SUBMIT, BEFORE_SUBMIT)} == {
        k: book.outcomes[k] for k in (DELIVERED, CANCELLED, AFTER_SUBMIT, BEFORE_SUBMIT)}
    assert (delta[DELIVERED] + delta[CANCELLED] + delta[AFTER_SUBMIT] + delta[BEFORE_SUBMIT]
            == book.enqueued)
    # submitted == accepted by the device == results that needed a Wait
    assert delta["submitted"] == ex.device.emu.counters()["jobs_submitted"] - emu_base
    assert delta["submitted"] == (book.outcomes[DELIVERED] + book.cancelled_after_submit
                                  + book.outcomes[AFTER_SUBMIT])


def arm_prob(ex, points: tuple[str, ...], ppm: int, seed: int) -> None:
    for offset, point in enumerate(points):
        arm(ex, point, "PROB", ppm, seed=seed + offset)


def clear_faults(ex, points: tuple[str, ...]) -> None:
    for point in points:
        assert ex.device.emu.clear_fault(Fault[point]) == 0


def job_path_executor(calbin: str, device_config: str, **config):
    """A started threaded executor with lock-order checking and a passive fault sink: these
    tests stress the job path; recovery (reset, generation+1) has its own tests."""
    return make_executor(calbin, device_config, fault_sink=RecordingFaultSink(),
                         check_lock_order=True, **config)


class ParkedClock(Clock):
    """The system's clock whose KV condition tells which threads wait in it now and whether
    a notify reached each since it began to wait: woken, a thread counts its wake-up only
    when it runs, which a loaded host may delay past any sleep; parked and not woken, it
    counts none until the next notify."""

    __slots__ = ("mu", "parked")

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.parked: dict[threading.Thread, bool] = {}  # waiting now -> notified since

    def condition(self, lock, name: str = "") -> threading.Condition:
        if name != "kv":
            return super().condition(lock, name)
        return ParkingCondition(self, lock)

    def settled(self, threads: list[threading.Thread]) -> bool:
        """Every one of ``threads`` waits in the KV condition, none notified since."""
        with self.mu:
            return all(self.parked.get(t) is False for t in threads)


class ParkingCondition(threading.Condition):
    """A condition of a :class:`ParkedClock`: records its waiting threads there."""

    def __init__(self, clock: ParkedClock, lock) -> None:
        super().__init__(lock)
        self.watch = clock

    def wait(self, timeout: float | None = None) -> bool:
        me, watch = threading.current_thread(), self.watch
        with watch.mu:
            watch.parked[me] = False
        try:
            return super().wait(timeout)
        finally:
            with watch.mu:
                watch.parked.pop(me, None)

    def notify(self, n: int = 1) -> None:  # (notify_all calls it) the caller holds the lock
        with self.watch.mu:
            for thread in self.watch.parked:
                self.watch.parked[thread] = True  # (woken, or may be: at most n of them)
        super().notify(n)


def fix_mmap_threshold() -> None:
    """Pin glibc's mmap threshold so freed large arrays go back to the OS at once: RSS then
    reflects live memory (drivers/memory.py explains the measurement)."""
    assert pin_mmap_threshold()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- 1. stress ---------------------------------------------------------------------------------------
DISTINCT_SEQS = (1, 2, 3, 4, 5, 6)
SHARED_SEQ = 9
STRESS_JOBS_PER_THREAD = 300
SHARED_STEPS = 40
STRESS_SLOTS = 8
POST_SUBMIT_BUDGET = 3  # after this many, post-submit faults are disarmed (slots stay usable)
WALL_CAP_S = 20.0


def shared_client(ex, seq: int, prompt: list[int], book: Book, stop_at: float,
                  spans: list[tuple[int, int]], generation: int) -> None:
    """Greedy on a sequence another thread also uses: every job re-prefills the whole history
    at past 0, so its expected output depends only on its own tokens. A concurrent job makes
    the executor refuse with kv.sequence_busy (retried); delivered jobs are recorded with
    their admitted..completed span to prove the sequence served one job at a time."""
    want = expected_greedy(prompt, SHARED_STEPS)
    out: list[int] = []
    logits_out = np.empty(VOCAB, np.float32)
    while len(out) <= SHARED_STEPS and time.monotonic() < stop_at:
        tokens = prompt + out
        handle = ex.enqueue(prefill(seq, tokens, 0, seconds=5.0), logits_out=logits_out,
                            on_created=book.track)
        result = wait_for(handle)
        outcome = classify(handle, result, seq, generation)
        committed = txn_state(handle) == "Committed"
        if outcome == DELIVERED:
            ref = oracle.OracleSequence(SEED)
            ref.run(tokens)
            assert result.argmax == want[len(out)] == ref.next_token()
            assert np.array_equal(result.logits, oracle_logits(ref.states[-1]))
            spans.append((result.timings.admitted_us, result.timings.completed_us))
            out.append(result.argmax)
        elif outcome == AFTER_SUBMIT or result.code == "kv.sequence_unknown":
            # the other thread may have reopened it; the device may still run the failed job
            status = ex.kvc.reset_sequence(seq, wait_s=RESOLVE_S)
            assert status.ok or status.code == "kv.sequence_busy", status
        elif result.code == "kv.sequence_busy":
            time.sleep(0.0005)  # client back-off while the other thread's job runs
        book.record(outcome, result, committed)


def distinct_client(client: SequenceClient, stop_at: float, jobs: int) -> None:
    for _ in range(jobs):
        if time.monotonic() >= stop_at:
            return
        if client.step() >= POST_SUBMIT_BUDGET:
            clear_faults(client.ex, POST_SUBMIT_FAULTS)


def canceller(book: Book, rng: random.Random, stop: threading.Event) -> None:
    while not stop.wait(rng.uniform(0.001, 0.004)):
        handle = book.pick_recent(rng)
        if handle is not None and handle.cancel():
            book.count_cancel()


def monitor(ex, stop: threading.Event, samples: list[int]) -> None:
    while not stop.wait(0.001):
        samples.append(ex.snapshot()["inflight"])


def test_concurrent_requests_cancels_and_faults_keep_the_section5_invariants(calbin):
    ex = job_path_executor(calbin, "decode_us=200;prefill_per_token_us=20;kv_block_size=16",
                           slots_per_kind=STRESS_SLOTS)
    pool = ex.pool
    try:
        generation = ex.generation.generation_id
        base, emu_base = dict(ex.counters), ex.device.emu.counters()["jobs_submitted"]
        arm_prob(ex, ("SUBMIT_RC", "CAN_ALLOCATE_FALSE"), 20_000, seed=101)
        arm_prob(ex, ("UNKNOWN_CSR",), 5_000, seed=111)
        arm_prob(ex, POST_SUBMIT_FAULTS, 5_000, seed=121)
        book, samples, spans = Book(keep_handles=True), [], []
        stop = threading.Event()
        stop_at = time.monotonic() + WALL_CAP_S
        helpers = [book.run(monitor, ex, stop, samples, name="stress-monitor"),
                   book.run(canceller, book, random.Random(7), stop, name="stress-canceller")]
        clients = [book.run(distinct_client,
                            SequenceClient(ex, seq, book, random.Random(seq), decode_share=0.85,
                                           restart_at=120, seconds=2.0,
                                           logits_out=np.empty(VOCAB, np.float32)),
                            stop_at, STRESS_JOBS_PER_THREAD, name=f"stress-seq{seq}")
                   for seq in DISTINCT_SEQS]
        shared_prompts = ([5, 6, 7, 8], [900, 800, 700])
        clients += [book.run(shared_client, ex, SHARED_SEQ, prompt, book, stop_at, spans,
                             generation, name=f"stress-shared{i}")
                    for i, prompt in enumerate(shared_prompts)]
        for thread in clients:
            thread.join(WALL_CAP_S + RESOLVE_S)
        stop.set()
        for thread in helpers:
            thread.join(5.0)
        assert not any(t.is_alive() for t in clients + helpers)
        assert book.errors == [], "\n".join(book.errors)

        # during the run
        assert samples and max(samples) == ex.config.inflight_capacity and min(samples) >= 0
        assert book.cancels_recorded > 0 and book.outcomes[CANCELLED] > 0
        assert sum(fired(ex, p) for p in PRE_SUBMIT_FAULTS + POST_SUBMIT_FAULTS) > 0
        spans.sort()
        overlaps = [(a, b) for a, b in zip(spans, spans[1:]) if a[1] > b[0]]
        assert not overlaps, overlaps  # (admitted_us, completed_us) of consecutive jobs
        # end state, device still open
        snap = settle(ex)
        assert snap["queued"] == snap["inflight"] == snap["pending_tokens"] == 0
        kv_matches_device(ex)
        assert_counters_add_up(ex, base, book, emu_base)
        assert ex.pool.counts()["Quarantined"] == book.outcomes[AFTER_SUBMIT]
        assert ex.infer_threads == {"calexec-submitter"}
        assert ex.wait_threads == {"calexec-completion"}
        assert ex.locks.violations == []
        counters = ex.device.emu.counters()
        assert counters["dma_input_violations"] == counters["dma_output_violations"] == 0
    finally:
        status = ex.shutdown(grace=5.0)
    assert status.ok and ex.state == "Stopped", status
    assert all(handle.done for handle in book.handles)
    counts = pool.counts()
    assert counts["Leased"] == counts["InFlight"] == 0
    assert ex.locks.violations == []


# ---- 2. the 1,000-job loop ---------------------------------------------------------------------------
LOOP_JOBS = 1000
LOOP_THREADS = 3
LOOP_WARMUP_PER_THREAD = 100
LOOP_SLOTS = 4
RSS_SLACK = 16 << 20  # a leak bound, not a speed bound


def loop_client(client: SequenceClient, jobs: int, warmed: threading.Barrier,
                go: threading.Event) -> None:
    for i in range(jobs):
        if i == LOOP_WARMUP_PER_THREAD:
            warmed.wait(RESOLVE_S)
            assert go.wait(RESOLVE_S)
        client.step()


def test_thousand_jobs_leave_no_leak(calbin):
    fix_mmap_threshold()
    with recording_thread_starts() as starts:  # the threads this test and its executor start
        ex = job_path_executor(calbin, "kv_block_size=16", slots_per_kind=LOOP_SLOTS)
        pool = ex.pool
        try:
            slots_before = len(ex.pool.slots)
            base, emu_base = dict(ex.counters), ex.device.emu.counters()["jobs_submitted"]
            plan = random.Random(2024)
            arm_prob(ex, ("SUBMIT_RC", "UNKNOWN_CSR", "CAN_ALLOCATE_FALSE"), 5_000, seed=201)
            for point in POST_SUBMIT_FAULTS:  # each fires exactly once, at a seeded call
                arm(ex, point, "NTH", plan.randint(100, 600))
            book = Book(keep_handles=False)
            warmed, go = threading.Barrier(LOOP_THREADS + 1), threading.Event()
            shares = [LOOP_JOBS // LOOP_THREADS + (i < LOOP_JOBS % LOOP_THREADS)
                      for i in range(LOOP_THREADS)]
            workers = [book.run(loop_client,
                                SequenceClient(ex, seq, book, random.Random(plan.random()),
                                               decode_share=0.9, restart_at=100, seconds=2.0,
                                               cancel_share=0.06),
                                jobs, warmed, go, name=f"loop-seq{seq}")
                       for seq, jobs in zip(range(1, LOOP_THREADS + 1), shares)]
            warmed.wait(RESOLVE_S)
            gc.collect()
            leased_warm = ex.pool.counts()["Leased"]
            rss_warm = rss_bytes()
            go.set()
            for thread in workers:
                thread.join(RESOLVE_S * 2)
            assert not any(t.is_alive() for t in workers)
            assert book.errors == [], "\n".join(book.errors)
            gc.collect()
            rss_end = rss_bytes()

            assert book.enqueued == LOOP_JOBS
            assert rss_end - rss_warm <= RSS_SLACK, (rss_warm, rss_end)
            snap = settle(ex)
            assert snap["queued"] == snap["inflight"] == snap["pending_tokens"] == 0
            assert ex.pool.counts()["Leased"] == 0 <= leased_warm
            assert len(ex.pool.slots) == slots_before
            post_submit_fired = sum(fired(ex, p) for p in POST_SUBMIT_FAULTS)
            assert post_submit_fired == len(POST_SUBMIT_FAULTS)
            assert (ex.pool.counts()["Quarantined"] == book.outcomes[AFTER_SUBMIT]
                    == post_submit_fired)
            assert book.outcomes[CANCELLED] > 0 and book.outcomes[BEFORE_SUBMIT] > 0
            assert_counters_add_up(ex, base, book, emu_base)
            kv_matches_device(ex)
            assert ex.locks.violations == []
        finally:
            status = ex.shutdown(grace=5.0)
    assert status.ok and ex.state == "Stopped", status
    counts = pool.counts()
    assert counts["Leased"] == counts["InFlight"] == 0
    # every thread the executor or the test started has ended (another test's leftover
    # threads are not judged: they may start or end meanwhile)
    assert [t.name for t in starts.ours() if t.is_alive()] == []


# ---- 3. KV pressure ------------------------------------------------------------------------------------
KV_CONFIG = "kv_blocks=6;kv_block_size=64"  # 6 blocks of 64 tokens
HOLDERS = (11, 12, 13)  # each takes 2 blocks: the KV is full
WAITERS = (1, 2, 3, 4)  # each needs 2 blocks: at most 3 fit at once
KV_PROMPT_LEN = 100  # 2 blocks
KV_DECODES = 6  # stays within 2 blocks
KV_ROUNDS = 2


def kv_waiter(ex, seq: int, results: list) -> None:
    """``KV_ROUNDS`` requests (prefill + greedy decodes), the sequence reset after each."""
    prompt = [(seq * 7919 + i) % VOCAB for i in range(KV_PROMPT_LEN)]
    for _ in range(KV_ROUNDS):
        out, past = [], 0
        request = prefill(seq, prompt, seconds=RESOLVE_S)
        for _ in range(KV_DECODES + 1):
            result = wait_for(ex.enqueue(request))
            assert isinstance(result, InferenceResult), result
            out.append(result.argmax)
            past = result.kv_len
            request = decode(seq, out[-1], past, seconds=RESOLVE_S)
        results.append((seq, out == expected_greedy(prompt, KV_DECODES)))
        status = ex.kvc.reset_sequence(seq)
        assert status.ok, status


def test_kv_pressure_waiters_block_idle_and_all_finish(calbin):
    own = OwnCpu()  # the executor's threads, the waiters and this one; not others' threads
    clock = ParkedClock()
    ex = job_path_executor(calbin, KV_CONFIG, slots_per_kind=3, clock=clock)
    pool = ex.pool
    try:
        for seq in HOLDERS:
            held = wait_for(ex.enqueue(prefill(seq, list(range(KV_PROMPT_LEN)))))
            assert isinstance(held, InferenceResult), held
        assert ex.kv.free_blocks() == (0, 0)
        book, results = Book(keep_handles=False), []
        waiters = [book.run(kv_waiter, ex, seq, results, name=f"kv-seq{seq}")
                   for seq in WAITERS]
        end = time.monotonic() + RESOLVE_S
        while ex.kvc.waiting < len(WAITERS) and time.monotonic() < end:
            time.sleep(0.005)
        assert ex.kvc.waiting == len(WAITERS)  # all blocked in reserve
        # each waiter joining the KV queue woke the others once (the head retries: its "no"
        # may have been transient); wait (bounded) until every one waits again, not woken
        # since: those wake-ups are all counted then (a quiet 50 ms said so only on a quiet
        # host: a woken waiter the host had not run yet counted its wake-up after it)
        while not clock.settled(waiters) and time.monotonic() < end:
            time.sleep(0.005)
        assert clock.settled(waiters), "the KV waiters never settled"
        # Everybody is blocked and nothing is released: an idle phase.
        wakeups, applies = ex.kvc.wakeups, ex.kvc.apply_calls
        cpu0, wall0 = own.now(), time.monotonic()
        time.sleep(0.3)
        cpu, wall = own.spent(cpu0, own.now()), time.monotonic() - wall0
        assert (ex.kvc.wakeups, ex.kvc.apply_calls) == (wakeups, applies)  # no polling
        # CPU accounting: waiting costs nothing (a load only takes CPU from these threads; the
        # threads other tests left running, which a whole-process count saw, not counted)
        assert cpu < wall / 10, (cpu, wall)
        assert all(t.is_alive() for t in waiters) and not results  # waiting, not failed
        for seq in HOLDERS:
            assert ex.kvc.reset_sequence(seq).ok
        for thread in waiters:
            thread.join(RESOLVE_S * 2)
        assert not any(t.is_alive() for t in waiters), "deadlock: waiters still blocked"
        assert book.errors == [], "\n".join(book.errors)
        assert sorted(results) == sorted((seq, True) for seq in WAITERS for _ in range(KV_ROUNDS))
        assert ex.kvc.wakeups > wakeups
        assert ex.kv.free_blocks() == (0, 6)
        assert ex.locks.violations == []
    finally:
        status = ex.shutdown(grace=5.0)
    assert status.ok, status
    counts = pool.counts()
    assert counts["Leased"] == counts["InFlight"] == 0
