"""The buffer pool's waits (machines/pool.py): a slot given back wakes a request waiting for a
slot of *its* kind, whatever else waits on the pool.

The pool's free lists are per task kind but its waiters once shared one condition, woken with
``notify()`` (one waiter, the oldest): a DECODE slot given back woke a PREFILL waiter, which
found nothing and slept again, and the DECODE waiter slept on until its deadline with a slot
free (found by profiling ``calexec serve`` under load at stop 44). The test holds every slot
of both kinds, parks a PREFILL waiter first and a DECODE waiter second, gives back a DECODE
slot, and asserts the DECODE waiter got it (not ``buffer exhausted`` at its deadline).
"""

from __future__ import annotations

import threading
import time

import pytest

from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.machines.pool import BufferLease
from executor_harness import running_job_path, write_calbin


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("pool"))


def _until(predicate, seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError("condition not reached")
        time.sleep(0.001)


def test_a_slot_given_back_wakes_a_waiter_of_its_kind(calbin):
    with running_job_path(calbin) as ex:
        pool = ex.gen.pool
        # start() returns once the golden run's result is in; its slot comes back just after
        # (the completion thread resolves, then gives the lease back). Taken before it is
        # back, that slot would come back later and serve a waiter at once: the test failed
        # 2 runs in 6 on a loaded host (stop 47)
        _until(lambda: pool.counts()["Free"] == len(pool.slots))
        held: dict[TaskKind, list[BufferLease]] = {TaskKind.PREFILL_IDS: [], TaskKind.DECODE: []}
        for kind, leases in held.items():
            while pool.free(kind):
                lease = pool.acquire(kind, time.monotonic() + 5.0, owner=0)
                assert isinstance(lease, BufferLease), lease
                leases.append(lease)
            assert leases, kind
        got: dict[TaskKind, BufferLease | Status] = {}

        def wait_for(kind: TaskKind, seconds: float) -> None:
            got[kind] = pool.acquire(kind, time.monotonic() + seconds, owner=1)

        prefill = threading.Thread(target=wait_for, args=(TaskKind.PREFILL_IDS, 60.0))
        prefill.start()  # the oldest waiter
        _until(lambda: pool.waiting(TaskKind.PREFILL_IDS) == 1)
        decode = threading.Thread(target=wait_for, args=(TaskKind.DECODE, 60.0))
        decode.start()
        _until(lambda: pool.waiting(TaskKind.DECODE) == 1)
        try:
            assert held[TaskKind.DECODE].pop().release().ok
            decode.join(10.0)  # woken at once by the slot, or (the bug) at its deadline
            assert not decode.is_alive(), "the DECODE waiter slept on with a DECODE slot free"
            assert isinstance(got.get(TaskKind.DECODE), BufferLease), got.get(TaskKind.DECODE)
            assert pool.waiting(TaskKind.PREFILL_IDS) == 1  # still waiting: nothing of its kind
        finally:
            for leases in held.values():
                for lease in leases:
                    lease.release()
            prefill.join(10.0)
            for lease in got.values():
                if isinstance(lease, BufferLease):
                    lease.release()
        assert isinstance(got.get(TaskKind.PREFILL_IDS), BufferLease)  # woken by its own kind
