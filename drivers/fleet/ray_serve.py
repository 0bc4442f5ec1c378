"""Ray Serve as router and supervisor: one replica per device (issue 9).

Each replica of :func:`build_app`'s ``calexec`` deployment is one Ray actor process that owns
exactly one device (§5 invariant 1): it opens its own device (with the bundled emulator, its own
emulator instance), writes the synthetic calbin into a replica-local temporary directory unless
a calbin path is given, starts a ``DeviceExecutor`` (Configuring -> Warming -> golden -> Ready)
and serves the reference server's app (``create_app``): the same OpenAI-style completions,
streaming, errors, /ready, /health and /metrics. The application's HTTP entry is
:class:`CalexecIngress` (deployment ``ingress``, no device; drivers/fleet/ingress.py), which
forwards every request to a replica through a streaming handle call to ``relay_http`` and
continues a completion or chat on a sibling when its replica dies, drains or fails mid-stream
(issue 16; ``build_app(ingress=False)``: the replicas are the HTTP entry, without that). Ray
Serve routes the requests across the replicas and supervises them:

- ``check_health`` reads the lifecycle chart. Ready, Draining, Recovering, Configuring and
  Warming are healthy (the executor recovers itself); Failed raises :class:`ReplicaFailed`, so
  the Serve controller stops the replica and starts a new one: the supervisor restart of §9.1.
  The replacement opens a fresh device and generation and passes its golden in its constructor
  before Serve routes traffic to it.
- Routing follows the lifecycle, not only the health check: every replica reports whether it
  serves (``record_routing_stats``, pulled by the controller every
  ``routing_stats_period_s``), and :class:`LifecycleRouter` (Serve's request-router API) ranks
  replicas that do not serve (Failed, Recovering, Warming, draining...) after those that do.
  A Failed replica therefore stops taking new requests within about one stats period plus the
  controller's 0.1 s loop, instead of answering 503 until its third failed health check.
- What a replica's device cannot serve is served by a sibling. Through the ingress: a
  completion or chat answered 503 before its first byte, or whose replica dies, drains or
  fails after tokens went out, is continued on a sibling from where the client is (prompt +
  tokens re-prefilled, same seed, id and stream); ``LifecycleRouter`` ranks the replicas that
  failed the request (``request["avoid"]``) last. A drained replica hands its ingress streams
  off at a token boundary while a sibling serves. Without the ingress, the replica's fleet
  edge (:class:`~calexec.drivers.fleet.edge.ReplicaEdge`) relays a completion once, before
  any byte reached the client, when it arrives while the replica does not serve or is
  answered 503 here (or 500 after the failure took the device down), through a streaming
  handle call to this deployment's ``relay_http``, which :class:`LifecycleRouter` never
  routes back to the relaying replica while another exists. ``request["replica"]`` pins a
  ``relay_http`` call to one replica (an operator's or a test's admin call).
- Scale-down, redeploy and ``serve.shutdown`` stop a replica gracefully: Serve stops routing to
  it and waits for its ongoing requests, then the destructor drains the service (admission
  refused, admitted requests finished) and shuts the executor down within
  ``ReplicaSettings.grace_s`` (an ingress stream still running then is handed to a sibling
  at its next token boundary). The deployment's ``graceful_shutdown_timeout_s`` is set above
  that grace so Ray does not kill the process mid-drain. ``calexec serve --ray`` stops the
  fleet at its ingress first (:func:`drain_fleet`: new requests 503 + Retry-After, admitted
  ones finish), since Serve's shutdown stops the HTTP proxies at once.
- Per-replica metrics: each replica exports Ray Serve gauges (:data:`RAY_GAUGES`) tagged with
  ``device``; Ray adds ``replica``, ``deployment`` and ``application``, and its metrics agent
  serves them to Prometheus per node. The replica's own /metrics (the reference server's) is
  reachable through the router too, one replica per request; every response carries
  ``x-calexec-replica`` and ``x-calexec-device`` headers naming who served it.

On a local Ray whose node IP is loopback (``calexec serve --ray --host 127.0.0.1``,
drivers/fleet/local_ray.py) each replica also binds Serve's inter-deployment gRPC server to
loopback (:func:`~calexec.drivers.fleet.local_ray.bind_serve_grpc_to_node_ip`).

Ray is an optional extra (``pip install calexec[ray]``); this module imports it at import time.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import socket
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import attrs
from ray import serve
from ray.serve import metrics as serve_metrics
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from calexec.drivers.calrt.runtime import Fault, FaultMode, emulator_of
from calexec.drivers.device_spec import DeviceSpec, with_emulated_latency, within_request_timeout
from calexec.drivers.fleet import local_ray
from calexec.drivers.fleet import registry as replica_registry
from calexec.drivers.fleet.edge import ReplicaEdge, serve_relayed
from calexec.drivers.fleet.ingress import CAUSES, FailoverSettings, FleetIngress
from calexec.drivers.serving.executor_view import served
from calexec.drivers.serving.handoff import PROGRESS_TYPE
from calexec.drivers.serving.process import (
    MAX_SWITCH_INTERVAL_US,
    SERVING_SWITCH_INTERVAL_US,
    set_gil_switch_interval_us,
)
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

log = logging.getLogger("calexec.ray_serve")

#: lifecycle states in which a replica is healthy: it serves, or recovers by itself.
HEALTHY_STATES = frozenset({"Ready", "Draining", "Recovering", "Configuring", "Warming"})

#: Ray Serve gauges exported by every replica (tag ``device``; Ray adds ``replica``):
#: name -> (description, executor snapshot / server key).
RAY_GAUGES: dict[str, tuple[str, str]] = {
    "calexec_replica_ready": ("1 while the replica's lifecycle is Ready and not draining.",
                              "ready"),
    "calexec_replica_generation": ("Model generation id of the replica's device.", "generation"),
    "calexec_replica_jobs_inflight": ("Jobs submitted to the replica's device.", "inflight"),
    "calexec_replica_requests_running": ("Completion requests being served.", "active"),
    "calexec_replica_jobs_succeeded": ("Jobs completed successfully (cumulative).",
                                       "succeeded"),
    "calexec_replica_jobs_failed": ("Jobs failed (cumulative).", "failed"),
    "calexec_replica_requests_relayed": ("Completions this replica could not serve and relayed "
                                         "to a sibling (cumulative).", "relayed"),
}

#: the handle method a replica relays completions through (see drivers/fleet/edge.py).
RELAY_METHOD = "relay_http"

#: the deployment names of :func:`build_app`: the HTTP entry and the device replicas
INGRESS_DEPLOYMENT = "ingress"
REPLICA_DEPLOYMENT = "calexec"


class ReplicaFailed(RuntimeError):
    """``check_health``'s verdict: the device lifecycle is not one the replica recovers from."""



