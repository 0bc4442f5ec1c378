"""The interleaving explorer as a library: the controlled scheduler, virtual clock and replay of
``explore.py`` (built for the executor) on a user's own threaded code.

The injection point is ``calexec.machines.clock.Clock``: code under test takes a clock (the
real one, ``calexec.machines.clock.SYSTEM``, by default) and makes every lock
(``clock.lock()``, ``clock.rlock()``), condition (``clock.condition(lock)``), event
(``clock.event()``), semaphore (``clock.semaphore(n)``, ``clock.bounded_semaphore(n)``), queue
(``clock.queue(maxsize)``) and thread (``clock.start_thread(target, name)``) through it, and
sleeps and reads time through it (``clock.sleep(s)``, ``clock.monotonic()``). Under the explorer the clock is a
``VirtualClock``: exactly one of those threads runs at a time, every acquire, wait, set,
start, join and sleep is a scheduling point where a chooser picks who runs next, and time
moves only when every thread is blocked (a 5 s timeout costs nothing).

    def scenario(clock):                      # builds the code under test on ``clock``
        bank = Bank(clock)
        for name in ("t1", "t2"):
            clock.start_thread(lambda: bank.transfer(...), name)
        return lambda: bank.total() == 100 or f"money lost: {bank.total()}"   # final check

    result = explore_threads(scenario, seeds=range(200))      # PCT schedules, one per seed
    if result.failure is not None:
        print(result.failure.message)                         # what broke, and where
        again = replay_threads(scenario, result.failure.choices)   # the same schedule exactly

``scenario(clock)`` returns a final check, or None: called once nothing can run any more, it
returns True/None when all is well, else False or a message. ``invariant`` (optional) is
checked at every scheduling point. A check that raises (an ``assert``) fails the schedule,
naming the check and the error. A check runs with every thread stopped, outside the
controlled world: it may take the code's lock when free (no scheduling point), and
``acquire(blocking=False)`` is False while a thread holds it; waiting for a held lock fails
the schedule, naming the holder. Any exception a controlled thread raises fails the
schedule; so does a thread not started by ``clock.start_thread`` using the clock's objects
(its steps would be neither scheduled nor replayed), a deadlock (threads blocked for good),
a chart contract violated by a run of ``charts`` (their contracts are enabled for the
exploration, recorded, never raised in the threads: machines/chart_contracts.py), and a
``StateChart`` callback's error that no transition takes: python-statemachine turns it into
the internal ``error.execution`` event and drops that when no transition takes it
(machines/error_events.py hears it; ``ignore_unhandled_errors=True`` lets it pass).
"""

from __future__ import annotations

import contextvars
import functools
import math
import sys
import threading
import traceback
from collections.abc import Callable, Iterable, Sequence

import attrs

from calexec.drivers.tools.explore import (
    WATCHDOG_RAISE,
    PCTChooser,
    ReplayChooser,
    Scheduler,
    TapeChooser,
    VirtualClock,
)
from calexec.drivers.tools.explore import (
    watchdog_s as _watchdog_seconds,
)
from calexec.machines.chart_contracts import ContractMonitor, declared_contracts, enable_contracts
from calexec.machines.clock import Clock
from calexec.machines.compiled import ChartLike, compiled
from calexec.machines.error_events import ErrorMonitor, watch_unhandled_errors

#: what a scenario's final check or invariant returns: True/None (holds), False or a message
Verdict = bool | str | None
Scenario = Callable[[Clock], Callable[[], Verdict] | None]


@attrs.frozen
class ScheduleFailure:
    """One failing schedule: ``message`` (what broke), ``seed`` (the PCT seed that found it,
    None for a replay), ``choices`` (every choice among several options, in order: what
    ``replay_threads`` takes) and ``trace`` (the last ``thread:point`` steps)."""

    message: str
    seed: int | None
    choices: tuple[int, ...]
    trace: tuple[str, ...]


@attrs.frozen
class Exploration:
    """What ``explore_threads`` did: the schedules run and the first failure (None: none)."""

    schedules: int
    failure: ScheduleFailure | None


