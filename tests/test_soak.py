"""``calexec bench soak`` (issue 28) run CI-sized, in-process: every check passes on a small
run with one fault of each kind, and each check can fail: a corrupted token, a leaked sequence
id, a thread left running, a growing RSS and a growing count of live objects (test seams,
``soak.Hooks``) are reported and give exit 1; an error outside the documented budget is
counted beyond it. Never a timing figure.
"""

from __future__ import annotations

import json
import os
import platform
import threading

import pytest

import needs

needs.module("httpx", "server")  # the soak drives the server over HTTP ([server])
from calexec.drivers.tools.bench import soak  # noqa: E402
from calexec.drivers.tools.chaos import FAULTS  # noqa: E402

#: CI-sized by default; CALEXEC_SOAK_REQUESTS / CALEXEC_SOAK_FAULTS for a longer run
REQUESTS = int(os.environ.get("CALEXEC_SOAK_REQUESTS", "200"))
FAULT_COUNT = int(os.environ.get("CALEXEC_SOAK_FAULTS", str(len(FAULTS) + 1)))
#: a run of a few seconds is all warm-up (the RSS rises as the pools, caches and generations
#: fill): the RSS check is exercised by the long run, not bounded here
RSS_BOUND = "4096"
ARGS = ["--json", "--clients", "6", "--seed", "5", "--decode-us", "0,2000",
        "--max-tokens", "3-6", "--progress-s", "600", "--max-seconds", "300",
        "--rss-bound-mib", RSS_BOUND]


def _run(capsys, requests: int, faults: int, hooks: soak.Hooks | None = None,
         flags: tuple[str, ...] = ()) -> tuple[int, dict, str]:
    code = soak.run_cli(["bench", "soak", "--requests", str(requests), "--faults", str(faults),
                         *ARGS, *flags], hooks)
    out, err = capsys.readouterr()
    assert out.count("\n") == 1, f"--json must print exactly one line, got {out!r}"
    return code, json.loads(out), err


def test_small_soak_passes_every_check_with_every_fault_kind(capsys):
    code, report, _ = _run(capsys, REQUESTS, FAULT_COUNT)
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["ok"]}
    assert code == 0 and report["ok"], failed
    assert set(report["checks"]) == {"requests", "faults", "wrong_tokens", "client_errors",
                                     "rss", "objects", "pools", "threads", "server"}
    assert report["requests_finished"] == REQUESTS
    assert set(report["by_mode"]) == set(soak.MODES)  # plain, stream, slow, disconnect
    kinds = {name for name, _, _ in FAULTS} | {"map_fail"}
    assert set(report["faults_by_kind"]) == kinds and report["faults_fired"] == FAULT_COUNT
    assert report["wrong_tokens"] == 0 and report["errors_beyond_budget"] == {}
    # only the faults the server does not resume from cost a client its request
    assert set(report["errors_documented"]) <= soak.NOT_RESUMED
    assert report["resumes_by_cause"] and report["recoveries"] >= 1
    assert [p["decode_us"] for p in report["phases"]] == [0, 2000]
    # the 2 ms phase runs the server's pre-armed decode streams
    assert report["phases"][1]["decode_steps_prearmed"] >= 1
    assert report["native_relay"] is False and report["relay_submitted"] == 0
    # the machine the figures are from: its CPU model and core count (until stop 63: no count)
    assert report["cpu_model"] and report["cpus"] == os.cpu_count()
    assert report["decode_steps_prearmed"] >= report["phases"][1]["decode_steps_prearmed"]
    start, end = report["pools_start"], report["pools_end"]
    assert {k: v for k, v in start.items() if k != "buffer_slots"} == \
        {k: v for k, v in end.items() if k != "buffer_slots"}
    assert end["buffer_slots"]["Leased"] == end["buffer_slots"]["InFlight"] == 0
    assert end["sequence_ids"]["free"] == end["sequence_ids"]["capacity"]
    assert end["kv_free_blocks"] == end["kv_capacity_blocks"] and end["kv_reserved_tokens"] == 0
    assert report["threads_leaked"] == []
    assert report["rss_mib"]["samples"] >= 1 and report["rss_mib"]["last"] > 0
    # the RSS is judged per phase; the live objects of the idle server, before and after
    assert [p["decode_us"] for p in report["rss_mib"]["by_phase"]] == [0, 2000]
    objects = report["live_objects"]
    assert objects["start"] > 0 and objects["growth"] == objects["end"] - objects["start"]
    assert objects["growth"] <= soak.LIVE_OBJECTS_SLACK
    # the process runs with calexec serve's memory policy (drivers/memory.py) where it can
    assert report["mmap_threshold_pinned"] is (platform.libc_ver()[0] == "glibc")


