"""Implicit pre-arming for ``enqueue``/``decode_sync`` callers (issue 17).

A llama.cpp-style caller decodes one sequence with ``decode_sync`` (or ``enqueue`` +
``wait_until``) per token: it builds a request, the executor admits it (token budget, KV txn,
buffer lease, chart Created -> Admitted -> Preparing, inputs copied, CSRs set) and queues it,
all between one token's result and the next token's ``infer()``. ``DecodeStream`` moves that
work off the critical path for callers that say they are decoding; this module does the same
for callers that do not, by guessing the one thing they will most likely ask next.

The rule. When the submitter has submitted a decode job N of sequence S (an ordinary,
single-sequence, caller's job) and the job it submitted before N was of S too (one sequence is
decoding: with several sequences interleaved a guess would mostly be wasted) and decode jobs
run >= ``tuning.auto_prearm_min_us`` (1 ms; on a faster device the caller is back first), it
arms, while N is on the device and it has nothing else to submit (``tuning.arm_delay_s`` after N's
``infer()``, at most a quarter of a decode job's device time, as for a stream's next step),
the job N+1 that a next token would need: DECODE of S at N's end position, N's ``want_logits``
and ``logits_out``, its KV txn chained behind N's (``KvCoordinator.reserve_next``: only within
the reservation S already holds, never a wait, never the KvManager), a free slot (never a wait)
and the token budget. The job then sits in the executor's ``_armed`` list (the same ownership
rule as a stream's: whoever removes it under ``submit_mu`` owns it) with ``uncounted`` set: its
release is not a failure, nobody asked for it.

When the caller's next ``enqueue`` is a DECODE of S at exactly that position, with the same
``want_logits``, one token and no new ``kv_reserve_len``, and passes the same checks an
ordinary request does, the armed job adopts the request (its token, deadline, request id,
``logits_out``) and is fired: the token id is written into its slot, the chart goes Queued,
the submitter infers. Any other request of S releases the armed job first (lease back, KV txn
rolled back, budget back) and is admitted the ordinary way: a guess never changes what a
request does, only when its admission work ran.

An armed job never keeps a resource from anyone:
- it expires ``tuning.auto_idle_s`` after N's expected end (the submitter releases it);
- an admission short of a buffer slot or of token budget releases every auto-armed job first;
- ``KvCoordinator.reset_sequence``/``truncate``/``reserve`` on S release it (``on_busy``
  hook) instead of answering ``kv.sequence_busy``;
- a generation's fence, a drain and shutdown release it like any armed job;
- ``decode_stream(S, ...)`` releases it (the stream arms its own).

``ExecutorConfig.auto_prearm`` (default on) switches the guess off.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from calexec.contracts.prepare import InferenceRequest
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.machines.dispatch import Arm

if TYPE_CHECKING:
    from calexec.machines.executor import DeviceExecutor
    from calexec.machines.job import Job

log = logging.getLogger("calexec.autoarm")


class AutoArm:
    """One sequence's guessed next job: waiting for the submitter to arm it, being armed, or
    armed (``job``), until it is taken or dropped. Its fields are guarded by the dispatch
    lock (``ex.dispatch.cv``); the dispatch keeps it in its table of guesses and in what the
    submitter arms (an ``Armer``, as a decode stream is)."""

    __slots__ = ("ex", "seq_id", "prev", "past", "job", "dropped")

    def __init__(self, ex: DeviceExecutor, prev: Job) -> None:
        self.ex = ex
        self.seq_id = prev.request.seq_id
        self.prev: Job | None = prev  # job N, on the device: the guess chains behind its txn
        self.past = prev.request.past_len + prev.request.token_count
        self.job: Job | None = None
        self.dropped = False

    def matches(self, job: Job, request: InferenceRequest, logits_out: np.ndarray | None
                ) -> bool:
        """Whether ``request`` is what this entry armed ``job`` for (``job`` is owned by the
        caller here: no lock needed)."""
        armed = job.request
        positions, armed_positions = request.positions, armed.positions
        return (request.kind == TaskKind.DECODE and len(request.seq_ids) == 1
                and request.past_len == self.past and request.token_count == 1
                and request.tokens is not None and request.embeddings is None
                and request.kv_reserve_len is None
                and request.want_logits == armed.want_logits
                and isinstance(positions, np.ndarray) and positions.shape == (1,)
                and armed_positions is not None and positions.dtype == armed_positions.dtype
                and int(positions[0]) == self.past
                and logits_out is job.logits_out)

    def arm_next(self) -> None:
        """(For the submitter, with nothing to submit.) Arm the guess. Never raises and
        never waits."""
        ex, job, drop = self.ex, None, None
        dispatch = ex.dispatch
        prev = self.prev
        try:
            if prev is not None and not self.dropped and prev.gen is ex.gen and not prev.done:
                job = self._arm(prev)
        except Exception:  # noqa: BLE001 - a failed guess only means nothing is armed
            log.exception("auto pre-arming the next job of seq %d raised", self.seq_id)
        with dispatch.cv:
            self.prev = None  # N's job is not kept alive by a guess
            if job is None or not dispatch.guess_armed_locked(self, job):
                drop = job  # nothing armed, or the guess was dropped meanwhile
                dispatch.forget_guess_locked(self)
        if drop is not None:
            ex.release_armed(drop, Status.cancelled(Phase.CANCEL, "auto pre-arm dropped"))

    def _arm(self, prev: Job) -> Job | None:
        ex = self.ex
        prev_positions = prev.request.positions
        if prev_positions is None:  # a submitted job's request has its positions (step 4)
            return None
        deadline = min(prev.deadline, ex.clock.monotonic() + ex.expected_decode_s
                       + ex.config.tuning.auto_idle_s)
        request = InferenceRequest(
            seq_id=self.seq_id, kind=TaskKind.DECODE, tokens=np.zeros(1, np.int32),
            positions=np.full(1, self.past, prev_positions.dtype), past_len=self.past,
            deadline=deadline, want_logits=prev.request.want_logits,
            request_id=prev.request.request_id)
        job = ex.admit_armed(request, prev.logits_out, Arm(prev.txn, blocking=False))
        return None if job.done else job
