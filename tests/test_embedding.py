"""The embedding API (issue 25, docs/embedding.md): completion without a waiting thread
(``JobHandle.add_done_callback`` / ``as_future`` / ``wait_async``), the typed protocol of the
executor's public surface (machines/api.py) and the example server that embeds the executor
(examples/asyncio_server.py), run against the bundled emulator on loopback.

No timing threshold: every wait is bounded, and a bound that is reached fails the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import json
import logging
import signal
import sys
import threading
import types
import typing
from pathlib import Path

import pytest

from calexec.contracts.status import Phase, Status
from calexec.machines.job import InferenceResult, Job, JobHandle
from executor_harness import (
    deadline,
    decode,
    expected_greedy,
    make_executor,
    prefill,
    running_job_path,
    settle,
    until,
    write_calbin,
)
from thread_starts import recording_thread_starts

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]
BOUND_S = 30.0  # a hang guard: reaching it fails the test


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def bare_job(job_id: int = 1) -> Job:
    """A job outside any executor (its handle's callbacks and awaits need none)."""
    return Job(job_id, 1, decode(1, 5, 0), on_cancel=lambda: None)


def resolve_in_thread(job: Job, result) -> threading.Thread:
    thread = threading.Thread(target=job.resolve, args=(result,), name="resolver")
    thread.start()
    thread.join(BOUND_S)
    assert not thread.is_alive()
    return thread


DONE = Status.cancelled(Phase.CANCEL, "resolved by the test")


# ---- add_done_callback ------------------------------------------------------------------------
def test_callback_runs_once_with_its_handle_on_the_resolving_thread():
    job = bare_job()
    handle = JobHandle(job)
    calls = []
    handle.add_done_callback(lambda h: calls.append((h, threading.current_thread().name)))
    assert calls == []  # not resolved yet: nothing runs on the registering thread
    resolve_in_thread(job, DONE)
    assert calls == [(handle, "resolver")]
    assert handle.remove_done_callback(calls.append) == 0  # nothing left registered
    assert handle.pending_callbacks == 0  # run: the list (and what it referenced) is gone


def test_callback_registered_after_resolution_runs_at_once_on_the_registering_thread():
    job = bare_job()
    job.resolve(DONE)
    handle = JobHandle(job)
    calls = []
    handle.add_done_callback(lambda h: calls.append((h, threading.current_thread())))
    assert calls == [(handle, threading.current_thread())]
    handle.add_done_callback(lambda h: calls.append("again"))
    assert calls[-1] == "again" and len(calls) == 2


def test_callbacks_run_in_registration_order_and_a_raising_one_is_logged_only(caplog):
    job = bare_job(7)
    handle = JobHandle(job)
    calls = []

    def boom(h):
        calls.append("boom")
        raise RuntimeError("embedder bug")

    handle.add_done_callback(lambda h: calls.append("first"))
    handle.add_done_callback(boom)
    handle.add_done_callback(lambda h: calls.append("last"))
    with caplog.at_level(logging.ERROR, logger="calexec.job"):
        resolve_in_thread(job, DONE)  # the thread's target would raise: it must not
    assert calls == ["first", "boom", "last"]
    assert job.done and job.result == DONE.with_context(job_id=7, seq_id=1, generation=1)
    logged = [r for r in caplog.records if r.name == "calexec.job"]
    assert len(logged) == 1 and "job 7 raised" in logged[0].getMessage()
    assert logged[0].exc_info[0] is RuntimeError


def test_a_done_callback_that_is_not_callable_is_refused_where_it_is_registered(caplog):
    """``add_done_callback(5)`` (say ``handle.add_done_callback(queue)`` for ``queue.put``)
    was registered, and the job's resolution then logged ``TypeError: 'int' object is not
    callable`` on the resolving thread, far from the mistake; nothing reached the caller
    (found at stop 50 by an embedder). It raises at once, naming ``fn``; nothing is
    registered."""
    caplog.set_level(logging.ERROR, logger="calexec.job")
    job = bare_job()
    handle = JobHandle(job)
    with pytest.raises(TypeError, match=r"^add_done_callback: fn=5: expected a callable"):
        handle.add_done_callback(5)
    assert handle.pending_callbacks == 0
    job.resolve(DONE)
    assert callback_errors(caplog) == []


def test_remove_done_callback_unregisters_before_resolution():
    job = bare_job()
    handle = JobHandle(job)
    calls = []
    keep, drop = (lambda h: calls.append("keep")), (lambda h: calls.append("drop"))
    handle.add_done_callback(drop)
    handle.add_done_callback(keep)
    handle.add_done_callback(drop)
    assert handle.remove_done_callback(drop) == 2
    assert handle.remove_done_callback(drop) == 0
    job.resolve(DONE)
    assert calls == ["keep"]


def test_registration_racing_resolution_runs_every_callback_exactly_once():
    """One thread resolves jobs while another registers on them: whichever comes second
    runs the callback, never both, never neither."""
    jobs = [bare_job(i) for i in range(3000)]
    counts = [0] * len(jobs)
    start = threading.Barrier(2)

    def register():
        start.wait()
        for i, job in enumerate(jobs):
            JobHandle(job).add_done_callback(lambda h, i=i: counts.__setitem__(i, counts[i] + 1))

    def resolve():
        start.wait()
        for job in jobs:
            job.resolve(DONE)

    threads = [threading.Thread(target=register), threading.Thread(target=resolve)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(BOUND_S)
    assert not any(thread.is_alive() for thread in threads)
    assert counts == [1] * len(jobs)


# ---- as_future / wait_async -------------------------------------------------------------------
def test_wait_async_of_a_job_resolved_before_registration_returns_its_result():
    job = bare_job()
    job.resolve(DONE)
    handle = JobHandle(job)

    async def main():
        future = handle.as_future()
        assert future.done() and future.result() is job.result
        return await handle.wait_async(deadline(BOUND_S))

    assert asyncio.run(main()) is job.result
    assert handle.pending_callbacks == 0  # nothing was registered for it


def callback_errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "calexec.job" and r.levelno >= logging.ERROR]


def test_as_future_is_resolved_from_another_thread_through_the_loop(caplog):
    """The loop runs in debug mode: a future set from the resolving thread directly (not
    through ``call_soon_threadsafe``) raises asyncio's thread check there, which the callback
    guard logs."""
    caplog.set_level(logging.ERROR, logger="calexec.job")
    job = bare_job()
    handle = JobHandle(job)

    async def main():
        future = handle.as_future()
        resolver = threading.Thread(target=job.resolve, args=(DONE,), name="resolver")
        resolver.start()
        result = await asyncio.wait_for(future, BOUND_S)
        resolver.join(BOUND_S)
        return result

    assert asyncio.run(main(), debug=True) is job.result
    assert callback_errors(caplog) == []


def test_wait_async_past_its_deadline_returns_wait_deadline_and_never_cancels():
    job = bare_job()
    handle = JobHandle(job)

    async def main():
        return await handle.wait_async(deadline(0.0))

    result = asyncio.run(main())
    assert isinstance(result, Status) and result.code == "wait.deadline"
    assert not handle.cancel_requested and not handle.done
    assert handle.pending_callbacks == 0  # the registration was removed with the wait
    job.resolve(DONE)  # resolving later touches no loop (it is closed)
    assert handle.done


def test_cancelling_the_awaiting_task_leaves_the_job_and_no_registration(caplog):
    job = bare_job()
    handle = JobHandle(job)

    async def main():
        task = asyncio.create_task(handle.wait_async(None))
        await asyncio.sleep(0)  # the task registers and awaits
        assert handle.pending_callbacks == 1  # registered while it awaits
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with caplog.at_level(logging.DEBUG, logger="calexec"):
        asyncio.run(main())
        assert not handle.cancel_requested  # observing stopped; the job was not cancelled
        assert handle.pending_callbacks == 0
        job.resolve(DONE)  # after the loop closed: nothing scheduled, nothing logged
    assert handle.done and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_many_concurrent_awaits_on_executor_jobs_park_no_thread(calbin, caplog):
    """Jobs of a stepped executor stay queued until the test drives it: while the awaits are
    pending no thread was started for them (the process's other threads, which other tests
    may have left, are not judged: tests/thread_starts.py); a driver thread then
    resolves every job (callbacks on a foreign thread, loop in debug mode) and each await gets
    its own sequence's oracle token."""
    caplog.set_level(logging.ERROR, logger="calexec.job")
    n = 24
    ex = make_executor(calbin, threads=False, slots_per_kind=n)
    try:
        prompts = {seq: [seq, *PROMPT] for seq in range(1, n + 1)}
        handles = {seq: ex.enqueue(prefill(seq, prompt, seconds=BOUND_S))
                   for seq, prompt in prompts.items()}
        assert not any(handle.done for handle in handles.values())

        def drive():
            while not all(h.done for h in handles.values()):
                if not (ex.submit_one() or ex.complete_one()):
                    break

        async def main():
            with recording_thread_starts() as starts:
                tasks = {seq: asyncio.create_task(handle.wait_async(deadline(BOUND_S)))
                         for seq, handle in handles.items()}
                futures = [handle.as_future() for handle in handles.values()]
                await asyncio.sleep(0)
                assert all(handle.pending_callbacks == 2 for handle in handles.values())
            during = starts.names()
            driver = threading.Thread(target=drive, name="driver")
            driver.start()
            results = {seq: await task for seq, task in tasks.items()}
            also = await asyncio.wait_for(asyncio.gather(*futures), BOUND_S)
            driver.join(BOUND_S)
            return during, results, also

        during, results, also = asyncio.run(main(), debug=True)
        assert during == []  # n pending awaits, no thread started for any of them
        assert callback_errors(caplog) == []  # every result went through the loop
        for seq, result in results.items():
            assert isinstance(result, InferenceResult), result
            assert result.argmax == expected_greedy(prompts[seq], 0)[0]
        assert [r.argmax for r in also] == [results[seq].argmax for seq in handles]
    finally:
        ex.shutdown(grace=5.0)


def test_a_raising_callback_never_reaches_the_executor_threads(calbin, caplog):
    """A callback that raises runs on the completion thread: it is logged, the job's result
    stands, no thread fault is counted and the executor serves the next job."""
    with running_job_path(calbin) as ex, caplog.at_level(logging.ERROR, logger="calexec.job"):
        seen = []

        def boom(h):
            seen.append(threading.current_thread().name)
            raise ValueError("embedder bug")

        # registered before admission: the job cannot be resolved yet
        handle = ex.enqueue(prefill(1, PROMPT), on_created=lambda h: h.add_done_callback(boom))
        result = handle.wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result
        until(lambda: seen, what="the callback ran")  # it runs right after the waiter wakes
        assert seen == ["calexec-completion"]
        again = ex.enqueue(decode(1, result.argmax, result.kv_len)).wait_until(
            deadline(BOUND_S))
        assert isinstance(again, InferenceResult), again
        assert [result.argmax, again.argmax] == expected_greedy(PROMPT, 1)
        snap = ex.snapshot()
        assert snap["thread_faults"] == 0 and ex.health() == []
        assert any("embedder bug" in str(r.exc_info[1]) for r in caplog.records)


def test_greedy_decode_over_wait_async_matches_the_oracle(calbin):
    """The asyncio embedder's loop on the threaded executor: enqueue (off the loop: it may
    wait for admission), then ``await wait_async`` per token, several sequences at once."""
    steps = 6
    with running_job_path(calbin) as ex:
        async def one(seq: int) -> list[int]:
            loop = asyncio.get_running_loop()
            prompt = [seq, *PROMPT]
            handle = await loop.run_in_executor(None, ex.enqueue, prefill(seq, prompt))
            result = await handle.wait_async(deadline(BOUND_S))
            assert isinstance(result, InferenceResult), result
            out = [result.argmax]
            for _ in range(steps):
                request = decode(seq, out[-1], result.kv_len)
                handle = await loop.run_in_executor(None, ex.enqueue, request)
                result = await handle.wait_async(deadline(BOUND_S))
                assert isinstance(result, InferenceResult), result
                out.append(result.argmax)
            return out

        async def main():
            return await asyncio.gather(*(one(seq) for seq in (1, 2, 3)))

        for seq, tokens in zip((1, 2, 3), asyncio.run(main())):
            assert tokens == expected_greedy([seq, *PROMPT], steps)


# ---- the typed protocol (machines/api.py) -----------------------------------------------------
#: Where the implementation's annotation is wider than the protocol's (none left since stop 44:
#: DeviceExecutor now satisfies InferenceExecutor for mypy too). Any difference fails.
WIDER: dict[tuple[str, str, str], str] = {}


def _hints(obj) -> dict:
    from calexec.machines.stream import DecodeStream
    return typing.get_type_hints(obj, localns={"DecodeStream": DecodeStream})


def _is_protocol(tp) -> bool:
    return isinstance(tp, type) and getattr(tp, "_is_protocol", False)


def _compatible(want, got, seen) -> bool:
    """``got`` (the class's annotation) is what ``want`` (the protocol's) says: equal, a class
    conforming to a protocol, or the same generic/union with compatible arguments."""
    # collections.abc.Callable keeps a ``None`` return as None, typing.Callable as NoneType
    want, got = (type(None) if t is None else t for t in (want, got))
    if want == got:
        return True
    if _is_protocol(want) and isinstance(got, type):
        return not conformance(want, got, seen=seen)
    unions = (typing.Union, types.UnionType)
    w_origin, g_origin = typing.get_origin(want), typing.get_origin(got)
    if w_origin is None or not (w_origin == g_origin or {w_origin, g_origin} <= set(unions)):
        return False
    w_args, g_args = typing.get_args(want), typing.get_args(got)
    if w_origin in unions:
        return (len(w_args) == len(g_args)
                and all(any(_compatible(w, g, seen) for w in w_args) for g in g_args)
                and all(any(_compatible(w, g, seen) for g in g_args) for w in w_args))
    if len(w_args) != len(g_args):
        return False
    for w, g in zip(w_args, g_args):
        if isinstance(w, list) and isinstance(g, list):  # Callable's parameter list
            if len(w) != len(g) or not all(_compatible(a, b, seen) for a, b in zip(w, g)):
                return False
        elif not _compatible(w, g, seen):
            return False
    return True


def _members(proto) -> dict[str, object]:
    """The protocol's own members: methods, properties and annotated attributes."""
    out = {name: value for name, value in vars(proto).items()
           if not name.startswith("_") and (callable(value) or isinstance(value, property))}
    out.update({name: None for name in vars(proto).get("__annotations__", {})
                if not name.startswith("_")})
    return out


def _value_matches(value, tp) -> bool:
    options = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) \
        else (tp,)
    return any(value is None if opt is type(None)
               else _typeddict_matches(value, opt) if typing.is_typeddict(opt)
               else isinstance(value, typing.get_origin(opt) or opt) for opt in options)


