"""Phase B (§6.4): two jobs in flight, each buffer slot fixed to PING or PONG and submitted with
infer_with_fixed_task_type. No crosstalk against the oracle under every overlap setting of the
emulator, in-flight never above 2, faults behave as in Phase A, automatic downgrade to 1, and
going back to Phase A is configuration only."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from calexec.contracts.status import Status
from calexec.contracts.types import EngineSlot
from calexec.drivers.synthetic import oracle
from executor_harness import (
    SEED,
    arm,
    deadline,
    decode,
    prefill,
    running_executor,
    running_job_path,
    settle,
    write_calbin,
)


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("phase_b"))


class TaskTypes:
    """Records the task type of every infer_with_fixed_task_type call (and plain infers)."""

    def __init__(self, device) -> None:
        self._device, self.calls = device, []

    def __getattr__(self, name):
        return getattr(self._device, name)

    def infer(self, *args):
        self.calls.append("infer")
        return self._device.infer(*args)

    def infer_with_fixed_task_type(self, *args):
        self.calls.append(args[-1])
        return self._device.infer_with_fixed_task_type(*args)


def decode_loop(ex, seq: int, prompt: list[int], steps: int, out: dict) -> None:
    ref = oracle.OracleSequence(SEED)
    ref.run(prompt)
    result = ex.enqueue(prefill(seq, prompt)).wait_until(deadline())
    tokens, ok = [], True
    for _ in range(steps):
        if isinstance(result, Status):
            out[seq] = result
            return
        ok &= result.argmax == ref.next_token()
        tokens.append(result.argmax)
        ref.run([result.argmax])
        result = ex.enqueue(decode(seq, result.argmax, result.kv_len)).wait_until(deadline())
    out[seq] = ok and not isinstance(result, Status) and result.argmax == ref.next_token()


@pytest.mark.parametrize("overlap", ["none", "dma", "full"])
def test_two_sequences_interleaved_show_no_crosstalk(calbin, overlap):
    config = f"overlap={overlap};decode_us=3000;h2d_us=300;d2h_us=300"
    with running_job_path(calbin, config, inflight_capacity=2) as ex:
        ex.device = recorder = TaskTypes(ex.device)
        seen, stop = [], threading.Event()

        def monitor():
            while not stop.is_set():
                seen.append(ex.snapshot()["inflight"])
                time.sleep(0.0005)

        out: dict = {}
        threads = [threading.Thread(target=decode_loop, args=(ex, seq, [seq, 2, 3, 4], 25, out))
                   for seq in (1, 2)]
        watcher = threading.Thread(target=monitor)
        watcher.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        stop.set()
        watcher.join()
        assert out == {1: True, 2: True}  # every token of both sequences equals the oracle
        assert max(seen) == 2 and min(seen) >= 0  # two in flight, never more
        assert set(recorder.calls) == {int(EngineSlot.PING), int(EngineSlot.PONG)}
        counters = ex.device.emu.counters()
        assert counters["dma_input_violations"] == counters["dma_output_violations"] == 0
        assert ex.locks.violations == []


def test_failure_after_submit_behaves_as_phase_a_and_downgrades(calbin, caplog):
    # three decode slots: the two that fail stay quarantined (no recovery in this test)
    with running_job_path(calbin, "decode_us=2000", inflight_capacity=2, slots_per_kind=3,
                          downgrade_after_faults=2) as ex:
        for seq in (1, 2, 3):
            assert not isinstance(ex.enqueue(prefill(seq, [seq, 5, 6])).wait_until(deadline()),
                                  Status)
        with caplog.at_level(logging.WARNING, logger="calexec.executor"):
            for seq in (1, 2):
                arm(ex, "CCU_EXCEPTION")
                res = ex.enqueue(decode(seq, 1, 3)).wait_until(deadline())
                assert isinstance(res, Status) and res.code == "device.ccu_exception"
                assert ex.kvc.seqs[seq].unknown_reason == res.code  # as in Phase A
        snap = settle(ex)
        assert snap["inflight_capacity"] == 1 and snap["downgrades"] == 1
        assert "downgraded to in-flight capacity 1" in caplog.text
        assert snap["slots"]["Quarantined"] == 2
        assert not isinstance(ex.enqueue(decode(3, 1, 3)).wait_until(deadline()), Status)


def test_back_to_phase_a_is_configuration_only(calbin):
    with running_executor(calbin, inflight_capacity=1) as ex:
        ex.device = recorder = TaskTypes(ex.device)
        assert not isinstance(ex.enqueue(prefill(1, [1, 2])).wait_until(deadline()), Status)
        assert recorder.calls == ["infer"]
        assert {slot.engine for slot in ex.pool.slots} == {EngineSlot.AUTO}
    with running_executor(calbin, inflight_capacity=2) as ex:
        assert {slot.engine for slot in ex.pool.slots} == {EngineSlot.PING, EngineSlot.PONG}


def test_downgrade_is_visible_in_metrics(calbin):
    from fastapi.testclient import TestClient

    from calexec.drivers.serving.server import ServerConfig, create_app
    from test_server_support import metric_value

    with running_job_path(calbin, "decode_us=1000", inflight_capacity=2, slots_per_kind=3,
                          downgrade_after_faults=1) as ex:
        with TestClient(create_app(ex, ServerConfig())) as client:
            text = client.get("/metrics").text
            assert metric_value(text, "calexec_inflight_capacity") == 2
            assert metric_value(text, "calexec_pingpong_downgrades_total") == 0
            assert not isinstance(ex.enqueue(prefill(1, [1, 2])).wait_until(deadline()), Status)
            arm(ex, "CCU_EXCEPTION")
            assert isinstance(ex.enqueue(decode(1, 1, 2)).wait_until(deadline()), Status)
            settle(ex)
            text = client.get("/metrics").text
            assert metric_value(text, "calexec_inflight_capacity") == 1
            assert metric_value(text, "calexec_pingpong_downgrades_total") == 1
