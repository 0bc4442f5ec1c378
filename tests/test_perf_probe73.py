"""Stop 73's perf probe (issue 28: the event loop's work per plain request). Each change that
made the one path of a plain completion cheaper must leave every answer the same; these
tests pin what the rest of the suite did not: the refused fields' checks against the
getattr-and-test-every-field reading they replaced (a differential over generated bodies),
and every scalar sampling parameter's refusal message, exactly as the formatted-then-checked
validators wrote it. No timing is asserted."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from calexec.contracts.fields import shown
from calexec.drivers.serving import sampling
from calexec.drivers.serving.openai_api import (
    REFUSED,
    ChatRequest,
    CompletionRequest,
    Refusal,
    TextOutput,
    metadata_refusal,
    parse,
    refusal,
)
from calexec.drivers.serving.sampling import SamplingError, SamplingParams
from test_stop_holdback import TOK, Reference


def _reference_refusal(body: Any) -> tuple[str | None, str] | None:
    """``refusal`` as it read the body before stop 73 (its fields by ``getattr``, a field
    the model lacks as null, and every ``REFUSED`` field the model declares as ``Any``
    tested, null included, in ``REFUSED``'s order): (param, message) of its refusal."""
    try:
        metadata_refusal(getattr(body, "metadata", None))
    except Refusal as err:
        return err.param, err.status.message
    best_of = getattr(body, "best_of", None)
    if best_of is not None and (type(best_of) is not int or best_of < 1):
        return "best_of", (f"best_of={shown(best_of, 80)}: must be an integer >= 1 or null, "
                           "and best_of > 1 is not supported: send 1 or leave it out")
    fields = type(body).model_fields
    for name, (neutral, why) in REFUSED.items():
        if name in fields and fields[name].annotation is Any and not neutral(getattr(body, name)):
            return name, f"{name}={shown(getattr(body, name), 80)}: {why}"
    if body.n < 1:
        return "n", f"n={shown(body.n)}: must be >= 1"
    if best_of is not None and best_of < body.n:
        return "best_of", (f"best_of={shown(best_of)} < n={shown(body.n)}: best_of must be "
                           ">= n (or left out)")
    return None  # (stream_options: not generated here; its checks did not change)


def _told(body: Any) -> tuple[str | None, str] | None:
    """(param, message) of ``refusal(body)``, None when it takes the body."""
    try:
        refusal(body)
    except Refusal as err:
        return err.param, err.status.message
    return None


#: values a client may send for a refused field: null, each table's neutral values, and
#: values some field refuses (wrong types among them: ``best_of: true`` is no ``1``)
_VALUES = st.sampled_from([None, 0, 1, 1.0, -3, 2, "", "none", "medium", "low", False, True,
                           [], ["text"], ["text", "audio"], {}, {"a": 1}, "x" * 200, 0.5])


@settings(max_examples=300, deadline=None)
@given(model=st.sampled_from([CompletionRequest, ChatRequest]),
       chosen=st.dictionaries(st.sampled_from(sorted(REFUSED)), _VALUES, max_size=4),
       n=st.sampled_from([0, 1, 2]))
def test_refused_fields_are_judged_as_the_getattr_reading_judged_them(model, chosen, n):
    """Differential (openai_api.refusal reads ``vars(body)`` and skips null since stop 73):
    for generated bodies carrying refused fields with null, neutral and refused values (and
    ``n``, which best_of is judged against), the refusal (its field and message) or its
    absence equals the reading that tested every field by ``getattr``."""
    prompt = {"prompt": [1, 2]} if model is CompletionRequest else {
        "messages": [{"role": "user", "content": "hi"}]}
    declared = {k: v for k, v in chosen.items()
                if k in model.model_fields and model.model_fields[k].annotation is Any}
    body = parse(model, json.dumps({**prompt, **declared, "n": n}).encode())
    assert _told(body) == _reference_refusal(body)


def test_metadata_on_a_completions_body_is_no_field_and_best_of_is_still_judged():
    """``metadata`` is chat's field: a completions body has none (read as null, as the
    getattr default read it), and best_of's own rule still names it."""
    assert "metadata" not in CompletionRequest.model_fields
    assert _told(parse(CompletionRequest, b'{"prompt": [1]}')) is None
    said = _told(parse(CompletionRequest, b'{"prompt": [1], "best_of": 0}'))
    assert said is not None and said[0] == "best_of"
    said = _told(parse(ChatRequest, json.dumps({
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"k" * 65: "v"}}).encode()))
    assert said is not None and said[0].startswith("metadata.")


