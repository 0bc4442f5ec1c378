"""Issue 16 (and issue 15's sequence-id bullet): a request waits for a KV sequence id and for a
Ready lifecycle within its deadline instead of an immediate 429/503 (drivers/serving/admission.py).

Real executor on the bundled emulator, loopback servers only; the recovery's golden is held on
the stepped emulator so the Warming window is deterministic. Every wait is a bounded poll of a
condition; nothing asserts a duration.
"""

from __future__ import annotations

import threading
import time

import anyio
import pytest

pytest.importorskip("httpx", reason="the server tests need the [server] extra")
import httpx  # noqa: E402

from calexec.contracts.errors import Category  # noqa: E402
from calexec.contracts.status import Phase, Status  # noqa: E402
from calexec.drivers.serving.admission import AdmissionQueue, Waiter  # noqa: E402
from calexec.drivers.serving.server import SequencePool, ServerConfig, create_app  # noqa: E402
from calexec.machines.executor import DeviceExecutor  # noqa: E402
from test_server_support import (  # noqa: E402
    LiveServer,
    busy_engine,
    metric_value,
    oracle_tokens,
    started_executor,
    stepped_server,
    wait_for,
)

PROMPT = [5, 6, 7]


def hold_recovery_in_warming(executor) -> threading.Thread:
    """A recovery whose golden job is held on the stepped device: the lifecycle stays Warming
    until ``emu.set_stepped(False)``."""
    emu = executor.device.emu
    assert emu.set_stepped(True) == 0
    reason = Status.failure("test.recover", Category.DEVICE, Phase.RECOVERY, "test")
    thread = threading.Thread(target=executor.recover, args=(reason,))
    thread.start()
    wait_for(lambda: executor.state == "Warming" and busy_engine(emu) is not None,
             what="the recovery's golden held on the stepped device")
    return thread


def waiting_behind_a_recovery(executor, service, url: str, max_tokens: int, out: list
                              ) -> tuple[threading.Thread, threading.Thread]:
    """``hold_recovery_in_warming``, then a completion of ``max_tokens`` posted to ``url``
    from a thread (its response appended to ``out``) until ``service``'s admission has it
    waiting: (the recovery's thread, the request's)."""
    recovery = hold_recovery_in_warming(executor)
    request = threading.Thread(target=lambda: out.append(httpx.post(
        f"{url}/v1/completions", timeout=30, json={"prompt": PROMPT, "max_tokens": max_tokens})))
    request.start()
    wait_for(lambda: service.admission.waiting == 1, what="the request waiting")
    return recovery, request


# ---- waiting through a recovery ------------------------------------------------------------------
def test_a_request_during_a_recovery_waits_and_completes(tmp_path):
    """It used to be an immediate 503. /ready stays 503 meanwhile (load balancers route away)."""
    out: list[httpx.Response] = []
    with stepped_server(tmp_path) as (server, service, executor):
        emu = executor.device.emu
        with httpx.Client(base_url=server.url, timeout=20) as client:
            recovery, late = waiting_behind_a_recovery(executor, service, server.url, 4, out)
            assert metric_value(client.get("/metrics").text,
                                "calexec_num_requests_waiting") == 1
            not_ready = client.get("/ready")
            assert not_ready.status_code == 503 and not_ready.headers["retry-after"]
            assert "Warming" in not_ready.json()["error"]["message"]
            assert emu.set_stepped(False) == 0
            recovery.join(20)
            late.join(30)
            assert out[0].status_code == 200, out[0].text
            assert out[0].json()["choices"][0]["token_ids"] == oracle_tokens(PROMPT, 4)
            assert client.get("/ready").json()["generation"] == 2
            assert metric_value(client.get("/metrics").text,
                                "calexec_num_requests_waiting") == 0


