"""Differential model-based testing of the executor's shortcuts (issue 24; docs/testing.md).

Every shortcut of the hot path (implicit pre-arms, the pre-armed decode stream, greedy ahead,
the arming delays, Phase B under each overlap setting, the fused logits postprocess, the
ready queue) is a claim: it answers exactly like the plain path. This module checks the claim
on histories: the same history runs on one executor per *variant* (the plain path, the
reference, and executors with shortcuts on), and every answer a client gets is compared.

A history is a list of actions at virtual times:

- ``client``: a caller starts decoding a sequence (a prefill, then greedy or given decode
  steps, through its variant's API: ``enqueue``, ``decode_sync`` or a ``decode_stream``),
  with or without ``logits_out``, a logits slice, a reservation, a deadline (far, or already
  passed), an early request (sent before its predecessor finished), one more request after
  a failure (its sequence is then Unknown), and ``release_sequence`` at the end;
- ``fault``: a fault of one job, named by its content (sequence, first position, kind): a
  submit error, a Wait error, a CCU exception, NaN or short output, a hang. It fires when
  that job reaches the device, whichever path brought it there;
- ``cancel`` of a client's current job, ``release`` of a sequence by an admin racing the
  clients, a device fault reported to the controller (``recover``), a model ``switch``;
- ``tick``: virtual time passes. The device is timed: each job takes the history's decode or
  prefill time on its engine (engines in parallel with ``overlap=full``, one job at a time
  otherwise), so implicit pre-arms, arming delays, early wake-ups and greedy ahead's yield run
  as they do on a real device, on every variant's own controlled scheduler
  (drivers/tools/explore.py: real executor threads, one at a time, virtual clock).

Each variant runs the history on its own ``Lane`` (an ``Explorer`` with a timed device), in
lock step: an action is applied to every lane, then every lane runs to the same virtual time.
Answers per client step (tokens, error codes, the digest of the logits the client reads, of
the caller's ``logits_out``) and the end state (every client's ``release_sequence`` answer, the
lifecycle, the generation, the recoveries) must equal the reference's; the reference itself
is checked against the numpy oracle. Where a shortcut may legitimately answer otherwise (Phase B
under faults, the ready queue during a recovery), ``compare`` accepts only the documented set
of outcomes (docs/testing.md, "Differential testing").
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs
import numpy as np

from calexec.contracts.codes import CalrtCode
from calexec.contracts.errors import Category
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Status
from calexec.contracts.types import TaskKind
from calexec.drivers.tools.explore import (
    DeviceModel,
    DeviceProxy,
    Explorer,
    RuntimeProxy,
    TapeChooser,
)

if TYPE_CHECKING:
    from calexec.drivers.calrt.runtime import CalRT
    from calexec.machines.device_api import RuntimeApi

VOCAB = 151936
#: job faults a history can schedule (emulator fault points, fired by job content);
#: ``SUBMIT_BUSY``: ``SUBMIT_RC`` answering DEVICE_BUSY once (retried after a backoff, §8)
JOB_FAULTS = ("SUBMIT_RC", "WAIT_RC", "CCU_EXCEPTION", "OUTPUT_NAN", "OUTPUT_SHORT", "HANG",
              "SUBMIT_BUSY")


# ---- variants ------------------------------------------------------------------------------------
@attrs.frozen
class Variant:
    """One executor configuration and the API its clients decode with."""

    name: str
    #: how a client sends its decode steps: ``enqueue`` (+ ``wait_until``), ``decode_sync``, or
    #: ``stream`` (``decode_stream``; greedy clients with ``greedy_ahead``)
    api: str = "enqueue"
    greedy_ahead: bool = False
    auto_prearm: bool = False
    capacity: int = 1
    overlap: str = "full"
    fused: bool = True
    ready_queue_max: int = 0
    #: ``default`` (HotPathTuning()) or ``immediate`` (HotPathTuning.immediate())
    tuning: str = "default"
    #: ``ExecutorConfig.native_relay``: the submitter waits in its relay (``ClockRelay`` on
    #: the lane's clock, the C relay's rules) and fired steps are inferred from that wait
    relay: bool = False

    @property
    def phase_b(self) -> bool:
        return self.capacity == 2

    @property
    def shifts_time(self) -> bool:
        """Runs a job at another time than the plain path: greedy ahead fires a step while
        its caller still thinks, Phase B runs two jobs at once."""
        return self.greedy_ahead or self.phase_b


#: the plain path: one job per request through ``enqueue``, no guess, no stream, the numpy
#: postprocess, Phase A. Every other variant is compared with it.
PLAIN = Variant("plain", api="enqueue", fused=False)
VARIANTS: dict[str, Variant] = {v.name: v for v in (
    PLAIN,
    Variant("fused", api="enqueue"),
    Variant("auto", api="decode_sync", auto_prearm=True),
    Variant("auto_immediate", api="enqueue", auto_prearm=True, tuning="immediate"),
    Variant("stream", api="stream", auto_prearm=True),
    Variant("ahead", api="stream", greedy_ahead=True),
    Variant("ahead_immediate", api="stream", greedy_ahead=True, tuning="immediate"),
    Variant("ready_queue", api="decode_sync", auto_prearm=True, ready_queue_max=8),
    Variant("ready_queue_stream", api="stream", ready_queue_max=8),
    Variant("phase_b_full", api="decode_sync", auto_prearm=True, capacity=2, overlap="full"),
    Variant("phase_b_dma", api="stream", greedy_ahead=True, capacity=2, overlap="dma"),
    Variant("phase_b_none", api="enqueue", capacity=2, overlap="none"),
    Variant("relay_ahead", api="stream", greedy_ahead=True, relay=True),
    Variant("relay_stream", api="stream", auto_prearm=True, relay=True),
    Variant("relay_auto", api="enqueue", auto_prearm=True, tuning="immediate", relay=True),
    Variant("relay_phase_b", api="stream", greedy_ahead=True, capacity=2, overlap="dma",
            relay=True),
)}


# ---- the history ---------------------------------------------------------------------------------
@attrs.frozen
class Client:
    """A caller decoding one sequence: a prefill of ``prompt``, then ``steps`` decodes."""

    cid: int
    seq: int
    prompt: tuple[int, ...]
    steps: int
    #: kv_reserve_len = prompt + steps on the prefill (as the server does)
    reserve: bool = True
    want: tuple[int, int] | None = None
    logits_out: bool = True
    #: with ``logits_out``: each decode request sent through ``enqueue`` or ``decode_sync``
    #: gets a zeroed row of its own (a caller that allocates per request, as a server may),
    #: so a guess armed with the row of the request before is not the caller's; a stream
    #: keeps the row it was opened with. The row a failed step leaves is then not compared
    #: (one lane's is fresh, a stream's holds the step before).
    fresh_rows: bool = False
    #: tokens: the argmax of the step before (greedy ahead applies) or ``tokens`` in turn
    greedy: bool = True
    tokens: tuple[int, ...] = ()
    #: every request's deadline, relative to the client's start; <= 0: already passed
    deadline_s: float = 60.0
    #: at this step, a request for the position after it is sent before the step finished
    early_at: int | None = None
    #: after a failed step, one more request: at the same position (``"same"``), at the next
    #: one as if nothing had failed (``"next"``), or none (``None``)
    after_failure: str | None = "same"
    #: the early request is sent this long after the step it precedes (a guess may be armed)
    early_delay_s: float = 0.0
    #: the client waits this long between a result and its next step (guesses expire)
    think_s: float = 0.0
    release: bool = True
    #: faults of this client's jobs: (step, emulator fault point); step -1 is the prefill,
    #: step j the j-th decode (at prompt + j: a step after a failure that repeats a position
    #: does not fault again)
    faults: tuple[tuple[int, str], ...] = ()


# ---- the timed device ------------------------------------------------------------------------------
class TimedDevice(DeviceModel):
    """The stepped emulator as a device whose jobs take time: each engine runs its queued
    jobs in order, each ``decode_s`` or ``prefill_s`` of virtual time; with ``serial`` (overlap
    ``none``/``dma`` in Phase B) one job at a time on the whole device. A job's stages are
    offered to the scheduler only once its time has passed, and that time is a jump target.
    Job faults are fired by content: ``faults[(seq, first_position, kind)]`` = emulator fault
    point, armed right before that job's ``infer`` (or its ``Wait``), once."""

    def __init__(self, sched, engines: int, decode_s: float, prefill_s: float,
                 serial: bool) -> None:
        super().__init__(sched, engines)
        self.decode_s = decode_s
        self.prefill_s = prefill_s
        self.serial = serial
        self.fifo: dict[int, deque] = {e: deque() for e in range(engines)}
        self.ready_at: dict[int, float | None] = dict.fromkeys(range(engines))
        self.serial_free = 0.0
        self.faults: dict[tuple[int, int, str], str] = {}
        #: (seq, position, kind, point, virtual time) in firing order
        self.fired: list[tuple] = []
        self.infers: list[tuple] = []  # (virtual time, seq, position, kind) of each infer
        self.wait_faults: set[int] = set()  # id() of output buffers whose next Wait fails
        self.locate: Callable[[Any], int] = lambda inbuf: -1
        self.proxy_class = TimedDeviceProxy

    def _sync(self) -> None:
        """Jobs the emulator no longer holds (a reset aborted them) leave the model."""
        for engine, fifo in self.fifo.items():
            rc, jobs, _stage = self.controls().pending(engine)
            if rc != 0:
                continue
            dropped = False
            while len(fifo) > jobs:
                fifo.popleft()
                dropped = True
            if dropped or not fifo:
                self.ready_at[engine] = None
            if fifo and self.ready_at[engine] is None:
                self._schedule(engine)

    def _schedule(self, engine: int) -> None:
        duration = self.fifo[engine][0]
        start = self.sched.now
        if self.serial:
            start = max(start, self.serial_free)
            self.serial_free = start + duration
        self.ready_at[engine] = start + duration

    def accepted(self, engine: int, kind: str) -> None:
        """``infer`` put a job of ``kind`` on ``engine``."""
        fifo = self.fifo[engine]
        fifo.append(self.decode_s if kind == "decode" else self.prefill_s)
        if len(fifo) == 1:
            self._schedule(engine)

    def next_ready(self) -> float | None:
        if self.emu is None or self.closed:
            return None
        now = self.sched.now
        times = [t for e, t in self.ready_at.items()
                 if t is not None and t > now and self.stuck.get(e) != self.epoch]
        return min(times) if times else None

    def options(self) -> list[str]:
        if self.emu is None or self.closed:
            return []
        self._sync()
        now = self.sched.now
        return [label for label in super().options()
                if label.startswith("device") and (
                    (ready := self.ready_at.get(int(label[6:]))) is None or ready <= now)]

    def step(self, label: str) -> None:
        from calexec.drivers.calrt.runtime import Did, Stage
        engine = int(label[len("device"):])
        if self.sched.on_step is not None:
            self.sched.on_step()
        rc, did = self.controls().step(engine, int(Stage.NONE))
        if rc != 0 or did in (Did.NOTHING, Did.HUNG, Did.BLOCKED):
            self.stuck[engine] = self.epoch
            return
        self.epoch += 1
        if did == Did.SIGNAL and self.fifo[engine]:
            self.fifo[engine].popleft()
            self.ready_at[engine] = None
            if self.fifo[engine]:
                self._schedule(engine)


    def take_wait_fault(self, outbuf) -> bool:
        from calexec.drivers.calrt.runtime import Fault, FaultMode
        if id(outbuf) not in self.wait_faults:
            return False
        self.wait_faults.discard(id(outbuf))
        if self.controls().set_fault(Fault.WAIT_RC, FaultMode.NTH, 1, 0, 0) != 0:
            raise RuntimeError("arming WAIT_RC refused")
        return True

    def job_fault(self, seq: int, inbuf, outbuf, kind: str) -> None:
        """Right before ``infer`` of a job: arm the fault scheduled for its content, once."""
        from calexec.drivers.calrt.runtime import Fault, FaultMode
        key = (seq, self.locate(inbuf), kind)
        self.infers.append((round(self.sched.now - 1000.0, 6), *key))
        point = self.faults.pop(key, None)
        if point is None:
            return
        self.fired.append((*key, point, self.sched.now))
        if point == "WAIT_RC":
            self.wait_faults.add(id(outbuf))
        elif point == "SUBMIT_BUSY":
            if self.controls().set_fault(Fault.SUBMIT_RC, FaultMode.NTH, 1, 0,
                                         int(CalrtCode.DEVICE_BUSY)) != 0:
                raise RuntimeError("arming SUBMIT_RC (busy) refused")
        elif self.controls().set_fault(Fault[point], FaultMode.NTH, 1, 0, 0) != 0:
            raise RuntimeError(f"arming {point} refused")


