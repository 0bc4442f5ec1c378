"""§4.2 ``BufferLease`` (machines/pool.py), its own rules, each read on a running executor's pool:

- move-only: no copy, deep copy or pickle; ``moved()`` hands the slot over and the moved-from
  lease can neither be used nor released (counted as misuse);
- released or dropped while the runtime may still DMA the slot (InFlight), or dropped while
  held at all, the slot is quarantined, never silently reused: it is not on the free list
  and no later lease gets it.

These were only exercised indirectly (the stateful invariants 3 and 7 hold while the executor
uses leases as it should); a lease dropped by the garbage collector, or copied, was never
tried.
"""

from __future__ import annotations

import copy
import gc
import pickle
import time

import pytest

from calexec.contracts.types import TaskKind
from calexec.machines.pool import BufferLease, LeaseError
from executor_harness import running_job_path, write_calbin

KIND = TaskKind.DECODE


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("lease"))


def _settled_pool(ex):
    """The pool once the start's golden job gave its slot back (bounded wait)."""
    pool = ex.gen.pool
    end = time.monotonic() + 10.0
    while pool.counts()["Free"] != len(pool.slots):
        assert time.monotonic() < end, pool.counts()
        time.sleep(0.001)
    return pool


def _lease(pool) -> BufferLease:
    lease = pool.acquire(KIND, time.monotonic() + 5.0, owner=99)
    assert isinstance(lease, BufferLease), lease
    return lease


def test_a_lease_is_move_only(calbin):
    with running_job_path(calbin) as ex:
        pool = _settled_pool(ex)
        lease = _lease(pool)
        slot = lease.slot
        for duplicate in (copy.copy, copy.deepcopy, pickle.dumps):
            with pytest.raises(LeaseError, match="move-only"):
                duplicate(lease)
        misuse = pool.misuse
        taken = lease.moved(owner=100)
        assert taken.slot is slot and taken.owner == 100 and not lease.held
        with pytest.raises(LeaseError, match=r"use of a moved lease \(owner job 99\)"):
            _ = lease.slot
        with pytest.raises(LeaseError, match="release of a moved lease"):
            lease.release()
        assert slot.run.state == "Leased"  # the moved-from lease gave nothing back
        assert taken.release().ok and slot.run.state == "Free"
        with pytest.raises(LeaseError, match="release of a released lease"):
            taken.release()
        del lease, taken
        assert pool.counts()["Free"] == len(pool.slots)
        # each use of a spent lease is counted on its pool (machines/pool.py: ``pool.misuse``)
        assert pool.misuse == misuse + 3


def test_a_lease_released_while_in_flight_quarantines_its_slot(calbin):
    with running_job_path(calbin) as ex:
        pool = _settled_pool(ex)
        free_before = pool.free(KIND)
        lease = _lease(pool)
        slot = lease.slot
        pool.mark_in_flight(lease)
        assert slot.run.state == "InFlight"
        status = lease.release()
        assert not status.ok and status.code == "internal.lease_in_flight", status
        assert "may still DMA" in status.message
        assert slot.run.state == "Quarantined" and pool.free(KIND) == free_before - 1
        # never silently reused: every later lease of its kind is another slot
        others = [_lease(pool) for _ in range(pool.free(KIND))]
        assert all(other.slot is not slot for other in others)
        for other in others:
            assert other.release().ok


@pytest.mark.parametrize("in_flight", [False, True], ids=["leased", "in_flight"])
def test_a_lease_dropped_while_held_quarantines_its_slot(calbin, in_flight):
    """§4.2: a lease destroyed while it holds its slot (the C++ destructor; here the garbage
    collector) quarantines the slot: conservative, the runtime may still use it."""
    with running_job_path(calbin) as ex:
        pool = _settled_pool(ex)
        free_before, dropped_before = pool.free(KIND), pool.dropped
        lease = _lease(pool)
        slot = lease.slot
        if in_flight:
            pool.mark_in_flight(lease)
        del lease
        gc.collect()
        assert pool.dropped == dropped_before + 1
        assert slot.run.state == "Quarantined"
        assert pool.free(KIND) == free_before - 1 and slot not in [
            s for s in pool.slots if s.run.state == "Free"]
