"""The interleaving explorer on a user's own threads (drivers/tools/interleave.py): what a
schedule's failure carries when the user's own checks raise."""

from __future__ import annotations

import inspect
import math
import threading
import time

import pytest

from calexec.drivers.tools import explore
from calexec.drivers.tools.interleave import explore_threads, replay_threads
from calexec.machines.clock import SYSTEM


def two_counters(clock):
    """Two threads bumping a counter under a lock made by ``clock``."""
    lock, counts = clock.lock(), [0]

    def bump():
        for _ in range(2):
            with lock:
                counts[0] += 1
    for name in ("a", "b"):
        clock.start_thread(bump, name)
    return counts


@pytest.mark.parametrize("where", ["final", "invariant"])
def test_a_check_that_raises_fails_the_schedule_with_its_seed_and_choices(where):
    """A final check or an ``invariant=`` written with ``assert`` (or one with a bug) raised
    out of ``explore_threads``: the schedule that broke it, its seed and its choices were lost,
    so it could not be replayed. It fails that schedule, naming the check and the error."""
    seen: list[list[int]] = []

    def scenario(clock):
        counts = two_counters(clock)
        seen.append(counts)

        def final():
            assert counts[0] == 5, f"count {counts[0]}"
        return final if where == "final" else None

    def invariant():
        if seen and seen[-1][0] == 3:
            raise KeyError("three")
        return True

    found = explore_threads(scenario, seeds=range(3),
                            invariant=invariant if where == "invariant" else None)
    assert found.failure is not None and found.failure.seed == 0
    expected = ("final check raised AssertionError: count 4" if where == "final"
                else "invariant raised KeyError: 'three'")
    assert found.failure.message.startswith(expected), found.failure.message
    again = replay_threads(scenario, found.failure.choices,
                           invariant=invariant if where == "invariant" else None)
    assert again is not None and again.message == found.failure.message


def test_a_condition_s_wait_for_runs_under_the_explorer():
    """``clock.condition(lock)`` is a ``threading.Condition`` on the real clock, so code uses
    its ``wait_for(predicate, timeout)``; the explorer's condition had no ``wait_for``: every
    schedule failed with ``AttributeError``. It waits as ``threading.Condition`` does, in
    virtual time: a producer one second late is seen, one later than the timeout is not."""

    def scenario(delay: float, seen: list[tuple[list[str], float]]):
        def build(clock):
            lock = clock.lock()
            ready = clock.condition(lock)
            box: list[str] = []
            start = clock.monotonic()

            def consumer():
                with ready:
                    got = ready.wait_for(lambda: box, timeout=5.0)
                    seen.append((list(got), clock.monotonic() - start))

            def producer():
                clock.sleep(delay)
                with ready:
                    box.append("x")
                    ready.notify_all()
            clock.start_thread(consumer, "consumer")
            clock.start_thread(producer, "producer")
        return build

    for delay, found, waited in ((1.0, ["x"], 1.0), (9.0, [], 5.0)):
        seen: list[tuple[list[str], float]] = []
        result = explore_threads(scenario(delay, seen), seeds=range(5))
        assert result.failure is None, result.failure.message
        assert [(got, round(t, 6)) for got, t in seen] == [(found, waited)] * 5, seen