class TimedDeviceProxy(DeviceProxy):
    """``infer`` fires the job's scheduled fault and tells the timed device what it runs."""

    def _run(self, name: str, model, kv, seq: int, inbuf, outbuf, *more) -> int:
        dev: TimedDevice = self._model
        kind = "decode" if "decode" in model.name else "prefill"
        dev.sched.point(f"runtime.{name}")
        dev.job_fault(seq, inbuf, outbuf, kind)
        before = [dev.controls().pending(e)[1] for e in range(dev.engines)]
        rc = getattr(self._inner, name)(model, kv, seq, inbuf, outbuf, *more)
        dev.epoch += 1
        if rc == 0:
            grown = [e for e in range(dev.engines)
                     if dev.controls().pending(e)[1] > before[e]]
            if grown:
                dev.accepted(grown[0], kind)
        return rc

    def infer(self, model, kv, seq, inbuf, outbuf):
        return self._run("infer", model, kv, seq, inbuf, outbuf)

    def infer_with_fixed_task_type(self, model, kv, seq, inbuf, outbuf, engine):
        return self._run("infer_with_fixed_task_type", model, kv, seq, inbuf, outbuf, engine)


class _NumpyPostprocess(RuntimeProxy):
    """The runtime without its fused native postprocess: the executor's numpy path."""

    def logits_postprocessor(self):
        return None


