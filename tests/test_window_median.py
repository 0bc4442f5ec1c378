"""``service.WindowMedian`` (stop 67, issue 28): the device-wait median the server reads per
decode job (``CompletionService.decode_device_ms``), kept sorted as the waits come. Equal to
the computation it replaced (a ring of the last ``size`` waits, ``math.inf`` for none yet,
``statistics.median`` of those not infinite) after every add, for seeded sequences with
repeated, tied, tiny and large values and infinities, at several window sizes."""

from __future__ import annotations

import math
import random
import statistics

import pytest

from calexec.drivers.serving.service import WindowMedian


def _plain(size: int, values: list[float]) -> list[float | None]:
    """The old computation: a ring of ``size`` slots (inf: none yet), the median of the
    slots that are not inf, after each value."""
    ring = [math.inf] * size
    out: list[float | None] = []
    for at, value in enumerate(values):
        ring[at % size] = value
        waits = [ms for ms in list(ring) if ms != math.inf]
        out.append(statistics.median(waits) if waits else None)
    return out


def _values(rng: random.Random, count: int) -> list[float]:
    pick = [lambda: float(rng.randrange(5)),           # ties
            lambda: rng.uniform(0.0, 0.05),              # a fast device's waits
            lambda: rng.lognormvariate(0.0, 2.0),        # a heavy tail
            lambda: math.inf,                            # a slot with no wait
            lambda: rng.choice([0.0, 1e-9, 1e9])]
    return [rng.choice(pick)() for _ in range(count)]


@pytest.mark.parametrize("size", [1, 2, 3, 5, 32])
@pytest.mark.parametrize("seed", [0, 1, 67])
def test_every_median_equals_the_plain_computation(size, seed):
    values = [math.inf, *_values(random.Random(seed * 100 + size), 600)]
    window = WindowMedian(size)
    got = []
    for value in values:
        window.add(value)
        got.append(window.median())
    assert got == _plain(size, values)
    # (a window of nothing but infinities first; then many distinct medians)
    assert got[0] is None and len({m for m in got if m is not None}) > 10


def test_no_value_yet_is_none_and_a_size_below_one_is_refused():
    assert WindowMedian(4).median() is None
    with pytest.raises(ValueError, match="size=0"):
        WindowMedian(0)
