"""The device lifecycle half of ``DeviceExecutor`` (spec §9.1, §9.2; LifecycleChart).

``DeviceExecutor`` (machines/executor.py) is the job path: enqueue, submitter, completion,
shutdown. This mixin is the device's life along the declared lifecycle chart: the chart's
guards, ``start`` (Configuring -> Warming -> golden -> Ready), the golden run, ``_fail``
(-> Failed with a reason), and recovery and model switch (Ready -> Draining -> Recovering ->
Configuring -> Warming -> Ready, or ``roll_back`` / Failed). It is not used on its own: its
methods read and write the executor's state (locks, queues, generations) set up in
``DeviceExecutor.__init__``, and call back into the job path (``_enqueue``, ``submit_one``,
``complete_one``, thread start/stop).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from calexec.contracts.errors import Category
from calexec.contracts.goldens import goldens_path
from calexec.contracts.goldens import lookup as lookup_golden
from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import EngineSlot, TaskKind
from calexec.machines.faults import Action, Decision
from calexec.machines.generation import Generation, open_generation
from calexec.machines.job import InferenceResult
from calexec.machines.chart_names import (LIFECYCLE_EV_CONFIGURED, LIFECYCLE_EV_DRAIN,
                                          LIFECYCLE_EV_FAIL, LIFECYCLE_EV_RECONFIGURE,
                                          LIFECYCLE_EV_RECOVER, LIFECYCLE_EV_ROLL_BACK,
                                          LIFECYCLE_EV_WARMED, LIFECYCLE_READY)

log = logging.getLogger("calexec.executor")


class DeviceLifecycle:
    """Lifecycle chart owner: start, golden, failure, recovery, model switch (mixin of
    ``DeviceExecutor``; see the module docstring)."""

    # ---- lifecycle guards (LifecycleChart) ------------------------------------------------
    def generation_advanced(self) -> bool:
        """A fresh generation is open: its id is above every generation that served or was
        retired, its pool is mapped and its KV coordinator open (read from the objects, not
        from a flag set for this guard)."""
        gen = self.gen
        if gen is None or gen.closing or gen.released or not gen.pool.opened:
            return False
        return all(gen.id > old.id for old in self._retired) and gen.id > self._served_gen_id

    def golden_passed(self) -> bool:
        return self._golden_ok

    def all_submitted_drained(self) -> bool:
        self.outcomes.reap_held(report=False)
        return self.dispatch.drained() and not len(self.completion)

    def reset_confirmed(self) -> bool:
        """The runtime no longer touches any old-generation buffer: every generation that
        served before is torn down (released after a drain, or after a confirmed reset) and
        no failed job is still held by the runtime."""
        if self.gen is not None and self.gen.id == self._served_gen_id:
            return False  # the generation that served is still the current one
        if self.dispatch.held():
            return False
        return all(old.released for old in self._retired if old.id <= self._served_gen_id)

    def last_good_known(self) -> bool:
        return self._rollback_path is not None

    @property
    def state(self) -> str:
        return self.lifecycle.state

    #: id of the newest generation that reached Ready
    _served_gen_id = 0

    # ---- start: Configuring -> Warming -> Ready ----------------------------------------------
    def start(self) -> Status:
        """Open the device and generation 1, warm up with the golden run, go Ready.

        FI01: the manifest is resolved against ``GetAllModels`` before ``configure``; a
        mismatch refuses the generation and nothing is configured."""
        rc, self.device = self.runtime.open_device(self.config.device_config)
        status = (Status.from_calrt(rc, Phase.CONFIGURE, "device open") if rc != 0 else
                  self._enable_phase_b())
        if status.ok:
            status = self._open(self.config.calbin_path)
        if status.ok:
            self.lifecycle.send(LIFECYCLE_EV_CONFIGURED)
            if self.config.threads:
                self.start_threads()
            status = self._warm_up()
        if not status.ok:
            self.start_status = status
            self._fail(status)
            released = self._release_failed_generation()
            self.stop_threads()
            if self.device is not None and released.ok:
                self.device.close()  # else a job may still run: keep the device open
            return status
        self._go_ready()
        self.start_status = Status.OK
        return Status.OK

    def _enable_phase_b(self) -> Status:
        """Phase B needs the runtime's parallel mode (§6.4); Phase A leaves it off."""
        if self.config.inflight_capacity != 2:
            return Status.OK
        rc = self.device.enable_parallel_mode(True)
        return Status.from_calrt(rc, Phase.CONFIGURE, "EnableParallelMode(true) for Phase B")

    def _open(self, calbin_path: str) -> Status:
        """Open generation+1 of ``calbin_path`` (Configuring)."""
        gen_id = next(self._gen_ids)
        engines = ((EngineSlot.PING, EngineSlot.PONG) if self.config.inflight_capacity == 2
                   else (EngineSlot.AUTO,))
        gen = open_generation(self.device, self.manifest, calbin_path, gen_id,
                              self.config.slots_per_kind, self.locks, engines)
        if isinstance(gen, Status):
            return gen
        gen.kvc.on_busy = self.outcomes.release_armed_of  # armed jobs are guesses
        self.gen = gen
        self._golden_ok = False
        self.dispatch.refuse(None)  # the new generation's own golden jobs may queue
        return Status.OK

    def _go_ready(self) -> None:
        with self.lifecycle_mu:
            self.lifecycle.send(LIFECYCLE_EV_WARMED)
            self._served_gen_id = self.gen.id
            self.dispatch.refuse(None)
            self._admitting = not self._stopping
            self._ready_cv.notify_all()  # requests queued through the recovery go on
        path = self.gen.calbin_path
        if path in self.good_calbins:
            self.good_calbins.remove(path)
        self.good_calbins.append(path)

    def expected_golden(self, sha: str) -> "tuple[tuple[int, ...] | None, str]":
        """(expected tokens or None, where they come from) for calbin ``sha``: the operator's
        ``goldens`` (``config.goldens``, or an unpinned run accepted in this process), else the
        golden pinned next to the manifest for this prompt and decode steps."""
        if sha in self.goldens:
            return tuple(self.goldens[sha]), ("unpinned" if sha in self.unpinned_goldens
                                              else "config")
        pinned = lookup_golden(getattr(self.manifest, "goldens", {}), sha,
                               self.config.golden_tokens, self.config.golden_decode_steps)
        return (None, "unpinned") if pinned is None else (pinned.tokens, "pinned")

    def _warm_up(self) -> Status:
        """§9.2 Warming: a fixed prefill + decode through the real path, compared with the
        golden pinned for this calbin. No pinned golden: refused (ARTIFACT, before anything
        runs) unless ``allow_unpinned_golden``, which accepts the first run's tokens."""
        cfg = self.config
        sha = self.gen.sha256
        expected, source = self.expected_golden(sha)
        if expected is None and not cfg.allow_unpinned_golden:
            return Status.failure(
                "golden.unpinned", Category.ARTIFACT, Phase.GOLDEN,
                f"calbin {self.gen.calbin_path!r} (sha256 {sha}) has no pinned golden for "
                f"golden_tokens/golden_decode_steps={cfg.golden_decode_steps} in "
                f"{goldens_path(getattr(self.manifest, 'source', 'manifest'))}; run `calexec "
                f"golden record --calbin {self.gen.calbin_path}` or set allow_unpinned_golden",
                generation=self.gen.id)
        tokens = self._run_golden()
        if isinstance(tokens, Status):
            return tokens
        if expected is None:
            log.warning("allow_unpinned_golden: calbin %r (sha256 %s) goes Ready on an unpinned "
                        "golden %s (first run trusted; §9.2 asks for a fixed golden)",
                        self.gen.calbin_path, sha, list(tokens))
            self.goldens[sha] = expected = tokens
            self.unpinned_goldens.add(sha)
        self.golden_source = source
        if tokens != tuple(expected):
            return Status.failure("golden.mismatch", Category.INTERNAL, Phase.GOLDEN,
                                  f"golden tokens {list(tokens)} != recorded {list(expected)}",
                                  generation=self.gen.id)
        status = self.kvc.reset_sequence(cfg.golden_seq_id)
        self._golden_ok = status.ok
        return status

    def _run_golden(self) -> "tuple[int, ...] | Status":
        cfg = self.config
        seq = cfg.golden_seq_id
        status = self.kvc.reset_sequence(seq)
        if not status.ok:
            return status
        prompt = np.asarray(cfg.golden_tokens, dtype=np.int32)
        out: list[int] = []
        request = InferenceRequest(seq_id=seq, kind=TaskKind.PREFILL_IDS, tokens=prompt,
                                   positions=np.arange(len(prompt), dtype=np.int32), past_len=0,
                                   deadline=self.clock.monotonic() + cfg.golden_timeout_s)
        for _ in range(cfg.golden_decode_steps + 1):
            result = self._run_internal(request)
            if isinstance(result, Status):
                return result
            out.append(result.argmax)
            past = result.kv_len
            request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                       tokens=np.asarray([result.argmax], dtype=np.int32),
                                       positions=np.asarray([past], dtype=np.int32),
                                       past_len=past,
                                       deadline=self.clock.monotonic() + cfg.golden_timeout_s)
        return tuple(out)

    def _run_internal(self, request: InferenceRequest) -> "InferenceResult | Status":
        handle = self.enqueue_internal(request)
        if not self.config.threads:
            while not handle.done:
                if not (self.submit_one() or self.complete_one()):
                    break
        return handle.wait_until(request.deadline)

    def _fail(self, status: Status) -> None:
        """Lifecycle -> Failed with ``status`` as the reason; queued work is refused."""
        with self.lifecycle_mu:
            self._admitting = False
            if not self.lifecycle.final:
                self.lifecycle.send(LIFECYCLE_EV_FAIL)
                self.failure = status
            self._ready_cv.notify_all()
        self._refuse_queued(status)
        log.error("device lifecycle Failed: %s", status)

    # ---- recovery (§9.1, §9.2): Ready -> Draining -> Recovering -> Configuring -> Warming ------
    def request_recovery(self, decision: Decision) -> None:
        """Called by the fault controller; never blocks. Runs the recovery on its own thread
        (threads mode) or leaves it for ``run_pending_recovery`` (stepped mode)."""
        if decision.action is Action.STOP:
            self._stop_admission(Status.unavailable(Phase.RECOVERY, decision.reason))
            self._fail(decision.status)
            return
        with self.lifecycle_mu:
            if self.lifecycle.state != LIFECYCLE_READY or self._pending_recovery is not None:
                return  # already draining/recovering: one recovery covers it
            self._pending_recovery = decision
            self._admitting = False  # stop admission at once (§8 Device row)
        if self.config.threads:
            self._recovery_thread = self.clock.start_thread(self._supervised_recovery,
                                                            "calexec-recovery")

    def _supervised_recovery(self) -> None:
        """The recovery thread's barrier: an exception mid-recovery leaves the device in an
        unknown state, so the lifecycle ends Failed with the reason (never a dead thread
        with the lifecycle stuck in Draining or Recovering)."""
        try:
            self.run_pending_recovery()
        except Exception as exc:  # noqa: BLE001 - the barrier
            status = Status.internal("recovery_exception", Phase.RECOVERY,
                                     f"recovery raised {type(exc).__name__}: {exc}",
                                     **self._gctx())
            log.error("recovery thread caught %s", status, exc_info=exc)
            self.thread_faults.append({"thread": "calexec-recovery",
                                       "error": f"{type(exc).__name__}: {exc}", "job": None,
                                       "at": self.clock.monotonic()})
            self._stop_admission(status)
            self._fail(status)

    def run_pending_recovery(self) -> Status | None:
        """Run the recovery the controller asked for, if any (stepped mode calls this)."""
        with self.lifecycle_mu:
            decision, self._pending_recovery = self._pending_recovery, None
        if decision is None:
            return None
        return self.recover(decision.status, reset=decision.action is Action.RESET_REBUILD,
                            calbin_path=(self._last_good_other() if decision.action is
                                         Action.ROLLBACK else None))

    def switch_model(self, calbin_path: str) -> Status:
        """Model switch through the lifecycle: the new calbin goes live only after its golden
        passes; otherwise the previous one is configured again and keeps serving."""
        return self.recover(Status.failure("lifecycle.model_switch", Category.LIFECYCLE,
                                           Phase.RECOVERY, f"switch to {calbin_path!r}"),
                            reset=False, calbin_path=calbin_path)

    def recover(self, reason: Status, reset: bool = True,
                calbin_path: str | None = None) -> Status:
        """Drain, optionally reset, tear down the generation, open generation+1 of
        ``calbin_path`` (default: the current calbin), run the golden, reopen admission."""
        with self._recovery_mu:
            self._recovery_owner = threading.get_ident()
            try:
                if self._stopping:  # shutdown ran first: nothing left to recover
                    return Status.unavailable(Phase.RECOVERY, "the executor is shutting down")
                t0 = self.clock.monotonic()
                record: dict[str, Any] = {"reason": reason.code, "reset": reset,
                                          "from_generation": self.gen.id if self.gen else None}
                status = self._recover(reason, reset, calbin_path, record)
            finally:
                self._recovery_owner = None
            record.update(ok=status.ok, status=status.code, seconds=self.clock.monotonic() - t0,
                          to_generation=self.gen.id if self.gen else None,
                          lifecycle=self.lifecycle.state)
            self.recoveries.append(record)
            return status

    def _recover(self, reason: Status, reset: bool, calbin_path: str | None,
                 record: dict[str, Any]) -> Status:
        policy = self.config.recovery
        with self.lifecycle_mu:
            if self.lifecycle.state != LIFECYCLE_READY:
                return Status.unavailable(Phase.RECOVERY,
                                          f"cannot recover from lifecycle {self.lifecycle.state}")
            self.lifecycle.send(LIFECYCLE_EV_DRAIN)
        unavailable = Status.unavailable(Phase.RECOVERY,
                                         f"device recovering after {reason.code}; retry later")
        self._stop_admission(unavailable)
        # fencing: no request thread works on the old generation past this point
        if not self._fence(self.gen, self.config.fence_grace_s):
            status = Status.internal("recovery.fence", Phase.RECOVERY,
                                     "request threads did not leave generation "
                                     f"{self.gen.id} within {self.config.fence_grace_s}s",
                                     **self._gctx())
            self._fail(status)
            return status
        drained = self._drain(policy.drain_grace_s)
        reset_done = False
        # A job still on the device after the drain grace needs the safe reset whatever the
        # cause of this recovery (§9.1: a model switch or a LIFECYCLE rebuild asks for none,
        # but a hung job would otherwise end it Failed).
        if not drained and policy.reset_kind != "none":
            status = self._reset(policy.reset_kind)  # aborts what the device still holds
            if not status.ok:
                self._fail(status)
                return status
            reset_done = True
            drained = self._drain(policy.drain_grace_s)
        if not drained:
            how = (f"after a device {policy.reset_kind}" if reset_done else
                   f"and no safe reset is configured (reset_kind={policy.reset_kind})")
            status = Status.failure("recovery.not_drained", Category.DEVICE, Phase.RECOVERY,
                                    f"submitted jobs did not finish within "
                                    f"{policy.drain_grace_s}s {how}; the process should exit "
                                    "for its supervisor", **self._gctx())
            self._fail(status)
            return status
        with self.lifecycle_mu:
            self.lifecycle.send(LIFECYCLE_EV_RECOVER)
        old = self.gen
        old.pool.quarantine_all()  # invariant 8: every old-generation slot
        if reset and not reset_done:
            if policy.reset_kind == "none":
                # a device fault needs a reset the runtime cannot give safely: stop (§9.1)
                status = Status.failure("recovery.no_safe_reset", Category.DEVICE,
                                        Phase.RECOVERY, f"{reason.code} needs a device reset "
                                        "and reset_kind=none; the process should exit for its "
                                        "supervisor", **self._gctx())
            else:
                status = self._reset(policy.reset_kind)
            if not status.ok:
                self._fail(status)
                return status
        record["reset_kind"] = policy.reset_kind if reset or reset_done else None
        status = old.release(self.device)
        self._retire(old)
        self.gen = None
        if not status.ok:
            self._fail(status)
            return status
        with self.lifecycle_mu:
            self.lifecycle.send(LIFECYCLE_EV_RECONFIGURE)
        target = calbin_path or old.calbin_path
        # One more attempt if this one fails: a switch rolls back to the last good calbin
        # (Triton keeps the old model on a failed reload); a recovery retries its calbin once.
        # The other chance if this one is refused: a switch to another calbin rolls back to
        # the last good one; a recovery, or a reload of the calbin that served, retries it.
        switching = calbin_path is not None and calbin_path != old.calbin_path
        self._rollback_path = (self._last_good_other(exclude=target) if switching else
                               target if target in self.good_calbins else None)
        status = self._configure_and_warm(target)
        refused: list[str] = []
        while not status.ok and not self._stopping and self.lifecycle.can(LIFECYCLE_EV_ROLL_BACK):
            refused.append(status.code)
            released = self._release_failed_generation()
            if not released.ok:  # its job still runs on the device: §9.1, never torn down
                record["refused"] = refused
                self._fail(released)
                return released
            fallback = self._rollback_path
            self.lifecycle.send(LIFECYCLE_EV_ROLL_BACK)
            self._rollback_path = None
            status = self._configure_and_warm(fallback)
            if status.ok and fallback != target:
                record["refused"] = refused
                self._go_ready()
                return Status.failure("recovery.rolled_back", Category.ARTIFACT, Phase.RECOVERY,
                                      f"{target!r} was refused ({refused[0]}); {fallback!r} "
                                      "serves again", **self._gctx())
        record["refused"] = refused
        if not status.ok:
            self._fail(status)
            return status
        self._go_ready()
        return Status.OK

    def _configure_and_warm(self, calbin_path: str) -> Status:
        """Configuring -> Warming -> (golden) with a fresh generation of ``calbin_path``."""
        status = self._open(calbin_path)
        if not status.ok:
            self.gen = None
            return status
        with self.lifecycle_mu:
            self.lifecycle.send(LIFECYCLE_EV_CONFIGURED)
        return self._warm_up()

    def _release_failed_generation(self) -> Status:
        """Tear down a generation refused while Configuring/Warming, or at a failed start,
        only once the runtime let go of it (§9.1): its golden jobs may still be on the
        device, so fence, drain, and reset if they do not finish. A job still on the device
        after that keeps the generation alive (buffers mapped, KvManager kept): the Status
        says so and the caller ends Failed for the supervisor instead of rolling back."""
        gen = self.gen
        if gen is None:
            return Status.OK
        policy = self.config.recovery
        self._stop_admission(Status.unavailable(Phase.RECOVERY,
                                                f"generation {gen.id} refused; retry later"))
        fenced = self._fence(gen, self.config.fence_grace_s)
        drained = fenced and self._drain(policy.drain_grace_s)
        if fenced and not drained and policy.reset_kind != "none":
            reset = self._reset(policy.reset_kind)
            drained = reset.ok and self._drain(policy.drain_grace_s)
        self.gen = None
        if not drained:
            self._retire(gen)  # kept, never released: the device may still use it
            return Status.failure(
                "recovery.generation_on_device", Category.DEVICE, Phase.RECOVERY,
                f"generation {gen.id} was refused while a job of it is still on the device "
                f"and no reset freed it (reset_kind={policy.reset_kind}); its buffers stay "
                "mapped; the process should exit for its supervisor (§9.1)", generation=gen.id)
        status = gen.release(self.device)
        self._retire(gen)
        return status

    def _retire(self, gen: Generation) -> None:
        """Keep a retired generation's host storage until the device proves it writes none of
        it any more (a stale DMA after a reset lands there, FI14; never in reused memory).
        Proof is ``device.dma_quiescent()``; a runtime without it keeps them all (logged).
        A generation that was never released (its job still on the device) is kept as is.
        Discarded storage is dropped explicitly: slots and their chart runs form cycles."""
        if gen not in self._retired:
            self._retired.append(gen)
        self._discard_proven()

    def _discard_proven(self) -> None:
        released = [gen for gen in self._retired if gen.released]
        if not released or self.device is None:
            return
        probe = getattr(self.device, "dma_quiescent", None)
        proven = probe() if probe is not None else None
        if proven is None and len(released) > 4:
            log.warning("%d retired generations kept: the runtime offers no proof that no "
                        "stale DMA is pending (dma_quiescent)", len(released))
        if proven:
            for gen in released:
                self._retired.remove(gen)
                gen.discard()

    def _last_good_other(self, exclude: str | None = None) -> str | None:
        exclude = exclude if exclude is not None else (self.gen.calbin_path if self.gen else None)
        others = [p for p in self.good_calbins if p != exclude]
        return others[-1] if others else None

    def _reset(self, kind: str) -> Status:
        rc = getattr(self.device, kind)()
        return Status.from_calrt(rc, Phase.RECOVERY, f"device {kind}", **self._gctx())

    def _gctx(self) -> dict[str, int]:
        return {} if self.gen is None else {"generation": self.gen.id}

    def _stop_admission(self, status: Status) -> None:
        """No new admissions; waiters end; queued (not submitted) jobs fail with ``status``
        (UNAVAILABLE: the client retries after Retry-After; nothing is dropped silently)."""
        self._admitting = False
        self._refuse_queued(status)
        if self.gen is not None:
            self.gen.kvc.wake()
            self.gen.pool.wake()

    def _refuse_queued(self, status: Status) -> None:
        self.dispatch.refuse(status)
        if not self.config.threads:
            while self.dispatch.has_work() and self.submit_one():
                pass

    def _drain(self, grace: float) -> bool:
        """Wait until every queued job was failed or submitted and every submitted job
        returned from Wait (or the grace ends: bounded)."""
        deadline = self.clock.monotonic() + grace
        while True:
            if not self.config.threads:
                while self.submit_one() or self.complete_one():
                    pass
            if self.all_submitted_drained():
                return True
            if self.clock.monotonic() >= deadline:
                return False
            self.clock.sleep(0.002)