@pytest.mark.parametrize(("kwargs", "named"), [
    ({"seeds": 5}, "seeds=5"), ({"seeds": "abc"}, "seeds='abc'"),
    ({"seeds": ["a", 1]}, "seeds: 'a'"), ({"seeds": [True]}, "seeds: True"),
    ({"depth": 0}, "depth=0"), ({"depth": 2.5}, "depth=2.5"), ({"length": 0}, "length=0"),
    ({"steps": 0}, "steps=0"), ({"horizon_s": 0}, "horizon_s=0"),
    ({"horizon_s": float("nan")}, "horizon_s=nan"), ({"invariant": 3}, "invariant=3"),
    # a depth above length placed change points past it; depth=10**8 took gigabytes (PCT's
    # change points are sampled from a list that long) before the first schedule
    ({"depth": 61, "length": 60}, "depth=61: at most length=60"),
    ({"depth": 10**9}, "depth=1000000000: at most length=60"),
])
def test_bad_arguments_are_refused_naming_the_argument_and_its_value(kwargs, named):
    """``seeds=5`` (meant: five seeds) failed with ``'int' object is not iterable``; ``depth``
    or ``steps`` of 0, a zero or NaN horizon and a non-callable invariant were taken and every
    schedule "passed" or failed for another reason. Each is refused before any schedule runs,
    with a ``ValueError``/``TypeError`` naming the argument and its value (a seed when the
    loop meets it: ``seeds`` is read lazily, ``itertools.count()`` explores until a failure)."""
    ran = []

    def scenario(clock):
        ran.append(1)
        two_counters(clock)

    with pytest.raises((TypeError, ValueError)) as refused:
        explore_threads(scenario, **kwargs)
    assert named in str(refused.value)
    assert ran == []


def test_replay_refuses_choices_that_are_not_indices():
    with pytest.raises(TypeError, match=r"choices: 'x'"):
        replay_threads(lambda clock: None, [0, "x"])
    with pytest.raises(ValueError, match=r"steps=-1"):
        replay_threads(lambda clock: None, [0], steps=-1)


def test_choices_that_do_not_fit_the_scenario_are_refused_not_reported_as_its_failure():
    """A newcomer replays a failure's choices after changing the scenario (or the choices of
    another one): a choice picked an index past its point's options, and ``replay_threads``
    returned a ``ScheduleFailure`` 'thread b raised RuntimeError: replay diverged ...' with the
    explorer's own traceback: the code under test blamed, and a test asserting the replay
    fails passed as if the bug had been reproduced. It is a ``ValueError`` naming ``choices``;
    choices that fit still replay the schedule as before."""
    def scenario(clock):
        counts = two_counters(clock)
        return lambda: counts[0] == 4 or f"count {counts[0]}"

    with pytest.raises(ValueError) as refused:
        replay_threads(scenario, [0, 0, 9, 9, 9])
    message = str(refused.value)
    assert message.startswith("choices=(0, 0, 9, 9, 9): not a schedule of this scenario ("
                              "choice "), message
    assert "picks index 9 of 2 options): the scenario or the code changed since" in message
    assert replay_threads(scenario, [0, 1, 1, 0]) is None  # a schedule that fits: it passes


def test_choices_that_do_not_fit_the_first_point_are_refused_the_same_way():
    """The refusal above held from the second choice on; a first choice past its options
    (``[9]``, or another scenario's choices) raised ``RuntimeError: replay diverged: choice 0
    picks index 9 of 2 options [<CThread(a, ...)>, ...]`` from the scheduler's loop, not the
    documented ``ValueError`` naming ``choices`` (found at stop 50 by a library user)."""
    def scenario(clock):
        counts = two_counters(clock)
        return lambda: counts[0] == 4 or f"count {counts[0]}"

    with pytest.raises(ValueError) as refused:
        replay_threads(scenario, [9, 0])
    assert str(refused.value).startswith(
        "choices=(9, 0): not a schedule of this scenario (choice 0 picks index 9 of 2 "
        "options)"), refused.value
    assert replay_threads(scenario, [0, 1, 1, 0]) is None  # the scenario replays on


@pytest.mark.parametrize("explore", [explore_threads, lambda s: replay_threads(s, [])])
def test_a_scenario_that_is_not_one_is_refused_naming_it(explore):
    """``explore_threads(42)`` failed with ``'int' object is not callable`` from inside the
    scheduler, and a scenario returning something that is no check (``return counts``: a
    list) failed every schedule as "final check raised TypeError: 'list' object is not
    callable", blamed on the code under test. Both are a ``TypeError`` naming the scenario
    (found at stop 50 by a library user)."""
    with pytest.raises(TypeError, match=r"^scenario=42: a function of the clock"):
        explore(42)
    with pytest.raises(TypeError, match=r"^scenario returned \[0, 0\]: a final check"):
        explore(lambda clock: [0, 0])


