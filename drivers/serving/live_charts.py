"""The live statecharts page: ``/debug/statecharts`` and ``/debug/statecharts/live.json``.

The page inlines the four declared charts (``machines/diagrams.py``: the SVG names each state's
node group ``s_<State>`` and each edge group ``t_<transition ids>``) and a script that polls
``live.json`` every ``REFRESH_MS`` and, without reloading:

- writes a count badge on every node: live objects in that state (job: the server's requests'
  jobs; KV txn: open transactions; buffer slot: slots of the current pool; lifecycle: 1 on the
  current state) and fills the node turquoise when the count is not zero;
- writes next to every edge the transitions it drew per minute over the last ``WINDOW_S``
  (``CompiledChart.taken``: every chart run of the process, so the executor's internal golden
  jobs count too; monitoring only, see there);
- shows lifecycle, generation, golden pin state, disabled features and the update time.

The screenshots of it in docs/diagrams.md are taken by ``calexec diagrams live``
(drivers/tools/live_screenshots.py).
"""

from __future__ import annotations

import html
import json
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from calexec.drivers.serving.executor_view import ServedExecutor
from calexec.machines.compiled import CHARTS, JOB
from calexec.machines.diagrams import EDGE_ID, NODE_ID, render_path_svg

WINDOW_S = 60.0
REFRESH_MS = 1000
#: samples kept for the rate window: at most one per second is added
_MIN_SAMPLE_GAP_S = 1.0


