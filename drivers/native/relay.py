"""The native relay (drivers/native/calexec_relay.h): the submitter's and the completion
thread's waits in C, and greedy firing decided by Python beforehand (issue 28).

:class:`NativeRelay` wraps one ``calexec_relay`` for one device generation. It calls the
runtime through function addresses (:class:`RelayFunctions`: ``CalRT.relay_functions()`` of
the bundled emulator or a vendor shim), with the handles' addresses (``Device.address`` etc.);
like the rest of drivers/native it imports nothing of calexec. cffi releases the GIL around every call, so a thread in
:meth:`NativeRelay.submitter_wait` or :meth:`NativeRelay.completion_wait` holds no GIL while
it waits, infers, Waits, takes the argmax and hands the next job over.

Not wired into ``DeviceExecutor``: today it backs the ``relay_floor`` side of
``calexec bench overhead`` (drivers/tools/bench/relayfloor.py), which measures what the design
of docs/architecture.md ("Native hand-offs") would cost per token before it is built into the
executor. Every method returns the C code or an :class:`RelayEvent`; none raises for a runtime
outcome.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Protocol

import attrs
import numpy as np

from calexec.drivers.native._calexec_native import ffi as _ffi
from calexec.drivers.native._calexec_native import lib as _lib

#: how many stop tokens a rule carries (CALEXEC_RELAY_MAX_STOP)
MAX_STOP = 16
#: the relay's queue capacity (fires, jobs in flight) and rule table size
QUEUE = 4
RULES = 8


class Rc(enum.IntEnum):
    """calexec_relay_rc"""
    OK = 0
    ENULL = 1
    EFULL = 2
    ECLOSED = 3
    EARG = 4
    EBUSY = 5


class Kind(enum.IntEnum):
    """calexec_relay_kind: what a wait returned."""
    TIMEOUT = 0
    INFERRED = 1
    WAKE = 2
    CLOSED = 3
    DONE = 4


class Why(enum.IntEnum):
    """calexec_relay_why: why a finished job's rule fired or not."""
    FIRED = 0
    NO_RULE = 1
    WAIT_FAILED = 2
    NOT_DONE = 3
    SHORT = 4
    NONFINITE = 5
    STOP = 6
    WITHDRAWN = 7
    QUEUE_FULL = 8


@attrs.frozen
class RelayFunctions:
    """The runtime entry points the relay calls, as addresses, and the runtime's DONE status
    (``CalRT.relay_functions()`` for a loaded CalRT; :class:`CallbackFunctions` for fakes)."""
    infer: int
    wait: int
    status: int
    valid_bytes: int
    done_status: int


class CallbackRuntime(Protocol):
    """A runtime written in Python (tests' fake devices): the four entry points the relay
    calls, with handles as integers. ``status`` and ``valid_bytes`` return (rc, value)."""

    def infer(self, dev: int, model: int, kv: int, seq: int, inbuf: int, outbuf: int) -> int: ...
    def wait(self, outbuf: int, timeout_us: int) -> int: ...
    def status(self, outbuf: int) -> tuple[int, int]: ...
    def valid_bytes(self, outbuf: int) -> tuple[int, int]: ...


class CallbackFunctions:
    """:class:`RelayFunctions` that call a Python :class:`CallbackRuntime` (each call takes
    the GIL): for tests of the relay against a fake device. Keep this object alive as long as
    a relay uses ``functions``."""

    def __init__(self, rt: CallbackRuntime, done_status: int) -> None:
        def addr(p: int) -> int:
            return int(_ffi.cast("uintptr_t", p))

        @_ffi.callback("calexec_relay_infer_fn", error=-1)
        def infer(dev, model, kv, seq, inbuf, outbuf):
            return rt.infer(addr(dev), addr(model), addr(kv), int(seq), addr(inbuf), addr(outbuf))

        @_ffi.callback("calexec_relay_wait_fn", error=-1)
        def wait(outbuf, timeout_us):
            return rt.wait(addr(outbuf), int(timeout_us))

        @_ffi.callback("calexec_relay_status_fn", error=-1)
        def status(outbuf, out):
            rc, value = rt.status(addr(outbuf))
            out[0] = value
            return rc

        @_ffi.callback("calexec_relay_valid_fn", error=-1)
        def valid_bytes(outbuf, out):
            rc, value = rt.valid_bytes(addr(outbuf))
            out[0] = value
            return rc

        self._keep = (infer, wait, status, valid_bytes)
        self.functions = RelayFunctions(
            infer=addr(_ffi.cast("void *", infer)), wait=addr(_ffi.cast("void *", wait)),
            status=addr(_ffi.cast("void *", status)),
            valid_bytes=addr(_ffi.cast("void *", valid_bytes)), done_status=done_status)


