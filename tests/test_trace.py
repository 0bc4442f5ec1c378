"""Trace export of job timelines (Chrome/Perfetto trace-event JSON) and the shape of
`calexec bench pingpong --json` on tiny sizes (values finite; no thresholds)."""

from __future__ import annotations

import json
import math

from calexec.contracts.types import JobTimings
from calexec.drivers.tools.bench import core as bench
from calexec.drivers.trace import HOST_TID_BASE, TracedJob, trace_events, validate, write_trace


def _job(job_id: int, seq: int, submitted: int, completed: int) -> TracedJob:
    return TracedJob(job_id, seq, "decode", JobTimings(
        accepted_us=submitted - 30, admitted_us=submitted - 20, queued_us=submitted - 10,
        submitted_us=submitted, completed_us=completed, device_wait_ms=0.5,
        postprocess_ms=0.01))


def test_overlapping_jobs_land_on_two_lanes_and_validate(tmp_path):
    jobs = [_job(1, 1, 1_000, 2_000), _job(2, 2, 1_500, 2_500), _job(3, 1, 2_100, 3_000)]
    trace = write_trace(str(tmp_path / "t.json"), {"capacity 2": jobs})
    assert validate(json.loads((tmp_path / "t.json").read_text())) == []
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["name"].startswith("decode")]
    lane = {e["args"]["job"]: e["tid"] for e in spans}
    assert lane[1] != lane[2]  # in flight together: PING and PONG lanes
    assert lane[3] == lane[1]  # starts after job 1 completed: its lane is free again
    first = next(e for e in spans if e["args"]["job"] == 1)
    assert first["ts"] == 30 and first["dur"] == 1000  # relative to the earliest stamp
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"admission", "prepare", "queued", "device wait", "postprocess"} <= names


def test_a_job_that_never_reached_the_device_has_host_spans_only():
    never = TracedJob(9, 3, "prefill", JobTimings(accepted_us=10, admitted_us=20))
    events = trace_events({"run": [never]})["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X"] == ["admission"]


def test_validate_names_the_problem():
    assert validate([]) == ["trace is not an object with a traceEvents list"]
    bad = {"traceEvents": [{"name": "x", "ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": -1},
                           {"name": "y", "ph": "X", "pid": 1}]}
    problems = validate(bad)
    assert "negative dur" in problems[0] and "missing ['tid']" in problems[1]


def test_pingpong_bound_of_each_overlap_setting():
    assert bench.pingpong_bound("none", 2000, 10000, 2000) == 1.0
    assert bench.pingpong_bound("dma", 2000, 10000, 2000) == 1.4
    assert bench.pingpong_bound("full", 2000, 10000, 2000) == 2.0


def test_bench_pingpong_json_shape_and_trace(tmp_path, capsys):
    path = tmp_path / "trace.json"
    rc = bench.main(["bench", "pingpong", "--json", "--seqs", "2", "--tokens", "2",
                     "--solo-tokens", "2", "--trace", str(path)])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["overlap"]) == {"none", "dma", "full"}
    for setting, r in out["overlap"].items():
        for key in ("aggregate_speedup", "tpot_p99_ratio", "bound_speedup"):
            assert math.isfinite(r[key]) and r[key] > 0, (setting, key)
        assert isinstance(r["meets_phase_b_rule"], bool)
        assert r["capacity_2"]["dma_violations"] == 0
        assert out["enable_by_default"][setting] == r["meets_phase_b_rule"]
    trace = json.loads(path.read_text())
    assert validate(trace) == []
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert complete and all(k in e for e in complete for k in ("ts", "dur", "pid", "tid"))


def test_a_jobs_chart_path_becomes_instant_events_on_its_host_lane(tmp_path):
    from executor_harness import deadline, prefill, running_job_path, write_calbin
    with running_job_path(write_calbin(tmp_path)) as ex:
        handle = ex.enqueue(prefill(1, [1, 2, 3]))
        result = handle.wait_until(deadline())
        steps = tuple(ex.job_trail(handle.job_id)["trail"])
    trace = trace_events({"run": [TracedJob(result.job_id, 1, "prefill", result.timings,
                                            steps)]})
    assert validate(trace) == []
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert [e["name"] for e in instants][:2] == ["admit: Created -> Admitted",
                                                 "begin_preparation: Admitted -> Preparing"]
    assert instants[-1]["name"] == "deliver: Completing -> Succeeded"
    assert all(e["tid"] == HOST_TID_BASE + 1 for e in instants)
    # the chart steps fall inside the job's own host/device timeline
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert min(e["ts"] for e in spans) <= instants[0]["ts"] <= instants[-1]["ts"]