class TransitionRates:
    """Transitions taken per minute over the last ``window_s``, per chart and transition id,
    from differences of ``CompiledChart.taken`` sampled when asked (at most once a second)."""

    def __init__(self, window_s: float = WINDOW_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._mu = threading.Lock()
        self._samples: deque[tuple[float, dict[str, tuple[int, ...]]]] = deque()
        self._sample(self._clock())

    def _sample(self, now: float) -> dict[str, tuple[int, ...]]:
        snap = {name: tuple(chart.taken) for name, chart in CHARTS.items()}
        if not self._samples or now - self._samples[-1][0] >= _MIN_SAMPLE_GAP_S:
            self._samples.append((now, snap))
        # keep one sample at or before the window's start, so the window is always covered
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        return snap

    def per_minute(self) -> dict[str, list[float]]:
        """chart -> rate per minute of each transition (index = transition id)."""
        with self._mu:
            now = self._clock()
            snap = self._sample(now)
            start, old = self._samples[0]
        span = now - start
        if span <= 0:
            return {name: [0.0] * len(counts) for name, counts in snap.items()}
        scale = 60.0 / span
        return {name: [round((new - before) * scale, 1) for new, before in zip(counts, old[name])]
                for name, counts in snap.items()}


def _kv_counts(executor: ServedExecutor) -> dict[str, int]:
    counts = dict.fromkeys(CHARTS["kv_txn"].states, 0)
    kvc = executor.kvc
    if kvc is not None:
        for view in list(kvc.seqs.values()):
            txn = view.open_txn
            state = getattr(txn, "state", None)
            if state in counts:
                counts[state] += 1
    return counts


def live_state(executor: ServedExecutor, job_counts: Callable[[], dict[str, int]],
               rates: TransitionRates) -> dict[str, Any]:
    """What the page shows, as JSON-able data."""
    snap = executor.snapshot()
    lifecycle = snap["lifecycle"]
    slots = snap.get("slots") or dict.fromkeys(CHARTS["buffer_slot"].states, 0)
    counts = {
        "job": job_counts(),
        "kv_txn": _kv_counts(executor),
        "lifecycle": {s: int(s == lifecycle) for s in CHARTS["lifecycle"].states},
        "buffer_slot": slots,
    }
    per_minute = rates.per_minute()
    return {
        "lifecycle": lifecycle,
        "generation": snap["generation"],
        "golden": snap.get("golden"),
        "allow_unpinned_golden": snap.get("allow_unpinned_golden"),
        "disabled_features": snap.get("disabled_features", []),
        "inflight": snap["inflight"],
        "queued": snap["queued"],
        "window_s": rates.window_s,
        "charts": {name: {"counts": counts[name], "per_minute": per_minute[name]}
                   for name in CHARTS},
    }


_CSS = """
body{font-family:sans-serif;margin:1em} section{margin-bottom:2em}
section svg{max-width:100%;height:auto}
.live-count{font:bold 13px sans-serif;fill:#b00000}
.live-rate{font:bold 12px sans-serif;fill:#0050b0}
#status span{margin-right:1.5em} .legend td{padding:0 .6em}
.swatch{display:inline-block;width:1.2em;height:.9em;border:1px solid #333;vertical-align:middle}
"""

_SCRIPT = """
const NODE_ID = %(node_id)s, EDGE_ID = %(edge_id)s, FILL = "#40e0d0";
function badge(group, cls, x, y, text, anchor) {
  let t = group.querySelector("text." + cls);
  if (!t) {
    t = document.createElementNS("http://www.w3.org/2000/svg", "text");
    t.setAttribute("class", cls);
    t.setAttribute("text-anchor", anchor);
    t.setAttribute("x", x); t.setAttribute("y", y);
    group.appendChild(t);
  }
  t.textContent = text;
}
function paint(chart, info) {
  const svg = document.querySelector('section[data-chart="' + chart + '"] svg');
  if (!svg) return;
  for (const [state, n] of Object.entries(info.counts)) {
    const g = svg.querySelector('g[id="' + NODE_ID + state + '"]');
    if (!g) continue;
    const shapes = g.querySelectorAll("path, polygon, ellipse");
    shapes.forEach((s, i) => {
      if (!s.dataset.fill) {  // the server may have highlighted one state: its base is white
        const f = s.getAttribute("fill") || "none";
        s.dataset.fill = (f === "turquoise") ? "white" : f;
      }
      if (s.dataset.fill !== "none") s.setAttribute("fill", n > 0 ? FILL : s.dataset.fill);
    });
    const box = shapes.length ? shapes[0].getBBox() : g.getBBox();
    badge(g, "live-count", box.x + box.width + 3, box.y + 11, String(n), "start");
    g.dataset.count = String(n);
  }
  svg.querySelectorAll('g.edge[id^="' + EDGE_ID + '"]').forEach((g) => {
    const ids = g.id.slice(EDGE_ID.length).split("_").map(Number);
    const rate = ids.reduce((sum, i) => sum + (info.per_minute[i] || 0), 0);
    const label = g.querySelector("text");
    if (!label) return;
    const x = Number(label.getAttribute("x")), y = Number(label.getAttribute("y"));
    badge(g, "live-rate", x, y - 14, rate.toFixed(1) + "/min", label.getAttribute("text-anchor"));
    g.querySelector("text.live-rate").style.fill = rate > 0 ? "" : "#999";
    g.dataset.rate = String(rate);
  });
}
async function tick() {
  try {
    const r = await fetch("/debug/statecharts/live.json", {cache: "no-store"});
    const d = await r.json();
    for (const [chart, info] of Object.entries(d.charts)) paint(chart, info);
    document.getElementById("lifecycle").textContent = d.lifecycle;
    document.getElementById("generation").textContent = d.generation;
    document.getElementById("golden").textContent =
      d.golden + (d.allow_unpinned_golden ? " (allow_unpinned_golden)" : "");
    document.getElementById("features").textContent =
      d.disabled_features.length ? d.disabled_features.join(", ") : "none";
    document.getElementById("load").textContent = d.inflight + " in flight, " + d.queued + " queued";
    document.getElementById("updated").textContent = new Date().toLocaleTimeString();
    document.body.dataset.updates = String(Number(document.body.dataset.updates || 0) + 1);
  } catch (e) {
    document.getElementById("updated").textContent = "update failed: " + e;
  }
}
tick();
setInterval(tick, %(refresh)d);
"""


def page(svgs: dict[str, str], initial: dict[str, Any] | None = None) -> str:
    """The HTML of the live page around the charts' SVG text (XML declarations stripped);
    ``initial`` (a ``live_state``) fills the status line before the script first runs."""
    now = initial or {}

    def field(key: str) -> str:
        value = now.get(key, "?")
        if key == "disabled_features":
            value = ", ".join(value) if value else "none"
        return html.escape(str(value))

    sections = "".join(
        f"<section data-chart='{html.escape(name)}'><h2>{html.escape(name)}</h2>{svg}</section>"
        for name, svg in svgs.items())
    script = _SCRIPT % {"node_id": json.dumps(NODE_ID), "edge_id": json.dumps(EDGE_ID),
                        "refresh": REFRESH_MS}
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>calexec statecharts</title>"
        f"<style>{_CSS}</style></head><body><h1>calexec statecharts (live)</h1>"
        f"<p id='status'><span>lifecycle: <b id='lifecycle'>{field('lifecycle')}</b></span>"
        f"<span>generation <b id='generation'>{field('generation')}</b></span>"
        f"<span>golden: <b id='golden'>{field('golden')}</b></span>"
        f"<span>disabled features: <b id='features'>{field('disabled_features')}</b></span>"
        "<span><b id='load'></b></span><span>updated <b id='updated'>never</b></span></p>"
        "<table class='legend'><tr><td><span class='swatch' style='background:#40e0d0'></span>"
        "</td><td>state holding at least one live object (lifecycle: the current state)</td></tr>"
        "<tr><td class='live-count' style='color:#b00000;font-weight:bold'>n</td><td>live "
        "objects in the state (jobs of the server's requests, open KV txns, buffer slots)"
        "</td></tr><tr><td style='color:#0050b0;font-weight:bold'>r/min</td><td>transitions "
        f"drawn by the edge, per minute over the last {WINDOW_S:.0f} s (every run in the "
        "process, golden jobs included)</td></tr><tr><td></td><td>each chart's own legend "
        "(below it) explains borders, guards and boxes</td></tr></table>"
        f"{sections}<script>{script}</script></body></html>")


