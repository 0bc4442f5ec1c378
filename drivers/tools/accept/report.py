"""Report files of ``calexec accept``: report.json, report.md (the same content as a table and
one section per gate) and PNG plots with matplotlib's Agg backend: the per-job latency
distribution of each series and RSS over the soak."""

from __future__ import annotations

import json
import os
from typing import Any

LATENCY_PNG = "latency.png"
RSS_PNG = "rss.png"
#: the files ``write_report`` may write (the plots when their series were measured)
REPORT_FILES = ("report.json", "report.md", LATENCY_PNG, RSS_PNG)


def write_report(report: dict[str, Any], directory: str) -> list[str]:
    """Write report.json, report.md and the plots into ``directory`` (created if missing);
    return the paths written."""
    os.makedirs(directory, exist_ok=True)
    plots = _plots(report, directory)
    report = {**report, "plots": [os.path.basename(p) for p in plots]}
    json_path = os.path.join(directory, "report.json")
    with open(json_path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=1)
    md_path = os.path.join(directory, "report.md")
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(markdown(report))
    return [json_path, md_path, *plots]


def _fmt(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def markdown(report: dict[str, Any]) -> str:
    """The report as Markdown: verdict, gate table, each gate's details, plots, environment."""
    lines = [f"# calexec accept ({report['mode']})", "",
             f"**{'PASSED' if report['passed'] else 'FAILED'}** - phases "
             f"{', '.join(report['phases'])}; started {report['started']}, "
             f"{report['seconds']} s.", "",
             "| gate | passed | metric | value | seconds |", "|---|---|---|---|---|"]
    for name, g in report["gates"].items():
        lines.append(f"| {name} | {'yes' if g['passed'] else '**NO**'} | {g['metric']} | "
                     f"{_fmt(g['value'])} | {g['seconds']} |")
    for name, g in report["gates"].items():
        lines += ["", f"## {name}", ""]
        lines += [f"- `{key}`: {_fmt(value)}" for key, value in g["details"].items()]
    if report.get("plots"):
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in report["plots"]]
    lines += ["", "## Sizes", ""] + [f"- `{k}`: {_fmt(v)}" for k, v in report["sizes"].items()]
    lines += ["", "## Environment", ""] + [f"- `{k}`: {v}"
                                          for k, v in report["environment"].items()]
    return "\n".join(lines) + "\n"


def _plots(report: dict[str, Any], directory: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written: list[str] = []
    latency = {k: v for k, v in report["series"]["latency_ms"].items() if v}
    if latency:
        fig, ax = plt.subplots(figsize=(9, 4.5))
        seen = report["series"].get("latency_jobs", {})
        for label, values in sorted(latency.items()):
            total = seen.get(label, len(values))
            sample = f"n={len(values)}" if total == len(values) else \
                f"uniform sample of {len(values)} of {total} jobs"
            ax.hist(values, bins=60, histtype="step", label=f"{label} ({sample})", log=True)
        written.append(_save(fig, ax, "job latency, accepted -> completed (ms)", "jobs",
                             "per-job latency distribution", os.path.join(directory, LATENCY_PNG)))
    rss = {k: v for k, v in report["series"]["rss_mib"].items() if v}
    if rss:
        fig, ax = plt.subplots(figsize=(9, 4))
        for phase, points in sorted(rss.items()):
            ax.plot([p[0] for p in points], [p[1] for p in points], label=f"soak phase {phase}")
        written.append(_save(fig, ax, "seconds since the soak started", "RSS (MiB)",
                             "resident set size over the soak", os.path.join(directory, RSS_PNG)))
    return written


def _save(fig: Any, ax: Any, xlabel: str, ylabel: str, title: str, path: str) -> str:
    """Label ``ax``, write ``fig`` to ``path`` (PNG, 100 dpi) and close it; returns ``path``."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
