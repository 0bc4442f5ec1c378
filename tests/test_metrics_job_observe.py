"""``ServerMetrics.observe_job`` (issue 28, stop 68): a job's stage timings and, for a decode
job, its time per output token are observed together under one lock (the decode burst's
thread calls it once per job). Differential: the same seeded job timings (every kind, spans
not reached, copies not measured, zero, negative and NaN spans, exact bucket bounds) observed
through ``observe_job`` and through the plain path -- each family's child observed on its own,
as ``observe_job`` did before -- give the same exposition, byte for byte; and threads
observing at once lose no observation. Passes on the code before the change as after."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from calexec.contracts.types import JobTimings, TaskKind
from calexec.drivers.serving.metrics import STAGE_BUCKETS, ServerMetrics

_STAGES = ("admission_wait", "queue_wait", "device_wait", "h2d", "d2h", "postprocess")


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The children record their creation time from ``time.time()``: one value for all."""
    monkeypatch.setattr(time, "time", lambda: 1765000000.25)


def _ms(rng: random.Random) -> float:
    pick = rng.random()
    if pick < 0.1:
        return rng.choice([0.0, -0.0, -1.0, math.nan, math.inf, 1e300])
    if pick < 0.25:
        return rng.choice(STAGE_BUCKETS) * 1000.0  # on a bound once divided (or next to it)
    return 10 ** rng.uniform(-3, 4)


def _stamp(rng: random.Random, base: int) -> int:
    return 0 if rng.random() < 0.1 else base + rng.randrange(0, 50_000)  # 0: not reached


def _timings(rng: random.Random) -> JobTimings:
    accepted = _stamp(rng, 1_000_000)
    return JobTimings(accepted_us=accepted, admitted_us=_stamp(rng, 1_050_000),
                      queued_us=_stamp(rng, 1_100_000), submitted_us=_stamp(rng, 1_150_000),
                      completed_us=_stamp(rng, 1_200_000),
                      h2d_ms=0.0 if rng.random() < 0.3 else _ms(rng), device_wait_ms=_ms(rng),
                      d2h_ms=0.0 if rng.random() < 0.3 else _ms(rng), postprocess_ms=_ms(rng))


def _plain_observe_job(metrics: ServerMetrics, kind: TaskKind, timings: JobTimings) -> None:
    """``observe_job`` as it was before stop 68: each family's child observed on its own."""
    spans = {"admission_wait": timings.admission_wait_ms(),
             "queue_wait": timings.queue_wait_ms(), "device_wait": timings.device_wait_ms,
             "h2d": timings.h2d_ms or None, "d2h": timings.d2h_ms or None,
             "postprocess": timings.postprocess_ms}
    for name in _STAGES:
        ms = spans[name]
        if ms is not None:
            metrics.stages[name].labels(kind.name.lower()).observe(ms / 1000.0)
    if kind == TaskKind.DECODE:
        total = timings.total_ms()
        if total is not None:
            metrics.tpot.observe(total / 1000.0)


def _metrics() -> ServerMetrics:
    return ServerMetrics(lambda: {}, dict)


def _exposed(metrics: ServerMetrics) -> list[str]:
    """The exposition of the families ``observe_job`` observes, line by line."""
    registry = CollectorRegistry()
    for family in (*metrics.stages.values(), metrics.tpot):
        registry.register(family)
    return generate_latest(registry).decode().splitlines()


@pytest.mark.parametrize("seed", [68, 69, 70])
def test_observe_job_exposition_equals_the_plain_path(seed: int, fixed_clock: None) -> None:
    rng = random.Random(seed)
    jobs = [(rng.choice(list(TaskKind)), _timings(rng)) for _ in range(3000)]
    lean, plain = _metrics(), _metrics()
    for kind, timings in jobs:
        lean.observe_job(kind, timings)
        _plain_observe_job(plain, kind, timings)
    got, want = _exposed(lean), _exposed(plain)
    assert got == want
    assert any("_count" in line and not line.endswith(" 0.0") for line in got)  # (it observed)


def test_threads_observing_at_once_lose_no_observation(fixed_clock: None) -> None:
    """Four threads observe jobs of every kind at once (a barrier starts them together): every
    family's count and sum is the plain path's for the same jobs observed one by one."""
    rng = random.Random(68)
    per_thread = [[(rng.choice(list(TaskKind)), JobTimings(
        accepted_us=1000, admitted_us=1000 + rng.randrange(1, 900), queued_us=3000,
        submitted_us=3000 + rng.randrange(1, 900), completed_us=9000 + rng.randrange(1, 900),
        h2d_ms=rng.choice([0.0, 0.25]), device_wait_ms=rng.randrange(1, 64) / 8,
        d2h_ms=rng.choice([0.0, 0.5]), postprocess_ms=rng.randrange(1, 64) / 16))
        for _ in range(2000)] for _ in range(4)]
    lean, plain = _metrics(), _metrics()
    start = threading.Barrier(len(per_thread))

    def observe(jobs: list[tuple[TaskKind, JobTimings]]) -> None:
        start.wait(timeout=30)
        for kind, timings in jobs:
            lean.observe_job(kind, timings)

    threads = [threading.Thread(target=observe, args=(jobs,)) for jobs in per_thread]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads)
    for jobs in per_thread:
        for kind, timings in jobs:
            _plain_observe_job(plain, kind, timings)

    def totals(metrics: ServerMetrics) -> list[str]:
        return [line for line in _exposed(metrics) if "_count" in line or "_bucket" in line]

    assert totals(lean) == totals(plain)

