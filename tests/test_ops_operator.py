"""What an operator deploying ``calexec serve`` relies on (stop 46): its signals and exit codes,
its log, the admin API's refusals.

- SIGHUP (a closed terminal, ``kill -HUP``) drains as SIGTERM does: it ended the process at
  once, the stream in flight cut, nothing logged, exit by the signal;
- a drain whose grace runs out with requests still running logs how many it cut (nothing was
  logged) and their error event no longer blames a "recovery or model switch";
- a forced exit (a second signal) writes its one WARNING line and no traceback (uvicorn logged
  a ``CancelledError`` traceback per cut request and one for the lifespan);
- the admin API names a body of the wrong JSON type by its JSON name (``array``, ``null``), not
  by Python's (``list``, ``NoneType``).

The ``serve`` cases run ``calexec serve`` in a child process on loopback, bounded, killed at the
end (tests/test_ops_sweep.py's helpers).
"""

from __future__ import annotations

import json
import signal
import threading

import httpx
import pytest

from test_ops_sweep import (
    killed,
    serve_process,
    stopped,
    stream_cut_at_a_stop,
    stream_in_thread,
)
from test_server_support import started_executor, wait_for

TOKEN = "op-token"


def test_sighup_drains_as_sigterm_does_and_exits_0(tmp_path):
    proc, url = serve_process(tmp_path, "--log-level", "info", "--grace", "30",
                              "--device-config", "decode_us=20000")
    try:
        worker, first, lines = stream_in_thread(url, 30)
        assert first.wait(10)
        proc.send_signal(signal.SIGHUP)
        wait_for(lambda: httpx.get(f"{url}/ready", timeout=2).status_code == 503,
                 what="/ready to report draining")
        code, err = stopped(proc)
        worker.join(10)
    finally:
        killed(proc)
    assert b"data: [DONE]" in lines  # the stream in flight finished
    assert code == 0, err
    assert "signal SIGHUP: draining" in err


def test_a_drain_whose_grace_runs_out_says_what_it_cut(tmp_path):
    """The exit stays 0 when the executor drained (issue 24's decision, pinned by
    tests/test_server_stalled.py: a client that never reads must not fail every stop); the
    requests the grace cut are one WARNING line, and the stream's error event says the drain
    ended it, not a "recovery or model switch". Before: nothing was logged at all."""
    code, err, lines = stream_cut_at_a_stop(tmp_path, forced=False)  # past the grace
    assert b"data: [DONE]" not in lines  # cut...
    assert code == 0, err  # ...the executor drained
    assert "drain: grace 0.5s over, 1 request(s) still running are cut" in err
    errors = [line for line in lines if line.startswith(b'data: {"error"')]
    assert len(errors) == 1 and b"recovery or model switch" not in errors[0], lines[-2:]


def test_a_forced_exit_logs_its_line_and_no_traceback(tmp_path):
    code, err, _ = stream_cut_at_a_stop(tmp_path, forced=True)
    assert code == 3, err
    assert "signal SIGINT again: forced exit, 1 request(s) cut" in err
    assert "Traceback" not in err and "CancelledError" not in err, err


@pytest.mark.parametrize(("body", "named"), [("[1]", "array"), ("null", "null"),
                                             ('"x"', "string"), ("5", "number"),
                                             ("true", "boolean")])
def test_an_admin_body_of_the_wrong_json_type_is_named_by_its_json_name(tmp_path, body, named):
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        with TestClient(app) as client:
            r = client.post("/admin/reload", content=body,
                            headers={"Authorization": f"Bearer {TOKEN}",
                                     "content-type": "application/json"})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["message"] == f'body: must be a JSON object {{"calbin": PATH}}, not {named}'
    assert error["param"] is None


