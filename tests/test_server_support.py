"""Helpers shared by the server tests (no tests here): executors on the bundled emulator,
a uvicorn server on an ephemeral loopback port, the oracle's greedy tokens, metric lookup."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.drivers.synthetic import oracle
from calexec.drivers.synthetic import calbin
from calexec.drivers.tools.chaos import LiveServer  # noqa: F401 - re-exported for the server tests
from calexec.drivers.calrt.runtime import CalRT
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


SVG_ACTIVE = re.compile(r"<title>(\w+)</title>\s*<\w+ fill=\"turquoise\"")
