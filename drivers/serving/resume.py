"""Resumable generations (issue 16): a device fault costs the client latency, not an error.

Greedy decoding (and any sampling that is a pure function of the seed and the token index) is
deterministic given the prompt and the tokens produced so far, so a request whose job fails
for a device-side or retryable reason can continue on a fresh KV sequence: wait for Ready
(drivers/serving/admission.py, ahead of new requests), release the failed sequence through the
server's release path (§7: reset, never reused), take a fresh sequence id, re-prefill prompt +
produced tokens in one PREFILL_IDS job at past_len 0 (reserving the KV of the whole request,
as the first prefill did) and go on decoding. A stream simply pauses. Nothing here chooses a
token: the re-prefill's result goes through the same path as any other job's.

Resumed: a job failure of category LIFECYCLE, UNAVAILABLE, TRANSIENT, DEVICE, UNKNOWN or
INTERNAL (§8: retryable or device-side; UNKNOWN/INTERNAL go on once the device is Ready again,
after the recovery they may trigger), and a generation replaced between two jobs of the request
(a recovery or model switch: its KV died with it). Never: INVALID_REQUEST, REQUEST_ARTIFACT,
ARTIFACT, COMPATIBILITY, PROGRAMMING, RESOURCE_EXHAUSTED, and never the client's own
cancellation or deadline. Budget per request (``ServerConfig``): ``max_resumes`` resumes and
``resume_budget_s`` seconds lost to them in total; past it the request ends with the failure
it would have got without resuming. A (re-)prefill the lifecycle refused before it ran
(``lifecycle.unavailable``: a switch or recovery began as it was enqueued) spends no resume,
at most ``REFUSED_PREFILLS_MAX`` times a request. A resume whose lifecycle ended meanwhile (Failed, Stopped)
ends with what a request sent then gets: 503 ``lifecycle.unavailable`` naming the failure.
"""

from __future__ import annotations

import time
import types
from collections.abc import Callable
from typing import Any

import anyio
from prometheus_client import Counter, Histogram

from calexec.contracts.errors import Category
from calexec.contracts.status import Status

#: failure categories a generation resumes from (module docstring; §8 table)
RESUMABLE = frozenset({Category.LIFECYCLE, Category.UNAVAILABLE, Category.TRANSIENT,
                       Category.DEVICE, Category.UNKNOWN, Category.INTERNAL})