def test_an_unexpected_error_is_logged_with_the_request_id_its_client_got(tmp_path, monkeypatch,
                                                                         caplog):
    """The 500 ``server.unexpected_error`` answers an ``x-request-id``; the log's traceback
    carried no request id, so an operator handed that id by a client could not find it."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving import openai_api
    from calexec.drivers.serving.server import ServerConfig, create_app

    def broken(model, raw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_api, "parse", broken)
    executor = started_executor(tmp_path)
    try:
        app = create_app(executor, ServerConfig())
        with caplog.at_level("ERROR", logger="calexec.server"), \
                TestClient(app, raise_server_exceptions=False) as client:
            r = client.post("/v1/completions", json={"prompt": "a secret prompt", "max_tokens": 1},
                            headers={"X-Request-Id": "report-42"})
    finally:
        executor.shutdown(5.0)
    assert r.status_code == 500 and r.headers["x-request-id"] == "report-42"
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "calexec.server"]
    assert lines == ["request report-42: POST /v1/completions: unexpected RuntimeError "
                     "(traceback below)"], lines
    assert not [line for line in caplog.messages if "secret prompt" in line]


def test_the_listening_line_comes_once_the_server_answers(tmp_path):
    """``listening on http://...`` was logged before the executor's start (warm-up, golden):
    a probe of that address was then refused for the whole start. It comes once the socket
    listens; before the start a ``bound ...`` line says connections are refused until then."""
    import os
    import subprocess
    import sys

    from test_server_support import free_port

    port = free_port()
    scratch = tmp_path / "tmp"  # the server's temp dir, where its start's scratch goes
    scratch.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "calexec", "serve", "--port", str(port),
                             "--log-level", "info"], stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path, env={**os.environ, "TMPDIR": str(scratch)})
    lines: list[str] = []
    watchdog = threading.Timer(30.0, proc.kill)  # bounds the read below
    watchdog.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "listening on" in line or len(lines) > 50:
                break
        watchdog.cancel()
        ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
        # stopped as an operator stops it: a SIGKILL here left the start's scratch directory
        # (``calexec-serve-*``, the synthetic calbin) in the temp dir on every run
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
    finally:
        watchdog.cancel()
        killed(proc)
    assert code == 0, err
    assert not list(scratch.glob("calexec-serve-*")), "the start's scratch directory was left"
    bound = [i for i, line in enumerate(lines) if "bound http://127.0.0.1:" in line]
    assert bound and "connections are refused until it serves" in lines[bound[0]], lines
    assert f"listening on http://127.0.0.1:{port}" in lines[-1], lines
    assert ready.status_code == 200, ready.text
    # one format for the whole log, uvicorn's lines included (they were ``INFO:     ...``)
    import re
    assert any("uvicorn" in line for line in lines), lines
    odd = [line for line in lines if not re.match(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                                                    r"[\w.]+: \S", line)]
    assert not odd, odd


def test_admin_drains_and_switches_are_logged(tmp_path, caplog):
    """A drain by ``POST /admin/drain`` and a model switch left no line in the log (a signal's
    drain did): the log showed uvicorn's ``Shutting down`` with no cause, a new generation
    with none. Each is one line naming the request's id; a switch that fails says so."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.synthetic import calbin as cb
    from test_server_support import oracle_tokens

    executor = started_executor(tmp_path)
    seed = cb.DEFAULT_SEED ^ 0x77
    other = tmp_path / "other.calbin"
    sha = cb.write(str(other), cb.default_spec(seed=seed))
    executor.goldens[sha] = tuple(oracle_tokens(list(executor.config.golden_tokens),
                                                executor.config.golden_decode_steps + 1, seed))
    unpinned = tmp_path / "unpinned.calbin"  # a calbin whose golden nobody pinned
    cb.write(str(unpinned), cb.default_spec(seed=seed ^ 0x11))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        app = create_app(executor, ServerConfig(admin_token=TOKEN))
        with caplog.at_level("INFO", logger="calexec.admin"), TestClient(app) as client:
            ok = client.post("/admin/reload", json={"calbin": str(other)},
                             headers={**auth, "X-Request-Id": "sw-1"})
            bad = client.post("/admin/reload", json={"calbin": str(unpinned)}, headers=auth)
            drain = client.post("/admin/drain", params={"grace": 5},
                                headers={**auth, "X-Request-Id": "dr-1"})
            wait_for(lambda: app.state.service.drain_status is not None, what="the drain")
    finally:
        executor.shutdown(5.0)
    assert (ok.status_code, bad.status_code, drain.status_code) == (200, 500, 202)
    lines = [r.getMessage() for r in caplog.records if r.name == "calexec.admin"]
    assert lines[0] == f"admin: switching to calbin {json.dumps(str(other))}, x-request-id sw-1", lines
    assert lines[1] == f"admin: calbin {json.dumps(str(other))} serves, generation 2", lines
    assert lines[3].startswith(f"admin: switch to calbin {json.dumps(str(unpinned))} failed, lifecycle Ready")
    assert lines[4] == "admin: draining (grace 5s), x-request-id dr-1", lines
    assert len(lines) == 5, lines


