"""One way the benchmarks run a helper program that prints one JSON report (the C floor
program, the out-of-process load generator): bounded by a timeout, and every failure an error
of the caller's kind naming the program and the last line it printed."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Sequence
from typing import Any


def run_json_program(argv: Sequence[str], timeout: float, what: str,
                     error: type[Exception]) -> dict[str, Any]:
    """Run ``argv`` and return the JSON object it printed on stdout; ``error(message)`` when it
    does not finish within ``timeout`` seconds, exits non-zero or prints no JSON object."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        raise error(f"{what} did not finish in {timeout:.0f} s") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        raise error(f"{what} exited {done.returncode}: " + (lines[-1] if lines else "no output"))
    try:
        report = json.loads(done.stdout)
    except ValueError as exc:
        raise error(f"{what} printed no JSON report: {exc}") from None
    if not isinstance(report, dict):
        raise error(f"{what} printed {type(report).__name__}, not a JSON object")
    return report