# ---- one variant's executor under the controlled scheduler -----------------------------------
def _digest(array: np.ndarray | None) -> str | None:
    if array is None:
        return None
    return hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=12).hexdigest()


def _executor_first(thread: Any) -> int:
    """``Scheduler.rank`` of a lane: the executor's own threads (``calexec-*``) first."""
    return 0 if thread.name.startswith("calexec-") else 1


class Lane(Explorer):
    """One variant's executor, its timed device, and the clients' answers on it."""

    device: TimedDevice

    def __init__(self, calbins: dict[str, str], variant: Variant, decode_s: float,
                 prefill_s: float, kv_blocks: int = 64, slots_per_kind: int = 2) -> None:
        self.variant = variant
        self.slots_per_kind = slots_per_kind
        # late check slack: in Phase B a job behind one the device holds after a failed Wait
        # is waited for after that one's grace (timeout_grace_s, 0.2 s)
        super().__init__(calbins, TapeChooser(), capacity=variant.capacity, kv_blocks=kv_blocks,
                         slack_s=0.35)
        self.device = TimedDevice(self.sched, variant.capacity, decode_s, prefill_s,
                                  serial=variant.phase_b and variant.overlap != "full")
        self.device.locate = self._locate
        self.sched.device = self.device
        self.sched.clamp_to_horizon = True
        # the executor's threads before the callers' when several can run (an instant woke
        # them, or the running one blocked): a job whose deadline passed is resolved by the
        # submitter before its caller's wait on that same deadline ends, on every lane alike
        # (else the tie is broken by which thread jumped time, which differs between lanes)
        self.sched.rank = _executor_first
        #: client id -> its answers, in order; ("admin", k) -> an admin release's answer
        self.answers: dict[Any, list] = {}
        self.current: dict[int, Any] = {}  # client id -> its handle or stream now
        self.abandoned: set[int] = set()  # clients that gave up (``cancel``)
        self.specs: dict[int, Client] = {}
        self.row_unknown: set[int] = set()  # clients whose row a non-finite output touched
        self.finished: set[int] = set()
        self.gen_calbins: dict[int, str] = {}
        self._admin = 0
        self._recovers = 0
        #: clients whose answers were not compared with the plain path's (the history took
        #: another path after an allowed difference): only checked against the oracle
        self.diverged: dict[Any, str] = {}
        self.times: dict[Any, list[float]] = {}  # key -> virtual time of each answer

    # ---- configuration ----------------------------------------------------------------------
    def config_overrides(self) -> dict:
        from calexec.machines.tuning import HotPathTuning
        v, o = self.variant, self.options
        return {"device_config": f"kv_blocks={o['kv_blocks']};kv_block_size=16;dma_guard=0;"
                                 f"overlap={v.overlap}",
                "auto_prearm": v.auto_prearm, "ready_queue_max": v.ready_queue_max,
                "slots_per_kind": self.slots_per_kind, "native_relay": v.relay,
                "tuning": (HotPathTuning.immediate() if v.tuning == "immediate"
                           else HotPathTuning())}

    def runtime(self, calrt: CalRT) -> RuntimeApi:
        proxy = RuntimeProxy if self.variant.fused else _NumpyPostprocess
        return proxy(calrt, self.device)

    def _locate(self, inbuf) -> int:
        """The first position of the job prepared in ``inbuf``'s slot (-1: not found)."""
        ex = self.started_ex
        pool = ex.pool if ex is not None else None
        for slot in (pool.slots if pool is not None else ()):
            if slot.inbuf is inbuf:
                return -1 if slot.host_position is None else int(slot.host_position[0])
        return -1

    def _check_point(self) -> None:
        super()._check_point()
        ex = self.started_ex
        gen = ex.gen if ex is not None else None
        if gen is not None and gen.id not in self.gen_calbins:
            self.gen_calbins[gen.id] = gen.calbin_path

    # ---- actions ----------------------------------------------------------------------------
    def advance(self, seconds: float) -> None:
        """Run to ``seconds`` of virtual time from now (every lane ends at the same time)."""
        target = self.sched.now + seconds
        self.run(10_000_000, horizon_s=seconds)
        self.sched.now = max(self.sched.now, target)

    def start_client(self, client: Client) -> None:
        self.specs[client.cid] = client
        self.answers[client.cid] = []
        self._spawn(f"client{client.cid}", lambda: self._client(client))

    def _fault_keys(self, client: Client) -> dict[tuple[int, int, str], str]:
        """The device's fault table entries of ``client``'s jobs (named by their content)."""
        keys = {}
        for step, point in client.faults:
            position = len(client.prompt) + step if step >= 0 else 0
            kind = "decode" if step >= 0 else "prefill"
            keys[(client.seq, position, kind)] = point
        return keys

    def cancel_client(self, cid: int) -> None:
        """The client gives up (a disconnect): its job now is cancelled, and so is every
        later one (as the server cancels every job of an abandoned request)."""
        def body():
            self.abandoned.add(cid)
            current = self.current.get(cid)
            if current is not None:
                current.cancel()
        self._spawn("cancel", body)

    def admin_release(self, seq: int) -> None:
        key = ("admin", self._admin)
        self._admin += 1
        self.answers[key] = []

        def body():
            status = self.ex.release_sequence(seq)
            self._record(key, ("release", status.code))
        self._spawn("admin-release", body)

    def request_recovery(self) -> None:
        """A device fault reported to the controller; its answer is whether it found the
        lifecycle Ready (``started``: a recovery runs for it) or already draining or
        recovering (``covered``: the running recovery covers it, one more generation less)."""
        key = ("recover", self._recovers)
        self._recovers += 1
        self.answers[key] = []
        self.script.append(("request_recovery",))

        def body():
            found = self.ex.state
            self.report_device_fault()
            self._record(key, ("recover", "started" if found == "Ready" else "covered"))
        self._spawn("admin-fault", body)

    def _record(self, key: Any, entry: tuple) -> None:
        """An answer, with the virtual time it came at (``compare`` orders divergences).
        After a non-finite output the caller's row is unspecified (partly written by the
        fused path, untouched by the numpy one) until a job delivers into it again: the
        row's digest is left out of the answers in between."""
        if entry[0] in ("prefill", "decode") and len(entry) > 5:
            if entry[3] == "ok":
                self.row_unknown.discard(key)
            elif entry[4] == "internal.output_not_finite":
                self.row_unknown.add(key)
            elif key in self.row_unknown:
                entry = (*entry[:-1], None)
        self.answers[key].append(entry)
        self.times.setdefault(key, []).append(self.sched.now)

    def clients_done(self) -> bool:
        return all(cid in self.finished for cid in self.answers if not isinstance(cid, tuple))

    def settled(self) -> bool:
        """Nothing left to happen after the clients ended: no job queued, armed, in flight
        or held by the runtime, and the lifecycle at rest (Ready or Failed). Unlocked reads
        (the lane's threads are paused at a scheduling point, maybe holding the lock)."""
        dispatch = self.ex.dispatch
        return (self.ex.state in ("Ready", "Failed") and dispatch.inflight == 0
                and not dispatch.has_work() and not dispatch.any_held)

    # ---- one client's program (a controlled thread) ------------------------------------------
    def _answer(self, result, out: np.ndarray | None, count: int,
                fresh: bool = False) -> tuple:
        if isinstance(result, Status):  # (with the caller's row: untouched by a failure,
            # except that non-finite output may leave it partly written: documented, and the
            # fused path writes before it finds the NaN, the numpy path after: not compared;
            # nor with ``fresh`` rows: Client.fresh_rows)
            unspecified = out is None or result.code == "internal.output_not_finite" or fresh
            return ("err", result.code,
                    None if unspecified or out is None else _digest(out[:count]))
        return ("ok", int(result.argmax), int(result.kv_len), result.generation,
                _digest(result.logits), None if out is None else _digest(out[:count]))

    def _client(self, c: Client) -> None:
        try:
            self._client_program(c)
        finally:
            for key, point in self._fault_keys(c).items():  # (its faults no job met)
                if self.device.faults.get(key) == point:
                    del self.device.faults[key]
            self.finished.add(c.cid)

    def _client_program(self, c: Client) -> None:
        ex, v = self.ex, self.variant
        # one owner per sequence id at a time, as the server's SequencePool leases them: a
        # client of a sequence another client still decodes starts once that one ended
        while any(o.seq == c.seq and o.cid < c.cid and o.cid not in self.finished
                  for o in self.specs.values()):
            ex.clock.sleep(0.001)
        # the client's faults are its own jobs': armed from its start to its end, so a job of
        # the sequence's earlier owner (run earlier or later by a shortcut) never meets them
        self.device.faults.update(self._fault_keys(c))

        def record(entry: tuple) -> None:
            self._record(c.cid, entry)

        deadline = ex.clock.monotonic() + c.deadline_s
        first, count = c.want if c.want is not None else (0, VOCAB)
        out = np.zeros(count, np.float32) if c.logits_out else None
        tokens = np.asarray(c.prompt, np.int32)
        request = InferenceRequest(
            seq_id=c.seq, kind=TaskKind.PREFILL_IDS, tokens=tokens,
            positions=np.arange(len(tokens), dtype=np.int32), past_len=0, deadline=deadline,
            want_logits=c.want, kv_reserve_len=len(tokens) + c.steps if c.reserve else None)
        gone = self._gone(c.cid)
        handle = ex.enqueue(request, logits_out=out, on_created=gone)
        self.current[c.cid] = handle
        self.handles.append(handle)
        result = handle.wait_until(deadline)
        self._give_up(handle)
        record(("prefill", c.prompt, 0, *self._answer(result, out, count)))
        stream, past, failed = None, len(tokens), isinstance(result, Status)
        token = first + result.argmax if not isinstance(result, Status) else 0
        for step in range(c.steps):
            if isinstance(result, Status) and failed and (
                    c.after_failure is None or result.category == Category.CANCELLED):
                break
            if failed and c.after_failure == "next":
                past += 1
            if c.think_s > 0:
                ex.clock.sleep(c.think_s)
            if not c.greedy:
                token = c.tokens[step % len(c.tokens)] if c.tokens else 0
            early = c.early_at == step
            step_out = out  # the caller's row of this step (Client.fresh_rows: its own)
            decode = InferenceRequest(
                seq_id=c.seq, kind=TaskKind.DECODE, tokens=np.asarray([token], np.int32),
                positions=np.asarray([past], np.int32), past_len=past, deadline=deadline,
                want_logits=c.want)
            if v.api == "stream":
                if stream is None or stream.closed:
                    stream = ex.decode_stream(
                        c.seq, past, deadline, logits_out=out, want_logits=c.want,
                        max_len=len(tokens) + c.steps, greedy_ahead=v.greedy_ahead and c.greedy,
                        max_steps=c.steps - step)
                    self.current[c.cid] = stream
                if c.cid in self.abandoned:
                    stream.cancel()
                submitted = stream.submit(token)
                if not isinstance(submitted, Status):
                    self.handles.append(submitted)
                if early:  # (sent whether the step was refused at once or not, as above)
                    record(("early", (0,), past + 1, *self._early(c, past, deadline)))
                result = submitted if isinstance(submitted, Status) else stream.wait()
            else:
                if c.fresh_rows and out is not None:
                    step_out = np.zeros(count, np.float32)
                handle = ex.enqueue(decode, logits_out=step_out, on_created=gone)
                self.current[c.cid] = handle
                self.handles.append(handle)
                if early:
                    record(("early", (0,), past + 1, *self._early(c, past, deadline)))
                result = handle.wait_until(deadline)
                self._give_up(handle)
            record(("decode", (token,), past,
                    *self._answer(result, step_out, count, c.fresh_rows)))
            if failed:  # the one request after a failure: done
                break
            failed = isinstance(result, Status)
            if not isinstance(result, Status):
                past = result.kv_len
                token = first + result.argmax
        if stream is not None:
            stream.close()
        if c.release:
            status = ex.release_sequence(c.seq, wait_s=5.0)
            record(("release", status.code))

    def _give_up(self, handle: Any) -> None:
        """As decode_sync and a decode stream's ``wait`` do at the caller's deadline: a job
        whose result nobody takes is cancelled, and waited for (bounded by
        ``cancelled_job_bound``), so its sequence may be released next."""
        if not handle.done:
            handle.cancel()
            handle.wait_until(self.ex.cancelled_job_bound(handle))

    def _gone(self, cid: int) -> Callable[[Any], None]:
        """``on_created`` of a client's jobs: a client that gave up cancels each at once."""
        def on_created(handle) -> None:
            if cid in self.abandoned:
                handle.cancel()
        return on_created

    def _early(self, c: Client, past: int, deadline: float) -> tuple:
        if c.early_delay_s > 0:
            self.ex.clock.sleep(c.early_delay_s)
        request = InferenceRequest(
            seq_id=c.seq, kind=TaskKind.DECODE, tokens=np.asarray([0], np.int32),
            positions=np.asarray([past + 1], np.int32), past_len=past + 1, deadline=deadline)
        handle = self.ex.enqueue(request)
        self.handles.append(handle)
        return self._answer(handle.wait_until(deadline), None, 0)