@pytest.mark.parametrize(("wait", "raised"), [
    (lambda clock: clock.event().wait(math.inf), "OverflowError"),
    (lambda clock: clock.sleep(math.inf), "OverflowError"),
    (lambda clock: clock.lock().acquire(timeout=math.nan), "ValueError: Invalid value NaN"),
    (lambda clock: clock.lock().acquire(timeout=-2), "ValueError: timeout value must be"),
    (lambda clock: clock.lock().acquire(False, 1.0), "ValueError: can't specify a timeout"),
])
def test_a_wait_the_real_clock_refuses_fails_the_schedule_as_it_would_fail_the_thread(wait,
                                                                                      raised):
    """Code under test that waits ``event.wait(math.inf)`` or sleeps ``math.inf`` raises
    ``OverflowError: timestamp out of range for platform time_t`` on the real clock
    (``threading``, ``time.sleep``), at its first wait; a NaN or negative lock timeout a
    ``ValueError``. Under the explorer's virtual clock each was taken (the infinite wait even
    timed out at virtual infinity and went on), so every schedule passed code that fails
    in production (found at stop 50 by a library user). The virtual clock raises what the
    real one raises: the schedule fails naming it."""
    def scenario(clock):
        clock.start_thread(lambda: wait(clock), "waiter")

    found = explore_threads(scenario, seeds=range(3))
    assert found.failure is not None, "the explorer passed a wait the real clock refuses"
    assert found.failure.message.startswith(f"thread waiter raised {raised}"), (
        found.failure.message)
    with pytest.raises((OverflowError, ValueError)):  # as the real clock does
        wait(SYSTEM)


def test_finite_waits_still_run_in_virtual_time():
    def scenario(clock):
        done = []

        def waiter():
            lock = clock.lock()
            assert lock.acquire(timeout=5.0) and not clock.event().wait(3600.0)
            clock.sleep(1e6)
            done.append(clock.monotonic())
        clock.start_thread(waiter, "waiter")
        return lambda: len(done) == 1 or "the waiter did not finish"

    assert explore_threads(scenario, seeds=range(2), horizon_s=1e7).failure is None


def ping_pong(rounds: int):
    """Two threads taking turns ``rounds`` times each: every step hands the baton over."""
    def scenario(clock):
        cond, turn, count = clock.condition(clock.lock()), [0], [0]

        def player(me: int) -> None:
            for _ in range(rounds):
                with cond:
                    while turn[0] != me:
                        cond.wait()
                    turn[0], count[0] = 1 - me, count[0] + 1
                    cond.notify_all()
        for me in (0, 1):
            clock.start_thread(player, f"player{me}", (me,))
        return lambda: count[0] == 2 * rounds or f"count {count[0]}"
    return scenario


def test_the_watchdog_times_a_stretch_without_a_point_not_the_whole_schedule(monkeypatch):
    """The real-time watchdog timed the whole schedule: one longer than
    ``CALEXEC_EXPLORE_WATCHDOG_S`` (60 s: a few million steps, or fewer on a loaded machine)
    failed as "watchdog: thread ... did not reach a scheduling point", though every step
    reached one. A long schedule passes; a thread held outside the scheduler is still named."""
    monkeypatch.setattr(explore, "WATCHDOG_S", 0.3)
    started = time.monotonic()
    found = explore_threads(ping_pong(20_000), seeds=[0], steps=10**6)
    took = time.monotonic() - started
    assert found.failure is None, (round(took, 2), found.failure.message[:300])
    assert took > 0.3  # (else the schedule proved nothing: it fit the watchdog anyway)

    held = threading.Event()  # not the clock's: the thread blocks outside the scheduler

    def stuck(clock):
        clock.start_thread(lambda: held.wait(1.0), "stuck")
    found = explore_threads(stuck, seeds=[0])
    assert found.failure is not None
    assert found.failure.message.startswith(
        "watchdog: thread stuck did not reach a scheduling point within 0.3s"), (
        found.failure.message)


