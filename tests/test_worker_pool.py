"""``drivers/serving/threads.WorkerPool`` (stop 70): the server's decode bursts and background
sequence releases run on threads the event loop hands work to without starting a thread
itself. ``threading.Thread.start`` waits for the new thread to be scheduled, 0.1-0.25 s on a
CPU-starved host (stop 69's chaos runs found the loop inside it: ``ThreadPoolExecutor``'s
``_adjust_thread_count`` and ``release_later``'s thread per release), and every request the
loop serves waited with it.

Here: the pool's own semantics (every call runs once, results and exceptions through its
future, at most ``max_workers`` threads, a call waits for a free worker rather than for a
thread start, shutdown and collection end the threads), that the submitting thread never
starts a thread, and, through a loopback server, that its event loop starts none for bursts
at rising concurrency from cold, for a decode stream's close or for a release waiting for a
hung job. Events and barriers with deadlines; no timing thresholds."""

from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import json
import logging
import threading
import weakref

import httpx
import pytest

from calexec.drivers.calrt.runtime import Stage
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.serving.threads import WorkerPool
from calexec.drivers.tools.interleave import explore_threads
from calexec.machines.clock import Clock
from calexec.machines.executor import DeviceExecutor
from test_server_support import (
    LiveServer,
    metric_value,
    oracle_tokens,
    server_idle,
    started_executor,
    wait_for,
)
from thread_starts import recording_thread_starts

WAIT_S = 30.0


def test_every_call_runs_once_with_its_result_or_exception():
    pool = WorkerPool(3, "t-pool")
    try:
        futures = [pool.submit(lambda i=i: i * i) for i in range(50)]
        assert [f.result(WAIT_S) for f in futures] == [i * i for i in range(50)]
        failing = pool.submit(int, "not a number")
        with pytest.raises(ValueError, match="not a number"):
            failing.result(WAIT_S)
        assert pool.submit(sum, [1, 2, 3]).result(WAIT_S) == 6  # the pool still serves
    finally:
        pool.shutdown()


def test_the_submitting_thread_never_starts_a_thread():
    """Eight blocking calls at once on a pool of eight: every worker is started by the pool's
    keeper, none by the thread that submits (which before stop 70, a ``ThreadPoolExecutor``'s
    submit, started each itself). The pool's name is its own: the starts are the whole
    process's, and a pool of another test of this file closed just before may still start a
    worker asked of its keeper (a CI run saw a ``t-pool_2`` of an earlier pool here)."""
    gate = threading.Event()
    with recording_thread_starts() as starts:
        pool = WorkerPool(8, "t-starts")
        try:
            running = threading.Barrier(9, timeout=WAIT_S)
            futures = [pool.submit(lambda: (running.wait(), gate.wait(WAIT_S))[1])
                       for _ in range(8)]
            running.wait()  # all eight run at once: eight workers
            gate.set()
            assert all(f.result(WAIT_S) for f in futures)
        finally:
            gate.set()
            pool.shutdown()
    me = threading.current_thread()
    by_me = [started.name for starter, started in starts.starts if starter is me]
    assert by_me == ["t-starts-keeper"], by_me
    workers = [(starter.name, started.name) for starter, started in starts.starts
               if started.name.startswith("t-starts_")]
    assert len(workers) == 8 and {s for s, _ in workers} == {"t-starts-keeper"}, workers


def test_at_most_max_workers_and_a_call_waits_for_a_free_one():
    """Two workers held by blocking calls: a third call waits in the queue (no third thread)
    and runs once one is free."""
    gate = threading.Event()
    pool = WorkerPool(2, "t-pool")
    try:
        both = threading.Barrier(3, timeout=WAIT_S)
        held = [pool.submit(lambda: (both.wait(), gate.wait(WAIT_S))[1]) for _ in range(2)]
        both.wait()
        third = pool.submit(threading.current_thread)
        assert not third.done()  # (no worker free: it cannot have run)
        assert pool.workers == 2
        gate.set()
        ran_on = third.result(WAIT_S)
        assert ran_on.name.startswith("t-pool_")
        assert all(f.result(WAIT_S) for f in held)
        assert pool.workers == 2
    finally:
        gate.set()
        pool.shutdown()


