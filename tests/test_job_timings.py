"""S11 / §10.3: every job's ``JobTimings`` are its own, never a value shared by sequence id or
taken from another job; the server's histograms observe each job once.

The timings are checked against stamps taken *outside* the executor:

- the caller's own window: ``time.monotonic_ns()`` just before ``enqueue`` and just after the
  result; the job's stamps must lie inside it;
- the device's own window of that job: the driver's ``Device.infer`` and ``OutputBuf.wait``
  are wrapped by the test, recording when each call started and returned (and, for infer, the
  sequence id and output buffer). The job was queued before its infer began, ``submitted_us``
  falls between its infer's return and its Wait's start, ``completed_us`` after its Wait
  returned, and ``device_wait_ms`` spans at least its Wait call and at most submitted ->
  completed;
- each job's own device latency (the emulator's profile is a floor): prefill and decode jobs
  of two sequences run concurrently with different latencies, and a job's execution span is
  at least its own latency (its Wait ended at least that long after its infer).

A stamp copied from another job (a concurrent one, or the previous job of a sequence id used
again after ``release_sequence``) falls outside the job's own windows. Phase A and Phase B.

A job armed before its request came (a pre-armed decode-stream step, an implicit pre-arm
adopted by ``enqueue``) is a separate finding: see
``test_a_prearmed_job_is_accepted_before_its_request_exists``.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
from fastapi.testclient import TestClient

from calexec.contracts.types import JobTimings
from calexec.drivers.calrt.runtime import Device, OutputBuf
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.machines.job import InferenceResult
from executor_harness import deadline, decode, expected_greedy, make_executor, prefill, write_calbin
from test_server_support import metric_value, oracle_tokens, started_executor

PREFILL_US_PER_TOKEN = 2_000
DECODE_US = 5_000
PREFILL_TOKENS = 8  # a prefill job: >= 16 ms on the device; a decode job: >= 5 ms


def now_us() -> int:
    return time.monotonic_ns() // 1000


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("timings"))


class DeviceLog:
    """infer / Wait calls as the driver saw them: (start_us, end_us) with the infer's sequence
    id and output buffer, and the output buffer each Wait was called on."""

    def __init__(self) -> None:
        self.infers: list[tuple[int, int, int, int]] = []  # (seq, outbuf id, t0, t1)
        self.waits: list[tuple[int, int, int]] = []  # (outbuf id, t0, t1)
        self.recording = False

    def install(self, monkeypatch) -> None:
        for name in ("infer", "infer_with_fixed_task_type"):
            real = getattr(Device, name)

            def infer(dev, model, kv, seq, inbuf, outbuf, *rest, _real=real):
                t0 = now_us()
                rc = _real(dev, model, kv, seq, inbuf, outbuf, *rest)
                if self.recording and rc == 0:
                    self.infers.append((seq, id(outbuf), t0, now_us()))
                return rc

            monkeypatch.setattr(Device, name, infer)
        real_wait = OutputBuf.wait

        def wait(buf, timeout_us, _real=real_wait):
            t0 = now_us()
            rc = _real(buf, timeout_us)
            if self.recording:
                self.waits.append((id(buf), t0, now_us()))
            return rc

        monkeypatch.setattr(OutputBuf, "wait", wait)

    def windows(self, seq: int) -> list[tuple[int, int, int, int]]:
        """(infer t0, infer t1, wait t0, wait t1) of each accepted job of ``seq``, in order:
        its Wait is the first on its output buffer that began after its infer returned."""
        out = []
        for s, buf, i0, i1 in self.infers:
            if s != seq:
                continue
            w0, w1 = next((w0, w1) for b, w0, w1 in self.waits if b == buf and w0 >= i1)
            out.append((i0, i1, w0, w1))
        return out


@pytest.fixture
def device_log(monkeypatch):
    log = DeviceLog()
    log.install(monkeypatch)
    return log


class Record:
    """One job as its caller saw it: own window, own device latency, the result."""

    def __init__(self, seq: int, latency_us: int, t_call: int, t_result: int, result) -> None:
        assert isinstance(result, InferenceResult), result
        self.seq, self.latency_us = seq, latency_us
        self.t_call, self.t_result, self.result = t_call, t_result, result


def run_job(ex, request, latency_us: int) -> Record:
    t_call = now_us()
    result = ex.enqueue(request).wait_until(deadline())
    return Record(request.seq_id, latency_us, t_call, now_us(), result)


def assert_own_timings(records: list[Record], log: DeviceLog) -> None:
    """Each job's timings lie in its own caller window and its own device window."""
    by_seq: dict[int, list[Record]] = {}
    for record in records:
        by_seq.setdefault(record.seq, []).append(record)
    for seq, jobs in by_seq.items():
        windows = log.windows(seq)
        assert len(windows) == len(jobs), (seq, len(windows), len(jobs))
        for k, (job, (i0, i1, w0, w1)) in enumerate(zip(jobs, windows)):
            t = job.result.timings
            where = f"seq {seq} job {k}: {t}"
            stamps = [t.accepted_us, t.admitted_us, t.queued_us, t.submitted_us, t.completed_us]
            assert all(stamps) and stamps == sorted(stamps), where  # monotonic, all reached
            assert job.t_call <= t.accepted_us and t.completed_us <= job.t_result, where
            assert t.queued_us <= i0, where  # queued before its own infer began
            assert i1 <= t.submitted_us <= w0, where  # between its infer and its Wait
            assert w1 <= t.completed_us, where  # after its own Wait returned
            device_us = t.device_wait_ms * 1000.0
            assert w1 - w0 - 1 <= device_us <= t.completed_us - t.submitted_us + 1, where
            # its own latency, not another job's: the device ran it at least that long
            assert w1 - i0 >= job.latency_us, where
            assert t.completed_us - t.submitted_us >= job.latency_us - (i1 - i0), where