# ---- the history, run on every variant in lock step ---------------------------------------------
class Differential:
    """The plain path and ``variants`` side by side, one ``Lane`` each; ``act`` applies an
    action to every lane, ``finish`` runs the clients to their end, compares and shuts down."""

    def __init__(self, calbins: dict[str, str], variants: Sequence[str], decode_s: float = 0.01,
                 prefill_s: float = 0.02, kv_blocks: int = 64, slots_per_kind: int = 2) -> None:
        names = ["plain", *[n for n in variants if n != "plain"]]
        self.calbins = calbins
        self.lanes = [Lane(calbins, VARIANTS[n], decode_s, prefill_s, kv_blocks, slots_per_kind)
                      for n in names]
        self.clients: dict[int, Client] = {}
        self.log: list[tuple] = []
        self.closed = False
        #: the history holds something timed (see ``allowed``): False, every answer is exact
        self.timed = False

    @property
    def ref(self) -> Lane:
        return self.lanes[0]

    def start(self) -> None:
        for lane in self.lanes:
            lane.start()
        self._align()

    def _align(self) -> None:
        now = max(lane.sched.now for lane in self.lanes)
        for lane in self.lanes:
            lane.sched.now = now

    def act(self, action: tuple) -> None:
        """One action on every lane (see the module docstring for their names)."""
        self.log.append(action)
        name, *args = action
        if name in ("cancel", "release", "recover", "switch"):
            self.timed = True
        if name == "client":
            client: Client = args[0]
            self.clients[client.cid] = client
            if (client.faults or client.think_s > 0 or client.early_delay_s > 0
                    or 0 < client.deadline_s < 1.0):
                self.timed = True
            for lane in self.lanes:
                lane.start_client(client)
        elif name == "cancel":
            for lane in self.lanes:
                lane.cancel_client(*args)
        elif name == "release":
            for lane in self.lanes:
                lane.admin_release(*args)
        elif name == "recover":
            for lane in self.lanes:
                lane.request_recovery()
        elif name == "switch":
            for lane in self.lanes:
                lane.switch(*args)
        elif name != "tick":
            raise ValueError(f"unknown action {name!r}")
        seconds = args[0] if name == "tick" else 0.0
        try:
            for lane in self.lanes:
                lane.advance(seconds)
        except BaseException:
            self.close()
            raise

    def finish(self, horizon_s: float = 120.0) -> list[str]:
        """Run until every client ended (bounded), then compare every lane with the plain
        path, check the plain path against the oracle, and shut every lane down. Returns
        the differences (empty: equal)."""
        for _ in range(int(horizon_s)):
            if all(lane.clients_done() for lane in self.lanes):
                break
            for lane in self.lanes:
                lane.advance(1.0)
        # the end state once nothing is left to happen: a job whose caller left (its
        # deadline passed) may still run, and its fault run a recovery (found by stop 40's
        # long run, seed 50114: compared at once, the plain path's was still on the device
        # while Phase B's, which had run earlier, already recovered)
        for _ in range(int(horizon_s)):
            if all(lane.settled() for lane in self.lanes):
                break
            for lane in self.lanes:
                lane.advance(1.0)
        problems = []
        for lane in self.lanes:
            if not lane.clients_done():
                stuck = [cid for cid in lane.answers if not isinstance(cid, tuple)
                         and cid not in lane.finished]
                problems.append(f"{lane.variant.name}: clients {stuck} never ended within "
                                f"{horizon_s}s of virtual time")
            elif not lane.settled():
                problems.append(f"{lane.variant.name}: never settled within {horizon_s}s of "
                                f"virtual time after its clients ended (lifecycle "
                                f"{lane.ex.state}, dispatch {lane.ex.dispatch.peek()})")
        problems += self.oracle_problems(self.ref)
        for lane in self.lanes[1:]:
            problems += compare(self.ref, lane, self.timed)
            problems += self.oracle_problems(lane, lane.diverged)
        for lane in self.lanes:
            try:
                lane.finish()
            finally:
                lane.close()
        return problems

    def close(self) -> None:
        self.closed = True
        for lane in self.lanes:
            lane.close()

    def oracle_problems(self, lane: Lane, only: Any = None) -> list[str]:
        """Every result ``lane`` delivered (to the clients in ``only``, default all) is the
        numpy oracle's."""
        from calexec.drivers.synthetic import calbin as cb
        from calexec.drivers.synthetic import oracle
        from calexec.drivers.tools.explore import OTHER_SEED_XOR
        seed = cb.default_spec().seed
        seeds = {self.calbins["main"]: seed, self.calbins["other"]: seed ^ OTHER_SEED_XOR}
        ref, problems = lane, []
        for cid, client in self.clients.items():
            if only is not None and cid not in only:
                continue
            first, count = client.want if client.want is not None else (0, VOCAB)
            sequence, generation = None, None
            zero = _digest(np.zeros(count, np.float32))
            row = zero if client.logits_out else None
            for entry in ref.answers.get(cid, ()):
                if client.fresh_rows and entry[0] == "decode" and lane.variant.api != "stream":
                    row = zero  # this step's row was its own, zeroed
                if entry[0] in ("prefill", "decode") and client.logits_out:
                    # the caller's row is written only by a job whose result the caller
                    # takes (after its Wait succeeded; a non-finite output may leave it
                    # partly written, documented), never by a failed or cancelled one. A
                    # ``wait.deadline`` is neither: its caller stopped waiting and the job
                    # goes on (``JobHandle.wait_until``), so it may have written the row
                    # before the answer (greedy ahead delivers a step after the next one is
                    # on the device, ``ahead_yield_s``) or write it after
                    digest = entry[-1]
                    waited_out = entry[3] == "err" and entry[4] == "wait.deadline"
                    if entry[3] == "err" and entry[4] != "internal.output_not_finite" \
                            and not waited_out:
                        if row is not None and digest is not None and digest != row:
                            problems.append(f"{lane.variant.name}: client {cid} {entry[0]} "
                                            f"at {entry[2]} ({entry[4]}) wrote the caller's "
                                            "row")
                    # (after non-finite output or a job left running: None, not known)
                    row = None if waited_out else digest
                if entry[0] not in ("prefill", "decode") or entry[3] != "ok":
                    continue
                tokens, past, gen_id = entry[1], entry[2], entry[6]
                if gen_id != generation or sequence is None:  # (None only before the first)
                    sequence = oracle.OracleSequence(seeds[ref.gen_calbins[gen_id]])
                    generation = gen_id
                if past > sequence.length:  # KV this client did not write (a sequence's
                    continue                # earlier owner left it): nothing to check it by
                sequence.run(list(tokens), past)
                logits = oracle.bf16_to_f32(oracle.logits_bf16(sequence.states[-1]))
                expected = _digest(logits[first:first + count])
                if entry[7] != expected or (client.logits_out and entry[8] != expected):
                    problems.append(f"{lane.variant.name}: client {cid} {entry[0]} at {past}: "
                                    "logits differ from the oracle")
                if entry[4] != int(np.argmax(logits[first:first + count])):
                    problems.append(f"{lane.variant.name}: client {cid} {entry[0]} at {past}: "
                                    "argmax differs from the oracle")
        return problems


