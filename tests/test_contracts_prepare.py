"""§6.3 prepare_job steps 1-6 with boundary values and order; §10.1 / slice bounds helpers."""

import warnings

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from calexec.contracts.errors import Category
from calexec.contracts.manifest import default_manifest_path, load_manifest
from calexec.contracts.prepare import (
    InferenceRequest,
    TensorSlice,
    check_request,
    check_slice,
    logits_slice_ok,
    plan_slices,
    slice_bounds_ok,
    valid_logits_row,
)
from calexec.contracts.types import ModelGeneration, TaskKind

MAX_SEQ, V, HIDDEN = 40960, 151936, 64  # the default manifest's values, asserted below


@pytest.fixture(scope="module")
def gen():
    m = load_manifest(default_manifest_path())
    g = ModelGeneration(7, "c" * 64, m.calrt_version, m.submodels, m.vocab_size, m.hidden_size)
    assert (g.vocab_size, g.hidden_size, g.submodels[TaskKind.PREFILL_IDS].max_seq) == (V, HIDDEN, MAX_SEQ)
    return g


def ids_request(n=5, past=0, kind=TaskKind.PREFILL_IDS, **changes):
    fields = dict(seq_id=3, kind=kind, past_len=past, deadline=1e9,
                  tokens=np.arange(n, dtype=np.int32) % V,
                  positions=np.arange(past, past + n, dtype=np.int64).astype(np.int32))
    fields.update(changes)
    return InferenceRequest(**fields)


def embeds_request(n=3, past=0, **changes):
    fields = dict(seq_id=3, kind=TaskKind.PREFILL_EMBEDS, past_len=past, deadline=1e9,
                  embeddings=np.zeros((n, HIDDEN), dtype=np.uint16),
                  positions=np.arange(past, past + n, dtype=np.int32))
    fields.update(changes)
    return InferenceRequest(**fields)


def assert_step(status, step, *fragments):
    assert not status.ok, "request accepted"
    assert (status.step, status.code, status.category) == (step, "request.invalid", Category.INVALID_REQUEST), status
    assert status.message.startswith(f"step {step}: ")
    for fragment in fragments:
        assert fragment in status.message, (fragment, status.message)


@pytest.mark.parametrize("request_factory", [
    lambda: ids_request(5),
    lambda: ids_request(1, past=100, kind=TaskKind.DECODE),
    lambda: embeds_request(3, past=10),
    lambda: ids_request(MAX_SEQ),  # exactly max_seq
    lambda: ids_request(1, past=MAX_SEQ - 1, kind=TaskKind.DECODE),  # decode of the last slot
    lambda: ids_request(2, tokens=np.array([0, V - 1], dtype=np.int32)),  # vocab edges
    lambda: ids_request(4, want_logits=(V - 1, 1)),
])
def test_valid_requests_pass(gen, request_factory):
    assert check_request(request_factory(), gen).ok


def test_failures_carry_seq_and_generation(gen):
    status = check_request(ids_request(MAX_SEQ + 1), gen)
    assert (status.seq_id, status.generation) == (3, 7)


def test_step1_token_count(gen):
    empty = np.zeros(0, dtype=np.int32)
    assert_step(check_request(ids_request(tokens=empty, positions=empty), gen), 1, "token_count=0")
    assert_step(check_request(ids_request(tokens=None, positions=None), gen), 1, "token_count=0")


@pytest.mark.parametrize(
    ("n", "past", "kind", "fragment"),
    [
        (MAX_SEQ + 1, 0, TaskKind.PREFILL_IDS, f"= {MAX_SEQ + 1} > max_seq={MAX_SEQ}"),
        (1, MAX_SEQ, TaskKind.DECODE, f"= {MAX_SEQ + 1} > max_seq"),  # §13.1: 40960 + decode is rejected
        (16, MAX_SEQ - 15, TaskKind.PREFILL_IDS, "> max_seq"),
    ],
)
def test_step2_max_seq(gen, n, past, kind, fragment):
    req = ids_request(n, tokens=np.zeros(n, dtype=np.int32),
                      positions=np.zeros(n, dtype=np.int32), past=past, kind=kind)
    assert_step(check_request(req, gen), 2, fragment)


