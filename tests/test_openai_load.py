"""A short load test with a real third-party tool (issue 15 §4): locust, headless, in a child
process (it monkey-patches with gevent) against the server on a loopback port for a few
seconds with a bounded number of users. Needs the ``[load]`` extra (skipped without it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap

import pytest

from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, started_executor

# not pytest.importorskip: importing locust monkey-patches this process with gevent (the
# server's worker threads then break); the child imports it
pytestmark = pytest.mark.skipif(importlib.util.find_spec("locust") is None,
                                reason="the [load] extra (locust) is not installed")

LOCUSTFILE = textwrap.dedent('''
    from locust import HttpUser, between, task

    class Client(HttpUser):
        wait_time = between(0.01, 0.05)

        @task(3)
        def completion(self):
            self.client.post("/v1/completions", json={
                "model": "calexec-qwen3-synthetic", "prompt": "hello", "max_tokens": 4,
                "temperature": 0.8, "seed": 1})

        @task(1)
        def chat(self):
            self.client.post("/v1/chat/completions", json={
                "model": "calexec-qwen3-synthetic", "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}]})

        @task(1)
        def models(self):
            self.client.get("/v1/models")
''')


def test_locust_headless_run_has_no_failures(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    locustfile = tmp_path / "locustfile.py"
    locustfile.write_text(LOCUSTFILE)
    try:
        with LiveServer(app) as server:
            done = subprocess.run(
                [sys.executable, "-m", "locust", "-f", str(locustfile), "--headless",
                 "--users", "4", "--spawn-rate", "4", "--run-time", "3s", "--host", server.url,
                 "--json", "--only-summary", "--stop-timeout", "5", "--loglevel", "WARNING"],
                capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        executor.shutdown(5.0)
    assert done.returncode == 0, done.stderr[-2000:]
    stats = json.loads(done.stdout)
    requests = sum(entry["num_requests"] for entry in stats)
    failures = sum(entry["num_failures"] for entry in stats)
    assert requests > 0 and failures == 0, (requests, failures, done.stderr[-2000:])
    assert {entry["name"] for entry in stats} == {"/v1/completions", "/v1/chat/completions",
                                                  "/v1/models"}