#: answers that depend on when a job ran relative to another action (an early request, a
#: cancel, a deadline, a recovery or switch, another job's fault): the ``timing`` rule
TIMING_CODES = frozenset({
    "request.cancelled", "admission.deadline", "submit.deadline", "wait.deadline",
    "kv.deadline", "lifecycle.unavailable", "kv.sequence_busy", "kv.sequence_on_device",
    "kv.sequence_unknown", "kv.past_len_beyond_committed", "execution.deadline"})


def _code(entry: tuple) -> str | None:
    """The error code of an answer: a job's (``err``) or a sequence release's (not ``ok``)."""
    if entry[0] == "release":
        return None if entry[1] == "ok" else entry[1]
    return entry[4] if len(entry) > 4 and entry[3] == "err" else None


#: where an answer entry (kind, tokens, past, "ok", argmax, kv_len, generation, digest, row
#: digest) holds the generation its job ran in
_GENERATION = 6


def _in_another_generation(expected: tuple, got: tuple) -> bool:
    """Two successes equal but for the generation their job ran in."""
    return (len(expected) == len(got) > _GENERATION and expected[3] == got[3] == "ok"
            and expected[_GENERATION] != got[_GENERATION]
            and expected[:_GENERATION] == got[:_GENERATION]
            and expected[_GENERATION + 1:] == got[_GENERATION + 1:])


