"""Run one experiment in a child process with a timeout.

A runtime under test may crash (a signal) or hang (a Wait that never returns, a reset that
blocks): the experiment therefore runs in a fresh ``spawn`` child, and the parent only waits
on a pipe with a deadline. The outcome says what happened; it never raises for anything the
child did, and a child past its deadline is killed (SIGKILL) so the runner never hangs.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import attrs

OK, ERROR, TIMEOUT, SIGNALLED, EXITED = "ok", "error", "timeout", "signal", "exit"
#: the child's first message, once its interpreter runs and the experiment's module is imported
STARTED = "started"
#: how long a child may take to start (a spawn: a fresh interpreter and its imports), not
#: counted in the experiment's timeout: until stop 71 it was, and `conform --timeout 0.5` (or a
#: busy CI host) had every experiment killed while its child started, "the runtime hung"
START_BOUND_S = 120.0


@attrs.frozen
class Outcome:
    """``status`` ok | error (the experiment raised) | timeout | signal | exit (the child
    ended without a result); ``result`` is the experiment's return value when ok;
    ``reason`` says what went wrong otherwise."""

    status: str
    result: Any
    reason: str
    seconds: float


def _failure(exc: BaseException) -> tuple[str, str]:
    where = traceback.extract_tb(exc.__traceback__)[-1]
    return ERROR, f"{type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:{where.lineno})"


def _child(conn, module: str, func: str, kwargs: dict) -> None:
    """Run the experiment and send its outcome. A parent that is gone (killed: its end of the
    pipe closed) is told nothing, quietly: the send's BrokenPipeError, and the one of the
    ERROR sent for it, were two tracebacks on the terminal, after the shell's prompt."""
    try:
        try:
            experiment = getattr(importlib.import_module(module), func)
            try:
                conn.send((STARTED, None))  # (the experiment's timeout starts here)
            except (BrokenPipeError, ConnectionResetError):
                return  # (the parent is gone: no one to tell)
            message = (OK, experiment(**kwargs))
        except Exception as exc:  # noqa: BLE001 - any failure of the experiment is reported, not raised
            message = _failure(exc)
        try:
            conn.send(message)
        except (BrokenPipeError, ConnectionResetError):
            pass  # (the parent is gone: no one to tell)
        except Exception as exc:  # noqa: BLE001 - a result that cannot be sent (not picklable)
            try:
                conn.send(_failure(exc))
            except (BrokenPipeError, ConnectionResetError):
                pass
    finally:
        conn.close()


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


@contextlib.contextmanager
def _sigint_ignored_by_children() -> Iterator[None]:
    """SIGINT ignored while a child is started, so the child inherits the ignoring (Python
    keeps an inherited SIG_IGN): a Ctrl-C at the terminal reaches the whole process group,
    and the child's ``KeyboardInterrupt`` was a ``Process SpawnProcess-N:`` line (and its
    traceback) on the terminal. The parent stops the run and kills its child instead. (In
    another thread than the main one no handler can be set: nothing is changed there.)"""
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def run_isolated(target: str, kwargs: dict, timeout_s: float,
                 on_start: Callable[[int], None] | None = None) -> Outcome:
    """Call ``module:function(**kwargs)`` in a spawn child; wait at most timeout_s.

    ``on_start(pid)`` is called once the child runs the experiment (tests use it to kill the
    child); ``timeout_s`` counts from then, the child's start (a fresh interpreter and its
    imports) bounded by :data:`START_BOUND_S` on its own."""
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    module, _, func = target.partition(":")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, module, func, kwargs), daemon=True)
    t0 = time.monotonic()
    with _sigint_ignored_by_children():
        proc.start()
    child.close()
    message, got, running = None, False, False
    try:
        try:
            got = parent.poll(max(START_BOUND_S, timeout_s))  # (EOF too: the child died)
            message = parent.recv() if got else None
            if isinstance(message, tuple) and message[:1] == (STARTED,):
                running, message = True, None
                if on_start is not None and proc.pid is not None:  # (started: it has one)
                    on_start(proc.pid)
                got = parent.poll(timeout_s)
                message = parent.recv() if got else None
        except (EOFError, OSError):
            message = None  # the child died before sending a result
    except BaseException:  # a Ctrl-C (the child ignores it): the child goes with the parent
        proc.kill()
        proc.join(5)
        raise
    seconds = time.monotonic() - t0
    if message is None:
        if not got:
            proc.kill()
            proc.join(5)
            if not running:
                return Outcome(TIMEOUT, None, "the experiment's child did not start within "
                                              f"{max(START_BOUND_S, timeout_s):g} s (child "
                                              "killed): the host is too busy", seconds)
            # (the timeout as given: 0.04 s was said "within 0.0 s")
            return Outcome(TIMEOUT, None, f"experiment did not finish within {round(timeout_s, 6)} s "
                                          f"(child killed): the runtime hung", seconds)
        proc.join(5)
        code = proc.exitcode
        if code is not None and code < 0:
            return Outcome(SIGNALLED, None, f"child killed by {_signal_name(-code)} mid-experiment", seconds)
        return Outcome(EXITED, None, f"child exited with code {code} without a result", seconds)
    proc.join(5)
    if proc.is_alive():  # the result arrived but the runtime keeps the process (e.g. close hangs)
        proc.kill()
        proc.join(5)
    status, payload = message
    if status == OK:
        return Outcome(OK, payload, "", seconds)
    return Outcome(ERROR, None, f"experiment failed: {payload}", seconds)
