"""The allocation counter (drivers/alloccount.py, C hooks in drivers/alloccount_build.py)
and the allocation facts of the logits conversion it proves (§13.3 "allocation count")."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from calexec.drivers import alloccount
from calexec.drivers.alloccount import AllocCounterError, count
from calexec.machines.postprocess import bf16_all_finite, bf16_to_f32_into, bf16_to_f32_legacy

V = 151936


def test_counts_numpy_data_buffers_exactly():
    a = np.zeros(1000)
    out = np.empty(1000)
    assert count(lambda: np.add(a, a, out=out), 50).numpy_data == 0
    assert count(lambda: a + a, 50).numpy_data == 1  # one temporary result
    assert count(lambda: (a + a) * a, 50).numpy_data == 2
    assert count(lambda: np.empty((3, 1000)), 50).numpy_data == 1


def test_counts_python_allocations():
    a = np.zeros(10)
    view = count(lambda: a[2:5], 50)
    assert view.python >= 1 and view.numpy_data == 0  # a view: a header, no data
    assert count(lambda: [object() for _ in range(10)], 50).python >= 10
    assert count(lambda: None, 50).python < 1


def test_hooks_are_removed_and_counting_can_repeat():
    for _ in range(3):
        assert count(lambda: np.empty(5), 10).numpy_data == 1
    assert not alloccount.installed()
    # arrays allocated while counting are freed later through the wrapped allocator
    kept = []
    count(lambda: kept.append(np.full(100, 1.0)), 20)
    assert len(kept) == 21 and sum(float(k.sum()) for k in kept) == 2100.0  # + 1 warm-up


def test_nested_count_and_bad_calls_are_refused():
    with pytest.raises(AllocCounterError, match="already installed"):
        count(lambda: count(lambda: None, 1), 1)
    assert not alloccount.installed()
    with pytest.raises(ValueError, match="calls=0"):
        count(lambda: None, 0)


def test_numpy_count_is_per_thread_python_count_is_global():
    stop = threading.Event()

    def allocating() -> None:
        while not stop.is_set():
            np.ones(10)
            stop.wait(0.0005)
    worker = threading.Thread(target=allocating)
    worker.start()
    try:
        measured = count(lambda: stop.wait(0.001), 50)
    finally:
        stop.set()
        worker.join(10)
    assert measured.numpy_data == 0  # the other thread's arrays use its own context's handler


def test_direct_logits_conversion_allocates_no_numpy_buffer():
    rng = np.random.default_rng(3)
    src = (rng.standard_normal(4 * V, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    dst = np.empty(V, np.float32)
    direct = count(lambda: bf16_to_f32_into(src, 2 * V, V, dst), 100)
    legacy = count(lambda: bf16_to_f32_legacy(src, 2 * V, V, dst), 100)
    assert direct.numpy_data == 0
    assert legacy.numpy_data >= 2  # the widened whole tensor and its shifted copy
    scratch = np.empty(V, np.uint16)
    # the finiteness check: one reduction result, no buffer of the row's size
    assert count(lambda: bf16_all_finite(src[:V], scratch), 100).numpy_data <= 1


def test_a_function_counted_alone_is_not_charged_another_threads_allocations():
    """``every_thread=False``: another thread that allocates while the function is counted
    (here one making objects without pause while the function sleeps) adds nothing to its
    count, while the every-thread count sees it. ``bench logits`` counts its cases this way:
    in a test suite's process another test's leftover thread allocated during the count, and
    CI read the fused path's 0-1 allocations a call as 3.75 (stop 70)."""
    stop, started = threading.Event(), threading.Event()

    def churn() -> None:
        started.set()
        while not stop.is_set():
            [object() for _ in range(100)]

    thread = threading.Thread(target=churn, name="t-churn")
    thread.start()
    try:
        assert started.wait(10)
        alone = count(lambda: time.sleep(0.002), 20, every_thread=False)
        every = count(lambda: time.sleep(0.002), 20)
    finally:
        stop.set()
        thread.join(10)
    assert alone.python < 1, alone
    assert every.python >= 10, every  # (the other thread did allocate meanwhile)