@attrs.frozen
class RelayJob:
    """A job for infer: ``tag`` (the caller's id, unique among the relay's live jobs) and the
    runtime handles' addresses (``Device.address``, ``Model.address``, ...)."""
    tag: int
    dev: int
    model: int
    kv: int
    inbuf: int
    outbuf: int
    seq: int


@attrs.frozen
class RelayEvent:
    """What a wait returned (the C ``calexec_relay_event``)."""
    kind: Kind
    tag: int
    rc: int
    status: int
    why: Why
    fired_tag: int
    token: int
    t_ns: int


class NativeRelay:
    """One ``calexec_relay`` (module docstring). The arrays a rule points into are kept
    referenced here until the rule is decided or withdrawn."""

    def __init__(self, functions: RelayFunctions, submitter_only: bool = False) -> None:
        fns = _ffi.new("calexec_relay_fns *")
        fns.infer = _ffi.cast("calexec_relay_infer_fn", functions.infer)
        fns.wait = _ffi.cast("calexec_relay_wait_fn", functions.wait)
        fns.status = _ffi.cast("calexec_relay_status_fn", functions.status)
        fns.valid_bytes = _ffi.cast("calexec_relay_valid_fn", functions.valid_bytes)
        fns.done_status = functions.done_status
        self._h = _lib.calexec_relay_new(fns)
        if self._h == _ffi.NULL:
            raise MemoryError("calexec_relay_new: no memory")
        #: the executor's use: the jobs inferred are Waited by its own completion thread,
        #: not tracked here (``calexec_relay_submitter_only``: track and register refused)
        self.submitter_only = submitter_only
        if submitter_only:
            _lib.calexec_relay_submitter_only(self._h)
        # one event buffer per wait: the C relay lets one thread into each wait at a time
        # (EBUSY otherwise, the buffer untouched); fire, track and register build their own
        # argument, so any threads may call them at once
        self._submit_ev = _ffi.new("calexec_relay_event *")
        self._complete_ev = _ffi.new("calexec_relay_event *")
        self._kept: dict[int, tuple[np.ndarray, ...]] = {}  # tag -> arrays a rule points into
        self._closed = False

    # ---- the submitter's side ------------------------------------------------------------
    def _fill_job(self, out, job: RelayJob) -> None:
        out.tag = job.tag
        out.dev = _ffi.cast("void *", job.dev)
        out.model = _ffi.cast("void *", job.model)
        out.kv = _ffi.cast("void *", job.kv)
        out.inbuf = _ffi.cast("void *", job.inbuf)
        out.outbuf = _ffi.cast("void *", job.outbuf)
        out.seq = job.seq

    def fire(self, job: RelayJob) -> Rc:
        """Queue ``job`` for the submitter (Python's own fire)."""
        arg = _ffi.new("calexec_relay_job *")
        self._fill_job(arg, job)
        return Rc(_lib.calexec_relay_fire(self._h, arg))

    def track(self, job: RelayJob) -> Rc:
        """A job Python gave to infer itself joins the completion thread's queue."""
        arg = _ffi.new("calexec_relay_job *")
        self._fill_job(arg, job)
        return Rc(_lib.calexec_relay_track(self._h, arg))

    def wake(self) -> Rc:
        return Rc(_lib.calexec_relay_wake(self._h))

    def submitter_wait(self, timeout_s: float) -> RelayEvent | Rc:
        """Block (GIL released) until a queued job was given to infer, a wake, the close or
        the timeout. Only the submitter thread calls it."""
        rc = _lib.calexec_relay_submitter_wait(self._h, _timeout_us(timeout_s), self._submit_ev)
        return _event(self._submit_ev) if rc == 0 else Rc(rc)

    # ---- the completion thread's side ------------------------------------------------------
    def register(self, tag: int, nxt: RelayJob, token_dst: np.ndarray, logits: np.ndarray,
                 base: int, n: int, dst: np.ndarray, expect_bytes: int,
                 stop: Sequence[int] = ()) -> Rc:
        """Fire ``nxt`` when job ``tag`` completes DONE with ``expect_bytes`` valid bytes and
        the argmax of the finite BF16 slice ``logits.ravel()[base:base + n]`` is not in
        ``stop``: the argmax is written to ``token_dst[0]`` (an int32 array) first. ``dst``
        is the FP32 row the plain path converts into (checked, not written)."""
        if len(stop) > MAX_STOP:
            return Rc.EARG
        if (token_dst.dtype != np.int32 or logits.dtype != np.uint16 or dst.dtype != np.float32
                or not all(a.flags.c_contiguous for a in (token_dst, logits, dst))):
            return Rc.EARG
        r = _ffi.new("calexec_relay_rule *")
        r.tag = tag
        self._fill_job(r.next, nxt)
        r.token_dst = _ffi.cast("int32_t *", token_dst.ctypes.data)
        r.logits = _ffi.cast("const uint16_t *", logits.ctypes.data)
        r.size = logits.size
        r.base = base
        r.n = n
        r.dst = _ffi.cast("float *", dst.ctypes.data)
        r.dst_len = dst.size
        r.expect_bytes = expect_bytes
        for i, token in enumerate(stop):
            r.stop[i] = int(token)
        r.n_stop = len(stop)
        rc = Rc(_lib.calexec_relay_register(self._h, r))
        if rc == Rc.OK:
            self._kept[tag] = (token_dst, logits, dst)
        return rc

    def withdraw(self, tag: int) -> int:
        """1: the rule was withdrawn before its job's completion decided it (it will not
        fire); 0: not registered, or decided already (the job's DONE event says how)."""
        got = int(_lib.calexec_relay_withdraw(self._h, tag))
        if got == 1:
            self._kept.pop(tag, None)
        return got

    def completion_wait(self, timeout_s: float) -> RelayEvent | Rc:
        """Block (GIL released) until the oldest job in flight finished (Wait, status, the
        rule's decision), the close or the timeout. Only the completion thread calls it."""
        rc = _lib.calexec_relay_completion_wait(self._h, _timeout_us(timeout_s), self._complete_ev)
        if rc != 0:
            return Rc(rc)
        event = _event(self._complete_ev)
        if event.kind == Kind.DONE:
            self._kept.pop(event.tag, None)  # the rule, if any, is decided
        return event

    def result_wait(self, tag: int, timeout_s: float) -> RelayEvent | Rc:
        """Block (GIL released) until the completion thread decided job ``tag`` (DONE, with
        its why, token and fired tag; the last few decisions are kept), the close or the
        timeout. Any thread, any number of them: the consumer of a job's token wakes from C."""
        ev = _ffi.new("calexec_relay_event *")
        rc = _lib.calexec_relay_result_wait(self._h, tag, _timeout_us(timeout_s), ev)
        return _event(ev) if rc == 0 else Rc(rc)

    # ---- life ----------------------------------------------------------------------------
    def counters(self) -> dict[str, int]:
        out = _ffi.new("calexec_relay_counters *")
        _lib.calexec_relay_counters_get(self._h, out)
        return {name: int(getattr(out, name)) for name, _ in _ffi.typeof(out[0]).fields}

    def close(self) -> list[int]:
        """Every wait returns CLOSED from now on; the tags of the queued jobs never given to
        infer."""
        tags = _ffi.new("int64_t[]", QUEUE)
        n = int(_lib.calexec_relay_close(self._h, tags, QUEUE))
        self._closed = True
        self._kept.clear()
        return [int(tags[i]) for i in range(min(n, QUEUE))]

    def free(self) -> None:
        """Frees the relay: only after :meth:`close` and once both waits returned."""
        if self._h != _ffi.NULL:
            _lib.calexec_relay_free(self._h)
            self._h = _ffi.NULL


def _timeout_us(timeout_s: float) -> int:
    return max(0, int(timeout_s * 1e6))


def _event(ev) -> RelayEvent:
    return RelayEvent(kind=Kind(ev.kind), tag=int(ev.tag), rc=int(ev.rc), status=int(ev.status),
                      why=Why(ev.why), fired_tag=int(ev.fired_tag), token=int(ev.token),
                      t_ns=int(ev.t_ns))
