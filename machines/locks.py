"""Ranked locks for the executor (spec §5.2).

The spec fixes one acquisition order for the executor's locks::

    lifecycle_mu -> admission_mu -> pool_mu -> submit_mu

and forbids the completion thread from holding any of them while it blocks in ``Wait()``.
calexec ranks every other lock it owns around that order (issue 13: no lock outside it)::

    recovery_mu -> lifecycle_mu -> admission_mu -> pool_mu -> submit_mu -> completion_mu
        -> kv_call_mu -> faults_mu -> counters_mu

``recovery_mu`` serialises recoveries and is held across their lifecycle steps, so it ranks
first; ``kv_call_mu`` (KvManager calls), ``faults_mu`` (the fault controller's windows) and
``counters_mu`` are leaves: nothing is acquired while holding them. No runtime call is made
while holding pool_mu, submit_mu or completion_mu (§5.2); KvManager calls hold only the leaf
``kv_call_mu``.

Checking mode is on when ``ExecutorConfig.check_lock_order`` is set or the environment variable
``CALEXEC_CHECK_LOCK_ORDER=1`` is (the test suite sets it, so every test checks the order; 0 or
unset is off, another value an error naming it: ``machines/envflag.py``);
every ``LockOrder`` registers itself in ``ALL_ORDERS`` so a test fixture can assert that no
executor built during a test saw a violation.
``RankedLock`` is a ``threading.Lock`` with a rank. In checking mode (tests, or
``ExecutorConfig.check_lock_order``) every acquisition is checked against the ranks the calling
thread already holds; an out-of-order acquisition is recorded in ``LockOrder.violations`` (and
raised as ``LockOrderViolation`` when ``strict``). ``LockOrder.held_by_current_thread()`` lets the
completion thread prove it holds nothing before ``Wait()``.
"""

from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING

from calexec.machines.envflag import env_flag

if TYPE_CHECKING:
    from calexec.machines.clock import Clock

RECOVERY, LIFECYCLE, ADMISSION, POOL, SUBMIT, COMPLETION, KV_CALL, FAULTS, COUNTERS = range(9)
RANK_NAMES = {
    RECOVERY: "recovery_mu",
    LIFECYCLE: "lifecycle_mu",
    ADMISSION: "admission_mu",
    POOL: "pool_mu",
    SUBMIT: "submit_mu",
    COMPLETION: "completion_mu",
    KV_CALL: "kv_call_mu",
    FAULTS: "faults_mu",
    COUNTERS: "counters_mu",
}
ORDER_TEXT = " -> ".join(RANK_NAMES[r] for r in sorted(RANK_NAMES))

#: every LockOrder created in this process (weakly): tests assert none saw a violation
ALL_ORDERS: weakref.WeakSet[LockOrder] = weakref.WeakSet()


#: the environment variable that turns checking mode on (tests: tests/conftest.py sets it)
CHECK_ENV = "CALEXEC_CHECK_LOCK_ORDER"


def checking_from_env() -> bool:
    """``$CALEXEC_CHECK_LOCK_ORDER``: 1 on, 0 or unset off; another value raises
    ``EnvFlagError`` naming it (until stop 67 any value but 0 was on: ``=false`` too)."""
    return env_flag(CHECK_ENV, False, on="check the executor's lock order",
                    off="leave it unchecked (ExecutorConfig.check_lock_order still turns it on)")


class LockOrderViolation(RuntimeError):
    """A thread acquired a lock of lower or equal rank than one it already holds."""


class LockOrder:
    """Per-executor registry of ranked locks and of the order violations seen."""

    def __init__(self, checking: bool = False, strict: bool = False,
                 clock: Clock | None = None) -> None:
        from calexec.machines.clock import SYSTEM
        self.clock = clock or SYSTEM  # carried to every controller that gets this order
        from_env = checking_from_env()  # (read even when given: a bad value is said)
        self.checking = checking or from_env
        self.strict = strict
        self.violations: list[str] = []
        self._local = threading.local()
        ALL_ORDERS.add(self)

    def _held(self) -> list[int]:
        held = getattr(self._local, "held", None)
        if held is None:
            held = self._local.held = []
        return held

    def held_by_current_thread(self) -> tuple[str, ...]:
        return tuple(RANK_NAMES[r] for r in self._held())

    def lock(self, rank: int) -> RankedLock | threading.Lock:
        """A lock of ``rank``: a checking ``RankedLock`` in checking mode, else a plain
        ``threading.Lock`` (the hot path pays nothing for the checks it does not run)."""
        return RankedLock(self, rank) if self.checking else self._plain_lock()

    def _plain_lock(self) -> threading.Lock:
        """The lock under a ranked lock or of non-checking mode: made by the clock (the
        interleaving explorer's clock hands out controlled locks)."""
        return self.clock.lock()

    def _before_acquire(self, rank: int) -> None:
        held = self._held()
        if held and held[-1] >= rank:
            message = (
                f"{RANK_NAMES[rank]} acquired while holding {RANK_NAMES[held[-1]]} "
                f"(thread {threading.current_thread().name}); order is {ORDER_TEXT}"
            )
            self.violations.append(message)
            if self.strict:
                raise LockOrderViolation(message)


class RankedLock:
    """A non-reentrant lock with a rank in the §5.2 order; usable with ``threading.Condition``."""

    __slots__ = ("_order", "rank", "_lock")

    def __init__(self, order: LockOrder, rank: int) -> None:
        self._order = order
        self.rank = rank
        self._lock = order._plain_lock()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        order = self._order
        if order.checking:
            order._before_acquire(self.rank)
        got = self._lock.acquire(blocking, timeout)
        if got and order.checking:
            order._held().append(self.rank)
        return got

    def release(self) -> None:
        order = self._order
        if order.checking:
            held = order._held()
            if self.rank in held:
                # Remove the most recent entry of this rank (Condition.wait releases/reacquires).
                del held[len(held) - 1 - held[::-1].index(self.rank)]
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()

    def _is_owned(self) -> bool:
        # threading.Condition's fallback probes with acquire(False), which would count as an
        # out-of-order acquisition; a ranked lock is only ever released by its holder.
        return self._lock.locked()

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()
