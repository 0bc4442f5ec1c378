"""``calexec bench overhead`` and ``calexec bench logits`` run in-process with tiny sizes.

These check the reports' shape and the correctness facts the benchmarks verify (identical
tokens on both paths, bit-identical conversions, no slice-sized allocation on the direct
path). They never gate on a timing figure: benchmarks report numbers, tests don't.
"""

from __future__ import annotations

import json
import math
import os
import sys

import pytest

from calexec.drivers.tools.bench import core as bench

OVERHEAD_KEYS = {
    "p50_ratio", "p99_ratio", "overhead_us_p50", "tokens_identical",
    "direct_tpot_us_p50", "direct_tpot_us_p99", "executor_tpot_us_p50", "executor_tpot_us_p99",
    "direct_us_p50", "executor_us_p50", "executor_breakdown_us_p50",
    "executor_tpot_breakdown_us_p50", "tokens", "runs", "zero_tokens", "seed", "dma_violations",
}
MODE_KEYS = {"p50_ratio", "p99_ratio", "overhead_us_p50", "handoffs_per_token", "handoffs",
             "signals_without_waiter_per_token", "python_allocations_per_token",
             "numpy_data_allocations_per_token", "breakdown_us_p50", "tpot_breakdown_us_p50"}
BREAKDOWN_KEYS = {"admission_us", "prepare_us", "queue_wait_us", "execution_us",
                  "postprocess_us", "caller_us", "total_us"}
LOGITS_CASES = ("direct", "legacy", "direct_prefill", "legacy_prefill", "copy", "numpy_path",
                "fused", "fused_prefill", "fused_sumexp")
LOGITS_KEYS = {"speedup_vs_legacy", "speedup_vs_legacy_prefill", "ratio_to_copy",
               "fused_ratio_to_copy", "fused_prefill_ratio_to_copy", "numpy_path_ratio_to_copy",
               "fused_speedup_vs_numpy_path", "fused_cpu_ratio_to_copy", "fused_bit_identical",
               "fused_sumexp_rel_error",
               "cpu_model", "bit_identical", "allocations_per_token", "allocation_count_per_call", "iters",
               *(f"{case}_us_p50" for case in LOGITS_CASES),
               *(f"{case}_cpu_us" for case in LOGITS_CASES)}


def _run_json(argv: list[str], capsys) -> dict:
    assert bench.main(argv) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.count("\n") == 1, f"--json must print exactly one line, got {out!r}"
    report = json.loads(out)
    host = report.get("host")
    if isinstance(host, dict) and host.get("quiet") is False:  # said where a reader sees it
        assert f"not a quiet host ({host['noise']}" in captured.err, captured.err[-500:]
    return report


def _numbers(value) -> list[float]:
    """Every number inside a (nested) report, booleans excluded."""
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return []


def test_overhead_json_report(capsys):
    before = sys.getswitchinterval()
    report = _run_json(["bench", "overhead", "--json", "--tokens", "8", "--runs", "2",
                        "--zero-tokens", "12", "--seed", "3", "--gil-switch-us", "700"], capsys)
    assert OVERHEAD_KEYS <= report.keys(), OVERHEAD_KEYS - report.keys()
    assert report["gil_switch_interval_us"] == 700
    assert sys.getswitchinterval() == before  # restored after the run
    # what the host did beside the run (hostload.py; not Linux: available false)
    assert report["host"]["available"] is False or {
        "steal_pct", "busy_pct", "others_busy_pct", "quiet", "noise"} <= report["host"].keys()
    # gate_met is one run's verdict: the report says so and whether this host can count
    scope = report["gate_scope"]
    assert scope["runs"] == 1 and scope["cpus"] == report["cpus"]
    assert scope["counts_toward_gate"] is (report["host"].get("quiet") is True
                                           and report["cpus"] == 2)
    assert (report["tokens"], report["runs"], report["zero_tokens"], report["seed"]) == (8, 2, 12, 3)
    assert report["tokens_identical"] is True
    assert report["dma_violations"] == 0
    for key in ("executor_breakdown_us_p50", "executor_tpot_breakdown_us_p50"):
        assert BREAKDOWN_KEYS <= report[key].keys()
    numbers = _numbers(report)
    assert numbers and all(math.isfinite(n) for n in numbers)
    # Ratios are derived from the reported percentiles (numbers may be anything).
    assert report["p50_ratio"] == pytest.approx(
        report["executor_tpot_us_p50"] / report["direct_tpot_us_p50"], rel=1e-3)
    assert report["p99_ratio"] == pytest.approx(
        report["executor_tpot_us_p99"] / report["direct_tpot_us_p99"], rel=1e-3)
    # every executor mode: its ratios, hand-offs and allocations per token, its breakdown
    assert set(report["modes"]) == set(bench.MODES)
    assert report["modes"]["enqueue"]["p50_ratio"] == report["p50_ratio"]
    for mode, figures in report["modes"].items():
        assert MODE_KEYS <= figures.keys(), (mode, MODE_KEYS - figures.keys())
        assert BREAKDOWN_KEYS <= figures["tpot_breakdown_us_p50"].keys()
        assert figures["handoffs_per_token"] == pytest.approx(sum(figures["handoffs"].values()),
                                                              abs=0.01)
        # every hand-off is named by the notifying thread and the condition it signalled
        assert all("->" in name for name in figures["handoffs"]), figures["handoffs"]
        assert figures["python_allocations_per_token"] >= 0


