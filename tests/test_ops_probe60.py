"""What the operator of ``calexec serve`` met at stop 60, following docs/operations.md and
docs/server.md on the bundled emulator.

- A hung device under ``serve``'s defaults: the executor's §9.1 execution deadline (30 s) was
  as long as the request deadline (``--timeout``, 30 s), so for 30 s every request stalled
  behind the hung job with ``/ready`` 200 and nothing logged, then the hung job's request
  ended 504 and the ones behind it 503, none resumed (docs/server.md says a hang is resumed
  with the tokens of a fault-free run). ``serve`` now takes a job on the device for a third
  of ``--timeout`` before calling the device hung, and logs the deadline at start.
"""

from __future__ import annotations

import signal

import httpx

from test_ops_sweep import serve_process, stopped
from test_server_support import LiveServer, metric_value

TIMEOUT_S = 15.0  # the server's request deadline (serve --timeout)


def test_a_hung_job_is_recovered_and_its_request_resumed_within_the_request_deadline(tmp_path):
    """The executor ``serve`` builds (``within_request_timeout``) finds a hung job, resets the
    device and resumes the request before the request's own deadline: the client gets the
    tokens a fault-free run gives, not a 504 at the deadline."""
    from calexec.contracts.manifest import default_manifest_path, load_manifest
    from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode
    from calexec.drivers.device_spec import within_request_timeout
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.synthetic import calbin
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    path = str(tmp_path / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = DeviceExecutor(CalRT.load(), load_manifest(default_manifest_path()),
                              within_request_timeout(ExecutorConfig(calbin_path=path),
                                                     TIMEOUT_S))
    assert executor.start().ok
    body = {"prompt": "a hung device", "max_tokens": 6}
    try:
        app = create_app(executor, ServerConfig(default_timeout_s=TIMEOUT_S))
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            clean = http.post("/v1/completions", json=body)
            assert clean.status_code == 200, clean.text
            assert executor.device.emu.set_fault(Fault.HANG, FaultMode.NTH, 1, 0, 0) == 0
            hung = http.post("/v1/completions", json=body)
            text = http.get("/metrics").text
    finally:
        executor.shutdown(5.0)
    assert hung.status_code == 200, hung.text  # was 504 wait.deadline at the request deadline
    assert hung.json()["choices"][0]["token_ids"] == clean.json()["choices"][0]["token_ids"]
    assert metric_value(text, "calexec_recoveries_total") == 1
    assert metric_value(text, "calexec_resumes_total", {"cause": "device"}) == 1


def test_serve_logs_the_execution_deadline_it_derived_from_its_timeout(tmp_path):
    """The operator reads in the start-up log how long a hung job goes unnoticed: a third of
    ``--timeout`` (and the per-token part), not the executor's 30 s; at least 5 s, so a short
    ``--timeout`` does not take a busy host's slow job (the start's golden) for a hang."""
    proc, url = serve_process(tmp_path, "--timeout", "24", "--log-level", "info")
    try:
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
    assert code == 0, err
    lines = [line for line in err.splitlines() if "execution deadline" in line]
    assert lines, err
    assert lines[0].startswith("INFO calexec.serve: execution deadline 8s + 0.001s per token "
                               "(--timeout 24s)"), lines


def test_a_short_timeout_keeps_an_execution_deadline_a_busy_start_survives(tmp_path):
    """``--timeout 0.01`` gave an execution deadline of 3 ms: the start's golden job, late on
    a loaded host, was taken for a hung device and the start failed (exit 3)."""
    proc, url = serve_process(tmp_path, "--timeout", "0.01", "--log-level", "info")
    try:
        assert httpx.get(f"{url}/ready", timeout=10).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
    assert code == 0, err
    assert "INFO calexec.serve: execution deadline 5s + 0.001s per token (--timeout 0.01s)" \
        in err, err