def test_shutdown_refuses_new_calls_runs_the_queued_ones_and_ends_the_workers():
    gate = threading.Event()
    pool = WorkerPool(1, "t-pool")
    held = pool.submit(gate.wait, WAIT_S)
    queued = pool.submit(lambda: "ran")
    pool.shutdown()
    with pytest.raises(RuntimeError, match="t-pool"):
        pool.submit(int)
    gate.set()
    assert held.result(WAIT_S) is True and queued.result(WAIT_S) == "ran"
    wait_for(lambda: pool.workers == 0, WAIT_S, "the pool's workers to end")
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("t-pool")],
             WAIT_S, "the pool's threads to end")


def test_a_collected_pool_ends_its_threads():
    """An app dropped without its lifespan's shutdown (a test's) leaves no thread behind."""
    pool = WorkerPool(4, "t-dropped")
    assert pool.submit(lambda: 1).result(WAIT_S) == 1
    ref = weakref.ref(pool)
    del pool
    gc.collect()
    assert ref() is None
    wait_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("t-dropped")],
             WAIT_S, "the dropped pool's threads to end")


def test_a_worker_the_host_refuses_to_start_is_asked_for_again(monkeypatch, caplog):
    """The host refuses the pool's first worker (``RuntimeError: can't start new thread``: a
    thread limit, a container's ``pids.max``): the keeper logs it and starts another, and
    the queued call runs. Until stop 70's review the keeper took every refusal for the
    interpreter's end and returned: the pool never started a worker again, and the call (a
    request's shielded step: its deadline could not end it) waited forever, unlogged."""
    real = threading.Thread.start
    refused: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name == "t-refused_0":
            refused.append(thread.name)
            raise RuntimeError("can't start new thread")
        real(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    caplog.set_level(logging.WARNING, logger="calexec.server")
    pool = WorkerPool(1, "t-refused")
    try:
        assert pool.submit(lambda: "ran").result(WAIT_S) == "ran"
        assert pool.workers == 1
    finally:
        pool.shutdown()
    assert refused == ["t-refused_0"]
    assert ("t-refused: cannot start a worker thread (can't start new thread; 0 running)"
            in caplog.text), caplog.text
    # (the keeper logs it once the start returned: maybe after the call ran)
    wait_for(lambda: "t-refused: worker threads start again" in caplog.text, WAIT_S,
             "the keeper's log of the worker's start")


def test_a_call_raising_stop_iteration_fails_the_awaiting_loop_with_a_runtime_error():
    """The server awaits the pool's futures on its event loop (``asyncio.wrap_future``:
    ``in_worker``, ``_release_shielded``), and an asyncio future refuses ``StopIteration``
    (``TypeError`` in the loop's callback, the awaiting future never done): a call that
    raised it left its request waiting forever (shielded: not even its deadline ended it)
    with its limiter token. Now a ``RuntimeError`` from it, as anyio's ``to_thread``
    answered before stop 70."""
    pool = WorkerPool(1, "t-pool")

    async def awaited() -> object:
        return await asyncio.wait_for(asyncio.wrap_future(pool.submit(next, iter(()))),
                                      WAIT_S)
    try:
        with pytest.raises(RuntimeError, match="a t-pool call raised StopIteration") as err:
            asyncio.run(awaited())
        assert isinstance(err.value.__cause__, StopIteration)
        assert pool.submit(sum, [1, 2]).result(WAIT_S) == 3  # the worker still serves
    finally:
        pool.shutdown()


def _submits_racing_shutdown(clock: Clock, clocks: list[_CountingClock]):
    """Two threads submit two calls each while a third shuts the pool down (its keeper and
    workers run under the explorer's scheduler too): a call ``submit`` accepted runs once, a
    later submit is refused, at no point are more than ``max_workers`` workers counted, and
    every thread ends (one left waiting is the explorer's deadlock)."""
    counting = _CountingClock(clock, "t-race")
    clocks.append(counting)
    pool = WorkerPool(2, "t-race", clock=counting)
    accepted: list[tuple[int, concurrent.futures.Future[int]]] = []
    ran: list[int] = []

    def call(n: int) -> int:
        ran.append(n)
        return n * n

    def submitter(first: int) -> None:
        for n in (first, first + 1):
            try:
                accepted.append((n, pool.submit(call, n)))
            except RuntimeError:  # (shut down first: refused, nothing of it runs)
                pass

    clock.start_thread(submitter, "submitter-a", (0,))
    clock.start_thread(submitter, "submitter-b", (10,))
    clock.start_thread(pool.shutdown, "closer")

    def final() -> bool | str:
        left = sorted(n for n, future in accepted if not future.done())
        if left:
            return f"calls submit accepted were never run: {left} (ran {sorted(ran)})"
        assert sorted(ran) == sorted(n for n, _ in accepted), (ran, accepted)
        assert all(future.result() == n * n for n, future in accepted)
        return ((pool.workers == 0 and counting.running == 0)
                or f"{pool.workers} workers counted, {counting.running} running after the "
                   f"shutdown")
    return final


class _CountingClock(Clock):
    """The explorer's clock, counting the pool's worker threads (``{prefix}_N``) running: an
    invariant reads the count at every scheduling point without the pool's lock (which a
    thread may hold there)."""

    def __init__(self, inner: Clock, prefix: str) -> None:
        self.inner, self.prefix = inner, prefix
        self.real = inner.real  # (the explorer's: not the host's; its queue, not a C one)
        self.running = self.most = 0

    def lock(self):
        return self.inner.lock()

    def condition(self, lock, name: str = ""):
        return self.inner.condition(lock, name)

    def queue(self, maxsize: int = 0):
        return self.inner.queue(maxsize)

    def start_thread(self, target, name, args=()):
        if not name.startswith(f"{self.prefix}_"):
            return self.inner.start_thread(target, name, args)

        def worker(*given):
            try:
                target(*given)
            finally:
                self.running -= 1
        self.running += 1
        self.most = max(self.most, self.running)
        return self.inner.start_thread(worker, name, args)


def _at_most_two(clocks: list[_CountingClock]):
    def invariant() -> bool | str:
        return (not clocks or clocks[-1].running <= 2
                or f"{clocks[-1].running} worker threads running, max_workers=2")
    return invariant


def test_a_call_submit_accepted_runs_even_when_a_shutdown_races_it():
    """Under the interleaving explorer (PCT schedules): a submit on one thread racing
    ``shutdown`` on another. Until stop 70's review ``submit`` counted the call under the
    pool's lock but queued it after letting go: a shutdown in between queued its workers'
    stops ahead of it, every worker ended, and the call submit had accepted never ran (its
    future never done: an awaiting request, or release, waited forever)."""
    clocks: list[_CountingClock] = []
    found = explore_threads(lambda clock: _submits_racing_shutdown(clock, clocks),
                            seeds=range(150), invariant=_at_most_two(clocks))
    assert found.failure is None, found.failure.message


def test_every_call_runs_once_on_at_most_max_workers_under_any_schedule():
    """Under the explorer: four submitters of two calls each on a pool of two, shut down
    once they are done; every schedule runs each call once, counts at most two workers at
    every scheduling point, and ends every thread (a lost wake-up, a call queued with no
    worker to run it, or a worker missing its stop, is a deadlock or a final-check failure)."""
    clocks: list[_CountingClock] = []

    def scenario(clock: Clock):
        counting = _CountingClock(clock, "t-many")
        clocks.append(counting)
        pool = WorkerPool(2, "t-many", clock=counting)
        futures: list[tuple[int, concurrent.futures.Future[int]]] = []
        gate = clock.semaphore(0)

        def submitter(first: int) -> None:
            for n in (first, first + 1):
                futures.append((n, pool.submit(lambda n=n: n + 1)))
            gate.release()

        def closer() -> None:
            for _ in range(4):
                gate.acquire()
            pool.shutdown()

        for first in (0, 10, 20, 30):
            clock.start_thread(submitter, f"submitter-{first}", (first,))
        clock.start_thread(closer, "closer")

        def final() -> bool | str:
            assert len(futures) == 8
            left = sorted(n for n, future in futures if not future.done())
            if left:
                return f"calls never run: {left}"
            assert all(future.result() == n + 1 for n, future in futures)
            return ((pool.workers == 0 and counting.running == 0)
                    or f"{pool.workers} workers counted, {counting.running} running after "
                       f"the shutdown")
        return final

    found = explore_threads(scenario, seeds=range(150), invariant=_at_most_two(clocks))
    assert max(c.most for c in clocks) == 2  # (the bound was reached: the check could fail)
    assert found.failure is None, found.failure.message


def test_bad_sizes_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="max_workers must be >= 1, got 0"):
        WorkerPool(0, "t-pool")