def test_logits_json_report(capsys):
    report = _run_json(["bench", "logits", "--json", "--iters", "20"], capsys)
    assert LOGITS_KEYS <= report.keys(), LOGITS_KEYS - report.keys()
    assert report["iters"] == 20
    assert report["bit_identical"] is True
    numbers = _numbers(report)
    assert numbers and all(math.isfinite(n) for n in numbers)
    alloc = report["allocations_per_token"]
    slice_bytes = alloc["slice_bytes"]
    assert slice_bytes == report["vocab"] * 4
    # Allocation facts, not timings: the direct path holds no buffer of the slice's size,
    # the legacy path a full FP32 copy of the tensor (16 rows for the prefill tile).
    assert alloc["direct_peak_bytes"] < slice_bytes
    assert alloc["direct_prefill_peak_bytes"] < slice_bytes
    assert alloc["legacy_peak_bytes"] >= slice_bytes
    assert alloc["legacy_prefill_peak_bytes"] >= report["tile_d0"] * slice_bytes
    counts = report["allocation_count_per_call"]
    # counted, not inferred from bytes: the direct path allocates no numpy buffer per call
    assert counts["direct"]["numpy_data"] == 0 and counts["direct_prefill"]["numpy_data"] == 0
    assert counts["legacy"]["numpy_data"] >= 2 and counts["legacy_prefill"]["numpy_data"] >= 2
    assert counts["copy"] == {"python": pytest.approx(0, abs=0.5), "numpy_data": 0}
    # the fused native path: same bits and argmax as the numpy path, no numpy buffer, and at
    # most the argmax's int (the goal of issue 17: <= 2 Python allocations per call)
    assert report["fused_bit_identical"] is True
    assert report["fused_sumexp_rel_error"] < 1e-5
    for case in ("fused", "fused_prefill", "fused_sumexp"):
        assert counts[case]["numpy_data"] == 0 and counts[case]["python"] <= 2, (case, counts)
    assert counts["numpy_path"]["numpy_data"] >= 1  # np.argmax's and max's 0-d results


def test_text_report_names_the_figures(capsys):
    assert bench.main(["bench", "logits", "--iters", "5"]) == 0
    out = capsys.readouterr().out
    assert "speedup_vs_legacy" in out and "bit_identical" in out and "True" in out


def test_unknown_subcommand_is_a_usage_error(capsys):
    assert bench.main(["bench", "nonsense"]) == 2
    assert "usage" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "overhead", "--tokens", "0"],
                                  ["bench", "logits", "--iters", "-1"]])