def test_an_invariant_may_take_the_code_s_lock():
    """An invariant reading the state under the code's own lock (``with lock: ...``) failed
    every schedule with "invariant raised RecursionError": its acquire was a scheduling point,
    which ran the invariant again. A check runs with every thread stopped, outside the
    controlled world: a free lock is taken at once, ``acquire(blocking=False)`` of a held one
    is False, and a blocking acquire of a held one (it would wait for ever) names its holder."""
    def scenario(clock):
        lock, counts = clock.lock(), [0]

        def bump():
            for _ in range(2):
                with lock:
                    counts[0] += 1
                    clock.sleep(0.5)  # (a point while it holds the lock)
        for name in ("a", "b"):
            clock.start_thread(bump, name)

        def with_the_lock():
            with lock:
                return 0 <= counts[0] <= 4 or f"count {counts[0]}"

        def if_free():
            if not lock.acquire(blocking=False):
                return True  # mid-update: not checked now
            try:
                return 0 <= counts[0] <= 4
            finally:
                lock.release()
        invariants.update(blocking=with_the_lock, free=if_free)
        return lambda: counts[0] == 4 or f"count {counts[0]}"

    invariants: dict = {}
    for kind in ("free", "blocking"):
        found = explore_threads(scenario, seeds=range(20),
                                invariant=lambda kind=kind: invariants[kind]())
        if kind == "free":
            assert found.failure is None, found.failure.message[:300]
            assert found.schedules == 20
        else:  # a point inside the `with lock:` above: the invariant would wait for ever
            assert found.failure is not None
            assert found.failure.message.startswith(
                "invariant raised RuntimeError: a controlled lock held by thread "), (
                found.failure.message[:300])
            assert "acquire(blocking=False)" in found.failure.message


def test_a_thread_not_started_by_the_clock_using_its_objects_fails_the_schedule_naming_it():
    """A scenario that started one of its threads with ``threading.Thread`` instead of
    ``clock.start_thread`` passed every schedule: that thread took the explorer's lock as
    setup code does, unscheduled, so its races were never explored (and, met while another
    held the lock, its error went to ``threading``'s excepthook, not the schedule). It fails
    the schedule, naming the thread and the fix."""
    raised: list[BaseException] = []

    def scenario(clock):
        lock, counts = clock.lock(), [0]

        def bump():
            with lock:
                counts[0] += 1

        def plain():
            try:
                bump()
            except RuntimeError as err:
                raised.append(err)
        clock.start_thread(bump, "scheduled")
        stray = threading.Thread(target=plain, name="stray")
        stray.start()
        stray.join(10.0)
        return lambda: counts[0] >= 1

    found = explore_threads(scenario, seeds=range(3))
    assert found.failure is not None and found.schedules == 1
    assert found.failure.message.startswith(
        "thread stray used a lock made by the explorer's clock but is not one of its threads "
        "(not started by clock.start_thread)"), found.failure.message
    assert str(raised[0]) == found.failure.message


@pytest.mark.parametrize(("use", "what"), [
    (lambda cond: cond.notify(), "notify"),
    (lambda cond: cond.notify_all(), "notify"),
    (lambda cond: cond.wait(1.0), "wait"),
], ids=["notify", "notify_all", "wait"])
def test_a_condition_used_without_its_lock_fails_as_it_fails_the_real_clock(use, what):
    """A producer calling ``cond.notify()`` outside ``with cond:`` raises ``RuntimeError:
    cannot notify on un-acquired lock`` on the real clock (``threading.Condition``) at its
    first call; under the explorer the notify was taken and every schedule passed (a
    ``wait`` outside it raised "release of an unlocked lock", not threading's words). The
    virtual condition raises what the real one raises: the schedule fails naming it."""
    def scenario(clock):
        cond = clock.condition(clock.lock())
        clock.start_thread(lambda: use(cond), "producer")

    found = explore_threads(scenario, seeds=range(3))
    assert found.failure is not None, "the explorer passed what the real clock refuses"
    assert found.failure.message.startswith(
        f"thread producer raised RuntimeError: cannot {what} on un-acquired lock"), (
        found.failure.message)
    with pytest.raises(RuntimeError, match=f"cannot {what} on un-acquired lock"):
        use(SYSTEM.condition(SYSTEM.lock()))