@pytest.mark.parametrize("capacity", [1, 2], ids=["phase_a", "phase_b"])
def test_concurrent_prefill_and_decode_jobs_of_two_sequences_carry_their_own_timings(
        calbin, device_log, capacity):
    """seq 1: prefills of 8 tokens (>= 16 ms each); seq 2: decodes (>= 5 ms each); from two
    threads at once, so each job waits behind the other sequence's jobs (Phase A) or runs
    beside them (Phase B). Implicit pre-arms off: a job admitted before its request came is
    the separate finding below."""
    ex = make_executor(calbin, inflight_capacity=capacity, auto_prearm=False)
    try:
        assert ex.device.emu.set_latency(prefill_per_token_us=PREFILL_US_PER_TOKEN,
                                         decode_us=DECODE_US) == 0
        prompt = list(range(20, 20 + PREFILL_TOKENS))
        first = ex.enqueue(prefill(2, [3, 4, 5])).wait_until(deadline())
        assert isinstance(first, InferenceResult)
        device_log.recording = True
        records: dict[int, list[Record]] = {1: [], 2: []}
        start = threading.Barrier(2)

        def prefills():
            start.wait(5.0)
            for _ in range(6):
                records[1].append(run_job(ex, prefill(1, prompt),
                                          PREFILL_TOKENS * PREFILL_US_PER_TOKEN))

        def decodes():
            start.wait(5.0)
            token, past = first.argmax, first.kv_len
            for _ in range(12):
                record = run_job(ex, decode(2, token, past), DECODE_US)
                records[2].append(record)
                token, past = record.result.argmax, record.result.kv_len

        threads = [threading.Thread(target=fn, name=fn.__name__) for fn in (prefills, decodes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30.0)
        assert not any(thread.is_alive() for thread in threads)
        device_log.recording = False
        assert len(records[1]) == 6 and len(records[2]) == 12
        assert [r.result.argmax for r in records[2]] == expected_greedy([3, 4, 5], 12)[1:]
        # the two sequences' jobs did share the executor: some job of one sequence was
        # accepted while a job of the other was still running (its own caller waiting)
        assert any(a.t_call < b.t_result and b.t_call < a.t_result
                   for a in records[1] for b in records[2])
        assert_own_timings(records[1] + records[2], device_log)
    finally:
        ex.shutdown(grace=5.0)


def test_a_sequence_id_used_again_after_release_starts_with_fresh_timings(calbin, device_log):
    """seq 5: a long prefill (32 tokens, >= 64 ms), ``release_sequence(5)``, then a short one
    (2 tokens) and a decode on the same id: the new jobs' timings are theirs (windows, own
    latency), nothing of the first job's."""
    ex = make_executor(calbin, auto_prearm=False)
    try:
        assert ex.device.emu.set_latency(prefill_per_token_us=PREFILL_US_PER_TOKEN,
                                         decode_us=DECODE_US) == 0
        device_log.recording = True
        long_prompt = list(range(100, 132))
        old = run_job(ex, prefill(5, long_prompt), len(long_prompt) * PREFILL_US_PER_TOKEN)
        assert ex.release_sequence(5).ok
        short = run_job(ex, prefill(5, [9, 8]), 2 * PREFILL_US_PER_TOKEN)
        step = run_job(ex, decode(5, short.result.argmax, short.result.kv_len), DECODE_US)
        device_log.recording = False
        assert [short.result.argmax, step.result.argmax] == expected_greedy([9, 8], 1)
        assert_own_timings([old, short, step], device_log)
        assert short.result.timings.accepted_us > old.result.timings.completed_us
        assert old.result.timings is not short.result.timings
    finally:
        ex.shutdown(grace=5.0)


@pytest.mark.parametrize("path", ["decode_stream", "greedy_ahead", "implicit_prearm"])
def test_a_prearmed_job_is_accepted_before_its_request_exists(calbin, path):
    """§9.1: the admission span starts when the request enters the service; S11: a job's
    timings are its own. Each decode step's request exists only once the step before it
    returned its token, so a step's ``accepted_us`` is never before the previous step's
    ``completed_us`` (nor, for a caller's own request, before the caller called)."""
    ex = make_executor(calbin)
    try:
        assert ex.device.emu.set_latency(decode_us=DECODE_US) == 0
        steps = 8
        first = ex.enqueue(prefill(1, [3, 4, 5], kv_reserve_len=3 + steps)).wait_until(
            deadline())
        assert isinstance(first, InferenceResult)
        records: list[Record] = []
        token, past = first.argmax, first.kv_len
        if path == "implicit_prearm":
            for _ in range(steps):
                record = run_job(ex, decode(1, token, past), DECODE_US)
                records.append(record)
                token, past = record.result.argmax, record.result.kv_len
            assert ex.snapshot()["auto_prearmed"] > 0  # the guesses were taken
        else:
            stream = ex.decode_stream(1, past, deadline(), greedy_ahead=path == "greedy_ahead",
                                      max_steps=steps)
            with stream:
                for _ in range(steps):
                    t_call = now_us()
                    result = stream.step(token)
                    records.append(Record(1, DECODE_US, t_call, now_us(), result))
                    token = result.argmax
            assert stream.prearmed_steps > 0 or stream.ahead_steps > 0
        assert [r.result.argmax for r in records] == expected_greedy([3, 4, 5], steps)[1:]
        previous = first.timings.completed_us
        for k, record in enumerate(records):
            t = record.result.timings
            assert t.accepted_us >= previous, (
                f"step {k} accepted {previous - t.accepted_us} us before the step it needs "
                f"the token of completed: {t}")
            previous = t.completed_us
    finally:
        ex.shutdown(grace=5.0)


def test_server_histograms_observe_each_job_once(tmp_path):
    """Three completions at once on two sequence ids (the third reuses an id released by one
    of the first two), then one more alone: every job-stage histogram counts exactly the jobs
    that ran (one prefill per request, max_tokens - 1 decodes), TPOT one per decode job, TTFT
    one per request, and the executor delivered exactly those jobs (nothing observed twice,
    nothing missed)."""

    ex = started_executor(tmp_path)
    try:
        assert ex.device.emu.set_latency(decode_us=2000) == 0
        app = create_app(ex, ServerConfig(max_sequences=2))
        stages = ("admission_wait", "queue_wait", "device_wait", "postprocess")
        bodies = [dict(prompt=[1, 2, 3], max_tokens=5), dict(prompt=[4, 5], max_tokens=3),
                  dict(prompt=[6, 7, 8, 9], max_tokens=4, temperature=0.8, seed=3)]
        with TestClient(app) as client:
            def counts():
                text = client.get("/metrics").text
                out = {f"{s}_{k}": metric_value(text, f"calexec_job_{s}_seconds_count",
                                                {"kind": k}) or 0
                       for s in stages for k in ("prefill_ids", "decode")}
                for name in ("time_per_output_token", "time_to_first_token"):
                    out[name] = metric_value(text, f"calexec_{name}_seconds_count") or 0
                return out

            before, snap0 = counts(), ex.snapshot()
            replies: list = [None] * len(bodies)

            def post(i):
                replies[i] = client.post("/v1/completions", json=bodies[i])

            threads = [threading.Thread(target=post, args=(i,)) for i in range(len(bodies))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30.0)
            last = dict(prompt=[10, 11], max_tokens=6)
            replies.append(client.post("/v1/completions", json=last))
            assert all(r is not None and r.status_code == 200 for r in replies), replies
            for body, reply in zip(bodies[:2] + [last], replies[:2] + replies[3:]):
                assert reply.json()["choices"][0]["token_ids"] == oracle_tokens(
                    body["prompt"], body["max_tokens"])
            after, snap1 = counts(), ex.snapshot()
        requests = bodies + [last]
        prefills = len(requests)
        decodes = sum(b["max_tokens"] - 1 for b in requests)
        delta = {k: after[k] - before[k] for k in after}
        for stage in stages:
            assert delta[f"{stage}_prefill_ids"] == prefills, (stage, delta)
            assert delta[f"{stage}_decode"] == decodes, (stage, delta)
        assert delta["time_per_output_token"] == decodes, delta
        assert delta["time_to_first_token"] == prefills, delta
        assert snap1["succeeded"] - snap0["succeeded"] == prefills + decodes
        assert snap1["cancelled"] == snap0["cancelled"] and snap1["failed"] == snap0["failed"]
    finally:
        ex.shutdown(5.0)


def test_spans_ms_are_the_three_span_methods() -> None:
    """``JobTimings.spans_ms()`` (one call for ``ServerMetrics.observe_job``, stop 68) is
    (``admission_wait_ms()``, ``queue_wait_ms()``, ``total_ms()``) for stamps reached or not
    (0), in any order, equal or not."""
    rng = random.Random(68)
    for _ in range(5000):
        stamps = {name: rng.choice([0, 1, rng.randrange(1, 10**12)]) for name in (
            "accepted_us", "admitted_us", "queued_us", "submitted_us", "completed_us")}
        t = JobTimings(**stamps)
        assert t.spans_ms() == (t.admission_wait_ms(), t.queue_wait_ms(), t.total_ms()), stamps
