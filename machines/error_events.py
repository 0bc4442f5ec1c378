"""The ``error.execution`` events no transition takes, heard while enabled.

Under ``StateChart`` semantics (``catch_errors_as_events = True``, python-statemachine 3's
default for ``StateChart``) an exception a callback raises does not reach the caller: it
becomes the internal ``error.execution`` event, and when no transition of the active states
takes that event (none declared, ``error_execution = a.to(b)``, or none from where the chart
is) python-statemachine drops it, so the error is lost without a word. The interleaving
explorer (drivers/tools/interleave.py) fails a schedule on such an error: a bug of the chart
that an interleaving found.

``watch_unhandled_errors()`` returns an ``ErrorMonitor`` recording every such dropped event,
of python-statemachine instances (any chart class: the synchronous engine's
``select_transitions`` and ``processing_loop`` are wrapped while a monitor is enabled: an
``error.execution`` left queued when the chart stopped in a top-level final state, as an
action of the transition into it raised, is dropped too) and of compiled general runs
(``machines/statechart_run.py`` calls ``report_untaken``), until its ``disable()``; an
instance of a chart with async callbacks (python-statemachine's async engine, which a
synchronous ``send`` drives in a loop of its own) is heard the same way. An error a callback
raises while the chart handles ``error.execution`` (the action of ``error_execution =
a.to(b, on=...)``), which python-statemachine logs as "Error while processing
error.execution, ignoring" and drops whatever transitions the chart declares, is recorded too
(``UnhandledError.while_handling``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import statemachine
from statemachine.engines.async_ import AsyncEngine
from statemachine.engines.base import BaseEngine
from statemachine.engines.sync import SyncEngine

if TYPE_CHECKING:
    from statemachine.event_data import TriggerData
    from statemachine.orderedset import OrderedSet
    from statemachine.transition import Transition

ERROR_EXECUTION = "error.execution"

_LIBRARY = os.path.realpath(os.path.dirname(statemachine.__file__))
_HERE = os.path.realpath(os.path.dirname(__file__))


@attrs.frozen
class UnhandledError:
    """One ``error.execution`` no transition took: the ``chart`` (its class name), the
    active ``states`` then, the ``error`` and the ``callback`` (``name (file:line)``) it was
    raised in (None when not known: the event was sent by hand). ``while_handling``: the
    error was raised while the chart handled an ``error.execution`` (no transition can take
    it: python-statemachine drops it, to break a loop of errors)."""

    chart: str
    states: tuple[str, ...]
    error: BaseException | None
    callback: str | None
    while_handling: bool = False

    def __str__(self) -> str:
        what = ("error.execution was sent with no error" if self.error is None
                else f"{type(self.error).__name__}: {self.error}")
        where = f"callback {self.callback} raised " if self.callback is not None else ""
        if self.while_handling:
            return (f"{self.chart} (states {list(self.states)}): {where}{what} while the "
                    f"chart handled error.execution, so python-statemachine dropped it (an "
                    f"error raised there is never an event, whatever the chart declares: "
                    f"catch it in that callback, or let the error.execution transition only "
                    f"move to a state whose own actions cannot fail)")
        return (f"{self.chart} (states {list(self.states)}): {where}{what}; the chart's "
                f"error.execution event was taken by no transition, so StateChart's "
                f"catch_errors_as_events dropped the error (declare where it goes, e.g. "
                f"error_execution = <state>.to(failed), from every state it can happen in)")


class ErrorMonitor:
    """Records the untaken ``error.execution`` events in ``unhandled`` while enabled."""

    def __init__(self) -> None:
        self.unhandled: list[UnhandledError] = []
        self._lock = threading.Lock()
        self._enabled = True

    def report(self, found: UnhandledError) -> None:
        with self._lock:
            self.unhandled.append(found)

    def disable(self) -> None:
        """Stop recording (idempotent)."""
        with _SETUP:
            if not self._enabled:
                return
            self._enabled = False
            _MONITORS.remove(self)
            if not _MONITORS:
                SyncEngine.select_transitions = _ORIGINAL  # type: ignore[method-assign]
                SyncEngine.processing_loop = _LOOP  # type: ignore[method-assign]
                AsyncEngine.select_transitions = _ASYNC_ORIGINAL  # type: ignore[method-assign]
                AsyncEngine.processing_loop = _ASYNC_LOOP  # type: ignore[method-assign]
                BaseEngine._send_error_execution = _SEND  # type: ignore[method-assign]


_SETUP = threading.Lock()
_MONITORS: list[ErrorMonitor] = []
_ORIGINAL = SyncEngine.select_transitions
_LOOP = SyncEngine.processing_loop
_ASYNC_ORIGINAL = AsyncEngine.select_transitions
_ASYNC_LOOP = AsyncEngine.processing_loop
#: (both engines inherit it: an error raised while error.execution is handled ends there)
_SEND = BaseEngine._send_error_execution


def watch_unhandled_errors() -> ErrorMonitor:
    """An enabled ``ErrorMonitor`` (several may be at once: each hears every event)."""
    monitor = ErrorMonitor()
    with _SETUP:
        if not _MONITORS:
            SyncEngine.select_transitions = _heard  # type: ignore[method-assign]
            SyncEngine.processing_loop = _looped  # type: ignore[method-assign]
            AsyncEngine.select_transitions = _heard_async  # type: ignore[method-assign]
            AsyncEngine.processing_loop = _looped_async  # type: ignore[method-assign]
            BaseEngine._send_error_execution = _sent  # type: ignore[method-assign]
        _MONITORS.append(monitor)
    return monitor


def _heard(self: SyncEngine, trigger_data: TriggerData) -> OrderedSet[Transition]:
    enabled = _ORIGINAL(self, trigger_data)
    if not enabled:
        report_untaken(self.sm, trigger_data)
    return enabled


def _looped(self: SyncEngine) -> object:
    try:
        return _LOOP(self)  # type: ignore[no-untyped-call]
    finally:
        if not self.running:  # stopped (a top-level final state): its internal events,
            # an error.execution an action raised on the way in among them, are never taken
            for trigger in self.internal_queue.drain():
                report_untaken(self.sm, trigger)


async def _heard_async(self: AsyncEngine,
                       trigger_data: TriggerData) -> OrderedSet[Transition]:
    enabled = await _ASYNC_ORIGINAL(self, trigger_data)
    if not enabled:
        report_untaken(self.sm, trigger_data)
    return enabled


async def _looped_async(self: AsyncEngine, caller_future: object = None) -> object:
    try:
        return await _ASYNC_LOOP(self, caller_future)  # type: ignore[arg-type]
    finally:
        if not self.running:  # as _looped: what a top-level final state left queued
            for trigger in self.internal_queue.drain():
                report_untaken(self.sm, trigger)


def _sent(self: BaseEngine, error: Exception, trigger_data: TriggerData) -> None:
    if trigger_data.event is not None and str(trigger_data.event) == ERROR_EXECUTION:
        report_dropped(self.sm, error)
    _SEND(self, error, trigger_data)


def report_dropped(machine: object, error: BaseException) -> None:
    """``error`` was raised while ``machine`` handled ``error.execution``, and is dropped:
    reported to every enabled monitor."""
    if not _MONITORS:
        return
    _report(UnhandledError(type(machine).__name__,
                           _states(getattr(machine, "configuration", ())), error,
                           _callback(error), while_handling=True))


def report_untaken(machine: object, trigger: TriggerData) -> None:
    """``trigger`` enabled no transition of ``machine``: reported to every enabled monitor
    when it is an ``error.execution`` (else nothing)."""
    if not _MONITORS or trigger.event is None or str(trigger.event) != ERROR_EXECUTION:
        return
    error = trigger.kwargs.get("error")
    states = _states(getattr(machine, "configuration", ()))
    _report(UnhandledError(type(machine).__name__, states,
                           error if isinstance(error, BaseException) else None,
                           _callback(error) if isinstance(error, BaseException) else None))


def _report(found: UnhandledError) -> None:
    with _SETUP:
        monitors = list(_MONITORS)
    for monitor in monitors:
        monitor.report(found)


def _states(configuration: Iterable[object]) -> tuple[str, ...]:
    return tuple(str(getattr(state, "id", state)) for state in configuration)


def _callback(error: BaseException) -> str | None:
    """The outermost frame of ``error``'s traceback outside python-statemachine and calexec's
    general run: the callback the library called (the error may come from deeper)."""
    frames: list[tuple[str, int, str]] = []
    tb = error.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename, tb.tb_lineno, code.co_name))
        tb = tb.tb_next
    for filename, line, name in frames:
        if not os.path.realpath(filename).startswith((_LIBRARY + os.sep, _HERE + os.sep)):
            return f"{name!r} ({os.path.basename(filename)}:{line})"
    return None