def test_a_full_waiting_queue_is_503_in_recovery_and_a_failed_lifecycle_refuses(tmp_path):
    out: list[httpx.Response] = []
    with stepped_server(tmp_path, max_waiting=1) as (server, service, executor):
        emu = executor.device.emu
        with httpx.Client(base_url=server.url, timeout=20) as client:
            recovery, waiting = waiting_behind_a_recovery(executor, service, server.url, 2, out)
            full = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert full.status_code == 503 and full.headers["retry-after"] == "1"
            assert "max_waiting=1" in full.json()["error"]["message"]
            assert "Warming" in full.json()["error"]["message"]
            # the lifecycle ends Failed while one waits: it is refused, not left waiting
            executor.life.fail(Status.failure("test.failed", Category.COMPATIBILITY,
                                              Phase.RECOVERY, "test"))
            waiting.join(20)
            assert out[0].status_code == 503 and "Failed" in out[0].json()["error"]["message"]
            assert service.admission.waiting == 0
            refused = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert refused.status_code == 503 and "Failed" in refused.json()["error"]["message"]
            emu.set_stepped(False)
            recovery.join(20)


# ---- waiting for a sequence id -------------------------------------------------------------------
class _PrefillsRecorded(DeviceExecutor):
    """The executor, keeping the prompt of each prefill it is given (in the order given)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[list[int]] = []

    def enqueue(self, request, logits_out=None, on_created=None):
        if request.past_len == 0:
            self.prompts.append([int(t) for t in request.tokens])
        return super().enqueue(request, logits_out, on_created)


def test_more_requests_than_sequence_ids_all_complete_in_arrival_order(tmp_path):
    """max_sequences=1, worker_threads=1: five requests. Old code: four immediate 429s. Now
    they wait (FIFO) and complete one after the other, never taking a running request's
    worker thread (the one thread serves the running request's decodes). The order is the
    executor's (the one sequence id: each prefill comes after the request before it
    ended): the order the clients' threads woke up in is the host's (a loaded host once woke
    request 1's thread before request 0's)."""
    executor = started_executor(tmp_path, executor_class=_PrefillsRecorded)
    assert isinstance(executor, _PrefillsRecorded)
    app = create_app(executor, ServerConfig(max_sequences=1, worker_threads=1))
    service = app.state.service
    held = service.sequences.acquire()
    bodies: dict[int, httpx.Response] = {}
    prompts = {i: [10 + i, 20 + i] for i in range(5)}

    def post(i: int) -> None:
        bodies[i] = httpx.post(f"{server.url}/v1/completions", timeout=30,
                               json={"prompt": prompts[i], "max_tokens": 3})
    try:
        with LiveServer(app) as server:
            threads = []
            for i in range(5):  # each one queued before the next is sent: a known order
                threads.append(threading.Thread(target=post, args=(i,)))
                threads[-1].start()
                wait_for(lambda i=i: service.admission.waiting == i + 1,
                         what=f"request {i} waiting")
            service.sequences.release(held)
            for thread in threads:
                thread.join(30)
            assert executor.prompts == [prompts[i] for i in range(5)], executor.prompts
            for i in range(5):
                assert bodies[i].status_code == 200, bodies[i].text
                assert bodies[i].json()["choices"][0]["token_ids"] == oracle_tokens(prompts[i], 3)
        assert service.admission.waiting == 0 and service.sequences.in_use == 0
    finally:
        executor.shutdown(5.0)


def test_a_full_waiting_queue_is_429_when_ids_are_exhausted(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_sequences=1, max_waiting=1))
    service = app.state.service
    held = service.sequences.acquire()
    out: list[httpx.Response] = []
    try:
        with LiveServer(app) as server, httpx.Client(base_url=server.url, timeout=20) as client:
            waiting = threading.Thread(target=lambda: out.append(httpx.post(
                f"{server.url}/v1/completions", timeout=30,
                json={"prompt": PROMPT, "max_tokens": 2})))
            waiting.start()
            wait_for(lambda: service.admission.waiting == 1, what="one request waiting")
            full = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            assert full.status_code == 429 and full.headers["retry-after"] == "1"
            assert full.json()["error"]["code"] == "kv.full"
            assert "max_waiting=1" in full.json()["error"]["message"]
            service.sequences.release(held)
            waiting.join(20)
            assert out[0].status_code == 200
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_disconnects_while_waiting_leaves_the_queue(tmp_path, stream):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_sequences=1))
    service = app.state.service
    held = service.sequences.acquire()
    try:
        with LiveServer(app) as server:
            def gone() -> None:
                with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes
                    httpx.post(f"{server.url}/v1/completions", timeout=0.5,
                               json={"prompt": PROMPT, "max_tokens": 2, "stream": stream,
                                     "timeout": 60})
            client = threading.Thread(target=gone)
            client.start()
            wait_for(lambda: service.admission.waiting == 1, what="the request waiting")
            client.join(10)
            wait_for(lambda: service.admission.waiting == 0 and service.active == 0,
                     what="the disconnected request out of the queue")
            service.sequences.release(held)
            assert service.sequences.counts()["free"] == 1  # nobody took the freed id
            ok = httpx.post(f"{server.url}/v1/completions", timeout=10,
                            json={"prompt": PROMPT, "max_tokens": 2})
            assert ok.status_code == 200
    finally:
        executor.shutdown(5.0)


def test_a_drain_refuses_the_waiting_requests(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_sequences=1, admin_token="t"))
    service = app.state.service
    held = service.sequences.acquire()
    out: list[httpx.Response] = []
    try:
        with LiveServer(app) as server:
            waiting = threading.Thread(target=lambda: out.append(httpx.post(
                f"{server.url}/v1/completions", timeout=30,
                json={"prompt": PROMPT, "max_tokens": 2})))
            waiting.start()
            wait_for(lambda: service.admission.waiting == 1, what="one request waiting")
            r = httpx.post(f"{server.url}/admin/drain", params={"grace": 5},
                           headers={"Authorization": "Bearer t"})
            assert r.status_code == 202
            waiting.join(20)
            assert out[0].status_code == 503 and "draining" in out[0].json()["error"]["message"]
            service.sequences.release(held)
            wait_for(lambda: service.drain_status is not None, what="the drain")
            assert service.drain_status.ok
    finally:
        if not executor.lifecycle.final:
            executor.shutdown(5.0)


# ---- the queue itself ----------------------------------------------------------------------------
def _queue(ids: int, state: str = "Ready", max_waiting: int = 8):
    pool = SequencePool(range(1, ids + 1))
    box = {"state": state}
    queue = AdmissionQueue(pool, lambda: box["state"], lambda: [], lambda: False, max_waiting,
                           0.005)
    pool.on_free = queue.pump
    return pool, queue, box


def test_queue_serves_resumes_first_then_fifo_and_a_cancelled_waiter_returns_its_id():
    async def main() -> None:
        pool, queue, box = _queue(1)
        assert queue.try_admit() == 1
        a, b = queue.try_admit(), queue.try_admit()
        r = queue.try_admit(resume=True)
        assert all(isinstance(w, Waiter) for w in (a, b, r)) and queue.waiting == 3
        pool.release(1)  # -> the resume, though it came last
        assert r.seq_id == 1 and a.seq_id is None and queue.waiting == 2
        assert await queue.wait(r, time.monotonic() + 1) == 1
        pool.release(1)  # -> a (FIFO)
        assert a.seq_id == 1 and b.seq_id is None
        queue.leave(a)  # a was cancelled before taking it: the id goes on to b
        assert b.seq_id == 1 and pool.counts()["in_use"] == 1
        status = await queue.wait(queue.try_admit(), time.monotonic() + 0.01)
        assert status.code == "admission.deadline" and queue.waiting == 0
        box["state"] = "Recovering"
        pool.release(await queue.wait(b, time.monotonic() + 1))
        c = queue.try_admit()
        assert isinstance(c, Waiter) and c.seq_id is None  # an id is free but not Ready
        box["state"] = "Ready"
        assert await queue.wait(c, time.monotonic() + 5) == 1  # the watcher saw Ready
    anyio.run(main)


def test_an_id_answered_at_once_but_never_taken_goes_back_on_leave():
    """A resume's ``try_admit`` may answer an id at once; a request finishing before its next
    step took it (``finish`` -> ``leave``) gives it back instead of leaking it."""
    async def main() -> None:
        pool, queue, _ = _queue(2)
        seq_id = queue.try_admit(resume=True)
        assert isinstance(seq_id, int) and pool.counts()["in_use"] == 1
        queue.leave(seq_id)
        assert pool.counts() == {"free": 2, "in_use": 0, "withheld": 0, "capacity": 2}
        queue.leave(None)  # nothing to give back
        assert pool.consistent()
    anyio.run(main)


@pytest.mark.parametrize("flag", ["--max-waiting", "--max-resumes"])
def test_serve_refuses_a_negative_waiting_or_resume_bound_naming_the_flag(flag, capsys):
    from calexec import cli
    assert cli.main(["serve", flag, "-1"]) == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be >= 0, got -1" in err and err.count("\n") == 1


# ---- the queue's decisions (hand mutants of admission.py the tests above let through) ------------
def _gated_queue(ids: int, max_waiting: int = 8):
    """A queue whose lifecycle, health reasons and drain are the test's to set (``box``)."""
    pool = SequencePool(range(1, ids + 1))
    box: dict = {"state": "Ready", "health": [], "draining": False}
    queue = AdmissionQueue(pool, lambda: box["state"], lambda: list(box["health"]),
                           lambda: box["draining"], max_waiting, 0.005)
    pool.on_free = queue.pump
    return pool, queue, box


