"""Issue 28 (stop 66): a streamed decode burst (``ServerConfig.stream_bursts``) is handed to a
thread of the service's own pool (``calexec-burst_N``), as a non-streamed one has been since
stop 65 (tests/test_server_burst_threads.py), not through anyio's ``to_thread``.

The move is a claim that nothing a client sees changed, so first a differential test of its
own: the same streamed requests go to a server on the defaults (streamed bursts) and to one on
the plain path (no bursts, no inline waits: a worker thread per step), one request at a time,
and each answer of the first must be the plain one's: a whole stream, a client that reads one
to three events and vanishes mid-burst, a request whose deadline passes during its burst, a
device fault on a job of the burst (recovered and resumed), and a drain started while a
streamed burst runs (its grace long enough: the stream ends whole, then the drain). This
holds on the code before the move as after it. Then what the move is for, observed: the
streamed bursts ran in threads the pool started (named ``calexec-burst_N``; before it, anyio's
worker threads ran them), §5.1 invariant 2 still holds (only the submitter thread calls
``infer``, only the completion thread waits on a buffer), and the pool's threads end when the
app stops.

Loopback servers on the bundled emulator; a deadline on every request, a timeout on every
client; no timing in the assertions (a deadline's request is compared only by how it ended,
as in tests/test_server_inline_waits.py)."""

from __future__ import annotations

import collections
import contextlib
import threading

import httpx
import pytest

from calexec.drivers.calrt.runtime import Device, Fault, FaultMode, OutputBuf
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.machines.executor import DeviceExecutor, RecoveryPolicy
from calexec.machines.stream import DecodeStream
from test_server_inline_waits import comparable, idle, send
from test_server_support import LiveServer, oracle_tokens, started_executor, wait_for
from thread_starts import recording_thread_starts

TOKEN = "stream-burst-admin"
#: the defaults (streamed bursts) and the plain path, as test_server_inline_waits.PATHS
PATHS = {"bursts": {}, "plain": {"inline_waits": False, "decode_bursts": False,
                                 "stream_bursts": False, "prearm_min_device_ms": 0.0}}
STREAM = {"prompt": [5, 6, 7], "max_tokens": 12, "mode": "stream", "read": 1, "sampled": None,
          "stop_at": None, "deadline": False, "fault": None}
#: (fault, rc, the job it hits: the prefill is the first, the burst takes the rest)
FAULTS = [("CCU_EXCEPTION", 0, 3), ("OUTPUT_NAN", 0, 4), ("WAIT_RC", 0, 2), ("HANG", 0, 3)]
SPECS = ([STREAM, {**STREAM, "max_tokens": 40}]
         + [{**STREAM, "mode": "disconnect", "read": read} for read in (1, 2, 3)]
         + [{**STREAM, "deadline": True}]
         + [{**STREAM, "fault": fault} for fault in FAULTS])


def executor_for(tmp, decode_us: int):
    tmp.mkdir()
    return started_executor(tmp, f"decode_us={decode_us}", execution_timeout_s=0.3,
                            timeout_grace_s=0.1, execution_timeout_per_token_s=0.05,
                            recovery=RecoveryPolicy(max_recoveries=100_000, drain_grace_s=1.0))


@pytest.fixture
def runtime_calls(monkeypatch):
    """Every infer / Wait call on any device or output buffer, and every job a server's
    thread enqueued or stepped a decode stream with: (call, thread name)."""
    calls: list[tuple[str, str]] = []

    def wrap(cls, name):
        real = getattr(cls, name)

        def recorded(self, *args, **kwargs):
            calls.append((name, threading.current_thread().name))  # list.append: atomic
            return real(self, *args, **kwargs)
        monkeypatch.setattr(cls, name, recorded)
    for cls, name in ((Device, "infer"), (Device, "infer_with_fixed_task_type"),
                      (OutputBuf, "wait"), (DeviceExecutor, "enqueue"),
                      (DecodeStream, "submit")):
        wrap(cls, name)
    return calls


def answer_of(server, executor, service, spec: dict) -> tuple:
    emu = executor.device.emu
    if spec["fault"] is not None:
        name, rc, nth = spec["fault"]
        assert emu.set_fault(Fault[name], FaultMode.NTH, nth, 7, rc) == 0
    try:
        answer = send(server.url, spec)
    finally:
        emu.clear_all_faults()
    wait_for(lambda: idle(executor, service), timeout=20.0, what="server idle after a request")
    return comparable(spec, answer)