@pytest.mark.parametrize(
    ("past", "seq_id", "fragment"),
    [
        (2**32 - 1, 3, "past_len=4294967295 + token_count=1 = 4294967296 overflows u32"),
        (2**32, 3, "past_len=4294967296 does not fit u32"),
        (-1, 3, "past_len=-1 does not fit u32"),
        (0, -1, "seq_id=-1 does not fit"),
        (0, 2**31, "seq_id=2147483648 does not fit"),
    ],
)
def test_step2_abi_widths(gen, past, seq_id, fragment):
    one = np.zeros(1, dtype=np.int32)
    req = InferenceRequest(seq_id=seq_id, kind=TaskKind.DECODE, past_len=past, deadline=0.0, tokens=one, positions=one)
    assert_step(check_request(req, gen), 2, fragment)


def test_step3_one_sequence_per_request(gen):
    assert_step(check_request(ids_request(4, seq_id=(3, 4)), gen), 3, "seq_count=2", "max_batch=1")


def test_step4_presence_and_lengths(gen):
    assert_step(check_request(ids_request(4, tokens=None), gen), 4, "tokens is None")
    assert_step(check_request(ids_request(4, positions=None), gen), 4, "positions is None")
    assert_step(check_request(ids_request(4, tokens=np.zeros(5, dtype=np.int32)), gen), 4,
                "len(tokens)=5 != len(positions)=4")
    assert_step(check_request(embeds_request(3, embeddings=None), gen), 4, "embeddings is None")
    bad = np.zeros((3, HIDDEN - 1), dtype=np.uint16)
    assert_step(check_request(embeds_request(3, embeddings=bad), gen), 4,
                f"embeddings has {3 * (HIDDEN - 1)} elements, expected token_count=3 x hidden_size={HIDDEN}")


def test_step5_contracts(gen):
    assert_step(check_request(ids_request(2, kind=TaskKind.VISION), gen), 5, "kind=VISION")
    assert_step(check_request(ids_request(3, tokens=np.arange(3, dtype=np.int64)), gen), 5,
                "tokens.dtype=int64", "'input_ids' is S32")
    assert_step(check_request(ids_request(3, positions=np.arange(3, dtype=np.uint32)), gen), 5,
                "positions.dtype=uint32")
    assert_step(check_request(ids_request(3, tokens=np.zeros((3, 1), dtype=np.int32)), gen), 5,
                "tokens has rank 2")
    assert_step(check_request(ids_request(2, kind=TaskKind.DECODE), gen), 5,
                "tokens.shape=[2]", "exactly 1 rows")
    flat = np.zeros(3 * HIDDEN, dtype=np.uint16)
    assert_step(check_request(embeds_request(3, embeddings=flat), gen), 5, "embeddings has rank 1")
    as_f32 = np.zeros((3, HIDDEN), dtype=np.float32)
    assert_step(check_request(embeds_request(3, embeddings=as_f32), gen), 5, "embeddings.dtype=float32")


def test_step6_ranges(gen):
    tokens = np.array([1, 2, V], dtype=np.int32)
    assert_step(check_request(ids_request(3, tokens=tokens), gen), 6, f"tokens[2]={V} outside [0, vocab_size={V})")
    tokens = np.array([-1, 2, 3], dtype=np.int32)
    assert_step(check_request(ids_request(3, tokens=tokens), gen), 6, "tokens[0]=-1")
    positions = np.array([10, 11, 12, 14, 14], dtype=np.int32)
    assert_step(check_request(ids_request(5, past=10, positions=positions), gen), 6,
                "positions[3]=14, expected past_len + 3 = 13")
    for want in [(V, 1), (0, V + 1), (0, 0), (-1, 2)]:
        assert_step(check_request(ids_request(2, want_logits=want), gen), 6, f"want_logits=(base={want[0]}")


