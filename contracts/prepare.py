"""Spec §6.3 ``prepare_job()`` steps 1-6 as pure validators, in the spec's order.

``check_request(req, gen)`` returns ``Status.OK`` or the FIRST failing step as
``Status.invalid(step=N, ...)`` (category INVALID_REQUEST, HTTP 400), naming the field and value.
No runtime call happens before it passes. Steps 7 (``SetCsrByName``) and 8 (``MapBuf`` /
``SliceTensor``) need the driver; the executor reports them with ``Status.from_csr``,
``Status.from_map`` and ``Status.from_slice``, and checks every slice it is about to request with
:func:`check_slice` first (FI03).

Steps 2-3 need the submodel's limits, so a request whose kind has no submodel in the generation
is reported as step 5 as soon as step 1 has passed.

Request layout: one sequence per request. ``tokens`` is int32 ``[n]`` (ids kinds),
``embeddings`` is BF16 bits as uint16 ``[n, hidden]`` (embedding kinds), ``positions`` int32
``[n]``; ``n`` (``token_count``) is the number of positions. Each array is the request's row of
a ``[max_batch, seq, ...]`` tensor: its rank is the tensor's minus one, its first dimension fits
the tensor's ``seq`` (equals it when the tensor is not sliceable) and the rest match exactly.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterator, Sequence
from typing import SupportsFloat, SupportsIndex

import attrs
import numpy as np

from calexec.contracts import fields
from calexec.contracts.status import Status
from calexec.contracts.types import (
    S32_MAX,
    U32_MAX,
    ModelGeneration,
    SubmodelContract,
    TaskKind,
    TensorContract,
)


def slice_bounds_ok(offset: int, size: int, limit: int) -> bool:
    """True iff ``[offset, offset + size)`` lies inside ``[0, limit)`` for u64 operands.

    Written as ``offset <= limit and size <= limit - offset`` so that fixed-width (C, numpy
    uint64) arithmetic never computes the overflowing ``offset + size``.
    """
    return 0 <= offset <= limit and 0 <= size <= limit - offset


def logits_slice_ok(base: int, n: int, size: int) -> bool:
    """§10.1 bound for converting ``n`` logits from ``base`` of a ``size``-element tensor:
    ``base <= size and n <= size - base`` (the same rule as :func:`slice_bounds_ok`)."""
    return slice_bounds_ok(base, n, size)


def valid_logits_row(token_count: int, tile_d0: int) -> int:
    """Row of the prefill output tile holding the last token's logits (S09): ``(n - 1) % D0``.

    ``tile_d0`` is the graph metadata's ``logits_tile_d0`` from the manifest. Raises
    ``ValueError`` for ``token_count < 1`` or ``tile_d0 < 1`` (caller bug: step 1 guarantees n >= 1).
    """
    if token_count < 1 or tile_d0 < 1:
        raise ValueError(f"valid_logits_row: token_count={token_count} and tile_d0={tile_d0} must be >= 1")
    return (token_count - 1) % tile_d0


def _index(field: str, value: object) -> int:
    """``operator.index(value)``; a TypeError names the field and the value (a newcomer's
    ``past_len=1.0`` or ``seq_id="3"`` says which argument it was). A bool is no int here:
    ``seq_id=True`` was sequence 1, another request's KV."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)  # type: ignore[arg-type]  # checked: TypeError below
    except TypeError:
        raise TypeError(f"InferenceRequest.{field}={value!r}: expected an int, got "
                        f"{type(value).__name__}") from None


def _seq_ids(value: SupportsIndex | tuple[SupportsIndex, ...] | list[SupportsIndex]
             ) -> tuple[int, ...]:
    if isinstance(value, (tuple, list)):
        return tuple(_index("seq_id", v) for v in value)
    return (_index("seq_id", value),)


def _kind(value: int) -> TaskKind:
    try:
        return TaskKind(value)
    except ValueError:
        members = ", ".join(f"TaskKind.{k.name} ({k.value})" for k in TaskKind)
        named = (f": write TaskKind.{value.upper()}, the member, not its name"
                 if isinstance(value, str) and value.upper() in TaskKind.__members__ else "")
        raise ValueError(f"InferenceRequest.kind={value!r}: not a TaskKind{named} (one of "
                         f"{members})") from None


def _past_len(value: SupportsIndex) -> int:
    return _index("past_len", value)


def _request_id(value: SupportsIndex) -> int:
    return _index("request_id", value)