# ---- the path of one job: /debug/jobs/{id} (DeviceExecutor.job_trail) ----------------------
def path_page(record: dict[str, Any]) -> str:
    """HTML of one job's path (a ``DeviceExecutor.job_trail`` record): the job chart with the
    path drawn, and the steps in order."""
    steps = record["trail"]
    svg = render_path_svg(JOB, steps)
    svg = svg[svg.index("?>") + 2:] if svg.startswith("<?xml") else svg
    t0 = steps[0]["t"] if steps else 0.0
    rows = "".join(
        f"<tr><td>{(s['t'] - t0) * 1e3:.3f}</td><td>{html.escape(s['event'])}</td>"
        f"<td>{html.escape(s['from'])}</td><td>{html.escape(s['to'] or 'refused')}</td>"
        f"<td class='refused'>{html.escape(', '.join(s['refused_by'] or []))}</td></tr>"
        for s in steps)
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>calexec job {record['job_id']}</title><style>{_CSS}"
        "table.steps td,table.steps th{padding:0 .7em;text-align:left}"
        ".refused{color:#b00000;font-weight:bold}</style></head><body>"
        f"<h1>job {record['job_id']}: {html.escape(str(record['state']))} "
        f"({html.escape(str(record['status']))})</h1>"
        f"<p>sequence {record['seq_id']}, {html.escape(str(record['kind']))}, generation "
        f"{record['generation']}. Red edges: the transitions it took; red text inside a state: "
        "an event refused there and the guard(s) that refused it, or the guards of the "
        "alternatives an [else] fallback passed over (each guard's spec rule: "
        "calexec/machines/charts.py GUARD_RULES).</p>"
        "<table class='steps'><tr><th>ms</th><th>event</th><th>from</th><th>to</th>"
        f"<th>refused by</th></tr>{rows}</table>"
        f"<section data-chart='job'>{svg}</section></body></html>")