def test_a_try_or_timed_acquire_of_a_lock_the_thread_holds_answers_false_as_threading():
    """``lock.acquire(blocking=False)`` (or ``acquire(timeout=0.5)``) by the thread holding
    the lock answers False on the real clock (``threading.Lock``: a try-lock); the explorer
    failed every schedule with "re-acquired a non-reentrant lock it holds", which only a
    blocking acquire with no timeout (one that would wait for ever) is."""
    def code(clock, answers: list[bool]):
        lock = clock.lock()

        def holder() -> None:
            with lock:
                answers.append(lock.acquire(blocking=False))
                answers.append(lock.acquire(timeout=0.5))
        return holder, lock

    real: list[bool] = []
    code(SYSTEM, real)[0]()
    assert real == [False, False]

    def scenario(clock):
        answers: list[bool] = []
        clock.start_thread(code(clock, answers)[0], "holder")
        return lambda: answers == real or f"answers {answers}"
    found = explore_threads(scenario, seeds=range(3))
    assert found.failure is None, found.failure.message

    def forever(clock):
        holder, lock = code(clock, [])

        def again() -> None:
            with lock:
                lock.acquire()
        clock.start_thread(again, "again")
    found = explore_threads(forever, seeds=range(1))
    assert found.failure is not None
    assert found.failure.message == "thread again re-acquired a non-reentrant lock it holds"


def test_a_long_exploration_reports_its_progress():
    """``explore_threads(seeds=itertools.count())`` explores until a failure, saying nothing
    meanwhile: on code without the bug a user could not tell a long search from a hang.
    ``progress(schedules, seed)`` is called after each schedule that passed; one that is not
    callable is refused before a schedule runs."""
    seen: list[tuple[int, int]] = []
    found = explore_threads(lambda clock: two_counters(clock) and None, seeds=[7, 3, 9],
                            progress=lambda schedules, seed: seen.append((schedules, seed)))
    assert found.failure is None and seen == [(1, 7), (2, 3), (3, 9)]
    with pytest.raises(TypeError, match=r"progress=5: a function of \(schedules, seed\)"):
        explore_threads(two_counters, progress=5)


def test_a_scenario_that_joins_its_threads_is_told_the_explorer_runs_them(monkeypatch):
    """A scenario that joined the threads it started (as the same code does on the real
    clock) hung for ever on ``thread.join()``, before any watchdog (no thread runs until the
    scenario returns), or waited out ``clock.join(thread, 1.0)`` in real time and went on
    with the thread not run. Refused at the join, naming the thread and what to do, before
    any real join (one is recorded and refused here, so a regression fails, not hangs)."""
    def scenario(clock, join):
        done: list[int] = []
        thread = clock.start_thread(lambda: done.append(1), "worker")
        join(clock, thread)
        return lambda: done == [1]

    real_joins: list[float | None] = []
    real_join = threading.Thread.join

    def recorded_join(self, timeout=None):
        frame = inspect.currentframe()  # called by the scenario (the explorer's own clean-up joins)
        while frame is not None and frame.f_code is not scenario.__code__:
            frame = frame.f_back
        if frame is None:
            return real_join(self, timeout)
        real_joins.append(timeout)
        raise AssertionError(f"the scenario's worker was joined in real time ({timeout})")

    for join in (lambda clock, thread: clock.join(thread, 1.0),
                 lambda clock, thread: thread.join()):
        with monkeypatch.context() as patch:
            patch.setattr(threading.Thread, "join", recorded_join)
            with pytest.raises(RuntimeError, match="the scenario joined thread worker: no "
                                                   "thread runs until the scenario has returned"):
                explore_threads(lambda clock, join=join: scenario(clock, join), seeds=[0])
    assert real_joins == []
    assert explore_threads(lambda clock: scenario(clock, lambda c, t: None),
                           seeds=range(2)).failure is None


@pytest.mark.parametrize("seeds", [[], range(0), iter(())], ids=["list", "range", "iterator"])
def test_no_seed_is_refused_not_a_pass(seeds):
    """``explore_threads(scenario, seeds=range(n))`` with ``n`` 0 (a schedule count read from
    the environment, say) returned ``Exploration(schedules=0, failure=None)``: a test asserting
    ``failure is None`` passed having run no schedule. Refused, naming ``seeds``."""
    with pytest.raises(ValueError, match=r"^seeds=.*: no seed, so no schedule ran"):
        explore_threads(two_counters_checked, seeds=seeds)


