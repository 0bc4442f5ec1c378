"""The GIL switch interval of a serving process (process-wide: only entry points set it).

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
"""

from __future__ import annotations

import sys

#: the interval serving entry points use, in microseconds (Python's default is 5000).
SERVING_SWITCH_INTERVAL_US = 500


def set_gil_switch_interval_us(interval_us: int) -> int:
    """Set the GIL switch interval; 0 leaves it unchanged. Returns the interval in force
    before, in microseconds. Raises ``ValueError`` naming the value if it is negative."""
    previous = round(sys.getswitchinterval() * 1e6)
    if interval_us < 0:
        raise ValueError(f"gil switch interval={interval_us} us: must be >= 0 (0 keeps "
                         f"Python's {previous} us)")
    if interval_us:
        sys.setswitchinterval(interval_us / 1e6)
    return previous
