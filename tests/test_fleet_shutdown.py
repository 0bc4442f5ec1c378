"""How the fleet stops and where its local Ray listens, without starting Ray (issue 24 item 8).

- the fleet ingress's drain (drivers/fleet/ingress.py): new requests 503 + Retry-After, the
  admitted ones finish, bounded by the grace; driven as in tests/test_fleet_ingress.py, with
  plain async generators as replicas;
- drivers/fleet/local_ray.py's rules: which environment makes a local Ray listen on loopback,
  the refusal of a node IP that is not, the rewrite of Serve's wildcard gRPC bind, the signal
  handlers the CLI installs after ``ray.init``, and the reaping of what Ray leaves running.

The Ray processes themselves (sockets, exit code, leftovers): tests/test_fleet_process.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys

import pytest

import needs
from calexec.drivers.fleet import local_ray
from calexec.drivers.fleet.ingress import FailoverSettings, FleetIngress
from calexec.drivers.serving import wire
from test_fleet_ingress import UNCUT, Client, Replica, Router


def ingress(router) -> FleetIngress:
    return FleetIngress(router, FailoverSettings(backoff_s=0.001, retry_after_s=2))


def test_a_draining_ingress_refuses_new_requests_and_waits_for_the_admitted_ones():
    gate = asyncio.Event()
    r1 = Replica("r1", gate=gate)  # each token after the first waits for the gate
    app = ingress(Router(r1))

    async def scenario():
        first = asyncio.ensure_future(Client().run(app))
        while not r1.requests:  # admitted and streaming
            await asyncio.sleep(0.01)
        assert app.active == 1
        drain = asyncio.ensure_future(app.drain(grace_s=5.0, poll_s=0.01))
        await asyncio.sleep(0.05)
        assert not drain.done() and app.draining  # the admitted stream is still running
        late = await Client().run(app)  # refused at once, never reaches a replica
        gate.set()
        return await first, late, await drain

    first, late, drained = asyncio.run(scenario())
    assert first.content == UNCUT and first.ended  # the admitted stream was not cut
    assert drained == {"drained": True, "active": 0, "request_ids": []}
    assert len(r1.requests) == 1  # the late request never reached the replica
    assert late.starts[0]["status"] == 503 and late.header(b"retry-after") == b"2"
    error = json.loads(late.content)["error"]
    assert error["message"] == "fleet is draining" and error["code"] == "lifecycle.unavailable"


def test_a_drain_gives_up_after_its_grace_and_says_how_many_requests_are_left():
    gate = asyncio.Event()
    r1 = Replica("r1", gate=gate)
    app = ingress(Router(r1))

    async def scenario():
        first = asyncio.ensure_future(Client().run(app))
        while not r1.requests:
            await asyncio.sleep(0.01)
        drained = await app.drain(grace_s=0.1, poll_s=0.01)
        gate.set()  # then let it finish, so nothing is left running
        await first
        return drained

    drained = asyncio.run(scenario())
    assert drained["drained"] is False and drained["active"] == 1
    assert app.active == 0


def test_a_drain_that_leaves_requests_names_their_request_ids_as_the_servers_does(caplog):
    """The fleet's drain line counted the requests it left to be cut but named none, where a
    single server's names their ``x-request-id`` s (tests/test_ops_opb63.py): the client's
    ``X-Request-Id``, else the id its response started with, in admission order, bounded as
    the server's (``wire.cut_ids``)."""
    gate = asyncio.Event()
    r1 = Replica("r1", gate=gate)
    app = ingress(Router(r1))
    mine = Client(headers=((b"x-request-id", b"client-report-64"),))
    theirs = Client()  # sends no id: the one its response started with names it

    async def scenario():
        runs = []
        for client in (mine, theirs):  # one at a time: admitted in this order
            runs.append(asyncio.ensure_future(client.run(app)))
            while not client.starts:
                await asyncio.sleep(0.01)
        drained = await app.drain(grace_s=0.1, poll_s=0.01)
        gate.set()
        await asyncio.gather(*runs)
        return drained

    with caplog.at_level(logging.INFO, logger="calexec.fleet_ingress"):
        drained = asyncio.run(scenario())
    given = theirs.header(b"x-request-id").decode()
    assert given and given != "client-report-64"
    assert drained == {"drained": False, "active": 2,
                       "request_ids": ["client-report-64", given]}
    assert (f"ingress drain: grace 0.1s over, 2 request(s) still running are cut "
            f"(x-request-id: client-report-64, {given})") in caplog.text, caplog.text
    assert app.active == 0
    # the fleet's own exit line (calexec/serve.py) names them with the server's words too
    assert wire.cut_ids(drained["request_ids"]) == f" (x-request-id: client-report-64, {given})"


