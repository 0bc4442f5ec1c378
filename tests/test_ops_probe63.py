"""Stop 63 (operator): what ``/metrics`` tells an operator that it did not: a device refusing
work as busy, and requests counted in one unit.

Loopback servers only, on the bundled emulator; faults through the emulator's fault points;
every wait bounded; nothing asserts a duration.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import needs  # noqa: E402
from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.drivers.tools.chaos import chaos_executor  # noqa: E402
from test_server_support import ServeLikeServer, chaos_server, server_idle, wait_for  # noqa: E402


def _samples(text: str, name: str, *labels: str) -> dict[tuple[str, ...], float]:
    return {tuple(s.labels[k] for k in labels): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def test_a_busy_infer_the_submitter_retried_is_counted_with_its_raw_code(tmp_path):
    """``infer()`` answering 17 (DEVICE_BUSY) is retried by the submitter after a back-off
    (§8 TRANSIENT) and the request is answered 200: before, nothing in ``/metrics`` moved
    (no fault, no failure), so an operator could not see the device refusing work. It is
    ``calexec_submit_retries_total{raw="17"}``, shown at 0 before the first."""
    with chaos_server(tmp_path) as (emu, service, http):
        before = http.get("/metrics").text
        assert emu.set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 1, 0, 17) == 0
        answer = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                    "timeout": 20})
        emu.clear_all_faults()
        assert answer.status_code == 200, answer.text
        wait_for(lambda: server_idle(service), 20, "the server idle")
        after = http.get("/metrics").text
    assert _samples(before, "calexec_submit_retries_total", "raw") == {("17",): 0.0}
    assert _samples(after, "calexec_submit_retries_total", "raw") == {("17",): 1.0}
    # retried, not a fault nor a failure (one that spent its retries is a fault, raw 17)
    assert _samples(after, "calexec_device_faults_total", "code") == {}
    assert _samples(after, "calexec_request_failures_total", "code") == {}


#: (route, body, HTTP status, outcome in calexec_api_requests_total)
TRAFFIC = [
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2}, 200, "success"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": 2}, 200, "success"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 2, "n": 2}, 200, "success"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "stream": True}, 200, "success"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": 2, "stream": True}, 200,
     "success"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": 2, "temperature": 9}, 400,
     "refused"),
    ("/v1/completions", {"prompt": [1, 2], "max_tokens": 2, "n": 2, "model": "other"}, 404,
     "refused"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2, "n": 2}, 200, "success"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "refused"),
    # the Responses API, on the chat path: counted as chat is (a stream answered whole ends
    # with response.completed, or response.incomplete when max_output_tokens cut it)
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}, 200, "success"),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "stream": True}, 200,
     "success"),
    ("/v1/responses", {"input": "hi", "previous_response_id": "resp_1"}, 400, "refused"),
]
ROUTE = {"/v1/completions": "completions", "/v1/chat/completions": "chat_completions",
         "/v1/responses": "responses"}


def _totals(text: str) -> dict[str, float]:
    """Each per-choice family summed, and ``calexec_api_requests_total`` by route/outcome."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "calexec_api_requests_total":
                key = f"{s.labels['route']}/{s.labels['outcome']}"
            elif s.name in ("calexec_requests_total", "calexec_request_success_total",
                            "calexec_request_failures_total"):
                key = s.name
            else:
                continue
            out[key] = out.get(key, 0.0) + s.value
    return out


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def test_every_completion_request_is_counted_once_by_outcome_whatever_its_choices(tmp_path):
    """``calexec_requests_total``, ``_success_total`` and ``_failures_total`` count admitted
    choices (and a refused request once): a request of ``n`` 2 counts 2, so no series
    counted requests sent, nor a share of them failed. ``calexec_api_requests_total{route,
    outcome}`` counts each HTTP request once (success, refused, failed), and the docs' sum
    holds exactly: success + failures = requests + the refused ones."""
    with chaos_server(tmp_path) as (emu, service, http):
        start = _totals(http.get("/metrics").text)
        # every series shows before its first request, at 0 (a rate() has a start)
        assert {k: v for k, v in start.items() if "/" in k} == {
            f"{r}/{o}": 0.0 for r in ROUTE.values() for o in ("success", "failed",
                                                               "refused", "handed_off")}
        for path, body, status, outcome in TRAFFIC:
            before = _totals(http.get("/metrics").text)
            answer = http.post(path, json=body)
            assert answer.status_code == status, (body, answer.text)
            if body.get("stream"):
                assert answer.text.endswith("data: [DONE]\n\n") or re.search(
                    r"(^|\n\n)event: response\.(completed|incomplete)\ndata: [^\n]*\n\n$",
                    answer.text), answer.text
            wait_for(lambda: server_idle(service), 20, "the server idle")
            moved = _delta(_totals(http.get("/metrics").text), before)
            assert moved.pop(f"{ROUTE[path]}/{outcome}") == 1, (body, moved)
            assert not [k for k in moved if "/" in k], (body, moved)
            assert (moved.get("calexec_request_success_total", 0)
                    + moved.get("calexec_request_failures_total", 0)
                    == moved.get("calexec_requests_total", 0)
                    + (outcome == "refused")), (body, moved)
        # an admitted request of 2 choices whose choice fails: failed, once
        before = _totals(http.get("/metrics").text)
        assert emu.set_fault(Fault.UNKNOWN_CSR, FaultMode.NTH, 1, 0, 0) == 0
        failed = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2,
                                                    "n": 2})
        emu.clear_all_faults()
        assert failed.status_code == 500, failed.text
        wait_for(lambda: server_idle(service), 20, "the server idle")
        moved = _delta(_totals(http.get("/metrics").text), before)
        assert moved.pop("completions/failed") == 1, moved
        assert not [k for k in moved if "/" in k], moved
        assert moved["calexec_request_failures_total"] == moved["calexec_requests_total"]
        # another method (a CORS preflight's OPTIONS, a GET: 405) asks for no completion
        before = _totals(http.get("/metrics").text)
        assert http.get("/v1/completions").status_code == 405
        assert http.options("/v1/chat/completions").status_code == 405
        assert _delta(_totals(http.get("/metrics").text), before) == {}
        end = _totals(http.get("/metrics").text)
    sent = len(TRAFFIC) + 1
    assert sum(v for k, v in end.items() if "/" in k) == sent
    refused = sum(v for k, v in end.items() if k.endswith("/refused"))
    assert (end["calexec_request_success_total"] + end["calexec_request_failures_total"]
            == end["calexec_requests_total"] + refused)


