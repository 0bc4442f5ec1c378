"""``metrics.LeanHistogram`` against prometheus_client's ``Histogram`` (stop 64, issue 28): the
server's histograms observed per job and per token use the lean one (a bisect and one lock
per observation); the same observations must give the same exposition, byte for byte, as the
library's histogram gave (differential: both fed the same seeded values, edge values
included, labelled and not, with and without the ``_created`` series)."""

from __future__ import annotations

import math
import random
import threading
import time

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics import disable_created_metrics, enable_created_metrics

from calexec.drivers.serving.metrics import STAGE_BUCKETS, TOKEN_BUCKETS, LeanGroup, LeanHistogram

EDGES = [0.0, -0.0, -1.0, 1e-5, 1e-5 * (1 + 1e-15), 0.000025, 10.0, 10.000001, 1e300,
         math.inf, -math.inf, math.nan, 3, 1024, 2**60]


def _values(rng: random.Random, n: int) -> list[float]:
    out: list[float] = []
    for _ in range(n):
        pick = rng.random()
        if pick < 0.1:
            out.append(rng.choice(EDGES))
        elif pick < 0.2:
            out.append(rng.choice(STAGE_BUCKETS))  # exactly on a bound: counted in it
        elif pick < 0.3:
            out.append(rng.randrange(0, 5000))  # an int (token counts)
        else:
            out.append(10 ** rng.uniform(-6, 1.5))
    return out


def _pair(labels: tuple[str, ...], buckets: tuple[float, ...]
          ) -> tuple[CollectorRegistry, Histogram, CollectorRegistry, LeanHistogram]:
    old_reg, new_reg = CollectorRegistry(), CollectorRegistry()
    old = Histogram("calexec_job_device_wait_seconds", "Time spent in Wait().", labels,
                    buckets=buckets, registry=old_reg)
    new = LeanHistogram("calexec_job_device_wait_seconds", "Time spent in Wait().", labels,
                        buckets=buckets, registry=new_reg)
    return old_reg, old, new_reg, new


@pytest.fixture
def fixed_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both record their children's creation time from ``time.time()``: one value for all."""
    monkeypatch.setattr(time, "time", lambda: 1765000000.25)


@pytest.mark.parametrize("seed", [64, 65, 66])
@pytest.mark.parametrize("buckets", [STAGE_BUCKETS, TOKEN_BUCKETS, (-1.0, 0.5, 2.0)])
def test_labelled_exposition_equals_prometheus_clients(seed: int, buckets: tuple[float, ...],
                                                       fixed_clock: None) -> None:
    rng = random.Random(seed)
    old_reg, old, new_reg, new = _pair(("kind", "model_name"), buckets)
    kinds = [("prefill_ids", "m"), ("decode", "m"), ("decode", "other \"quoted\"\n")]
    for kind in kinds[:2]:  # children looked up before any observation show as zeros
        old.labels(*kind)
        new.labels(*kind)
    for value in _values(rng, 3000):
        kind = rng.choice(kinds)
        old.labels(*kind).observe(value)
        new.labels(*kind).observe(value)
    assert generate_latest(new_reg) == generate_latest(old_reg)
    # the same samples (repr: a NaN sum equals no float, its repr equals its repr)
    assert repr(list(new_reg.collect())) == repr(list(old_reg.collect()))


@pytest.mark.parametrize("created", [True, False])
def test_unlabelled_exposition_equals_prometheus_clients(created: bool,
                                                         fixed_clock: None) -> None:
    if not created:
        disable_created_metrics()
    try:
        old_reg, old, new_reg, new = _pair((), STAGE_BUCKETS)
        assert generate_latest(new_reg) == generate_latest(old_reg)  # nothing observed yet
        for value in _values(random.Random(7), 2000):
            old.observe(value)
            new.observe(value)
        assert generate_latest(new_reg) == generate_latest(old_reg)
        assert (b"_created" in generate_latest(new_reg)) is created
    finally:
        enable_created_metrics()


def test_concurrent_observations_all_counted() -> None:
    """Four threads observing one child: every observation counted once (the count and each
    bucket's share are exact; a lost update would show)."""
    reg = CollectorRegistry()
    lean = LeanHistogram("calexec_time_per_output_token_seconds", "d", buckets=STAGE_BUCKETS,
                         registry=reg)
    per_thread = 20000
    start = threading.Barrier(4, timeout=30)

    def work() -> None:
        start.wait()
        for i in range(per_thread):
            lean.observe(0.001 if i % 2 else 7.0)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    name = "calexec_time_per_output_token_seconds"
    assert reg.get_sample_value(f"{name}_count") == 4 * per_thread
    assert reg.get_sample_value(f"{name}_bucket", {"le": "0.001"}) == 2 * per_thread
    assert reg.get_sample_value(f"{name}_sum") == pytest.approx(2 * per_thread * 7.001)


def test_refusals_name_the_histogram() -> None:
    with pytest.raises(ValueError, match="calexec_x: buckets \\[2.0, 1.0\\] must be given"):
        LeanHistogram("calexec_x", "d", buckets=(2.0, 1.0))
    lean = LeanHistogram("calexec_y", "d", ["kind"], buckets=(1.0,))
    with pytest.raises(ValueError, match="calexec_y: 2 label values for the labels \\['kind'\\]"):
        lean.labels("a", "b")
    with pytest.raises(ValueError, match="calexec_y has labels \\['kind'\\]"):
        lean.observe(1.0)
    reg = CollectorRegistry()
    LeanHistogram("calexec_z", "d", buckets=(1.0,), registry=reg)
    with pytest.raises(ValueError, match="Duplicated timeseries"):
        Histogram("calexec_z", "d", buckets=(1.0,), registry=reg)


def test_a_group_of_series_with_locks_of_their_own_is_refused() -> None:
    """A :class:`LeanGroup` takes one lock for all its series: series that another lock
    guards (their families made without a shared ``lock``) would be counted unguarded."""
    shared = threading.Lock()
    ok = [LeanHistogram(f"calexec_g{i}", "d", ["kind"], buckets=(1.0,), lock=shared).labels("x")
          for i in range(2)]
    LeanGroup(ok).observe_ms([500.0, None])
    with pytest.raises(ValueError, match="must share one lock: 2 locks among 2 series"):
        LeanGroup([LeanHistogram(f"calexec_h{i}", "d", buckets=(1.0,)).labels()
                   for i in range(2)])
    assert ok[0].state() == ([1, 0], 0.5) and ok[1].state() == ([0, 0], 0.0)
