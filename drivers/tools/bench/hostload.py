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
  the hand-offs of every mode more on a VM).

Where ``/proc`` does not exist (not Linux) the report says ``available: false`` and why.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

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
                 cpus: int | None = None) -> None:
        self._stat, self._loadavg, self._cpuidle = stat, loadavg, cpuidle
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
        return {"available": True,
                "steal_pct": round(100.0 * delta["steal"] / total, 2),
                "busy_pct": round(busy_pct, 1),
                "own_busy_pct": round(own_pct, 1),
                "others_busy_pct": round(max(0.0, busy_pct - own_pct), 1),
                "seconds": round(wall, 1), **out}