def _busy(emu):
    return next((e for e in (0, 1) if emu.pending(e)[1] > 0), None)


#: the defaults (bursts, inline waits) and the plain path (a worker thread per step)
PATHS = {"defaults": {}, "plain": {"inline_waits": False, "decode_bursts": False,
                                   "stream_bursts": False, "prearm_min_device_ms": 0.0}}


def _stream_tokens(response) -> list[int]:
    tokens = []
    for line in response.text.splitlines():
        if line.startswith("data: {"):
            tokens += json.loads(line[6:])["choices"][0]["token_ids"]
    return tokens


@pytest.mark.parametrize("path", PATHS)
def test_the_event_loop_starts_no_thread_for_bursts_steps_closes_or_releases(tmp_path, path):
    """Through a loopback server: from cold, 8 then 16 clients at once (non-streamed: each
    new concurrency level needs new burst threads), 8 streamed at once (their prefill and,
    on the plain path, every step: a worker thread's call), then a request whose decode job
    hangs on the (stepped) device past its deadline (its 504 leaves the sequence to a
    background release, ``release_later``). Every thread started meanwhile was started by
    another thread than the event loop's. Before stop 70 the loop started the burst threads
    (``ThreadPoolExecutor.submit``), each release's thread and anyio's worker threads."""
    executor = started_executor(tmp_path)
    emu = executor.device.emu
    app = create_app(executor, ServerConfig(max_sequences=16, **PATHS[path]))
    service = app.state.service
    try:
        with recording_thread_starts() as starts, LiveServer(app) as server:
            loop_thread = server.thread
            for clients, stream in ((8, False), (16, False), (8, True)):
                ready = threading.Barrier(clients, timeout=WAIT_S)
                answers: list = []

                def one(ready=ready, answers=answers, stream=stream):
                    ready.wait()
                    answers.append(httpx.post(f"{server.url}/v1/completions", timeout=WAIT_S,
                                              json={"prompt": [5, 6, 7], "max_tokens": 8,
                                                    "stream": stream}))
                workers = [threading.Thread(target=one) for _ in range(clients)]
                for w in workers:
                    w.start()
                for w in workers:
                    w.join(WAIT_S)
                assert [r.status_code for r in answers] == [200] * clients
                tokens = [_stream_tokens(r) if stream else r.json()["choices"][0]["token_ids"]
                          for r in answers]
                assert tokens == [oracle_tokens([5, 6, 7], 8)] * clients
            wait_for(lambda: server_idle(service), WAIT_S, "the server idle")
            # a decode job held on the device past the request's deadline: its release waits
            # for it in the background
            assert emu.set_stepped(True) == 0
            answered: list = []
            client = threading.Thread(target=lambda: answered.append(httpx.post(
                f"{server.url}/v1/completions", timeout=WAIT_S,
                json={"prompt": [1, 2, 3], "max_tokens": 3, "timeout": 3.0})))
            client.start()
            wait_for(lambda: _busy(emu) is not None, WAIT_S, "the prefill on the device")
            assert emu.step(_busy(emu), Stage.JOB)[0] == 0
            wait_for(lambda: executor.snapshot()["inflight"] == 1 and _busy(emu) is not None,
                     WAIT_S, "the decode job held on the device")
            client.join(WAIT_S)
            assert answered and answered[0].status_code == 504, answered
            wait_for(lambda: service.releases_pending == 1, WAIT_S, "the background release")
            assert emu.step(_busy(emu), Stage.JOB)[0] == 0  # the job ends: the id comes back
            wait_for(lambda: server_idle(service), WAIT_S, "the id back after the job")
            assert emu.set_stepped(False) == 0
            by_loop = [started.name for starter, started in starts.starts
                       if starter is loop_thread]
            started = [started.name for _, started in starts.starts]
        assert by_loop == [], by_loop
        assert any(n.startswith("calexec-burst_") for n in started) == (path == "defaults")
        assert any(n.startswith("calexec-worker_") for n in started), started
        assert any(n.startswith("calexec-seq-release_") for n in started), started
    finally:
        emu.set_stepped(False)
        executor.shutdown(5.0)


