"""Stop 75 (perf, issue 28): the plain request's event-loop work made cheaper on its one path,
each change a claim of equality that these tests pin where the suite did not.

* ``SamplingParams`` checks its fields in ``__attrs_post_init__``, asking a field's validator
  only where a cheap test (a float or an int in range, an empty tuple, None where null is
  allowed) does not take the value, where thirteen attrs validators ran for every request.
  A differential against the attrs-validated class it replaced (:class:`_Reference`, its
  validators as they were at stop 74) over generated parameter sets, good and bad, every
  field and every kind of value a caller can pass: the same parameters, or the same error
  (type, field, value and message).
* ``release_sequence`` tests its arguments fully only where a plain int id in range and a
  finite float wait >= 0 are not given (``SequenceOwnership``), and the executor's refusal of
  a waiting release on a worker thread tests a float wait without the ABC's ``isinstance``:
  a differential of the answers against the full tests (stop 74's ``_argument_refusal``)
  over generated ids and waits, and the worker-thread refusal of each kind of wait on the
  completion thread against stop 74's predicate.
* ``wire.utf8_json`` does not ask ``json.detect_encoding`` of a body opening with ``{`` and
  no NUL in its first two bytes: a differential against the function it was over generated
  bodies (BOMs, NULs, UTF-16 and UTF-32 text, invalid UTF-8, every length near the
  detector's 2 and 4).
"""

from __future__ import annotations

import fractions
import json
import math
import numbers
import operator
import threading
from collections.abc import Iterable, Sized
from decimal import Decimal
from typing import Any

import attrs
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calexec.contracts import fields
from calexec.contracts.errors import Category
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import S32_MAX
from calexec.drivers.serving import sampling, wire
from calexec.drivers.serving.sampling import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    PENALTY_RANGE,
    SEED_MAX,
    SEED_MIN,
    SamplingError,
    SamplingParams,
)
from calexec.machines.job import InferenceResult
from calexec.machines.sequences import SequenceOwnership
from executor_harness import deadline, prefill, running_job_path, write_calbin

# ---- the reference: SamplingParams' validation as it was at stop 74 (attrs validators) ------
_NUMBERS = (int, float, np.integer, np.floating)


def _check(field: str, ok: bool, value: Any, why: str) -> None:
    if not ok:
        raise SamplingError(field, value, why)


def _check_count(field: str, value: Sized, limit: int, what: str) -> None:
    if len(value) > limit:
        raise SamplingError(field, value, f"at most {limit} {what}", count=len(value))


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBERS) and not isinstance(value, bool)


def _validate_temperature(_inst: Any, _attr: Any, value: float) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and 0.0 <= value <= 2.0):
        raise SamplingError("temperature", value, "must be a number in [0, 2]")


def _validate_top_p(_inst: Any, _attr: Any, value: float) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and 0.0 < value <= 1.0):
        raise SamplingError("top_p", value, "must be a number in (0, 1]")


def _validate_top_k(_inst: Any, _attr: Any, value: int) -> None:
    if not (fields.is_int(value) and (value >= 1 or value in (0, -1))):
        raise SamplingError("top_k", value, "must be an integer >= 1, or 0 / -1 for all tokens")


def _validate_seed(_inst: Any, _attr: Any, value: int | None) -> None:
    if not (value is None or (fields.is_int(value) and SEED_MIN <= value <= SEED_MAX)):
        raise SamplingError("seed", value, f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")


def _validate_stop(_inst: Any, _attr: Any, value: tuple[str, ...]) -> None:
    _check_count("stop", value, MAX_STOP_STRINGS, "stop strings")
    for i, s in enumerate(value):
        _check(f"stop[{i}]", isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS, s,
               f"must be a non-empty string of at most {MAX_STOP_CHARS} characters")


def _validate_stop_ids(_inst: Any, _attr: Any, value: tuple[int, ...]) -> None:
    _check_count("stop_token_ids", value, MAX_STOP_TOKEN_IDS, "ids")
    for i, t in enumerate(value):
        _check(f"stop_token_ids[{i}]", fields.is_token_id(t), t, "must be an integer >= 0")


def _validate_min_p(_inst: Any, _attr: Any, value: float) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise SamplingError("min_p", value, "must be a number in [0, 1]")


def _validate_repetition(_inst: Any, _attr: Any, value: float) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0.0):
        raise SamplingError("repetition_penalty", value, "must be a number > 0 (1 = off)")