#: ``calexec_resumes_total{cause}`` of a generation replaced between two jobs
REPLACED = "generation_replaced"
#: the code of a failure that only says the device stopped serving the request's generation
#: (``Status.unavailable``): admission stopped or the generation replaced by a recovery, a
#: model switch or a drain (``service.knock_on``), never a job's failure of its own
KNOCK_ON_CODE = "lifecycle.unavailable"
#: the refusals of a request's (re-)prefill before it ran that spend no resume
#: (``Resumer.resume``); past them each spends one, as any resume: the number of lifecycle
#: changes one request may wait through is bounded whatever the time budget
REFUSED_PREFILLS_MAX = 8
RESUME_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Resumer:
    """The resume path of one ``CompletionService`` and its metrics."""

    def __init__(self, service: Any) -> None:
        self.service = service
        reg = service.metrics.registry
        self.resumes = Counter("calexec_resumes", "Generations resumed on a fresh sequence, "
                               "by cause (failure category or generation_replaced).", ["cause"],
                               registry=reg)
        self.reprefilled = Counter("calexec_resumed_tokens_reprefilled",
                                   "Prompt + produced tokens re-prefilled by resumes.",
                                   registry=reg)
        self.lost = Histogram("calexec_resume_lost_seconds", "Time lost to one resume: the "
                              "failure to the re-prefill's result.", buckets=RESUME_BUCKETS,
                              registry=reg)
        self.exhausted = Counter("calexec_resume_budget_exhausted",
                                 "Requests that failed because their resume budget was spent.",
                                 registry=reg)
        #: called with (the failure's time.monotonic(), seconds lost, cause) after each resume
        #: that reached its re-prefill's result (``calexec bench faults`` attributes them)
        self.on_resumed: Callable[[float, float, str], None] | None = None

    def resumable(self, failure: Status) -> bool:
        return failure.category in RESUMABLE

    async def resume(self, run: Any, failure: Status, replaced: bool = False) -> bool:
        """Start resuming ``run`` after ``failure`` (its last job is resolved): True when the
        request goes on (its next ``advance`` waits for a fresh sequence and re-prefills),
        False when it ends with ``failure`` (not resumable, or the budget is spent)."""
        config = self.service.config
        if run.abandoned or not (replaced or self.resumable(failure)) or config.max_resumes == 0:
            return False
        now = time.monotonic()
        spent = run.resume_s + (now - run.resume_started if run.resume_started else 0.0)
        # a (re-)prefill the lifecycle refused before it ran (it left Ready as the job was
        # enqueued: a model switch, a recovery; ``lifecycle.unavailable``, "Draining; not
        # admitting", "retired before the job was queued") lost nothing: the request holds
        # no KV yet, and waits for Ready as a request sent a moment later does, within the
        # resume time budget and its deadline, spending none of ``max_resumes`` (until stop
        # 72 each such refusal spent one: a reload beside a fault under load ended requests
        # that never reached the device with 503, the budget exhausted)
        free = (not replaced and failure.code == KNOCK_ON_CODE and run.past == 0
                and run.refused_prefills < REFUSED_PREFILLS_MAX)
        if (not free and run.resumes >= config.max_resumes) \
                or spent >= config.resume_budget_s:
            self.exhausted.inc()
            return False
        if now >= run.deadline:
            return False
        if run.resume_started is None:
            run.resume_started = now
        if free:
            run.refused_prefills += 1
        else:
            run.resumes += 1
        run.resume_cause = (REPLACED if replaced or failure.category is None
                            else failure.category.value)
        self.resumes.labels(run.resume_cause).inc()
        run.resume_failure = failure
        # Register first: the id the failed sequence frees below goes to this request ahead of
        # requests not yet admitted (pump serves resumes first).
        run.waiter = self.service.admission.try_admit(resume=True)
        old = types.SimpleNamespace(seq_id=run.seq_id, handle=run.handle,
                                    enqueue_idle=run.enqueue_idle,
                                    request_id=run.request_id, decode=run.decode)
        run.seq_id, run.handle, run.generation_id, run.past = None, None, None, 0
        run.decode = None  # the next sequence gets its own stream
        run.reprefill = True
        with anyio.CancelScope(shield=True):
            await self._release(old)
        return True

    async def _release(self, old: Any) -> None:
        """The failed sequence through the server's own release path (§7)."""
        service = self.service
        handle = old.handle
        try:
            if old.decode is not None:  # its pre-armed job holds KV of the failed sequence
                await service.in_worker(old.decode.close)  # (the loop starts no thread)
            if handle is None or handle.done:
                released = await service.in_worker(service.release_now, old.seq_id)
                if released:
                    return
            service.release_later(old)
        except Exception:  # noqa: BLE001 - never leave the id in limbo
            service.release_later(old)

    async def take_sequence(self, run: Any) -> Status | None:
        """``run`` has no sequence (admission or resume): wait for one (a resume no longer
        than its time budget allows); None once it holds one, else the Status it ends with."""
        until = run.deadline
        if run.resume_started is not None:
            until = min(until, run.resume_started + self.service.config.resume_budget_s
                        - run.resume_s)
        refused = await self.service.admission.take(run, until)
        if refused is None or run.resume_started is None:
            return refused
        if refused.category == Category.UNAVAILABLE:
            # the lifecycle ended (Failed, Stopped; the only 503 a resume's wait is refused
            # with: a drain or a full queue refuses no resume): the answer a request sent now
            # gets, naming the failure that ended it. The failure resumed from was answered:
            # 503 "generation 2 retired ...; retry" or "device.ccu_exception", telling the
            # client to retry a device that will not serve again without an operator
            return refused
        if refused.category == Category.DEADLINE and time.monotonic() < run.deadline:
            self.exhausted.inc()  # the resume time budget ran out before the deadline
        # the resume gave up (deadline, budget): the client gets the failure it would have
        # got without resuming
        return run.resume_failure

    def resumed(self, run: Any) -> None:
        """The re-prefill of ``run`` succeeded: account for the time lost."""
        if not run.reprefill:
            return
        run.reprefill = False
        self.reprefilled.inc(len(run.prompt) + len(run.tokens))
        if run.resume_started is not None:
            started, lost = run.resume_started, time.monotonic() - run.resume_started
            run.resume_s += lost
            run.resume_started = None
            self.lost.observe(lost)
            if self.on_resumed is not None:
                self.on_resumed(started, lost, run.resume_cause)

