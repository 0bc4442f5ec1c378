"""An operator running ``calexec serve`` by docs/operations.md and docs/server.md word for word
(stop 63, second pass):

- the WARNING line of a drain's cut and of a forced exit counted the requests it cut but named
  none: without ``--dump-dir`` a client's report (its ``x-request-id``) could not be matched to
  the cut. The line names the first ``CUT_IDS_LOGGED`` ids and counts the rest.

The ``serve`` cases run ``calexec serve`` in a child process on loopback, bounded, killed at the
end (tests/test_ops_sweep.py's helpers).
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from calexec.contracts.manifest import default_manifest_path
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.serving.service import CUT_IDS_LOGGED
from test_ops_sweep import (
    killed,
    serve_process,
    stopped,
    stream_cut_at_a_stop,
    stream_in_thread,
)
from test_server_handoff import through_ingress
from test_server_support import metric_value, server_idle, started_executor, wait_for


def test_a_drains_cut_names_the_request_ids_it_cut(tmp_path):
    code, err, _ = stream_cut_at_a_stop(tmp_path, forced=False,
                                        request_id="client-report-17")  # past the grace
    assert code == 0, err
    assert ("drain: grace 0.5s over, 1 request(s) still running are cut "
            "(x-request-id: client-report-17)") in err, err


def test_a_forced_exit_names_the_request_ids_it_cut(tmp_path):
    code, err, _ = stream_cut_at_a_stop(tmp_path, forced=True, request_id="client-report-18")
    assert code == 3, err
    assert ("signal SIGINT again: forced exit, 1 request(s) cut "
            "(x-request-id: client-report-18)") in err, err


def test_a_cut_of_many_requests_names_the_first_ids_and_counts_the_rest(tmp_path):
    """A bounded line: the first ``CUT_IDS_LOGGED`` ids in admission order, then ``and M more``."""
    total = CUT_IDS_LOGGED + 2
    proc, url = serve_process(tmp_path, "--grace", "1", "--device-config", "decode_us=20000")
    workers = []
    try:
        for k in range(total):  # one at a time: admitted in this order
            worker, first, _ = stream_in_thread(url, 1000, f"many-{k}")
            assert first.wait(10)
            workers.append(worker)
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
        for worker in workers:
            worker.join(10)
    finally:
        killed(proc)
    named = ", ".join(f"many-{k}" for k in range(CUT_IDS_LOGGED))
    assert (f"drain: grace 1s over, {total} request(s) still running are cut "
            f"(x-request-id: {named} and 2 more)") in err, err


def test_a_bug_in_a_route_that_is_no_completion_is_answered_and_logged_not_counted(
        tmp_path, monkeypatch):
    """One rule for ``calexec_request_failures_total``: completion, chat and Responses requests
    only. A bug (500) in ``/v1/models`` was counted there while that route's refusals are
    not (docs/server.md), which made the documented identity ``success + failures =
    requests + api_requests{refused}`` false; a completion's bug stays counted."""
    from calexec.drivers.serving import openai_api

    def broken(request, api_key):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_api, "auth_refusal", broken)
    executor = started_executor(tmp_path)
    try:
        with TestClient(create_app(executor, ServerConfig()),
                        raise_server_exceptions=False) as client:
            before = unexpected(client)
            r = client.get("/v1/models")
            assert (r.status_code, r.json()["error"]["code"]) == (500, "server.unexpected_error")
            after_models = unexpected(client)
            assert client.post("/v1/completions",
                               json={"prompt": [1, 2], "max_tokens": 1}).status_code == 500
            after_completion = unexpected(client)
            text = client.get("/metrics").text
    finally:
        executor.shutdown(5.0)
    assert after_models == before  # answered (and logged), not counted
    assert after_completion == before + 1
    # docs/operations.md "Metrics": success + failures = requests + api_requests{refused}
    refused = sum(metric_value(text, "calexec_api_requests_total",
                               {"route": route, "outcome": "refused"}) or 0.0
                  for route in ("completions", "chat_completions", "responses"))
    assert (family_sum(text, "calexec_request_success_total")
            + family_sum(text, "calexec_request_failures_total")
            == family_sum(text, "calexec_requests_total") + refused)


def unexpected(client) -> float:
    return metric_value(client.get("/metrics").text, "calexec_request_failures_total",
                        {"code": "server.unexpected_error"}) or 0.0


