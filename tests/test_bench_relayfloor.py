"""The native-relay floor of ``calexec bench overhead`` (drivers/tools/bench/relayfloor.py,
issue 28): the executor's thread roles with the token carried from job to job by the native
relay, on the emulator.

It decodes the direct loop's greedy tokens; a job the plain path would not fire after (a NaN
or Inf in its logits, a short output, a CCU exception) is not fired by the relay either, and
the failure reaches the caller naming the thread and why (never a hang), as does a refused
infer; ``bench overhead`` reports the side beside the others, or says why not
(``--no-relay-floor``). No timing threshold: benchmarks report numbers, tests don't.
"""

from __future__ import annotations

import json
import tempfile
import threading

import numpy as np
import pytest

from calexec.drivers.calrt.runtime import Fault, FaultMode
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.drivers.tools.bench import core as bench
from calexec.drivers.tools.bench.relayfloor import DELIVERIES, RelayLoop, RelayLoopError

PROMPT = np.asarray([5, 6, 7, 8, 9, 10, 11], dtype=np.int32)


def _relay_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("calexec-bench-relay")]


@pytest.fixture(params=[(deliver, True) for deliver in DELIVERIES] + [("python", False)],
                ids=lambda p: p[0] if p[1] else f"{p[0]}-no-rules")
def loops(request):
    """Each delivery with fire rules (which path a job takes then depends on whether the
    submitter armed the next job before it completed: both happen), and with none (every job
    on the plain path: the completion thread's Python checks it and fires the next)."""
    deliver, rules = request.param
    device = DeviceSpec()
    with tempfile.TemporaryDirectory() as tmp:
        path = device.calbin(tmp)
        rt = device.runtime()
        direct = bench.DirectLoop(rt, path)
        relay = RelayLoop(rt, path, bench.BENCH_SEQ, wait_s=10.0, python_work_us=20,
                          deliver=deliver, rules=rules)
        try:
            yield direct, relay
        finally:
            relay.close()
            direct.close()


@pytest.mark.parametrize("decode_us", [0, 300])
def test_the_relay_loop_answers_as_the_direct_loop(loops, decode_us):
    """Each way of delivering the token (``deliver``), at zero latency too, where the device
    runs ahead of the caller past the decisions the relay keeps."""
    direct, relay = loops
    direct.set_decode_latency(decode_us)
    relay.set_decode_latency(decode_us)
    want, _ = direct.decode_block(PROMPT, 30)
    got, times = relay.decode_block(PROMPT, 30)
    assert got == want and len(times) == 30
    again, _ = relay.decode_block(PROMPT, 30)  # a second block on the same sequence id
    assert again == want
    assert relay.rule_fires + relay.plain_fires == 2 * 29
    if not relay.rules:
        assert relay.rule_fires == 0
    assert relay.dma_violations() == 0


@pytest.mark.parametrize("point, why", [
    (Fault.OUTPUT_NAN, "NONFINITE"), (Fault.OUTPUT_INF, "NONFINITE"),
    (Fault.OUTPUT_SHORT, "SHORT"), (Fault.CCU_EXCEPTION, "NOT_DONE"),
])
def test_a_job_the_plain_path_would_refuse_is_not_fired_and_the_caller_hears_why(loops, point, why):
    _, relay = loops
    relay.set_decode_latency(300)
    emu = relay.runner.device.emu
    assert emu is not None
    assert emu.set_fault(point, FaultMode.NTH, 4) == 0  # the 4th job from now: decode tag 3
    with pytest.raises(RelayLoopError, match=f"calexec-bench-relay-completion: job 3: .*{why}"):
        relay.decode_block(PROMPT, 20)
    # nothing was fired after the faulted job: 2 fired by rules or the plain path, not more
    assert relay.rule_fires + relay.plain_fires == 2
    counters = relay.relay.counters()
    assert counters["inferred"] == 3 and counters["queued"] == 0
    relay.close()
    assert _relay_threads() == []


def test_a_refused_infer_reaches_the_caller_naming_the_submitter(loops):
    _, relay = loops
    emu = relay.runner.device.emu
    assert emu is not None
    assert emu.set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 3, rc=17) == 0
    with pytest.raises(RelayLoopError, match="calexec-bench-relay-submitter: infer\\(tag=2\\) returned 17"):
        relay.decode_block(PROMPT, 10)
    with pytest.raises(RelayLoopError, match="submitter"):  # the loop stays failed
        relay.decode_block(PROMPT, 1)