def scrape_checked(http: httpx.Client, seen: dict[tuple, float]) -> str:
    """``/metrics`` parsed by prometheus_client's parser, held to what a monitoring stack
    relies on: HELP and TYPE for every family, no NaN, cumulative histogram buckets, no
    counter (or histogram count/sum/bucket) below its value at an earlier scrape (``seen``,
    updated), label values from closed sets (no request id, prompt or client-sent text)."""
    import math
    import re

    from prometheus_client.parser import text_string_to_metric_families

    text = http.get("/metrics").text
    helps = set(re.findall(r"^# HELP (\S+)", text, re.M))
    types = set(re.findall(r"^# TYPE (\S+)", text, re.M))
    assert helps == types and types, sorted(types ^ helps)
    for family in text_string_to_metric_families(text):
        buckets: dict[tuple, list[tuple[float, float]]] = {}
        for sample in family.samples:
            assert not math.isnan(sample.value), sample
            for value in sample.labels.values():
                assert "secret" not in value and not re.fullmatch(r"[0-9a-f]{32}", value), sample
            key = (sample.name, tuple(sorted(sample.labels.items())))
            monotone = family.type in ("counter", "histogram") and not sample.name.endswith(
                "_created")
            if monotone:
                assert sample.value >= seen.get(key, 0.0), (key, seen.get(key), sample.value)
                seen[key] = sample.value
            if sample.name.endswith("_bucket"):
                rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
                buckets.setdefault(rest, []).append((float(sample.labels["le"]), sample.value))
        for series in buckets.values():
            counts = [count for _, count in sorted(series)]
            assert counts == sorted(counts), (family.name, series)
    return text


def test_metrics_and_probes_through_the_lifecycle(tmp_path):
    """docs/operations.md's probe table and metric promises, on a loopback server: serving,
    under load (streamed and not), a model switch, a recovery (an injected CCU exception:
    generation + 1), a drain."""
    from calexec.drivers.calrt.runtime import Fault, FaultMode
    from calexec.drivers.serving.server import ServerConfig, create_app
    from calexec.drivers.synthetic import calbin as cb
    from test_server_support import LiveServer, metric_value, oracle_tokens

    executor = started_executor(tmp_path, "decode_us=2000")
    seed = cb.DEFAULT_SEED ^ 0x77
    other = tmp_path / "other.calbin"
    sha = cb.write(str(other), cb.default_spec(seed=seed))
    executor.goldens[sha] = tuple(oracle_tokens(list(executor.config.golden_tokens),
                                                executor.config.golden_decode_steps + 1, seed))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    seen: dict[tuple, float] = {}
    app = create_app(executor, ServerConfig(admin_token=TOKEN, metrics_names="vllm"))
    service = app.state.service

    def load(url: str) -> list[int]:
        codes: list[int] = []

        def one(i: int) -> None:
            body = {"prompt": f"secret prompt {i}", "max_tokens": 12, "stream": i % 2 == 0}
            with httpx.Client(base_url=url, timeout=30) as client:
                r = client.post("/v1/completions", json=body,
                                headers={"X-Request-Id": f"{i:032x}"})
                codes.append(r.status_code)
        workers = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for worker in workers:
            worker.start()
        scrape_checked(http, seen)  # while they run
        for worker in workers:
            worker.join(30)
        return codes

    def probes() -> tuple[int, int]:
        return http.get("/ready").status_code, http.get("/health").status_code
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            scrape_checked(http, seen)
            assert probes() == (200, 200)
            assert load(server.url) == [200] * 4
            r = http.post("/admin/reload", json={"calbin": str(other)}, headers=auth)
            assert r.status_code == 200 and r.json()["generation"] == 2, r.text
            scrape_checked(http, seen)
            assert probes() == (200, 200)
            assert executor.device.emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 1, 0, 0) == 0
            assert load(server.url) == [200] * 4  # the faulted one resumed
            wait_for(lambda: probes() == (200, 200) and executor.gen.id == 3,
                     what="Ready at generation 3")
            text = scrape_checked(http, seen)
            # the fault's recovery, not the switch: an alert on recoveries pages for faults
            assert metric_value(text, "calexec_recoveries_total") == 1
            assert metric_value(text, "calexec_model_switches_total", {"outcome": "ok"}) == 1
            assert metric_value(text, "calexec_generation") == 3
            r = http.post("/admin/drain", params={"grace": 5}, headers=auth)
            assert r.status_code == 202
            ready = http.get("/ready")
            assert (ready.status_code, ready.headers["retry-after"]) == (503, "1")
            assert http.get("/health").status_code == 200
            wait_for(lambda: service.drain_status is not None, what="the drain")
            text = scrape_checked(http, seen)
            assert metric_value(text, "calexec_server_draining") == 1
            assert metric_value(text, "calexec_lifecycle_state", {"state": "Stopped"}) == 1
            assert probes() == (503, 200)
    finally:
        executor.shutdown(5.0)