def allowed(variant: Variant, expected: tuple, got: tuple, timed: bool) -> str | None:
    """Why ``variant`` may answer ``got`` where the plain path answered ``expected`` (the rule's
    name), or None: it may not. The rules (docs/testing.md, "Differential testing"):

    - ``ready_queue``: a request the plain path refuses because the lifecycle is not admitting
      (``lifecycle.unavailable``: a recovery or switch runs) waits for Ready instead, bounded by
      its deadline, and is then answered in the new generation.
    - ``speculation`` (greedy ahead; decided in ``compare``): a step fired ahead that its
      caller never took (the caller was cancelled or stopped while it ran) met a fault of
      its own, and a recovery the plain path never needed: the histories differ from then.
    - ``timing`` (variants that run a job at another time: greedy ahead, Phase B), only in
      histories with something timed (``timed``: a cancel, an admin release, a recovery or
      switch, a job fault, a short deadline, a caller that waits between steps or sends its
      early request late): an answer that depends on when a job ran may differ: an early
      request, a reported device fault that found a recovery running (covered by it) where
      the other found the lifecycle Ready (a recovery of its own), or an error of
      ``TIMING_CODES`` (a job's, or an admin release's that finds the sequence busy or on
      the device, or free, at another time) or of the device (a reset
      aborts every job in flight, Phase B's two included; in Phase B a job in flight behind
      a hung one on a device that runs one job at a time ends when its own Wait times out,
      ``calrt.wait_failed``) on either side, or a success with
      the same tokens and logits in another generation (a job that faults ran at another
      time, so its recovery did, before or after this job). Histories with nothing timed
      must be answered exactly.
    """
    if (variant.ready_queue_max and expected[0] != "release"
            and _code(expected) == "lifecycle.unavailable"):
        return "ready_queue"
    if variant.shifts_time and timed:
        if expected[0] in ("early", "recover") or got[0] in ("early", "recover"):
            return "timing"
        for code in (_code(expected), _code(got)):
            if code is not None and (code in TIMING_CODES or code.startswith(("device.",
                                                                              "internal."))
                                     or (variant.phase_b and code == "calrt.wait_failed")):
                return "timing"
        if _in_another_generation(expected, got):
            return "timing"
    return None