def test_a_block_beyond_the_sequence_is_refused_before_any_job(loops):
    _, relay = loops
    with pytest.raises(RelayLoopError, match="KV apply"):
        relay.decode_block(PROMPT, calbin_fmt.MAX_SEQ)
    assert relay.relay.counters()["inferred"] == 0


def test_an_unknown_delivery_is_refused_naming_it():
    device = DeviceSpec()
    with tempfile.TemporaryDirectory() as tmp:
        with pytest.raises(ValueError, match="deliver='fast': one of python, native, caller"):
            RelayLoop(device.runtime(), device.calbin(tmp), bench.BENCH_SEQ, deliver="fast")


def test_overhead_reports_the_relay_floor_beside_the_others(capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "not in this test"))
    assert bench.main(["bench", "overhead", "--json", "--tokens", "5", "--runs", "2",
                       "--zero-tokens", "5", "--decode-us", "400,250", "--no-threads-floor",
                       "--relay-work-us", "20", "--relay-deliver", "caller"]) == 0
    report = json.loads(capsys.readouterr().out)
    side = report["relay_floor"]
    assert side["available"] is True and side["reason"] is None
    assert side["python_work_us"] == 20 and side["threads"] == 3
    assert side["deliver"] == "caller"
    assert side["rule_fires"] + side["plain_fires"] > 0
    assert isinstance(side["overhead_us_p50"], float)
    assert report["relay_floor_us_p50"] == report["profiles"][0]["relay_floor_us_p50"]
    for profile in report["profiles"]:
        r = profile["relay_floor"]
        assert r["tokens_identical"] is True
        assert profile["relay_floor_us_p50"] == pytest.approx(
            r["tpot_us_p50"] - profile["decode_us"], abs=0.02)
        assert r["p50_ratio"] == pytest.approx(r["tpot_us_p50"] / profile["direct_tpot_us_p50"],
                                               abs=1e-4)
    assert report["dma_violations"] == 0


def test_no_relay_floor_flag_says_why_and_a_bad_work_value_is_refused(capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "not in this test"))

    def refuse(*args, **kwargs):
        raise AssertionError("--no-relay-floor must not start the relay loop")
    monkeypatch.setattr(bench, "RelayLoop", refuse)
    assert bench.main(["bench", "overhead", "--json", "--tokens", "4", "--runs", "1",
                       "--zero-tokens", "4", "--decode-us", "300", "--no-threads-floor",
                       "--no-relay-floor"]) == 0
    report = json.loads(capsys.readouterr().out)
    side = report["relay_floor"]
    assert side["available"] is False and "--no-relay-floor" in side["reason"]
    assert side["overhead_us_p50"] is None and report["relay_floor_us_p50"] is None
    assert report["profiles"][0]["relay_floor"] is None
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["bench", "overhead", "--relay-work-us", "-5"])
    assert exit_info.value.code == 2
    assert "--relay-work-us" in capsys.readouterr().err


def test_native_relay_runs_every_mode_again_on_the_relay_executor(capsys, monkeypatch):
    """``--native-relay``: each executor mode a second time as ``MODE+relay`` on an executor
    with ``ExecutorConfig.native_relay``, in the same rotation; the direct loop's tokens,
    and the report says how many steps its submitter inferred from the relay."""
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "not in this test"))
    assert bench.main(["bench", "overhead", "--json", "--tokens", "6", "--runs", "2",
                       "--zero-tokens", "6", "--decode-us", "1500", "--no-threads-floor",
                       "--no-relay-floor", "--native-relay"]) == 0
    report = json.loads(capsys.readouterr().out)
    relay_modes = [m + bench.RELAY_SUFFIX for m in bench.MODES]
    assert list(report["modes"]) == [*bench.MODES, *relay_modes]
    assert report["native_relay"]["modes"] == relay_modes
    assert 0 < report["native_relay"]["relay_submitted"] <= report["native_relay"]["submitted"]
    assert report["tokens_identical"] is True and report["dma_violations"] == 0
    for mode in relay_modes:
        assert report["modes"][mode]["handoffs_per_token"] >= 0
        assert mode in report["profiles"][0]["modes"]
    assert set(report["gate_met"]) == set(report["modes"])


def test_without_native_relay_no_mode_runs_on_a_relay(capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "not in this test"))
    assert bench.main(["bench", "overhead", "--json", "--tokens", "4", "--runs", "1",
                       "--zero-tokens", "4", "--decode-us", "300", "--no-threads-floor",
                       "--no-relay-floor"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert list(report["modes"]) == list(bench.MODES)
    assert report["native_relay"] == {"modes": [], "relay_submitted": None, "submitted": None}
