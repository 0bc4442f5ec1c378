"""Shared helpers for executor tests: a started DeviceExecutor on the bundled emulator, request
builders, and the numpy oracle's expectation for a sequence."""

from __future__ import annotations

import inspect
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.calrt.runtime import CalRT, Fault, FaultMode
from calexec.drivers.synthetic import calbin as cb
from calexec.drivers.synthetic import oracle
from calexec.machines.executor import DeviceExecutor, ExecutorConfig

SEED = cb.default_spec().seed
MANIFEST = load_manifest(default_manifest_path())


def oracle_golden(seed: int, config: ExecutorConfig | None = None) -> tuple[int, ...]:
    """The §9.2 warm-up tokens of a synthetic calbin of ``seed``, from the numpy oracle (an
    independent expectation, used to pin a golden for calbins the packaged file does not)."""
    config = config or ExecutorConfig(calbin_path="")
    ref = oracle.OracleSequence(seed)
    ref.run(list(config.golden_tokens))
    out = [ref.next_token()]
    for _ in range(config.golden_decode_steps):
        ref.run([out[-1]])
        out.append(ref.next_token())
    return tuple(out)


#: the child's side of :func:`golden_deadline_default`: Python run before ``calexec`` in a
#: subprocess (``python -c``), ``{seconds}`` to format in
GOLDEN_DEADLINE_PRE = (f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); "
                       "import executor_harness; executor_harness.golden_deadline_default({seconds})")


def golden_deadline_default(seconds: float):
    """Make ``seconds`` the default of ``ExecutorConfig.golden_timeout_s`` (10 s) for every
    config made in this process from now on, the product's own (``calexec golden record``,
    ``demo``, ``serve``) included; returns the undo. A test of a warm-up slower than the golden
    deadline proves the same against a 1 s deadline as against 10 s, in a tenth of the time."""
    init = ExecutorConfig.__init__
    old = init.__defaults__
    defaulted = [p.name for p in inspect.signature(init).parameters.values()
                 if p.kind is p.POSITIONAL_OR_KEYWORD and p.default is not p.empty]
    assert old is not None and len(defaulted) == len(old), (defaulted, old)
    index = defaulted.index("golden_timeout_s")
    init.__defaults__ = (*old[:index], float(seconds), *old[index + 1:])
    assert ExecutorConfig(calbin_path="model.calbin").golden_timeout_s == seconds

    def undo() -> None:
        init.__defaults__ = old
    return undo


@contextmanager
def short_golden_deadline(seconds: float = 1.0):
    """:func:`golden_deadline_default` for the ``with`` block."""
    undo = golden_deadline_default(seconds)
    try:
        yield
    finally:
        undo()


def write_calbin(directory: Path) -> str:
    path = directory / "qwen3_synthetic.calbin"
    cb.write(str(path), cb.default_spec())
    return str(path)


def make_executor(calbin_path: str, device_config: str = "", fault_sink=None, clock=None,
                  **config) -> DeviceExecutor:
    """A started executor (asserts start succeeded). ``fault_sink``: None gives the real
    FaultController; job-path tests pass a ``RecordingFaultSink`` so no recovery runs.
    ``clock``: the executor's (None: the system's)."""
    config.setdefault("check_lock_order", True)
    config.setdefault("strict_lock_order", False)
    executor = DeviceExecutor(CalRT.load(), MANIFEST,
                              ExecutorConfig(calbin_path=calbin_path, device_config=device_config,
                                             **config), fault_sink=fault_sink,
                              **({} if clock is None else {"clock": clock}))
    status = executor.start()
    assert status.ok, status
    return executor


@contextmanager
def running_executor(calbin_path: str, device_config: str = "", **config):
    executor = make_executor(calbin_path, device_config, **config)
    try:
        yield executor
    finally:
        if not executor.lifecycle.final:
            executor.shutdown(grace=5.0)


def running_job_path(calbin_path: str, device_config: str = "", **config):
    """The job path alone: a passive fault sink, so no recovery interferes (recovery has its
    own tests in test_recovery.py)."""
    from calexec.machines.faults import RecordingFaultSink
    config.setdefault("fault_sink", RecordingFaultSink())
    return running_executor(calbin_path, device_config, **config)


def deadline(seconds: float = 10.0) -> float:
    return time.monotonic() + seconds