def _refused_later_by_the_ready_queue(variant: Variant, answer: tuple, ref_at: float,
                                      lane_at: float) -> bool:
    """The ``ready_queue`` rule for an answer equal on both lanes: a request the plain path
    refused at once (``lifecycle.unavailable``) waited for Ready in the ready queue and was
    refused the same way later (the lifecycle ended Failed, or its deadline came first), so
    what its client does next happens later than on the plain path (found by stop 41's
    hypothesis run: a sequence release then found the sequence free, the plain path's busy)."""
    return bool(variant.ready_queue_max) and answer[0] != "release" \
        and _code(answer) == "lifecycle.unavailable" and lane_at > ref_at


def compare(ref: Lane, lane: Lane, timed: bool = True) -> list[str]:
    """Where ``lane`` answered otherwise than the plain path ``ref``, beyond what ``allowed``
    accepts. From the first allowed difference on (in virtual time), the two histories differ
    (a request served that was refused, a fault met by another job, a recovery earlier): the
    answers after it are not compared, only checked against the oracle (``diverged``); every
    answer before it must be equal, and so must the end state when there was none."""
    name = lane.variant.name
    diverge_at, first = None, []
    if lane.variant.greedy_ahead:  # a step fired ahead that its caller never took met a fault
        ran = {entry[1:] for entry in ref.device.infers}
        for seq, position, kind, _point, at in lane.device.fired:
            if (seq, position, kind) not in ran and (diverge_at is None or at < diverge_at):
                diverge_at, first = at, ["speculation", "speculation"]
    switched_alone = False
    if lane.variant.shifts_time and timed:  # a switch that found Ready on one lane only
        for (ref_at, ref_ran), (lane_at, lane_ran) in zip(ref.switch_log, lane.switch_log):
            if ref_ran != lane_ran:
                switched_alone = True
                diverge_at, first = min(ref_at, lane_at), ["switch", "timing"]
                break
    for key, expected in ref.answers.items():  # the earliest allowed difference
        got = lane.answers.get(key, [])
        for index, (e, g) in enumerate(zip(expected, got)):
            if e != g:
                rule = allowed(lane.variant, e, g, timed)
                if rule is not None:
                    at = min(ref.times[key][index], lane.times[key][index])
                    if diverge_at is None or at < diverge_at:
                        diverge_at, first = at, [key, rule]
                break
            if _refused_later_by_the_ready_queue(lane.variant, e, ref.times[key][index],
                                                 lane.times[key][index]):
                at = ref.times[key][index]
                if diverge_at is None or at < diverge_at:
                    diverge_at, first = at, [key, "ready_queue"]
                break
    problems = []
    for key, expected in ref.answers.items():
        got = lane.answers.get(key, [])
        ref_t, got_t = ref.times.get(key, []), lane.times.get(key, [])
        for index in range(max(len(expected), len(got))):
            late = diverge_at is not None and (
                (index < len(ref_t) and ref_t[index] >= diverge_at)
                or (index < len(got_t) and got_t[index] >= diverge_at)
                or index >= min(len(expected), len(got)))
            if late:
                lane.diverged[key] = first[1]
                break
            if index >= min(len(expected), len(got)):
                problems.append(f"{name}: client {key}: {len(got)} answers != plain "
                                f"{len(expected)}\n  plain: {expected}\n  {name}: {got}")
                break
            e, g = expected[index], got[index]
            if e != g:
                rule = allowed(lane.variant, e, g, timed)
                if rule is None:
                    problems.append(f"{name}: client {key} answer {index}: {g} != plain {e}"
                                    f"\n  plain: {expected}\n  {name}: {got}")
                else:
                    lane.diverged[key] = rule
                break
    if switched_alone:  # the end state follows a model switch one lane did not make
        lane.diverged["end"] = "timing"
    elif lane.ex.state == "Failed" and ref.ex.state != "Failed":  # never a shortcut's outcome
        problems.append(f"{name}: the lifecycle ended Failed ({lane.ex.failure}), the plain "
                        f"path's {ref.ex.state}")
    if diverge_at is None:
        ga = None if ref.ex.gen is None else ref.ex.gen.id
        gb = None if lane.ex.gen is None else lane.ex.gen.id
        if ga != gb and _recovered_at_another_time(ref, lane, timed):
            lane.diverged["end"] = "timing"
        else:
            if ref.ex.state != lane.ex.state:
                problems.append(f"{name}: lifecycle {lane.ex.state} != plain {ref.ex.state}")
            if ga != gb:
                problems.append(f"{name}: generation {gb} != plain {ga}")
    return problems