def _typeddict_matches(value, tp) -> bool:
    """``value`` is a dict with exactly the keys of TypedDict ``tp`` (its required ones and
    any of its optional ones), each of the key's type."""
    if not isinstance(value, dict):
        return False
    hints = typing.get_type_hints(tp)
    return (tp.__required_keys__ <= value.keys() <= hints.keys()
            and all(_value_matches(v, hints[k]) for k, v in value.items()))


def conformance(proto, cls, instance=None, seen=None) -> list[str]:
    """Every way ``cls`` (and ``instance``, for the attributes it sets in ``__init__``)
    differs from ``proto``: a missing member, a method that became a property or async, a
    parameter renamed, moved, added or with another default, an annotation that differs
    (unless listed in ``WIDER``)."""
    seen = set() if seen is None else seen
    if (proto, cls) in seen:
        return []  # assumed while being checked (the protocols refer to each other)
    seen.add((proto, cls))
    problems = []
    for name, want in sorted(_members(proto).items()):
        where = f"{cls.__name__}.{name}"
        got = inspect.getattr_static(cls, name, None)
        if want is None:  # an attribute: a class-level member or set on the instance
            if got is None and instance is None:
                continue  # set in __init__: checked when an instance is given
            wanted = typing.get_type_hints(proto)[name]
            if instance is not None and not _value_matches(getattr(instance, name, _MISSING),
                                                           wanted):
                problems.append(f"{where}: {getattr(instance, name, _MISSING)!r} is not a "
                                f"{wanted}")
            continue
        if got is None:
            problems.append(f"{where}: missing")
            continue
        if isinstance(want, property):
            if not isinstance(got, property):
                problems.append(f"{where}: not a property")
            elif not _compatible(_hints(want.fget)["return"], _hints(got.fget)["return"], seen):
                problems.append(f"{where}: property type {_hints(got.fget)['return']}")
            continue
        if not inspect.isfunction(got):
            problems.append(f"{where}: not a method ({type(got).__name__})")
            continue
        if inspect.iscoroutinefunction(want) != inspect.iscoroutinefunction(got):
            problems.append(f"{where}: async differs")
        w_sig, g_sig = inspect.signature(want), inspect.signature(got)
        w_params = [(p.name, p.kind, p.default) for p in w_sig.parameters.values()]
        g_params = [(p.name, p.kind, p.default) for p in g_sig.parameters.values()]
        if w_params != g_params:
            problems.append(f"{where}: parameters {g_params} != {w_params}")
            continue
        w_hints, g_hints = _hints(want), _hints(got)
        for param in [*list(w_sig.parameters)[1:], "return"]:
            w, g = w_hints.get(param), g_hints.get(param)
            if (not _compatible(w, g, seen)
                    and (cls.__name__, name, param) not in WIDER):
                problems.append(f"{where}: {param} annotated {g}, the protocol says {w}")
    return problems


