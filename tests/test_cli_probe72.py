"""Stop 72 (cli): a device fault the metrics missed, an interrupt that left an executor
running, and bad CLI input as a user on a terminal and a CI script give it
(docs/traceability.md, "Found at stop 72 (cli)"). Loopback servers only; every wait bounded;
never a timing figure.
"""

from __future__ import annotations

import pytest

import needs

needs.module("httpx", "server")  # /metrics and the reload go over HTTP ([server])
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from test_server_support import ServeLikeServer  # noqa: E402

ADMIN = "probe72"


def _device_faults(text: str) -> dict[tuple[str, str, str], float]:
    return {(s.labels["category"], s.labels["code"], s.labels["raw"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "calexec_device_faults_total"}


def test_a_configure_the_device_refused_is_counted_in_the_device_faults(tmp_path):
    """A model switch (``POST /admin/reload``) whose configure the device refused (rc 24,
    ``calrt.map_failed``: §8 DEVICE) reset the device and configured again, and served on,
    but ``calexec_device_faults_total`` never counted the refusal (nor did the log have the
    fault's line): no fault controller heard of it, since no job carried it. It is now
    reported as every device fault is, counted once with its category, code and raw code."""
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.tools.chaos import chaos_executor

    executor = chaos_executor(tmp_path)
    emu = executor.device.emu
    calbin = executor.gen.calbin_path
    app = create_app(executor, ServerConfig(admin_token=ADMIN))
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=60) as http:
            assert _device_faults(http.get("/metrics").text) == {}
            # the switch's first buffer map is refused; the configure after the reset maps
            assert emu.set_fault(Fault.MAP_FAIL, FaultMode.NTH, 1, 0, 0) == 0
            answer = http.post("/admin/reload", json={"calbin": calbin},
                               headers={"Authorization": f"Bearer {ADMIN}"})
            emu.clear_all_faults()
            assert answer.status_code == 200, answer.text
            assert http.get("/ready").status_code == 200
            faults = _device_faults(http.get("/metrics").text)
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)
    assert faults == {("device", "calrt.map_failed", "24"): 1.0}, faults
    assert executor.recoveries[-1]["refused"] == ["calrt.map_failed"], executor.recoveries[-1]
