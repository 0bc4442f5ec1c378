"""CPU time per thread role of this process, for ``calexec bench server``'s
``cpu_ms_per_request_by_thread`` (issue 28: "profile the server's share"): which of the
process's threads the server's extra CPU per request lands on, from the kernel's own account
(``/proc/self/task/TID/schedstat``: each thread's time on a CPU, in ns; ``stat``'s user and
system ticks where there is no schedstat), not a sampling profiler.

A thread's role is its Python name (``threading.Thread.name``) with a trailing number cut
(``AnyIO worker thread``, ``calexec-submitter``, ``bench-load``), or, for a thread Python
did not start, its kernel name (``comm``) whole: the emulator names its engines
``calrt-emu-e0`` and ``calrt-emu-e1``, one per chiplet. A thread Python did not start that
never named itself keeps the kernel name of the thread that created it, the process's own
(``python``): numpy's OpenBLAS workers, an OpenMP pool. Its role is :data:`UNNAMED_NATIVE`,
not that name, which read as the interpreter's own CPU (the main thread is ``MainThread``).
A span's figures are each role's CPU
between two snapshots; a thread that started inside the span counts from zero; a thread
that ended inside it is lost to the account and counted in ``threads_ended``; one that
started and ended inside it is not seen at all, unless it reported its own CPU before it
ended (the bench's load workers do: ``reported``).

Linux only (``/proc``); elsewhere ``snapshot`` answers None and the bench reports no
per-thread figures.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping

import attrs

#: a trailing thread number: "Thread-7", "bench-direct-3", "worker 12", "calrt-emu-e1"
_NUMBER = re.compile(r"[-_ ]?\d+$")
#: threading's default names, "Thread-7 (worker)": the target's name is the role
_DEFAULT_NAME = re.compile(r"^Thread-\d+ \((?P<target>.+)\)$")
_TASKS = "/proc/self/task"
#: the role of a thread Python did not start that kept the name it inherited (a Python
#: thread's kernel name): numpy's OpenBLAS workers, an OpenMP pool, any library's unnamed
#: thread; which library started it, the kernel does not say
UNNAMED_NATIVE = "native (unnamed)"


def role_of(name: str) -> str:
    """A thread's role from its name (``role_of("calexec-submitter") == "calexec-submitter"``,
    ``role_of("Thread-7 (worker)") == "worker"``, ``role_of("bench-direct-3") ==
    "bench-direct"``); an empty name is ``"?"``."""
    default = _DEFAULT_NAME.match(name)
    if default is not None:
        name = default.group("target")
    return _NUMBER.sub("", name.strip()) or "?"


@attrs.frozen
class ThreadCpu:
    """One thread at a snapshot: its role and its CPU time so far (s, user + system)."""

    role: str
    cpu_s: float


def snapshot(tasks: str = _TASKS) -> dict[int, ThreadCpu] | None:
    """Every live thread of this process by kernel thread id, with its role and CPU so far;
    None where ``tasks`` (``/proc/self/task``) is not there (not Linux). A thread that ends
    while it is read is left out."""
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    named = {t.native_id: role_of(t.name) for t in threading.enumerate()
             if t.native_id is not None}
    # the kernel names Python's threads have: the name a thread they created inherits
    inherited = {comm for comm in (_comm(tasks, str(tid)) for tid in named) if comm}
    tick = float(os.sysconf("SC_CLK_TCK"))
    out: dict[int, ThreadCpu] = {}
    for entry in tids:
        try:
            tid = int(entry)
            with open(f"{tasks}/{entry}/stat", encoding="ascii", errors="replace") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue  # ended meanwhile
        role = named.get(tid)
        if role is None:  # not a Python thread: its kernel name, whole, if it chose one
            comm = _comm(tasks, entry)
            if comm is None:
                continue  # ended meanwhile
            role = UNNAMED_NATIVE if comm in inherited else (comm or "?")
        cpu = _schedstat_s(tasks, entry)
        if cpu is None:  # no schedstat: stat's utime + stime, in clock ticks (10 ms)
            # fields after the command name, which is in parentheses and may hold any
            # byte: state is the 3rd field of stat, utime and stime the 14th and 15th
            fields = stat.rsplit(")", 1)[-1].split()
            try:
                cpu = (int(fields[11]) + int(fields[12])) / tick
            except (IndexError, ValueError):
                continue
        out[tid] = ThreadCpu(role, cpu)
    return out


def _comm(tasks: str, entry: str) -> str | None:
    """A thread's kernel name (``comm``), None when it ended meanwhile."""
    try:
        with open(f"{tasks}/{entry}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _schedstat_s(tasks: str, entry: str) -> float | None:
    """A thread's time on a CPU (s) from ``schedstat``'s first field, in ns (the kernel's
    scheduler account; stat's utime and stime count 10 ms ticks, too coarse for a block of a
    few hundred requests); None when the kernel has no schedstat."""
    try:
        with open(f"{tasks}/{entry}/schedstat", encoding="ascii") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return None


@attrs.frozen
class SpanCpu:
    """CPU per role over a span (s) and how many threads ended inside it (their CPU since the
    span began is not in ``by_role``)."""

    by_role: dict[str, float]
    threads_ended: int


def span(before: Mapping[int, ThreadCpu], after: Mapping[int, ThreadCpu],
         reported: Mapping[str, float] | None = None) -> SpanCpu:
    """Each role's CPU between ``before`` and ``after`` (``snapshot``s): a thread in both
    counts its growth, one only in ``after`` all of its CPU (it started inside the span), one
    only in ``before`` is counted as ended. ``reported``: CPU per role the span's own
    short-lived threads reported themselves before they ended (added)."""
    by_role: dict[str, float] = {}
    for tid, now in after.items():
        was = before.get(tid)
        grown = now.cpu_s - (was.cpu_s if was is not None and was.role == now.role else 0.0)
        if grown > 0:
            by_role[now.role] = by_role.get(now.role, 0.0) + grown
    for role, cpu_s in (reported or {}).items():
        if cpu_s > 0:
            by_role[role] = by_role.get(role, 0.0) + cpu_s
    return SpanCpu(by_role, sum(1 for tid in before if tid not in after))


def per_request_ms(spans: list[SpanCpu], served: int) -> dict[str, float]:
    """Pooled spans' CPU per role as ms per served request, the largest first (``served`` >
    0)."""
    total: dict[str, float] = {}
    for one in spans:
        for role, cpu_s in one.by_role.items():
            total[role] = total.get(role, 0.0) + cpu_s
    return {role: round(1000.0 * cpu_s / served, 3)
            for role, cpu_s in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))}


def difference(side: Mapping[str, float], base: Mapping[str, float]) -> dict[str, float]:
    """``side`` minus ``base`` per role (a role missing on one side is 0 there), the largest
    difference first: where one side's extra CPU per request goes."""
    roles = set(side) | set(base)
    diff = {role: round(side.get(role, 0.0) - base.get(role, 0.0), 3) for role in roles}
    return dict(sorted(diff.items(), key=lambda kv: (-kv[1], kv[0])))