@pytest.mark.parametrize(
    ("req", "step"),
    [
        # fails 2 (past_len) and 4 (length mismatch): 2 is reported
        (lambda: ids_request(4, past=MAX_SEQ, tokens=np.zeros(3, dtype=np.int32)), 2),
        # fails 3 and 4
        (lambda: ids_request(4, seq_id=(1, 2), tokens=None), 3),
        # fails 1 and 5 (no vision submodel)
        (lambda: ids_request(0, kind=TaskKind.VISION), 1),
        # fails 4, 5 and 6
        (lambda: ids_request(4, tokens=np.full(5, V, dtype=np.int64)), 4),
        # fails 5 and 6
        (lambda: ids_request(3, tokens=np.full(3, V, dtype=np.int64)), 5),
    ],
)
def test_steps_are_checked_in_the_spec_order(gen, req, step):
    assert check_request(req(), gen).step == step


def test_plan_and_check_slices(gen):
    ids = gen.submodels[TaskKind.PREFILL_IDS]
    assert plan_slices(ids_request(17), ids) == (TensorSlice("input_ids", 0, 68), TensorSlice("positions", 0, 68))
    emb = gen.submodels[TaskKind.PREFILL_EMBEDS]
    assert plan_slices(embeds_request(3), emb) == (TensorSlice("inputs_embeds", 0, 3 * HIDDEN * 2),
                                                   TensorSlice("positions", 0, 12))
    assert plan_slices(ids_request(1, kind=TaskKind.DECODE), gen.submodels[TaskKind.DECODE]) == ()
    t = ids.token_or_embed
    assert check_slice(t, 0, t.byte_size).ok
    assert check_slice(t, t.byte_size, 0).ok
    assert_step(check_slice(t, 0, t.byte_size + 1), 6,
                f"size={t.byte_size + 1} exceeds byte_size={t.byte_size}")  # FI03
    assert_step(check_slice(t, 4, t.byte_size), 6, "offset=4")
    assert_step(check_slice(gen.submodels[TaskKind.DECODE].position, 0, 4), 6, "not sliceable")


def test_valid_logits_row():
    assert [valid_logits_row(n, 16) for n in (1, 2, 15, 16, 17, 128, 40960)] == [0, 1, 14, 15, 0, 15, 15]
    assert valid_logits_row(7, 1) == 0
    with pytest.raises(ValueError, match="token_count=0"):
        valid_logits_row(0, 16)
    with pytest.raises(ValueError, match="tile_d0=0"):
        valid_logits_row(1, 0)


U64 = st.integers(min_value=0, max_value=2**64 - 1)


@given(U64, U64, U64)
def test_slice_bounds_equal_the_mathematical_condition(offset, size, limit):
    expected = offset + size <= limit  # Python ints: exact
    assert slice_bounds_ok(offset, size, limit) is expected
    assert logits_slice_ok(offset, size, limit) is expected


@given(U64, U64, U64)
def test_slice_bounds_never_overflow_in_u64_arithmetic(offset, size, limit):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy reports uint64 wrap-around as a RuntimeWarning
        got = slice_bounds_ok(np.uint64(offset), np.uint64(size), np.uint64(limit))
    assert bool(got) is (offset + size <= limit)


@given(st.integers(min_value=-(2**64), max_value=-1), U64)
def test_negative_operands_are_out_of_bounds(negative, other):
    assert not slice_bounds_ok(negative, other, other)
    assert not slice_bounds_ok(other, negative, 2**64)


