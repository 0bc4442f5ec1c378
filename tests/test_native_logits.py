"""The fused native logits postprocess (drivers/native/fused_logits.py over
drivers/native/calexec_native.c): bit-identical to the numpy path (``bf16_to_f32_into`` +
``bf16_all_finite`` + ``np.argmax``), §10.1 bounds refused as values, GIL released, no
allocation per call; and the executor using it, with the numpy path as the fallback for
runtimes without it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from calexec.contracts.status import Status
from calexec.drivers import alloccount
from calexec.drivers.calrt.runtime import CalRT
from calexec.drivers.native._calexec_native import lib as native_lib
from calexec.drivers.native.fused_logits import EBOUNDS, EDST, NONFINITE, OK, FusedLogits
from calexec.machines.postprocess import bf16_all_finite, bf16_to_f32_into
from executor_harness import deadline, decode, prefill, running_executor, write_calbin

V = 151936
BLOCK = 1024  # the C loop's block: slices around its multiples are the edges
SPECIAL = [0x0000, 0x8000,  # +0, -0
           0x0001, 0x8001, 0x007F, 0x807F,  # denormals
           0x0080, 0x8080,  # smallest normals
           0x7F7F, 0xFF7F,  # largest finite
           0x3F80, 0xBF80,  # +1, -1
           0x7F80, 0xFF80,  # +Inf, -Inf
           0x7FC0, 0xFFC0, 0x7F81, 0xFFFF]  # NaNs (quiet, signalling, negative)
FINITE_SPECIAL = [b for b in SPECIAL if (b & 0x7F80) != 0x7F80]


def reference(src: np.ndarray, base: int, n: int):
    """Today's numpy path: (finite, FP32 row, argmax) or (False, None, first non-finite)."""
    scratch = np.empty(max(n, 1), np.uint16)
    piece = src[base:base + n]
    if not bf16_all_finite(piece, scratch):
        return False, None, int(np.flatnonzero((piece & 0x7F80) == 0x7F80)[0])
    dst = np.empty(n, np.float32)
    bf16_to_f32_into(src, base, n, dst)
    return True, dst, (int(np.argmax(dst)) if n else -1)


def check_against_numpy(src: np.ndarray, base: int, n: int) -> None:
    fused = FusedLogits()
    dst = np.full(n + 3, np.float32(5.5))  # 3 sentinels past the slice
    # check (greedy ahead's first pass): the same answers, nothing written
    rc = fused.check(src, base, n, dst)
    checked = (rc, fused.argmax, fused.first_nonfinite, np.float32(fused.max).view(np.uint32))
    assert np.all(dst == np.float32(5.5))
    rc = fused.with_sumexp(src, base, n, dst)
    assert checked == (rc, fused.argmax, fused.first_nonfinite,
                       np.float32(fused.max).view(np.uint32))
    finite, expected, index = reference(src, base, n)
    assert np.all(dst[n:] == np.float32(5.5))  # never a write past n
    if not finite:
        assert rc == NONFINITE and fused.first_nonfinite == index and fused.argmax == -1
        return
    assert rc == OK and fused.first_nonfinite == -1
    assert np.array_equal(dst[:n].view(np.uint32), expected.view(np.uint32))  # bit-identical
    assert fused.argmax == index
    if n == 0:
        assert fused.max == -np.inf and fused.sumexp == 0.0
        return
    assert np.float32(fused.max).view(np.uint32) == expected[index].view(np.uint32)
    x = expected.astype(np.float64)
    want = float(np.exp(x - x.max()).sum())
    # terms below exp(-87) count as exp(-87) (<= n * 1.7e-38 in absolute terms)
    assert fused.sumexp == pytest.approx(want, rel=2e-6, abs=n * 2e-38)


bf16 = st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL))


@settings(max_examples=300)
@given(data=st.data(), size=st.integers(0, 3 * BLOCK + 5))
def test_fused_matches_numpy_on_any_bf16_bytes(data, size):
    src = data.draw(hnp.arrays(np.uint16, size, elements=bf16))
    base = data.draw(st.integers(0, size))
    n = data.draw(st.one_of(st.just(size - base), st.integers(0, size - base)))
    check_against_numpy(src, base, n)


