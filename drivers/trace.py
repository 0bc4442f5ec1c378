"""Chrome/Perfetto trace of executor job timelines, from each job's own ``JobTimings``.

Input: ``TracedJob`` values (job id, sequence, kind, ``JobTimings``) grouped in named runs.
Output: the trace-event JSON object (``{"traceEvents": [...]}``, times in us) that
``chrome://tracing`` and ui.perfetto.dev open. One process per run; inside it:

* one thread per in-flight lane (``in flight 0``, ``in flight 1``): the job's
  ``submitted -> completed`` span, with the completion thread's ``device wait`` nested at its end
  and ``postprocess`` after it. ``JobTimings`` does not name the engine, so lanes are assigned
  by interval colouring: the executor never has more than ``inflight_capacity`` jobs between
  ``submitted`` and ``completed``, so with capacity 2 the two lanes are the PING/PONG pair and
  their overlap is what Phase B buys;
* one thread per sequence for the host-side spans: ``admission`` (accepted -> admitted),
  ``prepare`` (admitted -> queued), ``queued`` (queued -> submitted).

``h2d`` / ``d2h`` spans are added when the timings carry them (a runtime that reports them).
A job's chart path (``DeviceExecutor.job_trail``: taken transitions and refused events) is
drawn as instant events on its host lane, ``event: from -> to`` or ``event refused by guard``.
Timestamps are made relative to the earliest stamp of all runs. ``validate`` checks the shape
tools rely on (used by the tests and by ``calexec bench pingpong --trace``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from calexec.contracts.files import write_whole
from calexec.contracts.types import JobTimings

HOST_TID_BASE = 100  # host lanes: tid = HOST_TID_BASE + seq_id, after the in-flight lanes


@attrs.frozen
class TracedJob:
    """One delivered (or failed-after-submit) job: identity plus its own timings."""

    job_id: int
    seq_id: int
    kind: str
    timings: JobTimings
    #: the job's chart path, ``job_trail(job_id)["trail"]`` (steps with ``t`` in seconds)
    steps: tuple = ()


def _lanes(jobs: Sequence[TracedJob]) -> dict[int, int]:
    """job_id -> in-flight lane: the lowest lane free at the job's submit (interval colouring)."""
    lane_end: list[int] = []
    out: dict[int, int] = {}
    for job in sorted(jobs, key=lambda j: j.timings.submitted_us):
        t = job.timings
        lane = next((i for i, end in enumerate(lane_end) if end <= t.submitted_us), len(lane_end))
        if lane == len(lane_end):
            lane_end.append(0)
        lane_end[lane] = t.completed_us
        out[job.job_id] = lane
    return out


def _x(name: str, start_us: float, dur_us: float, pid: int, tid: int,
       args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "cat": "calexec", "ph": "X", "ts": round(start_us, 3),
            "dur": round(max(0.0, dur_us), 3), "pid": pid, "tid": tid, "args": args}


def _meta(kind: str, pid: int, tid: int, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}


