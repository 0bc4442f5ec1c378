"""One way the benchmarks run a helper program that prints one JSON report (the C floor
program, the out-of-process load generator): bounded by a timeout, and every failure an error
of the caller's kind naming the program and the last line it printed; and the one way the
tools run a build (``make``, the compiler it starts): :func:`run_group`; a command whose output
is calexec's own (``charts cover``'s test command): :func:`call_group`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

from calexec.cliargs import interrupts_held, wait_s

#: how long a group told to end (SIGTERM) has to clean up before it is killed (SIGKILL)
TERM_GRACE_S = 2.0


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # (already gone)
        pass


def _kill_group(proc: subprocess.Popen[Any]) -> None:
    """End ``proc``'s process group: SIGTERM first, so what it runs cleans up (gcc removes its
    temporary ``/tmp/cc*.s``, make the target it was writing; killed outright they were left
    behind at every interrupted build), then, at most :data:`TERM_GRACE_S` later, SIGKILL
    for whatever of the group is still there (a program that ignores SIGTERM)."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    except KeyboardInterrupt:  # (a second Ctrl-C: no more grace)
        _signal_group(proc, signal.SIGKILL)
        raise
    _signal_group(proc, signal.SIGKILL)


def end_leftovers(pid: int, grace: float = TERM_GRACE_S) -> None:
    """End what a command left running in its process group ``pid`` (a session of its own)
    once the command itself exited and was reaped: a server a test started and never stopped,
    a shell's background job. SIGTERM first, so it cleans up (removes its socket or pid file,
    flushes what it writes), then, once the group is empty or at most ``grace`` seconds later,
    SIGKILL for whatever ignores SIGTERM. Nothing left: returns at once. A process that left
    the group (``setsid``, a daemon) is not touched."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):  # (nothing left in the group)
        return
    until = time.monotonic() + grace
    while time.monotonic() < until:
        time.sleep(0.02)
        try:
            os.killpg(pid, 0)
        except (ProcessLookupError, PermissionError):  # (the group is empty)
            return
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_group(argv: Sequence[str], timeout: float | None = None,
              cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as ``subprocess.run(argv, capture_output=True, text=True)`` does, but in a
    process group of its own, killed whole when it times out (``subprocess.TimeoutExpired``,
    raised) or the caller is interrupted (a Ctrl-C, a SIGTERM that ``calexec`` turns into one):
    ``subprocess.run`` kills only the program it started, so ``make``'s compiler ran on after
    calexec had exited 130. A ``timeout`` beyond what the wait takes is
    :func:`calexec.cliargs.wait_s`'s bound."""
    proc: subprocess.Popen[str] | None = None
    try:
        with interrupts_held():  # (a Ctrl-C inside Popen(), its child started but not yet
            # returned to end: the build ran on after calexec had exited 130)
            proc = subprocess.Popen(list(argv), cwd=cwd, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    text=True, errors="replace", start_new_session=True)
        out, err = proc.communicate(timeout=None if timeout is None else wait_s(timeout))
    except BaseException:  # (TimeoutExpired, KeyboardInterrupt: the group ends with the call)
        if proc is None:  # (none started)
            raise
        _kill_group(proc)
        try:
            proc.communicate(timeout=5.0)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):  # (a pipe a grandchild kept,
            # a second interrupt: stop there)
            proc.kill()
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode, out, err)


def call_group(argv: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Run ``argv`` with calexec's stdin, stdout and stderr to its end, as ``subprocess.call``
    does, and return its exit code; but in a process group of its own, killed whole when the
    caller is interrupted (a Ctrl-C, a SIGTERM that ``calexec`` turns into one):
    ``subprocess.call`` kills only the program it started, and what that had started (a
    shell's background job, pytest-xdist's workers) ran on (``charts cover``'s command).
    What the command leaves running in its group when it exits (a server a test never
    stopped) is ended then too (:func:`end_leftovers`: SIGTERM, SIGKILL after at most
    :data:`TERM_GRACE_S`); a process that left the group (``setsid``, a daemon) is not."""
    proc: subprocess.Popen[bytes] | None = None
    try:
        with interrupts_held():  # (as run_group's)
            proc = subprocess.Popen(list(argv), env=env, start_new_session=True)
        code = proc.wait()
    except BaseException:  # (KeyboardInterrupt: the group ends with the call)
        if proc is None:  # (none started)
            raise
        _kill_group(proc)
        proc.wait()
        raise
    # what the command left running in its group (a server a test never stopped) ends with
    # it: until stop 71 it ran on past calexec, and a Python one of ``charts cover``'s wrote
    # its transitions at its exit into the run's directory, removed by then (a traceback)
    end_leftovers(proc.pid)
    return code


def run_json_program(argv: Sequence[str], timeout: float, what: str,
                     error: type[Exception]) -> dict[str, Any]:
    """Run ``argv`` and return the JSON object it printed on stdout; ``error(message)`` when it
    does not finish within ``timeout`` seconds, exits non-zero or prints no JSON object."""
    try:
        done = run_group(argv, timeout)
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