class _RaisingExecutor(DeviceExecutor):
    """Its ``enqueue`` raises ``StopIteration`` once ``raising`` is set (a bug of a library
    user's executor, or of one the server calls in a worker thread)."""

    raising = False

    def enqueue(self, request, logits_out=None, on_created=None):
        if self.raising:
            raise StopIteration("the executor's bug")
        return super().enqueue(request, logits_out, on_created)


@pytest.mark.parametrize("path", PATHS)
def test_a_step_raising_stop_iteration_is_a_500_not_a_wait_for_the_deadline(tmp_path, path):
    """A request whose step's call raises ``StopIteration`` in a thread (its enqueue, here)
    is answered at once with the 500 of an unexpected error, as any other exception and as
    anyio's ``to_thread`` answered it. Since stop 70 the step's thread answered through an
    asyncio future (``in_worker``; a burst's ``_settle_answer`` since stop 69), which refuses
    ``StopIteration``: the answer never came, and the request waited for its deadline (a
    504), or for ever where the wait was shielded (a sampled pick, a grammar's start)."""
    executor = started_executor(tmp_path, executor_class=_RaisingExecutor)
    app = create_app(executor, ServerConfig(max_sequences=4, **PATHS[path]))
    try:
        with LiveServer(app) as server:
            executor.raising = True
            answer = httpx.post(f"{server.url}/v1/completions", timeout=WAIT_S,
                                json={"prompt": [5, 6, 7], "max_tokens": 4, "timeout": 4.0})
            executor.raising = False
            assert answer.status_code == 500, answer.text
            assert answer.json()["error"]["code"] == "server.unexpected_error", answer.text
            ok = httpx.post(f"{server.url}/v1/completions", timeout=WAIT_S,
                            json={"prompt": [5, 6, 7], "max_tokens": 4})
            assert ok.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 4)
            wait_for(lambda: server_idle(app.state.service), WAIT_S, "the server idle")
    finally:
        executor.shutdown(5.0)