@pytest.mark.parametrize(("field", "value", "error"), [
    ("deadline", None, TypeError),  # "no deadline" is not None here: float() said nothing
    ("deadline", "soon", TypeError),
    ("past_len", 1.5, TypeError),
    ("seq_id", "3", TypeError),
    ("seq_id", [1, 2.0], TypeError),
    ("kind", 99, ValueError),
    ("request_id", None, TypeError),
    ("kv_reserve_len", 8.0, TypeError),
    ("want_logits", 5, TypeError),
    ("want_logits", (0, 1.5), TypeError),
])
def test_a_badly_typed_request_field_raises_naming_the_field_and_value(field, value, error):
    """A newcomer's wrong type raises from the converter with ``InferenceRequest.<field>=
    <value>`` in the message, not a bare "float() argument must be ..." that names neither
    (found at stop 44 by an embedder)."""
    fields = dict(seq_id=1, kind=TaskKind.PREFILL_IDS, tokens=np.arange(3, dtype=np.int32),
                  positions=np.arange(3, dtype=np.int32), past_len=0, deadline=1.0)
    fields[field] = value
    with pytest.raises(error) as raised:
        InferenceRequest(**fields)
    assert f"InferenceRequest.{field}=" in str(raised.value), raised.value
    assert repr(value) in str(raised.value) or repr(value[1]) in str(raised.value)


@pytest.mark.parametrize("name", ["DECODE", "decode", "prefill_ids"])
def test_a_kind_given_by_its_name_says_to_write_the_member(name):
    """``kind="DECODE"`` (or the manifest's spelling, ``"prefill_ids"``) was refused "not a
    TaskKind (one of PREFILL_IDS, PREFILL_EMBEDS, DECODE, VISION)": the list named the very
    string given, so the message read as a contradiction (found at stop 50 by an embedder).
    It says to write the member, ``TaskKind.DECODE``, and lists the members as written."""
    fields = dict(seq_id=1, kind=name, tokens=np.arange(3, dtype=np.int32),
                  positions=np.arange(3, dtype=np.int32), past_len=0, deadline=1.0)
    with pytest.raises(ValueError) as raised:
        InferenceRequest(**fields)
    message = str(raised.value)
    assert message.startswith(f"InferenceRequest.kind={name!r}: not a TaskKind: write "
                              f"TaskKind.{name.upper()}, the member, not its name"), message
    assert "TaskKind.PREFILL_IDS (0), TaskKind.PREFILL_EMBEDS (1)" in message


# ---- boundaries hand mutants moved unseen (stop 48, docs/testing.md) ----------------------------
def test_the_largest_seq_id_that_fits_s32_passes_step_2(gen):
    one = np.zeros(1, dtype=np.int32)
    req = InferenceRequest(seq_id=2**31 - 1, kind=TaskKind.DECODE, past_len=0, deadline=0.0,
                           tokens=one, positions=one)
    assert check_request(req, gen).ok


def test_more_embedding_elements_than_positions_are_refused_at_step_4(gen):
    four_rows = np.zeros((4, HIDDEN), dtype=np.uint16)
    assert_step(check_request(embeds_request(3, embeddings=four_rows), gen), 4,
                f"embeddings has {4 * HIDDEN} elements, expected token_count=3 x hidden_size={HIDDEN}")


def test_a_wrong_position_past_the_small_request_path_is_refused_at_step_6(gen):
    """Above 16 positions the check runs on numpy: a position too high or too low is named."""
    for wrong in (50, 5):
        positions = np.arange(10, 30, dtype=np.int32)
        positions[17] = wrong
        assert_step(check_request(ids_request(20, past=10, positions=positions), gen), 6,
                    f"positions[17]={wrong}, expected past_len + 17 = 27")


def test_a_tensor_that_is_not_sliceable_takes_exactly_its_rows(gen):
    """A manifest may declare an input that is not sliceable with more than one row (a fixed
    length): a request must then fill it exactly; fewer rows are refused at step 5."""
    import attrs

    ids = gen.submodels[TaskKind.PREFILL_IDS]
    fixed = attrs.evolve(ids, token_or_embed=attrs.evolve(ids.token_or_embed, sliceable=False),
                         position=attrs.evolve(ids.position, sliceable=False))
    whole = attrs.evolve(gen, submodels={**gen.submodels, TaskKind.PREFILL_IDS: fixed})
    assert_step(check_request(ids_request(5), whole), 5, "tokens.shape=[5]",
                f"exactly {MAX_SEQ} rows")
    assert check_request(ids_request(5), gen).ok  # sliceable: at most MAX_SEQ rows
