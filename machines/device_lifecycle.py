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
import time
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

log = logging.getLogger("calexec.executor")


class DeviceLifecycle:
    """Lifecycle chart owner: start, golden, failure, recovery, model switch (mixin of
    ``DeviceExecutor``; see the module docstring)."""

    # ---- lifecycle guards (LifecycleChart) ------------------------------------------------
    def generation_advanced(self) -> bool:
        """A fresh generation (new id, calbin, KvManager, pool) is open."""
        return self.gen is not None and self.gen.id == self._last_gen_id

    def golden_passed(self) -> bool:
        return self._golden_ok

    def all_submitted_drained(self) -> bool:
        self._reap_held()
        with self.submit_mu:
            return self._inflight == 0 and not self._completion_q

    def reset_confirmed(self) -> bool:
        """The runtime no longer touches any old-generation buffer: the old generation was
        released after a drain, or after a confirmed reset."""
        return self._teardown_confirmed

    def last_good_known(self) -> bool:
        return self._rollback_path is not None

    @property
    def state(self) -> str:
        return self.lifecycle.state

    _last_gen_id = 0

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
            self.lifecycle.send("configured")
            if self.config.threads:
                self._start_threads()
            status = self._warm_up()
        if not status.ok:
            self.start_status = status
            self._fail(status)
            self._stop_threads()
            if self.gen is not None:
                self.gen.pool.close()
                self.gen.release(self.device)
            if self.device is not None:
                self.device.close()
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
        self.gen, self._last_gen_id = gen, gen_id
        self._golden_ok = self._teardown_confirmed = False
        with self._submit_cv:
            self._refusal = None  # the new generation's own golden jobs may queue
        return Status.OK

    def _go_ready(self) -> None:
        with self.lifecycle_mu:
            self.lifecycle.send("warmed")
            with self._submit_cv:
                self._refusal = None
            self._admitting = not self._stopping
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
                                   deadline=time.monotonic() + cfg.golden_timeout_s)
        for _ in range(cfg.golden_decode_steps + 1):
            result = self._run_internal(request)
            if isinstance(result, Status):
                return result
            out.append(result.argmax)
            past = result.kv_len
            request = InferenceRequest(seq_id=seq, kind=TaskKind.DECODE,
                                       tokens=np.asarray([result.argmax], dtype=np.int32),
                                       positions=np.asarray([past], dtype=np.int32),
                                       past_len=past, deadline=time.monotonic() + cfg.golden_timeout_s)
        return tuple(out)

    def _run_internal(self, request: InferenceRequest) -> "InferenceResult | Status":
        handle = self._enqueue(request, internal=True)
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
                self.lifecycle.send("fail")
                self.failure = status
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
            if self.lifecycle.state != "Ready" or self._pending_recovery is not None:
                return  # already draining/recovering: one recovery covers it
            self._pending_recovery = decision
            self._admitting = False  # stop admission at once (§8 Device row)
        if self.config.threads:
            thread = threading.Thread(target=self.run_pending_recovery, name="calexec-recovery",
                                      daemon=True)
            self._recovery_thread = thread
            thread.start()

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
            t0 = time.monotonic()
            record: dict[str, Any] = {"reason": reason.code, "reset": reset,
                                      "from_generation": self.gen.id if self.gen else None}
            status = self._recover(reason, reset, calbin_path, record)
            record.update(ok=status.ok, status=status.code, seconds=time.monotonic() - t0,
                          to_generation=self.gen.id if self.gen else None,
                          lifecycle=self.lifecycle.state)
            self.recoveries.append(record)
            return status

    def _recover(self, reason: Status, reset: bool, calbin_path: str | None,
                 record: dict[str, Any]) -> Status:
        policy = self.config.recovery
        with self.lifecycle_mu:
            if self.lifecycle.state != "Ready":
                return Status.unavailable(Phase.RECOVERY,
                                          f"cannot recover from lifecycle {self.lifecycle.state}")
            self.lifecycle.send("drain")
        unavailable = Status.unavailable(Phase.RECOVERY,
                                         f"device recovering after {reason.code}; retry later")
        self._stop_admission(unavailable)
        drained = self._drain(policy.drain_grace_s)
        reset_done = False
        if not drained and reset and policy.reset_kind != "none":
            status = self._reset(policy.reset_kind)  # aborts what the device still holds
            if not status.ok:
                self._fail(status)
                return status
            reset_done = True
            drained = self._drain(policy.drain_grace_s)
        if not drained:
            status = Status.failure("recovery.not_drained", Category.DEVICE, Phase.RECOVERY,
                                    "submitted jobs did not finish and no safe reset is "
                                    f"configured (reset_kind={policy.reset_kind}); the "
                                    "process should exit for its supervisor", **self._gctx())
            self._fail(status)
            return status
        with self.lifecycle_mu:
            self.lifecycle.send("recover")
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
        record["reset_kind"] = policy.reset_kind if reset else None
        status = old.release(self.device)
        self._retire(old)
        if not status.ok:
            self._fail(status)
            return status
        self._teardown_confirmed = True
        with self.lifecycle_mu:
            self.lifecycle.send("reconfigure")
        target = calbin_path or old.calbin_path
        # One more attempt if this one fails: a switch rolls back to the last good calbin
        # (Triton keeps the old model on a failed reload); a recovery retries its calbin once.
        self._rollback_path = (self._last_good_other(exclude=target) if calbin_path else
                               target if target in self.good_calbins else None)
        status = self._configure_and_warm(target)
        refused: list[str] = []
        while not status.ok and self.lifecycle.can("roll_back"):
            refused.append(status.code)
            self._release_failed_generation()
            fallback = self._rollback_path
            self.lifecycle.send("roll_back")
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
            self.lifecycle.send("configured")
        return self._warm_up()

    def _release_failed_generation(self) -> None:
        """Tear down a generation refused while Configuring/Warming (its golden jobs may
        still be on the device: drain, and reset if they do not finish)."""
        gen = self.gen
        if gen is None:
            return
        policy = self.config.recovery
        if not self._drain(policy.drain_grace_s) and policy.reset_kind != "none":
            self._reset(policy.reset_kind)
            self._drain(policy.drain_grace_s)
        gen.release(self.device)
        self._retire(gen)
        self.gen = None

    def _retire(self, gen: Generation) -> None:
        """Keep a released generation's host storage alive (a stale DMA after a reset lands in
        it, FI14); past ``keep_retired_generations`` the oldest is discarded. Its objects form
        reference cycles (slots and their chart runs), so its storage is dropped explicitly
        instead of waiting for a full garbage collection."""
        self._retired.append(gen)
        while len(self._retired) > self.config.keep_retired_generations:
            self._retired.popleft().discard()

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
        with self._submit_cv:
            self._refusal = status
            self._submit_cv.notify_all()
        if not self.config.threads:
            while self._submit_q and self.submit_one():
                pass

    def _drain(self, grace: float) -> bool:
        """Wait until every submitted job returned from Wait (or the grace ends)."""
        deadline = time.monotonic() + grace
        while True:
            if not self.config.threads:
                while self.complete_one():
                    pass
            if self.all_submitted_drained() and not self._submit_q:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