def test_the_event_loop_starts_no_thread_for_a_resume_or_a_grammar(tmp_path):
    """A request whose decode job faults (CCU exception) is resumed on a fresh sequence: the
    failed one's stream is closed and its id released from the loop's side (``resume.py``);
    a request with ``response_format`` has its grammar compiled in a worker thread
    (``openai_api``'s ``compiled``). Neither makes the event loop start a thread: both went
    to anyio's ``to_thread`` until stop 70, which starts one whenever none is idle."""
    from calexec.drivers.calrt.runtime import Fault, FaultMode
    from calexec.machines.faults import RecoveryPolicy

    executor = started_executor(tmp_path, recovery=RecoveryPolicy(max_recoveries=1000,
                                                                  drain_grace_s=1.0))
    emu = executor.device.emu
    app = create_app(executor, ServerConfig())
    service = app.state.service
    try:
        with recording_thread_starts() as starts, LiveServer(app) as server, \
                httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            loop_thread = server.thread
            assert emu.set_fault(Fault.CCU_EXCEPTION, FaultMode.NTH, 4, 0, 0) == 0
            r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 8,
                                                     "timeout": 20})
            emu.clear_all_faults()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == oracle_tokens([5, 6, 7], 8)
            metrics = client.get("/metrics").text
            assert sum(metric_value(metrics, "calexec_resumes_total", {"cause": cause}) or 0
                       for cause in ("device", "internal", "transient", "unknown")) >= 1
            shaped = client.post("/v1/completions", json={
                "prompt": [5, 6, 7], "max_tokens": 4, "timeout": 20,
                "response_format": {"type": "json_object"}})
            assert shaped.status_code == 200, shaped.text
            wait_for(lambda: server_idle(service), WAIT_S, "the server idle")
            by_loop = [started.name for starter, started in starts.starts
                       if starter is loop_thread]
        assert by_loop == [], by_loop
    finally:
        emu.clear_all_faults()
        executor.shutdown(5.0)