def _judge(verdict: Verdict, what: str) -> str | None:
    if verdict is None or verdict is True:
        return None
    return f"{what}: {verdict}" if isinstance(verdict, str) else f"{what} does not hold"


def _ask(check: Callable[[], Verdict], what: str) -> str | None:
    """``check``'s verdict as a failure message, or None; a check that raises (an ``assert``
    in it, or a bug) fails the schedule too, naming the check and the error: raised out of
    the explorer, it would lose the schedule's seed and choices (or, raised at a point of a
    controlled thread, be blamed on that thread)."""
    try:
        verdict = check()
    except Exception as err:  # noqa: BLE001 - the user's check: any error is its failure
        return f"{what} raised {type(err).__name__}: {err}"
    return _judge(verdict, what)


def run_schedule(scenario: Scenario, chooser: TapeChooser | PCTChooser, *,
                 invariant: Callable[[], Verdict] | None = None,
                 charts: Iterable[ChartLike] = (), steps: int = 100_000,
                 horizon_s: float = 60.0, seed: int | None = None,
                 watchdog_s: float | None = None,
                 ignore_unhandled_errors: bool = False) -> ScheduleFailure | None:
    """Run ``scenario`` once under ``chooser``'s schedule; the failure, or None."""
    _check_flag(ignore_unhandled_errors)
    contracts = enable_contracts(*_contracted(charts), raise_on_violation=False)
    errors = None if ignore_unhandled_errors else watch_unhandled_errors()
    try:
        return _run_schedule(scenario, chooser, contracts, invariant=invariant, steps=steps,
                             horizon_s=horizon_s, seed=seed, watchdog=watchdog_s,
                             errors=errors)
    finally:
        if errors is not None:
            errors.disable()
        contracts.disable()


def _run_schedule(scenario: Scenario, chooser: TapeChooser | PCTChooser,
                  contracts: ContractMonitor, *, invariant: Callable[[], Verdict] | None,
                  steps: int, horizon_s: float, seed: int | None,
                  watchdog: float | None = None,
                  errors: ErrorMonitor | None = None) -> ScheduleFailure | None:
    """``run_schedule`` with the charts' contracts enabled already (``contracts``, perhaps
    for many schedules: only the violations reported from this schedule's start count).

    The scenario, the final check and an invariant checked before any thread runs are the
    driver's, run in a thread of the explorer's that the caller waits for at most
    ``watchdog`` real seconds (``watchdog_s()``) without a scheduling point: one that blocks
    (a callback waiting on ``threading.Event`` nobody sets) hung the caller, and its test
    run, for ever, where the scheduler's watchdog covers only the controlled threads."""
    sched = Scheduler(chooser)
    sched.watchdog = watchdog
    since = len(contracts.violations)
    #: the error.execution events no transition took before this schedule (not its own)
    dropped = len(errors.unhandled) if errors is not None else 0
    #: what the driver thread is doing; None: the controlled threads run (their watchdog's)
    doing: list[str | None] = ["the scenario"]
    raised: list[BaseException] = []

    def at_point() -> None:
        if len(contracts.violations) > since:
            raise AssertionError(f"chart contract violated: {contracts.violations[since]}")
        if errors is not None and len(errors.unhandled) > dropped:
            raise AssertionError(f"unhandled error.execution: {errors.unhandled[dropped]}; "
                                 f"a chart that means to drop it: explore with "
                                 f"ignore_unhandled_errors=True")
        if invariant is not None:
            driving = threading.current_thread() is sched.driver
            was = doing[0]
            if driving:
                doing[0] = "the invariant"
            try:
                problem = _ask(invariant, "invariant")
            finally:
                if driving:
                    doing[0] = was
            if problem is not None:
                raise AssertionError(problem)

    def drive() -> None:
        try:
            _drive(sched, scenario, at_point, doing, steps=steps, horizon_s=horizon_s)
        except BaseException as err:  # noqa: BLE001 - raised again in the caller's thread
            raised.append(err)
        finally:
            sched.abort_threads()

    sched.on_point = at_point
    # (in the caller's context: a context variable it set reads the same in the scenario)
    driver = threading.Thread(target=contextvars.copy_context().run, args=(drive,),
                              name="explore-driver", daemon=True)
    sched.driver = driver  # the scenario and its final check run there
    limit = _watchdog_seconds(watchdog)
    seen: tuple[str | None, int] = (doing[0], sched.steps)
    driver.start()
    try:
        while True:
            driver.join(limit)
            if not driver.is_alive():
                break
            now = (doing[0], sched.steps)
            if doing[0] is not None and now == seen:  # a whole watchdog with no progress
                sched.fail(_driver_stuck(driver, doing[0], limit))
                break
            seen = now
    finally:  # (stuck, or the caller interrupted: Ctrl-C): no controlled thread left parked
        if driver.is_alive():
            sched.abort_threads()
    if raised:
        raise raised[0]
    if sched.failure is None:
        return None
    return ScheduleFailure(sched.failure, seed, tuple(sched.choices), tuple(sched.trace[-40:]))


