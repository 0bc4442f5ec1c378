"""Stop 44 (faultload): what the server says about itself (/metrics, /ready, /health,
Retry-After) held against what clients see while faults and bad clients happen.

Loopback servers only, on the bundled emulator; faults through the emulator's fault points
(seeded); every wait bounded; nothing asserts a duration.
"""

from __future__ import annotations

import json
import random
import threading
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.drivers.tools.chaos import FAULTS, arm_fault, chaos_executor  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    ServeLikeServer,
    metric_value,
    server_idle,
    started_executor,
    wait_for,
)


class BetweenGenerations:
    """A started executor seen through its public surface, which the test can make look like
    it is between two generations of a recovery (``hold()``): lifecycle ``Configuring`` and
    no ``generation``, as a real recovery is from the old generation's release until the new
    one is open (measured: some 130-170 ms per CCU recovery on the bundled emulator, every
    time). Everything else is the executor's own."""

    def __init__(self, executor: Any) -> None:
        self._executor = executor
        self.held = False

    def hold(self) -> None:
        self.held = True

    def release(self) -> None:
        self.held = False

    @property
    def state(self) -> str:
        return "Configuring" if self.held else self._executor.state

    @property
    def generation(self) -> Any:
        return None if self.held else self._executor.generation

    def health(self) -> list[str]:
        return ["lifecycle is Configuring, not admitting"] if self.held else \
            self._executor.health()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._executor, name)


@pytest.fixture(name="gap")
def gap_fixture(tmp_path):
    """``(proxy, service, url)``: a loopback server on a ``BetweenGenerations`` executor."""
    executor = started_executor(tmp_path)
    proxy = BetweenGenerations(executor)
    app = create_app(proxy, ServerConfig())
    try:
        with LiveServer(app) as server:
            yield proxy, app.state.service, server.url
    finally:
        proxy.release()
        executor.shutdown(5.0)


def _post_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def post() -> None:
        out["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread


def test_a_structured_request_between_generations_waits_for_ready(gap):
    """A completion with ``response_format`` arriving while a recovery has released the old
    generation and not yet opened the new one waits for Ready as every other completion does
    (docs/server.md: new completions wait within their deadline), then gets its answer; it
    was answered 503 ``device lifecycle is Configuring`` at once, with /ready about to be 200."""
    proxy, service, url = gap
    proxy.hold()
    out: dict = {}
    thread = _post_in_thread(url, {"prompt": [5, 6, 7], "max_tokens": 4, "timeout": 20,
                                   "response_format": {"type": "json_object"}}, out)
    wait_for(lambda: service.admission.waiting == 1 or "response" in out, 10,
             "the request waiting (or answered)")
    assert "response" not in out, out["response"].text
    proxy.release()
    thread.join(30)
    assert out["response"].status_code == 200, out["response"].text


def test_a_logit_bias_outside_the_vocabulary_is_refused_between_generations(gap):
    """A ``logit_bias`` key outside the vocabulary is a 400 naming ``logit_bias`` whatever the
    lifecycle: between two generations it was taken unchecked (no vocabulary to check it
    against), waited for Ready and got a 200."""
    proxy, service, url = gap
    proxy.hold()
    out: dict = {}
    thread = _post_in_thread(url, {"prompt": [5, 6, 7], "max_tokens": 2, "timeout": 20,
                                   "logit_bias": {"999999": 1}}, out)
    wait_for(lambda: "response" in out or service.admission.waiting == 1, 10,
             "the request answered (or waiting)")
    proxy.release()
    thread.join(30)
    response = out["response"]
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "logit_bias"


def test_models_report_the_context_length_between_generations(gap):
    """``/v1/models`` (``max_model_len``) and ``/tokenizer_info`` (``model_max_length``) say
    the served context length during a recovery too (the generation served before it): they
    said null between two generations."""
    proxy, _, url = gap
    before = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    proxy.hold()
    during = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["max_model_len"]
    info = httpx.get(f"{url}/tokenizer_info", timeout=10).json()["model_max_length"]
    assert isinstance(before, int) and during == before and info == before


def test_a_choice_cancelled_by_its_sibling_failure_is_not_a_client_cancellation(tmp_path):
    """``n=2``: one choice fails (an artifact fault: not resumed), the request answers its
    500 and its other choice is cancelled. No client left, so nothing is counted under
    ``request.cancelled`` (docs/server.md: 499, the client is gone), which operators read as
    clients giving up: the sibling was counted there, one per failed request of several
    choices. It has a code of its own, ``request.choice_cancelled``."""
    # decode jobs of 20 ms: the sibling is still decoding when the first choice fails
    executor = started_executor(tmp_path, "decode_us=20000")
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    service = app.state.service
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            assert emu.set_fault(Fault.UNKNOWN_CSR, FaultMode.NTH, 1, 0, 0) == 0
            response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "n": 2,
                                                          "max_tokens": 8})
            assert response.status_code == 500, response.text
            assert response.json()["error"]["code"] == "calrt.csr_failed"
            wait_for(lambda: service.active == 0, 10, "both choices finished")
            metrics = http.get("/metrics").text
        failures = {code: metric_value(metrics, "calexec_request_failures_total",
                                       {"code": code})
                    for code in ("calrt.csr_failed", "request.cancelled",
                                 "request.choice_cancelled")}
        assert failures == {"calrt.csr_failed": 1, "request.cancelled": None,
                            "request.choice_cancelled": 1}, failures
    finally:
        executor.shutdown(5.0)