def _finite(instance: Any, attribute: Any, value: float) -> None:
    """attrs validator: a finite number (``executor.shutdown`` refuses an infinite grace)."""
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name}={value!r}: must be a finite number of seconds")


@attrs.frozen
class ReplicaSettings:
    """Settings of every replica of the deployment (one device each)."""

    #: device config string passed to ``open_device`` (e.g. ``decode_us=10000``).
    device_config: str = ""
    #: calbin to serve; None writes the synthetic calbin into a replica-local temp dir.
    calbin_path: str | None = None
    #: CalRT shim library; None: ``$CALEXEC_CALRT_LIB`` or the bundled emulator.
    runtime_lib: str | None = None
    #: model manifest; None: the packaged synthetic one.
    manifest_path: str | None = None
    #: ``RecoveryPolicy.reset_kind``; None: the rule of drivers/device_spec.py (an external
    #: library without an explicit kind gets "none", §9.1).
    reset_kind: str | None = None
    #: drain grace of a replica being stopped (requests, then executor shutdown).
    #: (finite: it is the executor's ``shutdown(grace=...)``, which refuses inf)
    grace_s: float = attrs.field(default=30.0, validator=[attrs.validators.ge(0), _finite])
    #: the reference server's settings (admin token, sequences, deadlines).
    server: ServerConfig = attrs.field(factory=ServerConfig)
    #: how often the Ray Serve gauges are refreshed.
    metrics_period_s: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    #: GIL switch interval of the replica process in us (0: Python's default; drivers/serving/process.py)
    gil_switch_us: int = attrs.field(default=SERVING_SWITCH_INTERVAL_US,
                                     validator=[attrs.validators.ge(0),
                                                attrs.validators.le(MAX_SWITCH_INTERVAL_US)])
    #: ``ExecutorConfig.native_relay`` of every replica's executor (``serve --native-relay``)
    native_relay: bool = False
    #: ``ExecutorConfig.inflight_capacity`` of every replica's executor (``serve
    #: --inflight-capacity``: 1, Phase A; 2, Phase B). Until stop 70 ``serve --ray`` took
    #: the flag and ran every replica in Phase A
    inflight_capacity: int = attrs.field(default=1, validator=attrs.validators.in_((1, 2)))
    #: ``ExecutorConfig.allow_unpinned_golden`` of every replica's executor (``serve
    #: --allow-unpinned-golden``; taken and ignored by ``serve --ray`` until stop 70, so a
    #: calbin with no pinned golden failed every replica's start)
    allow_unpinned_golden: bool = False