@pytest.mark.parametrize("grace", [-1.0, float("nan"), float("inf")])
def test_a_drain_refuses_a_grace_that_is_not_a_finite_number_of_seconds(grace):
    app = ingress(Router(Replica("r1")))
    with pytest.raises(ValueError, match=f"grace_s={grace}"):
        asyncio.run(app.drain(grace))
    assert not app.draining


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.0.0.2", True), ("localhost", True), ("::1", True),
    ("[::1]", True), ("0.0.0.0", False), ("::", False), ("10.1.2.3", False),
    ("npu-host-1", False)])
def test_loopback_hosts(host, loopback):
    assert local_ray.is_loopback(host) is loopback


def test_a_local_ray_for_a_loopback_host_runs_in_ray_single_machine_mode():
    env = local_ray.SINGLE_MACHINE_ENV
    assert local_ray.local_environment("127.0.0.1", {}) == {env: "0"}
    assert local_ray.local_environment("::1", {}) == {env: "0"}
    # a routable or wildcard host: Ray's own binding (every interface, as a cluster needs)
    assert local_ray.local_environment("0.0.0.0", {}) == {}
    assert local_ray.local_environment("10.1.2.3", {}) == {}
    # joining a cluster: its services listen as the cluster was started
    assert local_ray.local_environment("127.0.0.1", {"RAY_ADDRESS": "head:6379"}) == {}
    # the user's own setting wins
    assert local_ray.local_environment("127.0.0.1", {env: "1"}) == {}


def test_without_ray_address_ray_init_starts_a_local_cluster_never_the_last_one_started():
    assert local_ray.init_address({}) == "local"
    assert local_ray.init_address({"RAY_ADDRESS": " "}) == "local"
    assert local_ray.init_address({"RAY_ADDRESS": "head:6379"}) == "head:6379"
    assert not local_ray.joins_cluster({}) and local_ray.joins_cluster({"RAY_ADDRESS": "h:1"})


def test_a_failed_join_names_the_address_and_the_token_settings():
    line = local_ray.join_error("10.0.0.5:6379", ConnectionError("Failed to connect"))
    assert "RAY_ADDRESS='10.0.0.5:6379'" in line and "Failed to connect" in line
    assert "RAY_AUTH_MODE=token" in line and "RAY_AUTH_TOKEN" in line
    assert "\n" not in line


def test_a_node_ip_that_is_not_loopback_is_refused_for_a_loopback_host():
    local_ray.check_node_ip("127.0.0.1", "127.0.0.1")
    local_ray.check_node_ip("0.0.0.0", "192.0.2.2")  # not asked for loopback
    with pytest.raises(local_ray.RayBindError,
                       match=r"--host=127\.0\.0\.1 .* node IP 192\.0\.2\.2"):
        local_ray.check_node_ip("127.0.0.1", "192.0.2.2")


def test_serve_grpc_wildcard_binds_move_to_a_loopback_node_ip_only():
    assert local_ray.grpc_bind_address("[::]:0", "127.0.0.1") == "127.0.0.1:0"
    assert local_ray.grpc_bind_address("0.0.0.0:9000", "127.0.0.1") == "127.0.0.1:9000"
    assert local_ray.grpc_bind_address("[::]:0", "::1") == "[::1]:0"
    assert local_ray.grpc_bind_address("[::]:0", "192.0.2.2") == "[::]:0"  # a cluster node
    assert local_ray.grpc_bind_address("10.0.0.1:0", "127.0.0.1") == "10.0.0.1:0"


def test_stop_signals_set_the_event_and_restore_the_previous_handlers():
    def previous(*_):
        raise AssertionError("the previous handler must not run inside the context")
    saved = {sig: signal.signal(sig, previous) for sig in local_ray.StopSignals.SIGNALS}
    try:
        with local_ray.StopSignals() as signals:
            os.kill(os.getpid(), signal.SIGTERM)
            assert signals.stop.wait(5) and signals.received == "SIGTERM"
            os.kill(os.getpid(), signal.SIGINT)  # a second signal: no KeyboardInterrupt
            assert signals.received == "SIGTERM"
        for sig in local_ray.StopSignals.SIGNALS:
            assert signal.getsignal(sig) is previous
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_reap_waits_for_processes_that_end_and_ends_those_that_do_not():
    needs.module("ray", "ray")  # psutil comes with Ray
    psutil = needs.module("psutil", "ray")
    quick = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.2)"])
    stuck = subprocess.Popen([sys.executable, "-c",  # ignores SIGTERM: needs the SIGKILL
                              "import signal, time; signal.signal(signal.SIGTERM, "
                              "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        assert stuck.stdout.readline() == b"up\n"
        forced = local_ray.reap([psutil.Process(quick.pid), psutil.Process(stuck.pid)],
                                wait_s=2.0, term_s=0.5)
        assert [f.split()[0] for f in forced] == [str(stuck.pid)]
        # reaped by reap() itself (both are this process's children): no zombie is left
        assert not psutil.pid_exists(quick.pid) and not psutil.pid_exists(stuck.pid)
    finally:
        for proc in (quick, stuck):
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        stuck.stdout.close()