def _validate_penalty(_inst: Any, attr: Any, value: float) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE):
        raise SamplingError(attr.name, value,
                            f"must be a number in [{-PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")


def _validate_logit_bias(_inst: Any, _attr: Any, value: tuple[tuple[int, float], ...]) -> None:
    _check_count("logit_bias", value, MAX_LOGIT_BIAS, "entries")
    for token, bias in value:
        _check(f"logit_bias[{fields.shown(token)}]", fields.is_token_id(token), token,
               "the key must be a token id >= 0")
        _check(f"logit_bias[{fields.shown(token)}]", _is_number(bias) and math.isfinite(bias)
               and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE, bias,
               f"must be a number in [{-LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")


def _validate_min_tokens(_inst: Any, _attr: Any, value: int) -> None:
    if not (fields.is_int(value) and value >= 0):
        raise SamplingError("min_tokens", value, "must be an integer >= 0")


def _validate_allowed(_inst: Any, _attr: Any, value: tuple[int, ...] | None) -> None:
    if value is None:
        return
    _check("allowed_token_ids", len(value) > 0, list(value), "must not be empty (null: all)")
    for i, t in enumerate(value):
        _check(f"allowed_token_ids[{i}]", fields.is_token_id(t), t, "must be an integer >= 0")


def _to_ids(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _pair_tuple(value: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    return tuple(value)


def _validate_logprobs(_inst: Any, _attr: Any, value: int | None) -> None:
    if not (value is None or (fields.is_int(value) and 0 <= value <= MAX_LOGPROBS)):
        raise SamplingError("logprobs", value, f"must be null or an integer in [0, {MAX_LOGPROBS}]")


@attrs.frozen
class _Reference:
    """``SamplingParams`` at stop 74: the same fields, each checked by its attrs validator."""

    temperature: float = attrs.field(default=0.0, validator=_validate_temperature)
    top_p: float = attrs.field(default=1.0, validator=_validate_top_p)
    top_k: int = attrs.field(default=-1, validator=_validate_top_k)
    seed: int | None = attrs.field(default=None, validator=_validate_seed)
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple,
                                        validator=_validate_stop)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple,
                                                  validator=_validate_stop_ids)
    logprobs: int | None = attrs.field(default=None, validator=_validate_logprobs)
    min_p: float = attrs.field(default=0.0, validator=_validate_min_p)
    repetition_penalty: float = attrs.field(default=1.0, validator=_validate_repetition)
    presence_penalty: float = attrs.field(default=0.0, validator=_validate_penalty)
    frequency_penalty: float = attrs.field(default=0.0, validator=_validate_penalty)
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=_pair_tuple, validator=_validate_logit_bias)
    min_tokens: int = attrs.field(default=0, validator=_validate_min_tokens)
    end_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_to_ids,
                                                            validator=_validate_allowed)
    grammar: Any = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.min_tokens > 0 and self.allowed_token_ids is not None:
            held = {*self.end_token_ids, *self.stop_token_ids}
            _check("min_tokens", not held.issuperset(self.allowed_token_ids), self.min_tokens,
                   f"every token of allowed_token_ids {list(self.allowed_token_ids)[:16]} is "
                   "an end or stop token, which min_tokens holds back: no token could be "
                   "chosen before min_tokens")


# ---- generated parameter sets -----------------------------------------------------------------
def _numbers(bounds: Iterable[float]) -> st.SearchStrategy[Any]:
    """Numbers at and around ``bounds``, of every type a caller may pass, with the values
    every number field refuses (NaN, the infinities, a bool, a str, None) and numbers of
    types no field takes (Decimal, Fraction)."""
    edges: list[Any] = []
    for b in bounds:
        edges += [b, float(b), math.nextafter(float(b), math.inf),
                  math.nextafter(float(b), -math.inf), np.float32(b), np.float64(b)]
        if float(b).is_integer():
            edges += [int(b), int(b) + 1, int(b) - 1, np.int8(int(b) % 100)]
            edges += [np.int64(int(b))] if abs(b) < 2 ** 63 else []
    edges += [-0.0, 0.0, 0.5, 1, 1.0, False, np.True_, Decimal("0.5"),
              fractions.Fraction(1, 2), 10 ** 400, -(10 ** 400), np.float32(np.nan),
              np.float16(1.0), np.float64(math.inf), np.float32(-math.inf)]
    return st.one_of(st.sampled_from([math.nan, math.inf, -math.inf, True, None, "1"]),
                     st.sampled_from(edges), st.floats(), st.integers(-5, 5))


