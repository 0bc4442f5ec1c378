"""The process-wide settings of a serving process (only entry points set them): the GIL
switch interval and the open-file limit.

CPython makes a thread that wants the GIL wait up to ``sys.getswitchinterval()`` (5 ms by
default) before it forces the running thread to let go. The executor hands every job across
threads (request -> submitter -> completion -> caller, §5); when a hand-off lands while
another thread runs Python, the woken thread can wait most of that interval, which shows in the
TPOT tail. Measured with ``calexec bench overhead --json`` on the 2-core VM, 10 ms decode
profile, four runs each, interleaved: default 5 ms -> TPOT P99 ratio (executor / direct)
1.043-1.051, P50 1.018-1.028; 0.5 ms -> P99 1.033-1.038, P50 1.018-1.019 (docs/benchmarks.md).

``calexec serve`` (``--gil-switch-us``, default :data:`SERVING_SWITCH_INTERVAL_US`), each Ray
Serve replica (``ReplicaSettings.gil_switch_us``) and ``calexec bench overhead`` apply it; the
library (``DeviceExecutor``) never changes interpreter-wide state, so an embedding server
keeps its own choice.

The open-file limit: every connection is a descriptor, held until its client goes or the
server's head timeout (30 s) closes it. Under a soft ``RLIMIT_NOFILE`` of 1024 (many hosts'
default for a new process) a thousand idle connections (a slowloris, clients that open and
wait) leave none for the next client's accept: its ``/health`` is reset. Serving entry points
raise the soft limit toward the hard one (:func:`raise_open_file_limit`, at most
:data:`OPEN_FILES_TARGET`), as vLLM's API server does.
"""

from __future__ import annotations

import sys

try:
    import resource
except ImportError:  # not POSIX: no RLIMIT_NOFILE to raise
    resource = None  # type: ignore[assignment]

#: the interval serving entry points use, in microseconds (Python's default is 5000).
SERVING_SWITCH_INTERVAL_US = 500
#: the longest interval taken, in microseconds (1 s, 200 x Python's default): longer lets a
#: thread running Python keep the GIL for seconds while the executor's hand-offs and the event
#: loop wait, and CPython stores the interval as an unsigned long of microseconds, so a value
#: past it (``1e21``) silently wrapped to 0 (a switch at every check)
MAX_SWITCH_INTERVAL_US = 1_000_000


def set_gil_switch_interval_us(interval_us: int) -> int:
    """Set the GIL switch interval; 0 leaves it unchanged. Returns the interval in force
    before, in microseconds. Raises ``ValueError`` naming the value if it is negative or
    above :data:`MAX_SWITCH_INTERVAL_US`."""
    previous = round(sys.getswitchinterval() * 1e6)
    if not 0 <= interval_us <= MAX_SWITCH_INTERVAL_US:
        raise ValueError(f"gil switch interval={interval_us} us: must be in "
                         f"0..{MAX_SWITCH_INTERVAL_US} us (0 keeps Python's {previous} us)")
    if interval_us:
        sys.setswitchinterval(interval_us / 1e6)
    return previous


#: the soft open-file limit serving entry points ask for (vLLM's ``set_ulimit`` default)
OPEN_FILES_TARGET = 65536


def raise_open_file_limit(target: int = OPEN_FILES_TARGET) -> tuple[int, int] | None:
    """Raise the soft ``RLIMIT_NOFILE`` to ``target`` (or the hard limit, if lower); never
    lowers it. Returns (before, after) when it changed, None when it did not need to or
    could not (no ``resource`` module, or the system refused: the limit in force stays)."""
    if resource is None:
        return None
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
        if soft != resource.RLIM_INFINITY and soft < wanted:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            return soft, wanted
    except (OSError, ValueError):
        return None
    return None