def two_counters_checked(clock):
    counts = two_counters(clock)
    return lambda: counts[0] == 4


@pytest.mark.parametrize(("where", "said"), [
    ("scenario", "the scenario waited for an event no thread has set yet: no thread runs "
                 "until the scenario has returned"),
    ("final", "final check raised RuntimeError: the final check waited on a condition: it "
              "runs once no thread can go on"),
    ("invariant", "invariant raised RuntimeError: an invariant waited for an event no thread "
                  "has set yet: it runs with every thread stopped"),
], ids=["scenario", "final", "invariant"])
def test_a_wait_outside_the_threads_is_refused_naming_who_waited(where, said):
    """The scenario waiting for an event its thread sets (``started.wait(5)``, as on the
    real clock) was answered False at once and went on as if the thread had not started; a
    final check's or an invariant's ``cond.wait`` raised "block('cond') outside a
    controlled thread". Each is refused naming who waited and why no wait can end there."""
    def scenario(clock):
        started, cond = clock.event(), clock.condition(clock.lock())
        clock.start_thread(lambda: clock.sleep(1.0) or started.set(), "starter")
        if where == "scenario":
            started.wait(5.0)

        def final():
            with cond:
                cond.wait(1.0)
        checks["invariant"] = lambda: started.wait() or True
        return final if where == "final" else None

    checks: dict = {}
    invariant = (lambda: checks["invariant"]()) if where == "invariant" else None
    if where == "scenario":
        with pytest.raises(RuntimeError, match=f"^{said}"):
            explore_threads(scenario, seeds=[0])
        return
    found = explore_threads(scenario, seeds=[0], invariant=invariant)
    assert found.failure is not None and found.failure.message.startswith(said), (
        found.failure and found.failure.message)


class Ledger:
    """A payment worker pool a newcomer writes with ``threading``'s other primitives, all made
    by the clock: jobs on a ``queue.Queue``, an ``RLock`` a method re-takes through another,
    a ``Semaphore`` capping the payments in flight, a ``BoundedSemaphore`` of two slots.
    ``racy``: a payment checks the balance, lets go of the lock while it waits for a slot of
    the payment gateway, and debits after it: two payments may both pass the check."""

    def __init__(self, clock, racy: bool) -> None:
        self.clock, self.racy = clock, racy
        self.mu = clock.rlock()
        self.gateway = clock.semaphore(1)
        self.slots = clock.bounded_semaphore(2)
        self.jobs = clock.queue(maxsize=1)
        self.balance, self.paid = 100, []

    def funds(self, amount: int) -> bool:
        with self.mu:  # (re-taken by pay, which holds it)
            return self.balance >= amount

    def pay(self, amount: int) -> None:
        with self.slots:
            with self.mu:
                ok = self.funds(amount)
                if ok and not self.racy:
                    self.balance -= amount
            if not ok:
                return
            with self.gateway:  # the bug: the check above is stale once the lock is let go
                self.clock.sleep(0.01)
            with self.mu:
                if self.racy:
                    self.balance -= amount
                self.paid.append(amount)

    def worker(self) -> None:
        while True:
            amount = self.jobs.get(timeout=5.0)
            try:
                if amount is None:
                    return
                self.pay(amount)
            finally:
                self.jobs.task_done()

    def producer(self, workers: int) -> None:
        for amount in (70, 60):
            self.jobs.put(amount)
        self.jobs.join()  # every payment judged: then stop the workers
        for _ in range(workers):
            self.jobs.put(None)


def ledger_scenario(racy: bool):
    def scenario(clock):
        ledger = Ledger(clock, racy)
        for name in ("w1", "w2"):
            clock.start_thread(ledger.worker, name)
        clock.start_thread(lambda: ledger.producer(2), "producer")
        return lambda: ledger.balance >= 0 or f"overdrawn: {ledger.balance} after {ledger.paid}"
    return scenario


