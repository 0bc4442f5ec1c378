"""``calexec serve --ray`` as an operator runs it: a process with its own local Ray (issue 24
item 8).

Each fleet here is ``calexec serve --ray`` in a subprocess on ``--host 127.0.0.1`` with a
port picked on loopback; the tests list the process tree (psutil, which Ray ships) while it
serves, signal it, and check what is left once it exited:

- every listening socket of the tree (GCS, raylet, dashboard and runtime-env agents, Serve
  controller, proxy, replicas, the driver) is on loopback;
- SIGTERM drains: a stream in flight finishes with every token, a request arriving during the
  drain gets 503 + Retry-After, the command exits 0 and, when it has exited, no process of
  its tree is running and none of their ports is still listening (no agent lingering);
- a stream still running after ``--grace`` is cut and the exit is 3, with nothing left either;
- without ``$RAY_ADDRESS`` it starts its own Ray, even when the machine's last ``ray start``
  cluster (Ray's ``ray_current_cluster`` file) is gone; SIGINT stops it like SIGTERM.

Each fleet's Ray lives in a temporary directory of its own (``RAY_TMPDIR``), apart from any
other Ray on the machine. Every wait is bounded; a fleet that outlives its test is killed by
pid (never by name). The module needs the ``[ray]`` extra (skipped without it); one fleet at a
time, 25-35 s each.
"""

from __future__ import annotations

import ipaddress
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest

import needs

ray = needs.module("ray", "ray")  # the [ray] extra: without it the module is skipped
psutil = needs.module("psutil", "ray")  # shipped with Ray (importable once Ray is)

from test_server_support import free_port, oracle_tokens  # noqa: E402 - after the skip

STARTUP_S = 180.0  # Ray + Serve + two golden runs on 2 shared cores
#: the kinds of process a local fleet runs (the listing below must have found them all)
KINDS = ("gcs_server", "raylet", "DashboardAgent", "RuntimeEnvAgent", "ServeController",
         "ProxyActor", "ServeReplica:calexec:calexec", "ServeReplica:calexec:ingress")


def is_loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    mapped = getattr(address, "ipv4_mapped", None)
    return address.is_loopback or (mapped is not None and mapped.is_loopback)