@settings(max_examples=200)
@given(data=st.data(), size=st.integers(1, 3 * BLOCK + 5))
def test_fused_matches_numpy_on_finite_values_with_ties(data, size):
    # few distinct values: many ties, across blocks, incl. -0 vs +0 and denormals
    values = data.draw(st.lists(st.sampled_from(FINITE_SPECIAL + [0x4000, 0xC000]),
                                min_size=1, max_size=4))
    src = data.draw(hnp.arrays(np.uint16, size, elements=st.sampled_from(values)))
    base = data.draw(st.integers(0, size))
    check_against_numpy(src, base, size - base)


@settings(max_examples=200)
@given(data=st.data(), size=st.integers(1, 3 * BLOCK + 5))
def test_fused_matches_numpy_when_the_maximum_is_a_signed_zero(data, size):
    # -0 == +0 for np.argmax: whichever zero comes first is the argmax
    negatives = st.sampled_from([0x8001, 0x807F, 0x8080, 0xBF80, 0xFF7F])
    src = data.draw(hnp.arrays(np.uint16, size, elements=st.one_of(
        negatives, st.sampled_from([0x0000, 0x8000]))))
    check_against_numpy(src, 0, size)


@pytest.mark.parametrize("bits,expected", [
    ([0x8000, 0x0000], 0), ([0x0000, 0x8000], 0), ([0xBF80, 0x8000, 0x0000], 1),
    ([0x8001] * 5 + [0x8000] + [0x8001] * 2000 + [0x0000], 5),  # across a block boundary
    ([0x8001] * 1500 + [0x0000] + [0x8000], 1500),
    ([0x0001, 0x0002, 0x0002, 0x0001], 1), ([0x8002, 0x8001, 0x8001], 1),  # denormals
])
def test_signed_zero_and_denormal_ties_follow_np_argmax(bits, expected):
    src = np.array(bits, np.uint16)
    dst = np.empty(len(bits), np.float32)
    fused = FusedLogits()
    assert fused(src, 0, len(bits), dst) == OK
    assert fused.argmax == expected == int(np.argmax(dst))


@pytest.mark.parametrize("base,n", [(0, V), (14 * V, V), (15 * V + 1, V - 1), (16 * V - 1, 1),
                                    (16 * V, 0), (3 * V + BLOCK - 1, BLOCK + 2)])
