"""Sequence ownership across generations (issue 13, §7, §9.2): a mixin of ``DeviceExecutor``.

KV sequence ids are owned *above* the KvManager: the embedding server leases them from its own
free list (``drivers/serving/server.py`` ``SequencePool``) and gives each back exactly once, through
:meth:`SequenceOwnership.release_sequence`. A KvManager lives and dies with its generation, so
what releasing an id means depends on where its KV is:

* the id has KV in the **current** generation's KvManager: it is reset there
  (``KvCoordinator.reset_sequence``: refused while a job of it is open, and waiting, bounded by
  ``wait_s``, while the device still runs a job of it after a failed Wait);
* its generation was **retired** (recovery, model switch, refused switch and roll back): its KV
  died with that generation's KvManager, which is destroyed or about to be. Nothing is called on
  it; the release succeeds at once. The current generation's KvManager has never seen the id, so
  it is clean there too.

A release racing a recovery cannot reach a destroyed KvManager: ``Generation.release`` closes
the generation's ``KvCoordinator`` before destroying its KvManager, and ``close`` fences every
KvManager call under the coordinator's call lock (a call after it answers without the device).

The mixin reads ``self.gen`` (the executor's current ``Generation``, None during a switch) and
touches nothing else of the executor but its ``_before_release`` hook (a step a greedy stream
fired ahead leaves the device first); it takes no executor lock.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import TYPE_CHECKING

from calexec.contracts import fields
from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import S32_MAX

if TYPE_CHECKING:
    from calexec.machines.generation import Generation


class SequenceOwnership:
    """``release_sequence`` for the owner of the sequence ids (mixin of ``DeviceExecutor``)."""

    def release_sequence(self, seq_id: int, wait_s: float = 0.0) -> Status:
        """Give back the KV of ``seq_id`` once its last job is resolved.

        OK when the current generation released it, or when no live generation holds KV of it
        (its generation retired: the KV died with that KvManager; or the lifecycle is between
        generations). ``kv.sequence_on_device`` (UNAVAILABLE: retry) while the device still
        runs a job of it after ``wait_s`` seconds; ``kv.sequence_busy`` while a job of it is
        open (the caller released too early: a bug on its side); ``kv.seq_id_out_of_range``
        (INVALID_REQUEST) for an id at or above the live KvManager's ``max_seqs``."""
        # (the arguments' full test only where a plain int id and a finite float wait >= 0,
        # which it takes, are not given: 11 of a server request's Python calls, issue 28)
        if not (type(seq_id) is int and 0 <= seq_id <= S32_MAX
                and type(wait_s) is float and 0.0 <= wait_s < math.inf):
            refusal = _argument_refusal(seq_id, wait_s)
            if refusal is not None:
                return refusal
        gen: Generation | None = getattr(self, "gen", None)
        kvc = None if gen is None else gen.kvc
        max_seqs = None if kvc is None else kvc.max_seqs()
        if max_seqs is not None and seq_id >= max_seqs:
            # no sequence of that id can exist: answered OK, so the id the caller meant (a
            # typo, an off-by-one of its free list) kept its KV; refused as ``enqueue`` is
            return Status.failure("kv.seq_id_out_of_range", Category.INVALID_REQUEST,
                                  Phase.VALIDATE, f"release_sequence: seq_id={int(seq_id)} is "
                                  f"outside the KvManager's [0, max_seqs={max_seqs}); nothing "
                                  "was released", seq_id=int(seq_id))
        if kvc is None or seq_id not in kvc.seqs:
            return Status.OK  # no KV of it in a live KvManager: nothing to release on the device
        self._before_release(seq_id, wait_s)
        return kvc.reset_sequence(seq_id, wait_s=wait_s)

    def _before_release(self, seq_id: int, wait_s: float) -> None:
        """(The owner's hook, before the reset of a sequence held by the live KvManager.)
        Nothing here; the executor lets a step a greedy stream fired ahead leave first."""


def _argument_refusal(seq_id: object, wait_s: object) -> Status | None:
    """``request.invalid`` naming ``seq_id`` when it is no sequence id (not an int, a bool,
    outside ``0..S32_MAX``), or ``wait_s`` when it is no finite number of seconds >= 0 (a
    NaN, an infinity, a str, a negative number: until stop 68 taken as 0):
    an id the KvManager never holds would otherwise be "released" with OK while the id the
    caller meant (``"3"`` for 3) kept its KV."""
    try:
        index = None if isinstance(seq_id, bool) else operator.index(seq_id)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if index is None or not 0 <= index <= S32_MAX:
        return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE,
                              f"release_sequence: seq_id={seq_id!r}: expected a sequence id, "
                              f"an int in 0..{S32_MAX}")
    if isinstance(wait_s, bool) or not isinstance(wait_s, numbers.Real) or not math.isfinite(
            fields.to_float(wait_s)) or wait_s < 0:  # 10**400: math.isfinite raised OverflowError
        return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE,
                              f"release_sequence: wait_s={wait_s!r}: expected a finite number of "
                              "seconds >= 0 (0: no wait)", seq_id=index)
    return None
