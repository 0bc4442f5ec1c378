"""The measured floor of ``calexec bench overhead`` (issue 28): drivers/calrt/floor.c.

A C program on the emulator with the same two device threads the executor has (invariant 2:
only the submitter thread calls infer, only the completion thread calls Wait): completion
thread Wait -> argmax over the logits row -> hand-off (mutex + condition variable) ->
submitter writes the next input token -> infer. Its per-token time minus the device's decode
latency is the least any executor with these thread roles can cost per token on this machine;
``bench overhead`` reports it beside each mode's (``floor_us_p50``, ``floor_us_p99``).

:func:`build_floor` builds it with the emulator's Makefile (``make floor``, warnings as errors)
into a directory of the caller's; when it cannot (no source or Makefile installed, no make or
C compiler, a failed build) it returns the reason instead, and the benchmark reports that.
:class:`FloorLoop` runs one block per call, as the benchmark's other sides do.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from typing import Any

from calexec.drivers.tools.bench.subproc import run_group, run_json_program

#: drivers/calrt/ of this installation (the emulator's sources and Makefile)
CALRT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "calrt")
_BUILD_TIMEOUT_S = 600.0


class FloorError(RuntimeError):
    """The floor program failed on a block (its stderr line says why)."""


def build_floor(out_dir: str, calrt_dir: str = CALRT_DIR) -> tuple[str | None, str | None]:
    """Build the floor program into ``out_dir``: ``(path, None)``, or ``(None, reason)`` when
    it cannot be built here."""
    for name in ("floor.c", "Makefile"):
        if not os.path.isfile(os.path.join(calrt_dir, name)):
            return None, f"{os.path.join(calrt_dir, name)} is not installed with this package"
    make = shutil.which("make")
    if make is None:
        return None, "no make on PATH (the floor is built with drivers/calrt/Makefile)"
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        return None, f"no C compiler {compiler!r} on PATH (set CC)"
    try:
        done = run_group([make, "-s", "-C", calrt_dir, "floor", f"O={out_dir}"],
                         _BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"make floor did not finish in {_BUILD_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return None, f"make floor could not run: {exc}"
    program = os.path.join(out_dir, "floor")
    if done.returncode != 0 or not os.access(program, os.X_OK):
        lines = (done.stderr or done.stdout).strip().splitlines()
        return None, f"make floor failed (exit {done.returncode}): " + (
            lines[-1] if lines else "no output")
    return program, None


class FloorLoop:
    """One block of the floor program per :meth:`decode_block`: prefill ``prompt``, a few
    warm-up decode tokens (not timed), then ``n`` timed decode tokens, at the latency of
    :meth:`set_decode_latency`, on the calbin of the benchmark's other sides. ``roles`` 3
    adds the executor's caller thread between the completion thread and the submitter
    (``--roles 3``)."""

    def __init__(self, program: str, calbin_path: str, warmup: int = 8, roles: int = 2) -> None:
        if roles not in (2, 3):
            raise ValueError(f"roles={roles!r}: the floor program runs 2 or 3 threads")
        self.roles = roles
        self.program = program
        self.calbin_path = calbin_path
        self.warmup = warmup
        self.decode_us = 0
        self.last: dict[str, Any] = {}
        self.dma_violations = 0  #: the emulator's DMA guard counters over every block

    def set_decode_latency(self, decode_us: int) -> None:
        self.decode_us = decode_us

    def run(self, prompt: Sequence[int], n: int) -> dict[str, Any]:
        """The program's report for one block (FloorError when it fails)."""
        argv = [self.program, "--calbin", self.calbin_path, "--decode-us", str(self.decode_us),
                "--tokens", str(n), "--warmup", str(self.warmup),
                "--prompt", ",".join(str(int(t)) for t in prompt), "--roles", str(self.roles)]
        jobs = 1 + self.warmup + n
        timeout = 60.0 + jobs * (self.decode_us / 1e6 + 0.05)
        report = run_json_program(argv, timeout, "the floor program", FloorError)
        if len(report.get("token_us", ())) != n or len(report.get("token_ids", ())) != jobs:
            raise FloorError(f"the floor program reported {len(report.get('token_us', ()))} "
                             f"token times and {len(report.get('token_ids', ()))} tokens for "
                             f"{n} timed tokens and {jobs} jobs")
        self.last = report
        self.dma_violations += int(report.get("dma_violations", 0))
        return report

    def decode_block(self, prompt: Sequence[int], n: int) -> tuple[list[int], list[float]]:
        """As the benchmark's other loops: (the prefill's token then the first ``n`` decode
        tokens, the ``n`` timed tokens' times in us). The timed tokens come after the warm-up,
        so the tokens returned are the greedy continuation of the prompt, comparable with the
        other sides', and the times are those of the block's last ``n`` tokens."""
        report = self.run(prompt, n)
        return [int(t) for t in report["token_ids"][:n + 1]], [float(t) for t in report["token_us"]]