def test_the_explorer_schedules_rlock_semaphores_and_queues_made_by_the_clock():
    """``Clock`` made locks, conditions and events only: a newcomer's code using an
    ``RLock``, a ``Semaphore``, a ``BoundedSemaphore`` or a ``queue.Queue`` had none to
    take from the clock (``AttributeError``), and ``threading``'s own are not scheduled (a
    thread blocked on one stalled the schedule until the 60 s watchdog). The clock now makes
    them (``rlock``, ``semaphore``, ``bounded_semaphore``, ``queue``), ``SYSTEM`` as
    ``threading``/``queue`` do and the explorer controlled: a check-then-act race across a
    semaphore wait is found, replayed exactly, and the fixed code passes every schedule."""
    found = explore_threads(ledger_scenario(racy=True), seeds=range(200))
    assert found.failure is not None
    assert found.failure.message.startswith("final check: overdrawn: -30 after "), (
        found.failure.message)
    again = replay_threads(ledger_scenario(racy=True), found.failure.choices)
    assert again is not None and again.message == found.failure.message
    fixed = explore_threads(ledger_scenario(racy=False), seeds=range(60))
    assert fixed.failure is None and fixed.schedules == 60
    # the real clock's are threading's and queue's own: the same code runs on real threads
    import queue as queue_module
    assert isinstance(SYSTEM.queue(), queue_module.Queue)
    assert isinstance(SYSTEM.bounded_semaphore(), threading.BoundedSemaphore)
    ledger = Ledger(SYSTEM, racy=False)
    threads = [SYSTEM.start_thread(ledger.worker, name) for name in ("w1", "w2")]
    ledger.producer(2)
    for thread in threads:
        assert SYSTEM.join(thread, 10.0)
    assert ledger.balance == 30 and ledger.paid == [70]


def test_the_clock_s_rlock_semaphores_and_queue_answer_as_threading_s():
    """Under the explorer each answers as its ``threading``/``queue`` original: an RLock
    taken twice is released twice (a condition over it waits releasing every level), a
    bounded semaphore released above its value and a queue's extra ``task_done`` are
    ``ValueError``s, a full or empty queue without blocking raises ``Full``/``Empty``, a
    timed wait ends in virtual time."""
    import queue as queue_module
    seen: list[object] = []

    def scenario(clock):
        mu = clock.rlock()
        ready = clock.condition(mu)
        box, sem = clock.queue(maxsize=1), clock.bounded_semaphore(1)
        state = {"go": False}

        def waiter():
            with mu, mu:
                while not state["go"]:
                    ready.wait()
                seen.append("woken holding both levels")
            seen.append(sem.acquire(timeout=1.0))
            seen.append(sem.acquire(timeout=1.0))  # (taken above: times out, virtually)
            sem.release()
            try:
                sem.release()
            except ValueError as err:
                seen.append(str(err))
            box.put_nowait(1)
            try:
                box.put_nowait(2)
            except queue_module.Full:
                seen.append("full")
            seen.append(box.get())
            try:
                box.get(timeout=2.0)
            except queue_module.Empty:
                seen.append("empty")
            box.task_done()
            try:
                box.task_done()
            except ValueError as err:
                seen.append(str(err))

        def setter():
            with mu:
                state["go"] = True
                ready.notify()
        clock.start_thread(waiter, "waiter")
        clock.start_thread(setter, "setter")
        return None

    for seed in range(5):
        seen.clear()
        found = explore_threads(scenario, seeds=[seed])
        assert found.failure is None, found.failure.message
        assert seen == ["woken holding both levels", True, False,
                        "Semaphore released too many times", "full", 1, "empty",
                        "task_done() called too many times"], seen


