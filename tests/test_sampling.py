"""Host-side sampling (drivers/serving/sampling.py): the determinism contract (the choice depends only
on logits, params and the token index), greedy = argmax, top-k/top-p bounds, logprobs, and
validation errors that name the field and the value."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from calexec.drivers.serving.sampling import (
    GREEDY,
    MAX_LOGPROBS,
    SamplingError,
    SamplingParams,
    log_softmax,
    pick,
    process,
)


def _logits(seed: int = 0, n: int = 1000) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, n).astype(np.float32)


def test_greedy_is_the_argmax_and_uses_the_callers_argmax_without_work():
    logits = _logits()
    assert pick(logits, GREEDY, 0) == (int(np.argmax(logits)), None)
    # the fast path trusts the executor's argmax: no pass over the row at all
    assert pick(logits, GREEDY, 0, argmax=7) == (7, None)
    assert pick(logits, SamplingParams(temperature=0.0, seed=3), 5)[0] == int(np.argmax(logits))
    assert pick(logits, SamplingParams(temperature=1.5, top_k=1, seed=3), 5)[0] == \
        int(np.argmax(logits))


def test_the_choice_depends_only_on_logits_params_and_index():
    logits = _logits(1)
    params = SamplingParams(temperature=1.0, seed=42)
    first = [pick(logits, params, i)[0] for i in range(64)]
    # again, in another order: each token is a pure function of its index
    again = {i: pick(logits, params, i)[0] for i in reversed(range(64))}
    assert first == [again[i] for i in range(64)]
    assert len(set(first)) > 1  # it does sample
    other = [pick(logits, SamplingParams(temperature=1.0, seed=43), i)[0] for i in range(64)]
    assert other != first


def test_frequencies_follow_the_softmax():
    logits = np.log(np.array([0.7, 0.2, 0.1], dtype=np.float32))
    params = SamplingParams(temperature=1.0, seed=5)
    counts = np.bincount([pick(logits, params, i)[0] for i in range(3000)], minlength=3)
    assert np.allclose(counts / 3000, [0.7, 0.2, 0.1], atol=0.03)


def test_top_k_and_top_p_bound_the_candidates():
    logits = _logits(2)
    order = np.argsort(-logits)
    k3 = {pick(logits, SamplingParams(temperature=2.0, top_k=3, seed=1), i)[0]
          for i in range(300)}
    assert k3 <= set(order[:3].tolist()) and len(k3) > 1
    probs = np.exp(log_softmax(logits))
    mass = np.cumsum(probs[order])
    need = int(np.searchsorted(mass, 0.5)) + 1  # smallest prefix with mass >= 0.5
    p05 = {pick(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=1), i)[0]
           for i in range(300)}
    assert p05 <= set(order[:need].tolist())


def test_logprobs_are_the_raw_distributions():
    logits = _logits(3)
    lp = log_softmax(logits)
    token, info = pick(logits, SamplingParams(temperature=0.7, seed=9, logprobs=5), 2)
    assert info.token == token and info.logprob == pytest.approx(lp[token])
    assert [t for t, _ in info.top] == np.argsort(-lp)[:5].tolist()
    assert all(a >= b for (_, a), (_, b) in zip(info.top, info.top[1:]))
    assert math.isclose(float(np.exp(lp).sum()), 1.0, rel_tol=1e-9)
    _, none = pick(logits, SamplingParams(temperature=0.0, logprobs=0), 0)
    assert none.top == () and none.token == int(np.argmax(logits))


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", -0.5), ("temperature", float("nan")), ("temperature", 2.5),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("top_k", 1.5), ("seed", "7"),
    ("seed", 1 << 64), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", -1)])
def test_invalid_values_name_the_field_and_the_value(field, value):
    with pytest.raises(SamplingError) as err:
        SamplingParams(**{field: value})
    assert err.value.field == field and str(err.value).startswith(f"{field}={json.dumps(value)}")


def test_stop_lists_are_bounded_and_named():
    with pytest.raises(SamplingError, match=r'stop\[1\]=""'):
        SamplingParams(stop=["a", ""])
    with pytest.raises(SamplingError, match=r"^stop: 17 given: at most 16 stop strings$"):
        SamplingParams(stop=["x"] * 17)
    with pytest.raises(SamplingError, match=r"stop_token_ids\[0\]=-1"):
        SamplingParams(stop_token_ids=[-1])


def test_a_request_without_seed_gets_one_at_admission():
    params = SamplingParams(temperature=1.0)
    with pytest.raises(SamplingError, match="seed"):
        pick(_logits(), params, 0)
    resolved = params.resolved()
    assert resolved.seed is not None and resolved.resolved() is resolved
    logits = _logits(4)
    assert [pick(logits, resolved, i)[0] for i in range(8)] == \
        [pick(logits, resolved, i)[0] for i in range(8)]
    assert SamplingParams(seed=-5).seed == -5  # negative seeds are taken modulo 2**64
    assert pick(logits, SamplingParams(temperature=1.0, seed=-5), 0)[0] == \
        pick(logits, SamplingParams(temperature=1.0, seed=(1 << 64) - 5), 0)[0]


@pytest.mark.parametrize("n", [1, 7, 1023, 1024, 1025, 5000])
def test_the_two_level_inverse_cdf_equals_a_plain_cumsum_search(n):
    from calexec.drivers.serving.sampling import inverse_cdf
    rng = np.random.default_rng(n)
    probs = rng.random(n) ** 4  # uneven
    probs[rng.integers(0, n, size=max(1, n // 10))] = 0.0  # zero-mass tokens are never chosen
    if not probs.any():
        probs[0] = 1.0
    for u in [0.0, 1e-12, *rng.random(200).tolist(), 1 - 1e-12]:
        plain = np.cumsum(probs)
        expected = min(int(np.searchsorted(plain, u * plain[-1], side="right")), n - 1)
        got = inverse_cdf(probs, u)
        assert probs[got] > 0
        # the block sums may round differently from one long cumsum only at a boundary
        assert got == expected or abs(plain[min(got, expected)] - u * plain[-1]) < 1e-9


def test_top_p_on_a_peaked_row_matches_a_full_sort():
    logits = _logits(6, n=50000) * 4  # peaked: the nucleus is a few tokens
    for top_p in (0.5, 0.9, 0.99):
        probs = np.exp(log_softmax(logits))
        order = np.lexsort((np.arange(len(probs)), -probs))
        need = int(np.searchsorted(np.cumsum(probs[order]), top_p * probs.sum())) + 1
        nucleus = set(order[:need].tolist())
        chosen = {pick(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=2), i)[0]
                  for i in range(200)}
        assert chosen <= nucleus and len(chosen) > 1


def test_top_k_2_draws_only_the_two_most_likely_tokens():
    """top_k is applied from 2 up (1 is greedy): the third token never comes."""
    logits = np.array([3.0, 2.9, 2.8, -5.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=2, seed=7)
    drawn = {pick(logits, params, i)[0] for i in range(200)}
    assert drawn == {0, 1}


def test_min_p_keeps_a_token_exactly_at_the_threshold():
    """min_p keeps tokens whose probability is >= min_p x the top one's: at min_p=1 every
    token tied with the top one is kept (and is drawn), the rest never."""
    logits = np.array([5.0, 5.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, min_p=1.0, seed=3)
    drawn = {pick(logits, params, i)[0] for i in range(200)}
    assert drawn == {0, 1}


def test_repetition_penalty_applies_to_the_prompt_before_any_token_is_generated():
    """vLLM penalises every token of the prompt and the output: the first token's row too,
    when nothing was generated yet."""
    logits = np.array([2.0, 1.0, -1.0], dtype=np.float32)
    row = process(logits, SamplingParams(repetition_penalty=2.0, seed=1), prompt=[0, 2])
    assert row.tolist() == [1.0, 1.0, -2.0]
