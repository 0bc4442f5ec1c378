"""Timing artefacts of the overlap experiment: a Chrome/Perfetto trace and a PNG diagram.

Input is the experiment's span list: ``{"phase", "engine", "job", "stage", "start_us",
"end_us"}`` with times relative to the phase start (host-side timestamps around infer/Wait
and GetStatus polling). Trace: one process per phase (serial, parallel), one thread per
engine (PING, PONG), one complete ("X") event per stage of each job.
"""

from __future__ import annotations

import json
from typing import Any

PHASES = ("serial", "parallel")
ENGINES = ("PING", "PONG")
STAGE_COLOURS = {"queued": "#d9d9d9", "H2D": "#4e79a7", "compute": "#f28e2b", "D2H": "#59a14f",
                 "running": "#b07aa1"}


def trace_events(spans: list[dict]) -> dict[str, Any]:
    """The trace-event JSON object (``{"traceEvents": [...]}``) of the spans."""
    events: list[dict[str, Any]] = []
    for pid, phase in enumerate(PHASES, start=1):
        events.append({"name": "process_name", "ph": "M", "ts": 0, "pid": pid, "tid": 0,
                       "args": {"name": f"{phase} ({'PING only' if phase == 'serial' else 'PING/PONG'})"}})
        for tid, engine in enumerate(ENGINES):
            events.append({"name": "thread_name", "ph": "M", "ts": 0, "pid": pid, "tid": tid,
                           "args": {"name": engine}})
    for s in spans:
        events.append({"name": s["stage"], "cat": "calrt", "ph": "X", "ts": round(s["start_us"], 3),
                       "dur": round(max(0.0, s["end_us"] - s["start_us"]), 3),
                       "pid": PHASES.index(s["phase"]) + 1, "tid": s["engine"], "args": {"job": s["job"]}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: str, spans: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace_events(spans), f)


def write_png(path: str, spans: list[dict], title: str) -> None:
    """Render the stage timeline of both phases (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(len(PHASES), 1, figsize=(11, 4.5), sharex=True)
    for ax, phase in zip(axes, PHASES):
        for s in (s for s in spans if s["phase"] == phase):
            ax.broken_barh([(s["start_us"] / 1e3, (s["end_us"] - s["start_us"]) / 1e3)],
                           (s["engine"] - 0.35, 0.7), facecolors=STAGE_COLOURS.get(s["stage"], "#999999"),
                           edgecolor="white", linewidth=0.3)
        ax.set_yticks(range(len(ENGINES)), ENGINES)
        ax.set_ylim(-0.6, len(ENGINES) - 0.4)
        ax.set_title(phase, fontsize=9, loc="left")
    axes[-1].set_xlabel("ms since the phase started (host-side timestamps)")
    used = sorted({s["stage"] for s in spans}, key=list(STAGE_COLOURS).index)
    fig.legend(handles=[Patch(color=STAGE_COLOURS[k], label=k) for k in used], loc="upper right", ncol=len(used))
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)
