"""Host-side sampling of the next token from the FP32 logits row the executor fills (issue 15).

``pick(logits, params, index)`` chooses token number ``index`` of a generation. The choice
depends ONLY on ``(logits, params, index)``: the random draw comes from a generator seeded per
token with ``[seed, index]`` (``np.random.default_rng``), so a generation replayed from any
token on, by this process or another one, makes the same choices (resumable generations rely on
it). A request without a seed gets one drawn at admission (:meth:`SamplingParams.resolved`)
and keeps it, so it is reproducible internally too.

Order, as in vLLM's sampler: the row processors first, on the FP32 row (:func:`process`:
``logit_bias`` added, then the repetition penalty over the prompt and generated tokens, then the
frequency and presence penalties over the generated ones); then temperature 0 is greedy (the
argmax of the processed row; ties: the lowest id, as ``np.argmax``); otherwise temperature,
min-p, top-k, top-p (nucleus) over the remaining tokens, then one draw. With processors the
choice also depends on the prompt and the tokens generated so far (``pick``'s ``prompt`` and
``output``), which a replay has (the dump record keeps both).
Log-probabilities are those of the model's own distribution (``log_softmax`` of the raw logits,
before every processor, temperature, min-p, top-k and top-p), like vLLM's default
``raw_logprobs``.

A grammar (structured outputs and tools, drivers/serving/grammar.py) is one more processor,
applied first: every token its :class:`RowConstraint` does not allow next is set to -inf.
It is stateful (it advances with each accepted token), so it lives on the request's run, not
in the frozen params: :attr:`SamplingParams.grammar` only says which one to start. Unlike the
other processors it also shapes the log-probabilities: vLLM applies the grammar's bitmask to
the logits before its sampler computes ``raw_logprobs``, so a structured output's
log-probabilities are over the tokens the grammar allows (a token it forces: 0.0) and its top
tokens are allowed ones only.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable, Sequence, Sized
from typing import Any, Protocol

import attrs
import numpy as np

from calexec.contracts import fields

#: the most alternatives ``logprobs``/``top_logprobs`` may ask for (vLLM's default max_logprobs)
MAX_LOGPROBS = 20
#: at most this many stop strings / stop token ids per request, each string at most this long
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
#: at most this many ``logit_bias`` entries (OpenAI's limit), each bias in [-100, 100]
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = 100.0
#: presence/frequency penalties are in [-2, 2] (OpenAI, vLLM)
PENALTY_RANGE = 2.0
#: seeds are taken modulo 2**64 (any int in [-2**63, 2**64) is accepted)
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class SamplingError(ValueError):
    """A sampling parameter is invalid: ``field`` names it, the message gives the value."""

    def __init__(self, field: str, value: Any, why: str, *, count: int | None = None) -> None:
        # a list refused for its length is named by its count, not shown: its first items
        # (``stop=["a", "b", "c", "d"]: at most 16 stop strings``) read as the whole list
        shown = (f"{field}: {count} given" if count is not None
                 else f"{field}={fields.shown(value, 80)}")  # (a stop string may be 1 MB)
        super().__init__(f"{shown}: {why}")
        self.field = field
        self.value = value


class NoTokenLeft(SamplingError):
    """The request's constraints leave no token to choose at one step of its generation
    (known only there: the grammar's state with ``allowed_token_ids``); ``field`` names the
    body field to change."""


# The validators below raise where their test fails, without :func:`_check`: its message
# was formatted (``f"...{PENALTY_RANGE:g}..."``) and a call made for every field of every
# request's parameters, about 10 of the event loop's Python calls a request (issue 28, stop
# 73); the loops over a field's items keep it. They test :func:`_is_number` written out.
# Since stop 75 they are no attrs validators: ``SamplingParams.__attrs_post_init__`` asks
# each field's in the order of the fields, and only for a value its cheap test (a float, an
# int or an empty tuple in range, each accepted by the validator too) does not take.
def _check(field: str, ok: bool, value: Any, why: str) -> None:
    if not ok:
        raise SamplingError(field, value, why)


def _check_count(field: str, value: Sized, limit: int, what: str) -> None:
    if len(value) > limit:
        raise SamplingError(field, value, f"at most {limit} {what}", count=len(value))


#: the types a number field takes (a bool aside: :func:`_is_number`)
_NUMBERS = (int, float, np.integer, np.floating)
_INF = math.inf


def _is_number(value: Any) -> bool:
    return isinstance(value, _NUMBERS) and not isinstance(value, bool)


def _validate_temperature(value: Any) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and 0.0 <= value <= 2.0):
        raise SamplingError("temperature", value, "must be a number in [0, 2]")


def _validate_top_p(value: Any) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and 0.0 < value <= 1.0):
        raise SamplingError("top_p", value, "must be a number in (0, 1]")


def _validate_top_k(value: Any) -> None:
    if not (fields.is_int(value) and (value >= 1 or value in (0, -1))):
        raise SamplingError("top_k", value, "must be an integer >= 1, or 0 / -1 for all tokens")


def _validate_seed(value: Any) -> None:
    if not (value is None or (fields.is_int(value) and SEED_MIN <= value <= SEED_MAX)):
        raise SamplingError("seed", value, f"must be an integer in [{SEED_MIN}, {SEED_MAX}]")


def _validate_stop(value: tuple[str, ...]) -> None:
    _check_count("stop", value, MAX_STOP_STRINGS, "stop strings")
    for i, s in enumerate(value):
        _check(f"stop[{i}]", isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS, s,
               f"must be a non-empty string of at most {MAX_STOP_CHARS} characters")


def _validate_stop_ids(value: tuple[int, ...]) -> None:
    _check_count("stop_token_ids", value, MAX_STOP_TOKEN_IDS, "ids")
    for i, t in enumerate(value):
        _check(f"stop_token_ids[{i}]", fields.is_token_id(t), t, "must be an integer >= 0")


def _validate_min_p(value: Any) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and 0.0 <= value <= 1.0):
        raise SamplingError("min_p", value, "must be a number in [0, 1]")


def _validate_repetition(value: Any) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and value > 0.0):
        raise SamplingError("repetition_penalty", value, "must be a number > 0 (1 = off)")


def _validate_penalty(name: str, value: Any) -> None:
    if not (isinstance(value, _NUMBERS) and not isinstance(value, bool)
            and math.isfinite(value) and -PENALTY_RANGE <= value <= PENALTY_RANGE):
        raise SamplingError(name, value,
                            f"must be a number in [{-PENALTY_RANGE:g}, {PENALTY_RANGE:g}]")


def _validate_logit_bias(value: tuple[tuple[int, float], ...]) -> None:
    _check_count("logit_bias", value, MAX_LOGIT_BIAS, "entries")
    for token, bias in value:
        _check(f"logit_bias[{fields.shown(token)}]", fields.is_token_id(token), token,
               "the key must be a token id >= 0")
        _check(f"logit_bias[{fields.shown(token)}]", _is_number(bias) and math.isfinite(bias)
               and -LOGIT_BIAS_RANGE <= bias <= LOGIT_BIAS_RANGE, bias,
               f"must be a number in [{-LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")


def _validate_min_tokens(value: Any) -> None:
    if not (fields.is_int(value) and value >= 0):
        raise SamplingError("min_tokens", value, "must be an integer >= 0")


def _validate_allowed(value: tuple[int, ...] | None) -> None:
    if value is None:
        return
    _check("allowed_token_ids", len(value) > 0, list(value), "must not be empty (null: all)")
    for i, t in enumerate(value):
        _check(f"allowed_token_ids[{i}]", fields.is_token_id(t), t, "must be an integer >= 0")


def _validate_logprobs(value: Any) -> None:
    if not (value is None or (fields.is_int(value) and 0 <= value <= MAX_LOGPROBS)):
        raise SamplingError("logprobs", value, f"must be null or an integer in [0, {MAX_LOGPROBS}]")


def _to_ids(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


# The converters of the tuple fields: ``tuple(value)``. A subscripted ``tuple[int, ...]`` as
# converter made the same tuple at about six times the cost (a ``types.GenericAlias`` call
# tries to set ``__orig_class__`` on the tuple and swallows the AttributeError), four times
# per request's parameters (stop 63: the server's CPU per request).
def _str_tuple(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


def _pair_tuple(value: Iterable[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    return tuple(value)


@attrs.frozen
class SamplingParams:
    """How a generation chooses its tokens. ``logprobs``: None = no log-probabilities; k >= 0 =
    the chosen token's and the k most likely alternatives'. Invalid values raise
    :class:`SamplingError` naming the field and the value."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = attrs.field(default=(), converter=_str_tuple)
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    logprobs: int | None = None
    #: vLLM extensions and OpenAI's penalties (:func:`process`; 0/1/empty = off)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    #: (token id, bias) pairs, added to the row
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(default=(), converter=_pair_tuple)

    #: vLLM: the end token and ``stop_token_ids`` cannot be chosen before this many tokens
    min_tokens: int = 0
    #: the server's end token(s) (not a request field): what ``min_tokens`` holds back
    end_token_ids: tuple[int, ...] = attrs.field(default=(), converter=_int_tuple)
    #: vLLM: the end token does not end the generation
    ignore_eos: bool = False
    #: vLLM: the text keeps the stop string that ended it (drivers/serving/openai_api.TextOutput)
    include_stop_str_in_output: bool = False
    #: vLLM: only these tokens can be chosen (None: all)
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_to_ids)
    #: structured outputs and tools: the grammar each generation starts (None: free text)
    grammar: GrammarSpec | None = attrs.field(default=None, eq=False)

    def __attrs_post_init__(self) -> None:
        # Each field's validator, in the order of the fields (as attrs ran them, after every
        # converter: the first refused field is the one named), asked only where the field's
        # cheap test does not take the value: a float (an int) in the field's range, an empty
        # tuple, None where null is allowed. Each of those tests takes only values its
        # validator takes (a NaN fails every comparison, an infinity every bound), so an
        # answer is the validators' own. The construction took 50 of the event loop's
        # Python calls a request with thirteen attrs validators, 7 now (issue 28, stop 75;
        # tests/test_perf_probe75.py: a differential against them). (attrs'
        # ``validators.set_disabled`` no longer turns them off: nothing here used it.)
        value: Any = self.temperature
        if type(value) is not float or not 0.0 <= value <= 2.0:
            _validate_temperature(value)
        value = self.top_p
        if type(value) is not float or not 0.0 < value <= 1.0:
            _validate_top_p(value)
        value = self.top_k
        if type(value) is not int or value < -1:
            _validate_top_k(value)
        value = self.seed
        if value is not None and (type(value) is not int or not SEED_MIN <= value <= SEED_MAX):
            _validate_seed(value)
        if self.stop:
            _validate_stop(self.stop)
        if self.stop_token_ids:
            _validate_stop_ids(self.stop_token_ids)
        value = self.logprobs
        if value is not None and (type(value) is not int or not 0 <= value <= MAX_LOGPROBS):
            _validate_logprobs(value)
        value = self.min_p
        if type(value) is not float or not 0.0 <= value <= 1.0:
            _validate_min_p(value)
        value = self.repetition_penalty
        if type(value) is not float or not 0.0 < value < _INF:
            _validate_repetition(value)
        value = self.presence_penalty
        if type(value) is not float or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
            _validate_penalty("presence_penalty", value)
        value = self.frequency_penalty
        if type(value) is not float or not -PENALTY_RANGE <= value <= PENALTY_RANGE:
            _validate_penalty("frequency_penalty", value)
        if self.logit_bias:
            _validate_logit_bias(self.logit_bias)
        value = self.min_tokens
        if type(value) is not int or value < 0:
            _validate_min_tokens(value)
        if self.allowed_token_ids is not None:
            _validate_allowed(self.allowed_token_ids)
        # min_tokens holds the end and stop tokens back; allowed_token_ids of those alone
        # left no token to choose: every logit -inf, and the pick was a token outside
        # allowed_token_ids (id 0 greedy, the last id sampled), silently
        if self.min_tokens > 0 and self.allowed_token_ids is not None:
            held = {*self.end_token_ids, *self.stop_token_ids}
            _check("min_tokens", not held.issuperset(self.allowed_token_ids), self.min_tokens,
                   f"every token of allowed_token_ids {list(self.allowed_token_ids)[:16]} is "
                   "an end or stop token, which min_tokens holds back: no token could be "
                   "chosen before min_tokens")

    @property
    def greedy(self) -> bool:
        """Temperature 0 (or top_k 1): the argmax (of the processed row), no draw."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def processed(self) -> bool:
        """A row processor is on (:func:`process`): the argmax may not be the raw row's."""
        return bool(self.logit_bias) or self.repetition_penalty != 1.0 \
            or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 \
            or self.min_tokens > 0 or self.allowed_token_ids is not None \
            or self.grammar is not None

    @property
    def raw_argmax(self) -> bool:
        """Greedy on the unprocessed row: the executor's argmax is the choice (it may fire the
        next step with it itself, greedy ahead)."""
        return self.greedy and not self.processed

    @property
    def plain_greedy(self) -> bool:
        """The executor's argmax without log-probabilities: it is the whole answer."""
        return self.raw_argmax and self.logprobs is None

    def resolved(self) -> SamplingParams:
        """These params with a seed: a random one drawn now (``draw_seed``) when none was
        given."""
        if self.seed is not None:
            return self
        return attrs.evolve(self, seed=draw_seed())