# ---- the fault load: counters, gauges, /ready and Retry-After against what clients saw -------
#: the job-level faults the load injects (drivers/tools/chaos.py's; hangs left out: each costs
#: an execution deadline, and tests/test_chaos.py has them)
LOAD_FAULTS = ("ccu_exception", "output_nan", "output_short", "wait_rc", "submit_busy",
               "submit_unavailable", "can_allocate_false", "apply_false", "unknown_csr",
               "slice_fail")
KINDS = ("plain", "stream", "slow", "vanish", "cancel", "short")
#: the gauges that must read 0 once the load is over and the server idle
IDLE_GAUGES = ("calexec_num_requests_running", "calexec_num_requests_waiting",
               "calexec_kv_sequences_in_use", "calexec_kv_sequences_withheld",
               "calexec_jobs_inflight", "calexec_queue_depth", "calexec_pending_tokens",
               "calexec_responses_send_waiting", "calexec_kv_cache_usage_perc")


def _load_client(url: str, seed: int, stop: threading.Event, out: list) -> None:
    """Seeded client kinds: plain, streamed, a slow reader, one that leaves after two events,
    one that gives up before its answer (client timeout), one with a 50 ms server timeout.
    Each request appends ``(kind, status or None, outcome, error code)``."""
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            kind = rng.choice(KINDS)
            body = {"prompt": [rng.randrange(1, 1000) for _ in range(rng.randint(1, 6))],
                    "max_tokens": rng.randint(2, 10), "timeout": 0.05 if kind == "short" else 5,
                    "stream": kind in ("stream", "slow", "vanish")}
            record: dict[str, Any] = {"kind": kind, "status": None, "outcome": None,
                                      "code": None, "retry_after": None}
            try:
                if not body["stream"]:
                    response = http.post("/v1/completions", json=body,
                                         timeout=0.02 if kind == "cancel" else 30)
                    record["status"] = response.status_code
                    record["retry_after"] = response.headers.get("retry-after")
                    record["outcome"] = "answer"
                    if response.status_code != 200:
                        record["code"] = response.json()["error"]["code"]
                else:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        record["status"] = response.status_code
                        record["retry_after"] = response.headers.get("retry-after")
                        if response.status_code != 200:
                            record["outcome"] = "answer"
                            record["code"] = json.loads(response.read())["error"]["code"]
                        else:
                            events = 0
                            for line in response.iter_lines():
                                if not line:
                                    continue
                                events += 1
                                if line == "data: [DONE]":
                                    record["outcome"] = "done"
                                elif '"error"' in line:
                                    record["outcome"] = "error"
                                    record["code"] = json.loads(line[6:])["error"]["code"]
                                if kind == "slow":
                                    stop.wait(0.02)
                                if kind == "vanish" and events >= 2:
                                    record["outcome"] = "left"
                                    break  # leaving the block closes the connection
                            record["outcome"] = record["outcome"] or "cut"
            except httpx.TimeoutException:
                record["outcome"] = "left"
            out.append(record)
            if record["status"] in (429, 503):
                stop.wait(0.05)


def _poll_ready(url: str, stop: threading.Event, out: list) -> None:
    """``(status, Retry-After, lifecycle in the body or None)`` of /ready, until ``stop``."""
    with httpx.Client(base_url=url, timeout=30) as http:
        while not stop.is_set():
            ready = http.get("/ready")
            out.append((ready.status_code, ready.headers.get("retry-after"),
                        ready.json().get("lifecycle")))
            stop.wait(0.01)


