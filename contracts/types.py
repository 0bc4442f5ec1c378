"""Spec §4.1/§4.2 data types as attrs values: tasks, tensors, submodels, generations, timings.

Every limit (max_seq, max_batch, logits tile D0, vocab, shapes) comes from a manifest checked
against the runtime (``calexec.contracts.manifest``); nothing here has a default for them.
"""

from __future__ import annotations

import enum
import math
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import SupportsInt

import attrs
import numpy as np

from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status

#: Integer widths of the CalRT / llama ABI (§6.3 step 2 rejects values that do not fit).
U32_MAX = 2**32 - 1
S32_MAX = 2**31 - 1
U64_MAX = 2**64 - 1


class TaskKind(enum.IntEnum):
    """§4.1 ``CalTaskKind``. The manifest spells it in lower case (``prefill_ids``)."""

    PREFILL_IDS = 0
    PREFILL_EMBEDS = 1
    DECODE = 2
    VISION = 3

    @property
    def takes_embeddings(self) -> bool:
        """True when the first input is an embedding matrix rather than token ids."""
        return self in (TaskKind.PREFILL_EMBEDS, TaskKind.VISION)


class EngineSlot(enum.IntEnum):
    """§4.2 engine slot for ``infer_with_fixed_task_type``; AUTO lets the runtime choose."""

    AUTO = -1
    PING = 0
    PONG = 1


class DType(enum.Enum):
    """Tensor element type; values are the names ``RuntimeTensorInfo.dtype`` uses."""

    S32 = "S32"
    BF16 = "BF16"
    F32 = "F32"
    F16 = "F16"
    U8 = "U8"
    S8 = "S8"

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _ITEMSIZE[self]

    @property
    def host_dtype(self) -> np.dtype[np.generic]:
        """numpy dtype of a host array holding this type (BF16 as its uint16 bit pattern)."""
        return _HOST_DTYPE[self]


_ITEMSIZE = {DType.S32: 4, DType.BF16: 2, DType.F32: 4, DType.F16: 2, DType.U8: 1, DType.S8: 1}
_HOST_DTYPE: dict[DType, np.dtype[np.generic]] = {
    DType.S32: np.dtype(np.int32), DType.BF16: np.dtype(np.uint16), DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16), DType.U8: np.dtype(np.uint8), DType.S8: np.dtype(np.int8),
}


class FieldError(ValueError):
    """A contract value is invalid. ``field`` is the attribute path (``byte_size``,
    ``logits.shape``), so a loader can name the key it came from."""

    def __init__(self, owner: str, field: str, value: object, problem: str) -> None:
        self.owner, self.field, self.value, self.problem = owner, field, value, problem
        super().__init__(f"{owner}.{field}={value!r}: {problem}")


def _to_dtype(value: DType | str) -> DType:
    if isinstance(value, DType):
        return value
    try:
        return DType(value)
    except ValueError:
        raise FieldError("TensorContract", "dtype", value,
                         f"unknown dtype (allowed: {[d.value for d in DType]})") from None


