"""Helpers shared by the server tests (no tests here): executors on the bundled emulator,
a uvicorn server on an ephemeral loopback port, the oracle's greedy tokens, metric lookup."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers import calbin, oracle
from calexec.drivers.runtime import CalRT
from calexec.machines.executor import DeviceExecutor, ExecutorConfig


def started_executor(tmp: Path, device_config: str = "", **config) -> DeviceExecutor:
    """A started executor serving the default synthetic calbin written into ``tmp``."""
    path = str(tmp / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              ExecutorConfig(calbin_path=path, device_config=device_config,
                                             **config))
    status = executor.start()
    if not status.ok:
        raise RuntimeError(f"executor did not start: {status}")
    return executor


def oracle_tokens(prompt: list[int], n: int, seed: int = calbin.DEFAULT_SEED) -> list[int]:
    """The greedy continuation of ``prompt`` (n tokens) by the numpy oracle."""
    seq = oracle.OracleSequence(seed)
    seq.run(prompt)
    out = []
    for _ in range(n):
        token = seq.next_token()
        out.append(token)
        seq.run([token])
    return out


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    """Value of the sample ``name`` with ``labels`` in a Prometheus exposition, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and (labels or {}).items() <= sample.labels.items():
                return sample.value
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (bounded) until true; AssertionError naming ``what`` otherwise."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.01)


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1 (ephemeral port) in a background thread."""

    def __init__(self, app) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="uvicorn-test", daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        wait_for(lambda: self.server.started, what="uvicorn startup")
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


SVG_ACTIVE = re.compile(r"<title>(\w+)</title>\s*<\w+ fill=\"turquoise\"")
