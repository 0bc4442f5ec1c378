"""Stop 66 (review): follow-ups of the stop's code review."""

from __future__ import annotations

import threading

import httpx

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving import grammar
from calexec.drivers.serving.openai_api import GRAMMAR_THREADS
from calexec.machines.faults import Action, Decision, FaultController
from calexec.machines.job import Job
from test_server_support import live_fixture

assert live_fixture  # the fixture ``live``, imported by its name


class _Target:
    """A FaultTarget whose lifecycle never ended (Ready), recording what it was asked."""

    def __init__(self) -> None:
        self.asked: list[Decision] = []

    def recovery_under_way(self) -> bool:
        return False

    def lifecycle_final(self) -> str | None:
        return None

    def request_recovery(self, decision: Decision) -> None:
        self.asked.append(decision)

    def disable_feature(self, status: Status, job: Job | None = None) -> object:
        return None


def _device_fault() -> Status:
    return Status.failure("device.hung", Category.DEVICE, Phase.WAIT, "the job hung")


def test_a_controller_attached_to_a_new_executor_decides_its_faults_again():
    """A STOP decided for the first executor (its COMPATIBILITY fault) ended that one; the
    controller attached to the next executor acts on its device fault (reset and rebuild),
    where it decided it ``none`` as "the lifecycle is already Failed", a lifecycle it never
    had."""
    controller = FaultController()
    first = _Target()
    controller.attach(first)
    controller.report(Status.failure("manifest.incompatible", Category.COMPATIBILITY,
                                     Phase.CONFIGURE, "the runtime cannot run this calbin"))
    assert [d.action for d in first.asked] == [Action.STOP]
    second = _Target()
    controller.attach(second)
    controller.report(_device_fault())
    assert [d.action for d in second.asked] == [Action.RESET_REBUILD], controller.decisions[-1]


def test_a_request_waiting_for_a_grammar_thread_ends_at_its_timeout(live, monkeypatch):
    """Two requests compile their grammar (held here); a third with ``timeout: 1`` waited
    for a compile thread with no bound, whatever timeout it gave (here until the test's
    client gave up). It ends at its timeout: a 504 naming ``timeout`` and what to change."""
    server, _, _ = live
    entered = threading.Semaphore(0)
    release = threading.Event()
    real = grammar.completion_structure

    def held(*args):
        entered.release()
        release.wait(60.0)  # (bounded: the test sets it)
        return real(*args)

    monkeypatch.setattr(grammar, "completion_structure", held)
    body = {"prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "json_object"}}
    answers: list[httpx.Response] = []
    holding = [threading.Thread(target=lambda: answers.append(
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=90.0)))
        for _ in range(GRAMMAR_THREADS)]
    for thread in holding:
        thread.start()
    try:
        for _ in holding:
            assert entered.acquire(timeout=30.0), "the grammar was never built"
        third = httpx.post(f"{server.url}/v1/completions", json={**body, "timeout": 1},
                           timeout=30.0)
        assert not release.is_set()
    finally:
        release.set()
        for thread in holding:
            thread.join(90.0)
    assert third.status_code == 504, third.text[:300]
    error = third.json()["error"]
    assert error["param"] == "timeout", error
    assert error["message"].startswith("request timeout=1 s passed waiting for one of the "
                                       f"server's {GRAMMAR_THREADS} grammar compile threads"), error
    assert [r.status_code for r in answers] == [200] * GRAMMAR_THREADS, answers