def test_a_small_soak_on_the_native_relay_passes_every_check(capsys):
    """``--native-relay``: the same faults under the same load with the executor's submitter
    on its native relay (every fault kind, resumes, recoveries): no wrong token, nothing
    beyond the budget, nothing leaked, and steps really went to infer() from the relay."""
    code, report, _ = _run(capsys, REQUESTS, FAULT_COUNT, flags=("--native-relay",))
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["ok"]}
    assert code == 0 and report["ok"], failed
    assert report["native_relay"] is True and report["faults_fired"] == FAULT_COUNT
    assert report["wrong_tokens"] == 0 and report["errors_beyond_budget"] == {}
    # the run's whole count, not a phase's: in a phase, under load, a step reaches the relay
    # only while the submitter idles in it (CI once saw 0 of phase 1's 16 pre-armed steps);
    # the fault-free references before the phases come one at a time, to an idle submitter
    assert report["relay_submitted"] >= 1, report["phases"]
    assert report["relay_submitted"] >= sum(p["relay_submitted"] for p in report["phases"])


def test_a_small_soak_in_phase_b_passes_every_check(capsys):
    """``--inflight-capacity 2``: the same faults under the same load with two jobs on the
    device (Phase B), kept there for the whole run (no downgrade: two faults after submit
    would end Phase B for the rest of it): no wrong token, nothing beyond the budget, nothing
    leaked. Before stop 57 neither soak nor fault bench could run Phase B at all."""
    code, report, _ = _run(capsys, REQUESTS, FAULT_COUNT, flags=("--inflight-capacity", "2"))
    failed = {name: c["detail"] for name, c in report["checks"].items() if not c["ok"]}
    assert code == 0 and report["ok"], failed
    assert report["inflight_capacity"] == 2 and report["faults_fired"] == FAULT_COUNT
    assert report["downgrades"] == 0 and report["inflight_capacity_end"] == 2, report
    assert report["wrong_tokens"] == 0 and report["errors_beyond_budget"] == {}


def test_a_wrong_token_a_leaked_id_a_leaked_thread_growing_rss_and_objects_fail_the_run(
        capsys, monkeypatch):
    monkeypatch.setattr(soak, "THREAD_WAIT_S", 1.0)  # the leaked thread is waited for that long
    corrupted: list[dict] = []
    release = threading.Event()
    leaked = threading.Thread(target=release.wait, args=(30,), name="test-soak-leak")

    def corrupt(body: dict, tokens: list[int]) -> list[int]:
        if corrupted or not tokens or "seed" in body:
            return tokens
        corrupted.append(body)
        return [tokens[0] + 1, *tokens[1:]]

    rss_calls: list[int] = []

    def growing_rss() -> int:  # 8 GiB more at every sample: past any bound after warm-up
        rss_calls.append(1)
        return len(rss_calls) << 33

    counts = iter((100_000, 100_000 + soak.LIVE_OBJECTS_SLACK + 1))

    def leak(service, executor) -> None:
        assert service.sequences.acquire() is not None  # taken, never given back
        leaked.start()

    try:
        code, report, err = _run(capsys, 60, 1, soak.Hooks(
            tokens=corrupt, after_traffic=leak, rss=growing_rss,
            objects=lambda: next(counts)))
    finally:
        release.set()
        if leaked.is_alive() or leaked.ident is not None:
            leaked.join(10)
    assert code == 1 and not report["ok"]
    checks = report["checks"]
    assert len(corrupted) == 1
    assert not checks["wrong_tokens"]["ok"] and report["wrong_tokens"] == 1
    assert report["wrong_examples"][0]["request"]["prompt"] == corrupted[0]["prompt"]
    assert not checks["pools"]["ok"] and report["pools_end"]["sequence_ids"]["in_use"] == 1
    assert not checks["threads"]["ok"] and report["threads_leaked"] == ["test-soak-leak"]
    assert not checks["rss"]["ok"] and report["rss_mib"]["samples"] >= 3
    assert report["rss_mib"]["growth"] > 64.0, report["rss_mib"]
    assert not checks["objects"]["ok"]
    assert report["live_objects"]["growth"] == soak.LIVE_OBJECTS_SLACK + 1
    # the rest held: the seams are what failed
    assert all(checks[name]["ok"] for name in ("requests", "faults", "client_errors",
                                               "server"))
    assert "checks failed: wrong_tokens, rss, objects, pools, threads" in err


def test_a_slow_schedule_still_meets_traffic_with_every_fault(capsys):
    """The schedule arms each fault late (as on a busy host, or after a long recovery): the
    traffic waits at the fault's step, so every fault still has requests to land on. Before,
    the traffic ran on to the next step meanwhile and a fault armed after it met none."""
    armed: list[int] = []

    def late(i: int) -> None:
        armed.append(i)
        threading.Event().wait(0.4)  # the traffic of a step takes a few ms at most here

    code, report, _ = _run(capsys, 80, 4, soak.Hooks(before_arm=late))
    assert armed == [0, 1, 2, 3]
    assert report["faults_not_fired"] == {}, report["checks"]["faults"]["detail"]
    assert code == 0 and report["ok"] and report["faults_fired"] == 4
    assert report["requests_finished"] == 80


