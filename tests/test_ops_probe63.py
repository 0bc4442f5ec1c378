"""Stop 63 (operator): what ``/metrics`` tells an operator that it did not: a device refusing
work as busy, and requests counted in one unit.

Loopback servers only, on the bundled emulator; faults through the emulator's fault points;
every wait bounded; nothing asserts a duration.
"""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.drivers.tools.chaos import chaos_executor  # noqa: E402
from test_server_support import ServeLikeServer, server_idle, wait_for  # noqa: E402


def _samples(text: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[k] for k in labels): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def test_a_busy_infer_the_submitter_retried_is_counted_with_its_raw_code(tmp_path):
    """``infer()`` answering 17 (DEVICE_BUSY) is retried by the submitter after a back-off
    (§8 TRANSIENT) and the request is answered 200: before, nothing in ``/metrics`` moved
    (no fault, no failure), so an operator could not see the device refusing work. It is
    ``calexec_submit_retries_total{raw="17"}``, shown at 0 before the first."""
    executor = chaos_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    service = app.state.service
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            before = http.get("/metrics").text
            assert emu.set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 1, 0, 17) == 0
            answer = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                        "timeout": 20})
            emu.clear_all_faults()
            assert answer.status_code == 200, answer.text
            wait_for(lambda: server_idle(service), 20, "the server idle")
            after = http.get("/metrics").text
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)
    assert _samples(before, "calexec_submit_retries_total", "raw") == {("17",): 0.0}
    assert _samples(after, "calexec_submit_retries_total", "raw") == {("17",): 1.0}
    # retried, not a fault nor a failure (one that spent its retries is a fault, raw 17)
    assert _samples(after, "calexec_device_faults_total", "code") == {}
    assert _samples(after, "calexec_request_failures_total", "code") == {}