OPERATIONS = Path(__file__).resolve().parents[1] / "docs" / "operations.md"
#: the families the docs' queries read (their series go to promtool)
QUERIED = ("calexec_api_requests_total", "calexec_request_failures_total",
           "calexec_submit_retries_total", "calexec_requests_total",
           "calexec_request_success_total", "calexec_device_faults_total")
#: the docs' alert on device faults, and the plain form it replaces (checked to miss a kind's
#: first fault: the series appears with it, so increase() sees nothing rise)
FAULT_ALERT = ("sum by (code) (increase(calexec_device_faults_total[10m])) > 0 or "
               "sum by (code) (calexec_device_faults_total unless calexec_device_faults_total "
               "offset 10m)")
PLAIN_ALERT = "sum by (code) (increase(calexec_device_faults_total[10m])) > 0"
STEPS = 10  # samples a minute apart, from the idle scrape's values to the last scrape's


def _doc_queries() -> list[str]:
    block = re.search(r"^```promql\n(.*?)^```", OPERATIONS.read_text(), re.M | re.S)
    assert block is not None, "docs/operations.md has no promql block"
    return [line for line in block.group(1).splitlines()
            if line.strip() and not line.startswith("#")]


def _series(text: str) -> dict[str, float]:
    """``name{labels}`` (PromQL selector syntax) -> value, of the ``QUERIED`` families."""
    return {s.name + "{" + ",".join(f"{k}={json.dumps(v)}" for k, v in sorted(s.labels.items()))
            + "}": s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name in QUERIED}


