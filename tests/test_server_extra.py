"""Issue 6's remaining server checks: ``calexec serve --once`` (README's run command), /ready
through an injected device fault and its recovery, ``promtool check metrics`` on /metrics, and
a headless-Chromium screenshot of /debug/statecharts.

promtool (Debian package ``prometheus``) and chromium (Debian package ``chromium``) are
installed by ``.ci/install-server-tools``; a missing tool skips the test with the reason, and
fails it under ``CALEXEC_REQUIRE_TOOLS=1`` (as ``.ci/run`` sets it; tests/needs.py).
Everything talks to 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image

import needs
from calexec.drivers.calrt.runtime import Fault, FaultMode, Stage
from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.dumpsink import DumpSink
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.serve import SAMPLE_REQUEST
from test_server_support import LiveServer, metric_value, oracle_tokens, started_executor, wait_for

TURQUOISE = (64, 224, 208)  # the highlighted state's fill (machines/diagrams.py)


def run_bounded(argv: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """Run ``argv`` in its own process group; on timeout kill that group (browsers fork
    helpers) and fail the test."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{argv[0]} did not finish within {timeout}s", pytrace=False)
    try:  # helpers left behind by a process that exited
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


# ---- calexec serve --once ------------------------------------------------------------------------
@pytest.mark.parametrize("flags", [[], ["--native-relay", "--device-config", "decode_us=2000"]],
                         ids=["default", "native_relay"])
def test_serve_once_prints_a_curl_command_and_the_completion(tmp_path, flags):
    done = run_bounded([sys.executable, "-m", "calexec", "serve", "--once", *flags], timeout=60,
                       cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    curl = re.search(r"^  curl -s http://127\.0\.0\.1:(\d+)/v1/completions "
                     r"-H 'content-type: application/json' -d '(.*)'$", out, re.MULTILINE)
    assert curl, out
    assert int(curl.group(1)) != 8000  # an ephemeral port, not the default
    assert json.loads(curl.group(2)) == SAMPLE_REQUEST
    assert "response (HTTP 200," in out
    reply = json.loads(out[out.index("\n{\n") + 1:out.index("\n}\n") + 2])
    prompt = tokenizer.encode(SAMPLE_REQUEST["prompt"])
    assert reply["choices"][0]["token_ids"] == oracle_tokens(prompt,
                                                             SAMPLE_REQUEST["max_tokens"])
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    assert out.rstrip().endswith("drained: executor Stopped; exit 0")


def test_serve_once_in_phase_b(tmp_path):
    """``--inflight-capacity 2`` (stop 57: the server could not run Phase B but through an
    embedder's own ``ExecutorConfig``): the executor starts with two jobs in flight, says so,
    and the sample is the oracle's; 3 is refused naming the flag, exit 2."""
    done = run_bounded([sys.executable, "-m", "calexec", "serve", "--once", "--log-level",
                        "info", "--inflight-capacity", "2"], timeout=60, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "inflight_capacity=2 (Phase B)" in done.stderr, done.stderr
    reply = json.loads(done.stdout[done.stdout.index("\n{\n") + 1:
                                   done.stdout.index("\n}\n") + 2])
    prompt = tokenizer.encode(SAMPLE_REQUEST["prompt"])
    assert reply["choices"][0]["token_ids"] == oracle_tokens(prompt,
                                                             SAMPLE_REQUEST["max_tokens"])
    refused = run_bounded([sys.executable, "-m", "calexec", "serve", "--once",
                           "--inflight-capacity", "3"], timeout=60, cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "argument --inflight-capacity: must be in 1..2, got 3" in refused.stderr


def test_serve_once_exits_non_zero_when_the_sample_request_fails(tmp_path):
    # a deadline nobody can meet: the sample gets 504 and the run must not report success
    done = run_bounded([sys.executable, "-m", "calexec", "serve", "--once",
                        "--timeout", "0.000001"], timeout=60, cwd=tmp_path)
    assert done.returncode == 4, done.stdout + done.stderr
    assert "response (HTTP 504," in done.stdout and "sample request failed" in done.stderr


# ---- /ready through a device fault and its recovery ----------------------------------------------
def busy_engine(emu) -> int | None:
    """The first device engine with a job queued or running, or None."""
    return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)


def step_one_job(emu) -> None:
    """Stepped emulator: wait (bounded) for a job on either engine, run it to its signal."""
    wait_for(lambda: busy_engine(emu) is not None, what="a job on the stepped device")
    rc, _did = emu.step(busy_engine(emu), Stage.JOB)
    assert rc == 0, rc


def test_ready_follows_an_injected_device_fault_through_recovery(tmp_path):
    """With the waiting queue and resumes off (issue 16: tests/test_server_waiting.py and
    test_server_resume.py cover them on): the faulted request and a request during the
    recovery get 503 at once."""
    executor = started_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig(max_waiting=0, max_resumes=0))
    prompt = [5, 6, 7]
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=20) as client:
            ready = client.get("/ready")
            assert ready.status_code == 200 and ready.json()["generation"] == 1
            # The next job ends DONE_CCU_EXCEPTION; stepped mode holds every job on the device
            # until this test runs it, so the recovery's golden run waits in Warming.
            assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
            assert emu.set_stepped(True) == 0
            failed: list[httpx.Response] = []
            worker = threading.Thread(target=lambda: failed.append(httpx.post(
                f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 4},
                timeout=20)))
            worker.start()
            step_one_job(emu)  # the request's prefill: CCU exception -> DEVICE -> recovery
            worker.join(20)
            assert failed and failed[0].status_code == 503, failed
            assert failed[0].json()["status"]["category"] == "device"
            wait_for(lambda: executor.state == "Warming" and busy_engine(emu) is not None,
                     what="the recovery's golden job waiting on the stepped device")
            not_ready = client.get("/ready")
            assert not_ready.status_code == 503 and not_ready.headers["retry-after"]
            assert "Warming" in not_ready.json()["error"]["message"]
            refused = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert refused.status_code == 503 and refused.headers["retry-after"]
            assert emu.set_stepped(False) == 0  # the device runs the golden by itself again
            wait_for(lambda: client.get("/ready").status_code == 200 and bool(executor.recoveries),
                     timeout=20, what="/ready to return to 200 and the recovery recorded")
            ready = client.get("/ready").json()
            assert ready["lifecycle"] == "Ready" and ready["generation"] == 2
            assert executor.recoveries[-1]["ok"] and executor.recoveries[-1]["reset"]
            done = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
            assert done.status_code == 200, done.text
            assert done.json()["choices"][0]["token_ids"] == oracle_tokens(prompt, 4)
            metrics = client.get("/metrics").text
        assert metric_value(metrics, "calexec_generation") == 2
        assert metric_value(metrics, "calexec_request_failures_total",
                            {"category": "device"}) == 1
        assert app.state.service.sequences.in_use == 0
    finally:
        emu.set_stepped(False)  # a failed assertion must not leave jobs held on the device
        executor.shutdown(5.0)


