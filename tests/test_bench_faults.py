"""``calexec bench faults`` run tiny, in-process: the report's shape and its correctness facts
(issue 16: 0 client-visible errors for retryable faults within the resume budget, every
completed request's tokens equal to the fault-free run's, every retryable kind injected).
Never a timing figure: benchmarks report numbers, tests don't.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("httpx", reason="the fault bench drives the server over HTTP ([server])")
from calexec.drivers.tools.bench import fault_cost as bench_faults  # noqa: E402

KEYS = {"faults_requested", "faults_fired", "faults_by_kind", "faults_not_fired", "clients",
        "streaming_clients", "seed", "requests", "completed", "client_errors", "errors",
        "tokens_identical_pct", "tokens_mismatched", "mismatch_examples",
        "reference_errors", "error_examples", "reference_error_examples", "completed_sampled",
        "tokens_identical_pct_sampled", "resumes", "resumes_by_cause",
        "resumes_per_fault", "faults_with_a_resume", "added_latency_per_fault_ms",
        "resume_budget_exhausted", "recoveries", "native_relay", "relay_submitted",
        "inflight_capacity", "downgrades", "inflight_capacity_end",
        "sequences_at_end", "seconds_with_faults", "cpu_model", "cpus"}


def test_fault_bench_json_report_every_kind_no_client_error_identical_tokens(capsys):
    kinds = len(bench_faults.KINDS)
    assert bench_faults.main(["bench", "faults", "--json", "--faults", str(kinds),
                              "--clients", "4", "--seed", "3"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.count("\n") == 1, f"--json must print exactly one line, got {out!r}"
    report = json.loads(out)
    # progress on stderr for both parts: the faults, and the fault-free replay of every
    # completed request (minutes with many clients; it said nothing, found at stop 57)
    assert f"bench faults: {kinds}/{kinds} faults" in captured.err, captured.err
    assert f"bench faults: {report['completed']}/{report['completed']} reference requests" \
        in captured.err, captured.err
    assert set(report) == KEYS
    assert report["faults_fired"] + sum(report["faults_not_fired"].values()) == kinds
    assert set(report["faults_by_kind"]) | set(report["faults_not_fired"]) \
        == set(bench_faults.KINDS)
    assert report["faults_fired"] >= 1 and report["completed"] >= 1
    assert report["streaming_clients"] == 2
    # the correctness facts: nothing a client sees, tokens as without faults
    assert report["client_errors"] == 0, report["error_examples"]
    assert report["reference_errors"] == {}, report["reference_error_examples"]
    assert report["tokens_mismatched"] == 0, report["mismatch_examples"]
    assert report["tokens_identical_pct"] == 100.0
    assert report["completed_sampled"] >= 1 and report["tokens_identical_pct_sampled"] == 100.0
    assert report["resume_budget_exhausted"] == 0
    assert report["resumes"] >= 1 and report["recoveries"] >= 1
    assert set(report["resumes_by_cause"]) <= {"device", "internal", "transient", "unknown",
                                               "lifecycle", "unavailable",
                                               "generation_replaced"}
    latency = report["added_latency_per_fault_ms"]
    assert set(latency) == {"p50", "p99", "max"}
    seqs = report["sequences_at_end"]
    assert seqs["free"] == seqs["capacity"] and seqs["withheld"] == 0
    assert isinstance(report["cpu_model"], str) and report["cpu_model"]
    # without --native-relay the submitter never waits in the relay
    assert report["native_relay"] is False and report["relay_submitted"] == 0


def test_fault_bench_on_the_native_relay_reports_it_and_keeps_every_fact(capsys):
    """``--native-relay`` (as ``bench soak --native-relay``): the same faults under the same
    load with the executor's submitter on its native relay; no client error, tokens as
    without faults, and the report says the relay ran (``native_relay``, ``relay_submitted``,
    the fields soak reports). The flag did not exist: a usage error, exit 2."""
    assert bench_faults.main(["bench", "faults", "--json", "--faults", "3", "--clients", "4",
                              "--seed", "5", "--native-relay"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) == KEYS
    assert report["native_relay"] is True and report["relay_submitted"] >= 1, report
    assert report["faults_fired"] >= 1 and report["completed"] >= 1
    assert report["client_errors"] == 0, report["error_examples"]
    assert report["tokens_mismatched"] == 0, report["mismatch_examples"]
    assert report["reference_errors"] == {}, report["reference_error_examples"]
    seqs = report["sequences_at_end"]
    assert seqs["free"] == seqs["capacity"] and seqs["withheld"] == 0


def test_fault_bench_in_phase_b_keeps_two_in_flight_and_every_fact(capsys):
    """``--inflight-capacity 2`` (stop 57): the faults under load with two jobs on the device
    for the whole run (never downgraded), no client error, tokens as without faults."""
    assert bench_faults.main(["bench", "faults", "--json", "--faults", "3", "--clients", "4",
                              "--seed", "5", "--inflight-capacity", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inflight_capacity"] == 2 and report["inflight_capacity_end"] == 2
    assert report["downgrades"] == 0 and report["client_errors"] == 0, report
    assert report["tokens_identical_pct"] == 100.0, report


@pytest.mark.parametrize("flag", ["--native-relay=yes", "--native-relay=0"])
def test_fault_bench_native_relay_takes_no_value(capsys, flag):
    with pytest.raises(SystemExit) as exc:
        bench_faults.main(["bench", "faults", flag])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--native-relay" in err and "ignored explicit argument" in err, err
    assert err.count("\n") <= 2, err


def test_fault_bench_refuses_a_bad_count_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        bench_faults.main(["bench", "faults", "--faults", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--faults" in err and "must be >= 1" in err