def check_lifecycle(state: str, failure: Any = None) -> None:
    """Raise :class:`ReplicaFailed` unless ``state`` is in :data:`HEALTHY_STATES`."""
    if state not in HEALTHY_STATES:
        raise ReplicaFailed(f"device lifecycle is {state}: {failure}")


def routing_stats(state: str, serving: bool) -> dict[str, Any]:
    """What a replica reports to the router (``record_routing_stats``): its lifecycle state and
    whether it admits requests now (Ready and not draining)."""
    return {"lifecycle": state, "serving": serving}


def is_serving(stats: dict[str, Any]) -> bool:
    """Whether the router should prefer a replica whose last report is ``stats``. A replica
    with no report yet (``{}``: Serve has not pulled one since it started) counts as serving:
    Serve marks a replica running only after its constructor, which ends with the golden run."""
    return bool(stats.get("serving", True))


class LifecycleRouter(FIFOMixin, RequestRouter):
    """Serve request router: power of two choices among the replicas that serve, then among
    the others.

    Rank one holds two random replicas whose routing stats say they serve (:func:`is_serving`);
    Serve sends the request to the one with the shorter queue. Only when neither can take it
    (both at ``max_ongoing_requests``) or none serves does Serve try rank two, the replicas
    that do not serve: their answer is the reference server's clear 503 + Retry-After, never a
    request parked in the router. A replica's lifecycle reaches the router through the
    controller (which pulls it) and a long poll: about ``request_routing_stats_period_s`` plus
    one or two controller loops (0.1 s each) late."""

    def initialize_state(self, **kwargs: Any) -> None:
        # so this process's relay can ask whether a sibling serves (drivers/fleet/registry.py
        # says why this state is not kept in this module)
        replica_registry.register_router(self)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        relay = (pending_request is not None
                 and pending_request.metadata.call_method == RELAY_METHOD)
        me = replica_registry.self_replica() if relay else None
        request = (pending_request.args[0] if relay and pending_request is not None
                   and pending_request.args else None)
        avoid, pin = (), None
        if isinstance(request, dict):  # built by the fleet ingress or a tool, never by HTTP
            avoid, pin = request.get("avoid") or (), request.get("replica")
        return rank_by_lifecycle(candidate_replicas, exclude=me, avoid=avoid, pin=pin)


