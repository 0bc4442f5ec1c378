"""llama.cpp-style sequence memory over the CalRT KV (spec §3: declare only what is real).

The old adapter returned success from empty ``seq_cp/keep/add/div/state_*`` bodies, so upper
layers believed operations happened that never did. This adapter implements what the
0.7.6 KvManager can really do and returns an explicit UNSUPPORTED Status for the rest, so a
caller can disable the feature (prompt caching, context shifting, ...) instead of corrupting
a sequence:

==============================  ================================================================
operation                       behaviour
==============================  ================================================================
``seq_rm(seq, p0, -1)``         supported: keep positions ``[0, p0)`` (truncate to the end)
``seq_rm(seq, 0, -1)``          supported: clear the sequence (device release)
``seq_rm`` of an inner range    UNSUPPORTED (the device keeps a causal state chain)
``seq_pos_max(seq)``            supported: committed length - 1 (-1 when empty)
``seq_cp``, ``seq_keep``,       UNSUPPORTED: no device operation copies, filters or shifts KV
``seq_add``, ``seq_div``
``state_save/state_restore``    UNSUPPORTED: 0.7.6 exposes no KV read-back
==============================  ================================================================
"""

from __future__ import annotations

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.machines.kv import KvCoordinator


def unsupported(operation: str, detail: str = "") -> Status:
    """The explicit 'not supported' answer (§3), PROGRAMMING category: disable the feature."""
    text = f"{operation} is not supported by the CalRT 0.7.6 KV adapter"
    return Status.failure("kv.unsupported", Category.PROGRAMMING, Phase.VALIDATE,
                          f"{text}: {detail}" if detail else text)


class SequenceMemory:
    """The llama_memory-like surface over a ``KvCoordinator``."""

    def __init__(self, kv: KvCoordinator) -> None:
        self._kv = kv

    def seq_pos_max(self, seq_id: int) -> int:
        view = self._kv.seqs.get(seq_id)
        return -1 if view is None else view.committed_len - 1

    def seq_rm(self, seq_id: int, p0: int, p1: int) -> Status:
        """Remove positions ``[p0, p1)`` (``p1 < 0``: to the end). Only tails are supported."""
        p0 = max(p0, 0)
        end = self.seq_pos_max(seq_id) + 1
        if p1 >= 0 and p1 < end:
            return unsupported("seq_rm of an inner range",
                               f"seq={seq_id} [{p0}, {p1}) with length {end}")
        if p0 == 0:
            return self._kv.reset_sequence(seq_id)
        if p0 >= end:
            return Status.OK
        return self._kv.truncate(seq_id, p0)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> Status:
        return unsupported("seq_cp", f"src={src} dst={dst}")

    def seq_keep(self, seq_id: int) -> Status:
        return unsupported("seq_keep", f"seq={seq_id}")

    def seq_add(self, seq_id: int, p0: int, p1: int, delta: int) -> Status:
        return unsupported("seq_add", f"seq={seq_id} delta={delta}")

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> Status:
        return unsupported("seq_div", f"seq={seq_id} d={d}")

    def state_save(self, seq_id: int) -> Status:
        return unsupported("state_save", f"seq={seq_id}")

    def state_restore(self, seq_id: int, data: bytes) -> Status:
        return unsupported("state_restore", f"seq={seq_id}")
