"""What the host did beside a benchmark (issue 28): a ratio measured on a 2-core VM is only
worth its number on a quiet host, and a VM cannot see its neighbours except through the CPU
time the hypervisor took from it (``steal``) and the CPU that other processes used.

``HostMeter`` reads the aggregate ``cpu`` line of ``/proc/stat`` and the CPU time of the
benchmark's own process tree when the benchmark starts and when it ends, and reports over that
span:

* ``steal_pct``: the share of the host's CPU time the hypervisor gave to someone else
  (``/proc/stat``'s steal column over every column): 0 on a quiet VM;
* ``busy_pct``: the share spent running (not idle, waiting for I/O or stolen), every
  process's, the benchmark's included;
* ``own_busy_pct``: the benchmark's own share: this process, every process it started that
  is still running (``/proc/<pid>/stat`` of each descendant: ``bench server``'s load generator
  and API process, ``bench overhead``'s C floor program and the ``make`` that builds it) and
  every one that ended and was waited for inside the span (their ``cutime``/``cstime``);
  ``own_cpu_s`` that share in CPU seconds, ``own_processes`` how many processes the tree
  held at the end, ``own_scope`` how it was counted;
* ``others_busy_pct``: ``busy_pct`` minus ``own_busy_pct``: other work on the host (a test
  suite, another benchmark, another helper) competing for the same cores;
* ``loadavg_start`` / ``loadavg_end``: the 1-minute load average at both ends;
* ``cpuidle_driver``: how an idle core sleeps (``none``: a plain halt, whose wake-up costs
  the hand-offs of every mode more on a VM);
* ``quiet``: whether the span was a quiet host's (at most ``QUIET_STEAL_PCT`` of the CPU
  stolen and at most ``QUIET_OTHERS_PCT`` used by other processes: the benchmark's own helper
  processes are its own share, never the others'), and ``noise``: why not (None when quiet).
  The benches say it on stderr at their end: a ratio from a noisy span is no gate figure.
  (Until stop 63 only this process's CPU was its own, so ``bench server`` could not tell its
  load generator from other work and ignored other processes altogether: a span with other
  processes at 75.8 % of the CPU was reported quiet.)

Where ``/proc`` does not exist (not Linux) the report says ``available: false`` and why.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

#: a quiet host's span: the most of the CPU the hypervisor may take, in percent (a quiet VM
#: shows 0-1 %; at 5-20 % the direct loop itself moved 2x between runs, docs/benchmarks.md)
QUIET_STEAL_PCT = 2.0
#: ... and the most other processes may use, in percent, where the benchmark runs alone
QUIET_OTHERS_PCT = 5.0

#: /proc/stat's cpu columns, in order (proc(5)); guest time is already inside user and nice
#: the unit of /proc's tick counts (USER_HZ)
_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_COLUMNS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def read_cpu_ticks(path: str | os.PathLike[str] = "/proc/stat") -> dict[str, int] | None:
    """The aggregate ``cpu`` line's columns (ticks since boot), None when unreadable."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                fields = line.split()
                if fields and fields[0] == "cpu":
                    values = [int(v) for v in fields[1:1 + len(_COLUMNS)]]
                    values += [0] * (len(_COLUMNS) - len(values))  # old kernels: no steal
                    return dict(zip(_COLUMNS, values, strict=True))
    except (OSError, ValueError):
        return None
    return None