def test_what_the_server_says_under_a_fault_load_is_what_clients_saw(tmp_path):
    """A seeded fault load (one job-level fault at a time, as the chaos soak arms them) with
    six clients of every kind, on ``calexec serve``'s uvicorn configuration. Then:

    * every 429 and 503 (answers and /ready) carried a whole-number ``Retry-After``, and a
      /ready 200 said Ready;
    * every request is counted once: ``calexec_request_success_total`` + ``_failures_total``
      is the number of requests the clients sent; per error code the server counts what the
      clients that stayed saw, plus at most the clients that left (their answer unread); the
      successes are what clients saw plus at most those that left; ``request.cancelled``
      never exceeds the clients that left;
    * once idle, every in-flight, queue, sequence-id, KV and send gauge reads 0, no slot is
      leased or in flight, every sequence id is free, /ready is 200 and a request then gets
      200."""
    executor = chaos_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig(max_sequences=4, max_waiting=4))
    service = app.state.service
    rng = random.Random(44)
    records: list[dict] = []
    readies: list[tuple] = []
    stop = threading.Event()
    faults = 0
    try:
        with ServeLikeServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30) as http:
            threads = [threading.Thread(target=_load_client, args=(server.url, 440 + i, stop,
                                                                   records), daemon=True)
                       for i in range(6)]
            threads.append(threading.Thread(target=_poll_ready, args=(server.url, stop, readies),
                                            daemon=True))
            for thread in threads:
                thread.start()
            try:
                for _ in range(8):  # about 3 s: each fault meets the traffic, then Ready again
                    action = rng.choice(LOAD_FAULTS)
                    _, point, rc = next(f for f in FAULTS if f[0] == action)
                    arm_fault(emu, point, rng, rc)
                    faults += 1
                    stop.wait(rng.uniform(0.15, 0.35))
                    wait_for(lambda: http.get("/ready").status_code == 200, 20,
                             "/ready 200 after the fault")
                    emu.clear_all_faults()
            finally:
                stop.set()
                for thread in threads:
                    thread.join(30)
            assert not any(thread.is_alive() for thread in threads)
            wait_for(lambda: server_idle(service) and service.admission.waiting == 0, 20,
                     "the server idle")
            wait_for(lambda: http.get("/ready").status_code == 200, 20, "/ready 200")
            metrics = http.get("/metrics").text
            after = http.post("/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 3})
        assert after.status_code == 200, after.text
    finally:
        stop.set()
        emu.clear_all_faults()
        executor.shutdown(5.0)

    assert records and faults
    # Retry-After: on every 429/503, a whole number of seconds; /ready's 200 says Ready
    refused = [r for r in records if r["status"] in (429, 503)]
    assert all(r["retry_after"] is not None and r["retry_after"].isdigit() for r in refused), \
        refused
    assert all(ra is not None and ra.isdigit() for code, ra, _ in readies if code == 503)
    assert all(life == "Ready" for code, _, life in readies if code == 200)
    assert {code for code, _, _ in readies} <= {200, 503}

    def count(name: str, **labels: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == name and labels.items() <= s.labels.items())

    left = sum(1 for r in records if r["outcome"] == "left")
    succeeded = sum(1 for r in records if r["status"] == 200 and r["outcome"] in ("answer",
                                                                                   "done"))
    assert all(r["outcome"] != "cut" for r in records), records  # an end or an error event
    assert count("calexec_request_success_total") + count(
        "calexec_request_failures_total") == len(records)
    assert succeeded <= count("calexec_request_success_total") <= succeeded + left
    seen = Counter(r["code"] for r in records if r["code"] and r["outcome"] != "left")
    for code, n in seen.items():
        assert n <= count("calexec_request_failures_total", code=code) <= n + left, code
    assert count("calexec_request_failures_total", code="request.cancelled") <= left
    assert count("calexec_recoveries_total") >= 1
    # idle: nothing leaked
    for name in IDLE_GAUGES:
        assert metric_value(metrics, name) == 0, name
    for state in ("Leased", "InFlight"):
        assert metric_value(metrics, "calexec_buffer_slots", {"state": state}) == 0, state
    assert metric_value(metrics, "calexec_kv_sequences_free") == 4
    assert metric_value(metrics, "calexec_lifecycle_state", {"state": "Ready"}) == 1