def _kv_reserve_len(value: SupportsIndex | None) -> int | None:
    return None if value is None else _index("kv_reserve_len", value)


def _deadline(value: SupportsFloat) -> float:
    """An absolute ``time.monotonic()`` value (None is no deadline here: pass one). A bool
    is no time, as it is no int for the other fields (and no seconds for a handle's waits):
    ``deadline=True`` was 1.0, a deadline long past, answered ``admission.deadline``."""
    if isinstance(value, (str, bytes, bool, np.bool_)):  # float("3") would parse it: refuse
        raise TypeError(f"InferenceRequest.deadline={value!r}: expected an absolute "
                        f"time.monotonic() value (a float), got {type(value).__name__}")
    try:
        return fields.to_float(value)  # an int beyond any float: an infinity (request.invalid)
    except (TypeError, ValueError):
        raise TypeError(f"InferenceRequest.deadline={value!r}: expected an absolute "
                        f"time.monotonic() value (a float), got {type(value).__name__}"
                        ) from None


def _optional_array(instance: object, attribute: attrs.Attribute[np.ndarray | None],
                    value: object) -> None:
    if value is not None and not isinstance(value, np.ndarray):
        raise TypeError(f"InferenceRequest.{attribute.name}: expected numpy.ndarray or None, "
                        f"got {type(value).__name__}")


def _optional_range(value: Sequence[SupportsIndex] | None) -> tuple[int, int] | None:
    if value is None:
        return None
    if not isinstance(value, Sequence) or len(value) != 2:
        raise TypeError(f"InferenceRequest.want_logits={value!r}: expected (base, count) "
                        "or None")
    return (_index("want_logits", value[0]), _index("want_logits", value[1]))


@attrs.frozen(eq=False)
class InferenceRequest:
    """One sequence's prefill or decode request, as built from a llama batch (§6.1).

    Construction only normalises types; every range and consistency rule is checked by
    :func:`check_request` so the failing §6.3 step is reported. ``seq_id`` accepts an int or
    several ids (a batch naming more than one sequence; refused by step 3). ``deadline`` is an
    absolute ``time.monotonic()`` value. ``want_logits`` is the ``(base, count)`` vocab range to
    return; None means the whole vocabulary of the generation. The arrays must not be mutated
    after the request is handed to the executor.
    """

    seq_ids: tuple[int, ...] = attrs.field(alias="seq_id", converter=_seq_ids)
    kind: TaskKind = attrs.field(converter=_kind)
    positions: np.ndarray | None = attrs.field(validator=_optional_array)
    past_len: int = attrs.field(converter=_past_len)
    deadline: float = attrs.field(converter=_deadline)
    tokens: np.ndarray | None = attrs.field(default=None, validator=_optional_array)
    embeddings: np.ndarray | None = attrs.field(default=None, validator=_optional_array)
    want_logits: tuple[int, int] | None = attrs.field(default=None, converter=_optional_range)
    request_id: int = attrs.field(default=0, converter=_request_id)
    #: KV tokens the whole request needs to finish (prompt + max new tokens): the prefill
    #: reserves them up front, all or nothing (§7, no hold and wait); None: this job's only.
    kv_reserve_len: int | None = attrs.field(
        default=None, converter=_kv_reserve_len,
        validator=attrs.validators.optional(attrs.validators.ge(0)))

    @property
    def seq_id(self) -> int:
        """The request's sequence (the first id; step 3 guarantees there is exactly one).
        -1 for a request naming none (``seq_id=[]``), which step 3 refuses (``seq_count=0``):
        the job refused for it still names a sequence in its Status and trail, as a job
        refused for no request at all does. (It raised IndexError out of ``enqueue``.)"""
        return self.seq_ids[0] if self.seq_ids else -1

    @property
    def primary(self) -> np.ndarray | None:
        """The array for the submodel's first input: embeddings or tokens, by kind."""
        return self.embeddings if self.kind.takes_embeddings else self.tokens

    @property
    def primary_name(self) -> str:
        return "embeddings" if self.kind.takes_embeddings else "tokens"

    _token_count: int = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        arr = self.positions if self.positions is not None else self.primary
        object.__setattr__(self, "_token_count", 0 if arr is None else _rows(arr))

    @property
    def token_count(self) -> int:
        """Number of positions (else of the first input's rows; 0 when both are missing);
        computed once at construction (the arrays must not change afterwards)."""
        return self._token_count

    def logits_range(self, vocab_size: int) -> tuple[int, int]:
        """``(base, count)`` of logits to return, resolving None to the whole vocabulary."""
        return self.want_logits if self.want_logits is not None else (0, vocab_size)