#: (field, a refused value, why) of every scalar sampling parameter, the message's words as
#: the validators formatted them before stop 73
_SCALAR_REFUSALS: list[tuple[str, Any, str]] = [
    *((("temperature", v, "must be a number in [0, 2]"))
      for v in (-0.1, 2.5, math.nan, math.inf, True, "1")),
    *((("top_p", v, "must be a number in (0, 1]")) for v in (0.0, 1.5, math.nan, False)),
    *((("top_k", v, "must be an integer >= 1, or 0 / -1 for all tokens"))
      for v in (-2, 1.5, True)),
    *((("seed", v, f"must be an integer in [{sampling.SEED_MIN}, {sampling.SEED_MAX}]"))
      for v in (sampling.SEED_MIN - 1, sampling.SEED_MAX + 1, 1.0, True)),
    *((("min_p", v, "must be a number in [0, 1]")) for v in (-0.5, 1.01, math.nan)),
    *((("repetition_penalty", v, "must be a number > 0 (1 = off)"))
      for v in (0.0, -1.0, math.inf)),
    *(((name, v, "must be a number in [-2, 2]"))
      for name in ("presence_penalty", "frequency_penalty") for v in (-2.5, 3, math.nan)),
    *((("min_tokens", v, "must be an integer >= 0")) for v in (-1, 1.0, True)),
    *((("logprobs", v, f"must be null or an integer in [0, {sampling.MAX_LOGPROBS}]"))
      for v in (-1, sampling.MAX_LOGPROBS + 1, 2.0)),
]


@pytest.mark.parametrize(("field", "value", "why"), _SCALAR_REFUSALS,
                         ids=[f"{f}={v!r}" for f, v, _ in _SCALAR_REFUSALS])
def test_each_scalar_sampling_parameter_is_refused_with_its_message(field, value, why):
    """The scalar validators raise where their test fails since stop 73 (no ``_check`` with
    a message formatted for every field of every request): the same error, field, value
    and words."""
    with pytest.raises(SamplingError) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field
    assert caught.value.value is value
    assert str(caught.value) == f"{field}={shown(value, 80)}: {why}"


_EDGES: list[tuple[str, Any]] = [
    ("temperature", 0.0), ("temperature", 2), ("top_p", 1), ("top_p", 1e-9), ("top_k", 0),
    ("top_k", -1), ("top_k", 1), ("seed", sampling.SEED_MIN), ("seed", sampling.SEED_MAX),
    ("seed", None), ("min_p", 0), ("min_p", 1.0), ("repetition_penalty", 1e-9),
    ("presence_penalty", -2), ("frequency_penalty", 2.0), ("min_tokens", 0),
    ("logprobs", None), ("logprobs", 0), ("logprobs", sampling.MAX_LOGPROBS)]


@pytest.mark.parametrize(("field", "value"), _EDGES, ids=[f"{f}={v!r}" for f, v in _EDGES])
def test_each_scalar_sampling_parameter_takes_its_bounds(field, value):
    built: Callable[..., SamplingParams] = SamplingParams
    assert getattr(built(**{field: value}), field) == value


#: byte tokens (ids 256..511) of ASCII and of a UTF-8 character's bytes (a piece may be held
#: by the detokenizer until the character is whole), and special ids
_TEXT_TOKENS = [256 + b for b in b"ab <>1"] + [256 + b for b in "é€".encode()] + [1, 11]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.sampled_from(_TEXT_TOKENS), max_size=40), keep=st.booleans(),
       min_tokens=st.integers(0, 3))
def test_text_without_stop_strings_is_the_reference_holdbacks(tokens, keep, min_tokens):
    """``TextOutput`` without stop strings does not ask ``_held`` since stop 73 (nothing to
    hold back): every piece, ``sent``, ``text`` and the flush equal the hold-back
    reference's (tests/test_stop_holdback.py's, which generates stop strings only)."""
    ours, ref = TextOutput(TOK, (), keep, min_tokens), Reference((), keep)
    for token in tokens:
        assert ours.add(token) == ref.add(token)
        assert ours.sent == ref.sent and not ours.stopped
    assert ours.flush() == ref.flush()
    assert ours.text == ref.text