def test_non_positive_sizes_are_rejected(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(argv)
    assert exc.value.code == 2
    assert "must be >= 1" in capsys.readouterr().err


def test_server_bench_json_report(capsys):
    from calexec.drivers.tools.bench import server_overhead as bench_server
    assert bench_server.main(["bench", "server", "--json", "--requests", "3", "--max-tokens",
                              "2", "--decode-us", "0", "--concurrency", "1,8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["loadgen"] == "process" and report["levels"] == [1, 8]
    for level in ("c1", "c8"):
        for side in ("direct", "server", "server_stream", "server_no_ahead",
                     "server_always_prearm", "server_no_bursts", "server_thread_waits",
                     "http_floor"):
            figures = dict(report[level][side])
            by_thread = figures.pop("cpu_ms_per_request_by_thread", {})  # ms per role
            figures.pop("threads_ended", None)  # a count, 0 when none ended
            assert all(math.isfinite(v) and v > 0 for v in figures.values())
            assert all(math.isfinite(v) and v >= 0 for v in by_thread.values())
        assert {"ttft_p50_ms", "ttft_p99_ms"} <= report[level]["server_stream"].keys()
        assert math.isfinite(report[level]["stream_throughput_ratio"])
        assert math.isfinite(report[level]["throughput_ratio"])
        assert math.isfinite(report[level]["ahead_p50_ratio"])


PROFILE_KEYS = {"decode_us", "tokens_identical", "direct_tpot_us_p50", "direct_tpot_us_p99",
                "direct", "modes", "gate_met"}
PROFILE_MODE_KEYS = {"p50_ratio", "p99_ratio", "tpot_us_p50", "tpot_us_p99",
                     "over_decode_us_p50", "over_decode_us_p99", "tpot_breakdown_us_p50",
                     "tpot_tail_breakdown_us"}


def test_overhead_reports_each_decode_profile(capsys):
    # repeatable and comma lists, in the given order, a duplicate dropped
    report = _run_json(["bench", "overhead", "--json", "--tokens", "6", "--runs", "1",
                        "--zero-tokens", "6", "--decode-us", "700,300", "--decode-us", "300"],
                       capsys)
    assert report["decode_us_profiles"] == [700, 300]
    assert [p["decode_us"] for p in report["profiles"]] == [700, 300]
    first = report["profiles"][0]
    # backward compatible: the top-level TPOT figures are the first profile's
    assert report["decode_us"] == 700
    assert report["direct_tpot_us_p50"] == first["direct_tpot_us_p50"]
    assert report["p50_ratio"] == first["modes"]["enqueue"]["p50_ratio"]
    assert report["modes"]["prearmed"]["p99_ratio"] == first["modes"]["prearmed"]["p99_ratio"]
    assert report["gate_met"] == first["gate_met"]
    for profile in report["profiles"]:
        assert PROFILE_KEYS <= profile.keys(), PROFILE_KEYS - profile.keys()
        # --tokens given: every profile has that many tokens per block, one block per side
        assert (profile["tokens_per_block"], profile["samples_per_side"]) == (6, 6)
        assert set(profile["modes"]) == set(bench.MODES)
        assert profile["tokens_identical"] is True
        for mode, figures in profile["modes"].items():
            assert PROFILE_MODE_KEYS <= figures.keys(), (mode, PROFILE_MODE_KEYS - figures.keys())
            # time over the decode latency is the TPOT minus that latency (P50 of a shift)
            assert figures["over_decode_us_p50"] == pytest.approx(
                figures["tpot_us_p50"] - profile["decode_us"], abs=0.02)
            # the tail's spans: tokens at or above the P99, so their mean wall time is too
            tail = figures["tpot_tail_breakdown_us"]
            assert BREAKDOWN_KEYS <= tail.keys() and tail["tokens"] >= 1, tail
            for ci in (figures["p50_ratio_ci95"], figures["p99_ratio_ci95"]):
                assert len(ci) == 2 and 0 < ci[0] <= ci[1], (mode, ci)
            assert tail["total_us"] >= figures["tpot_us_p99"] - 0.1, (tail, figures)
            assert set(profile["gate_met"]) == set(bench.MODES)
            assert profile["gate_met"][mode] == (figures["p50_ratio"] <= 1.03
                                                 and figures["p99_ratio"] <= 1.05)
        assert all(math.isfinite(n) for n in _numbers(profile))


def test_tokens_per_block_holds_the_device_time_of_100_tokens_at_10_ms():
    limit = 40000
    assert bench.tokens_per_block(10000, None, limit) == 100
    assert bench.tokens_per_block(2000, None, limit) == 500  # P99: 30th slowest of 3,000
    assert bench.tokens_per_block(1000, None, limit) == 1000
    # bounded both ways: a fast profile does not run a million tokens, a slow one keeps 100
    assert bench.tokens_per_block(1, None, limit) == bench.AUTO_TOKENS_MAX
    assert bench.tokens_per_block(1_000_000, None, limit) == bench.AUTO_TOKENS_MIN
    # --tokens wins at every profile; the sequence length bounds both
    assert bench.tokens_per_block(2000, 7, limit) == 7
    assert bench.tokens_per_block(1, None, 300) == 300
    assert bench.tokens_per_block(2000, 900, 300) == 300


def test_ratio_ci95_is_the_sampling_spread_of_the_ratio():
    import numpy as np
    rng = np.random.default_rng(1)
    d = rng.exponential(100.0, 3000) + 2000.0
    e = d * 1.1
    small = bench.ratio_ci95(e[:300], d[:300], 99)
    large = bench.ratio_ci95(e, d, 99)
    assert small is not None and large is not None
    # reproducible (fixed seed), around the true ratio, narrower with ten times the tokens
    assert bench.ratio_ci95(e, d, 99) == large
    point = float(np.percentile(e, 99) / np.percentile(d, 99))
    assert large[0] <= point <= large[1]
    assert large[1] - large[0] < small[1] - small[0]
    assert bench.ratio_ci95(e[:1], d, 99) is None


def test_every_floor_is_reported_in_the_modes_ratio_terms():
    import numpy as np
    d = 2000.0 + np.arange(100.0)  # the direct loop: P50 2049.5, P99 2098.01
    tail = d.copy()
    tail[-2:] += 1000.0  # two late tokens of 100: the P99 is 3098.01, the P50 unchanged
    tpot = {"direct": d, "floor": tail, "threads": d * 1.04, "relay": d.copy(),
            "enqueue": d * 1.01, "identical": True}  # no floor3: not measured, not reported
    floors = bench.floor_ratios(tpot)
    assert list(floors) == ["floor", "threads", "relay"]
    assert floors["floor"]["p50_ratio"] == 1.0
    assert floors["floor"]["p99_ratio"] == round(3098.01 / 2098.01, 4) == 1.4766
    assert floors["floor"]["within_gate"] is False  # P99 past 1.05
    assert floors["threads"]["p50_ratio"] == floors["threads"]["p99_ratio"] == 1.04
    assert floors["threads"]["within_gate"] is False  # P50 past 1.03
    assert floors["relay"]["p50_ratio"] == floors["relay"]["p99_ratio"] == 1.0
    assert floors["relay"]["within_gate"] is True
    # one computation for a floor and a mode: the same numbers give the same ratios
    assert {k: v for k, v in floors["floor"].items() if k != "within_gate"} == \
        bench.side_ratios(tail, d)
    assert floors["floor"]["p99_ratio_ci95"] == bench.ratio_ci95(tail, d, 99)
    assert bench.side_ratios(d * 1.01, d)["p50_ratio"] == 1.01
    assert bench.floor_ratios({"direct": d}) == {}


def test_the_text_report_tables_every_mode_and_floor_ratio():
    profile = {"decode_us": 2000, "samples_per_side": 3000,
               "modes": {"ahead": {"p50_ratio": 1.0241, "p99_ratio": 1.5012}},
               "gate_met": {"ahead": False},
               "floor_ratios": {"floor": {"p50_ratio": 0.9871, "p99_ratio": 1.2104,
                                          "within_gate": False},
                                "relay": {"p50_ratio": 1.0, "p99_ratio": 1.02,
                                          "within_gate": True}}}
    lines = bench.ratio_lines({"spec_gate": bench.SPEC_GATE, "profiles": [profile]})
    assert "1.03" in lines[0] and "1.05" in lines[0]
    assert lines[1] == "  2000 us decode, 3000 tokens per side:"
    assert lines[2].split() == ["ahead", "1.024", "/", "1.501", "gate", "not", "met"]
    assert lines[3].startswith("    C floor ") and "0.987 / 1.210  past the gate" in lines[3]
    assert "2 C threads" in lines[3]
    assert "1.000 / 1.020  within the gate" in lines[4] and "relay floor" in lines[4]
    assert len(lines) == 5  # no host record: no line about it
    loaded = {"available": True, "quiet": False, "noise": "other processes 88 % > 5 %",
              "seconds": 170.2}
    lines = bench.ratio_lines({"spec_gate": bench.SPEC_GATE, "profiles": [profile],
                               "host": loaded})
    assert lines[-1] == ("  not a quiet host (other processes 88 % > 5 %, over 170.2 s): the "
                         "ratios are not a gate figure (docs/benchmarks.md)")


def test_the_overhead_text_report_ends_with_the_ratio_table(capsys):
    assert bench.main(["bench", "overhead", "--tokens", "3", "--runs", "1", "--zero-tokens",
                       "3", "--decode-us", "300", "--no-floor"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(out) if line.startswith("ratios against the direct"))
    table = out[start + 1:]
    assert table[0] == "  300 us decode, 3 tokens per side:"
    rows = [line for line in table[1:] if line.startswith("    ")]
    assert [line.split()[0] for line in rows] == [*bench.MODES, "threads", "relay"], table
    # after the rows, at most the line that says the host was not quiet (or its load unknown)
    assert all(line.startswith(("  not a quiet host", "  host load unknown"))
               for line in table[1 + len(rows):]), table
    assert len(table) <= 2 + len(rows), table


def test_decode_profiles_default_is_10_and_2_ms():
    assert bench.decode_profiles(None) == [10000, 2000]
    assert bench.decode_profiles(["2000", "10000, 500"]) == [2000, 10000, 500]


@pytest.mark.parametrize("value", ["abc", "0", "-5", "1.5", "", "10000,x", "99999999"])
def test_bad_decode_us_names_the_flag_and_value(value, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main(["bench", "overhead", "--decode-us", value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "--decode-us=" in err
    bad = value.split(",")[-1].strip()
    assert bad in err, err


def test_the_timed_executor_has_the_system_clock_and_hand_offs_are_counted_aside(tmp_path):
    """The hand-off counting clock wraps every condition and event of the executor (a tally
    per notify, a lock per job's event): time and allocations on the very path the benchmark
    times. The executor of the timed blocks is built as a serving one is, with the system
    clock; hand-offs are counted on an executor of its own (found at stop 46: every mode's
    timed figure included the counting)."""
    from calexec.drivers.device_spec import DeviceSpec
    from calexec.machines.clock import SYSTEM

    device = DeviceSpec()
    path = device.calbin(str(tmp_path))
    rt = device.runtime()
    timed = bench.ExecutorLoop(rt, path, device)
    counting = bench.ExecutorLoop(rt, path, device, counting=True)
    try:
        assert timed.ex.clock is SYSTEM and timed.tally is None
        assert isinstance(counting.ex.clock, bench.CountingClock)
        prompt = bench.np.arange(1, 17, dtype=bench.np.int32)
        for loop in (timed, counting):
            loop.mode = "enqueue"
            tokens, _ = loop.decode_block(prompt, 4)
            assert len(tokens) == 5
        assert set(timed.accounting(prompt, 5)) == {
            "python_allocations_per_token", "numpy_data_allocations_per_token"}
        handoffs = counting.accounting(prompt, 5)
        # the spec's thread roles each signal per token; whether the thread signalled was
        # already waiting (a hand-off) or still busy (a signal without a waiter) is the
        # host's scheduling (CI at stop 53, under load: 2.8 hand-offs + 3.0 signals without)
        assert handoffs["handoffs_per_token"] > 0, handoffs
        assert (handoffs["handoffs_per_token"]
                + handoffs["signals_without_waiter_per_token"]) >= 3, handoffs
    finally:
        timed.close()
        counting.close()


@pytest.mark.parametrize("argv", [
    ["bench", "recovery", "--json", "--recoveries", "1"],
    ["bench", "pingpong", "--json", "--seqs", "1", "--tokens", "1", "--solo-tokens", "1"],
    ["bench", "charts", "--json", "--iters", "5"],
], ids=["recovery", "pingpong", "charts"])
def test_every_bench_report_names_the_cpu_model_and_core_count(argv, capsys):
    """A figure is only worth its number with the machine it came from (docs/benchmarks.md:
    `lscpu` model and cores); until stop 63 these reports named neither, or no model."""
    if argv[1] == "charts":
        from calexec.drivers.tools.bench import chart_cost

        assert chart_cost.main(argv) == 0
        report = json.loads(capsys.readouterr().out)
    else:
        report = _run_json(argv, capsys)
    assert report["cpu_model"] == bench.cpu_model() and report["cpu_model"]
    assert report["cpus"] == os.cpu_count()
    if argv[1] == "pingpong":  # its enable_by_default verdict says what it is worth too
        assert report["gate_scope"]["runs"] == 1 and "available" in report["host"]
        assert report["gate_scope"]["counts_toward_gate"] is (
            report["host"].get("quiet") is True and report["cpus"] == 2)