def family_sum(text: str, name: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


def api_outcomes(text: str) -> dict[str, float]:
    """``calexec_api_requests_total`` summed over its routes, by outcome."""
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "calexec_api_requests_total":
                outcome = sample.labels["outcome"]
                got[outcome] = got.get(outcome, 0.0) + sample.value
    return got


@pytest.mark.parametrize("stream", [True, False])
def test_a_request_handed_to_a_sibling_is_counted_handed_off_not_failed(tmp_path, stream):
    """Under the fleet a draining replica hands a request to a sibling (drivers/serving/
    handoff.py): the first replica counted it ``failed`` in ``calexec_api_requests_total``
    and its choice in ``calexec_request_failures_total`` (``lifecycle.unavailable``), the
    sibling ``success``: a sum over the replicas counted one request answered whole as two, one
    failed. No Ray: the real app reached as a replica is (``serve_relayed``) behind the real
    fleet ingress, one app as both replicas (tests/test_server_handoff.py's harness)."""
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig())
        with TestClient(app) as client:
            before = client.get("/metrics").text
            body = {"prompt": [5, 6, 7], "max_tokens": 8, "stream": stream, "seed": 1}
            _, start, calls = through_ingress(app, "/v1/completions", body,
                                              cut=3 if stream else 0, drain=True)
            assert start["status"] == 200 and len(calls) == 2
            wait_for(lambda: server_idle(app.state.service), 20, "the server idle")
            after = client.get("/metrics").text
    finally:
        executor.shutdown(5.0)
    moved = {k: v - api_outcomes(before).get(k, 0.0) for k, v in api_outcomes(after).items()}
    assert moved == {"success": 1.0, "failed": 0.0, "refused": 0.0, "handed_off": 1.0}
    failed = (family_sum(after, "calexec_request_failures_total")
              - family_sum(before, "calexec_request_failures_total"))
    assert failed == 0.0
    # every admitted choice ends once: in success, failures or (per replica) handed off
    admitted = (family_sum(after, "calexec_requests_total")
                - family_sum(before, "calexec_requests_total"))
    succeeded = (family_sum(after, "calexec_request_success_total")
                 - family_sum(before, "calexec_request_success_total"))
    assert admitted == succeeded + moved["handed_off"] == 2.0


def calexec(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "calexec", *args], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


def test_a_golden_recorded_while_serving_lets_the_next_reload_switch(tmp_path):
    """The procedure docs/server.md gives a refused switch, word for word: the 500
    ``recovery.rolled_back`` says ``run `calexec golden record --calbin PATH``; done, the
    same reload was refused again (the goldens file was read once, at start: only a restart,
    a drain of everything, took the pin), and with ``serve --manifest M`` the command it gave
    pinned into the packaged manifest's file, which the server does not read. The refusal
    names ``--manifest M``, and the next reload reads the goldens file again."""
    for name in ("qwen3_synthetic.toml", "qwen3_synthetic.goldens.toml"):
        shutil.copy(default_manifest_path().with_name(name), tmp_path / name)
    manifest = tmp_path / "qwen3_synthetic.toml"
    assert calexec(tmp_path, "sim", "write-calbin", "--seed", "7", "m7.calbin").returncode == 0
    calbin = str(tmp_path / "m7.calbin")
    (tmp_path / "admin").write_text("t0k")
    (tmp_path / "admin").chmod(0o600)
    proc, url = serve_process(tmp_path, "--manifest", str(manifest), "--admin-token-file",
                              str(tmp_path / "admin"))
    try:
        def reload() -> httpx.Response:
            return httpx.post(f"{url}/admin/reload", json={"calbin": calbin}, timeout=60,
                              headers={"Authorization": "Bearer t0k"})
        refused = reload()
        assert refused.status_code == 500, refused.text
        message = refused.json()["error"]["message"]
        advice = f"run `calexec golden record --calbin {calbin} --manifest {manifest}`"
        assert advice in message, message
        recorded = calexec(tmp_path, "golden", "record", "--calbin", calbin, "--manifest",
                           str(manifest))
        assert recorded.returncode == 0, recorded.stderr
        switched = reload()
        ready = httpx.get(f"{url}/ready", timeout=10)
    finally:
        killed(proc)
    assert switched.status_code == 200, switched.text
    assert switched.json()["calbin"] == calbin and ready.status_code == 200


def test_a_switch_refuses_a_goldens_file_that_no_longer_loads_and_moves_nothing(tmp_path):
    """The re-read goldens file (above) broken meanwhile: the switch is refused before the
    lifecycle moves, naming the file; the model serving goes on."""
    from calexec.contracts.manifest import load_manifest
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.drivers.synthetic import calbin
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig

    for name in ("qwen3_synthetic.toml", "qwen3_synthetic.goldens.toml"):
        shutil.copy(default_manifest_path().with_name(name), tmp_path / name)
    path = str(tmp_path / "synthetic.calbin")
    calbin.write(path, calbin.default_spec())
    executor = DeviceExecutor(CalRT.load(), load_manifest(tmp_path / "qwen3_synthetic.toml"),
                              ExecutorConfig(calbin_path=path))
    try:
        assert executor.start().ok
        generation = executor.gen.id
        (tmp_path / "qwen3_synthetic.goldens.toml").write_text("format = [")
        status = executor.switch_model(path)
        assert (status.code, executor.state, executor.gen.id) == ("golden.file_invalid", "Ready",
                                                                   generation)
        assert "qwen3_synthetic.goldens.toml" in status.message and "<toml>" in status.message
    finally:
        executor.shutdown(5.0)