def _rows(arr: np.ndarray) -> int:
    return int(arr.shape[0]) if arr.ndim else 1


@attrs.frozen
class TensorSlice:
    """A ``SliceTensor`` request: ``size`` bytes from byte ``offset`` of input ``tensor``."""

    tensor: str
    offset: int
    size: int


def check_slice(contract: TensorContract, offset: int, size: int) -> Status:
    """Step 6 for one slice the executor is about to request (FI03: ByteSize + 1 is refused)."""
    if not contract.sliceable:
        return Status.invalid(6, f"tensor {contract.name!r} is not sliceable (offset={offset}, size={size})")
    if not slice_bounds_ok(offset, size, contract.byte_size):
        return Status.invalid(
            6, f"slice of tensor {contract.name!r} offset={offset} size={size} exceeds byte_size={contract.byte_size}"
        )
    return Status.OK


def plan_slices(req: InferenceRequest, sub: SubmodelContract) -> tuple[TensorSlice, ...]:
    """The slices covering the request's ``token_count`` rows of each sliceable input."""
    n = req.token_count
    return tuple(
        TensorSlice(t.name, 0, n * t.row_bytes) for t in (sub.token_or_embed, sub.position) if t.sliceable
    )


def _step2_widths(req: InferenceRequest, sub: SubmodelContract) -> Status:
    n, past = req.token_count, req.past_len
    if not 0 <= past <= U32_MAX:
        return Status.invalid(2, f"past_len={past} does not fit u32")
    if n > U32_MAX:
        return Status.invalid(2, f"token_count={n} does not fit u32")
    bad_seq = [s for s in req.seq_ids if not 0 <= s <= S32_MAX]
    if bad_seq:
        return Status.invalid(2, f"seq_id={bad_seq[0]} does not fit a non-negative s32")
    total = past + n  # Python int: exact; compared with the u32 range before any C sees it.
    if total > U32_MAX:
        return Status.invalid(2, f"past_len={past} + token_count={n} = {total} overflows u32")
    # max_seq <= S32_MAX (SubmodelContract), so passing this also keeps every position in s32.
    if total > sub.max_seq:
        return Status.invalid(2, f"past_len={past} + token_count={n} = {total} > max_seq={sub.max_seq}")
    if req.kv_reserve_len is not None and req.kv_reserve_len > sub.max_seq:
        return Status.invalid(2, f"kv_reserve_len={req.kv_reserve_len} > max_seq={sub.max_seq}")
    return Status.OK


def _step4_presence(req: InferenceRequest, hidden_size: int) -> Status:
    name, primary, n = req.primary_name, req.primary, req.token_count
    if primary is None:
        return Status.invalid(4, f"{name} is None for kind={req.kind.name}")
    if req.positions is None:
        return Status.invalid(4, "positions is None")
    if req.kind.takes_embeddings:
        if primary.size != n * hidden_size:
            return Status.invalid(
                4, f"embeddings has {primary.size} elements, expected token_count={n} x hidden_size={hidden_size}"
            )
    elif _rows(primary) != n:
        return Status.invalid(4, f"len(tokens)={_rows(primary)} != len(positions)={n}")
    return Status.OK


def _step5_contract(arr: np.ndarray, field: str, contract: TensorContract) -> Status:
    if arr.dtype != contract.dtype.host_dtype:
        return Status.invalid(
            5, f"{field}.dtype={arr.dtype} but tensor {contract.name!r} is {contract.dtype.value} "
            f"(host {contract.dtype.host_dtype})"
        )
    if arr.ndim != contract.rank - 1:
        return Status.invalid(
            5, f"{field} has rank {arr.ndim}, tensor {contract.name!r} {list(contract.shape)} needs {contract.rank - 1}"
        )
    rows, seq = _rows(arr), contract.shape[1]
    fits = rows == seq if not contract.sliceable else rows <= seq
    if not fits or tuple(arr.shape[1:]) != contract.shape[2:]:
        need = "exactly" if not contract.sliceable else "at most"
        return Status.invalid(
            5, f"{field}.shape={list(arr.shape)} does not fit tensor {contract.name!r} {list(contract.shape)} "
            f"({need} {seq} rows of {list(contract.shape[2:])})"
        )
    return Status.OK


