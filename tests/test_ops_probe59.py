"""The operator's probe at stop 59: what the log says on a device fault.

docs/manifest.md section 4 (spec section 6.1): the caller logs the full Status, job, sequence,
generation, raw CalRT code and phase. The fault controller's line is the operator's record of
a fault, so it must name all five whatever the Status's message says."""

from __future__ import annotations

import json
import logging

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.faults import RecoveryPolicy
from executor_harness import arm, deadline, decode, greedy, running_executor, write_calbin

PROMPT = [7, 7, 8, 9, 10]


def test_a_status_written_out_names_its_raw_code_beside_the_job_it_belongs_to():
    """A Status whose message does not spell out its raw code (an execution deadline's keeps
    Wait's rc, 13) was written as ``... (job_id=5 seq_id=1 generation=1)``: the raw code was
    lost from every log line that writes a Status. It is now in the context: ``raw=13``."""
    status = Status.failure("execution.deadline", Category.DEVICE, Phase.WAIT,
                            "execution deadline passed", raw=13, job_id=5, seq_id=1,
                            generation=2)
    text = str(status)
    assert "(job_id=5 seq_id=1 generation=2 raw=13)" in text, text
    assert "[device/wait]" in text, text
    without = Status.failure("device.hung", Category.DEVICE, Phase.WAIT, "still there", job_id=5)
    assert "raw=" not in str(without), str(without)  # no raw code: none invented


def test_the_fault_line_of_a_hung_job_names_job_seq_generation_raw_code_and_phase(
        tmp_path, caplog):
    """A job the device never finishes ends at its execution deadline; the fault controller's
    WARNING line for it said ``INJECTED fault execution.deadline [device/wait] execution
    deadline passed; ... (job_id=5 seq_id=1 generation=1) -> reset_rebuild``: no raw code,
    though the Status carries Wait's (13) and its HTTP body says it (``raw_name``)."""
    caplog.set_level(logging.WARNING, logger="calexec.faults")
    # 2 s: the hung job misses it by far; the golden and the greedy run before it have
    # seconds of margin on a loaded host
    with running_executor(write_calbin(tmp_path), execution_timeout_s=2.0,
                          timeout_grace_s=0.1, execution_timeout_per_token_s=0.05,
                          recovery=RecoveryPolicy(drain_grace_s=0.2)) as ex:
        greedy(ex, 1, PROMPT, 0)
        arm(ex, "HANG")
        res = ex.enqueue(decode(1, 3, len(PROMPT))).wait_until(deadline())
        assert isinstance(res, Status) and res.code == "execution.deadline", res
        assert res.raw is not None
        lines = [r.getMessage() for r in caplog.records
                 if r.name == "calexec.faults" and "execution.deadline [" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    line = lines[0]
    for part in (f"job_id={res.job_id}", "seq_id=1", f"generation={res.generation}",
                 f"raw={res.raw}", "[device/wait]"):
        assert part in line, (part, line)


def test_the_dump_holds_admitted_requests_and_not_the_ones_refused_before(tmp_path):
    """docs/operations.md called the dump "one JSON line per request": an operator looking up
    a refused request's ``x-request-id`` (a 400 for a parameter, a 401 without the API key, a 503 while draining)
    finds no record, as none is written before admission; the doc now says which requests
    have one, and this pins it."""
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.dumpsink import DumpSink
    from calexec.drivers.serving.server import ServerConfig, create_app
    from test_server_support import started_executor

    executor = started_executor(tmp_path)
    try:
        sink = DumpSink(tmp_path / "dump", max_bytes=100_000)
        app = create_app(executor, ServerConfig(api_key="k1", admin_token="adm"), sink)
        key = {"authorization": "Bearer k1"}
        with TestClient(app) as client:
            served = client.post("/v1/completions", headers=key,
                                 json={"prompt": "a", "max_tokens": 2})
            bad = client.post("/v1/completions", headers=key,
                              json={"prompt": "a", "max_tokens": -1})
            keyless = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            drain = client.post("/admin/drain?grace=5", headers={"authorization": "Bearer adm"})
            draining = client.post("/v1/completions", headers=key,
                                   json={"prompt": "a", "max_tokens": 2})
        assert (served.status_code, bad.status_code, keyless.status_code, drain.status_code,
                draining.status_code) == (200, 400, 401, 202, 503)
        records = [json.loads(line) for line in sink.path.read_text().splitlines()]
        assert [r["x_request_id"] for r in records] == [served.headers["x-request-id"]]
    finally:
        executor.shutdown(5.0)


def test_a_second_signal_that_cuts_nothing_exits_as_the_drain_does(tmp_path):
    """docs/operations.md's signal table said a second signal during the drain exits 3, and
    docs/server.md "never 0"; the exit is 3 when the forced exit cut requests (the product's
    rule: a cut request is no clean drain). Two signals to an idle server cut nothing, and the
    executor stops: exit 0, no "forced exit by a second signal" line. The docs say so now."""
    import os
    import signal

    from test_ops_sweep import serve_process, stopped

    proc, _url = serve_process(tmp_path, "--log-level", "info", "--grace", "30")
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGTERM)
    code, err = stopped(proc)
    assert code == 0, err
    assert "forced exit by a second signal" not in err, err
    assert "Traceback" not in err, err


def test_the_serve_synopsis_names_every_flag_of_serve_help():
    """The synopsis at the top of docs/server.md is what a newcomer reads first: it left out
    ``--cors-origin`` and ``--ray``/``--replicas``. Every flag ``calexec serve --help`` lists is
    in it now, and it names no flag serve does not have."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "server.md").read_text()
    start = doc.index("calexec serve [")
    synopsis = doc[start:doc.index("\n\n", start)]
    helped = subprocess.run([sys.executable, "-m", "calexec", "serve", "--help"],
                            capture_output=True, text=True, timeout=60, check=True).stdout
    flags = set(re.findall(r"^\s+(--[a-z][a-z-]*)", helped, re.M)) - {"--help"}
    named = set(re.findall(r"(--[a-z][a-z-]*)", synopsis))
    assert flags - named == set(), f"serve flags missing from the synopsis: {flags - named}"
    assert named - flags == set(), f"synopsis flags serve does not have: {named - flags}"