def _ints(bounds: Iterable[int]) -> st.SearchStrategy[Any]:
    edges: list[Any] = []
    for b in bounds:
        edges += [b, b - 1, b + 1, float(b), np.int64(b) if -2 ** 63 <= b < 2 ** 63 else b,
                  np.uint64(b) if 0 <= b < 2 ** 64 else b]
    edges += [True, False, np.True_, None, "3", 1.5, math.nan, Decimal(3),
              fractions.Fraction(3, 1), 10 ** 400]
    return st.one_of(st.sampled_from(edges), st.integers(-3, 30))


_ID = st.one_of(st.integers(-2, 6), st.sampled_from([True, 1.0, "1", None, np.int32(2),
                                                     np.uint8(3), 2 ** 70]))
_STOP = st.one_of(st.text(max_size=3), st.sampled_from(["", "x" * MAX_STOP_CHARS,
                                                         "x" * (MAX_STOP_CHARS + 1), 5,
                                                         None, b"ab"]))
_BIAS = st.one_of(st.floats(), st.sampled_from([100, -100, 100.0, 101, -100.5, True,
                                                np.float32(99.5), "1", None, math.nan]))


def _list(item: st.SearchStrategy[Any], limit: int) -> st.SearchStrategy[Any]:
    """A list of ``item`` (empty, short or one past ``limit``), or a value that is no list."""
    return st.one_of(st.just([]), st.lists(item, max_size=4),
                     st.lists(item, min_size=limit, max_size=limit + 1),
                     st.sampled_from([(), "ab", None, 5]))


_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "temperature": _numbers([0.0, 2.0, 1.0]),
    "top_p": _numbers([0.0, 1.0, 1e-9]),
    "top_k": _ints([-1, 0, 1, -2, 50]),
    "seed": _ints([SEED_MIN, SEED_MAX, 0]),
    "stop": _list(_STOP, MAX_STOP_STRINGS),
    "stop_token_ids": _list(_ID, MAX_STOP_TOKEN_IDS),
    "logprobs": _ints([0, MAX_LOGPROBS]),
    "min_p": _numbers([0.0, 1.0]),
    "repetition_penalty": _numbers([0.0, 1.0, 1e30]),
    "presence_penalty": _numbers([-PENALTY_RANGE, PENALTY_RANGE]),
    "frequency_penalty": _numbers([-PENALTY_RANGE, PENALTY_RANGE]),
    "logit_bias": st.one_of(
        _list(st.tuples(_ID, _BIAS), MAX_LOGIT_BIAS),
        st.sampled_from([[(1,)], [(1, 2.0, 3)], [5], [(2, 1.0), "ab"]])),
    "min_tokens": _ints([0, 1, 3]),
    "end_token_ids": st.one_of(st.lists(st.integers(0, 6), max_size=2),
                               st.sampled_from([None, 7])),
    "ignore_eos": st.sampled_from([True, False, None, 1]),
    "include_stop_str_in_output": st.sampled_from([True, False, "no"]),
    "allowed_token_ids": st.one_of(st.none(), _list(_ID, 3)),
}


def _floats(low: float, high: float) -> st.SearchStrategy[Any]:
    """Numbers a field in [low, high] takes, of the types a caller passes."""
    return st.one_of(st.floats(low, high), st.sampled_from([low, high]),
                     st.floats(low, high).map(np.float64), st.integers(math.ceil(low),
                                                                        math.floor(high)))