def test_a_draining_server_refuses_new_requests_but_still_resumes_admitted_ones():
    """docs/server.md: a drain lets admitted requests finish; one of them resuming after a
    device fault is not a new request and is not refused for the drain."""
    async def main() -> None:
        pool, queue, box = _gated_queue(1)
        assert queue.try_admit() == 1
        fresh = queue.try_admit()
        assert isinstance(fresh, Waiter)
        box["draining"] = True
        refused = queue.try_admit()
        assert isinstance(refused, Status) and refused.category is Category.UNAVAILABLE
        assert "draining" in refused.message
        resume = queue.try_admit(resume=True)
        assert isinstance(resume, Waiter), resume
        pool.release(1)  # pump: the drain refuses the fresh waiter, the resume gets the id
        assert fresh.status is not None and "draining" in fresh.status.message
        assert resume.status is None and resume.seq_id == 1
    anyio.run(main)


def test_a_request_arriving_as_the_lifecycle_turns_ready_queues_behind_earlier_waiters():
    """Ids are free during a recovery; the first request to arrive once Ready (before the
    watcher pumped) must not take one ahead of the requests that waited through it."""
    async def main() -> None:
        _, queue, box = _gated_queue(1)
        box["state"] = "Recovering"
        first = queue.try_admit()
        assert isinstance(first, Waiter)
        box["state"] = "Ready"
        late = queue.try_admit()
        assert isinstance(late, Waiter), f"the later request jumped the queue: {late!r}"
        assert await queue.wait(first, time.monotonic() + 5) == 1
        queue.leave(late)
        assert queue.waiting == 0
    anyio.run(main)


