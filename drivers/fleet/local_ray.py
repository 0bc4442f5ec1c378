"""The Ray that ``calexec serve --ray`` starts: how it ends.

``calexec serve --ray`` joins the cluster named by ``$RAY_ADDRESS`` or starts a local one in its
own process tree (GCS, raylet, the dashboard and runtime-env agents, the Serve controller,
proxy and replicas). This module holds what the CLI (drivers/serving/serve.py) needs around
``ray.init``; it never imports Ray at module level.

**How it ends.** ``ray.init`` replaces the SIGTERM handler of its caller (its own Python handler
calls ``sys.exit``; its core worker's C++ failure handler logs ``*** SIGTERM received`` and
aborts: exit 134), so :class:`StopSignals` installs the CLI's handlers after ``ray.init`` and
restores the previous ones on exit. ``ray.shutdown`` stops the processes it started itself but
not the agents the raylet started: they notice their parent is gone by polling, and when the
raylet did not stop gracefully they first try to report it to the (dead) GCS, about a minute
with their ports held. :func:`reap` waits, bounded, for every process of the local cluster
(the caller's descendants, listed before the shutdown) and ends the ones still running, so
the command exits with nothing of its Ray left behind.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any, Iterable

log = logging.getLogger("calexec.fleet.local_ray")

#: how long :func:`reap` waits for the processes to end by themselves, then after SIGTERM
REAP_WAIT_S = 15.0
REAP_TERM_S = 5.0


def joins_cluster(environ: dict[str, str] | None = None) -> bool:
    """Whether ``ray.init`` will join an existing cluster (``$RAY_ADDRESS``) instead of
    starting a local one."""
    env = os.environ if environ is None else environ
    return bool(env.get("RAY_ADDRESS", "").strip())


class StopSignals:
    """SIGTERM and SIGINT set :attr:`stop` while the context is open (install it after
    ``ray.init``, which replaces its caller's SIGTERM handler); the handlers in place before are
    restored on exit. A second signal during the shutdown only sets the event again, so it
    cannot cut the drain short. :attr:`received` names the first signal."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: str | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, _frame: Any) -> None:
        if self.received is None:
            self.received = signal.Signals(signum).name
        self.stop.set()

    def __enter__(self) -> "StopSignals":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def shutdown(local: bool) -> list[str]:
    """Shut Serve down (every replica drains within its graceful shutdown timeout), then Ray;
    for a ``local`` cluster (started by this process) wait for every process of it to end
    (:func:`reap`). Each step runs even when the one before raised; the first error is
    raised at the end. Returns what :func:`reap` had to signal."""
    import ray
    from ray import serve

    cluster: list[Any] = []
    errors: list[BaseException] = []
    for step in (serve.shutdown, ray.shutdown):
        if local:  # listed before each step: a replica restarted meanwhile is included
            cluster += descendants()
        try:
            step()
        except Exception as err:  # the next step and the reaping still run
            log.warning("%s failed: %r", step.__qualname__, err)
            errors.append(err)
    forced = reap(cluster) if local else []
    if errors:
        raise errors[0]
    return forced


def descendants() -> list[Any]:
    """The processes below this one (``psutil.Process``; Ray ships psutil, import Ray first)."""
    import psutil

    try:
        return psutil.Process().children(recursive=True)
    except psutil.Error:
        return []


def reap(processes: Iterable[Any], wait_s: float = REAP_WAIT_S,
         term_s: float = REAP_TERM_S) -> list[str]:
    """Wait up to ``wait_s`` for ``processes`` (``psutil.Process``) to end, SIGTERM the ones
    still running and wait ``term_s``, then SIGKILL the rest. Returns a description of each
    process that had to be signalled (empty when all ended by themselves)."""
    import psutil

    procs = {p.pid: p for p in processes}.values()
    _, alive = psutil.wait_procs(list(procs), timeout=wait_s)
    forced = []
    for proc in alive:
        forced.append(_describe(proc))
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=term_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=term_s)
    return forced


def _describe(proc: Any) -> str:
    try:
        return f"{proc.pid} {' '.join(proc.cmdline())[:80] or proc.name()}"
    except Exception:  # gone or unreadable meanwhile
        return str(proc.pid)