#: values each field takes (the server's usual ones and others): a parameter set has mostly
#: these, and one or two fields from ``_FIELDS``, so that a late field's refusal is reached
_GOOD: dict[str, st.SearchStrategy[Any]] = {
    "temperature": _floats(0.0, 2.0),
    "top_p": _floats(1e-9, 1.0),
    "top_k": st.one_of(st.integers(-1, 100), st.just(np.int64(5))),
    "seed": st.one_of(st.none(), st.integers(SEED_MIN, SEED_MAX)),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 6), max_size=2),
    "logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
    "min_p": _floats(0.0, 1.0),
    "repetition_penalty": st.one_of(_floats(1e-9, 3.0), st.just(1e300)),
    "presence_penalty": _floats(-PENALTY_RANGE, PENALTY_RANGE),
    "frequency_penalty": _floats(-PENALTY_RANGE, PENALTY_RANGE),
    "logit_bias": st.lists(st.tuples(st.integers(0, 6), _floats(-100.0, 100.0)), max_size=2),
    "min_tokens": st.integers(0, 3),
    "end_token_ids": st.lists(st.integers(0, 6), max_size=2),
    "ignore_eos": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "allowed_token_ids": st.one_of(st.none(), st.lists(st.integers(0, 6), min_size=1,
                                                       max_size=3)),
}


@st.composite
def _param_sets(draw: st.DrawFn) -> dict[str, Any]:
    """Any subset of the fields, each a value it takes but for at most two (``wild``), drawn
    from every kind of value (``_FIELDS``)."""
    wild = set(draw(st.lists(st.sampled_from(sorted(_FIELDS)), max_size=2)))
    names = wild | set(draw(st.lists(st.sampled_from(sorted(_FIELDS)))))
    return {name: draw(_FIELDS[name] if name in wild else _GOOD[name])
            for name in sorted(names)}


def _outcome(cls: type, given_fields: dict[str, Any]) -> tuple[Any, ...]:
    """What constructing ``cls`` from ``given_fields`` answers: its fields' values, or the
    error's type, message, field and value (a NaN and a numpy scalar compared by repr and
    type)."""
    try:
        built = cls(**given_fields)
    except SamplingError as err:
        return ("refused", type(err).__name__, str(err), err.field, type(err.value),
                repr(err.value))
    except Exception as err:  # noqa: BLE001  (a converter's TypeError, an unpacking's error)
        return ("raised", type(err).__name__, str(err))
    values = [getattr(built, a.name) for a in attrs.fields(cls)]
    return ("built", [(type(v), repr(v)) for v in values])


@settings(max_examples=1000, deadline=None)
@given(chosen=_param_sets())
def test_sampling_params_answer_as_the_attrs_validators_answered(chosen):
    """Differential (``SamplingParams.__attrs_post_init__`` asks a field's validator only
    where its cheap test fails, since stop 75): for generated parameter sets with any subset
    of the fields given, good and bad values of every type, the new class and the attrs
    validators' (:class:`_Reference`) build the same parameters or refuse with the same
    first error."""
    assert [a.name for a in attrs.fields(SamplingParams)] == \
        [a.name for a in attrs.fields(_Reference)]
    assert _outcome(SamplingParams, chosen) == _outcome(_Reference, chosen)


@pytest.mark.parametrize("name", sorted(_FIELDS))
@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_each_field_alone_answers_as_its_attrs_validator_answered(name, data):
    """Differential, one field at a time (the others their defaults): every kind of value of
    the field, the same parameters or the same error as :class:`_Reference`."""
    chosen = {name: data.draw(_FIELDS[name])}
    assert _outcome(SamplingParams, chosen) == _outcome(_Reference, chosen)


def test_the_differential_meets_every_fields_refusal_and_the_post_init_check():
    """The differential is not vacuous: one refused value of each checked field, and the
    min_tokens check after them, answer as the reference (first field refused first)."""
    bad: dict[str, Any] = {
        "temperature": math.inf, "top_p": 0.0, "top_k": -2, "seed": SEED_MAX + 1,
        "stop": [""], "stop_token_ids": [-1], "logprobs": MAX_LOGPROBS + 1, "min_p": 1.5,
        "repetition_penalty": math.inf, "presence_penalty": 2.5, "frequency_penalty": -2.5,
        "logit_bias": [(1, 101.0)], "min_tokens": -1, "allowed_token_ids": []}
    names = list(bad)
    for i, name in enumerate(names):
        # every later field bad too: the first is the one named
        chosen = {n: bad[n] for n in names[i:]}
        got = _outcome(SamplingParams, chosen)
        assert got == _outcome(_Reference, chosen)
        assert got[0] == "refused" and got[3].split("[")[0] == name, got
    chosen = {"min_tokens": 2, "allowed_token_ids": [3], "end_token_ids": [3]}
    got = _outcome(SamplingParams, chosen)
    assert got == _outcome(_Reference, chosen) and got[3] == "min_tokens"
    # the values only a validator's full test refuses past a cheap test's type: a float
    # subclass (numpy's float64) at inf, an int subclass (a bool)
    for name, value in (("repetition_penalty", np.float64(math.inf)), ("top_k", True),
                        ("seed", False), ("min_tokens", np.True_), ("logprobs", True)):
        assert _outcome(SamplingParams, {name: value}) == _outcome(_Reference, {name: value})
        assert _outcome(SamplingParams, {name: value})[0] == "refused"