def test_an_unhealthy_executor_hands_no_id_and_its_full_queue_is_503_not_429():
    """While ``executor.health()`` names a reason (a hung job not yet recovered) a freed id
    waits for health, and a full queue is 503 naming the reason, not 429 ``kv.full``."""
    async def main() -> None:
        pool, queue, box = _gated_queue(1, max_waiting=1)
        assert queue.try_admit() == 1
        box["health"] = ["job 7 hung"]
        waiter = queue.try_admit()
        assert isinstance(waiter, Waiter)
        full = queue.try_admit()
        assert isinstance(full, Status) and full.http_status == 503, full
        assert full.category is Category.UNAVAILABLE and "job 7 hung" in full.message
        pool.release(1)
        assert waiter.seq_id is None  # not handed while unhealthy
        box["health"] = []
        assert await queue.wait(waiter, time.monotonic() + 5) == 1
    anyio.run(main)


def test_a_resume_is_never_refused_for_a_full_queue_and_a_failed_lifecycle_refuses_it():
    async def main() -> None:
        _, queue, box = _gated_queue(1, max_waiting=1)
        assert queue.try_admit() == 1
        fresh = queue.try_admit()
        full = queue.try_admit()
        assert isinstance(full, Status) and full.code == "kv.full" and full.http_status == 429
        resume = queue.try_admit(resume=True)
        assert isinstance(resume, Waiter), f"a resume was refused for a full queue: {resume!r}"
        box["state"] = "Failed"
        queue.pump()  # waiting cannot help any more: every waiter, resumes too, is refused
        for waiter in (fresh, resume):
            assert waiter.status is not None and waiter.status.http_status == 503
            assert "Failed" in waiter.status.message
        assert queue.waiting == 0
    anyio.run(main)