def _drive(sched: Scheduler, scenario: Scenario, at_point: Callable[[], None],
           doing: list[str | None], *, steps: int, horizon_s: float) -> None:
    """The driver's part of a schedule: build the scenario, run the threads, check the end."""
    final = scenario(VirtualClock(sched))
    if final is not None and not callable(final):
        raise TypeError(f"scenario returned {final!r}: a final check (a function of no "
                        "arguments) or None")
    doing[0] = None
    stop = sched.run(steps, horizon_s)
    doing[0] = "the final check"
    if sched.failure is None:
        at_point_failure = None
        try:
            at_point()
        except AssertionError as err:
            at_point_failure = str(err)
        blocked = [t for t in sched.threads if not t.finished]
        if at_point_failure is not None:
            sched.fail(at_point_failure)
        elif stop == "quiescent" and blocked:
            sched.fail("deadlock: no thread can run and none has a deadline:\n"
                       + sched.describe())
        elif stop in ("budget", "horizon"):
            sched.fail(f"the schedule did not finish ({stop}: {steps} steps, "
                       f"{horizon_s} s of virtual time):\n{sched.describe()}")
        elif final is not None:
            problem = _ask(final, "final check")
            if problem is not None:
                sched.fail(problem)


def _driver_stuck(driver: threading.Thread, doing: str, limit: float) -> str:
    """The failure of a driver (the scenario, the final check, an invariant) that did not
    return within ``limit`` real seconds, with where it is blocked."""
    frame = sys._current_frames().get(driver.ident or -1)
    stack = "".join(traceback.format_stack(frame)[-12:]) if frame is not None else ""
    return (f"watchdog: {doing} did not return within {limit}s real time (a blocking call "
            f"outside the controlled threads? {doing} runs in the explorer's own thread, with "
            f"no controlled thread running, so a wait there on anything (threading's own "
            f"objects, an event nobody sets, a callback of a chart it drives that waits) never "
            f"ends: leave the waiting to a thread started with clock.start_thread); "
            f"{WATCHDOG_RAISE}\n{stack}")