def test_streamed_bursts_answer_like_the_plain_path_in_the_pools_threads(
        tmp_path, runtime_calls):
    answers: dict[str, list] = {}
    seen = {}  # path -> (burst jobs, jobs by the pool's threads, the pool's threads, calls)
    for path, settings in PATHS.items():
        # 1 ms a decode: a burst runs ahead of the loop and a 10 ms deadline passes in it
        executor = executor_for(tmp_path / path, 1000)
        try:
            app = create_app(executor, ServerConfig(**settings))
            service = app.state.service
            registry = service.metrics.registry
            with recording_thread_starts() as starts:
                with LiveServer(app) as server:
                    del runtime_calls[:]  # (the start's golden run is not the server's)
                    before = registry.get_sample_value("calexec_decode_burst_jobs_total") or 0
                    answers[path] = [answer_of(server, executor, service, spec)
                                     for spec in SPECS]
                    took = registry.get_sample_value("calexec_decode_burst_jobs_total") - before
                    # (started by the pool's keeper since stop 70, not by the loop)
                    bursts = [t for _, t in starts.starts
                              if t.name.startswith("calexec-burst_")]
            # the jobs each thread enqueued or stepped a decode stream with
            jobs_by = collections.Counter(n for call, n in runtime_calls
                                          if call in ("enqueue", "submit"))
            pools = sum(k for n, k in jobs_by.items() if n.startswith("calexec-burst_"))
            seen[path] = (took, pools, bursts, list(runtime_calls), jobs_by)
        finally:
            executor.shutdown(5.0)
    # first the claim of equality (it held before stop 66 as it does now)
    assert answers["bursts"] == answers["plain"]
    greedy = oracle_tokens(STREAM["prompt"], 40)
    assert answers["plain"][0][:5] == ("stream", greedy[:12], "length", None, True)
    assert answers["plain"][1][:5] == ("stream", greedy, "length", None, True)
    for path, (took, pools, bursts, calls, jobs_by) in seen.items():
        if path == "bursts":
            # streamed bursts took the decode steps (11 and 39 of the two whole streams at
            # the least), in the pool's threads (anyio's worker threads before stop 66)
            assert took >= 11 + 39 and pools >= 11 + 39, (took, jobs_by)
            assert bursts and all(t.name.startswith("calexec-burst_") for t in bursts)
            for thread in bursts:  # the app stopped: the pool's idle threads end
                thread.join(10.0)
                assert not thread.is_alive(), thread.name
        else:
            assert took == 0 and not bursts and pools == 0, (took, jobs_by)
        # §5.1 invariant 2, whichever path took the steps
        device = [(call, n) for call, n in calls if call not in ("enqueue", "submit")]
        assert {n for call, n in device if call != "wait"} == {"calexec-submitter"}, path
        assert {n for call, n in device if call == "wait"} == {"calexec-completion"}, path


def test_a_drain_during_a_streamed_burst_answers_like_the_plain_path(tmp_path):
    """``POST /admin/drain?grace=30`` while a streamed request's burst runs (its client has
    read its first two events and holds the rest): the stream ends whole with every greedy
    token and ``[DONE]``, the drain then ends; the same on the plain path."""
    answers = {}
    for path, settings in PATHS.items():
        executor = executor_for(tmp_path / path, 5000)  # 40 decodes: 0.2 s at the least
        try:
            app = create_app(executor, ServerConfig(admin_token=TOKEN, **settings))
            service = app.state.service
            with LiveServer(app) as server, httpx.Client(base_url=server.url,
                                                          timeout=30.0) as client:
                body = {"prompt": STREAM["prompt"], "max_tokens": 40, "stream": True,
                        "timeout": 30}
                events, drained = [], None
                with client.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line)
                        if len(events) == 2 and drained is None:
                            drained = client.post(
                                "/admin/drain", params={"grace": 30},
                                headers={"Authorization": f"Bearer {TOKEN}"}).status_code
                wait_for(lambda s=service: s.drain_status is not None, timeout=30,
                         what="the drain's end")
                answers[path] = (drained, str(service.drain_status.code), events[-1],
                                 [t for line in events[:-1]
                                  for t in httpx.Response(200, content=line[6:]).json()
                                  ["choices"][0]["token_ids"]])
        finally:
            with contextlib.suppress(Exception):
                executor.shutdown(5.0)
    assert answers["bursts"] == answers["plain"]
    assert answers["plain"][0] == 202 and answers["plain"][2] == "data: [DONE]"
    assert answers["plain"][3] == oracle_tokens(STREAM["prompt"], 40)
