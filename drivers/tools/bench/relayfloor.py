"""The relay floor of ``calexec bench overhead`` (issue 28): the executor's three thread roles
in Python, with the native relay (drivers/native/relay.py) carrying the greedy token from
the completion thread to the submitter, as docs/architecture.md ("Native hand-offs") designs
it for ``ahead`` streams. It measures that design's per-token cost before the executor is
built on it.

Two decode slots alternate (the executor's buffer pool with an armed successor): while job k
runs in one, the submitter, back in Python after giving k to infer, *arms* job k + 1 in the
other (its position and CSRs) and registers the fire rule "when k completes, write its argmax
into k + 1's input and queue k + 1". The completion thread waits in C; when k completes the
relay checks it (status, valid bytes, finite logits), takes the argmax and hands k + 1 to the
submitter, which infers it in C: no Python on the way from one job to the next. Back in
Python, the completion thread delivers k's token to the caller (a condition, as the
executor's job event), which times it. Should the arming come after k completed (the
submitter late), the rule is refused by the completion side's bookkeeping, and the completion
thread fires k + 1 itself (the plain path); ``plain_fires`` counts those. The plain path
checks the job as the relay does (status, valid bytes, finite logits) before it fires the
next: a job either path refuses ends the block with the same reason. ``rules=False``
registers none, every job on the plain path.

Every wait is bounded (``wait_s``); a failure in a thread is raised to the caller as
:class:`RelayLoopError` naming the thread and the call.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np

from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.direct import DirectRunner
from calexec.drivers.native.relay import Kind, NativeRelay, RelayEvent, RelayJob, Why
from calexec.drivers.synthetic import calbin as calbin_fmt
from calexec.machines.postprocess import bf16_to_f32_into

MODULE = "drivers/tools/bench/relayfloor.py"
THREADS = 3
#: how a job's token reaches the caller (``RelayLoop(deliver=...)``, ``--relay-deliver``):
#: ``python``, the completion thread's Python does the job's work and then wakes the caller
#: (a condition, as the executor's job event); ``native``, the caller waits in C for the
#: relay's decision (``result_wait``) while the completion thread's Python does the work;
#: ``caller``, the caller waits in C and does the job's work itself
DELIVERIES = ("python", "native", "caller")
#: how long a caller waits in C before it looks for its token on the Python side too
_EVICTED_POLL_S = 0.05


def _python_work(us: float) -> None:
    """Run Python bytecode (holding the GIL) for about ``us`` microseconds."""
    if us <= 0:
        return
    end = time.perf_counter_ns() + int(us * 1e3)
    x = 0
    while time.perf_counter_ns() < end:
        for i in range(20):
            x += i


class RelayLoopError(RuntimeError):
    """A block of the relay loop failed (the message names the thread and the call)."""


class _DecodeSlot:
    """One decode job's buffers (the host arrays are mapped: they never move)."""

    def __init__(self, runner: DirectRunner) -> None:
        model = runner.slot(calbin_fmt.DECODE).model
        info = model.info
        rc, inbuf = model.create_input_buf()
        if inbuf is None:
            raise RelayLoopError(f"create_input_buf returned {rc}")
        rc, outbuf = model.create_output_buf()
        if outbuf is None:
            raise RelayLoopError(f"create_output_buf returned {rc}")
        self.inbuf, self.outbuf = inbuf, outbuf
        self.ids = np.zeros(info.inputs[0].shape, dtype=np.int32)
        self.pos = np.zeros(info.inputs[1].shape, dtype=np.int32)
        out = info.outputs[0]
        self.logits = np.zeros(out.shape, dtype=np.uint16)
        self.row = np.empty(out.shape[-1], dtype=np.float32)
        for what, rc in (("map input_ids", inbuf.map("input_ids", self.ids)),
                         ("map positions", inbuf.map("positions", self.pos)),
                         ("map logits", outbuf.map(out.name, self.logits))):
            if rc != 0:
                raise RelayLoopError(f"decode slot: {what} returned {rc}")
        self.nbytes = self.logits.nbytes

    def arm(self, past: int) -> None:
        """Position and CSRs of a decode job at ``past`` (the token comes later)."""
        self.pos.flat[0] = past
        for name, value in (("cur_seq_len", 1), ("total_seq_len", past + 1)):
            rc = self.inbuf.set_csr(name, value)
            if rc != 0:
                raise RelayLoopError(f"set_csr({name}={value}) returned {rc}")


