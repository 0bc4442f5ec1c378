"""The Python-threads floor of ``calexec bench overhead`` (drivers/tools/bench/pyfloor.py,
issue 28): the direct loop run by the executor's three thread roles and nothing else.

It produces the direct loop's greedy tokens at zero latency and with a decode latency, one
time per token; a failure in a device thread reaches the caller as an error naming the thread
and the call (never a hang), and close() ends both threads; ``bench overhead`` reports it
beside each mode (the arithmetic of ``over_threads_floor_us_p50``), or says why not
(``--no-threads-floor``). No timing threshold: benchmarks report numbers, tests don't.
"""

from __future__ import annotations

import json
import tempfile
import threading

import numpy as np
import pytest

from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.tools.bench import core as bench
from calexec.drivers.tools.bench.pyfloor import ThreadedLoop, ThreadedLoopError

PROMPT = np.asarray([5, 6, 7, 8, 9, 10, 11], dtype=np.int32)


def _pyfloor_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("calexec-bench-pyfloor")]


@pytest.fixture
def loops():
    device = DeviceSpec()
    with tempfile.TemporaryDirectory() as tmp:
        path = device.calbin(tmp)
        rt = device.runtime()  # the bundled emulator (latency controls)
        direct = bench.DirectLoop(rt, path)
        threaded = ThreadedLoop(rt, path, bench.BENCH_SEQ, wait_s=10.0)
        try:
            yield direct, threaded
        finally:
            threaded.close()
            direct.close()


@pytest.mark.parametrize("decode_us", [1, 300])
def test_threaded_loop_answers_as_the_direct_loop(loops, decode_us):
    direct, threaded = loops
    direct.set_decode_latency(decode_us)
    threaded.set_decode_latency(decode_us)
    for block in range(2):  # a second block on the released sequence answers alike
        want, _ = direct.decode_block(PROMPT, 12)
        got, times = threaded.decode_block(PROMPT, 12)
        assert got == want, block
        assert len(times) == 12 and all(np.isfinite(times)) and min(times) > 0
    assert threaded.dma_violations() == 0


def test_a_device_thread_failure_reaches_the_caller_and_close_ends_the_threads(loops):
    _, threaded = loops
    assert len(_pyfloor_threads()) == 2
    # past the sequence's capacity the submitter's KV Apply fails (DriverError) in its thread
    with pytest.raises(ThreadedLoopError, match="calexec-bench-pyfloor-submitter: .*kv apply"):
        threaded.step(5, calbin_fmt.MAX_SEQ)
    with pytest.raises(ThreadedLoopError, match="submitter"):  # the loop stays failed
        threaded.decode_block(PROMPT, 1)
    threaded.close()
    assert _pyfloor_threads() == []


def test_overhead_reports_the_threads_floor_beside_each_mode(capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "not in this test"))
    assert bench.main(["bench", "overhead", "--json", "--tokens", "5", "--runs", "2",
                       "--zero-tokens", "5", "--decode-us", "400,250"]) == 0
    report = json.loads(capsys.readouterr().out)
    side = report["threads_floor"]
    assert side["available"] is True and side["reason"] is None
    assert (side["threads"], side["handoffs_per_token"]) == (3, 3)
    assert isinstance(side["overhead_us_p50"], float)
    assert report["threads_floor_us_p50"] == report["profiles"][0]["threads_floor_us_p50"]
    for profile in report["profiles"]:
        t = profile["threads_floor"]
        assert t["tokens_identical"] is True
        assert profile["threads_floor_us_p50"] == pytest.approx(
            t["tpot_us_p50"] - profile["decode_us"], abs=0.02)
        assert t["p50_ratio"] == pytest.approx(t["tpot_us_p50"] / profile["direct_tpot_us_p50"],
                                               abs=1e-4)
        for mode, figures in profile["modes"].items():
            assert figures["over_threads_floor_us_p50"] == pytest.approx(
                figures["over_decode_us_p50"] - profile["threads_floor_us_p50"], abs=0.02), mode
    assert report["dma_violations"] == 0 and report["tokens_identical"] is True


def test_no_threads_floor_flag_says_why(capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "not in this test"))

    def refuse(*args, **kwargs):
        raise AssertionError("--no-threads-floor must not start the threaded loop")
    monkeypatch.setattr(bench, "ThreadedLoop", refuse)
    assert bench.main(["bench", "overhead", "--json", "--tokens", "4", "--runs", "1",
                       "--zero-tokens", "4", "--decode-us", "300", "--no-threads-floor"]) == 0
    report = json.loads(capsys.readouterr().out)
    side = report["threads_floor"]
    assert side["available"] is False and "--no-threads-floor" in side["reason"]
    assert side["overhead_us_p50"] is None and report["threads_floor_us_p50"] is None
    profile = report["profiles"][0]
    assert profile["threads_floor"] is None
    assert all(f["over_threads_floor_us_p50"] is None for f in profile["modes"].values())