def explore_threads(scenario: Scenario, *, seeds: Iterable[int] = range(100), depth: int = 3,
                    length: int = 60, invariant: Callable[[], Verdict] | None = None,
                    charts: Iterable[ChartLike] = (), steps: int = 100_000,
                    horizon_s: float = 60.0,
                    progress: Callable[[int, int], object] | None = None,
                    watchdog_s: float | None = None,
                    ignore_unhandled_errors: bool = False) -> Exploration:
    """Run ``scenario`` under one PCT schedule per seed (random thread priorities and
    ``depth - 1`` priority change points placed among the first ``length`` choices, as
    Shuttle's and Coyote's PCT) until one fails; ``charts``: whose contracts are checked.
    ``progress(schedules, seed)`` (optional) is called after each schedule that passed: a
    long exploration (``seeds=itertools.count()``) can say how far it got. ``watchdog_s``:
    the real seconds a schedule may go without any scheduling point (a thread, the scenario,
    a check blocked outside the scheduler) before it fails naming who blocked and where
    (None: ``$CALEXEC_EXPLORE_WATCHDOG_S``, else 60). A ``StateChart`` callback's error
    that no transition takes (its ``error.execution`` event, dropped by python-statemachine)
    fails the schedule, naming the chart, the callback and the error;
    ``ignore_unhandled_errors=True``: a chart that means to drop them passes."""
    _check_bounds(scenario, steps=steps, horizon_s=horizon_s, invariant=invariant,
                  watchdog=watchdog_s, depth=depth, length=length)
    _check_flag(ignore_unhandled_errors)
    if depth > length:  # (PCTChooser samples its change points from a list that long:
        # depth=10**8 took gigabytes before the first schedule)
        raise ValueError(f"depth={depth!r}: at most length={length!r} (its depth - 1 priority "
                         f"change points are placed among the first length choices)")
    if progress is not None and not callable(progress):
        raise TypeError(f"progress={progress!r}: a function of (schedules, seed) (or None)")
    if isinstance(seeds, (int, str, bytes)):
        raise TypeError(f"seeds={seeds!r}: an iterable of integer seeds, e.g. range({seeds!r})"
                        if isinstance(seeds, int) else
                        f"seeds={seeds!r}: an iterable of integer seeds, e.g. range(100)")
    charts = _contracted(charts)
    count = 0
    # the contracts enabled once for every schedule: enabling them looks for the charts'
    # instances made before (gc.get_referrers, a walk of the whole heap), which was most of a
    # small scenario's schedule in a large process (a test session)
    contracts = enable_contracts(*charts, raise_on_violation=False)
    errors = None if ignore_unhandled_errors else watch_unhandled_errors()
    try:
        for seed in map(functools.partial(_index, "seeds"), seeds):  # lazily: count() may go on
            count += 1
            failure = _run_schedule(scenario,
                                    PCTChooser(seed, depth=depth, steps=length, p_jump=0.0),
                                    contracts, invariant=invariant, steps=steps,
                                    horizon_s=horizon_s, seed=seed, watchdog=watchdog_s,
                                    errors=errors)
            if failure is not None:
                return Exploration(count, failure)
            if progress is not None:
                progress(count, seed)
    finally:
        if errors is not None:
            errors.disable()
        contracts.disable()
    if count == 0:  # (an exploration that passed having run nothing would look checked)
        raise ValueError(f"seeds={_short_seeds(seeds)}: no seed, so no schedule ran (give "
                         f"at least one, e.g. seeds=range(100))")
    return Exploration(count, None)


def _short_seeds(seeds: Iterable[int]) -> str:
    text = repr(seeds)
    return text if len(text) <= 60 else text[:56] + "..."


def replay_threads(scenario: Scenario, choices: Sequence[int], *,
                   invariant: Callable[[], Verdict] | None = None,
                   charts: Iterable[ChartLike] = (), steps: int = 100_000,
                   horizon_s: float = 60.0,
                   watchdog_s: float | None = None,
                   ignore_unhandled_errors: bool = False) -> ScheduleFailure | None:
    """Run ``scenario`` under the recorded ``choices`` (``ScheduleFailure.choices``): the same
    schedule, so the same failure (or None if the code no longer fails on it). ``ValueError``
    naming ``choices`` when they do not fit the scenario (a point offers fewer options than a
    choice picks): that is no failure of the code, nor a reproduction."""
    _check_bounds(scenario, steps=steps, horizon_s=horizon_s, invariant=invariant,
                  watchdog=watchdog_s)
    _check_flag(ignore_unhandled_errors)
    if isinstance(choices, (str, bytes)):
        raise TypeError(f"choices={choices!r}: the choices a ScheduleFailure recorded")
    choices = [_index("choices", choice) for choice in choices]
    charts = _contracted(charts)
    chooser = ReplayChooser(list(choices))
    try:
        found = run_schedule(scenario, chooser, invariant=invariant, charts=tuple(charts),
                             steps=steps, horizon_s=horizon_s, watchdog_s=watchdog_s,
                             ignore_unhandled_errors=ignore_unhandled_errors)
    except RuntimeError:
        # a choice that does not fit the schedule's first point raises in the scheduler's
        # own loop (the caller's thread), not in a controlled thread: the same refusal below
        if chooser.diverged is None:
            raise
        found = None
    if chooser.diverged is not None:  # not the code's failure: the choices do not fit it
        raise ValueError(f"choices={_short(choices)}: not a schedule of this scenario "
                         f"({chooser.diverged}): the scenario or the code "
                         f"changed since they were recorded, or they are another scenario's")
    return found


