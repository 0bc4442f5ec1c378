"""The Ray that ``calexec serve --ray`` starts: where its services listen and how it ends.

``calexec serve --ray`` joins the cluster named by ``$RAY_ADDRESS`` or starts a local one in its
own process tree: GCS, raylet, the dashboard and runtime-env agents, the Serve controller, proxy
and replicas (:func:`init_address`: never the last ``ray start`` cluster of the machine). This
module holds what the CLI (calexec/serve.py) needs around ``ray.init``; it never
imports Ray at module level (callers import Ray after :func:`local_environment` has set what
Ray reads at import).

**Where a local Ray listens.** Ray binds its gRPC servers (GCS, raylet, every worker's core
worker), its agents and its metrics ports to loopback only when the node's IP is loopback, and
to every interface otherwise. On Linux ``ray.init(_node_ip_address="127.0.0.1")`` is rewritten
to the host's routable address (``resolve_ip_for_localhost``); the node IP is loopback only in
Ray's single-machine mode, the one it uses on macOS and Windows, selected by
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (read when ``ray`` is imported). So for a loopback
``--host`` and a local cluster, :func:`local_environment` sets that variable (unless the user
set it), and :func:`check_node_ip` refuses a node IP that is not loopback after ``ray.init``
(Ray imported earlier in the process, or a Ray that changed the rule), naming the address.
A Serve replica's inter-deployment gRPC server (``[::]:0`` in Ray Serve 2.60, whatever the
node IP) is moved by :func:`bind_serve_grpc_to_node_ip`, called in the replica's constructor.
A wildcard or routable ``--host`` leaves Ray's defaults: every interface, as a multi-node
cluster needs.

**How it ends.** ``ray.init`` replaces the SIGTERM handler of its caller (its own Python handler
calls ``sys.exit``; its core worker's C++ failure handler logs ``*** SIGTERM received`` and
aborts: exit 134), so :class:`StopSignals` installs the CLI's handlers after ``ray.init`` and
restores the previous ones on exit. ``ray.shutdown`` returns before the agents the raylet
started have ended: they notice their parent is gone by polling (seconds), and when the raylet
did not stop gracefully they first try to report it to the (dead) GCS, about a minute with
their ports held. :func:`reap` waits, bounded, for every process of the local cluster (the
caller's descendants, listed before each shutdown step) and ends the ones still running, so the
command exits with nothing of its Ray left behind.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import signal
import threading
from collections.abc import Iterable, Mapping
from typing import Any

log = logging.getLogger("calexec.fleet.local_ray")

#: Ray's switch between its single-machine mode (0: node IP is loopback) and cluster mode.
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"

#: how long :func:`reap` waits for the processes to end by themselves, then after SIGTERM
REAP_WAIT_S = 15.0
REAP_TERM_S = 5.0


class RayBindError(RuntimeError):
    """A local Ray would listen beyond the loopback ``--host`` it was asked for."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def joins_cluster(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``ray.init`` will join an existing cluster (``$RAY_ADDRESS``) instead of
    starting a local one."""
    env = os.environ if environ is None else environ
    return bool(env.get("RAY_ADDRESS", "").strip())


def init_address(environ: dict[str, str] | None = None) -> str:
    """The ``address`` for ``ray.init``: ``$RAY_ADDRESS`` when set, else ``"local"`` (always a
    new local cluster; with ``None`` Ray would join the last ``ray start`` cluster of the
    machine named in its ``ray_current_cluster`` file, and wait for ever on a stale one)."""
    env = os.environ if environ is None else environ
    return env.get("RAY_ADDRESS", "").strip() or "local"


def join_error(address: str, err: BaseException) -> str:
    """One line for a ``ray.init`` that could not join the cluster at ``address``: Ray uses a
    cluster's token only when told to (an explicit address never enables it by itself)."""
    return (f"cannot join the Ray cluster at RAY_ADDRESS={address!r}: {err}; a cluster with "
            f"token authentication needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN, "
            f"RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token; `ray get-auth-token` on the head prints "
            f"it), and a head started with {SINGLE_MACHINE_ENV}=0 needs it here too")


def local_environment(host: str, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What to set in the environment before ``import ray`` so that a local Ray serving on
    ``host`` listens where ``host`` does: Ray's single-machine mode for a loopback host.
    Empty when joining a cluster, for a non-loopback host, or when the user set the variable."""
    env = os.environ if environ is None else environ
    if joins_cluster(env) or not is_loopback(host) or SINGLE_MACHINE_ENV in env:
        return {}
    return {SINGLE_MACHINE_ENV: "0"}


def check_node_ip(host: str, node_ip: str) -> None:
    """Raise :class:`RayBindError` when ``host`` is loopback but the local Ray's node IP is not
    (its services would listen on every interface)."""
    if is_loopback(host) and not is_loopback(node_ip):
        raise RayBindError(
            f"--host={host} is loopback but the local Ray started with node IP {node_ip}, so "
            f"its services would listen on every interface (Ray was imported before "
            f"{SINGLE_MACHINE_ENV}=0 could be set, or that variable is set to another value)")


def grpc_bind_address(address: str, node_ip: str) -> str:
    """``address`` with a wildcard host (``[::]``, ``0.0.0.0``) replaced by ``node_ip`` when the
    node IP is loopback; any other address as given."""
    host, sep, port = address.rpartition(":")
    if not sep or host not in ("[::]", "0.0.0.0") or not is_loopback(node_ip):
        return address
    bare = node_ip.strip("[]")
    return f"[{bare}]:{port}" if ":" in bare else f"{bare}:{port}"


def bind_serve_grpc_to_node_ip() -> bool:
    """In a Serve replica process: make the replica's inter-deployment gRPC server, which Ray
    Serve 2.60 binds to ``[::]:0`` after the user constructor, bind to the node IP when that is
    loopback (as every other Ray server of the node does). True when the bind was redirected
    (idempotent); False on a routable node IP or when this Serve has no such hook."""
    import ray
    from ray.serve._private import replica as serve_replica

    node_ip = ray.util.get_node_ip_address()
    if not is_loopback(node_ip):
        return False
    original = getattr(serve_replica, "add_port_to_grpc_server", None)
    if original is None:
        log.warning("Ray Serve has no add_port_to_grpc_server: the replica's gRPC server "
                    "keeps Serve's own address")
        return False
    if getattr(original, "calexec_node_ip", None) == node_ip:
        return True

    def add_port_to_grpc_server(server: Any, address: str) -> int:
        return original(server, grpc_bind_address(address, node_ip))

    # a marker on the function object (a function takes any attribute; mypy knows none)
    add_port_to_grpc_server.calexec_node_ip = node_ip  # type: ignore[attr-defined]
    serve_replica.add_port_to_grpc_server = add_port_to_grpc_server
    return True


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

    def __enter__(self) -> StopSignals:
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
        except Exception as err:  # noqa: BLE001 - the next step and the reaping still run
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
    except Exception:  # noqa: BLE001 - gone or unreadable meanwhile
        return str(proc.pid)