def _recovered_at_another_time(ref: Lane, lane: Lane, timed: bool) -> bool:
    """The ``timing`` rule for the end state when every answer was equal: a job's device
    fault (the same answer on both lanes) found a recovery or switch running on one lane (its
    generation covered the fault) and the lifecycle Ready on the other (a recovery of its
    own, one generation more), because ``lane`` ran the job at another time (found by stop
    39's long run, seed 30271: Phase B's fault came before a model switch, the plain path's
    during its drain). Allowed only for that many more generations as the lane ahead has
    device faults among its answers (the lifecycle states then differ too: one may still
    warm a generation the other never opens)."""
    if not (lane.variant.shifts_time and timed) or ref.ex.gen is None or lane.ex.gen is None:
        return False
    ahead = ref if ref.ex.gen.id > lane.ex.gen.id else lane
    faults = sum((_code(entry) or "").startswith("device.")
                 for answers in ahead.answers.values() for entry in answers)
    return abs(ref.ex.gen.id - lane.ex.gen.id) <= faults


# ---- random histories, replay and shrinking ------------------------------------------------
@attrs.frozen
class Case:
    """One history and the variants it runs on (``run_case``)."""

    variants: tuple[str, ...]
    actions: tuple[tuple, ...]
    decode_s: float = 0.01
    slots_per_kind: int = 2


def random_case(seed: int, variants: Sequence[str] | None = None) -> Case:
    """A random history from ``seed``: two to five clients (prompts, steps, slices, rows,
    reservations, greedy or given tokens, deadlines far or passed or short, early requests,
    think times, requests after a failure, job faults) interleaved with ticks, cancels,
    admin releases, recoveries and model switches; every variant unless named."""
    import random
    rng = random.Random(seed)
    # (values chosen so that device ends, deadlines and think times rarely fall on the same
    # virtual instant: a tie between two events is ordered arbitrarily, even on the plain path)
    decode_s = rng.choice((0.00053, 0.0031, 0.0097))
    slots = rng.choice((2, 2, 4))
    actions: list[tuple] = []
    for cid in range(1, rng.randint(2, 6)):
        actions.append(("client", Client(
            cid, rng.choice((1, 2, 3)),
            tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))), rng.randint(0, 6),
            reserve=rng.random() < 0.7,
            want=None if rng.random() < 0.7 else (rng.randrange(150000), rng.randint(1, 1000)),
            logits_out=rng.random() < 0.6, greedy=rng.random() < 0.7,
            fresh_rows=rng.random() < 0.3,
            tokens=tuple(rng.randrange(VOCAB) for _ in range(3)),
            deadline_s=rng.choice((60.0, 60.0, 60.0, -1.0, 0.0147)),
            early_at=rng.choice((None, None, 0, 1, 2)),
            early_delay_s=rng.choice((0.0, 0.0029, 0.0083)),
            think_s=rng.choice((0.0, 0.0, 0.0041, 0.0703)),
            after_failure=rng.choice(("same", "next", None)), release=rng.random() < 0.8,
            faults=tuple((rng.randint(-1, 5), rng.choice(JOB_FAULTS))
                         for _ in range(rng.choice((0, 0, 1, 2)))))))
        actions.append(("tick", rng.choice((0.00047, 0.0021, 0.0059, 0.0203, 0.1007))))
        r = rng.random()
        if r < 0.15:
            actions.append(("cancel", rng.randint(1, cid)))
        elif r < 0.22:
            actions.append(("recover",))
        elif r < 0.28:
            actions.append(("switch", rng.random() < 0.5, rng.random() < 0.6))
        elif r < 0.36:
            actions.append(("release", rng.choice((1, 2, 3))))
    names = tuple(variants) if variants is not None else tuple(n for n in VARIANTS
                                                               if n != "plain")
    return Case(names, tuple(actions), decode_s, slots)


def run_case(calbins: dict[str, str], case: Case) -> list[str]:
    """The history on the plain path and ``case.variants``: the differences (empty: equal).
    An explorer check that fails (lock order, a leak, a job past its bound, ...) is a
    difference too."""
    from calexec.drivers.tools.explore import ExplorationFailure
    diff = Differential(calbins, case.variants, decode_s=case.decode_s,
                        prefill_s=2 * case.decode_s, slots_per_kind=case.slots_per_kind)
    try:
        diff.start()
        for action in case.actions:
            diff.act(action)
        return diff.finish()
    except ExplorationFailure as failure:
        return [f"explorer: {str(failure).splitlines()[0]}"]
    finally:
        diff.close()


def shrink_case(calbins: dict[str, str], case: Case, attempts: int = 200) -> Case:
    """A smaller history that still differs (greedy: drop actions, then variants, then
    simplify clients), for a failure report or a regression test."""
    def fails(candidate: Case) -> bool:
        return bool(run_case(calbins, candidate))

    tries = 0
    i = 0
    while i < len(case.actions) and tries < attempts:
        candidate = attrs.evolve(case, actions=case.actions[:i] + case.actions[i + 1:])
        tries += 1
        if fails(candidate):
            case = candidate
        else:
            i += 1
    for name in case.variants:
        if len(case.variants) == 1 or tries >= attempts:
            break
        candidate = attrs.evolve(case, variants=tuple(v for v in case.variants if v != name))
        tries += 1
        if fails(candidate):
            case = candidate
    simpler = {"want": None, "logits_out": False, "fresh_rows": False, "early_at": None,
               "think_s": 0.0,
               "early_delay_s": 0.0, "faults": (), "release": True, "after_failure": None}
    for index, action in enumerate(case.actions):
        if action[0] != "client":
            continue
        for field, value in simpler.items():
            client = case.actions[index][1]
            if getattr(client, field) == value or tries >= attempts:
                continue
            actions = list(case.actions)
            actions[index] = ("client", attrs.evolve(client, **{field: value}))
            candidate = attrs.evolve(case, actions=tuple(actions))
            tries += 1
            if fails(candidate):
                case = candidate
    return case
