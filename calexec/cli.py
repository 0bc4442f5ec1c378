"""The ``calexec`` console script.

Each subcommand lives in its own module with ``main(argv: list[str]) -> int``; this file
only dispatches, so adding a subcommand never touches another's code.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module, one-line help). Two-word commands ("sim bench") are looked up first.
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("calexec.drivers.demo", "prefill and decode a few sequences through the executor on the bundled emulator"),
    "sim bench": ("calexec.drivers.simbench", "measure the emulator's host-side cost and profile accuracy"),
    "sim write-calbin": ("calexec.drivers.simbench", "write the default synthetic calbin"),
    "diagrams": ("calexec.machines.diagrams", "render the declared statecharts to diagrams/ (--check: fail if stale)"),
    "bench charts": ("calexec.machines.bench", "per-job chart work on the hot path"),
    "bench overhead": ("calexec.drivers.bench", "executor vs direct synchronous loop (TPOT ratios, control overhead)"),
    "bench logits": ("calexec.drivers.bench", "direct BF16->FP32 slice conversion vs the legacy path"),
    "conform": ("calexec.drivers.conform.runner", "answer the spec's §14 vendor questions for a calrt.h library (--report DIR)"),
    "bench recovery": ("calexec.drivers.bench", "time from an injected device fault to Ready again, requests failed per recovery"),
    "accept": ("calexec.drivers.accept", "the §13 acceptance gates (--quick|--full, --phase a|b|both, --report DIR, --json)"),
    "bench pingpong": ("calexec.drivers.bench", "Phase B: tokens/s at in-flight 2 vs 1 per emulator overlap setting, TPOT P99, trace"),
    "bench server": ("calexec.drivers.bench_server", "the server's own overhead: HTTP vs in-process executor at concurrency 1 and 8"),
    "charts mutate": ("calexec.drivers.charts_mutate", "mutation testing of declared charts: each guard forced true/false, transition dropped, target changed (--chart module:Class, --test-cmd, --json, --report DIR)"),
    "serve": ("calexec.drivers.serve", "run the reference HTTP server (OpenAI-style completions, metrics, drain)"),
}


def _usage() -> str:
    lines = ["usage: calexec <command> [options]", "", "commands:"]
    for name, (_, help_text) in COMMANDS.items():
        lines.append(f"  {name:<18} {help_text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    for width in (2, 1):
        name = " ".join(argv[:width])
        if len(argv) >= width and name in COMMANDS:
            module = importlib.import_module(COMMANDS[name][0])
            # The module sees the full command words, so one module can serve several.
            return int(module.main(argv) or 0)
    print(f"calexec: unknown command {' '.join(argv[:2])!r}\n\n{_usage()}", file=sys.stderr)
    return 2


if __name__ == "__main__":  # pragma: no cover - `python -m calexec.cli`
    sys.exit(main())