def rank_by_lifecycle(candidates: list[Any], exclude: Any = None, avoid: Any = (),
                      pin: str | None = None) -> list[list[Any]]:
    """:class:`LifecycleRouter`'s ranking of replicas (anything with ``routing_stats`` and
    ``replica_id``): up to two random serving replicas, then up to two random others; empty
    ranks are left out. ``exclude`` (a relaying replica's own id) is never chosen while
    another replica exists; alone, it gets the request back and answers it itself (a relayed
    request is never relayed again), so a relay is never parked in the router. ``avoid``
    (replica unique ids that already failed this request: the fleet ingress's failover) come
    last, after every other replica. ``pin`` (a replica unique id: an operator or test
    addressing one replica) is the only choice while it exists."""
    if pin is not None:
        pinned = [r for r in candidates if unique_id(r) == pin]
        if pinned:
            return [pinned]
    if exclude is not None:
        others = [r for r in candidates if r.replica_id != exclude]
        candidates = others or candidates
    avoided = [r for r in candidates if unique_id(r) in avoid]
    candidates = [r for r in candidates if unique_id(r) not in avoid]
    serving = [r for r in candidates if is_serving(r.routing_stats)]
    others = [r for r in candidates if not is_serving(r.routing_stats)]
    ranks = [random.sample(serving, min(2, len(serving))),
             random.sample(others, min(2, len(others))),
             random.sample(avoided, min(2, len(avoided)))]
    return [rank for rank in ranks if rank]


def unique_id(replica: Any) -> str:
    """A replica's unique id (the ``x-calexec-replica`` header's value)."""
    return str(getattr(replica.replica_id, "unique_id", replica.replica_id))


def sibling_serves(app_name: str, self_id: Any) -> bool:
    """Whether a router of this process knows a replica of ``app_name`` other than ``self_id``
    whose last routing stats say it serves (the relay's precondition)."""
    for router in replica_registry.routers():
        if router.app_name != app_name:
            continue
        # Serve replaces this dict (or pops a dead replica) on its router thread; list() copies
        # it in one C-level pass under the GIL, so the copy is consistent
        replicas = list(router.curr_replicas.values())
        if any(r.replica_id != self_id and is_serving(r.routing_stats) for r in replicas):
            return True
    return False