_MISSING = object()


def test_the_protocol_matches_the_classes_member_by_member():
    from calexec.machines.api import CompletionHandle, DecodeSteps, InferenceExecutor
    from calexec.machines.executor import DeviceExecutor
    from calexec.machines.stream import DecodeStream
    assert conformance(InferenceExecutor, DeviceExecutor) == []
    assert conformance(CompletionHandle, JobHandle) == []
    assert conformance(DecodeSteps, DecodeStream) == []
    # every allowance is still needed: a fixed annotation must leave the list
    from calexec.machines.api import InferenceExecutor as P
    for (cls, name, param), why in WIDER.items():
        want = _hints(getattr(P, name))[param]
        got = _hints(getattr(DeviceExecutor, name))[param]
        assert not _compatible(want, got, set()), f"{cls}.{name} {param}: {why} no longer"


def test_the_conformance_check_sees_a_drift():
    """A renamed parameter, a changed default, another annotation, a missing method, a
    method turned async: each is reported (the check is not vacuous)."""
    from calexec.machines.api import CompletionHandle, InferenceExecutor
    from calexec.machines.executor import DeviceExecutor

    class Renamed(DeviceExecutor):
        def release_sequence(self, seq_id: int, wait: float = 0.0) -> Status:
            return Status.OK

    class Default(DeviceExecutor):
        def shutdown(self, grace: float = 5.0) -> Status:
            return Status.OK

    class Annotated(DeviceExecutor):
        def health(self) -> list[int]:
            return []

    class Missing:
        pass

    class Async(JobHandle):
        async def cancel(self) -> bool:
            return False

    class WrongReturn(JobHandle):
        def wait_until(self, deadline: float | None) -> InferenceResult:
            raise NotImplementedError

    assert "parameters" in " ".join(conformance(InferenceExecutor, Renamed))
    assert "parameters" in " ".join(conformance(InferenceExecutor, Default))
    assert "health: return" in " ".join(conformance(InferenceExecutor, Annotated))
    # every member is missing, except annotated attributes (checked on an instance only)
    attributes = sum(1 for want in _members(InferenceExecutor).values() if want is None)
    assert len(conformance(InferenceExecutor, Missing)) == (len(_members(InferenceExecutor))
                                                            - attributes)
    assert "async differs" in " ".join(conformance(CompletionHandle, Async))
    assert "wait_until: return" in " ".join(conformance(CompletionHandle, WrongReturn))


def test_live_objects_satisfy_the_runtime_checkable_protocols(calbin):
    from calexec.machines.api import CompletionHandle, DecodeSteps, InferenceExecutor
    from calexec.machines.executor import DeviceExecutor
    from calexec.machines.stream import DecodeStream
    with running_job_path(calbin) as ex:
        assert isinstance(ex, InferenceExecutor)
        assert conformance(InferenceExecutor, DeviceExecutor, instance=ex) == []
        handle = ex.enqueue(prefill(1, PROMPT, kv_reserve_len=len(PROMPT) + 2))
        assert isinstance(handle, CompletionHandle)
        result = handle.wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result
        with ex.decode_stream(1, result.kv_len, deadline(BOUND_S), max_len=len(PROMPT) + 2
                              ) as stream:
            assert isinstance(stream, DecodeSteps)
            assert conformance(DecodeSteps, DecodeStream, instance=stream) == []
            step = stream.step(result.argmax)
            assert isinstance(step, InferenceResult), step
            assert conformance(DecodeSteps, DecodeStream, instance=stream) == []
        assert not isinstance(object(), InferenceExecutor)
        assert ex.release_sequence(1).ok