def read_loadavg(path: str | os.PathLike[str] = "/proc/loadavg") -> float | None:
    """The 1-minute load average, None when unreadable."""
    try:
        return float(Path(path).read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        return None


def read_cpuidle_driver(path: str | os.PathLike[str]
                        = "/sys/devices/system/cpu/cpuidle/current_driver") -> str | None:
    try:
        return Path(path).read_text(encoding="ascii").strip() or None
    except OSError:
        return None


def _pid_stat(proc: str | os.PathLike[str], pid: str) -> tuple[int, int] | None:
    """(parent pid, CPU ticks: user + system + waited-for children's) of ``proc/pid/stat``,
    None when it is gone or unreadable."""
    try:
        text = Path(proc, pid, "stat").read_text(encoding="utf-8", errors="replace")
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses; fields after the
        # last ")" are state, ppid, ... utime (14th field), stime, cutime, cstime (17th)
        rest = text[text.rindex(")") + 1:].split()
        return int(rest[1]), sum(int(v) for v in rest[11:15])
    except (OSError, ValueError, IndexError):
        return None


def read_tree_ticks(pid: int | None = None, proc: str | os.PathLike[str] = "/proc"
                    ) -> tuple[int, int] | None:
    """(CPU ticks, processes) of process ``pid`` (default: this one) and every live
    descendant of it: each one's user and system time and its waited-for children's
    (``cutime``/``cstime``: a helper that ended and was reaped is still counted). None when
    ``proc/pid/stat`` is not readable (not Linux)."""
    root = str(pid if pid is not None else os.getpid())
    try:
        names = [e.name for e in os.scandir(proc) if e.name.isdigit()]
    except OSError:
        return None
    children: dict[int, list[str]] = {}
    ticks: dict[str, int] = {}
    for name in names:
        got = _pid_stat(proc, name)
        if got is not None:  # (a process that ended between the listing and the read: none)
            children.setdefault(got[0], []).append(name)
            ticks[name] = got[1]
    if root not in ticks:
        return None
    total, count, todo, seen = 0, 0, [root], {root}
    while todo:  # (bounded: each pid once)
        name = todo.pop()
        total += ticks[name]
        count += 1
        for child in children.get(int(name), ()):
            if child not in seen:
                seen.add(child)
                todo.append(child)
    return total, count


class HostMeter:
    """``start()`` at the benchmark's start, ``report()`` at its end (see the module doc)."""

    def __init__(self, stat: str | os.PathLike[str] = "/proc/stat",
                 loadavg: str | os.PathLike[str] = "/proc/loadavg",
                 cpuidle: str | os.PathLike[str]
                 = "/sys/devices/system/cpu/cpuidle/current_driver",
                 cpus: int | None = None, proc: str | os.PathLike[str] = "/proc",
                 pid: int | None = None) -> None:
        """``proc``/``pid``: where the process tree counted as the benchmark's own is read
        and its root (default: ``/proc`` and this process)."""
        self._stat, self._loadavg, self._cpuidle = stat, loadavg, cpuidle
        self._proc, self._pid = proc, pid
        self._cpus = cpus or os.cpu_count() or 1
        self._ticks0: dict[str, int] | None = None
        self._tree0: tuple[int, int] | None = None
        self._load0: float | None = None
        self._wall0 = self._cpu0 = 0.0

    def start(self) -> HostMeter:
        self._ticks0 = read_cpu_ticks(self._stat)
        self._tree0 = read_tree_ticks(self._pid, self._proc)
        self._load0 = read_loadavg(self._loadavg)
        self._wall0, self._cpu0 = time.monotonic(), _times_s()
        return self

    def report(self) -> dict[str, Any]:
        wall = time.monotonic() - self._wall0
        times_cpu = _times_s() - self._cpu0
        ticks1 = read_cpu_ticks(self._stat)
        tree1 = read_tree_ticks(self._pid, self._proc)
        out: dict[str, Any] = {"loadavg_start": self._load0,
                               "loadavg_end": read_loadavg(self._loadavg),
                               "cpuidle_driver": read_cpuidle_driver(self._cpuidle),
                               "cpus": self._cpus}
        if self._ticks0 is None or ticks1 is None:
            return {"available": False, "reason": f"{self._stat} not readable (not Linux?)",
                    **out}
        delta = {k: ticks1[k] - self._ticks0[k] for k in _COLUMNS}
        total = sum(delta.values())
        if total <= 0:
            return {"available": False, "reason": "no CPU time passed between the samples",
                    **out}
        busy = total - delta["idle"] - delta["iowait"] - delta["steal"]
        busy_pct = 100.0 * busy / total
        if self._tree0 is not None and tree1 is not None:
            own_ticks = max(0, tree1[0] - self._tree0[0])
            own_pct = 100.0 * own_ticks / total
            own_cpu_s = own_ticks / _CLK_TCK
            scope = ("process tree: this process, its live descendants and the children "
                     f"they waited for ({self._proc}/<pid>/stat)")
            processes: int | None = tree1[1]
        else:  # (no per-process /proc: this process and the children it waited for)
            own_pct = 100.0 * times_cpu / (wall * self._cpus) if wall > 0 else 0.0
            own_cpu_s = times_cpu
            scope = "this process and the children it waited for (os.times)"
            processes = None
        steal = round(100.0 * delta["steal"] / total, 2)
        others = round(max(0.0, busy_pct - own_pct), 1)
        noise = [f"steal {steal:g} % > {QUIET_STEAL_PCT:g} %"] if steal > QUIET_STEAL_PCT else []
        if others > QUIET_OTHERS_PCT:
            noise.append(f"other processes {others:g} % > {QUIET_OTHERS_PCT:g} %")
        return {"available": True,
                "steal_pct": steal,
                "busy_pct": round(busy_pct, 1),
                "own_busy_pct": round(own_pct, 1),
                "others_busy_pct": others,
                "own_cpu_s": round(own_cpu_s, 3), "own_processes": processes,
                "own_scope": scope,
                "quiet": not noise, "noise": "; ".join(noise) or None,
                "seconds": round(wall, 1), **out}


def _times_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def noise_line(report: dict[str, Any]) -> str | None:
    """The line a benchmark prints on stderr at its end when ``report`` (``HostMeter.report``)
    was not a quiet host's span, else None."""
    if not report.get("available", False):
        return f"host load unknown ({report.get('reason')}): the ratios may not be a gate figure"
    if report.get("quiet", True):
        return None
    return (f"not a quiet host ({report.get('noise')}, over {report.get('seconds')} s): "
            "the ratios are not a gate figure (docs/benchmarks.md)")


#: the cores of the host the project's gates are judged on (a 2-core VM, as CI's)
GATE_CPUS = 2
#: the rule a gate figure follows (docs/benchmarks.md)
GATE_RULE = ("a gate is met only when two consecutive runs meet it, each on a quiet "
             f"{GATE_CPUS}-core host (the CPU model named); this report is one run's")


def gate_scope(report: dict[str, Any], cpus: int | None) -> tuple[dict[str, Any], str | None]:
    """What a run's gate verdicts (``gate_met``) are worth: ``(scope, line)``. ``scope`` says
    they are one run's, whether its host was quiet (``report``: ``HostMeter.report``) and had
    ``GATE_CPUS`` cores, and ``counts_toward_gate`` (both); ``line`` is the stderr line that
    says why they cannot count, None when they can (still one run of the two)."""
    quiet = report.get("quiet") if report.get("available", False) else None
    counts = bool(quiet) and cpus == GATE_CPUS
    scope = {"runs": 1, "host_quiet": quiet, "cpus": cpus, "gate_cpus": GATE_CPUS,
             "counts_toward_gate": counts, "rule": GATE_RULE}
    why = []
    if quiet is not True:
        why.append("the host was not quiet" if quiet is False else "the host load is unknown")
    if cpus != GATE_CPUS:
        why.append(f"it ran on {cpus} cores, not the gate host's {GATE_CPUS}")
    line = None if not why else (
        f"gate_met is one run's verdict and does not count toward a gate: {'; '.join(why)}")
    return scope, line