# ---- promtool check metrics ----------------------------------------------------------------------
def test_promtool_accepts_the_metrics_exposition(tmp_path):
    promtool = needs.tool("promtool")
    # promtool's lint is live: a counter without _total is reported (exit non-zero)
    lint = subprocess.run([promtool, "check", "metrics"], input="# TYPE x_bytes counter\n"
                          "x_bytes 1\n", capture_output=True, text=True, timeout=30)
    assert lint.returncode != 0 and "_total" in lint.stdout + lint.stderr
    executor = started_executor(tmp_path)
    dump = DumpSink(tmp_path / "dump", max_bytes=1 << 20)  # its counter family is linted too
    try:
        with TestClient(create_app(executor, ServerConfig(), dump)) as client:
            assert client.post("/v1/completions",
                               json={"prompt": [1, 2], "max_tokens": 3}).status_code == 200
            with client.stream("POST", "/v1/completions",
                               json={"prompt": "hi", "max_tokens": 2, "stream": True}) as r:
                assert r.status_code == 200 and list(r.iter_lines())
            assert client.post("/v1/completions", json={"prompt": []}).status_code == 400
            assert client.post("/v1/completions", json={"prompt": [1], "max_tokens": 2,
                                                        "timeout": 1e-6}).status_code == 504
            text = client.get("/metrics").text
    finally:
        executor.shutdown(5.0)
    # the traffic above filled the histograms, counters and gauges promtool is to lint
    for name in ("calexec_time_to_first_token_seconds_bucket", "calexec_job_h2d_seconds_bucket",
                 "calexec_request_failures_total", "calexec_lifecycle_state",
                 "calexec_buffer_slots", "calexec_num_requests_running",
                 "calexec_dump_records_total"):
        assert name in text, name
    check = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                           text=True, timeout=30)
    assert check.returncode == 0 and not (check.stdout + check.stderr).strip(), (
        check.stdout + check.stderr)


# ---- headless Chromium screenshot of /debug/statecharts -----------------------------------------
@pytest.mark.requires_tool("dot")
def test_statecharts_page_renders_in_headless_chromium(tmp_path):
    chromium = needs.tool("chromium")
    shot = tmp_path / "statecharts.png"
    executor = started_executor(tmp_path)
    try:
        with LiveServer(create_app(executor, ServerConfig())) as server:
            done = run_bounded(
                [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}",
                 "--window-size=1400,1000", f"{server.url}/debug/statecharts"],
                timeout=60, env={**os.environ, "HOME": str(tmp_path)})
    finally:
        executor.shutdown(5.0)
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    with Image.open(shot) as image:
        assert image.format == "PNG" and image.size == (1400, 1000)
        pixels = np.asarray(image.convert("RGB"), dtype=np.int16)
    assert pixels.std() > 0  # not blank
    assert (pixels.min(axis=2) < 128).mean() > 0.001  # dark text and chart lines drawn
    # the lifecycle chart is first and its current state (Ready) is filled turquoise
    assert (np.abs(pixels - TURQUOISE).max(axis=2) <= 8).sum() > 500


def test_full_queue_is_429_with_retry_after(tmp_path):
    """The executor's admission token budget is the queue: over it, 429 + Retry-After."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    from test_server_support import started_executor

    executor = started_executor(tmp_path, max_pending_tokens=8)
    try:
        with TestClient(create_app(executor, ServerConfig())) as client:
            r = client.post("/v1/completions", json={"prompt": list(range(1, 10)),
                                                     "max_tokens": 1})
            assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
            assert r.json()["status"]["code"] == "queue.full"
            r = client.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 1})
            assert r.status_code == 200  # still serving
    finally:
        executor.shutdown(5.0)