def test_a_thread_blocked_on_threading_s_own_queue_or_semaphore_is_named(monkeypatch):
    """``queue.Queue`` or ``threading.Semaphore`` used directly (the clock made none until
    stop 57) blocks outside the scheduler: the watchdog said only "an uncontrolled blocking
    call?". It now names the call the thread is blocked in and the clock's factory to use."""
    import queue as queue_module
    monkeypatch.setattr(explore, "WATCHDOG_S", 0.3)
    jobs, gate = queue_module.Queue(), threading.Semaphore(0)
    for name, wait, named in [("q", lambda: jobs.get(timeout=1.0), "queue.Queue.get"),
                              ("s", lambda: gate.acquire(timeout=1.0),
                               "threading.Semaphore.acquire")]:
        def scenario(clock, wait=wait, name=name):
            clock.start_thread(wait, name)
        found = explore_threads(scenario, seeds=[0])
        assert found.failure is not None
        assert found.failure.message.startswith(
            f"watchdog: thread {name} did not reach a scheduling point within 0.3s real time "
            f"(blocked in {named}) (an uncontrolled blocking call? threading's and queue's own "
            f"objects are not scheduled: make them with the clock, clock.lock(), rlock(), "
            f"condition(lock), event(), semaphore(n), bounded_semaphore(n), queue(maxsize))"), (
            found.failure.message)


def test_a_wait_on_the_clock_s_queue_or_semaphore_outside_the_threads_is_refused():
    """As for a condition or an event: the scenario (no thread has run yet) or a final check
    (none can run any more) that would wait on a controlled queue or semaphore is refused,
    naming the wait, instead of waiting for ever."""
    def getter(clock):
        jobs = clock.queue()
        clock.start_thread(lambda: jobs.put(1), "producer")
        jobs.get()
    with pytest.raises(RuntimeError, match=r"^the scenario got from an empty queue \(a "
                                           r"controlled queue\): no thread runs until"):
        explore_threads(getter, seeds=[0])

    def acquirer(clock):
        gate = clock.semaphore(0)
        clock.start_thread(gate.release, "releaser")
        return lambda: gate.acquire() and gate.acquire()
    found = explore_threads(acquirer, seeds=[0])
    assert found.failure is not None and found.failure.message.startswith(
        "final check raised RuntimeError: the final check acquired a semaphore no thread has "
        "released yet: it runs once no thread can go on"), found.failure.message


@pytest.mark.parametrize("value", ["5s", "0", "-1", "inf", "nan"])
def test_a_watchdog_that_is_no_number_of_seconds_is_refused_naming_the_variable(
        monkeypatch, value):
    """``CALEXEC_EXPLORE_WATCHDOG_S`` was read at import: ``5s`` failed every import of the
    explorer (``could not convert string to float: '5s'``, naming no variable), ``0`` or ``-1``
    failed every schedule blaming its first thread ("did not reach a scheduling point within
    0.0s real time ... an uncontrolled blocking call?"), ``inf`` raised ``OverflowError`` out
    of the scheduler. It is read at each exploration and refused, named, before any schedule
    runs; a good value is used (the watchdog's message names it)."""
    monkeypatch.setattr(explore, "WATCHDOG_S", None)  # the environment's
    monkeypatch.setenv("CALEXEC_EXPLORE_WATCHDOG_S", value)
    ran: list[int] = []

    def scenario(clock):
        ran.append(1)
        two_counters(clock)
    for run in (lambda: explore_threads(scenario, seeds=range(3)),
                lambda: replay_threads(scenario, [])):
        with pytest.raises(ValueError, match=rf"^CALEXEC_EXPLORE_WATCHDOG_S='{value}': the "
                                             r"explorer's real-time watchdog.*> 0"):
            run()
    assert ran == []
    monkeypatch.setenv("CALEXEC_EXPLORE_WATCHDOG_S", " 0.25 ")
    held = threading.Event()  # not the clock's: the thread blocks outside the scheduler

    def stuck(clock):
        clock.start_thread(lambda: held.wait(1.0), "stuck")
    found = explore_threads(stuck, seeds=[0])
    assert found.failure is not None and found.failure.message.startswith(
        "watchdog: thread stuck did not reach a scheduling point within 0.25s"), (
        found.failure.message)
    monkeypatch.delenv("CALEXEC_EXPLORE_WATCHDOG_S")
    assert explore.watchdog_s() == 60.0
    assert explore_threads(scenario, seeds=range(2)).failure is None