def _step6_ranges(req: InferenceRequest, primary: np.ndarray, positions: np.ndarray,
                  sub: SubmodelContract, vocab_size: int) -> Status:
    """``primary`` and ``positions``: the request's arrays, present (step 4 passed)."""
    for arr, field, contract in ((primary, req.primary_name, sub.token_or_embed),
                                 (positions, "positions", sub.position)):
        if arr.nbytes > contract.byte_size:
            return Status.invalid(6, f"{field} is {arr.nbytes} bytes > tensor {contract.name!r} "
                                     f"byte_size={contract.byte_size}")
    contracts = {sub.token_or_embed.name: sub.token_or_embed, sub.position.name: sub.position}
    for piece in plan_slices(req, sub):
        status = check_slice(contracts[piece.tensor], piece.offset, piece.size)
        if not status.ok:
            return status
    if not req.kind.takes_embeddings:  # primary is the tokens
        i = _first_index(primary, lambda a: (a < 0) | (a >= vocab_size),
                         lambda v: not 0 <= v < vocab_size)
        if i is not None:
            return Status.invalid(6, f"tokens[{i}]={int(primary[i])} outside [0, vocab_size={vocab_size})")
    past = req.past_len
    if positions.shape[0] <= _SMALL:  # decode: plain ints beat numpy's per-call overhead
        i = next((k for k, v in enumerate(positions.tolist()) if v != past + k), None)
    else:
        expected = np.arange(past, past + positions.shape[0], dtype=np.int64)
        wrong = np.flatnonzero(positions.astype(np.int64) != expected)
        i = int(wrong[0]) if wrong.size else None
    if i is not None:
        return Status.invalid(6, f"positions[{i}]={int(positions[i])}, expected past_len + {i} = {past + i}")
    base, count = req.logits_range(vocab_size)
    if count < 1 or not logits_slice_ok(base, count, vocab_size):
        return Status.invalid(6, f"want_logits=(base={base}, count={count}) outside vocab_size={vocab_size}")
    return Status.OK


#: at or below this many elements, checks run on Python ints (numpy's per-call cost dominates)
_SMALL = 16


def _first_index(arr: np.ndarray, bad_mask: Callable[[np.ndarray], np.ndarray],
                 bad_value: Callable[[int], bool]) -> int | None:
    """Index of the first element failing a check, or None."""
    if arr.shape[0] <= _SMALL:
        return next((k for k, v in enumerate(arr.tolist()) if bad_value(v)), None)
    bad = np.flatnonzero(bad_mask(arr))
    return int(bad[0]) if bad.size else None


def check_request(req: InferenceRequest, gen: ModelGeneration) -> Status:
    """§6.3 steps 1-6 in order; ``Status.OK`` or the first failure, with seq/generation context."""
    ctx = {"seq_id": req.seq_ids[0] if len(req.seq_ids) == 1 else None, "generation": gen.generation_id}
    n = req.token_count
    if n <= 0:
        return Status.invalid(1, f"token_count={n}: must be > 0", **ctx)
    sub = gen.submodels.get(req.kind)
    if sub is None:
        return Status.invalid(5, f"kind={req.kind.name}: generation {gen.generation_id} has no exact submodel "
                                 f"(has {sorted(k.name for k in gen.submodels)})", **ctx)
    for status in _checks(req, sub, gen):
        if not status.ok:
            return status.with_context(**ctx)
    return Status.OK


def _checks(req: InferenceRequest, sub: SubmodelContract, gen: ModelGeneration
            ) -> Iterator[Status]:
    """Steps 2-6 lazily, so nothing after the first failure is evaluated."""
    yield _step2_widths(req, sub)
    if len(req.seq_ids) != 1:
        yield Status.invalid(3, f"seq_count={len(req.seq_ids)} (seq_ids={list(req.seq_ids)}): a request carries "
                                f"one sequence and max_batch={sub.max_batch}")
    yield _step4_presence(req, gen.hidden_size)
    primary, positions = req.primary, req.positions
    if primary is None or positions is None:  # step 4 refused it: never resumed past there
        return
    yield _step5_contract(primary, req.primary_name, sub.token_or_embed)
    yield _step5_contract(positions, "positions", sub.position)
    yield _step6_ranges(req, primary, positions, sub, gen.vocab_size)