def test_a_signal_after_an_admin_drain_is_the_first_one_not_a_forced_exit(tmp_path):
    """A preStop hook that drains by ``POST /admin/drain`` returns at once, then Kubernetes
    sends SIGTERM: that signal was taken as the second one, a forced exit cutting the
    requests the drain was finishing (exit 3). It is the first: the drain goes on (its own
    grace), the stream ends whole, exit 0; a second signal still forces."""
    token = tmp_path / "admin-token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    proc, url = serve_process(tmp_path, "--log-level", "info", "--grace", "30",
                              "--admin-token-file", str(token),
                              "--device-config", "decode_us=20000")
    try:
        worker, first, lines = stream_in_thread(url, 40)
        assert first.wait(10)
        r = httpx.post(f"{url}/admin/drain", params={"grace": 30}, timeout=5,
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 202, r.text
        proc.send_signal(signal.SIGTERM)
        code, err = stopped(proc)
        worker.join(10)
    finally:
        killed(proc)
    assert b"data: [DONE]" in lines, lines[-2:]  # the drain finished it
    assert code == 0, err
    assert "signal SIGTERM: already draining (grace 30s)" in err and "forced" not in err, err


def test_the_systemd_unit_of_operations_md_waits_for_the_drain_and_never_restarts_a_usage_error(
        tmp_path):
    """docs/operations.md's systemd unit: its ``ExecStart`` names ``calexec serve`` flags,
    its stop waits longer than the drain's ``--grace`` (systemd sends SIGKILL when
    ``TimeoutStopSec`` runs out), it restarts a failure and not exit 2 (a configuration the
    same flags refuse again); ``systemd-analyze verify`` takes it where systemd is installed."""
    import re
    import shlex
    import shutil
    import subprocess
    from pathlib import Path

    from calexec.serve import EXIT_USAGE
    from test_docs_commands import help_text

    text = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text(
        encoding="utf-8")
    [unit] = re.findall(r"^```ini\n(.*?)^```", text, re.M | re.S)
    keys = dict(line.split("=", 1) for line in unit.splitlines()
                if "=" in line and not line.startswith("#"))
    argv = shlex.split(keys["ExecStart"])
    assert Path(argv[0]).name == "calexec" and argv[1] == "serve"
    flags = [word for word in argv[2:] if word.startswith("--")]
    assert flags and all(re.search(re.escape(flag) + r"(?![a-z0-9-])", help_text("serve"))
                         for flag in flags), flags
    assert float(keys["TimeoutStopSec"]) > float(argv[argv.index("--grace") + 1])
    assert keys["KillSignal"] == "SIGTERM" and keys["Restart"] == "on-failure"
    assert str(EXIT_USAGE) in keys["RestartPreventExitStatus"].split()
    analyze, exe = shutil.which("systemd-analyze"), shutil.which("calexec")
    if analyze is None or exe is None:
        return
    here = tmp_path / "calexec.service"
    here.write_text(unit.replace(argv[0], exe), encoding="utf-8")
    done = subprocess.run([analyze, "verify", str(here)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