def prefill(seq: int, tokens, past: int = 0, seconds: float = 10.0, **kw) -> InferenceRequest:
    tokens = np.asarray(tokens, dtype=np.int32)
    return InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=tokens,
                            positions=np.arange(past, past + len(tokens), dtype=np.int32),
                            past_len=past, deadline=deadline(seconds), **kw)


def decode(seq: int, token: int, past: int, seconds: float = 10.0, **kw) -> InferenceRequest:
    return InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                            tokens=np.asarray([token], dtype=np.int32),
                            positions=np.asarray([past], dtype=np.int32), past_len=past,
                            deadline=deadline(seconds), **kw)


def expected_greedy(prompt, steps: int) -> list[int]:
    """The oracle's greedy tokens: first from the prefill, then ``steps`` decodes."""
    ref = oracle.OracleSequence(SEED)
    ref.run(list(prompt))
    out = [ref.next_token()]
    for _ in range(steps):
        ref.run([out[-1]])
        out.append(ref.next_token())
    return out


def greedy(executor: DeviceExecutor, seq: int, prompt, steps: int) -> list[int]:
    result = executor.enqueue(prefill(seq, prompt)).wait_until(deadline())
    assert not isinstance(result, Status), result
    out, past = [result.argmax], result.kv_len
    for _ in range(steps):
        result = executor.enqueue(decode(seq, out[-1], past)).wait_until(deadline())
        assert not isinstance(result, Status), result
        out.append(result.argmax)
        past = result.kv_len
    return out


def arm(executor: DeviceExecutor, point: str, mode: str = "NTH", param: int = 1, rc: int = 0,
        seed: int = 0) -> None:
    assert executor.device.emu.set_fault(Fault[point], FaultMode[mode], param, seed, rc) == 0


def fired(executor: DeviceExecutor, point: str) -> int:
    rc, _calls, count = executor.device.emu.fault_stats(Fault[point])
    assert rc == 0
    return count


def jobs_on_device(executor: DeviceExecutor, jobs: int) -> bool:
    """The device holds ``jobs`` jobs (queued or running on its engines): the emulator's own
    count, not the executor's completion queue, which still holds the start's last golden
    job for a moment after ``start()`` returned. False before the device is opened."""
    if executor.device is None:
        return False
    held = 0
    for engine in (0, 1):
        rc, count, _stage = executor.device.emu.pending(engine)
        held += count if rc == 0 else 0
    return held == jobs


def recover_in_thread(executor: DeviceExecutor, reason: Status, name: str = "test-recover",
                      **kw) -> tuple[threading.Thread, list[Status]]:
    """``executor.recover(reason, **kw)`` on a thread of its own (started, daemon): the thread
    and the list its answer is appended to."""
    out: list[Status] = []
    thread = threading.Thread(target=lambda: out.append(executor.recover(reason, **kw)),
                              name=name, daemon=True)
    thread.start()
    return thread, out


def until(predicate, seconds: float = 10.0, what: str = "condition") -> None:
    """Poll ``predicate`` (bounded); AssertionError naming ``what`` when it never holds."""
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {seconds}s waiting for {what}")
        time.sleep(0.001)


def settle(executor: DeviceExecutor, seconds: float = 5.0) -> dict:
    """Wait until nothing is queued, in flight, handed off, completing or guessed; return the
    snapshot. (Stepped executors
    only move when the test drives them: nothing to wait for.)"""
    if not executor.config.threads:
        return executor.snapshot()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        snap = executor.snapshot()
        # the completion queue empties only once the completion thread gave the lease back
        # (the permit goes back before the caller is woken, the lease after it)
        # and the guesses of implicit pre-arms (machines/autoarm.py) expired: they hold a slot
        # and a token of budget until then; a guess leaves the table before whoever holds its
        # job releases it, so its token is waited for too
        # and the submitter has taken the report of every job it handed off (a relayed job
        # can be resolved by the completion thread before the submitter reads the relay's
        # report of its submit: CI, stop 70, read handing_off 1 after a stream's last step)
        if (snap["queued"] == 0 and snap["inflight"] == 0 and snap["completing"] == 0
                and snap["pending_tokens"] == 0 and not executor.dispatch.guesses()
                and snap["dispatch"]["handing_off"] == 0 and snap["dispatch"]["relayed"] == 0):
            return snap
        time.sleep(0.002)
    return executor.snapshot()


__all__ = [name for name in dir(sys.modules[__name__]) if not name.startswith("_")]
