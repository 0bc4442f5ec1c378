"""Generation-scoped buffer pool and move-only leases (spec §4.2, §5.1-3/4/5/8, S06, S07, FI15).

A ``BufferPool`` is built once per model generation. Every ``BufferSlot`` owns host storage
(numpy arrays) allocated once, and one runtime InputBuf/OutputBuf pair created once and mapped
once onto that storage. Host arrays are never resized, moved or freed while mapped (invariant
4): they live as long as the slot, and a slot is destroyed only when it is Free or Retired.

Each slot's state is a run of the declared ``BufferSlotChart`` (Free, Leased, InFlight,
Quarantined, Retired); the slot object answers the chart's guards:

- ``runtime_done``: the runtime no longer uses the slot's buffers (GetStatus is not
  PENDING/RUNNING; IDLE when infer() never accepted the job).
- ``undo_slice_done``: every SliceTensor was undone (FI15; else ``give_back`` quarantines).
- ``reset_confirmed``: after the drain or reset that ended the generation, the runtime's own
  answer (GetStatus, asked outside pool_mu) says it no longer runs anything on the slot; a slot
  whose job still runs is never retired (its buffers stay mapped).

A ``BufferLease`` is the only way to reach a leased slot. It is move-only: ``moved()`` hands
the slot to a new lease object and invalidates the old one; copying or pickling raises. Using
a released or moved-from lease raises ``LeaseError`` (a programming error, counted in
``pool.misuse``). Releasing while the slot is InFlight does not return it: the slot is
quarantined (§4.2: "Submitted-state destruction asserts and quarantines"), and so does a
lease that is garbage-collected while still holding a slot.

Locking: ``pool_mu`` (rank 2 of §5.2) guards the free lists and slot transitions; no runtime
call is made while holding it (§5.2): ``GetStatus`` is asked before the lock is taken and the
``runtime_done`` guard reads that answer (``BufferSlot.runtime_answer``); buffers are destroyed
after the lock is released.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable
from typing import NoReturn

import numpy as np

from calexec.contracts.codes import DeviceJobStatus
from calexec.contracts.prepare import InferenceRequest, TensorSlice, check_slice, plan_slices
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import (
    EngineSlot,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
)
from calexec.machines.chart_names import (
    SLOT_EV_DEVICE_DONE,
    SLOT_EV_DROP_IN_FLIGHT,
    SLOT_EV_GIVE_BACK,
    SLOT_EV_LEASE,
    SLOT_EV_QUARANTINE,
    SLOT_EV_RETIRE,
    SLOT_EV_SUBMIT,
    SLOT_FREE,
    SLOT_IN_FLIGHT,
    SLOT_LEASED,
    SLOT_QUARANTINED,
    SLOT_RETIRED,
)
from calexec.machines.compiled import BUFFER_SLOT, GuardRejected
from calexec.machines.device_api import InputBufApi, ModelApi, OutputBufApi, no_object
from calexec.machines.locks import POOL, LockOrder


class LeaseError(RuntimeError):
    """A lease was used after release, released twice, or used after being moved from."""


def host_array(contract: TensorContract) -> np.ndarray:
    """Flat host storage for one tensor contract (allocated once, never resized). Not
    zero-filled (~32 MB a generation of the bundled model at two slots a kind; every start,
    recovery and switch paid for it): no reader sees a byte nobody wrote. The host writes a
    job's input rows before it submits; the device writes the whole output before it reports
    it valid, and the host reads a row only after that (``Completion.postprocess``);
    tests/test_host_storage.py pins it."""
    array = np.empty(math.prod(contract.shape), dtype=contract.dtype.host_dtype)
    if array.nbytes != contract.byte_size:
        raise ValueError(
            f"tensor {contract.name!r}: shape {contract.shape} x {contract.dtype} is "
            f"{array.nbytes} bytes but the contract says byte_size={contract.byte_size}"
        )
    return array


class BufferSlot:
    """One slot: host storage + mapped runtime buffers for one submodel (§4.2 BufferSlot)."""

    __slots__ = ("slot_id", "generation_id", "kind", "engine", "submodel", "model", "inbuf",
                 "outbuf", "host_input", "host_position", "host_output", "scratch", "sliced", "run",
                 "runtime_answer", "_pool", "__weakref__")

    def __init__(self, pool: BufferPool, slot_id: int, submodel: SubmodelContract,
                 model: ModelApi, engine: EngineSlot) -> None:
        self._pool = pool
        self.slot_id = slot_id
        self.generation_id = pool.generation_id
        self.kind = submodel.kind
        self.engine = engine
        self.submodel = submodel
        self.model = model
        #: the runtime buffers: created and mapped by ``BufferPool.open``, None once destroyed
        self.inbuf: InputBufApi | None = None
        self.outbuf: OutputBufApi | None = None
        #: host storage, mapped into the buffers; None only once dropped (``drop_storage``)
        self.host_input: np.ndarray | None = host_array(submodel.token_or_embed)
        self.host_position: np.ndarray | None = host_array(submodel.position)
        self.host_output: np.ndarray | None = host_array(submodel.logits)
        # Scratch for the finiteness check of one logits row (no per-token allocation).
        self.scratch: np.ndarray | None = np.empty(pool.generation.vocab_size, dtype=np.uint16)
        self.sliced: set[str] = set()
        #: the runtime's last GetStatus answer (rc, status) for this slot's output buffer
        self.runtime_answer: tuple[int, int] | None = None
        self.run = BUFFER_SLOT.run(self)

    # ---- guards of BufferSlotChart -------------------------------------------------------
    def ask_runtime(self) -> tuple[int, int] | None:
        """GetStatus of the output buffer (a runtime call: never under pool_mu), kept as
        ``runtime_answer`` for the chart's ``runtime_done`` guard. None once destroyed."""
        outbuf = self.outbuf
        self.runtime_answer = None if outbuf is None else outbuf.get_status()
        return self.runtime_answer

    def runtime_done(self) -> bool:
        """Guard: the runtime's last answer says it no longer uses the buffers."""
        answer = self.runtime_answer
        return answer is not None and answer[0] == 0 and answer[1] not in (
            DeviceJobStatus.PENDING, DeviceJobStatus.RUNNING)

    def runtime_let_go(self) -> bool:
        """Ask the runtime now (outside any pool lock) whether it let go of the buffers."""
        self.ask_runtime()
        return self.runtime_done()

    def undo_slice_done(self) -> bool:
        return not self.sliced

    def reset_confirmed(self) -> bool:
        """Guard of ``retire``: the runtime's answer, asked once the generation was drained
        or reset, says the slot is no longer in use (a hung job keeps its slot)."""
        return self.runtime_done()

    # ---- runtime calls on the slot's buffers (return Status, never raise) -----------------
    def _map(self, inbuf: InputBufApi, outbuf: OutputBufApi) -> Status:
        """Map the host storage into this slot's new buffers (``BufferPool.open``)."""
        sm = self.submodel
        host_input, host_position, host_output = (self.host_input, self.host_position,
                                                  self.host_output)
        if host_input is None or host_position is None or host_output is None:
            return self._dropped("map")
        for rc, what in (
            (inbuf.map(sm.token_or_embed.name, host_input), sm.token_or_embed.name),
            (inbuf.map(sm.position.name, host_position), sm.position.name),
            (outbuf.map(sm.logits.name, host_output), sm.logits.name),
        ):
            if rc != 0:
                return Status.from_map(rc, what, generation=self.generation_id)
        return Status.OK

    def prepare(self, request: InferenceRequest) -> Status:
        """Copy ``request``'s inputs into this slot's host storage, slice, set the CSRs
        (§6.3 steps 7-8): the job's preparation, on its request thread."""
        sm = self.submodel
        n = request.token_count
        host_input, host_position = self.host_input, self.host_position
        if host_input is None or host_position is None:
            return self._dropped("prepare")
        if request.kind == TaskKind.PREFILL_EMBEDS:
            embeddings = request.embeddings
            if embeddings is None:  # check_request (§6.3 step 4) refuses it before a lease
                return Status.invalid(4, "embeddings is None for kind=PREFILL_EMBEDS")
            flat = embeddings.reshape(-1)
            host_input[: flat.shape[0]] = flat
        else:
            host_input[:n] = request.tokens
        host_position[:n] = request.positions
        for planned in plan_slices(request, sm):
            status = self.slice_input(planned)
            if not status.ok:
                return status
        inbuf = self.inbuf
        if inbuf is None:
            return self._destroyed("SetCSR")
        for name, value in ((sm.csr_cur_seq, n), (sm.csr_total_seq, request.past_len + n)):
            status = Status.from_csr(inbuf.set_csr(name, value), name, value)
            if not status.ok:
                return status
        return Status.OK

    def slice_input(self, planned: TensorSlice) -> Status:
        """SliceTensor one input (§6.3 steps 6 and 8): the byte range is checked against the
        contract first (FI03: nothing out of range reaches the runtime), then passed to the
        runtime in elements."""
        contract = self.submodel.token_or_embed
        if planned.tensor != contract.name:
            contract = self.submodel.position
        status = check_slice(contract, planned.offset, planned.size)
        if not status.ok:
            return status
        item = contract.dtype.itemsize
        inbuf = self.inbuf
        if inbuf is None:
            return self._destroyed("SliceTensor")
        rc = inbuf.slice(planned.tensor, planned.offset // item, planned.size // item)
        if rc != 0:
            return Status.from_slice(rc, planned.tensor, planned.offset, planned.size)
        self.sliced.add(planned.tensor)
        return Status.OK

    def undo_slices(self) -> Status:
        """UndoSlice every sliced tensor (§6.5 "reset slice/tensors")."""
        result = Status.OK
        inbuf = self.inbuf
        if inbuf is None:
            return self._destroyed("UndoSlice") if self.sliced else result
        for name in sorted(self.sliced):
            rc = inbuf.undo_slice(name)
            if rc == 0:
                self.sliced.discard(name)
            elif result.ok:
                result = Status.from_calrt(rc, Phase.RELEASE, message=f"UndoSlice({name!r}) failed")
        return result

    def _destroyed(self, what: str) -> Status:
        """A runtime call on a slot whose buffers were destroyed (its pool closed while it was
        leased): a bug of the caller's, as a value."""
        return Status.internal("slot_destroyed", Phase.PREPARE,
                               f"{what} on buffer slot {self.slot_id}: its buffers are destroyed",
                               generation=self.generation_id)

    def _dropped(self, what: str) -> Status:
        return Status.internal("slot_dropped", Phase.MAP,
                               f"{what} on buffer slot {self.slot_id}: its host storage was dropped",
                               generation=self.generation_id)

    def __repr__(self) -> str:
        return (f"BufferSlot(id={self.slot_id}, gen={self.generation_id}, "
                f"kind={self.kind.name}, state={self.run.state})")


class BufferLease:
    """Move-only ownership of one leased slot (§4.2 ``BufferLease``)."""

    __slots__ = ("_pool", "_slot", "_state", "owner")

    def __init__(self, slot: BufferSlot, owner: int | None = None) -> None:
        self._slot: BufferSlot | None = slot
        # kept past a move or release: the misuse of a spent lease is counted on its pool
        self._pool: BufferPool = slot._pool
        self._state = "held"  # held | moved | released
        self.owner = owner

    @property
    def slot(self) -> BufferSlot:
        slot = self._slot
        if slot is None:
            self._misuse(f"use of a {self._state} lease")
        return slot

    @property
    def held(self) -> bool:
        return self._slot is not None

    def moved(self, owner: int | None = None) -> BufferLease:
        """Hand the slot to a new lease; this one becomes unusable (C++ move semantics)."""
        slot = self.slot
        self._slot, self._state = None, "moved"
        return BufferLease(slot, owner if owner is not None else self.owner)

    def release(self) -> Status:
        """Return the slot: Free if the runtime is done and slices were undone, else quarantine.

        Releasing while the slot is InFlight quarantines it (never a silent reuse)."""
        slot = self._slot
        if slot is None:
            self._misuse(f"release of a {self._state} lease")
        self._slot, self._state = None, "released"
        return slot._pool._give_back(slot)

    def _misuse(self, what: str) -> NoReturn:
        # (a spent lease has no slot: the pool it came from counts it; no pool_mu, which the
        # caller may hold: ``mark_in_flight`` reads ``lease.slot`` under it)
        self._pool.misuse += 1
        raise LeaseError(f"{what} (owner job {self.owner})")

    def __copy__(self) -> NoReturn:
        raise LeaseError("BufferLease is move-only: use moved(), never copy")

    def __deepcopy__(self, memo: dict[int, object]) -> NoReturn:
        raise LeaseError("BufferLease is move-only: use moved(), never copy")

    def __reduce__(self) -> NoReturn:
        raise LeaseError("BufferLease is move-only and cannot be pickled")

    def __del__(self) -> None:
        slot = getattr(self, "_slot", None)
        if slot is not None:  # dropped while holding: conservative quarantine (§4.2)
            slot._pool._quarantine_dropped(slot)


class BufferPool:
    """All slots of one model generation (S07: created once, mapped once, reused)."""

    def __init__(self, generation: ModelGeneration, models: dict[TaskKind, ModelApi],
                 slots_per_kind: dict[TaskKind, int], locks: LockOrder,
                 engines: tuple[EngineSlot, ...] = (EngineSlot.AUTO,)) -> None:
        self.generation = generation
        self.generation_id = generation.generation_id
        self.pool_mu = locks.lock(POOL)
        self.clock = locks.clock
        self.misuse = 0
        self.dropped = 0
        self.slots: list[BufferSlot] = []
        self.opened = False  # every slot's buffers created and mapped
        # free slots per task kind; in Phase B each slot is fixed to PING or PONG (§6.4)
        self._free: dict[TaskKind, deque[BufferSlot]] = {}
        #: requests waiting in ``acquire`` per kind (a speculative acquire leaves them the slot)
        self._waiting: dict[TaskKind, int] = {}
        ids = itertools.count()
        for kind, count in slots_per_kind.items():
            submodel = generation.submodels[kind]
            for index in range(count):
                engine = engines[index % len(engines)]
                slot = BufferSlot(self, next(ids), submodel, models[kind], engine)
                self.slots.append(slot)
                self._free.setdefault(kind, deque()).append(slot)
        #: one condition per kind, all on pool_mu: a slot given back wakes a waiter of its own
        #: kind (one shared condition woke the oldest waiter of any kind, which slept again,
        #: while the waiter the slot was for slept on until its deadline)
        self._available = {kind: self.clock.condition(self.pool_mu, "pool")
                           for kind in self._free}
        self._models = models

    def open(self) -> Status:
        """Create and map every slot's runtime buffers once. On failure nothing stays mapped."""
        for slot in self.slots:
            rc, inbuf = slot.model.create_input_buf()
            slot.inbuf = inbuf
            if rc != 0:
                self.close()
                return Status.from_calrt(rc, Phase.MAP, message="InputBuf create failed",
                                         generation=self.generation_id)
            rc, outbuf = slot.model.create_output_buf()
            slot.outbuf = outbuf
            if rc != 0:
                self.close()
                return Status.from_calrt(rc, Phase.MAP, message="OutputBuf create failed",
                                         generation=self.generation_id)
            if inbuf is None or outbuf is None:
                self.close()
                return no_object("InputBuf/OutputBuf create", Phase.MAP,
                                 generation=self.generation_id)
            status = slot._map(inbuf, outbuf)
            if not status.ok:
                self.close()
                return status
        self.opened = True
        return Status.OK

    def close(self) -> None:
        """Destroy the runtime buffers of slots the runtime cannot touch any more.

        Free and Retired slots are destroyed. Leased/InFlight/Quarantined slots keep their
        buffers and host storage alive (invariant 4) until a confirmed reset retires them."""
        doomed = []
        with self.pool_mu:
            self.opened = False
            for slot in self.slots:
                if slot.run.state in (SLOT_FREE, SLOT_RETIRED):
                    doomed += [buf for buf in (slot.inbuf, slot.outbuf) if buf is not None]
                    slot.inbuf = slot.outbuf = None
        for buf in doomed:  # runtime calls after pool_mu is released (§5.2)
            buf.destroy()

    # ---- leasing ---------------------------------------------------------------------------
    def acquire(self, kind: TaskKind, deadline: float, owner: int | None = None,
                stop: Callable[[], Status | None] = lambda: None,
                speculative: bool = False) -> BufferLease | Status:
        """Lease a free slot of ``kind`` (of whichever engine it is fixed to), waiting on a
        condition (never polling) until ``deadline`` (absolute ``time.monotonic()``);
        ``stop()`` returning a Status (cancel, shutdown) ends the wait with it.
        ``speculative`` (a pre-armed job: no caller asked for it yet): never a slot that a
        request is waiting for."""
        available = self._available.get(kind)
        if available is None:
            return Status.invalid(5, f"no buffer slot for kind={kind.name} in this generation")
        with available:
            while True:
                free = self._free[kind]
                if free and not (speculative and self._waiting.get(kind)):
                    slot = free.popleft()
                    slot.run.send(SLOT_EV_LEASE)
                    return BufferLease(slot, owner)
                stopped = stop()
                if stopped is not None:
                    return stopped
                remaining = deadline - self.clock.monotonic()
                if remaining <= 0:
                    # the caller's own deadline may have passed between ``stop()`` and the
                    # read above (a stalled thread): its answer is that deadline (504), as
                    # when it passes during the wait, never "no slot" (429)
                    stopped = stop()
                    if stopped is not None:
                        return stopped
                    return Status.exhausted(
                        "buffer", Phase.LEASE, f"no free {kind.name} buffer slot before the deadline",
                        generation=self.generation_id)
                self._waiting[kind] = self._waiting.get(kind, 0) + 1
                try:
                    self.clock.wait(available, remaining)
                finally:
                    self._waiting[kind] -= 1

    def wake(self) -> None:
        """Wake waiters (a cancel or shutdown happened)."""
        with self.pool_mu:
            for available in self._available.values():
                available.notify_all()

    def mark_in_flight(self, lease: BufferLease) -> None:
        with self.pool_mu:
            lease.slot.run.send(SLOT_EV_SUBMIT)

    def device_done(self, lease: BufferLease) -> bool:
        """InFlight -> Leased once the runtime finished with the buffers; False if it has not.
        GetStatus is asked before pool_mu is taken; the guard reads that answer."""
        slot = lease.slot
        if slot.run.state == SLOT_IN_FLIGHT:
            slot.ask_runtime()
        with self.pool_mu:
            run = slot.run
            if run.state != SLOT_IN_FLIGHT:
                return run.state == SLOT_LEASED
            try:
                run.send(SLOT_EV_DEVICE_DONE)
            except GuardRejected:
                return False
            return True

    def quarantine(self, lease: BufferLease, reason: str) -> None:
        """Quarantine the leased slot (failure after submit, §6.5); the lease is consumed."""
        slot = lease.slot
        lease._slot, lease._state = None, "released"
        with self.pool_mu:
            if slot.run.state != SLOT_QUARANTINED:
                slot.run.send(SLOT_EV_QUARANTINE)

    def _give_back(self, slot: BufferSlot) -> Status:
        with self.pool_mu:
            run = slot.run
            if run.state == SLOT_IN_FLIGHT:
                run.send(SLOT_EV_DROP_IN_FLIGHT)
                return Status.internal("lease_in_flight", Phase.RELEASE,
                                       f"lease of slot {slot.slot_id} released while the runtime "
                                       "may still DMA it: slot quarantined",
                                       generation=slot.generation_id)
            if run.state != SLOT_LEASED:
                self.misuse += 1
                return Status.internal("lease_state", Phase.RELEASE, f"slot {slot.slot_id} returned in state "
                                                      f"{run.state}", generation=slot.generation_id)
            target = run.send(SLOT_EV_GIVE_BACK)
            if target == SLOT_FREE:
                self._free[slot.kind].append(slot)
                self._available[slot.kind].notify()
                return Status.OK
            return Status.internal("undo_slice_missing", Phase.RELEASE,
                                   f"slot {slot.slot_id} returned with active slices "
                                   f"{sorted(slot.sliced)} (UndoSlice missing): quarantined",
                                   generation=slot.generation_id)

    def _quarantine_dropped(self, slot: BufferSlot) -> None:
        with self.pool_mu:
            self.dropped += 1
            if slot.run.state in (SLOT_LEASED, SLOT_IN_FLIGHT):
                slot.run.send(SLOT_EV_QUARANTINE)

    def quarantine_all(self) -> int:
        """Invariant 8: a reset quarantines every slot of this (old) generation."""
        count = 0
        with self.pool_mu:
            for slot in self.slots:
                if slot.run.state in (SLOT_FREE, SLOT_LEASED, SLOT_IN_FLIGHT):
                    slot.run.send(SLOT_EV_QUARANTINE)
                    count += 1
            for free in self._free.values():
                free.clear()
        return count

    def retire_quarantined(self) -> list[BufferSlot]:
        """After the drain or reset that ended the generation: Quarantined -> Retired and
        buffers destroyed, for every slot the runtime says it let go of (asked first, outside
        pool_mu). Returns the slots the runtime still uses (their buffers stay mapped)."""
        for slot in self.slots:
            if slot.run.state == SLOT_QUARANTINED:
                slot.ask_runtime()
        doomed, held = [], []
        with self.pool_mu:
            for slot in self.slots:
                if slot.run.state != SLOT_QUARANTINED:
                    continue
                try:
                    slot.run.send(SLOT_EV_RETIRE)
                except GuardRejected:
                    held.append(slot)
                    continue
                doomed += [buf for buf in (slot.inbuf, slot.outbuf) if buf is not None]
                slot.inbuf = slot.outbuf = None
        for buf in doomed:  # runtime calls after pool_mu is released (§5.2)
            buf.destroy()
        return held

    def drop_storage(self) -> None:
        """Free the host arrays of every slot; only for a retired pool whose runtime buffers
        are destroyed (every slot Retired), so invariant 4 cannot be broken."""
        with self.pool_mu:
            for slot in self.slots:
                if slot.run.state != SLOT_RETIRED:
                    raise LeaseError(f"drop_storage of {slot!r}: only Retired slots")
                slot.host_input = slot.host_position = slot.host_output = slot.scratch = None

    def free(self, kind: TaskKind) -> int:
        """Slots of ``kind`` free to lease now."""
        with self.pool_mu:
            return len(self._free.get(kind, ()))

    def waiting(self, kind: TaskKind) -> int:
        """Requests waiting in ``acquire`` for a slot of ``kind`` now."""
        with self.pool_mu:
            return self._waiting.get(kind, 0)

    def usable(self, kind: TaskKind) -> int:
        """Slots of ``kind`` that can still be leased now or later (not quarantined/retired)."""
        with self.pool_mu:
            return sum(1 for slot in self.slots if slot.kind == kind
                       and slot.run.state not in (SLOT_QUARANTINED, SLOT_RETIRED))

    # ---- observability ---------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        """Slots per chart state (for metrics and the leased==0 check)."""
        result = {state: 0 for state in BUFFER_SLOT.states}
        for slot in self.slots:
            result[slot.run.state] += 1
        return result