class CalexecReplica:
    """One replica: one device, one executor, the reference server's app behind its fleet
    edge, reached through ``relay_http`` (from :class:`CalexecIngress`; a Serve application
    has one HTTP ingress deployment)."""

    def __init__(self, settings: ReplicaSettings) -> None:
        """Open the device and start the executor (golden included); raise on failure so Ray
        retries the constructor instead of routing to a replica that cannot serve."""
        self.settings = settings
        local_ray.bind_serve_grpc_to_node_ip()  # a loopback node: Serve's gRPC server too
        set_gil_switch_interval_us(settings.gil_switch_us)  # the process is this replica's
        self._tmp = tempfile.TemporaryDirectory(prefix="calexec-replica-")
        spec = DeviceSpec(manifest_path=settings.manifest_path, calbin_path=settings.calbin_path,
                          runtime_lib=settings.runtime_lib, reset_kind=settings.reset_kind)
        self.executor = DeviceExecutor(spec.runtime(), spec.manifest(), with_emulated_latency(
            within_request_timeout(ExecutorConfig(
                calbin_path=spec.calbin(self._tmp.name), device_config=settings.device_config,
                recovery=spec.recovery(), native_relay=settings.native_relay,
                inflight_capacity=settings.inflight_capacity,
                allow_unpinned_golden=settings.allow_unpinned_golden),
                settings.server.default_timeout_s)))
        status = self.executor.start()
        if not status.ok:  # (Failed: its device closed, its threads ended, by the shutdown)
            self.executor.shutdown(grace=settings.grace_s)
            self._tmp.cleanup()
            raise RuntimeError(f"calexec replica: executor failed to start: {status}")
        try:
            self._app = create_app(served(self.executor), settings.server)
            self.service = self._app.state.service
            self.device = device_label(self.executor, settings)
            replica_id = serve.get_replica_context().replica_id
            replica_registry.set_self_replica(replica_id)
            self.replica = replica_id.unique_id
            self._app.add_middleware(ReplicaHeaders, replica=self.replica, device=self.device)
            deployment = replica_id.deployment_id
            self._siblings = serve.get_deployment_handle(deployment.name, deployment.app_name)
            self._relay_handle = self._siblings.options(method_name=RELAY_METHOD, stream=True)
            self.edge = ReplicaEdge(
                self._app, replica=self.replica, serving=lambda: self.service.ready,
                relay=lambda request: self._relay_handle.remote(request),
                relay_target=lambda: sibling_serves(deployment.app_name, replica_id),
                max_body_bytes=settings.server.max_body_bytes,
                retry_after_s=settings.server.retry_after_s,
                body_timeout_s=settings.server.body_timeout_s)
            self._gauges = {name: serve_metrics.Gauge(name, doc, tag_keys=("device",))
                            for name, (doc, _) in RAY_GAUGES.items()}
            for gauge in self._gauges.values():
                gauge.set_default_tags({"device": self.device})
            loop = asyncio.get_running_loop()
            self._metrics_task = loop.create_task(self._export_metrics())
            self._warm_task = loop.create_task(self._warm_relay())
        except BaseException:
            # the executor runs (device open, its threads, the golden passed): a constructor
            # failing past its start left it so in this process, its device held and its
            # scratch directory behind (``__del__`` stops only a replica that was built)
            self.executor.shutdown(grace=settings.grace_s)
            self._tmp.cleanup()
            raise

    def __serve_build_asgi_app__(self) -> Any:
        return self.edge

    async def relay_http(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """A request from the fleet ingress (drivers/fleet/ingress.py) or a sibling's relay
        (drivers/fleet/edge.py), served by this replica's edge and streamed back as ASGI
        messages, with the progress messages the ingress asked for; never relayed again. A
        draining replica hands a stream off at a token boundary while a sibling serves."""
        if request.get("progress"):  # which replica this is, before anything can fail
            yield {"type": PROGRESS_TYPE, "replica": self.replica}
        async for message in serve_relayed(self.edge, request,
                                           handoff_ok=self.edge.relay_target):
            yield message

    async def _warm_relay(self) -> None:
        """One call through this replica's own handle, so its router exists and follows the
        deployment's replicas and their routing stats before a relay needs them."""
        try:
            await self._siblings.identity.remote()
        except Exception as err:  # noqa: BLE001 - the relay then answers here (503) until a router exists
            log.warning("relay handle warm-up failed: %r", err)

    def check_health(self) -> None:
        """Ray Serve's health probe: raises :class:`ReplicaFailed` when the lifecycle is
        Failed (or Stopped), so the controller replaces this replica."""
        check_lifecycle(self.executor.state, self.executor.failure)

    def record_routing_stats(self) -> dict[str, Any]:
        """Ray Serve's routing-stats hook, pulled by the controller every
        ``request_routing_stats_period_s`` and handed to :class:`LifecycleRouter`."""
        return routing_stats(self.executor.state, self.service.ready)

    def identity(self) -> dict[str, Any]:
        """Which replica and device answered, and its lifecycle (handle calls, tests, ops)."""
        snap = self.executor.snapshot()
        return {"replica": self.replica, "device": self.device, "pid": os.getpid(),
                "lifecycle": snap["lifecycle"], "generation": snap["generation"],
                "succeeded": snap["succeeded"], "relayed": self.edge.relayed,
                "inflight_capacity": self.executor.config.inflight_capacity,
                "allow_unpinned_golden": self.executor.config.allow_unpinned_golden}

    def inject_submit_fault(self, rc: int, nth: int = 1) -> dict[str, Any]:
        """Emulator only: the ``nth`` next ``infer()`` on this replica's device returns ``rc``
        (fault drills and tests). ``{"replica", "device", "rc"}``: the emulator's return code
        (0: armed), or -1 on a vendor runtime (nothing armed)."""
        emu = emulator_of(self.executor.device)
        rc_armed = -1 if emu is None else emu.set_fault(
            Fault.SUBMIT_RC, FaultMode.NTH, nth, 0, rc=rc)
        return {"replica": self.replica, "device": self.device, "rc": rc_armed}

    def _gauge_values(self) -> dict[str, float]:
        snap = self.executor.snapshot()
        values = {"ready": 1.0 if self.service.ready else 0.0,
                  "generation": snap["generation"] or 0, "inflight": snap["inflight"],
                  "active": self.service.active, "succeeded": snap["succeeded"],
                  "failed": snap["failed"], "relayed": self.edge.relayed}
        return {name: float(values[key]) for name, (_, key) in RAY_GAUGES.items()}

    async def _export_metrics(self) -> None:
        while True:
            for name, value in self._gauge_values().items():
                self._gauges[name].set(value)
            await asyncio.sleep(self.settings.metrics_period_s)

    async def __del__(self) -> None:
        """Graceful stop (scale-down, redeploy, replacement, shutdown): Serve has stopped
        routing here and waited for ongoing requests; drain what is left and shut the
        executor down within ``grace_s``. Ray also calls this after a constructor that
        raised; the executor then never started (nothing to drain)."""
        if not hasattr(self, "_metrics_task"):
            return
        self._metrics_task.cancel()
        self._warm_task.cancel()
        status = await self.service.drain(self.settings.grace_s)
        if not status.ok:
            # a Failed replica being replaced ends here too: its reason is the executor's
            log.warning("replica drain ended %s: %s", self.executor.state, status)
        self._tmp.cleanup()


@serve.ingress()
class CalexecHttpReplica(CalexecReplica):
    """A replica that is the application's HTTP entry itself (``build_app(ingress=False)``:
    no ingress hop, no mid-stream failover)."""


@serve.ingress()
class CalexecIngress:
    """The fleet's HTTP entry (drivers/fleet/ingress.py): no device; every request goes to a
    device replica through a streaming handle call to its ``relay_http``, and a completion or
    chat a replica cannot finish (its process died, it drained, its device failed) continues
    on a sibling from where the client is. Exports Ray Serve counters
    ``calexec_fleet_failovers{cause}``, ``calexec_fleet_failover_tokens_reprefilled`` and
    ``calexec_fleet_failover_budget_exhausted``."""

    def __init__(self, replicas: Any, failover: FailoverSettings) -> None:
        local_ray.bind_serve_grpc_to_node_ip()  # a loopback node: Serve's gRPC server too
        self._relay = replicas.options(method_name=RELAY_METHOD, stream=True)
        self.ingress = FleetIngress(lambda request: self._relay.remote(request), failover)
        failovers = serve_metrics.Counter(
            "calexec_fleet_failovers", "Requests continued on a sibling replica, by cause "
            f"({', '.join(CAUSES)}).", tag_keys=("cause",))
        reprefilled = serve_metrics.Counter(
            "calexec_fleet_failover_tokens_reprefilled",
            "Prompt + produced tokens re-prefilled by siblings on failovers.")
        exhausted = serve_metrics.Counter(
            "calexec_fleet_failover_budget_exhausted",
            "Requests that failed because their failover budget was spent.")

        def counted(cause: str, tokens: int) -> None:
            failovers.inc(1, tags={"cause": cause})
            if tokens:
                reprefilled.inc(tokens)
        self.ingress.on_failover = counted
        self.ingress.on_exhausted = lambda: exhausted.inc(1)

    def __serve_build_asgi_app__(self) -> Any:
        return self.ingress

    async def drain(self, grace_s: float) -> dict[str, Any]:
        """Refuse new requests (503 + Retry-After) and wait up to ``grace_s`` for those in
        progress (:meth:`FleetIngress.drain`); :func:`drain_fleet` calls it."""
        return await self.ingress.drain(grace_s)

    def stats(self) -> dict[str, Any]:
        """The ingress's failover counters (tests, ops)."""
        return {"failovers": dict(self.ingress.failovers),
                "reprefilled": self.ingress.reprefilled, "exhausted": self.ingress.exhausted}


class ReplicaHeaders:
    """ASGI middleware: every HTTP response names the replica and device that served it
    (``x-calexec-replica``, ``x-calexec-device``), streaming responses included."""

    def __init__(self, app: Any, replica: str, device: str) -> None:
        self.app = app
        self._headers = [(b"x-calexec-replica", replica.encode()),
                         (b"x-calexec-device", device.encode())]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *self._headers]}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def device_label(executor: DeviceExecutor, settings: ReplicaSettings) -> str:
    """The ``device`` metrics tag: ``host/emu-PID`` for the replica's own emulator instance,
    ``host/DEVICE_CONFIG`` for a vendor runtime (the config string selects the device)."""
    host = socket.gethostname()
    if emulator_of(executor.device) is not None:
        return f"{host}/emu-{os.getpid()}"
    return f"{host}/{settings.device_config or 'default'}"