def draw_seed() -> int:
    """A fresh random seed for a request that gave none: what ``SamplingParams.resolved()``
    draws, for callers that build the params with their seed in one construction."""
    return secrets.randbits(63)


@attrs.frozen
class TokenLogprobs:
    """Log-probability of the chosen token and the ``top`` most likely ones (id, logprob),
    most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class RowConstraint(Protocol):
    """The state of a grammar over one generation (drivers/serving/grammar.py)."""

    def allowed(self) -> np.ndarray:
        """A bool array over the vocabulary: the tokens that may come next."""
        ...

    def accept(self, token: int) -> None:
        """Advance past ``token`` (one :meth:`allowed` permitted)."""
        ...

    @property
    def finished(self) -> bool:
        """The grammar is complete and takes no more tokens: the generation ends."""
        ...


class GrammarSpec(Protocol):
    """A compiled grammar a request asks for; each generation starts its own state."""

    def start(self) -> RowConstraint:
        ...


#: the parameters of a request that gives none (greedy, no logprobs)
GREEDY = SamplingParams()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """``log_softmax`` in float64 (stable: the max is subtracted first)."""
    x = logits.astype(np.float64)
    x -= x.max()
    x -= math.log(float(np.exp(x).sum()))
    return x


def process(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int] = (),
            output: Sequence[int] = (), constraint: RowConstraint | None = None) -> np.ndarray:
    """The row the choice is made on (a float32 copy; ``logits`` is left as it is), as vLLM's
    sampler computes it: every token ``constraint`` (the grammar's state) does not allow
    next, every token outside ``allowed_token_ids`` and, while ``output`` is
    shorter than ``min_tokens``, the end and stop tokens set to -inf; ``logit_bias`` added;
    then the repetition penalty on every token of ``prompt`` and ``output`` (a positive logit
    divided by it, a negative one multiplied);
    then ``frequency_penalty`` times each token's count in ``output`` and ``presence_penalty``
    for each token in ``output`` subtracted. ``logits`` itself when no processor is on."""
    return _process(logits, params, prompt, output,
                    None if constraint is None else constraint.allowed())


def grammar_masked(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """A float32 copy of ``logits`` with every token ``allowed`` (a grammar's mask, one bool
    a token; ids past its end are not allowed) does not hold set to -inf."""
    row = logits.astype(np.float32, copy=True)
    n = min(row.shape[0], allowed.shape[0])
    row[:n][~allowed[:n]] = -np.inf
    row[n:] = -np.inf
    return row


def _process(logits: np.ndarray, params: SamplingParams, prompt: Sequence[int],
             output: Sequence[int], allowed: np.ndarray | None) -> np.ndarray:
    """:func:`process` with the grammar's mask of this step (``allowed``) computed once."""
    if not params.processed:
        return logits
    if allowed is not None:
        row = grammar_masked(logits, allowed)
    else:
        row = logits.astype(np.float32, copy=True)
    vocab = row.shape[0]
    if params.allowed_token_ids is not None:
        allowed = np.asarray([t for t in params.allowed_token_ids if t < vocab], dtype=np.int64)
        kept = row[allowed]
        row[:] = -np.inf
        row[allowed] = kept
    if len(output) < params.min_tokens:
        held = [t for t in (*params.end_token_ids, *params.stop_token_ids) if t < vocab]
        row[held] = -np.inf
    for token, bias in params.logit_bias:
        if token < vocab:
            row[token] += np.float32(bias)
    if params.repetition_penalty != 1.0 and (len(prompt) or len(output)):
        seen = np.unique(np.concatenate([np.asarray(prompt, dtype=np.int64),
                                         np.asarray(output, dtype=np.int64)]))
        seen = seen[(seen >= 0) & (seen < vocab)]
        row[seen] = _penalised(row[seen], params.repetition_penalty)
    if len(output) and (params.frequency_penalty != 0.0 or params.presence_penalty != 0.0):
        ids = np.asarray(output, dtype=np.int64)
        counts = np.bincount(ids[(ids >= 0) & (ids < vocab)], minlength=vocab)[:vocab]
        row -= np.float32(params.frequency_penalty) * counts.astype(np.float32)
        row -= np.float32(params.presence_penalty) * (counts > 0).astype(np.float32)
    return row


#: the largest finite float32: where an extreme repetition penalty's logit ends
_F32_MAX = float(np.finfo(np.float32).max)


def _penalised(logits: np.ndarray, penalty: float) -> np.ndarray:
    """``logits`` (float32) under the repetition penalty: a positive one divided by it, a
    negative one multiplied, in float32 as vLLM computes it. Any penalty > 0 is accepted, so
    float32 may overflow (1e-46 rounds to 0, 1e39 to inf): a finite logit ends finite (at
    most the largest float32, 0 stays 0) and a masked one (-inf) stays masked; an inf or NaN
    would make argmax and the sampler pick a token no processor allowed."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        factor = np.float32(penalty)
        out = np.where(logits > 0, logits / factor, logits * factor)
    finite = np.isfinite(logits)
    if np.array_equal(np.isfinite(out), finite) and not np.isnan(out).any():
        return out  # (the usual case: nothing overflowed)
    out = np.where(finite, np.nan_to_num(out, nan=0.0, posinf=_F32_MAX, neginf=-_F32_MAX),
                   logits)
    return out.astype(np.float32, copy=False)


def pick(logits: np.ndarray, params: SamplingParams, index: int,
         argmax: int | None = None, prompt: Sequence[int] = (),
         output: Sequence[int] = (), constraint: RowConstraint | None = None
         ) -> tuple[int, TokenLogprobs | None]:
    """Token number ``index`` (0-based) of a generation and its log-probabilities (None unless
    ``params.logprobs`` is set). ``argmax``: the raw row's argmax when the caller has it
    already (the executor computes it): greedy without processors or logprobs then does no work
    at all. ``prompt``/``output``: the request's prompt and the tokens generated before this
    one (the penalties, :func:`process`). ``constraint``: the generation's grammar state
    (:attr:`SamplingParams.grammar`), advanced here past the chosen token. A sampling request
    needs ``params.seed`` (see :meth:`SamplingParams.resolved`)."""
    if params.plain_greedy:
        return (int(np.argmax(logits)) if argmax is None else int(argmax)), None
    allowed = None if constraint is None else constraint.allowed()
    row = _process(logits, params, prompt, output, allowed)
    if params.allowed_token_ids is not None and not np.isfinite(row).any():
        # the grammar (response_format, tools) allows none of allowed_token_ids next: every
        # logit -inf, and the argmax or the draw was id 0, outside both, silently
        raise NoTokenLeft("allowed_token_ids", list(params.allowed_token_ids)[:16],
                          f"none of them can be token {index} of the answer (the "
                          "response_format or tools grammar allows none of them there)")
    if params.greedy:
        token = int(np.argmax(row)) if argmax is None or params.processed else int(argmax)
    else:
        if params.seed is None:
            raise SamplingError("seed", None, "sampling needs a seed (SamplingParams.resolved())")
        token = _sample(row, params, index) if constraint is None else _sample_masked(
            row, params, index)
    if constraint is not None:
        constraint.accept(token)
    if params.logprobs is None:
        return token, None
    # vLLM's raw logprobs are computed on the row its grammar bitmask was applied to (before
    # the sampler's own processors): over the tokens the grammar allows, as the answer is
    raw = logits if allowed is None else grammar_masked(logits, allowed)
    return token, token_logprobs(raw, token, params.logprobs)


def token_logprobs(logits: np.ndarray, token: int, top: int) -> TokenLogprobs:
    """The chosen ``token``'s log-probability and the ``top`` most likely tokens' (only
    tokens of finite logit: a grammar's masked row may hold fewer than ``top``)."""
    lp = log_softmax(logits)
    best: tuple[tuple[int, float], ...] = ()
    if top > 0:
        top = min(top, int(np.isfinite(lp).sum()))
        ids = np.argpartition(-lp, top - 1)[:top]
        ids = ids[np.lexsort((ids, -lp[ids]))]  # most likely first, ties by id
        best = tuple((int(i), float(lp[i])) for i in ids)
    return TokenLogprobs(token, float(lp[token]), best)


#: the temperature from which ``(x - max) / temperature`` cannot overflow: a row's logits are
#: float32 (a difference of at most 6.9e38; 6.9e38 / 1e-200 < 1.8e308). Below it (any
#: temperature in (0, 2] is taken: 1e-320 too) the quotient may be -inf, the right limit (the
#: most likely tokens alone keep their mass), which numpy warned of in the server's log
#: (``RuntimeWarning: overflow encountered in divide``) for a valid request
_NO_OVERFLOW_TEMPERATURE = 1e-200


def _sample(logits: np.ndarray, params: SamplingParams, index: int) -> int:
    x = logits.astype(np.float64)
    ids = None  # None: every token, in id order; else the candidates, most likely first
    if 1 < params.top_k < x.shape[0]:
        ids = _most_likely(x, np.argpartition(-x, params.top_k - 1)[:params.top_k])
        x = x[ids]
    if params.temperature >= _NO_OVERFLOW_TEMPERATURE:
        probs = np.exp((x - x.max()) / params.temperature)
    else:  # the quotient may overflow to -inf, the right limit: said nowhere (stop 75)
        with np.errstate(over="ignore"):
            probs = np.exp((x - x.max()) / params.temperature)
    if params.min_p > 0.0:  # after temperature, as vLLM: below min_p x the top probability
        probs = np.where(probs >= params.min_p, probs, 0.0)  # (the top one's is exp(0) = 1)
    if params.top_p < 1.0:
        if ids is None:
            ids = _nucleus_candidates(probs, params.top_p)
            probs = probs[ids]
        cut = int(np.searchsorted(np.cumsum(probs), params.top_p * probs.sum())) + 1
        ids, probs = ids[:cut], probs[:cut]  # the smallest most-likely set with mass >= top_p
    if params.seed is None:  # sampling runs on SamplingParams.resolved()
        raise TypeError("_sample: unresolved SamplingParams (seed None)")
    rng = np.random.default_rng([params.seed % (1 << 64), index])
    position = inverse_cdf(probs, rng.random())
    return position if ids is None else int(ids[position])


def _sample_masked(row: np.ndarray, params: SamplingParams, index: int) -> int:
    """:func:`_sample` over the tokens a grammar left possible (the finite entries, in id
    order): the same distribution, drawn the same way, as over the whole row, whose -inf
    entries have no mass; but ``exp`` of the few candidates, not of ~150k entries that
    underflow (libm's slow path: 6 ms a token instead of 1 on the synthetic vocabulary)."""
    keep = np.flatnonzero(row > -np.inf)
    if keep.size == 0:  # (the grammar allows the end token at least)
        return int(np.argmax(row))
    return int(keep[_sample(row[keep], params, index)])


def _most_likely(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """``ids`` ordered most likely first, ties by id (deterministic)."""
    return ids[np.lexsort((ids, -x[ids]))]


def _nucleus_candidates(probs: np.ndarray, top_p: float) -> np.ndarray:
    """The most likely tokens, most likely first, at least as many as the nucleus of mass
    ``top_p`` needs: the top 256, 2048, ... (one partial partition each) until their mass
    reaches it, so the whole vocabulary is sorted only for a nearly flat distribution."""
    need = top_p * probs.sum()
    n, k = probs.shape[0], 256
    while k < n:
        top = np.argpartition(-probs, k - 1)[:k]
        if probs[top].sum() >= need:
            return _most_likely(probs, top)
        k *= 8
    return _most_likely(probs, np.arange(n))


#: block size of :func:`inverse_cdf`'s two-level search
_BLOCK = 1024


def inverse_cdf(probs: np.ndarray, u: float) -> int:
    """The position where the cumulative mass of ``probs`` (unnormalised) first exceeds
    ``u`` times their total: one cumulative sum over block sums, then one inside the block
    (a full-vocabulary ``cumsum`` costs ~0.5 ms; block sums are vectorised)."""
    n = probs.shape[0]
    whole = n - n % _BLOCK
    sums = probs[:whole].reshape(-1, _BLOCK).sum(axis=1)
    if whole < n:
        sums = np.append(sums, probs[whole:].sum())
    edges = np.cumsum(sums)
    target = u * edges[-1]
    block = min(int(np.searchsorted(edges, target, side="right")), len(sums) - 1)
    before = edges[block - 1] if block else 0.0
    start = block * _BLOCK
    inside = before + np.cumsum(probs[start:start + _BLOCK])
    return start + min(int(np.searchsorted(inside, target, side="right")), len(inside) - 1)