def test_the_dashboard_queries_of_the_docs_give_what_the_clients_saw(tmp_path):
    """Each query of docs/operations.md's ``promql`` block, evaluated by ``promtool test
    rules`` on the series a server exported (ramped a minute apart, from an idle scrape to
    one after the traffic), gives what the clients saw: requests by outcome, the share not
    answered whole, the choices failed after admission, the busy answers retried, and the
    alert on a device fault fires for the first fault of its kind. A series the idle scrape
    lacks ramps from 0 (a long-running server's exists by then), except the faults': a kind's
    series appears at its first fault (absent, then there), as a scrape sees it."""
    promtool = needs.tool("promtool")
    seen = {"success": 0, "refused": 0, "failed": 0, "handed_off": 0}  # (no fleet here)
    with chaos_server(tmp_path) as (emu, service, http):
        idle = http.get("/metrics").text
        for path, body, status, outcome in TRAFFIC:
            assert http.post(path, json=body).status_code == status, body
            seen[outcome] += 1
        assert emu.set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 1, 0, 17) == 0
        assert http.post("/v1/completions", json={"prompt": [3], "max_tokens": 2}
                         ).status_code == 200
        seen["success"] += 1
        assert emu.set_fault(Fault.UNKNOWN_CSR, FaultMode.NTH, 1, 0, 0) == 0
        assert http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2,
                                                  "n": 2}).status_code == 500
        emu.clear_all_faults()
        seen["failed"] += 1
        wait_for(lambda: server_idle(service), 20, "the server idle")
        last = http.get("/metrics").text
    before, after = _series(idle), _series(last)
    seconds = STEPS * 60

    def moved(name: str) -> float:
        return sum(after[k] - before.get(k, 0.0) for k in after if k.startswith(name + "{"))
    # admitted choices that failed: every admitted choice ends once, in success or failures
    failed_choices = moved("calexec_requests_total") - moved("calexec_request_success_total")
    faults = {s.labels["code"]: s.value for f in text_string_to_metric_families(last)
              for s in f.samples if s.name == "calexec_device_faults_total"}
    assert faults and not [k for k in before if k.startswith("calexec_device_faults_total")]
    expected = {  # query -> [(labels, value)] at the last step, scaled by 1e6 and rounded
        "sum by (outcome) (rate(calexec_api_requests_total[5m]))":
            [(f'{{outcome="{o}"}}', round(1e6 * n / seconds)) for o, n in seen.items()],
        'sum(rate(calexec_api_requests_total{outcome!~"success|handed_off"}[5m])) / '
        'sum(rate(calexec_api_requests_total{outcome!="handed_off"}[5m]))':
            [("{}", round(1e6 * (seen["refused"] + seen["failed"]) / sum(seen.values())))],
        "sum(rate(calexec_request_failures_total[5m])) - "
        'sum(rate(calexec_api_requests_total{outcome="refused"}[5m]))':
            [("{}", round(1e6 * failed_choices / seconds))],
        "sum(rate(calexec_submit_retries_total[5m]))": [("{}", round(1e6 * 1 / seconds))],
        FAULT_ALERT: [(f'{{code="{code}"}}', round(1e6 * n)) for code, n in faults.items()],
    }
    assert failed_choices >= 1
    assert sorted(_doc_queries()) == sorted(expected), "a documented query is unchecked"
    half = STEPS // 2
    series = [{"series": name, "values": f"_x{half} {value!r}x{STEPS - half}"}
              if name.startswith("calexec_device_faults_total") else
              {"series": name, "values": f"{before.get(name, 0.0)!r}+"
               f"{(value - before.get(name, 0.0)) / STEPS!r}x{STEPS}"}
              for name, value in after.items()]
    checks = {**expected, PLAIN_ALERT: []}
    tests = [{"interval": "1m", "input_series": series, "promql_expr_test": [
        {"expr": f"round(1e6 * ({query}))", "eval_time": f"{STEPS}m",
         "exp_samples": [{"labels": labels, "value": value} for labels, value in samples]}
        for query, samples in checks.items()]}]
    spec = tmp_path / "dashboard_test.yml"
    spec.write_text(json.dumps({"rule_files": [], "evaluation_interval": "1m",
                                "tests": tests}))  # (JSON is YAML)
    check = subprocess.run([promtool, "test", "rules", str(spec)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_end_of_a_fault_recovery_is_logged_with_its_generation(tmp_path, caplog):
    """A fault's WARNING line says a recovery begins (``-> reset_rebuild``); its end wrote
    nothing (a model switch's end has the admin's line), so the log of a recovered device
    never said when, in what state, or at which generation it served again. One line now:
    ``recovery after <code> done: generation 1 -> 2, lifecycle Ready, reset=KIND, <s>s``."""
    executor = chaos_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    try:
        with caplog.at_level(logging.INFO, logger="calexec"), ServeLikeServer(app) as server, \
                httpx.Client(base_url=server.url, timeout=30) as http:
            assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
            answer = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                        "timeout": 20})
            emu.clear_all_faults()
            assert answer.status_code == 200, answer.text  # resumed on generation 2
            wait_for(lambda: http.get("/ready").status_code == 200, 20, "/ready 200")
            wait_for(lambda: any(r.getMessage().startswith("recovery after")
                                 for r in caplog.records), 20, "the recovery's line")
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)
    ends = [r for r in caplog.records if r.getMessage().startswith("recovery after")]
    assert len(ends) == 1, [r.getMessage() for r in ends]
    assert ends[0].levelno == logging.INFO
    assert re.fullmatch(r"recovery after device\.ccu_exception done: generation 1 -> 2, "
                        r"lifecycle Ready, reset=\w+, \d+\.\d{3}s", ends[0].getMessage()), (
        ends[0].getMessage())