def _contracted(charts: Iterable[ChartLike]) -> tuple[ChartLike, ...]:
    """``charts`` as a tuple, each a chart class (or its ``CompiledChart``) that declares
    contracts: else a ``TypeError`` (not a chart: a ``"module:Class"`` string, say) or
    ``ValueError`` (no contract: an exploration that looked checked would check nothing, as
    the pytest option ``--chart-contracts`` refuses), naming ``charts`` and the chart."""
    if isinstance(charts, (str, bytes)) or not isinstance(charts, Iterable):
        raise TypeError(f"charts={charts!r}: an iterable of chart classes whose contracts are "
                        f"checked (e.g. charts=[Transfer])")
    found = tuple(charts)
    for chart in found:
        try:
            shared = compiled(chart)
        except TypeError as err:
            raise TypeError(f"charts: {err} (pass the class itself, e.g. charts=[Transfer]; "
                            f"a 'module:Class' reference: calexec.machines.chartref."
                            f"load_chart)") from None
        except ValueError as err:  # no states, a construct no tool supports: named as above
            raise ValueError(f"charts: {err}") from None
        if not declared_contracts(shared):
            raise ValueError(f"charts: {shared.name} declares no contracts, so none would be "
                             f"checked (declare them in the class with @invariant, "
                             f"@precondition or @postcondition from "
                             f"calexec.machines.chart_contracts, or leave it out of charts)")
    return found


def _short(choices: Sequence[int]) -> str:
    text = repr(tuple(choices))
    return text if len(text) <= 60 else text[:56] + "...)"


def _index(name: str, value: object) -> int:
    """``value``, an element of argument ``name``, as a non-negative integer, else
    ``TypeError``/``ValueError`` naming both."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: {value!r} is not an integer")
    if value < 0:
        raise ValueError(f"{name}: {value!r} is negative")
    return value


def _check_bounds(scenario: object, *, steps: int, horizon_s: float, invariant: object,
                  watchdog: float | None = None, **counts: int) -> None:
    """Refuse, naming the argument and its value, a ``scenario`` that is not callable, and a
    bound no schedule can run under: ``steps``
    and every count (``depth``, ``length``) an integer >= 1, ``horizon_s`` a finite number of
    seconds > 0, ``invariant`` None or callable."""
    if not callable(scenario):
        raise TypeError(f"scenario={scenario!r}: a function of the clock that builds the code "
                        "under test (def scenario(clock): ...)")
    # watchdog_s= (or $CALEXEC_EXPLORE_WATCHDOG_S): refused, named, before any schedule runs
    _watchdog_seconds(watchdog)
    for name, value in {"steps": steps, **counts}.items():
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name}={value!r}: an integer >= 1")
        if value < 1:
            raise ValueError(f"{name}={value!r}: must be >= 1")
    if isinstance(horizon_s, bool) or not isinstance(horizon_s, (int, float)):
        raise TypeError(f"horizon_s={horizon_s!r}: seconds of virtual time, a number > 0")
    if not (math.isfinite(horizon_s) and horizon_s > 0):
        raise ValueError(f"horizon_s={horizon_s!r}: seconds of virtual time, finite and > 0")
    if invariant is not None and not callable(invariant):
        raise TypeError(f"invariant={invariant!r}: a function of no arguments (or None)")


def _check_flag(ignore_unhandled_errors: object) -> None:
    """Refuse an ``ignore_unhandled_errors`` that is not a bool, naming it (a string
    ``"false"`` would be true)."""
    if not isinstance(ignore_unhandled_errors, bool):
        raise TypeError(f"ignore_unhandled_errors={ignore_unhandled_errors!r}: True or False")
