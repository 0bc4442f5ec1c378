"""Stop 54 (faults): seeded fault schedules under load, each defect replayed with its
interleaving forced (a gate on the thread that reports a fault, a loop held until the
recovery moved on) rather than hoped for. Real executor on the bundled emulator, loopback
servers only; every wait is a bounded poll of a condition; nothing asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest

import needs

needs.module("httpx", "server")
import httpx  # noqa: E402

from calexec.drivers.calrt.runtime import Fault, FaultMode  # noqa: E402
from calexec.drivers.serving.server import ServerConfig, create_app  # noqa: E402
from calexec.machines.faults import RecoveryPolicy  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    metric_value,
    server_idle,
    started_executor,
    wait_for,
)


def _answer_code(response: httpx.Response, stream: bool) -> tuple[int, str | None]:
    """(HTTP status, the error code the client read: the body's, or a stream's error event's)."""
    if response.status_code != 200:
        return response.status_code, response.json()["error"]["code"]
    events = [json.loads(line[len("data: "):]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    errors = [e["error"]["code"] for e in events if "error" in e]
    assert stream or not errors, response.text
    return 200, errors[-1] if errors else None


def _failures(service, code: str) -> float:
    text = service.metrics.exposition().decode()
    return metric_value(text, "calexec_request_failures_total", {"code": code}) or 0.0


def _server(tmp_path, prearm: bool):
    """``prearm`` pins the decode path: the server picks it by the device time it measured
    (``prearm_min_device_ms``), which a loaded host reads long enough to pre-arm for; left to
    that, the interleaving each test forces depended on the host's load. The default
    execution deadline: no job hangs here, and with ``max_resumes`` 0 a healthy job a loaded
    host held past a short one (1 s) failed the request with a fault the test never armed."""
    executor = started_executor(tmp_path, recovery=RecoveryPolicy(max_recoveries=1000))
    config = ServerConfig(max_resumes=0, prearm=prearm, prearm_min_device_ms=0.0)
    return executor, create_app(executor, config)


@pytest.mark.parametrize("prearm", [False, True], ids=["plain", "prearmed"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_s_fault_is_the_answer_when_a_sibling_s_knock_on_came_first(tmp_path, stream,
                                                                            prearm):
    """``n`` = 2, ``max_resumes`` 0, a CCU exception on one choice's job: the recovery it sets
    off ends the other choice too (503 ``lifecycle.unavailable``, "device recovering after
    device.ccu_exception"), and whichever of the two the event loop saw first was the
    request's answer: the same schedule answered 503 device.ccu_exception 7 times in 10, 503
    lifecycle.unavailable 3 times (500 internal.output_not_finite or 503 for a NaN row).
    Here the thread that reports the fault waits until the knock-on was counted before the
    faulted job is resolved (the old code's losing order, every time); the answer is the
    fault that set the recovery off."""
    executor, app = _server(tmp_path, prearm)
    service = app.state.service
    report = executor.request_recovery
    forced: list[bool] = []

    def gated(decision) -> None:  # the completion thread, between the report and the resolve
        # the other choice's next job is queued behind the faulted one (one job in flight:
        # it cannot be submitted while this thread holds the permit), or, pre-armed, waits
        # for a slot (the faulted job's is quarantined, the faulted stream's own next step
        # holds the other), so the recovery's stop of admission fails it: the knock-on (a
        # job enqueued later would wait for Ready)
        def sibling_waits() -> bool:
            dispatch = executor.snapshot()["dispatch"]
            return dispatch["queued"] + (dispatch["armed"] if prearm else 0) >= 1

        end = time.monotonic() + 30.0
        while not sibling_waits() and time.monotonic() < end:
            time.sleep(0.005)
        before = _failures(service, "lifecycle.unavailable")
        report(decision)
        end = time.monotonic() + 30.0
        while _failures(service, "lifecycle.unavailable") <= before and time.monotonic() < end:
            time.sleep(0.005)
        forced.append(_failures(service, "lifecycle.unavailable") > before)

    executor.request_recovery = gated
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert executor.device.emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 3, 0,
                                                 0) == 0
            body = {"prompt": [5, 6, 7], "n": 2, "max_tokens": 6, "stream": stream}
            answer = _answer_code(http.post("/v1/completions", json=body), stream)
            executor.device.emu.clear_all_faults()
            wait_for(lambda: forced, 30, "the gate on the fault's report to open")
            assert forced == [True], "the sibling's knock-on did not come first"
            assert answer in ((503, "device.ccu_exception"), (200, "device.ccu_exception")), answer
            if not stream:
                assert answer[0] == 503
            wait_for(lambda: server_idle(service), 30, "every id and run released")
            assert service.sequences.consistent() and service.sequences.withheld == 0
            wait_for(lambda: http.get("/ready").status_code == 200, 30, "ready again")
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("prearm", [False, True], ids=["plain", "prearmed"])
def test_a_fault_is_the_answer_when_its_recovery_retired_the_generation_first(tmp_path, prearm):
    """``n`` = 1, ``max_resumes`` 0, a CCU exception: when the event loop took the failed job
    only after the recovery it set off had replaced the generation (a busy loop), the answer
    was 503 ``lifecycle.unavailable`` ("the request's generation 1 was replaced by 2") instead
    of the fault's own 503 ``device.ccu_exception`` (for a NaN row, 503 instead of 500), the
    code a matter of timing. Here the loop is held from just before the job is resolved until
    the generation moved."""
    executor, app = _server(tmp_path, prearm)
    loops: list[asyncio.AbstractEventLoop] = []

    @app.get("/probe54-loop")
    async def loop_route() -> dict:
        loops.append(asyncio.get_running_loop())
        return {}

    def generation() -> int | None:
        contracts = executor.generation
        return None if contracts is None else contracts.generation_id

    report = executor.request_recovery
    held: list[tuple[int | None, int | None]] = []

    def gated(decision) -> None:  # the completion thread, between the report and the resolve
        before = generation()
        holding = threading.Event()

        def hold_the_loop() -> None:  # the job's wake-up waits behind this
            holding.set()
            end = time.monotonic() + 30.0
            while generation() in (before, None) and time.monotonic() < end:
                time.sleep(0.005)
            held.append((before, generation()))

        loops[0].call_soon_threadsafe(hold_the_loop)
        report(decision)
        holding.wait(30.0)

    executor.request_recovery = gated
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as http:
            assert http.get("/probe54-loop").status_code == 200 and loops
            assert executor.device.emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 2, 0,
                                                 0) == 0
            response = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 6})
            executor.device.emu.clear_all_faults()
            wait_for(lambda: held, 30, "the loop to be let go")
            assert len(held) == 1 and held[0][1] not in (held[0][0], None), held
            assert _answer_code(response, False) == (503, "device.ccu_exception"), response.text
            wait_for(lambda: server_idle(app.state.service), 30, "every id and run released")
    finally:
        executor.shutdown(5.0)