def trace_events(runs: Mapping[str, Iterable[TracedJob]]) -> dict[str, Any]:
    """The trace-event object of ``runs`` (run label -> jobs). Jobs that never reached
    ``submitted`` and ``completed`` contribute only their host spans."""
    materialised = {label: list(jobs) for label, jobs in runs.items()}
    stamps = [t for jobs in materialised.values() for j in jobs
              for t in (j.timings.accepted_us, j.timings.submitted_us) if t]
    origin = min(stamps) if stamps else 0
    events: list[dict[str, Any]] = []
    for pid, (label, jobs) in enumerate(materialised.items(), start=1):
        events.append(_meta("process_name", pid, 0, label))
        device_jobs = [j for j in jobs if j.timings.submitted_us and j.timings.completed_us]
        lanes = _lanes(device_jobs)
        for lane in sorted(set(lanes.values())):
            events.append(_meta("thread_name", pid, lane, f"in flight {lane}"))
        for seq in sorted({j.seq_id for j in jobs}):
            events.append(_meta("thread_name", pid, HOST_TID_BASE + seq, f"seq {seq} (host)"))
        for job in jobs:
            t = job.timings
            args = {"job": job.job_id, "seq": job.seq_id, "kind": job.kind}
            host = HOST_TID_BASE + job.seq_id
            for name, start, end in (("admission", t.accepted_us, t.admitted_us),
                                     ("prepare", t.admitted_us, t.queued_us),
                                     ("queued", t.queued_us, t.submitted_us)):
                if start and end:
                    events.append(_x(name, start - origin, end - start, pid, host, args))
            for step in job.steps:
                name = (f"{step['event']}: {step['from']} -> {step['to']}" if step["to"] else
                        f"{step['event']} refused by {', '.join(step['refused_by'] or [])}")
                events.append({"name": name, "cat": "calexec.chart", "ph": "i", "s": "t",
                               "ts": round(step["t"] * 1e6 - origin, 3), "pid": pid,
                               "tid": host, "args": args})
            if job.job_id not in lanes:
                continue
            lane = lanes[job.job_id]
            submitted, completed = t.submitted_us - origin, t.completed_us - origin
            events.append(_x(f"{job.kind} job {job.job_id}", submitted, completed - submitted,
                             pid, lane, args))
            if t.h2d_ms:
                events.append(_x("h2d", submitted, t.h2d_ms * 1e3, pid, lane, args))
            wait_us = min(t.device_wait_ms * 1e3, completed - submitted)
            if wait_us > 0:
                events.append(_x("device wait", completed - wait_us, wait_us, pid, lane, args))
            if t.d2h_ms:
                events.append(_x("d2h", completed - t.d2h_ms * 1e3, t.d2h_ms * 1e3, pid, lane,
                                 args))
            if t.postprocess_ms:
                events.append(_x("postprocess", completed, t.postprocess_ms * 1e3, pid, lane,
                                 args))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, runs: Mapping[str, Iterable[TracedJob]]) -> dict[str, Any]:
    """Write the trace of ``runs`` to ``path`` and return the object written. A file (or no
    file yet) at ``path`` is replaced only by a whole trace: the JSON goes into a scratch file
    beside it first, renamed over it once written, so a write cut short (a full disk, a
    Ctrl-C) leaves the previous file as it was, never a truncated trace in its place; a FIFO
    or a device (``/dev/stdout``) is written as it is (``contracts.files.write_whole``)."""
    trace = trace_events(runs)
    write_whole(path, json.dumps(trace).encode("utf-8"))
    return trace


def validate(trace: Any) -> list[str]:
    """Problems with ``trace`` as trace-event JSON (empty list: valid). Checks the object
    form, that every event has name/ph/pid/tid, that complete events have numeric ``ts`` and
    non-negative ``dur``, and that metadata events name their process or thread."""
    if not isinstance(trace, dict) or not isinstance(trace.get("traceEvents"), list):
        return ["trace is not an object with a traceEvents list"]
    problems: list[str] = []
    for i, ev in enumerate(trace["traceEvents"]):
        missing = [k for k in ("name", "ph", "pid", "tid") if k not in ev]
        if missing:
            problems.append(f"event {i}: missing {missing}")
            continue
        if ev["ph"] == "X":
            if not isinstance(ev.get("ts"), (int, float)) or not isinstance(ev.get("dur"), (int, float)):
                problems.append(f"event {i} ({ev['name']}): X event without numeric ts/dur")
            elif ev["dur"] < 0:
                problems.append(f"event {i} ({ev['name']}): negative dur {ev['dur']}")
        elif ev["ph"] == "i":
            if not isinstance(ev.get("ts"), (int, float)):
                problems.append(f"event {i} ({ev['name']}): instant event without numeric ts")
        elif ev["ph"] == "M":
            if not isinstance(ev.get("args", {}).get("name"), str):
                problems.append(f"event {i}: metadata event without args.name")
        else:
            problems.append(f"event {i}: unexpected ph {ev['ph']!r}")
    return problems