def test_a_request_s_parameters_are_built_as_before():
    """The parameters the server builds for a plain request (floats from ``as_float``, the
    seed drawn, tuples of the body's lists) are the reference's."""
    chosen = {"temperature": 0.0, "top_p": 1.0, "top_k": -1, "seed": sampling.draw_seed(),
              "stop": [], "stop_token_ids": [], "logprobs": None, "min_p": 0.0,
              "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
              "logit_bias": (), "min_tokens": 0, "end_token_ids": (3,), "ignore_eos": False,
              "allowed_token_ids": None, "include_stop_str_in_output": False}
    assert _outcome(SamplingParams, chosen) == _outcome(_Reference, chosen)
    assert _outcome(SamplingParams, chosen)[0] == "built"


# ---- release_sequence's arguments ----------------------------------------------------------------
def _reference_argument_refusal(seq_id: object, wait_s: object) -> Status | None:
    """``machines.sequences._argument_refusal`` at stop 74, asked of every release."""
    try:
        index = None if isinstance(seq_id, bool) else operator.index(seq_id)  # type: ignore[arg-type]
    except TypeError:
        index = None
    if index is None or not 0 <= index <= S32_MAX:
        return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE,
                              f"release_sequence: seq_id={seq_id!r}: expected a sequence id, "
                              f"an int in 0..{S32_MAX}")
    if isinstance(wait_s, bool) or not isinstance(wait_s, numbers.Real) or not math.isfinite(
            fields.to_float(wait_s)) or wait_s < 0:
        return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE,
                              f"release_sequence: wait_s={wait_s!r}: expected a finite number of "
                              "seconds >= 0 (0: no wait)", seq_id=index)
    return None


class _NoGeneration(SequenceOwnership):
    """An owner between generations: a release whose arguments pass answers OK."""

    gen = None


_SEQ_IDS = st.one_of(st.integers(-3, 10), st.sampled_from(
    [S32_MAX, S32_MAX + 1, -S32_MAX, 2 ** 70, True, False, 1.0, "1", None, np.int64(3),
     np.uint32(S32_MAX), np.int8(-1), np.bool_(True)]))
_WAITS = st.one_of(st.floats(), st.integers(-3, 3), st.sampled_from(
    [0.0, -0.0, 1e-300, 1e308, math.inf, -math.inf, math.nan, 0, True, False, 10 ** 400,
     "1", None, np.float32(0.1), np.float64(math.nan), np.int64(2), Decimal("1"),
     fractions.Fraction(1, 2)]))


def _answer(status: Status) -> tuple[Any, ...]:
    return (status.code, status.category, status.phase, status.message, repr(status))


@settings(max_examples=600, deadline=None)
@given(seq_id=_SEQ_IDS, wait_s=_WAITS)
def test_release_arguments_answer_as_the_full_test_answered(seq_id, wait_s):
    """Differential (``SequenceOwnership.release_sequence`` asks ``_argument_refusal`` only
    off its fast path, since stop 75): for generated ids and waits, the release of an owner
    between generations answers the full test's refusal, or OK where it took them."""
    expected = _reference_argument_refusal(seq_id, wait_s)
    got = _NoGeneration().release_sequence(seq_id, wait_s)
    assert _answer(got) == _answer(Status.OK if expected is None else expected)


def _reference_refuses_on_worker(wait_s: object) -> bool:
    """``DeviceExecutor.release_sequence``'s test at stop 74: a release that would wait,
    refused on a worker thread."""
    return isinstance(wait_s, numbers.Real) and not isinstance(wait_s, bool) and wait_s > 0


