"""The ``calexec`` commands: name -> the module whose ``main(argv) -> int`` runs it.

Data only, imported by the console script (``calexec.cli``, which dispatches on it) and by
``calexec.cliargs`` (which names the command in a one-line error); the modules are named as
strings and imported only when their command runs, so this module imports nothing of calexec.
"""

from __future__ import annotations

from typing import NamedTuple


class Command(NamedTuple):
    module: str  #: module with ``main(argv) -> int``
    help: str  #: one line for ``calexec --help``
    extra: str | None = None  #: optional extra the module imports (server, plots, ray)


# Two-word commands ("sim bench") are looked up before one-word ones.
COMMANDS: dict[str, Command] = {
    "demo": Command(
        "calexec.drivers.tools.demo",
        "prefill and decode a few sequences through the executor, checked against the oracle"),
    "serve": Command(
        "calexec.serve",
        "run the reference HTTP server (OpenAI-style completions, metrics, drain)",
        "server"),
    "accept": Command(
        "calexec.drivers.tools.accept.run",
        "the §13 acceptance gates (--quick|--full, --phase a|b|both, --report DIR)"),
    "conform": Command(
        "calexec.drivers.tools.conform.runner",
        "answer the spec's §14 vendor questions for a calrt.h library (--report DIR)"),
    "diagrams": Command(
        "calexec.drivers.tools.render_diagrams",
        "render the declared statecharts to diagrams/ (--check: fail if stale)"),
    "sim bench": Command(
        "calexec.drivers.tools.bench.sim",
        "measure the emulator's host-side cost and profile accuracy"),
    "sim write-calbin": Command(
        "calexec.drivers.tools.bench.sim",
        "write the default synthetic calbin"),
    "bench charts": Command(
        "calexec.drivers.tools.bench.chart_cost",
        "per-job chart work on the hot path"),
    "bench overhead": Command(
        "calexec.drivers.tools.bench.core",
        "executor vs direct synchronous loop (TPOT ratios, control overhead)"),
    "bench logits": Command(
        "calexec.drivers.tools.bench.core",
        "direct BF16->FP32 slice conversion vs the legacy path"),
    "bench recovery": Command(
        "calexec.drivers.tools.bench.core",
        "time from an injected device fault to Ready again, requests failed per recovery"),
    "bench pingpong": Command(
        "calexec.drivers.tools.bench.core",
        "Phase B: tokens/s at in-flight 2 vs 1 per overlap setting, TPOT P99, trace"),
    "bench server": Command(
        "calexec.drivers.tools.bench.server_overhead",
        "the server's own overhead: HTTP vs in-process executor",
        "server"),
    "bench faults": Command(
        "calexec.drivers.tools.bench.fault_cost",
        "device faults under load: client errors, tokens vs a fault-free run, resumes and added "
        "latency per fault",
        "server"),
    "bench soak": Command(
        "calexec.drivers.tools.bench.soak",
        "long fault soak of the server: N requests (streaming, slow readers, disconnects), F "
        "faults of every kind, 0 and 2 ms decode; wrong tokens, errors, RSS, pools, threads",
        "server"),
    "diagrams live": Command(
        "calexec.drivers.tools.live_screenshots",
        "screenshot the live /debug/statecharts page under load and one job's path (headless "
        "Chromium)",
        "server"),
    "golden record": Command(
        "calexec.drivers.tools.golden",
        "run a calbin's warm-up on the emulator and pin its golden next to the manifest"),
    "charts names": Command(
        "calexec.drivers.tools.write_chart_names",
        "write machines/chart_names.py, one constant per declared state and event (--check: fail "
        "if stale)"),
    "charts draw": Command(
        "calexec.drivers.tools.charts_cli",
        "draw any chart class: charts draw MODULE:CLASS [--out DIR] [--check] [--png]"),
    "charts paths": Command(
        "calexec.drivers.tools.charts_cli",
        "shortest path to every state and transition, and a transition tour, of MODULE:CLASS "
        "(--json: as data)"),
    "charts cover": Command(
        "calexec.drivers.tools.charts_cover",
        "transition coverage of --chart MODULE:CLASS over a test command (-- COMMAND...), "
        "gated by --min PCT"),
    "charts mutate": Command(
        "calexec.drivers.tools.charts_mutate",
        "mutation testing of declared charts (calexec's or --chart module:Class with --test-cmd):"
        " guards forced, transitions dropped, targets changed"),
}


def lookup(argv: list[str]) -> str | None:
    """The command ``argv`` starts with (two-word commands first), or None."""
    for width in (2, 1):
        name = " ".join(argv[:width])
        if len(argv) >= width and name in COMMANDS:
            return name
    return None