def test_snapshot_keys_and_lifecycle_states_are_the_documented_ones(calbin):
    from calexec.machines.api import LIFECYCLE_STATES, ExecutorSnapshot
    from calexec.machines.compiled import LIFECYCLE
    assert LIFECYCLE_STATES == LIFECYCLE.states
    types_ = typing.get_type_hints(ExecutorSnapshot)
    with running_job_path(calbin) as ex:
        assert ex.state in LIFECYCLE_STATES
        snap = ex.snapshot()
        assert sorted(snap) == sorted(types_)
        wrong = {key: value for key, value in snap.items()
                 if not _value_matches(value, types_[key])}
        assert wrong == {}
        assert all(isinstance(v, int) for v in snap["slots"].values())


# ---- the example: a server of the embedder's own (examples/asyncio_server.py) ----------------
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "asyncio_server.py"


def load_example():
    spec = importlib.util.spec_from_file_location("asyncio_server_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def ask(port: int, body: dict) -> tuple[list[int], dict]:
    """One request on a fresh loopback connection: (tokens streamed, the last line)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(json.dumps(body).encode() + b"\n")
        await writer.drain()
        tokens = []
        while True:
            message = json.loads(await asyncio.wait_for(reader.readline(), BOUND_S))
            if "token" not in message:
                return tokens, message
            tokens.append(message["token"])
    finally:
        writer.close()


def started_embedding(example, calbin: str, sequences: int):
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from executor_harness import MANIFEST
    executor = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(calbin_path=calbin))
    return example.Embedding(executor, sequences)


def test_example_server_serves_concurrent_clients_oracle_tokens_without_waiting_threads(
        calbin, monkeypatch):
    """Six clients at once on four sequence ids: every client gets its prompt's oracle tokens,
    ids are reused after their release, no thread ever waits for an unresolved job (every
    completion is awaited on the loop), the only threads started while serving are the fixed
    control pool's, and the drain ends the executor Stopped with every id free."""
    example = load_example()
    sequences, max_tokens = 4, 8
    blocking = []
    wait_until = JobHandle.wait_until

    def counting(self, deadline):
        if not self.done:
            blocking.append((threading.current_thread().name, self.job_id))
        return wait_until(self, deadline)

    async def main():
        embedding = started_embedding(example, calbin, sequences)
        assert (await embedding.call(embedding.ex.start)).ok
        server = example.JsonLineServer(embedding)
        await server.start()
        executor_threads = set(embedding.ex.threads_alive())
        roots = [t for t in threading.enumerate() if t.name in executor_threads]
        monkeypatch.setattr(JobHandle, "wait_until", counting)
        prompts = [[i, *PROMPT] for i in range(1, 7)]
        answers = []
        # the threads the server, its control pool or its executor started while serving
        # (not the process's: another test's leftover thread may start one meanwhile)
        with recording_thread_starts(roots) as starts:
            for answer in asyncio.as_completed([ask(server.port, {"prompt": p,
                                                                  "max_tokens": max_tokens})
                                                for p in prompts]):
                answers.append(await answer)
        added = set(starts.names())
        monkeypatch.undo()
        health = await ask(server.port, {"op": "health"})
        status = await server.drain(BOUND_S)
        return prompts, answers, added, health, status, embedding

    prompts, answers, added, health, status, embedding = asyncio.run(main())
    expected = {tuple(expected_greedy(p, max_tokens - 1)) for p in prompts}
    assert {tuple(tokens) for tokens, _ in answers} == expected  # each prompt's own tokens
    assert all(last == {"done": True, "finish_reason": "length", "tokens": tokens}
               for tokens, last in answers)
    assert blocking == []  # no thread waited for the device
    # only the fixed control pool's threads, never a thread per token or job
    assert len(added) < sequences and all(n.startswith("app-control") for n in added), added
    assert health == ([], {"ready": True, "reasons": [], "lifecycle": "Ready"})
    assert status.ok and embedding.ex.state == "Stopped"
    assert embedding.free.qsize() == sequences and not embedding.withheld


def test_example_generation_given_up_early_or_cancelled_gives_everything_back(calbin):
    """A consumer that stops after two tokens (a stop string, a disconnect) and a generation
    task cancelled while it awaits: both end with their sequence id free, nothing armed or
    leased, no token budget held; the ids then serve a full generation with oracle tokens."""
    example = load_example()

    async def main():
        embedding = started_embedding(example, calbin, 1)
        ex = embedding.ex
        assert (await embedding.call(ex.start)).ok
        try:
            far = deadline(BOUND_S)
            early = []
            async with contextlib.aclosing(embedding.generate(PROMPT, 30, frozenset(), far)) as gen:
                async for token in gen:
                    early.append(token)
                    if len(early) == 2:
                        break  # a stop string, a client gone: the rest is not wanted
            await asyncio.wait_for(asyncio.gather(*embedding.finishing), BOUND_S)
            assert embedding.free.qsize() == 1

            first = asyncio.Event()

            async def consume():
                async with contextlib.aclosing(embedding.generate(PROMPT, 30, frozenset(),
                                                                  far)) as gen:
                    async for _ in gen:
                        first.set()

            task = asyncio.create_task(consume())
            await asyncio.wait_for(first.wait(), BOUND_S)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.wait_for(asyncio.gather(*embedding.finishing), BOUND_S)
            assert embedding.free.qsize() == 1 and not embedding.withheld
            # the last job's lease goes back after its caller was woken (its permit and
            # budget before): read at once, a completion thread preempted between the two
            # (two CPU hogs) still had it InFlight. Wait (bounded) for the completion side
            snap = await embedding.call(settle, ex)
            assert snap["pending_tokens"] == 0 and snap["slots"]["Leased"] == 0, snap
            assert snap["slots"]["InFlight"] == 0 and not snap["dispatch"]["armed"]
            full = [token async for token in embedding.generate(PROMPT, 5, frozenset(), far)]
            await asyncio.wait_for(asyncio.gather(*embedding.finishing), BOUND_S)
            return early, full
        finally:
            assert (await embedding.close(BOUND_S)).ok

    early, full = asyncio.run(main())
    assert early == expected_greedy(PROMPT, 1)
    assert full == expected_greedy(PROMPT, 4)


def test_example_server_as_a_process_serves_then_drains_on_sigterm():
    """``python examples/asyncio_server.py`` as CI runs it: a request whose generation is
    still running when SIGTERM comes completes (drain within --grace), a request after it is
    refused or finds the port closed, and the process exits 0 printing ``executor Stopped``."""
    async def main():
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(EXAMPLE), "--port", "0", "--sequences", "2",
            "--device-config", "decode_us=2000", stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode()
            assert line.startswith("listening on 127.0.0.1:"), line
            port = int(line.rsplit(":", 1)[1])
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(json.dumps({"prompt": PROMPT, "max_tokens": 40}).encode() + b"\n")
            await writer.drain()
            tokens = [json.loads(await asyncio.wait_for(reader.readline(), BOUND_S))["token"]]
            proc.send_signal(signal.SIGTERM)  # mid-generation: the drain lets it finish
            while True:
                message = json.loads(await asyncio.wait_for(reader.readline(), BOUND_S))
                if "token" not in message:
                    break
                tokens.append(message["token"])
            writer.close()
            out, err = await asyncio.wait_for(proc.communicate(), 120)
            return tokens, message, proc.returncode, out.decode(), err.decode()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    tokens, last, rc, out, err = asyncio.run(main())
    assert tokens == expected_greedy(PROMPT, 39) and last["done"] is True
    assert rc == 0, (out, err)
    assert out.strip().endswith("executor Stopped"), out


# ---- docs/embedding.md's complete example, as it stands on the page ---------------------------
DOC = Path(__file__).resolve().parent.parent / "docs" / "embedding.md"


def test_the_documented_example_runs_and_yields_the_oracle_tokens(calbin, capsys):
    text = DOC.read_text(encoding="utf-8")
    block = text.split("<!-- embedding-example:start -->", 1)[1].split(
        "<!-- embedding-example:end -->", 1)[0]
    code = block.split("```python\n", 1)[1].rsplit("```", 1)[0]
    namespace = {"__name__": "embedding_example"}
    exec(compile(code, str(DOC), "exec"), namespace)  # noqa: S102 - our own documentation
    results = asyncio.run(namespace["main"](calbin))
    assert results == [expected_greedy([3, 14, 15, 92], 7), expected_greedy([65, 35, 89, 79], 7)]
    out = capsys.readouterr().out
    assert "executor Stopped: ok" in out and "withheld" not in out


def test_the_documented_example_type_checks_with_mypy_strict(tmp_path, monkeypatch):
    """The page says "type your code against them": its complete example, which passes a
    ``DeviceExecutor`` where ``InferenceExecutor`` is expected, and examples/asyncio_server.py
    must pass ``mypy --strict`` against the package as installed (py.typed; the layer folders
    under calexec/, linked as .ci/lint does). Found at stop 44: the snapshot and stop_tokens
    annotations made DeviceExecutor no InferenceExecutor for mypy, and both examples had
    untyped helpers."""
    api = pytest.importorskip("mypy.api")
    root = DOC.parent.parent
    package = tmp_path / "site" / "calexec"
    package.mkdir(parents=True)
    for f in [*(root / "calexec").glob("*.py"), root / "calexec" / "py.typed"]:
        (package / f.name).symlink_to(f)
    for layer in ("contracts", "machines", "drivers"):
        (package / layer).symlink_to(root / layer, target_is_directory=True)
    text = DOC.read_text(encoding="utf-8")
    block = text.split("<!-- embedding-example:start -->", 1)[1].split(
        "<!-- embedding-example:end -->", 1)[0]
    example = tmp_path / "example.py"
    example.write_text(block.split("```python\n", 1)[1].rsplit("```", 1)[0], encoding="utf-8")
    monkeypatch.setenv("MYPYPATH", str(tmp_path / "site"))
    server = root / "examples" / "asyncio_server.py"  # the page's other example
    # mypy's main raises the interpreter's recursion limit to 2**14 and leaves it: every later
    # test in the process then parsed JSON 3000 deep that the server refuses at Python's
    # default (test_server_httpfuzz's deep reload body), so it is put back
    limit = sys.getrecursionlimit()
    try:
        out, err, rc = api.run(["--strict", "--follow-imports=silent", "--config-file=",
                                f"--cache-dir={tmp_path / 'mypy-cache'}", str(example),
                                str(server)])
    finally:
        sys.setrecursionlimit(limit)
    assert rc == 0, out + err


def test_decode_sync_past_its_deadline_returns_once_the_cancelled_job_let_go(calbin):
    """decode_sync gives the caller no handle, so when the deadline passes with the job on
    the device it waits (bounded) for the job it cancelled: the sequence can be released at
    once afterwards (not ``kv.sequence_busy``), and the Status says the job was cancelled,
    not that it continues (found at stop 44 by an embedder)."""
    # a 59-token prefill at 20 ms a token runs on the device long past its 50 ms deadline
    with running_job_path(calbin, device_config="prefill_per_token_us=20000") as ex:
        tokens = list(range(1, 60))
        code, status = ex.decode_sync(prefill(7, tokens, seconds=0.05, kv_reserve_len=63))
        assert code == 2 and isinstance(status, Status), status
        assert status.code == "wait.deadline" and status.seq_id == 7
        assert "cancelled" in status.message and "continues" not in status.message
        released = ex.release_sequence(7)
        assert released.ok, released


def test_the_package_ships_py_typed_so_a_users_mypy_reads_its_annotations():
    """PEP 561: without ``calexec/py.typed`` a user's ``mypy --strict`` refuses every
    ``calexec`` import ("missing library stubs or py.typed marker"), so the typed protocols
    of machines/api.py never reach the embedder (found at stop 44 by an embedder)."""
    import importlib.resources
    import tomllib
    assert (importlib.resources.files("calexec") / "py.typed").is_file()
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["calexec"]


def test_a_stream_step_with_no_generation_is_unavailable_not_an_invalid_token(calbin):
    """With no model generation (here: after shutdown; also between two during a switch) a
    stream's step used to answer ``request.invalid`` "token=1: outside [0, vocab_size=0)",
    a 400 blaming a valid token. It is ``lifecycle.unavailable`` (503: retry elsewhere), as
    ``enqueue`` answers then (found at stop 44 by an embedder). Since stop 58 a stream
    opened after shutdown is returned closed with that Status (the shutdown named, as
    ``enqueue`` names it), so even ``submit_nowait`` answers it at once."""
    with running_job_path(calbin) as ex:
        assert ex.shutdown(grace=5.0).ok
        stream = ex.decode_stream(1, 0, deadline(BOUND_S))
        assert stream.closed
        step = stream.step(1)
        assert isinstance(step, Status), step
        assert (step.code, step.category.name, step.seq_id) == (
            "lifecycle.unavailable", "UNAVAILABLE", 1), step
        assert "shutdown() called" in step.message, step
        assert stream.submit(1) is step  # the closed stream keeps its reason
        assert stream.submit_nowait(1) is step


def test_a_second_start_raises_at_once_and_the_executor_serves_on(calbin):
    """``start()`` is called once (docs/embedding.md section 1). A second call used to open
    a second device and configure generation 2 over the first one's handles before the
    lifecycle chart raised IllegalTransition, leaking the first device. It raises a
    RuntimeError naming the call and touches nothing: the executor serves on generation 1 and
    shuts down cleanly (found at stop 44 by an embedder)."""
    with running_job_path(calbin) as ex:
        with pytest.raises(RuntimeError, match=r"start\(\) called a second time"):
            ex.start()
        assert ex.state == "Ready" and ex.health() == []
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result
        assert result.argmax == expected_greedy(PROMPT, 0)[0]
        assert result.generation == 1 == ex.snapshot()["generation"]
        assert ex.release_sequence(1, 1.0).ok
        status = ex.shutdown(grace=5.0)
        assert status.ok and ex.state == "Stopped", status
        with pytest.raises(RuntimeError, match="second time"):
            ex.start()  # after shutdown too: nothing reopened


def test_shutdown_before_start_ends_stopped_and_start_then_refuses(calbin):
    """An embedder whose own start-up failed before it called ``start()`` (a config check, a
    port in use) calls ``shutdown()`` on the way out. Nothing was opened, so that is an
    orderly exit: the lifecycle ends ``Stopped`` (``Configuring -> Stopped`` guarded by
    ``never_opened``), not ``Failed``, which a supervisor reads as a broken device. A
    ``start()`` after it raises naming the shutdown and opens nothing (found at stop 44, fixed
    at stop 46)."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST

    ex = DeviceExecutor(CalRT.load(), MANIFEST, ExecutorConfig(calbin_path=str(calbin)),
                        fault_sink=RecordingFaultSink())
    status = ex.shutdown(grace=1.0)
    assert status.ok, status
    assert ex.state == "Stopped" and ex.failure is None
    assert ex.shutdown(grace=1.0).ok and ex.state == "Stopped"  # idempotent
    with pytest.raises(RuntimeError, match=r"start\(\) called after shutdown\(\)"):
        ex.start()
    assert ex.state == "Stopped" and ex.device is None
    assert ex.snapshot()["generation"] in (0, None)


def test_decode_sync_waits_for_its_cancelled_job_as_long_as_the_execution_deadline_allows(
        calbin):
    """The wait for the job decode_sync cancelled at its deadline is bounded by that job's
    §9.1 execution deadline (``execution_timeout_s`` + per token, + ``timeout_grace_s``), by
    which the completion thread resolves it whatever the device does. It used to be a fixed
    10 s: a job the device finishes 12 s after the deadline (a slow prefill; an operator's
    ``execution_timeout_s=60`` for a slow model) made decode_sync return "still on its way"
    and the caller's ``release_sequence`` fail ``kv.sequence_busy`` (stop 44's leftover)."""
    # 59 tokens at 200 ms a token: about 11.8 s on the device, past a 50 ms deadline (set once
    # the executor started: in the device config the warm-up's golden prefill took 3.4 s more)
    with running_job_path(calbin, execution_timeout_s=60.0) as ex:
        assert ex.device.emu.set_knob("prefill_per_token_us", 200_000) == 0
        code, status = ex.decode_sync(prefill(8, list(range(1, 60)), seconds=0.05,
                                              kv_reserve_len=63))
        assert code == 2 and isinstance(status, Status), status
        assert "still on its way" not in status.message, status
        released = ex.release_sequence(8)
        assert released.ok, released


@pytest.mark.parametrize(("field", "value", "error"), [
    ("calbin_path", 123, TypeError),
    ("calbin_path", None, TypeError),
    ("device_config", 5, TypeError),
    ("execution_timeout_s", -1.0, ValueError),
    ("execution_timeout_s", float("nan"), ValueError),
    ("execution_timeout_s", float("inf"), ValueError),
    ("execution_timeout_s", "30", TypeError),
    ("execution_timeout_per_token_s", -0.001, ValueError),
    ("timeout_grace_s", float("nan"), ValueError),
    ("downgrade_window_s", -1, ValueError),
    ("golden_timeout_s", 0, ValueError),
    ("fence_grace_s", float("inf"), ValueError),
    ("slots_per_kind", 10**9, ValueError),
    ("slots_per_kind", True, TypeError),
    ("max_pending_tokens", 2.5, TypeError),
    ("golden_tokens", (), ValueError),
    ("golden_tokens", (1, -5), ValueError),
    ("golden_decode_steps", -1, ValueError),
    ("golden_seq_id", -1, ValueError),
    ("goldens", None, TypeError),
    ("goldens", {"sha": "abc"}, ValueError),
    ("recovery", None, TypeError),
    ("tuning", None, TypeError),
    ("threads", "no", TypeError),
])
def test_a_nonsensical_executor_config_is_refused_at_construction_naming_the_field(
        field, value, error):
    """``ExecutorConfig`` refuses a wrong type or an out-of-range value when it is built, with
    an error naming the field and the value. Before, most fields took anything: a str or None
    calbin path or an int device config raised from deep inside ``start()`` (and the executor
    then shut down ``Failed``); a NaN or infinite execution timeout killed the completion
    thread and ``start()`` hung 20 s; a negative one failed every job; ``tuning=None`` sent
    the submitter into an endless fault/recovery loop; ``slots_per_kind=10**9`` exhausted
    memory (found at stop 50 by an embedder)."""
    from calexec.machines.executor import ExecutorConfig

    with pytest.raises(error, match=rf"ExecutorConfig\.{field}(\[.*\])?="):
        ExecutorConfig(**{"calbin_path": "model.calbin", field: value})
    config = ExecutorConfig(calbin_path="model.calbin")
    with pytest.raises(error, match=rf"ExecutorConfig\.{field}(\[.*\])?="):
        setattr(config, field, value)  # attrs runs the same check on assignment


def test_a_pathlike_calbin_path_is_taken_as_its_str(calbin):
    from calexec.machines.executor import ExecutorConfig

    assert ExecutorConfig(calbin_path=Path(calbin)).calbin_path == str(calbin)


def test_waits_take_an_infinite_deadline_and_refuse_a_nan_one_naming_it():
    """``result(math.inf)`` and ``wait_until(math.inf)`` wait without a limit, as None does.
    Before, they raised ``OverflowError: timestamp out of range for platform time_t`` from
    ``threading.Event.wait``; a NaN deadline or timeout returned a ``wait.deadline`` Status at
    once, for a deadline that never was (NaN compares false with every time). A NaN or a
    non-number is the caller's bug: ValueError or TypeError naming the call and the argument
    (found at stop 50 by an embedder)."""
    import math

    job = bare_job()
    handle = JobHandle(job)
    timer = threading.Timer(0.2, job.resolve, args=(DONE,))
    timer.start()
    try:
        assert handle.result(math.inf) is job.result
    finally:
        timer.join(BOUND_S)
    assert handle.wait_until(math.inf) is job.result
    assert handle.result(1e12) is job.result  # beyond threading.TIMEOUT_MAX: no limit either
    import numpy as np
    assert handle.result(np.float32(0.5)) is job.result  # a numpy number is seconds too
    assert handle.wait_until(np.float64(deadline(1.0))) is job.result

    pending = JobHandle(bare_job(2))
    with pytest.raises(ValueError, match=r"JobHandle\.wait_until: deadline=nan"):
        pending.wait_until(math.nan)
    with pytest.raises(ValueError, match=r"JobHandle\.result: timeout=nan"):
        pending.result(math.nan)
    with pytest.raises(TypeError, match=r"JobHandle\.result: timeout='5'"):
        pending.result("5")
    with pytest.raises(ValueError, match=r"JobHandle\.wait_async: deadline=nan"):
        asyncio.run(pending.wait_async(math.nan))


def test_decode_sync_of_something_not_a_request_is_a_status_like_enqueue(calbin):
    """``enqueue("x")`` answers ``request.invalid``; ``decode_sync("x")`` raised
    ``AttributeError: 'str' object has no attribute 'deadline'`` (found at stop 50 by an
    embedder). It answers llama.cpp's -1 and the same Status, and the executor serves on."""
    with running_job_path(calbin) as ex:
        for bad in ("x", None):
            code, status = ex.decode_sync(bad)
            assert code == -1 and isinstance(status, Status), status
            assert status.code == "request.invalid" and "InferenceRequest" in status.message
        code, result = ex.decode_sync(prefill(1, PROMPT))
        assert code == 0 and result.argmax == expected_greedy(PROMPT, 0)[0]
        assert ex.release_sequence(1, 1.0).ok
        snap = ex.snapshot()
        assert snap["queued"] == snap["inflight"] == snap["pending_tokens"] == 0