def test_fused_matches_numpy_on_a_prefill_tile(base, n):
    rng = np.random.default_rng(base + n)
    src = (rng.standard_normal(16 * V, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    # plant the maximum twice (the first wins) and denormals and -0 at the start
    if n:
        src[base + n // 2] = src[min(base + n - 1, 16 * V - 1)] = 0x7F00
        head = [0x0001, 0x8000, 0x0000, 0x807F, 0x0001, 0x8001, 0x0000, 0x8000][:min(n, 8)]
        src[base:base + len(head)] = head
    check_against_numpy(src, base, n)


@pytest.mark.parametrize("base,n,size", [
    (5, 0, 4), (4, 1, 4), (0, 5, 4), (2, 3, 4),  # base > size, n > size - base
    (2**64 - 1, 2, 4), (1, 2**64 - 1, 4),  # base + n overflows: still refused
])
def test_out_of_bounds_slices_are_refused_without_access(base, n, size):
    src = np.zeros(size, np.uint16)
    dst = np.full(8, np.float32(5.5))
    fused = FusedLogits()
    assert fused(src, base, n, dst) == EBOUNDS
    assert np.all(dst == np.float32(5.5)) and fused.argmax == -1


def test_negative_slices_and_short_destinations_are_refused():
    src = np.zeros(100, np.uint16)
    dst = np.full(10, np.float32(5.5))
    fused = FusedLogits()
    assert fused(src, -1, 5, dst) == EBOUNDS
    assert fused(src, 0, -5, dst) == EBOUNDS
    assert fused(src, 0, 11, dst) == EDST
    assert fused.check(src, -1, 5, dst) == EBOUNDS and fused.argmax == -1
    assert fused.check(src, 0, 11, dst) == EDST  # checked as the conversion checks it
    assert fused.check(src, 90, 10, dst) == OK and fused.argmax == 0
    assert np.all(dst == np.float32(5.5))
    assert fused(src, 90, 10, dst) == OK and np.all(dst == 0.0)


def test_python_misuse_raises_naming_the_argument():
    fused = FusedLogits()
    good_src, good_dst = np.zeros(10, np.uint16), np.zeros(10, np.float32)
    with pytest.raises(ValueError, match="src: .*uint16"):
        fused(np.zeros(10, np.float32), 0, 1, good_dst)
    with pytest.raises(ValueError, match="dst: .*float32"):
        fused(good_src, 0, 1, np.zeros(10, np.float64))
    with pytest.raises(ValueError, match="dst: .*c_contiguous=False"):
        fused(good_src, 0, 1, np.zeros(20, np.float32)[::2])
    readonly = np.zeros(10, np.float32)
    readonly.flags.writeable = False
    with pytest.raises(ValueError, match="dst: .*writeable=False"):
        fused(good_src, 0, 1, readonly)
    with pytest.raises(ValueError, match="src: expected a numpy array, got list"):
        fused([0] * 10, 0, 1, good_dst)


def test_cached_pointers_follow_the_arrays():
    fused = FusedLogits()
    dst = np.zeros(4, np.float32)
    arrays = [np.full(4, 0x3F80 + i, np.uint16) for i in range(20)]  # more than the cache
    for round_ in range(2):
        for i, src in enumerate(arrays):
            assert fused(src, 0, 4, dst) == OK
            assert np.all(dst.view(np.uint32) == (0x3F80 + i) << 16), (round_, i)
    # a cached array whose dtype is reassigned is checked again, not used as before
    src = np.full(4, 0x3F80, np.uint16)
    assert fused(src, 0, 4, dst) == OK
    src.dtype = np.int16
    with pytest.raises(ValueError, match="src: .*int16"):
        fused(src, 0, 4, dst)


def test_the_call_releases_the_gil():
    # cffi releases the GIL around API-mode calls; this hook reports what the C side sees
    assert native_lib.calexec_native_gil_held() == 0


def test_a_call_allocates_no_numpy_buffer_and_no_python_object():
    rng = np.random.default_rng(5)
    src = (rng.standard_normal(2 * V, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    dst = np.empty(V, np.float32)
    fused = FusedLogits()
    counted = alloccount.count(lambda: fused(src, V, V, dst), 100, every_thread=False)
    assert counted.numpy_data == 0
    assert counted.python < 0.5  # cached pointers, per-thread out-parameters: none per call
    # reading the argmax makes its int; with the call that is one allocation per token
    assert alloccount.count(lambda: (fused(src, V, V, dst), fused.argmax), 100,
                            every_thread=False).python < 1.5


@pytest.fixture(scope="module")
def calbin(tmp_path_factory):
    return write_calbin(tmp_path_factory.mktemp("calbin"))


def test_executor_uses_the_fused_path_and_matches_the_numpy_fallback(calbin):
    prompt = [11, 22, 33, 44, 55, 66, 77, 88, 99, 10, 20, 30, 40, 50, 60, 70, 80]  # 17: row != 0
    assert isinstance(CalRT.load().logits_postprocessor(), FusedLogits)

    def run(ex, seq):
        rows, tokens, past = [], [], 0
        out = np.empty(V, np.float32)
        res = ex.enqueue(prefill(seq, prompt), logits_out=out).wait_until(deadline())
        for _ in range(4):
            assert not isinstance(res, Status), res
            rows.append(out.copy())
            tokens.append(res.argmax)
            past = res.kv_len
            res = ex.enqueue(decode(seq, tokens[-1], past), logits_out=out).wait_until(deadline())
        return tokens, rows

    with running_executor(calbin) as ex:
        assert isinstance(ex.completion.fused_logits, FusedLogits)
        fused_tokens, fused_rows = run(ex, 1)
        ex.completion.fused_logits = None  # a runtime without the native postprocess: the numpy path
        numpy_tokens, numpy_rows = run(ex, 2)
    assert fused_tokens == numpy_tokens
    for a, b in zip(fused_rows, numpy_rows):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32))


def test_executor_turns_a_refused_slice_into_a_status(calbin):
    # §10.1 bounds are checked again natively; a refusal (here forced) fails the job with a
    # status naming the slice, never an access out of bounds or a dead completion thread
    class Refusing(FusedLogits):
        __slots__ = ()

        def __call__(self, src, base, n, dst):
            return EBOUNDS

    with running_executor(calbin) as ex:
        ex.completion.fused_logits = Refusing()
        res = ex.enqueue(prefill(1, [1, 2, 3])).wait_until(deadline())
    assert isinstance(res, Status) and res.code == "internal.logits_slice", res
    assert "refused (1: slice out of bounds)" in res.message and "base=" in res.message