class RelayLoop:
    """The direct loop's greedy decode, its hand-offs in the native relay (module docstring)."""

    def __init__(self, rt: CalRT, calbin_path: str, seq_id: int, wait_s: float = 30.0,
                 python_work_us: float = 0.0, deliver: str = "python",
                 rules: bool = True) -> None:
        if deliver not in DELIVERIES:
            raise ValueError(f"deliver={deliver!r}: one of {', '.join(DELIVERIES)}")
        self.runner = DirectRunner(rt, calbin_path)
        #: Python work (holding the GIL) done per job after each relay event, in place of the
        #: executor's chart transitions applied after the native hand-off (by the submitter,
        #: and by the completion thread or, with ``deliver="caller"``, the caller)
        self.python_work_us = python_work_us
        self.deliver = deliver
        #: register fire rules (False: the completion thread's Python fires every next job)
        self.rules = rules
        self.seq_id = seq_id
        self.wait_s = wait_s
        self.relay = NativeRelay(rt.relay_functions())
        self.slots = (_DecodeSlot(self.runner), _DecodeSlot(self.runner))
        self.plain_fires = 0
        self.rule_fires = 0
        #: when the relay decided each job's completion (CLOCK_MONOTONIC ns), this block's
        self.done_ns: list[int] = []
        #: when infer returned for each job (CLOCK_MONOTONIC ns), this block's
        self.inferred_ns: list[int] = []
        self._mu = threading.Lock()  # the bookkeeping of jobs (tags) between the threads
        self._cv = threading.Condition(self._mu)
        self._done: set[int] = set()  # completed job tags of this block
        self._tokens: dict[int, int] = {}  # tag -> its argmax, delivered to the caller
        self._past0 = 0  # the first decode job's position (tag 1)
        self._last = 0  # the block's last tag
        self._error: str | None = None
        self._stopping = False
        self._threads = [
            threading.Thread(target=self._guard, args=(self._submitter,), daemon=True,
                             name="calexec-bench-relay-submitter"),
            threading.Thread(target=self._guard, args=(self._completion,), daemon=True,
                             name="calexec-bench-relay-completion"),
        ]
        for thread in self._threads:
            thread.start()

    def set_decode_latency(self, decode_us: int) -> None:
        emu = self.runner.device.emu
        rc = emu.set_latency(decode_us=decode_us) if emu is not None else -1
        if rc != 0:
            raise RelayLoopError(f"relay floor device: set_latency(decode_us={decode_us}) "
                                 f"returned {rc}")

    # ---- jobs ----------------------------------------------------------------------------
    def _slot(self, tag: int) -> _DecodeSlot:
        return self.slots[tag % 2]

    def _job(self, tag: int) -> RelayJob:
        runner, slot = self.runner, self._slot(tag)
        model = runner.slot(calbin_fmt.DECODE).model
        return RelayJob(tag=tag, dev=runner.device.address, model=model.address,
                        kv=runner.kv.address, inbuf=slot.inbuf.address,
                        outbuf=slot.outbuf.address, seq=self.seq_id)

    def _arm_next(self, tag: int) -> None:
        """(submitter) job ``tag`` is on the device: arm ``tag + 1`` and register its rule,
        unless ``tag`` already completed (then the completion thread fires it)."""
        nxt = tag + 1
        if nxt > self._last or not self.rules:
            return
        slot, cur = self._slot(nxt), self._slot(tag)
        slot.arm(self._past0 + nxt - 1)
        with self._mu:
            if tag in self._done:
                return
            rc = self.relay.register(tag, self._job(nxt), slot.ids.reshape(-1), cur.logits.reshape(-1),
                                     0, cur.logits.shape[-1], cur.row, cur.nbytes)
            if rc != 0:
                raise RelayLoopError(f"relay register(tag={tag}) returned {rc!r}")

    # ---- the two device threads ----------------------------------------------------------
    def _guard(self, body: Callable[[], None]) -> None:
        try:
            body()
        except (RuntimeError, OSError, ValueError, KeyError) as exc:
            with self._cv:
                self._error = f"{threading.current_thread().name}: {exc}"
                self._cv.notify_all()
            self.relay.close()  # a caller waiting in C returns (CLOSED) and hears why

    def _submitter(self) -> None:
        relay = self.relay
        while not self._stopping:
            event = relay.submitter_wait(self.wait_s)
            if not isinstance(event, RelayEvent):
                raise RelayLoopError(f"submitter_wait returned {event!r}")
            if event.kind == Kind.CLOSED:
                return
            if event.kind != Kind.INFERRED:
                continue
            if event.rc != 0:
                raise RelayLoopError(f"infer(tag={event.tag}) returned {event.rc}")
            self.inferred_ns.append(event.t_ns)
            self._arm_next(event.tag)
            _python_work(self.python_work_us)

    def _completion(self) -> None:
        relay = self.relay
        while not self._stopping:
            event = relay.completion_wait(self.wait_s)
            if not isinstance(event, RelayEvent):
                raise RelayLoopError(f"completion_wait returned {event!r}")
            if event.kind == Kind.CLOSED:
                return
            if event.kind != Kind.DONE:
                continue
            if event.rc != 0 or event.why in (Why.NOT_DONE, Why.SHORT, Why.NONFINITE):
                raise RelayLoopError(f"job {event.tag}: wait {event.rc}, status {event.status}, "
                                     f"{event.why.name}")
            tag = event.tag
            self.done_ns.append(event.t_ns)
            with self._mu:
                self._done.add(tag)
                if event.why != Why.FIRED:
                    relay.withdraw(tag)  # a rule registered after the decision: spent
            token = event.token
            if event.why == Why.FIRED:
                self.rule_fires += 1
            else:  # the plain path: the argmax in Python, the next job fired from here
                slot = self._slot(tag)
                self._check_output(event, slot)
                token = int(np.argmax(slot.row))
                if tag + 1 <= self._last:
                    nxt = self._slot(tag + 1)
                    nxt.arm(self._past0 + tag)
                    nxt.ids.flat[0] = token
                    self.plain_fires += 1
                    rc = relay.fire(self._job(tag + 1))
                    if rc != 0:
                        raise RelayLoopError(f"relay fire(tag={tag + 1}) returned {rc!r}")
            if self.deliver != "caller":
                _python_work(self.python_work_us)
            with self._cv:
                self._tokens[tag] = token
                self._cv.notify_all()

    @staticmethod
    def _check_output(event: RelayEvent, slot: _DecodeSlot) -> None:
        """(completion, plain path) The relay's checks of a job no rule decided: its valid
        bytes, then its logits converted into ``slot.row`` and finite (the status the relay
        checked for every job). Raises naming the job and why, as the relay's decision."""
        rc, valid = slot.outbuf.valid_bytes()
        if rc != 0 or valid < slot.nbytes:
            raise RelayLoopError(f"job {event.tag}: valid_bytes rc {rc}, {valid} of "
                                 f"{slot.nbytes} bytes, {Why.SHORT.name}")
        bf16_to_f32_into(slot.logits.reshape(-1), 0, slot.row.shape[0], slot.row)
        if not np.isfinite(slot.row).all():
            raise RelayLoopError(f"job {event.tag}: logits not finite, {Why.NONFINITE.name}")

    # ---- the caller ----------------------------------------------------------------------
    def decode_block(self, prompt: np.ndarray, n: int) -> tuple[list[int], list[float]]:
        """As ``DirectLoop.decode_block``: the prefill on the calling thread (not timed),
        then ``n`` greedy decode tokens, each job fired by the relay. Returns (tokens,
        per-token wall time in us as the caller sees them)."""
        runner = self.runner
        if self._error is not None:
            raise RelayLoopError(self._error)
        rc = runner.kv.release(self.seq_id)
        if rc != 0:
            raise RelayLoopError(f"KV release of seq {self.seq_id} returned {rc}")
        bf16_row = runner.run(calbin_fmt.PREFILL_IDS, self.seq_id, 0, tokens=prompt)
        row = self.slots[0].row
        bf16_to_f32_into(bf16_row, 0, bf16_row.shape[0], row)
        first = int(np.argmax(row))
        p = len(prompt)
        if not runner.kv.apply(self.seq_id, p + n):  # the block's reservation, once
            raise RelayLoopError(f"KV apply(seq={self.seq_id}, {p + n}) failed")
        self.done_ns, self.inferred_ns = [], []
        with self._mu:
            self._done.clear()
            self._tokens.clear()
            self._past0, self._last = p, n
        slot = self._slot(1)
        slot.arm(p)
        slot.ids.flat[0] = first
        tokens, times = [first], []
        clock = time.perf_counter_ns
        t_prev = clock()
        rc = self.relay.fire(self._job(1))
        if rc != 0:
            raise RelayLoopError(f"relay fire(tag=1) returned {rc!r}")
        deadline = time.monotonic() + self.wait_s
        for tag in range(1, n + 1):
            token = self._native_token(tag, deadline) if self.deliver != "python" else None
            if token is None:
                token = self._python_token(tag, deadline)
            if self.deliver == "caller":
                _python_work(self.python_work_us)
            t = clock()
            times.append((t - t_prev) / 1e3)
            t_prev = t
            tokens.append(token)
        return tokens, times

    def _native_token(self, tag: int, deadline: float) -> int | None:
        """(deliver native or caller) Wait in C for the relay's decision on ``tag``: its
        token when a rule fired the job after it; None when the completion thread's Python
        has the token (no rule fired: the block's last job, or a late arming)."""
        while True:
            # the relay keeps the last few decisions: a caller that fell further behind (the
            # device far ahead, at zero latency) finds its token on the Python side instead
            left = deadline - time.monotonic()
            event = self.relay.result_wait(tag, min(max(0.0, left), _EVICTED_POLL_S))
            if self._error is not None:
                raise RelayLoopError(self._error)
            if not isinstance(event, RelayEvent):
                raise RelayLoopError(f"result_wait(tag={tag}) returned {event!r}")
            if event.kind == Kind.DONE:
                return event.token if event.why == Why.FIRED else None
            with self._cv:
                if tag in self._tokens:
                    return None
            if event.kind == Kind.CLOSED or left <= 0:
                raise RelayLoopError(f"no decision on job {tag} within {self.wait_s:.0f} s")

    def _python_token(self, tag: int, deadline: float) -> int:
        """The token the completion thread's Python delivered for ``tag``."""
        with self._cv:
            while tag not in self._tokens and self._error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RelayLoopError(f"no token {tag} within {self.wait_s:.0f} s")
                self._cv.wait(left)
            if self._error is not None:
                raise RelayLoopError(self._error)
            return self._tokens.pop(tag)

    def dma_violations(self) -> int:
        emu = self.runner.device.emu
        if emu is None:
            return 0
        counters = emu.counters()
        return int(counters["dma_input_violations"] + counters["dma_output_violations"])

    def close(self) -> None:
        """Closes the relay (both threads return), joins them (bounded), closes the device."""
        self._stopping = True
        self.relay.close()
        for thread in self._threads:
            thread.join(self.wait_s)
        if not any(thread.is_alive() for thread in self._threads):
            self.relay.free()
        self.runner.close()
