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
(``machines/statechart_run.py`` calls ``report_untaken``), until its ``disable()``. An
instance of a chart with async callbacks (the async engine) is not heard.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs
import statemachine
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
    raised in (None when not known: the event was sent by hand)."""

    chart: str
    states: tuple[str, ...]
    error: BaseException | None
    callback: str | None

    def __str__(self) -> str:
        what = ("error.execution was sent with no error" if self.error is None
                else f"{type(self.error).__name__}: {self.error}")
        where = f"callback {self.callback} raised " if self.callback is not None else ""
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


_SETUP = threading.Lock()
_MONITORS: list[ErrorMonitor] = []
_ORIGINAL = SyncEngine.select_transitions
_LOOP = SyncEngine.processing_loop


def watch_unhandled_errors() -> ErrorMonitor:
    """An enabled ``ErrorMonitor`` (several may be at once: each hears every event)."""
    monitor = ErrorMonitor()
    with _SETUP:
        if not _MONITORS:
            SyncEngine.select_transitions = _heard  # type: ignore[method-assign]
            SyncEngine.processing_loop = _looped  # type: ignore[method-assign]
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


def report_untaken(machine: object, trigger: TriggerData) -> None:
    """``trigger`` enabled no transition of ``machine``: reported to every enabled monitor
    when it is an ``error.execution`` (else nothing)."""
    if not _MONITORS or trigger.event is None or str(trigger.event) != ERROR_EXECUTION:
        return
    error = trigger.kwargs.get("error")
    states = _states(getattr(machine, "configuration", ()))
    found = UnhandledError(type(machine).__name__, states,
                           error if isinstance(error, BaseException) else None,
                           _callback(error) if isinstance(error, BaseException) else None)
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