def _to_shape(value: Iterable[SupportsInt]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _positive_dims(instance: object, attribute: attrs.Attribute[tuple[int, ...]],
                   shape: tuple[int, ...]) -> None:
    if not shape or any(d <= 0 for d in shape):
        raise FieldError(type(instance).__name__, attribute.name, list(shape), "need at least one dimension, all > 0")


def _in_range(lo: int, hi: int) -> Callable[[object, attrs.Attribute[int], object], None]:
    def check(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise FieldError(type(instance).__name__, attribute.name, value, f"must be an int in [{lo}, {hi}]")
    return check


def _non_empty(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise FieldError(type(instance).__name__, attribute.name, value, "must be a non-empty string")


@attrs.frozen
class TensorContract:
    """§4.1: one tensor of a submodel. ``byte_size == prod(shape) * dtype.itemsize``."""

    name: str = attrs.field(validator=_non_empty)
    shape: tuple[int, ...] = attrs.field(converter=_to_shape, validator=_positive_dims)
    dtype: DType = attrs.field(converter=_to_dtype)
    byte_size: int = attrs.field(validator=_in_range(1, U64_MAX))
    sliceable: bool = attrs.field(validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        expected = math.prod(self.shape) * self.dtype.itemsize
        if self.byte_size != expected:
            raise FieldError(
                f"tensor {self.name!r}", "byte_size", self.byte_size,
                f"shape {list(self.shape)} x {self.dtype.value} ({self.dtype.itemsize} B) = {expected}",
            )

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one step of the sequence dimension (``shape[1]``; everything after it)."""
        return math.prod(self.shape[2:]) * self.dtype.itemsize


@attrs.frozen
class SubmodelContract:
    """§4.1: one compiled graph and the contracts of its three tensors.

    ``logits.shape[-2]`` must equal ``logits_tile_d0``: the output holds D0 rows and the valid
    one is ``(token_count - 1) % D0`` (S09).
    """

    kind: TaskKind = attrs.field(converter=TaskKind)
    exact_name: str = attrs.field(validator=_non_empty)
    token_or_embed: TensorContract = attrs.field(validator=attrs.validators.instance_of(TensorContract))
    position: TensorContract = attrs.field(validator=attrs.validators.instance_of(TensorContract))
    logits: TensorContract = attrs.field(validator=attrs.validators.instance_of(TensorContract))
    csr_cur_seq: str = attrs.field(validator=_non_empty)
    csr_total_seq: str = attrs.field(validator=_non_empty)
    max_batch: int = attrs.field(validator=_in_range(1, U32_MAX))
    max_seq: int = attrs.field(validator=_in_range(1, S32_MAX))
    logits_tile_d0: int = attrs.field(validator=_in_range(1, U32_MAX))

    def __attrs_post_init__(self) -> None:
        if self.logits.rank < 2 or self.logits.shape[-2] != self.logits_tile_d0:
            raise FieldError(
                f"submodel {self.exact_name!r}", "logits_tile_d0", self.logits_tile_d0,
                f"logits shape {list(self.logits.shape)} must have that many rows in its second-to-last dimension",
            )
        for role in ("token_or_embed", "position"):
            tensor = getattr(self, role)
            if tensor.rank < 2 or tensor.shape[0] != self.max_batch:
                raise FieldError(
                    f"submodel {self.exact_name!r}", f"{role}.shape", list(tensor.shape),
                    f"an input must be [max_batch={self.max_batch}, seq, ...]",
                )


def validate_submodels(submodels: Mapping[TaskKind, SubmodelContract], vocab_size: int, hidden_size: int) -> None:
    """Cross-checks of a submodel set; raises ValueError naming the submodel and values.

    Each entry is keyed by its own kind, every logits tensor ends in ``vocab_size`` and every
    embedding input ends in ``hidden_size``. Shared by ``ModelGeneration`` and the manifest
    loader. Raises :class:`FieldError`.
    """
    for kind, sub in submodels.items():
        owner = f"submodel {sub.exact_name!r}"
        if sub.kind is not kind:
            raise FieldError(owner, "kind", sub.kind.name, f"stored under kind {kind.name}")
        if sub.logits.shape[-1] != vocab_size:
            raise FieldError(owner, "logits.shape", list(sub.logits.shape),
                             f"last dimension must equal vocab_size={vocab_size}")
        if kind.takes_embeddings and sub.token_or_embed.shape[-1] != hidden_size:
            raise FieldError(owner, "token_or_embed.shape", list(sub.token_or_embed.shape),
                             f"last dimension must equal hidden_size={hidden_size}")


#: a sha256 hex digest, matched whole by ``match`` and ``fullmatch`` alike (``\Z``: ``$`` also
#: matched before a final line feed, so a pin ending in one was taken and then never equalled a
#: digest; until stop 72)
SHA256_RE = re.compile(r"\A[0-9a-f]{64}\Z")


def _freeze_submodels(value: Mapping[TaskKind, SubmodelContract] | Mapping[int, SubmodelContract]
                      ) -> Mapping[TaskKind, SubmodelContract]:
    return types.MappingProxyType({TaskKind(k): v for k, v in dict(value).items()})


@attrs.frozen
class ModelGeneration:
    """§4.1: the configured calbin's submodels, valid for one ``generation_id`` (§9.2)."""

    generation_id: int = attrs.field(validator=_in_range(0, U64_MAX))
    calbin_sha256: str = attrs.field()
    calrt_version: str = attrs.field(validator=_non_empty)
    submodels: Mapping[TaskKind, SubmodelContract] = attrs.field(converter=_freeze_submodels, hash=False)
    vocab_size: int = attrs.field(validator=_in_range(1, S32_MAX))
    hidden_size: int = attrs.field(validator=_in_range(1, S32_MAX))

    @calbin_sha256.validator
    def _check_sha(self, attribute: attrs.Attribute[str], value: object) -> None:
        if not isinstance(value, str) or not SHA256_RE.fullmatch(value):
            raise FieldError("ModelGeneration", "calbin_sha256", value, "must be 64 lower-case hex digits")

    def __attrs_post_init__(self) -> None:
        validate_submodels(self.submodels, self.vocab_size, self.hidden_size)

    def submodel(self, kind: TaskKind) -> SubmodelContract | Status:
        """The contract for ``kind`` (exact, by kind), or a ``lookup.no_submodel`` Status (400)."""
        sub = self.submodels.get(kind)
        if sub is None:
            have = sorted(k.name for k in self.submodels)
            return Status.failure(
                "lookup.no_submodel", Category.INVALID_REQUEST, Phase.LOOKUP,
                f"kind={kind.name}: generation {self.generation_id} has no such submodel (has {have})",
                generation=self.generation_id,
            )
        return sub


@attrs.define(slots=True)
class JobTimings:
    """§4.2 per-job timings (S11: owned by the job, never shared by seq id).

    Stamps are ``time.monotonic_ns() // 1000`` values, 0 meaning "not reached"; durations in ms.
    The helpers return None while either end is unset.
    """

    accepted_us: int = 0
    admitted_us: int = 0
    queued_us: int = 0
    submitted_us: int = 0
    completed_us: int = 0
    h2d_ms: float = 0.0
    device_wait_ms: float = 0.0
    d2h_ms: float = 0.0
    postprocess_ms: float = 0.0

    @staticmethod
    def _span_ms(start_us: int, end_us: int) -> float | None:
        return (end_us - start_us) / 1000.0 if start_us and end_us else None

    def admission_wait_ms(self) -> float | None:
        """Accepted -> admitted (KV + token budget obtained)."""
        return self._span_ms(self.accepted_us, self.admitted_us)

    def queue_wait_ms(self) -> float | None:
        """Queued -> ``infer()`` succeeded (the §9.1 queue deadline span)."""
        return self._span_ms(self.queued_us, self.submitted_us)

    def execution_ms(self) -> float | None:
        """Submitted -> completed (the §9.1 execution deadline span)."""
        return self._span_ms(self.submitted_us, self.completed_us)

    def total_ms(self) -> float | None:
        """Accepted -> completed."""
        return self._span_ms(self.accepted_us, self.completed_us)

    def spans_ms(self) -> tuple[float | None, float | None, float | None]:
        """(``admission_wait_ms()``, ``queue_wait_ms()``, ``total_ms()``) in one call: the
        server observes them once per job, on the decode burst's thread (issue 28)."""
        accepted, submitted = self.accepted_us, self.submitted_us
        admitted, queued, completed = self.admitted_us, self.queued_us, self.completed_us
        return ((admitted - accepted) / 1000.0 if accepted and admitted else None,
                (submitted - queued) / 1000.0 if queued and submitted else None,
                (completed - accepted) / 1000.0 if accepted and completed else None)

    def to_dict(self) -> dict[str, float | int | None]:
        out: dict[str, float | int | None] = attrs.asdict(self)
        out.update(admission_wait_ms=self.admission_wait_ms(), queue_wait_ms=self.queue_wait_ms(),
                   execution_ms=self.execution_ms(), total_ms=self.total_ms())
        return out


@attrs.frozen
class KvTxnRecord:
    """§7 ``KvReservation`` without its state: the KV-transaction chart owns the state.

    ``old_len <= target_len``; lengths are u32 and seq ids s32 (non-negative) as in the ABI.
    """

    seq_id: int = attrs.field(validator=_in_range(0, S32_MAX))
    old_len: int = attrs.field(validator=_in_range(0, U32_MAX))
    target_len: int = attrs.field(validator=_in_range(0, U32_MAX))
    generation_id: int = attrs.field(validator=_in_range(0, U64_MAX))

    def __attrs_post_init__(self) -> None:
        if self.target_len < self.old_len:
            raise FieldError(f"KvTxnRecord(seq_id={self.seq_id})", "target_len", self.target_len,
                             f"must be >= old_len={self.old_len}")

    @property
    def token_count(self) -> int:
        return self.target_len - self.old_len
