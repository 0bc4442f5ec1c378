"""What the host did beside a benchmark (issue 28): a ratio measured on a 2-core VM is only
worth its number on a quiet host, and a VM cannot see its neighbours except through the CPU
time the hypervisor took from it (``steal``) and the CPU that other processes used.

``HostMeter`` reads the aggregate ``cpu`` line of ``/proc/stat`` and this process's CPU time
when the benchmark starts and when it ends, and reports over that span:

* ``steal_pct``: the share of the host's CPU time the hypervisor gave to someone else
  (``/proc/stat``'s steal column over every column): 0 on a quiet VM;
* ``busy_pct``: the share spent running (not idle, waiting for I/O or stolen), every
  process's, this one's included;
* ``others_busy_pct``: ``busy_pct`` minus this process's CPU share: other processes' work
  (a test suite, another benchmark) competing for the same cores;
* ``loadavg_start`` / ``loadavg_end``: the 1-minute load average at both ends;
* ``cpuidle_driver``: how an idle core sleeps (``none``: a plain halt, whose wake-up costs
  the hand-offs of every mode more on a VM);
* ``quiet``: whether the span was a quiet host's (at most ``QUIET_STEAL_PCT`` of the CPU
  stolen and, unless the benchmark's own helper processes run beside it, at most
  ``QUIET_OTHERS_PCT`` used by other processes), and ``noise``: why not (None when quiet).
  The benches say it on stderr at their end: a ratio from a noisy span is no gate figure.

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


class HostMeter:
    """``start()`` at the benchmark's start, ``report()`` at its end (see the module doc)."""

    def __init__(self, stat: str | os.PathLike[str] = "/proc/stat",
                 loadavg: str | os.PathLike[str] = "/proc/loadavg",
                 cpuidle: str | os.PathLike[str]
                 = "/sys/devices/system/cpu/cpuidle/current_driver",
                 cpus: int | None = None, others_expected: bool = False) -> None:
        """``others_expected``: the benchmark runs processes of its own (``bench server``'s
        load generator), so other processes' CPU does not make the span noisy."""
        self._stat, self._loadavg, self._cpuidle = stat, loadavg, cpuidle
        self._others_expected = others_expected
        self._cpus = cpus or os.cpu_count() or 1
        self._ticks0: dict[str, int] | None = None
        self._load0: float | None = None
        self._wall0 = self._cpu0 = 0.0

    def start(self) -> HostMeter:
        self._ticks0 = read_cpu_ticks(self._stat)
        self._load0 = read_loadavg(self._loadavg)
        self._wall0, self._cpu0 = time.monotonic(), time.process_time()
        return self

    def report(self) -> dict[str, Any]:
        wall = time.monotonic() - self._wall0
        own_cpu = time.process_time() - self._cpu0
        ticks1 = read_cpu_ticks(self._stat)
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
        own_pct = 100.0 * own_cpu / (wall * self._cpus) if wall > 0 else 0.0
        steal = round(100.0 * delta["steal"] / total, 2)
        others = round(max(0.0, busy_pct - own_pct), 1)
        noise = [f"steal {steal:g} % > {QUIET_STEAL_PCT:g} %"] if steal > QUIET_STEAL_PCT else []
        if not self._others_expected and others > QUIET_OTHERS_PCT:
            noise.append(f"other processes {others:g} % > {QUIET_OTHERS_PCT:g} %")
        return {"available": True,
                "steal_pct": steal,
                "busy_pct": round(busy_pct, 1),
                "own_busy_pct": round(own_pct, 1),
                "others_busy_pct": others,
                "quiet": not noise, "noise": "; ".join(noise) or None,
                "seconds": round(wall, 1), **out}


def noise_line(report: dict[str, Any]) -> str | None:
    """The line a benchmark prints on stderr at its end when ``report`` (``HostMeter.report``)
    was not a quiet host's span, else None."""
    if not report.get("available", False):
        return f"host load unknown ({report.get('reason')}): the ratios may not be a gate figure"
    if report.get("quiet", True):
        return None
    return (f"not a quiet host ({report.get('noise')}, over {report.get('seconds')} s): "
            "the ratios are not a gate figure (docs/benchmarks.md)")