class Fleet:
    """``calexec serve --ray`` in a subprocess of its own session; :meth:`tree` lists its
    processes, :meth:`cleanup` kills whatever of it is still running (by pid)."""

    def __init__(self, replicas: int, grace_s: float = 20.0, decode_us: int = 20_000,
                 stale_address: bool = False) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # short: Ray's unix sockets live below it (a socket path has at most 107 bytes)
        self.tmp = tempfile.mkdtemp(prefix="cxr-", dir="/tmp")
        if stale_address:  # what a `ray start` cluster that is gone leaves behind
            os.makedirs(os.path.join(self.tmp, "ray"))
            with open(os.path.join(self.tmp, "ray", "ray_current_cluster"), "w") as f:
                f.write(f"127.0.0.1:{free_port()}")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "calexec", "serve", "--ray", "--replicas", str(replicas),
             "--host", "127.0.0.1", "--port", str(self.port), "--grace", str(grace_s),
             "--device-config", f"decode_us={decode_us}"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**env, "RAY_TMPDIR": self.tmp})
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.seen: dict[int, tuple[float, str]] = {}  # pid -> (create time, name)
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, True),
                                          daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, False),
                                          daemon=True)]
        for reader in self._readers:
            reader.start()

    def _read(self, stream, out: bool) -> None:
        for line in stream:
            (self.stdout if out else self.stderr).append(line)
            if out:
                self.lines.put(line)
        if out:
            self.lines.put(None)

    def wait_serving(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line is not None and "replica(s) serving" in line:
                return
            if line is None or time.monotonic() > deadline:
                raise AssertionError(f"the fleet did not start (exit {self.proc.poll()}): "
                                     f"{''.join(self.stderr)[-3000:]}")

    def tree(self) -> list:
        """The CLI process and every process below it (remembered for :meth:`leftovers`)."""
        root = psutil.Process(self.proc.pid)
        procs = [root, *root.children(recursive=True)]
        for p in procs:
            try:
                self.seen[p.pid] = (p.create_time(), " ".join(p.cmdline())[:100] or p.name())
            except psutil.Error:
                pass
        return procs

    def listening(self) -> dict[tuple[str, int], str]:
        """(ip, port) -> process, for every listening TCP socket of the tree."""
        sockets = {}
        for p in self.tree():
            try:
                for c in p.net_connections(kind="inet"):
                    if c.status == psutil.CONN_LISTEN:
                        sockets[c.laddr.ip, c.laddr.port] = self.seen[p.pid][1]
            except psutil.Error:  # ended meanwhile
                pass
        return sockets

    def leftovers(self) -> list[str]:
        """Processes of the tree ever seen that still run (zombies hold nothing: not listed)."""
        left = []
        for pid, (created, name) in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(f"{pid} {name}")
            except psutil.Error:
                pass
        return left

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own session: this fleet only
            self.proc.wait(30)
        for entry in self.leftovers():
            try:
                psutil.Process(int(entry.split()[0])).kill()
            except psutil.Error:
                pass
        for reader in self._readers:
            reader.join(10)
        if not any(reader.is_alive() for reader in self._readers):  # (else one still reads)
            for stream in (self.proc.stdout, self.proc.stderr):  # (ResourceWarning: unclosed)
                if stream is not None:
                    stream.close()
        shutil.rmtree(self.tmp, ignore_errors=True)


def still_listening(sockets) -> list[str]:
    """The given (ip, port) pairs some process on this machine still listens on."""
    wanted = set(sockets)
    return [f"{c.laddr.ip}:{c.laddr.port} (pid {c.pid})"
            for c in psutil.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN and (c.laddr.ip, c.laddr.port) in wanted]


def assert_listed_every_kind(fleet: Fleet) -> None:
    """The tree listing found every kind of process a local fleet runs (else the checks on
    it would pass for want of processes)."""
    names = " | ".join(name for _, name in fleet.seen.values())
    missing = [kind for kind in KINDS if kind not in names]
    assert not missing, f"the listing missed {missing}: {names}"


@pytest.fixture(scope="module")
def fleet():
    fleet = Fleet(replicas=2)
    try:
        fleet.wait_serving()
        yield fleet
    finally:
        fleet.cleanup()


def test_every_listening_socket_of_a_loopback_fleet_is_on_loopback(fleet):
    sockets = fleet.listening()
    assert_listed_every_kind(fleet)
    exposed = {f"{ip}:{port}": name for (ip, port), name in sockets.items()
               if not is_loopback(ip)}
    assert not exposed, f"Ray sockets beyond loopback: {exposed}"
    assert ("127.0.0.1", fleet.port) in sockets  # the Serve proxy, where --port said
    r = httpx.post(f"{fleet.url}/v1/completions", json={"prompt": [3, 4], "max_tokens": 3},
                   timeout=30)
    assert r.status_code == 200
    assert r.json()["choices"][0]["token_ids"] == oracle_tokens([3, 4], 3)


def test_sigterm_drains_the_fleet_exits_0_and_leaves_no_ray_process_or_port(fleet):
    sockets = fleet.listening()  # also remembers every process of the tree
    assert_listed_every_kind(fleet)
    prompt, n = [9, 8, 7], 60  # 60 tokens at 20 ms: about 1.2 s after the signal
    tokens, events, late = [], [], []
    signalled = threading.Event()

    def arrive_during_the_drain() -> None:
        """New requests until one is refused (bounded): each is a 200 admitted before the
        drain began or the drain's 503."""
        signalled.wait(30)
        for _ in range(100):
            try:
                r = httpx.post(f"{fleet.url}/v1/completions", timeout=30,
                               json={"prompt": [5], "max_tokens": 2})
            except httpx.HTTPError as err:  # recorded: the assertions below name it
                late.append(err)
                return
            late.append(r)
            if r.status_code != 200:
                return
            time.sleep(0.02)
    client = threading.Thread(target=arrive_during_the_drain)
    client.start()
    with httpx.stream("POST", f"{fleet.url}/v1/completions", timeout=60,
                      json={"prompt": prompt, "max_tokens": n, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line:
                continue
            events.append(line)
            if line.startswith("data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                tokens += choices[0].get("token_ids", [])
            if len(tokens) >= 5 and not signalled.is_set():
                os.kill(fleet.proc.pid, signal.SIGTERM)
                signalled.set()
    client.join(60)
    assert not client.is_alive()
    t0 = time.monotonic()
    code = fleet.proc.wait(120)
    stopped_s = time.monotonic() - t0
    print(f"\n[figure] SIGTERM -> exit after the stream ended: {stopped_s:.1f} s")
    assert code == 0, "".join(fleet.stderr)[-3000:]
    # the stream in flight was drained, not cut: every token, one [DONE], no error event
    assert tokens == oracle_tokens(prompt, n)
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    # what arrived during the drain was refused with the server's 503 + Retry-After
    refused = late[-1]
    assert isinstance(refused, httpx.Response), refused
    assert refused.status_code == 503 and refused.headers.get("retry-after")
    assert refused.json()["error"]["message"] == "fleet is draining"
    assert all(r.status_code == 200 for r in late[:-1])
    assert any("SIGTERM: draining" in line for line in fleet.stdout)
    # once the command has exited, nothing of its Ray is left: no process, no port
    assert not fleet.leftovers(), fleet.leftovers()
    assert not still_listening(sockets), still_listening(sockets)


def test_a_stream_longer_than_the_grace_is_cut_and_the_exit_is_3():
    fleet = Fleet(replicas=1, grace_s=1.0)
    try:
        fleet.wait_serving()
        sockets = fleet.listening()
        tokens: list[int] = []
        signalled = False
        with pytest.raises(httpx.HTTPError):  # 300 tokens at 20 ms: 6 s, cut after 1 s
            with httpx.stream("POST", f"{fleet.url}/v1/completions", timeout=60,
                              headers={"X-Request-Id": "fleet-cut-64"},
                              json={"prompt": [2], "max_tokens": 300, "stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
                    if len(tokens) >= 5 and not signalled:
                        os.kill(fleet.proc.pid, signal.SIGTERM)
                        signalled = True
        assert 5 <= len(tokens) < 300
        assert fleet.proc.wait(120) == 3
        # named as the single server's drain names them (tests/test_fleet_shutdown.py)
        assert any("1 request(s) still running after --grace=1 s are cut "
                   "(x-request-id: fleet-cut-64)" in line for line in fleet.stderr)
        assert not fleet.leftovers(), fleet.leftovers()
        assert not still_listening(sockets), still_listening(sockets)
    finally:
        fleet.cleanup()


def test_a_fleet_without_ray_address_starts_its_own_ray_and_sigint_stops_it():
    """A stale ``ray_current_cluster`` (a ``ray start`` cluster that is gone) is not joined:
    ``ray.init()`` without an address would wait for that cluster for ever; the fleet starts
    its own Ray and serves. SIGINT then stops it as SIGTERM does."""
    fleet = Fleet(replicas=1, stale_address=True)
    try:
        fleet.wait_serving()
        sockets = fleet.listening()
        assert any("gcs_server" in name for _, name in fleet.seen.values())  # its own Ray
        r = httpx.post(f"{fleet.url}/v1/completions", timeout=30,
                       json={"prompt": [6, 7], "max_tokens": 2})
        assert r.status_code == 200
        os.kill(fleet.proc.pid, signal.SIGINT)
        assert fleet.proc.wait(120) == 0, "".join(fleet.stderr)[-3000:]
        assert any("SIGINT: draining" in line for line in fleet.stdout)
        assert not any("interrupted" in line for line in fleet.stderr)
        assert not fleet.leftovers(), fleet.leftovers()
        assert not still_listening(sockets), still_listening(sockets)
    finally:
        fleet.cleanup()
