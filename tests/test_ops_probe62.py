"""Stop 62 (operator): what /metrics tells an operator about the faults a server absorbed.

Loopback servers only, on the bundled emulator; faults through the emulator's fault points;
every wait bounded; nothing asserts a duration.
"""

from __future__ import annotations

import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from test_server_support import chaos_server, server_idle, wait_for  # noqa: E402

#: (emulator fault point, rc, the fault's code, its raw CalRT code in the label)
KINDS = [("CCU_EXCEPTION", 0, "device.ccu_exception", "none"),
         ("OUTPUT_NAN", 0, "internal.output_not_finite", "none"),
         ("OUTPUT_INF", 0, "internal.output_not_finite", "none"),
         ("OUTPUT_SHORT", 0, "internal.output_short", "none"),
         ("HANG", 0, "execution.deadline", "13"),
         ("SUBMIT_RC", 18, "calrt.submit_failed", "18")]


def _samples(text: str, name: str) -> dict[tuple[str, str], float]:
    return {(s.labels["code"], s.labels["raw"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


@pytest.mark.parametrize("point,rc,code,raw", KINDS, ids=[f"{k[0]}-{k[1]}" for k in KINDS])
def test_a_fault_its_request_survived_is_counted_by_kind(tmp_path, point, rc, code, raw):
    """Each fault kind met by a request the server then answers 200 (resumed after the
    recovery) is counted in ``calexec_device_faults_total`` by its code and
    raw CalRT code, and not in ``calexec_request_failures_total`` (no request failed). Before,
    nothing in /metrics counted it: an operator saw faults only in the log, or those that
    failed a request."""
    with chaos_server(tmp_path) as (emu, service, http):
        before = _samples(http.get("/metrics").text, "calexec_device_faults_total")
        assert emu.set_fault(Fault[point], FaultMode.NTH, 1, 0, rc) == 0
        answer = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4,
                                                    "timeout": 20})
        emu.clear_all_faults()
        assert answer.status_code == 200, answer.text
        wait_for(lambda: http.get("/ready").status_code == 200, 20, "/ready 200")
        wait_for(lambda: server_idle(service), 20, "the server idle")
        metrics = http.get("/metrics").text
    faults = _samples(metrics, "calexec_device_faults_total")
    assert before == {}, before
    assert faults.get((code, raw), 0) >= 1, faults
    assert _samples(metrics, "calexec_request_failures_total") == {}


def _counts(http: httpx.Client) -> tuple[float, float]:
    """``(calexec_requests_total, success + failures)``."""
    text = http.get("/metrics").text

    def total(name: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name == name)
    return total("calexec_requests_total"), total("calexec_request_success_total") + total(
        "calexec_request_failures_total")


def test_success_and_failures_count_admitted_choices_and_refused_requests(tmp_path):
    """docs/server.md's unit of the request counters, which said every request ends counted
    once (a dashboard summing them as requests sent over-counted requests of several
    choices): an admitted choice is counted once, a request refused before admission once
    whatever its ``n``; so success + failures rises by what ``calexec_requests_total`` rises
    by, plus one for a refusal."""
    bodies = [({"prompt": [1, 2], "max_tokens": 2}, 200, 1, 1),
              ({"prompt": [1, 2], "max_tokens": 2, "n": 2}, 200, 2, 2),
              ({"prompt": [[1, 2], [3, 4]], "max_tokens": 2, "n": 2}, 200, 4, 4),
              ({"prompt": [1, 2], "max_tokens": 2, "n": 2, "temperature": 9}, 400, 0, 1),
              ({"prompt": [1, 2], "max_tokens": 2, "n": 2, "model": "other"}, 404, 0, 1)]
    with chaos_server(tmp_path) as (emu, service, http):
        for body, status, admitted, counted in bodies:
            before = _counts(http)
            answer = http.post("/v1/completions", json=body)
            assert answer.status_code == status, answer.text
            wait_for(lambda: server_idle(service), 20, "the server idle")
            after = _counts(http)
            assert (after[0] - before[0], after[1] - before[1]) == (admitted, counted), body
        # a request of 2 choices whose choice fails: each admitted choice counted once
        before = _counts(http)
        assert emu.set_fault(Fault.UNKNOWN_CSR, FaultMode.NTH, 1, 0, 0) == 0
        failed = http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2,
                                                    "n": 2})
        emu.clear_all_faults()
        assert failed.status_code == 500, failed.text
        wait_for(lambda: server_idle(service), 20, "the server idle")
        after = _counts(http)
        assert after[1] - before[1] == after[0] - before[0] >= 1