def test_release_sequence_refuses_what_is_no_sequence_id_naming_it(calbin):
    """``release_sequence("1")`` (an id read from JSON), ``-1`` or ``True`` answered OK, since
    the KvManager holds no such id, while the KV of sequence 1 stayed held: the caller put the
    id back on its free list and its next prefill on 1 was refused ``kv.sequence_busy`` or
    rewound another request's KV (found at stop 50 by an embedder). They are
    ``request.invalid`` naming ``seq_id``; a NaN or infinite ``wait_s`` too, naming it."""
    import math

    with running_job_path(calbin) as ex:
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result
        for bad in ("1", -1, True, 2**40, None, 1.0):
            status = ex.release_sequence(bad)
            assert status.code == "request.invalid", (bad, status)
            assert f"seq_id={bad!r}" in status.message and status.category.value == "invalid_request"
        for bad_wait in (math.nan, math.inf, "1", -1, -0.5):  # (a negative: stop 68)
            status = ex.release_sequence(1, bad_wait)
            assert status.code == "request.invalid" and "wait_s=" in status.message, status
        import numpy as np
        assert ex.release_sequence(7, np.float32(0.1)).ok  # a numpy number is seconds too
        # sequence 1 still holds its KV: its next decode goes on from it
        step = ex.enqueue(decode(1, result.argmax, result.kv_len)).wait_until(deadline(BOUND_S))
        assert isinstance(step, InferenceResult), step
        assert step.argmax == expected_greedy(PROMPT, 1)[1] and step.kv_len == len(PROMPT) + 1
        assert ex.release_sequence(1, 1.0).ok