def test_the_event_loop_starts_no_thread_for_an_operators_calls(tmp_path):
    """``POST /admin/reload`` (its calbin check, then the model switch) and a job's page
    (``GET /debug/jobs/{id}``: its drawing, whether or not graphviz's ``dot`` is here) run
    their blocking calls in worker threads the pool's keeper starts
    (``CompletionService.operator_call``): until stop 71 they went to anyio's ``to_thread``,
    whose threads the event loop started itself, one whenever none was idle. At most
    ``OPERATOR_THREADS`` of them at once: 6 job pages asked for together all answer."""
    from calexec.drivers.serving.service import OPERATOR_THREADS

    token = "pool71-admin"
    auth = {"authorization": f"Bearer {token}"}
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token=token))
    service = app.state.service
    try:
        with recording_thread_starts() as starts, LiveServer(app) as server, \
                httpx.Client(base_url=server.url, timeout=WAIT_S) as client:
            loop_thread = server.thread
            r = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2})
            assert r.status_code == 200, r.text
            job_id = next(i for i in range(1, 1000) if executor.job_trail(i) is not None)
            generation = executor.generation.generation_id
            reload = client.post("/admin/reload", headers=auth,
                                 json={"calbin": executor.gen.calbin_path})
            assert reload.status_code == 200, reload.text
            assert executor.generation.generation_id == generation + 1
            pages: list = []
            ready = threading.Barrier(3 * OPERATOR_THREADS, timeout=WAIT_S)

            def page():
                ready.wait()
                pages.append(httpx.get(f"{server.url}/debug/jobs/{job_id}", headers=auth,
                                       timeout=WAIT_S))
            askers = [threading.Thread(target=page) for _ in range(3 * OPERATOR_THREADS)]
            for asker in askers:
                asker.start()
            for asker in askers:
                asker.join(WAIT_S)
            # the page, or the answer naming the missing ``dot``: either way, drawn in a thread
            assert len(pages) == 3 * OPERATOR_THREADS
            assert len({(p.status_code, p.headers["content-type"]) for p in pages}) == 1, pages
            wait_for(lambda: server_idle(service), WAIT_S, "the server idle")
            by_loop = [started.name for starter, started in starts.starts
                       if starter is loop_thread]
        assert by_loop == [], by_loop
    finally:
        executor.shutdown(5.0)


class _Thing:
    """An object whose life a test follows (a weak reference)."""


def _gone(ref: weakref.ref) -> bool:
    gc.collect()
    return ref() is None


def test_an_idle_worker_keeps_nothing_of_the_calls_it_ran_or_skipped():
    """A worker waiting for its next call holds no reference to the last one's arguments,
    result or future, nor to those of a call cancelled before it ran: a server's step
    returned a job handle, which holds the executor, and an app dropped without its lifespan
    (tests/test_server_appleak.py) kept its executor alive in an idle worker's frame (CI,
    stop 70). Each is waited for (bounded) to be collected while the worker waits for work."""
    pool = WorkerPool(1, "t-pool")
    try:
        given = _Thing()
        done = pool.submit(lambda thing: _Thing(), given)
        result = done.result(WAIT_S)
        refs = [weakref.ref(given), weakref.ref(result)]
        del given, result, done
        for ref in refs:
            wait_for(lambda ref=ref: _gone(ref), WAIT_S, "the call's argument and result freed")
        gate = threading.Event()
        held = pool.submit(gate.wait, WAIT_S)  # the one worker busy: the next call waits
        skipped_arg = _Thing()
        skipped = pool.submit(id, skipped_arg)
        ref = weakref.ref(skipped_arg)
        assert skipped.cancel()
        del skipped_arg, skipped
        gate.set()
        assert held.result(WAIT_S) is True
        wait_for(lambda: _gone(ref), WAIT_S, "the cancelled call's argument freed")
    finally:
        pool.shutdown()