def drain_fleet(app: str, grace_s: float) -> dict[str, Any]:
    """Drain the application ``app`` at its ingress before Serve shuts down: new requests are
    answered 503 + Retry-After and those in progress finish (failovers included) within
    ``grace_s``. Serve's own shutdown stops its HTTP proxies at once, which would cut every
    stream in flight; the replicas' own drain (``__del__``) then finds nothing left.
    Returns :meth:`FleetIngress.drain`'s answer."""
    handle = serve.get_deployment_handle(INGRESS_DEPLOYMENT, app)
    return handle.drain.remote(grace_s).result(timeout_s=grace_s + 30.0)


def build_app(settings: ReplicaSettings, replicas: int, health_check_period_s: float = 0.5,
              health_check_timeout_s: float = 10.0, routing_stats_period_s: float = 0.1,
              failover: FailoverSettings | None = None, ingress: bool = True) -> Any:
    """The bound Serve application: :class:`CalexecIngress` (deployment ``ingress``, the HTTP
    entry, one replica, no device) in front of ``replicas`` replicas of
    :class:`CalexecReplica` (deployment ``calexec``), routed by :class:`LifecycleRouter`.
    ``failover``: the ingress's budget; by default ``max_failovers`` is the server's
    ``max_resumes`` and the deadline, body limit and Retry-After are the server's.
    ``ingress=False``: the replicas are the HTTP entry themselves (no mid-stream failover;
    the replica's edge still relays a completion answered 503 before its first byte).

    ``graceful_shutdown_timeout_s`` is the drain grace plus 10 s of headroom for the
    executor's shutdown; one replica per device, so replicas take no Ray CPU (``num_cpus=0``)
    and a device-bound cluster schedules them with a custom resource instead
    (docs/deployment.md). Serve replaces a replica after 3 consecutive failed health checks
    (about ``3 * health_check_period_s``); the router stops preferring it as soon as its
    routing stats (pulled every ``routing_stats_period_s``) say it no longer serves."""
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: must be >= 1")
    if routing_stats_period_s <= 0:
        raise ValueError(f"routing_stats_period_s={routing_stats_period_s}: must be > 0")
    deployment = serve.deployment(
        CalexecReplica if ingress else CalexecHttpReplica, name=REPLICA_DEPLOYMENT,
        num_replicas=replicas,
        ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=settings.server.max_sequences,
        graceful_shutdown_wait_loop_s=0.2,
        graceful_shutdown_timeout_s=settings.grace_s + 10.0,
        health_check_period_s=health_check_period_s,
        health_check_timeout_s=health_check_timeout_s,
        request_router_config=RequestRouterConfig(
            request_router_class=LifecycleRouter,
            request_routing_stats_period_s=routing_stats_period_s))
    if not ingress:
        return deployment.bind(settings)
    server = settings.server
    failover = failover or FailoverSettings(
        max_failovers=server.max_resumes, default_timeout_s=server.default_timeout_s,
        max_body_bytes=server.max_body_bytes, retry_after_s=server.retry_after_s,
        body_timeout_s=server.body_timeout_s, deadline_slack_s=server.deadline_slack_s)
    entry = serve.deployment(
        CalexecIngress, name=INGRESS_DEPLOYMENT, num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        # every request of the fleet passes here: as many as the replicas admit or queue
        max_ongoing_requests=replicas * (server.max_sequences + server.max_waiting) + 16)
    return entry.bind(deployment.bind(settings), failover)