def test_a_run_cut_by_max_seconds_fails_the_requests_and_faults_checks(capsys):
    at = ARGS.index("--max-seconds")  # (a flag given twice is refused: ARGS' 300 replaced)
    code = soak.run_cli(["bench", "soak", "--requests", "100000", "--faults", "2",
                         *ARGS[:at], *ARGS[at + 2:], "--max-seconds", "4"])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert code == 1 and not report["ok"]
    assert not report["checks"]["requests"]["ok"] and report["requests_finished"] < 100000
    assert not report["checks"]["faults"]["ok"] and report["faults_fired"] < 2
    # stopped, then joined: every client returned, the server went idle, no thread left
    # (the soak's own bounded waits; a wall-clock bound on the run said nothing more)
    assert report["checks"]["server"]["ok"], report["checks"]["server"]["detail"]
    assert report["checks"]["threads"]["ok"], report["checks"]["threads"]["detail"]
    assert "checks failed: requests, faults" in err


@pytest.mark.parametrize("argv,flag,value", [
    (["--requests", "8", "--faults", "2"], "--requests", "8"),      # 3 * (2 + 1) = 9 needed
    (["--requests", "2", "--faults", "1", "--clients", "4"], "--requests", "2"),
])
def test_a_run_whose_requests_cannot_carry_its_faults_is_refused_at_the_cli(capsys, argv, flag,
                                                                            value):
    """``calexec bench soak`` refuses, in one line naming the flag and its value, exit 2, a run
    too small for its fault schedule: fault i is armed at (i + 1) * requests // (faults + 1)
    requests and each fault needs 3 of its own (armed on one of the next 1-3 calls), so
    ``--requests >= 3 * (faults + 1)`` (one client carries them since stop 59: the schedule
    nudges a request a KV fault refused, tests/test_soak_probe59.py). Before the fix such a
    run started a server and failed (faults not fired), or ran with its faults unplaced."""
    from calexec import cli

    code = cli.main(["bench", "soak", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and f"{flag}: {value} cannot carry --faults" in err, err


def test_the_bound_is_the_fewest_requests_that_give_each_fault_three(capsys):
    """At ``--requests 3 * (faults + 1)`` every fault's share of the schedule holds 3."""
    for faults in range(1, 40):
        requests = soak.REQUESTS_PER_FAULT * (faults + 1)
        assert soak.schedule_refusal(requests, faults, 2) is None
        assert soak.schedule_refusal(requests - 1, faults, 2) is not None
        due = [(i + 1) * requests // (faults + 1) for i in range(faults)] + [requests]
        assert min(b - a for a, b in zip(due, due[1:])) >= soak.REQUESTS_PER_FAULT
    assert soak.schedule_refusal(1, 0, 1) is None  # no fault: anything goes
    assert soak.schedule_refusal(9, 2, 1) is None  # one client carries faults (stop 59)


def test_a_run_with_no_faults_is_allowed_and_runs(capsys):
    """``--faults 0`` (refused by argparse before the fix: "must be >= 1") runs a fault-free
    soak through the CLI entry and passes every check."""
    from calexec import cli

    code = cli.main(["bench", "soak", "--requests", "12", "--faults", "0", "--clients", "1",
                     *ARGS[:1], *ARGS[3:]])
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert code == 0 and report["ok"], (err, {k: c for k, c in report["checks"].items()
                                              if not c["ok"]})
    assert report["faults_requested"] == 0 and report["requests_finished"] == 12


def test_errors_beyond_the_documented_budget_are_counted():
    windows = [{"kind": "unknown_csr", "armed": 10.0, "ended": 11.0, "fired": 1},
               {"kind": "hang", "armed": 20.0, "ended": 21.0, "fired": 1}]
    errors = [(10.2, 10.3, "HTTP 500 calrt.csr_failed"),   # the request that met the fault
              (10.4, 10.5, "HTTP 500 calrt.csr_failed"),   # a second one: beyond (1 firing)
              (20.1, 20.5, "HTTP 503 lifecycle.recovering"),  # a resumable fault: beyond
              (30.0, 30.1, "transport ReadError")]          # outside any window: beyond
    documented, beyond = soak.classify_errors(errors, windows)
    assert documented == {"unknown_csr": 1}
    assert beyond == {"HTTP 500 calrt.csr_failed": 1, "HTTP 503 lifecycle.recovering": 1,
                      "transport ReadError": 1}


@pytest.mark.parametrize("flag,value,message", [
    ("--decode-us", "0,x", "--decode-us='0,x': 'x' is not US or US:SHARE"),
    ("--decode-us", "2000:0", "--decode-us='2000:0': share '0' of 2000 must be > 0"),
    ("--max-tokens", "8-4", "--max-tokens='8-4': needs 1 <= LO <= HI"),
    # above the model's context: the server was started, then its first request was a 400
    # context_length_exceeded and the run ended "fault-free reference failed", exit 1 (stop 56)
    ("--max-tokens", "4-40945", "--max-tokens='4-40945': at most 40944 tokens"),
    ("--max-tokens", "99999999999999", "at most 40944 tokens"),
    ("--requests", "0", "must be >= 1"),
])
def test_bad_arguments_are_refused_naming_the_flag(capsys, flag, value, message):
    with pytest.raises(SystemExit) as exc:
        soak.main(["bench", "soak", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and flag in err
