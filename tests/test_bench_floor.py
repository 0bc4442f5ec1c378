"""The C floor of ``calexec bench overhead`` (drivers/calrt/floor.c, issue 28).

It builds with the emulator's Makefile, produces a sane report (the shape, one time per timed
token, the floor derived from the token times, the greedy tokens of the direct loop), rejects
bad arguments with exit 2, and ``bench overhead`` reports it beside each mode, or why it could
not. No timing threshold: benchmarks report numbers, tests don't.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile

import numpy as np
import pytest

from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.device_spec import DeviceSpec
from calexec.drivers.tools.bench import core as bench
from calexec.drivers.tools.bench import floor as floor_mod

FLOOR_KEYS = {"program", "threads", "handoffs_per_token", "decode_us", "tokens", "warmup",
              "prompt_len", "vocab", "token_us_p50", "token_us_p99", "floor_us_p50",
              "floor_us_p99", "jobs_submitted", "jobs_executed", "dma_violations", "token_us",
              "token_ids"}


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> str:
    path, reason = floor_mod.build_floor(str(tmp_path_factory.mktemp("floor-build")))
    assert path is not None, reason  # CI's machines have make and a C compiler
    return path


def _run(program: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([program, *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_floor_program_report_is_sane(program):
    done = _run(program, "--decode-us", "300", "--tokens", "25", "--warmup", "3",
                "--prompt", "5,6,7,8,9")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert FLOOR_KEYS <= report.keys(), FLOOR_KEYS - report.keys()
    assert (report["decode_us"], report["tokens"], report["warmup"], report["prompt_len"]) == (
        300, 25, 3, 5)
    assert (report["threads"], report["handoffs_per_token"]) == (2, 2)
    # every job ran on the device and finished: the prefill, the warm-up, the timed tokens
    assert report["jobs_submitted"] == report["jobs_executed"] == 1 + 3 + 25
    assert report["dma_violations"] == 0
    times = np.asarray(report["token_us"])
    assert len(times) == 25 and np.all(np.isfinite(times)) and np.all(times > 0)
    assert len(report["token_ids"]) == 1 + 3 + 25
    assert all(0 <= t < report["vocab"] for t in report["token_ids"])
    # the percentiles are numpy's of the reported times, the floor is them minus the latency
    for q in (50, 99):
        assert report[f"token_us_p{q}"] == pytest.approx(np.percentile(times, q), abs=0.01)
        assert report[f"floor_us_p{q}"] == pytest.approx(report[f"token_us_p{q}"] - 300,
                                                         abs=0.011)


@pytest.mark.parametrize("roles", [2, 3])
def test_floor_decodes_the_direct_loops_tokens(program, roles):
    """The loop really feeds each argmax back, through the caller thread too with three
    roles: on the benchmark's calbin it produces the greedy tokens of the direct Python loop
    for the same prompt."""
    device = DeviceSpec()
    prompt = np.arange(100, 117, dtype=np.int32)
    with tempfile.TemporaryDirectory() as tmp:
        path = device.calbin(tmp)
        direct = bench.DirectLoop(CalRT.load(), path)
        try:
            want, _ = direct.decode_block(prompt, 6)
        finally:
            direct.close()
        loop = floor_mod.FloorLoop(program, path, warmup=2, roles=roles)
        got, times = loop.decode_block(prompt.tolist(), 6)
        assert (loop.last["threads"], loop.last["handoffs_per_token"]) == (roles, roles)
    assert got == want
    assert len(times) == 6 and all(math.isfinite(t) for t in times)
    assert loop.dma_violations == 0


@pytest.mark.parametrize(("args", "named"), [
    (["--tokens", "0"], "--tokens=0"),
    (["--tokens", "x"], "--tokens=x"),
    (["--decode-us", "-1"], "--decode-us=-1"),
    (["--decode-us", "5000000"], "--decode-us=5000000"),
    (["--prompt", "1,,a"], "--prompt=1,,a"),
    (["--bogus", "1"], "--bogus=1"),
    (["--tokens"], "--tokens="),
    (["--roles", "4"], "--roles=4"),
    (["--roles", "1"], "--roles=1"),
])
def test_floor_program_rejects_bad_arguments(program, args, named):
    done = _run(program, *args)
    assert done.returncode == 2
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0], done.stderr


def test_floor_program_runtime_failure_exits_1(program, tmp_path):
    done = _run(program, "--calbin", str(tmp_path / "missing.calbin"), "--tokens", "2")
    assert done.returncode == 1
    assert "floor:" in done.stderr and done.stdout == ""


def test_build_floor_says_why_it_cannot(tmp_path):
    path, reason = floor_mod.build_floor(str(tmp_path / "out"), calrt_dir=str(tmp_path))
    assert path is None
    assert reason is not None and "floor.c" in reason


def test_overhead_reports_the_floor_beside_each_mode(capsys):
    assert bench.main(["bench", "overhead", "--json", "--tokens", "5", "--runs", "1",
                       "--zero-tokens", "5", "--decode-us", "400,250"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["floor"]["available"] is True and report["floor"]["reason"] is None
    assert report["floor"]["roles"] == [2, 3]
    assert report["floor3_us_p50"] == report["profiles"][0]["floor3_us_p50"]
    assert report["floor_us_p50"] == report["profiles"][0]["floor_us_p50"]
    assert report["floor_ratios"] == report["profiles"][0]["floor_ratios"]
    for profile in report["profiles"]:
        side = profile["floor"]
        assert side["tokens_identical"] is True
        assert profile["floor_us_p50"] == pytest.approx(side["tpot_us_p50"]
                                                        - profile["decode_us"], abs=0.02)
        three = profile["floor3"]  # the same loop with the caller thread between
        assert three["tokens_identical"] is True
        assert profile["floor3_us_p50"] == pytest.approx(three["tpot_us_p50"]
                                                         - profile["decode_us"], abs=0.02)
        # every floor also in the modes' terms: its P50 / P99 over the same profile's
        # direct loop (the C floor's tokens timed in its own process, the direct loop's here)
        assert list(profile["floor_ratios"]) == ["floor", "floor3", "threads", "relay"]
        for side, key in (("floor", "floor"), ("floor3", "floor3"),
                          ("threads", "threads_floor"), ("relay", "relay_floor")):
            ratios, figures = profile["floor_ratios"][side], profile[key]
            for q in ("p50", "p99"):
                assert figures[f"{q}_ratio"] == ratios[f"{q}_ratio"], (side, q)
                assert ratios[f"{q}_ratio"] == pytest.approx(
                    figures[f"tpot_us_{q}"] / profile[f"direct_tpot_us_{q}"], abs=1e-4), side
                assert len(ratios[f"{q}_ratio_ci95"]) == 2, side
            assert ratios["within_gate"] == (ratios["p50_ratio"] <= 1.03
                                             and ratios["p99_ratio"] <= 1.05), side
        for mode, figures in profile["modes"].items():
            assert figures["floor_us_p50"] == profile["floor_us_p50"], mode
            assert figures["floor_us_p99"] == profile["floor_us_p99"], mode
            assert isinstance(figures["floor_us_p50"], float)
    assert report["dma_violations"] == 0


def test_overhead_without_the_floor_says_why(capsys, monkeypatch):
    monkeypatch.setattr(bench, "build_floor", lambda out_dir: (None, "no C compiler 'cc'"))
    assert bench.main(["bench", "overhead", "--json", "--tokens", "4", "--runs", "1",
                       "--zero-tokens", "4", "--decode-us", "300"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["floor"]["available"] is False
    assert report["floor"]["reason"] == "no C compiler 'cc'"
    profile = report["profiles"][0]
    assert profile["floor"] is None and profile["floor_us_p50"] is None
    assert "floor" not in profile["floor_ratios"] and "floor3" not in profile["floor_ratios"]
    assert profile["floor3"] is None and profile["floor3_us_p50"] is None
    assert report["floor"]["roles"] == []
    assert all(f["floor_us_p50"] is None and f["over_decode_to_floor_p50"] is None
               for f in profile["modes"].values())
    assert report["tokens_identical"] is True  # the other sides ran as before


def test_no_floor_flag_skips_the_build(capsys, monkeypatch):
    def refuse(out_dir):
        raise AssertionError("--no-floor must not build the floor")
    monkeypatch.setattr(bench, "build_floor", refuse)
    assert bench.main(["bench", "overhead", "--json", "--tokens", "4", "--runs", "1",
                       "--zero-tokens", "4", "--decode-us", "300", "--no-floor"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["floor"]["available"] is False and "--no-floor" in report["floor"]["reason"]
    assert os.path.basename(report["floor"]["program"]) == "floor.c"


def test_floor_loop_refuses_other_roles(tmp_path):
    with pytest.raises(ValueError, match="roles=4"):
        floor_mod.FloorLoop(str(tmp_path / "floor"), str(tmp_path / "x.calbin"), roles=4)