def test_a_device_config_the_runtime_refuses_is_named_in_starts_status(calbin):
    """``ExecutorConfig(device_config="decode_us=20000;prefill_us=50000")`` (a key the
    emulator does not have: it is ``prefill_per_token_us``) made ``start()`` answer
    ``CalRT configure returned 5 (INVALID_CONFIG): device open``, naming neither the setting
    nor its value (``calexec serve --device-config`` names the refused item; an embedder had
    nothing to go on). The Status names ``device_config`` and its value (found at stop 50 by
    an embedder)."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST

    bad = "decode_us=20000;prefill_us=50000"
    ex = DeviceExecutor(CalRT.load(), MANIFEST,
                        ExecutorConfig(calbin_path=str(calbin), device_config=bad),
                        fault_sink=RecordingFaultSink())
    status = ex.start()
    assert status.code == "calrt.configure_failed" and status.raw == 5, status
    assert f"device_config={json.dumps(bad)}" in status.message, status.message
    assert ex.state == "Failed"
    assert ex.shutdown(grace=1.0).code == status.code


def test_shutdown_with_a_grace_that_is_no_seconds_raises_naming_it_and_changes_nothing(calbin):
    """``shutdown(None)`` (meant: the default) and ``shutdown("5")`` raised ``'>' not
    supported between instances of 'float' and 'NoneType'``; ``shutdown(math.inf)``
    ``OverflowError: timestamp out of range``; ``shutdown(math.nan)`` took the NaN, whose
    every bound compares false (found at stop 50 by an embedder); ``shutdown(-1)`` (-1: "no
    limit" to ``threading.Lock.acquire``) was taken as 0, and cancelled at once the jobs it was
    meant to drain (stop 68). Each raises naming
    ``grace`` before anything is stopped: the executor still serves, and a later
    ``shutdown(5.0)`` ends Stopped."""
    import math

    with running_job_path(calbin) as ex:
        for bad, error in ((None, TypeError), ("5", TypeError), (math.inf, ValueError),
                           (math.nan, ValueError), (-1, ValueError), (-0.5, ValueError)):
            with pytest.raises(error, match=rf"^shutdown: grace={bad!r}: expected"):
                ex.shutdown(bad)
            assert ex.state == "Ready" and ex.health() == []
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult) and result.argmax == expected_greedy(
            PROMPT, 0)[0]
        assert ex.release_sequence(1, 1.0).ok
        status = ex.shutdown(5.0)
        assert status.ok and ex.state == "Stopped", status


def test_a_device_executor_built_from_the_wrong_things_raises_naming_them(calbin):
    """``DeviceExecutor(runtime, manifest, {"calbin_path": ...})`` raised ``'dict' object has
    no attribute 'tuning'``; a manifest path (a str) or a None runtime were taken, and
    ``start()`` then raised ``AttributeError: 'str' object has no attribute 'resolve'`` from
    deep inside, leaving the lifecycle ``Configuring``, and ``shutdown()`` answered
    ``shutdown.not_drained`` as if a job had hung (found at stop 50 by an embedder). Each is a
    TypeError naming the argument when the executor is built."""
    from calexec.contracts.manifest import default_manifest_path
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from executor_harness import MANIFEST

    config = ExecutorConfig(calbin_path=str(calbin))
    cases = [
        ((CalRT.load(), MANIFEST, {"calbin_path": str(calbin)}),
         r"^DeviceExecutor: config=\{'calbin_path': .*: expected an ExecutorConfig, got dict "
         r"\(build one"),
        ((CalRT.load(), str(default_manifest_path()), config),
         r"^DeviceExecutor: manifest='.*': expected a Manifest \(load_manifest\(path\)\)"),
        ((CalRT.load(), None, config), r"^DeviceExecutor: manifest=None"),
        ((None, MANIFEST, config), r"^DeviceExecutor: runtime=None: expected a loaded runtime"),
        ((CalRT, MANIFEST, config), r"^DeviceExecutor: runtime=<class .*: expected a loaded"),
    ]
    for args, match in cases:
        with pytest.raises(TypeError, match=match):
            DeviceExecutor(*args)
    ex = DeviceExecutor(CalRT.load(), MANIFEST, config)
    try:
        assert ex.start().ok
    finally:
        assert ex.shutdown(5.0).ok


class _RaisingRuntime:
    """A runtime shim that raises instead of returning a code: at ``open_device``, or (with
    ``after_open``) at the open device's ``load_calbin``."""

    def __init__(self, after_open: bool) -> None:
        from calexec.drivers.calrt.runtime import CalRT
        self._runtime, self.after_open, self.closed = CalRT.load(), after_open, 0

    def open_device(self, config: str):
        if not self.after_open:
            raise RuntimeError("vendor shim: no device node")
        rc, device = self._runtime.open_device(config)
        shim = self

        class Device:
            def __getattr__(self, name: str):
                return getattr(device, name)

            def load_calbin(self, path):
                raise OSError("vendor shim: calbin read failed")

            def close(self):
                shim.closed += 1
                return device.close()
        return rc, Device()

    def __getattr__(self, name: str):
        return getattr(self._runtime, name)


@pytest.mark.parametrize("after_open", [False, True])
def test_a_runtime_that_raises_in_start_ends_failed_with_a_status(calbin, after_open, caplog):
    """A runtime shim that raises in ``start()`` (``open_device``, or the open device's
    ``load_calbin``) escaped ``start()`` as that exception and left the lifecycle
    ``Configuring``; ``shutdown()`` then answered ``shutdown.not_drained`` (DEVICE: "a job
    did not end", exit 3 in ``calexec serve``'s terms) for an executor that never ran a job
    (found at stop 50 by an embedder). ``start()`` answers ``internal.start_exception`` naming
    the error, the lifecycle is ``Failed``, the device opened is closed, and ``shutdown()``
    answers start's Status, as docs/embedding.md section 6 says."""
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST

    caplog.set_level(logging.CRITICAL, logger="calexec")
    runtime = _RaisingRuntime(after_open)
    ex = DeviceExecutor(runtime, MANIFEST, ExecutorConfig(calbin_path=str(calbin)),
                        fault_sink=RecordingFaultSink())
    status = ex.start()
    assert status.code == "internal.start_exception", status
    error = "OSError: vendor shim: calbin" if after_open else "RuntimeError: vendor shim"
    assert status.message.startswith(f"start raised {error}"), status.message
    assert ex.state == "Failed" and ex.failure is not None
    assert runtime.closed == (1 if after_open else 0)
    assert ex.shutdown(grace=1.0).code == "internal.start_exception"
    assert ex.state == "Failed" and not ex.threads_alive().get("calexec-submitter", False)


def test_a_golden_seq_id_the_kv_manager_refuses_is_named_as_the_setting(calbin):
    """``ExecutorConfig(golden_seq_id=999)`` on a KvManager of 64 ids made ``start()`` answer
    ``CalRT admission returned 4 (INVALID_VALUE): KvManager release of seq 999``: an id the
    embedder never sent, with nothing saying it is the warm-up's setting (found at stop 50 by
    an embedder). The Status names ``ExecutorConfig.golden_seq_id=999``."""
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.executor import DeviceExecutor, ExecutorConfig
    from calexec.machines.faults import RecordingFaultSink
    from executor_harness import MANIFEST

    ex = DeviceExecutor(CalRT.load(), MANIFEST,
                        ExecutorConfig(calbin_path=str(calbin), golden_seq_id=999),
                        fault_sink=RecordingFaultSink())
    status = ex.start()
    assert not status.ok and ex.state == "Failed", status
    assert status.message.startswith("golden run on ExecutorConfig.golden_seq_id=999: "), status
    assert ex.shutdown(grace=1.0).code == status.code


def test_a_bool_is_no_sequence_id_position_or_request_id(calbin):
    """``InferenceRequest(seq_id=True)`` was sequence 1 (``operator.index(True)`` is 1): an
    embedder's flag passed where an id belongs decoded on, and committed KV to, another
    request's sequence (found at stop 51, ``decode_stream(True, ...)``). A bool is refused
    for every int field of a request, naming it, as a str is."""
    import numpy as np

    from calexec.contracts.prepare import InferenceRequest
    from calexec.contracts.types import TaskKind

    for field, value in (("seq_id", True), ("seq_id", [1, False]), ("past_len", False),
                         ("request_id", True), ("kv_reserve_len", True),
                         ("want_logits", (0, True))):
        fields = {"seq_id": 1, "kind": TaskKind.DECODE, "tokens": np.ones(1, np.int32),
                  "positions": np.zeros(1, np.int32),
                  "past_len": 0,
                  "deadline": deadline(BOUND_S), field: value}
        with pytest.raises(TypeError, match=f"InferenceRequest.{field}="):
            InferenceRequest(**fields)
    with running_job_path(calbin) as ex:
        with pytest.raises(TypeError, match="InferenceRequest.seq_id=True"):
            ex.decode_stream(True, 0, deadline(BOUND_S))
        snap = ex.snapshot()
        assert snap["queued"] == snap["inflight"] == snap["pending_tokens"] == 0


def test_a_decode_stream_whose_first_step_cannot_be_valid_is_closed_when_made(calbin):
    """``decode_stream(-1, 0, ...)`` (or a ``past_len`` beyond ``max_seq``, a NaN deadline)
    returned an open stream with nothing armed; the request's own check answered only at
    the first ``submit`` (found at stop 50). Every step of such a stream is refused the same
    way, so the stream is closed when it is made, its ``status`` the check's
    ``request.invalid`` naming the value, and ``submit`` answers that status."""
    import math

    with running_job_path(calbin) as ex:
        for seq, past, dl, named in ((-1, 0, deadline(BOUND_S), "seq_id=-1"),
                                     (1, -5, deadline(BOUND_S), "past_len=-5"),
                                     (1, 10**9, deadline(BOUND_S), "past_len=1000000000"),
                                     (1, 0, math.nan, "deadline=nan")):
            stream = ex.decode_stream(seq, past, dl)
            assert stream.closed, (seq, past, dl)
            assert stream.status is not None and stream.status.code == "request.invalid"
            assert named in stream.status.message, stream.status
            assert stream.submit(5) is stream.status
        # a stream whose first step is only not armable now (no reason of the caller's)
        # stays open: a valid one decodes
        result = ex.enqueue(prefill(1, PROMPT)).wait_until(deadline(BOUND_S))
        assert isinstance(result, InferenceResult), result
        stream = ex.decode_stream(1, result.kv_len, deadline(BOUND_S))
        assert not stream.closed
        step = stream.step(result.argmax)
        assert isinstance(step, InferenceResult) and step.argmax == expected_greedy(PROMPT, 1)[1]
        stream.close()
        assert ex.release_sequence(1, 1.0).ok
        snap = ex.snapshot()
        assert snap["queued"] == snap["inflight"] == snap["pending_tokens"] == 0


# ---- docs/embedding.md section 5: the control core's loggers ----------------------------------
CORE_DIRS = ("machines", "contracts", "drivers/calrt")


def _core_logging_calls() -> tuple[set[str], list[str]]:
    """The logger names the control core creates (``logging.getLogger("...")``, or a
    module's ``__name__``), and every ``print(...)`` or handler set-up call in it."""
    import ast

    root = DOC.parent.parent
    names: set[str] = set()
    offences: list[str] = []
    for folder in CORE_DIRS:
        for path in sorted((root / folder).rglob("*.py")):
            module = "calexec." + ".".join(path.relative_to(root).with_suffix("").parts)
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                if not isinstance(node, ast.Call):
                    continue
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                where = f"{path.relative_to(root)}:{node.lineno}"
                if called == "getLogger":
                    arg = node.args[0] if node.args else None
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                        names.add(arg.value)
                    elif isinstance(arg, ast.Name) and arg.id == "__name__":
                        names.add(module)
                    else:
                        offences.append(f"{where}: getLogger of no fixed name")
                elif called in ("print", "basicConfig", "addHandler"):
                    offences.append(f"{where}: {called}()")
    return names, offences


def test_the_documented_loggers_are_the_ones_the_control_core_logs_on():
    """An embedder routes the core's lines by logger name (its faults to alerting, say), and
    the page named only ``calexec.job``: found at stop 67 embedding the executor, the names
    were to be read from the source. The page's list is the core's loggers, each a child of
    ``calexec``; the core never prints nor installs a handler of its own."""
    text = DOC.read_text(encoding="utf-8")
    listed_block = text.split("<!-- embedding-loggers:start -->", 1)[1].split(
        "<!-- embedding-loggers:end -->", 1)[0]
    listed = {line.split("`", 2)[1] for line in listed_block.splitlines()
              if line.strip().startswith("- `")}
    names, offences = _core_logging_calls()
    assert not offences
    assert names and all(name.startswith("calexec.") for name in names)
    assert listed == names, (sorted(listed - names), sorted(names - listed))