def test_a_worker_thread_s_release_is_refused_for_the_waits_it_was_refused_for(tmp_path):
    """``DeviceExecutor.release_sequence`` on the completion thread (a done callback): each
    kind of wait is refused with the RuntimeError, or answered, as stop 74's test of it
    decided (a float tested without the ABC's ``isinstance`` since stop 75)."""
    waits: list[Any] = [0.5, 0.0, -0.0, -1.0, math.nan, math.inf, 1e-300, 1, 0, True, False,
                        np.float32(0.5), np.float64(0.0), "1", None]
    seen: dict[Any, Any] = {}
    with running_job_path(write_calbin(tmp_path)) as ex:
        done = threading.Event()

        def on_done(handle: Any) -> None:  # calexec-completion
            seen["thread"] = threading.current_thread().name
            try:
                for i, wait_s in enumerate(waits):
                    try:
                        seen[i] = ex.release_sequence(5, wait_s)
                    except RuntimeError as exc:
                        seen[i] = exc
            finally:
                done.set()

        # the job is held on the stepped device until its callback is in place, so that the
        # callback runs on calexec-completion (not on this thread, for a job already done)
        emu = ex.device.emu
        assert emu.set_stepped(True) == 0
        try:
            handle = ex.enqueue(prefill(1, [1, 2, 3]))
            handle.add_done_callback(on_done)
        finally:
            assert emu.set_stepped(False) == 0
        assert isinstance(handle.wait_until(deadline()), InferenceResult)
        assert done.wait(30.0)
    assert seen["thread"] == "calexec-completion", seen["thread"]
    for i, wait_s in enumerate(waits):
        refused = isinstance(seen[i], RuntimeError)
        assert refused == _reference_refuses_on_worker(wait_s), (wait_s, seen[i])
        if refused:
            assert "release_sequence" in str(seen[i]) and "calexec-completion" in str(seen[i])
        else:
            assert isinstance(seen[i], Status), (wait_s, seen[i])


# ---- a body's encoding -----------------------------------------------------------------------------
def _reference_utf8_json(raw: bytes) -> bytes | str:
    """``wire.utf8_json`` at stop 74: ``json.detect_encoding`` asked of every body."""
    if raw.startswith(b"\xef\xbb\xbf"):
        return raw[3:]
    encoding = json.detect_encoding(raw)
    if encoding != "utf-8":
        return (f"body: JSON must be UTF-8 (RFC 8259 section 8.1); this body is "
                f"{encoding.upper()}: send it encoded as UTF-8")
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as err:
        return (f"body: JSON must be UTF-8 (RFC 8259 section 8.1); byte {err.start} "
                f"(0x{raw[err.start]:02X}) is not UTF-8 (a Latin-1 or Windows-1252 body?): "
                "send it encoded as UTF-8")
    return raw


_HEADS = [b"", b"{", b"{\x00", b"\x00{", b"{{", b"\xef\xbb\xbf", b"\xff\xfe", b"\xfe\xff",
          b"\x00\x00\xfe\xff", b"\xff\xfe\x00\x00", b"[", b" {", b"\xe9", b"{\xe9"]
_BODIES = st.one_of(
    st.builds(lambda head, tail: head + tail, st.sampled_from(_HEADS), st.binary(max_size=6)),
    st.sampled_from(["utf-8", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le",
                     "utf-32-be", "latin-1"]).flatmap(
        lambda codec: st.text(alphabet="{}\"a1é ", max_size=5).map(
            lambda text: text.encode(codec))),
    st.binary(max_size=8))


@settings(max_examples=1500, deadline=None)
@given(raw=_BODIES)
def test_a_body_s_encoding_is_judged_as_detect_encoding_judged_it(raw):
    """Differential (``wire.utf8_json`` takes a body opening with ``{`` and no NUL in its
    first two bytes as UTF-8 without ``json.detect_encoding``, since stop 75): the same
    body or the same refusal for generated bodies, bytes and bytearrays."""
    assert wire.utf8_json(raw) == _reference_utf8_json(raw)
    assert wire.utf8_json(bytearray(raw)) == _reference_utf8_json(bytearray(raw))
