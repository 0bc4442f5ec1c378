"""The OpenAI surface of the reference server (issue 15 §4): request bodies, the parameter
table (every known OpenAI parameter is implemented or refused with a 400 naming it), the chat
template, response and stream chunk shapes, and the routes ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions``, ``/tokenize``, ``/detokenize``.

The generation itself is ``CompletionService`` (drivers/serving/server.py): ``admit`` -> ``advance``
(one token per call, chosen by drivers/serving/sampling.py) -> ``finish``. This module turns tokens
into text (stop strings, echo, logprobs) and the OpenAI JSON. docs/server.md has the table.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import logging
import math
import re
import time
import types
import typing
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Annotated, Any, Literal, TypeVar, cast

import anyio
import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from calexec.contracts.errors import Category
from calexec.contracts.fields import shown, shown_string
from calexec.contracts.status import Phase, Status
from calexec.contracts.types import TaskKind
from calexec.drivers.serving import error_bodies, grammar, handoff, metrics, sampling, wire
from calexec.drivers.serving.hf_tokenizer import Tokenizer, compiled_chat_template
from calexec.drivers.serving.resume import RESUMABLE
from calexec.drivers.serving.sampling import (
    SamplingError,
    SamplingParams,
    TokenLogprobs,
    draw_seed,
)
from calexec.drivers.serving.service import (
    ABORTED,
    STREAM_AHEAD,
    Admission,
    CompletionService,
    OpenRequest,
    RequestRun,
    RouteService,
    context_exceeded,
    failure_param,
    knock_on,
)

Number = StrictInt | StrictFloat

#: chat max_tokens when the body gives neither max_tokens nor max_completion_tokens (the KV of
#: prompt + max_tokens is reserved up front: an "until the context is full" default would
#: reserve the whole context for every chat request)
CHAT_DEFAULT_MAX_TOKENS = 256
#: the worker threads of one app compiling grammars (structured outputs, tools) at once; a
#: request past them waits, before admission, holding nothing
GRAMMAR_THREADS = 2
#: the plain chat template (the tokenizer has none): one "role: content" line per message,
#: then "assistant:" for the reply
PLAIN_TEMPLATE_DOC = "{role}: {content}\\n per message, then 'assistant:'"
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

#: a request body model
Body = TypeVar("Body", bound=BaseModel)


class _Body(BaseModel):
    """Fields shared by completions and chat. Unknown fields are refused (400 naming them):
    calexec never ignores a parameter it does not implement. Refused OpenAI parameters are
    declared ``Any`` and checked by :func:`refusal` against their neutral values. ``null`` for
    an optional field means its default, as in the OpenAI API (:meth:`_null_is_default`)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None
    n: StrictInt = 1
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None  # vLLM / llama-server extension
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: list[StrictInt] | None = None  # vLLM extension
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    timeout: Number | None = Field(default=None, gt=0)  # calexec: per-request deadline (s)
    user: StrictStr | None = None  # metadata: accepted, ignored
    # OpenAI's penalties and bias, vLLM's extensions: on the FP32 row (sampling.process)
    logit_bias: dict[StrictStr, Number] | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    return_token_ids: StrictBool = False  # vLLM: prompt_token_ids too
    min_tokens: StrictInt | None = None  # vLLM: no end/stop token before this many
    ignore_eos: StrictBool = False  # vLLM: the end token does not end the generation
    allowed_token_ids: list[StrictInt] | None = None  # vLLM: only these can be chosen
    include_stop_str_in_output: StrictBool = False  # vLLM
    # vLLM: special tokens of the tokenizer (BOS...) added to the prompt; null: completions
    # true, chat false (the chat template writes its own)
    add_special_tokens: StrictBool | None = None
    # vLLM: keep only the last k prompt tokens (-1: the model's context)
    truncate_prompt_tokens: StrictInt | None = Field(default=None, ge=-1)
    # vLLM metadata: accepted, ignored (internal ids are the server's; no prefix cache to salt)
    request_id: StrictStr | None = None
    cache_salt: StrictStr | None = None
    # vLLM fields refused unless neutral (see REFUSED): named, never "unknown"
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    prompt_logprobs: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    bad_words: Any = None
    priority: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    return_tokens_as_token_ids: Any = None
    logits_processors: Any = None
    kv_transfer_params: Any = None
    vllm_xargs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_nulls(cls, data)


def drop_nulls(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the ``null`` values of ``model``'s optional fields (they take their
    default: ``n: null`` is 1, ``echo: null`` false). Required fields and unknown keys keep
    theirs, so a null ``messages`` is still a type error and an unknown key still refused."""
    if not isinstance(data, dict):
        return data
    fields = model.model_fields
    return {k: v for k, v in data.items()
            if not (v is None and k in fields and not fields[k].is_required())}


class CompletionRequest(_Body):
    """``POST /v1/completions``. ``prompt: null`` is the start of a document (OpenAI: the
    model generates as if from a document separator; here the end token)."""

    prompt: StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]] | None
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    # 0: nothing generated (echo and prompt logprobs only: evaluation harnesses' likelihoods)
    max_tokens: StrictInt | None = Field(default=None, ge=0)
    # vLLM: the log-probabilities of the prompt's tokens, each with this many top tokens
    prompt_logprobs: StrictInt | None = None
    best_of: Any = None
    suffix: Any = None
    response_format: Any = None  # vLLM takes it on completions too
    prompt_embeds: Any = None  # vLLM


class ChatMessage(BaseModel):
    """One message. An assistant message as the SDK dumps it (``message.model_dump()``) carries
    ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``tool_calls``, null when
    unused: null is accepted; a refusal is the message's text when it has no content; the
    ``parsed`` of the SDK's parse helpers (its own parse of the content) is ignored; tool
    calls are rendered by the chat template (drivers/serving/grammar.py), as are ``tool``
    messages (``tool_call_id``) and an assistant's reasoning (``reasoning_content`` or
    ``reasoning``: :func:`reasoning_text`); non-null function calls and audio are refused
    (:func:`message_text`)."""

    model_config = ConfigDict(extra="forbid")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    refusal: StrictStr | None = None
    annotations: list[dict[str, Any]] | None = None  # url citations: nothing to render
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None  # tool messages
    # the SDK's ParsedChatCompletionMessage (chat.completions.parse / .stream helpers): the
    # client's own parse of the content, sent back when the message is appended as it is
    parsed: Any = None
    # an assistant's reasoning, as a reasoning server returned it and clients send it back:
    # vLLM's ``reasoning`` (its name since it renamed ``reasoning_content``) and
    # ``reasoning_content`` (older vLLM, DeepSeek, litellm, pydantic-ai); both given to the
    # chat template, as vLLM gives them (:func:`reasoning_text`)
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None
    # litellm's Anthropic-style blocks: null or [] accepted (what litellm dumps), others refused
    thinking_blocks: list[dict[str, Any]] | None = None
    # litellm's copy of the reply's provider fields (a vLLM reply's ``reasoning``): its
    # ``reasoning``/``reasoning_content`` are the message's reasoning, the rest metadata
    provider_specific_fields: dict[str, Any] | None = None


class ChatRequest(_Body):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    # vLLM: template switches (Qwen3's enable_thinking), the assistant turn's opening
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    add_generation_prompt: StrictBool = True
    # metadata and caching hints: accepted, ignored (nothing is stored, one tier, no cache)
    metadata: dict[StrictStr, StrictStr] | None = None  # OpenAI's limits: metadata_refusal
    store: StrictBool | None = None
    # the OpenAI SDK's values (3.51); another string is a 400 naming the field, as OpenAI's
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    safety_identifier: StrictStr | None = None
    parallel_tool_calls: StrictBool | None = None  # false: at most one call
    # structured outputs and tools: checked and compiled by drivers/serving/grammar.py
    tools: Any = None
    tool_choice: Any = None
    response_format: Any = None
    # refused unless neutral
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None
    continue_final_message: StrictBool = False  # vLLM: continue the last (assistant) message
    # vLLM's chat fields refused unless neutral
    echo: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None


def _none_or(*values: Any) -> Callable[[Any], bool]:
    """Null or one of ``values``, of its type too: ``true == 1`` and ``0 == false`` in Python,
    but ``best_of: true`` is a wrong type, not the neutral ``best_of: 1``."""
    return lambda v: v is None or any(type(v) is type(x) and v == x for x in values)


#: refused OpenAI parameter -> (value that is accepted because it changes nothing, why refused)
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_none_or(1), "best_of > 1 is not supported (no choice is sampled more than "
                "once to return the best): send 1 or leave it out; n gives n choices"),
    "suffix": (_none_or(""), "suffix (insertion) is not supported"),
    "functions": (lambda v: v is None or v == [], "the deprecated functions are not "
                  "supported: send tools (same schemas) instead"),
    "function_call": (_none_or("none"), "the deprecated function_call is not supported: send "
                      "tool_choice instead (only \"none\" is accepted here)"),
    "modalities": (lambda v: v is None or v == ["text"], "only modalities [\"text\"]"),
    "audio": (_none_or(), "audio output is not supported"),
    "prediction": (_none_or(), "predicted outputs are not supported"),
    "reasoning_effort": (_none_or(), "reasoning_effort is not supported: Qwen3's thinking "
                         "is switched by its chat template, chat_template_kwargs: "
                         "{\"enable_thinking\": false} (with a --tokenizer that has one)"),
    "verbosity": (_none_or("medium"), "only \"medium\" (the default): the served model has "
                  "one verbosity, so \"low\" or \"high\" cannot be honoured"),
    "web_search_options": (_none_or(), "web search is not supported"),
    "moderation": (_none_or(), "moderation is not performed by this server"),
    # vLLM's own fields: named with the reason, not refused as unknown
    **{name: (_none_or(), "vLLM's guided decoding fields are not supported; structured "
              "outputs are: send response_format {\"type\": \"json_schema\", ...} (or "
              "json_object), or tools")
       for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                    "guided_decoding_backend", "guided_whitespace_pattern",
                    "structured_outputs")},
    "prompt_logprobs": (_none_or(), "prompt logprobs are computed on /v1/completions only"),
    "use_beam_search": (_none_or(False), "beam search is not supported"),
    "length_penalty": (_none_or(1, 1.0), "length_penalty needs beam search (not supported)"),
    "bad_words": (lambda v: v is None or v == [], "bad_words is not supported"),
    "priority": (_none_or(0), "one priority: admission is first come, first served"),
    "skip_special_tokens": (_none_or(True), "special tokens are never rendered in the text"),
    "spaces_between_special_tokens": (_none_or(True), "special tokens are never rendered"),
    "return_tokens_as_token_ids": (_none_or(False), "return_tokens_as_token_ids is not "
                                   "supported"),
    "logits_processors": (_none_or(), "custom logits processors are not supported"),
    "kv_transfer_params": (_none_or(), "KV transfer (disaggregated serving) is not supported"),
    "vllm_xargs": (_none_or(), "vllm_xargs is not supported"),
    "prompt_embeds": (_none_or(), "prompt embeddings are not supported: send text or ids"),
    "echo": (_none_or(False), "chat echo is not supported (completions' echo is)"),
    "documents": (_none_or(), "documents (RAG templates) are not supported"),
    "chat_template": (_none_or(), "a per-request chat template is not supported: the "
                      "server's tokenizer's template (or the plain one) renders"),
    "mm_processor_kwargs": (_none_or(), "multimodal inputs are not supported"),
}


def invalid(message: str) -> Status:
    return Status.failure("request.invalid", Category.INVALID_REQUEST, Phase.VALIDATE, message)


class Refusal(Exception):
    """A request the server answers with an error: ``status``, ``param``, ``http_status``,
    ``headers`` (of the response: ``wire.CLOSE`` when its body was not read whole)."""

    def __init__(self, status: Status, param: str | None, http_status: int | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(status.message)
        self.status, self.param, self.http_status = status, param, http_status
        self.headers = headers


def draining_refusal() -> Refusal:
    """The 503 of a completion or chat sent with ``Expect: 100-continue`` while the server
    drains, answered before its body is read: no ``100 Continue`` (uvicorn sends it when a
    route first reads the body: the client uploaded its body to be refused), and
    ``Connection: close`` (the body it announced never comes on this connection; the server
    is going away)."""
    return Refusal(Status.unavailable(Phase.ADMISSION, "server is draining"), None, 503,
                   wire.CLOSE)


@functools.cache
def _shape(model: type[Body]) -> str:
    """What a body of ``model`` is, for a refusal of one that holds nothing: a JSON object
    and the fields it must have (once per model: :func:`parse` asks for every body, and the
    fields are the class's)."""
    required = [name for name, field in model.model_fields.items() if field.is_required()]
    return ("a JSON object" + (f" with {', '.join(required)}" if required else "")
            + " (application/json; docs/server.md lists the fields)")


def parse(model: type[Body], raw: bytes) -> Body:
    """The validated body, or :class:`Refusal` naming the first bad field (its path in the
    body, e.g. ``messages.0.content``: never pydantic's union branch) and value."""
    nothing = wire.no_json_value(raw, _shape(model))
    if nothing is not None:  # (pydantic's words: "Invalid JSON: EOF while parsing a value")
        raise Refusal(invalid(nothing), None)
    raw_or_why = wire.utf8_json(raw)
    if isinstance(raw_or_why, str):  # UTF-16 or -32: refused naming it
        raise Refusal(invalid(raw_or_why), None)
    raw = raw_or_why
    try:
        body = model.model_validate_json(raw)
    except ValidationError as err:
        errors = err.errors()
        first = errors[0]
        surrogate = wire.lone_surrogate(raw) if first["type"] == "json_invalid" else None
        if surrogate is not None:  # (the parser's words named neither place nor escape)
            raise Refusal(invalid(surrogate[0]), surrogate[1]) from None
        overlong = (wire.overlong_number(raw) if first["type"] == "json_invalid"
                    and "number out of range" in first["msg"] else None)
        if overlong is not None:  # (the parser's words blamed a syntax error, no field)
            raise Refusal(invalid(overlong[0]), overlong[1]) from None
        if first["type"] == "json_invalid" and "recursion limit" in first["msg"]:
            # JSON nested past the parser's depth (valid or not: it read no further); its
            # words, "Invalid JSON", blamed a valid body for a syntax error
            raise Refusal(invalid(_too_deep(first["msg"])), None) from None
        path, branches = _field_path(model, first["loc"], first["type"] == "extra_forbidden")
        # (an unknown key is the client's, of any length: cut as every echoed value is)
        param = ".".join(str(p) for p in path)[:80] or None
        if first["type"] == "extra_forbidden":
            raise Refusal(invalid(f"{param}: unknown parameter, refused (calexec does not "
                                  "ignore parameters it does not implement; docs/server.md)"),
                          param) from None
        if param is None and first["type"] == "model_type":
            # valid JSON that is no object (a batch sent as an array, null): pydantic's
            # words, "Input should be an object", named neither what came nor what is taken
            raise Refusal(invalid(f"body: must be {_shape(model)}, not "
                                  f"{wire.json_type_name(first['input'])}"), None) from None
        if param is None or first["type"] == "missing":
            raise Refusal(invalid(f"{param or 'body'}: {first['msg']}"), param) from None
        value = f"{param}={_written(raw, first['loc'], first['input'])}"
        if branches:  # a union: none of its forms matched; name them all
            forms: dict[str, None] = {}
            inside: list[tuple[list[Any], str, object, str]] = []  # (where, form, input, why)
            for error in errors:
                where, tags = _field_path(model, error["loc"])
                if tags and where[:len(path)] == path:
                    forms[tags[0]] = None
                    inside.append((where[len(path):], tags[0], error["input"], error["msg"]))
            one_of = f"must be one of {', '.join(forms)}"
            # the form the value comes closest to, the one reaching deepest into it with the
            # fewest bad items there (a list of token-id lists; a list of ids with one null):
            # name its first bad item, which the value cut to 80 characters may not show
            deepest = max((len(got[0]) for got in inside), default=0)
            bad_items: dict[str, int] = {}
            for got in inside:
                if len(got[0]) == deepest:
                    bad_items[got[1]] = bad_items.get(got[1], 0) + 1
            fewest = min(bad_items.values(), default=0)
            closest = [form for form, count in bad_items.items() if count == fewest]
            if deepest and len(closest) == 1:
                at, form, bad, why = next(got for got in inside if got[1] == closest[0]
                                          and len(got[0]) == deepest)
                item = "".join(f"[{i}]" for i in at)
                raise Refusal(invalid(f"{param}{item}={_written(raw, (*path, *at), bad)}: "
                                      f"{why[:200]} "
                                      f"(as {form}; {param} {one_of})"), param) from None
            raise Refusal(invalid(f"{value}: {one_of}"), param) from None
        raise Refusal(invalid(f"{value}: {json_quoted(first)}"), param) from None
    repeated = wire.repeated_key(raw)  # (the parser kept the last one of a key given twice)
    if repeated is not None:
        raise Refusal(invalid(repeated[0]), repeated[1])
    return body


class _Number(str):
    """A JSON number as the body wrote it (``json.loads``' ``parse_float``/``parse_int``)."""


def _written(raw: bytes, loc: tuple[int | str, ...], value: object) -> str:
    """``value``, refused at ``loc`` in the body ``raw``, as a refusal shows it: written as
    JSON, cut to 80 characters; a number that is not an integer as the body wrote it (the
    parser made a float of it: ``max_tokens: 1E0`` was told ``max_tokens=1.0``, ``1e400``
    ``Infinity``), as the sampling numbers are (``_as_written``). ``loc`` is pydantic's: a
    key the body does not hold (a union's tag) is passed over."""
    if not isinstance(value, float):
        return shown(value, 80)
    try:
        at: object = json.loads(raw, parse_float=_Number, parse_int=_Number)
    except (ValueError, RecursionError):
        return shown(value, 80)
    for key in loc:
        if isinstance(at, dict) and isinstance(key, str):
            at = at[key] if key in at else at
        elif isinstance(at, list) and isinstance(key, int) and 0 <= key < len(at):
            at = at[key]
        elif not isinstance(key, str):
            return shown(value, 80)
    return at[:80] if isinstance(at, _Number) else shown(value, 80)


#: a value pydantic's message quotes as Python does (``Input should be 'auto' or 'fast'``)
PYTHON_QUOTED = re.compile(r"'([^'\\]*)'")


def json_quoted(error: Any) -> str:
    """A pydantic error's message; a ``literal_error``'s with the values it quotes as Python
    does in JSON's double quotes (what the client writes: ``"auto"``)."""
    message = str(error["msg"])
    return PYTHON_QUOTED.sub(r'"\1"', message) if error["type"] == "literal_error" else message


def _field_path(model: type[BaseModel], loc: tuple, extra: bool = False
                ) -> tuple[list[Any], list[str]]:
    """A pydantic error location split into the field path in the body (field names and
    list indices) and the union branch tags pydantic inserts (``str``, ``list[int]``): a
    name that is no field of the models reachable at that point is a tag, except the last
    one of an ``extra`` (extra_forbidden) error, which is the unknown key itself, and the
    item after a field whose value is an object (``logit_bias``), which is the key in it."""
    path: list[Any] = []
    tags: list[str] = []
    models = {model}
    keyed = False  # the previous item was a field of object values: this one is a key
    for i, item in enumerate(loc):
        owner = next((m for m in models if isinstance(item, str) and item in m.model_fields),
                     None)
        if keyed or isinstance(item, int) or owner is not None or \
                (extra and i == len(loc) - 1):
            path.append(item)
            keyed = False
            if owner is not None:
                annotation = owner.model_fields[item].annotation
                models = set(_models_in(annotation))
                keyed = _maps(annotation)
        else:
            tags.append(str(item))
            # a union's object form (``dict[str,any]``): the item after it is a key in it
            keyed = str(item).startswith("dict[")
    return path, tags


def _maps(annotation: Any) -> bool:
    """The annotation is an object of values (``dict[str, float] | None``), so pydantic's
    next location item is a key in it. Not a union of several forms, one of them an object
    (a Responses ``tool_choice``, ``str | dict[str, Any] | None``): pydantic names the form
    first (``str``), which was taken for a key, so ``tool_choice: 5`` was refused as
    ``tool_choice.str=5`` with ``param: tool_choice.str`` (:func:`_field_path` reads a key
    after the object form's name)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        forms = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        return len(forms) == 1 and _maps(forms[0])
    return origin is dict


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``list[ChatMessage] | None`` -> ChatMessage)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


@functools.cache
def _refused_fields(model: type[_Body]) -> tuple[tuple[str, Callable[[Any], bool], str], ...]:
    """:data:`REFUSED`'s parameters ``model`` declares as ``Any`` (chat's ``echo`` is not
    ours), in its order, with their neutral test and why: once per model, not per body.
    Each takes null (:func:`refusal` does not test a null value): a neutral test refusing
    null is a ValueError naming it, here, where its table is read."""
    fields = model.model_fields
    chosen = tuple((name, neutral, why) for name, (neutral, why) in REFUSED.items()
                   if name in fields and fields[name].annotation is Any)
    refusing_null = [name for name, neutral, _why in chosen if not neutral(None)]
    if refusing_null:
        raise ValueError(f"REFUSED[{refusing_null[0]!r}]: its neutral test refuses null, "
                         "which refusal() takes without testing")
    return chosen


#: OpenAI's limits of ``metadata`` (chat and Responses alike): pairs, a key's and a value's
#: characters
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512


def metadata_refusal(metadata: dict[str, str] | None) -> None:
    """Raise :class:`Refusal` for a ``metadata`` past OpenAI's limits (16 pairs, keys of at
    most 64 characters, values of at most 512), naming the key, as OpenAI refuses it: taken
    whatever its size, a client's tags that OpenAI refuses worked here only."""
    if not metadata:
        return
    if len(metadata) > METADATA_PAIRS:
        raise Refusal(invalid(f"metadata: {len(metadata)} pairs, at most {METADATA_PAIRS}"),
                      "metadata")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY:
            raise Refusal(invalid(f"metadata key {shown(key, 80)}: {len(key)} characters, at "
                                  f"most {METADATA_KEY}"), f"metadata.{key[:80]}")
        if len(value) > METADATA_VALUE:
            raise Refusal(invalid(f"metadata.{key}: a value of {len(value)} characters, at "
                                  f"most {METADATA_VALUE}"), f"metadata.{key}")


def refusal(body: _Body) -> None:
    """Raise :class:`Refusal` for the first refused parameter with a non-neutral value.
    The values are read from the body's field dict (``vars``: a field the model lacks is
    None, as ``getattr(body, name, None)`` gave it, without pydantic's ``__getattr__``
    raising inside), and a null refused field, neutral for each of them
    (:func:`_refused_fields`), is not tested: about 40 of the event loop's Python calls a
    request fewer (issue 28, stop 73)."""
    values = vars(body)
    metadata_refusal(values.get("metadata"))
    best_of = values.get("best_of")
    if best_of is not None and (type(best_of) is not int or best_of < 1):
        # (REFUSED's "best_of > 1 is not supported" is untrue of 0, -3, true or "2")
        raise Refusal(invalid(f"best_of={shown(best_of, 80)}: must be an integer >= 1 or "
                              "null, and best_of > 1 is not supported: send 1 or leave it "
                              "out"), "best_of")
    for name, neutral, why in _refused_fields(type(body)):
        value = values[name]
        if value is not None and not neutral(value):
            raise Refusal(invalid(f"{name}={shown(value, 80)}: {why}"), name)
    if body.n < 1:
        raise Refusal(invalid(f"n={shown(body.n)}: must be >= 1"), "n")
    if best_of is not None and best_of < body.n:  # here null or 1 (REFUSED took any other)
        # OpenAI and vLLM refuse it ("best_of must be greater than or equal to n"); served,
        # the answer had n choices where the client asked for the best of one
        raise Refusal(invalid(f"best_of={shown(best_of)} < n={shown(body.n)}: best_of must be >= n (or "
                              "left out)"), "best_of")
    if body.stream_options is not None:
        if not body.stream:
            raise Refusal(invalid("stream_options: only allowed with stream=true"),
                          "stream_options")
        unknown = set(body.stream_options) - {"include_usage", "continuous_usage_stats",
                                              "include_obfuscation"}
        if unknown:
            raise Refusal(invalid(f"stream_options.{sorted(unknown)[0][:80]}: unknown option"),
                          "stream_options")
        # no obfuscation is added; continuous_usage_stats: continuous_usage()
        for key in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            # null: the option's default (false), as for a field of the body
            if body.stream_options.get(key) is not None \
                    and not isinstance(body.stream_options[key], bool):
                raise Refusal(invalid(f"stream_options.{key}="
                                      f"{shown(body.stream_options[key], 80)}: must be a "
                                      "boolean, true or false"), "stream_options")


def include_usage(body: _Body) -> bool:
    return bool(body.stream_options and body.stream_options.get("include_usage"))


def continuous_usage(body: _Body) -> bool:
    """vLLM's ``stream_options.continuous_usage_stats``: every chunk of the stream carries
    ``usage`` so far (``_Shape.continuous_usage``); only with ``include_usage`` (as vLLM's
    ``should_include_usage``: without it no chunk carries usage)."""
    return include_usage(body) and bool(body.stream_options
                                        and body.stream_options.get("continuous_usage_stats"))


#: a ``logit_bias`` key: a token id in ASCII decimal digits (no vocabulary reaches 19 digits)
TOKEN_ID_KEY = re.compile(r"[0-9]{1,18}")


def as_float(value: int | float) -> float:
    """A number field's value as a float. A JSON integer has no bound and ``float()`` raises
    OverflowError past 1.8e308: such an integer is +-inf, out of every range (as ``1e400``,
    which the JSON parser reads as inf), so the field's check refuses it naming the field."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _logit_bias(bias: dict[str, int | float] | None, vocab: int | None
                ) -> tuple[tuple[int, float], ...]:
    """``logit_bias``'s (token id, bias) pairs: keys are token ids written as strings (OpenAI),
    each in ``[0, vocab)``."""
    pairs = []
    keys: dict[int, str] = {}  # token id -> the key that named it
    for key, value in (bias or {}).items():
        # at most 18 ASCII digits: "²".isdigit() holds and int() raises on more than 4300
        token = int(key) if TOKEN_ID_KEY.fullmatch(key) else None
        if token is None or (vocab is not None and token >= vocab):
            raise Refusal(invalid(f"logit_bias[{shown_string(key, 40)}]: the key must be a token id in "
                                  f"[0, {vocab if vocab is not None else 'vocab'})"),
                          "logit_bias")
        if token in keys:  # ("1" and "01": both biases were added, past [-100, 100])
            raise Refusal(invalid(f"logit_bias[{shown_string(key, 40)}] and "
                                  f"logit_bias[{shown_string(keys[token], 40)}] both name token "
                                  f"{token}: give each token once"), "logit_bias")
        keys[token] = key
        pairs.append((token, as_float(value)))
    return tuple(pairs)


def sampling_params(body: _Body, logprobs: int | None, vocab: int | None = None,
                    end_token: int | None = None) -> SamplingParams:
    """The request's sampling parameters with a seed (drawn now when the body has none);
    ``vocab``: the served vocabulary size, when known (token ids in ``stop_token_ids`` and
    ``logit_bias`` must be in it); ``end_token``: the server's, held back by ``min_tokens``."""
    stop = [body.stop] if isinstance(body.stop, str) else (body.stop or [])
    stop_ids = body.stop_token_ids or []
    for field, ids in (("stop_token_ids", stop_ids),
                       ("allowed_token_ids", body.allowed_token_ids or [])):
        bad = next((i for i, t in enumerate(ids) if vocab is not None and t >= vocab), None)
        if bad is not None:
            raise Refusal(invalid(f"{field}[{bad}]={shown(ids[bad])} outside the vocabulary "
                                  f"[0, {vocab})"), field)

    # vLLM's rule: a minimum above the maximum the body gives can never be met (without a
    # max_tokens in the body the server's default is no promise, so nothing is refused)
    given = body.max_tokens if body.max_tokens is not None else getattr(
        body, "max_completion_tokens", None)
    if body.min_tokens is not None and given is not None and body.min_tokens > given:
        field = "max_tokens" if body.max_tokens is not None else "max_completion_tokens"
        raise Refusal(invalid(f"min_tokens={shown(body.min_tokens)}: must be <= "
                              f"{field}={shown(given)}"),
                      "min_tokens")

    # (a number field's default when null, written out per field: a helper's call for each
    # of six fields was 6 of the event loop's Python calls a request; issue 28, stop 73)
    temperature, top_p, min_p = body.temperature, body.top_p, body.min_p
    repetition, presence, frequency = (body.repetition_penalty, body.presence_penalty,
                                       body.frequency_penalty)
    try:
        params = SamplingParams(
            temperature=0.0 if temperature is None else as_float(temperature),
            top_p=1.0 if top_p is None else as_float(top_p),
            top_k=-1 if body.top_k is None else body.top_k,
            # the seed drawn here when the body has none (what resolved() would draw after):
            # one construction of the frozen params per request, not two
            seed=body.seed if body.seed is not None else draw_seed(), stop=stop,
            stop_token_ids=stop_ids, logprobs=logprobs,
            min_p=0.0 if min_p is None else as_float(min_p),
            repetition_penalty=1.0 if repetition is None else as_float(repetition),
            presence_penalty=0.0 if presence is None else as_float(presence),
            frequency_penalty=0.0 if frequency is None else as_float(frequency),
            logit_bias=_logit_bias(body.logit_bias, vocab),
            min_tokens=0 if body.min_tokens is None else body.min_tokens,
            end_token_ids=() if end_token is None else (end_token,),
            ignore_eos=body.ignore_eos, allowed_token_ids=body.allowed_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output)
    except SamplingError as err:
        raise Refusal(invalid(_as_written(err, body)), err.field.split("[")[0]) from None
    return params


def _too_deep(said: str) -> str:
    """The message refusing a body nested past the JSON parser's depth (pydantic's ``said``:
    "Invalid JSON: recursion limit exceeded at line 1 column 206"), naming where. The parser
    stops there, so nothing says whether the rest is valid JSON (``[`` * 100000, never
    closed, is not): the message claims neither."""
    where = said.partition(" exceeded")[2].strip()
    return (f"body: nested deeper than the server's JSON parser reads{' ' + where if where else ''}"
            " (about 200 levels of arrays and objects; RFC 8259 section 9 lets a parser "
            f"bound the nesting): {error_bodies.TOO_DEEP_ADVICE}")



def _as_written(err: SamplingError, body: _Body) -> str:
    """``err``'s message with the number it refused as the body wrote it: the sampling
    parameters hold floats, so ``top_p: 0`` was told ``top_p=0.0``, ``logit_bias: {"5":
    101}`` ``logit_bias[5]=101.0`` and an integer past a double's range (``temperature:
    1000...0``) ``Infinity``, none of which the client wrote."""
    message = str(err)
    told = f"{err.field}={shown(err.value, 80)}"
    name, _, key = err.field.partition("[")
    if name == "logit_bias":
        written = next((value for given, value in (body.logit_bias or {}).items()
                        if TOKEN_ID_KEY.fullmatch(given) and f"{int(given)}]" == key), None)
    else:
        written = getattr(body, name, None) if name in _FLOAT_FIELDS else None
    if written is None or isinstance(written, bool) or not message.startswith(told):
        return message
    return f"{err.field}={shown(written, 80)}{message[len(told):]}"


#: the body's number fields the sampling parameters hold as floats (``sampling_params``)
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "repetition_penalty",
                           "presence_penalty", "frequency_penalty"})


# ---- authentication and model names ---------------------------------------------------------
def auth_refusal(request: Request, api_key: str | None) -> Refusal | None:
    """None when no key is configured or ``Authorization: Bearer <key>`` matches (constant
    time); else a 401 refusal."""
    if api_key is None:
        return None
    given = request.headers.getlist("authorization")
    if len(given) > 1:
        # one credential (RFC 9110 section 11.6.2: not a list field); the first was taken,
        # so a key behind a wrong one was refused and a wrong one behind the key let in,
        # whichever a proxy in front read
        return Refusal(Status.failure("request.invalid_api_key", Category.INVALID_REQUEST,
                                      Phase.VALIDATE, f"Authorization given {len(given)} times: "
                                      "send one, Authorization: Bearer <key>"), None, 401)
    scheme, _, token = (given[0] if given else "").partition(" ")
    if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode("utf-8"),
                                                          api_key.encode("utf-8")):
        return None
    return Refusal(Status.failure("request.invalid_api_key", Category.INVALID_REQUEST, Phase.VALIDATE,
                                  "missing or wrong API key: send Authorization: Bearer <key>"),
                   None, 401)


def query_field_refusal(request: Request, model: type[Body]) -> Refusal | None:
    """The 400 of a field of ``model``'s body given in the query (``POST
    /v1/completions?stream=true``, ``/tokenize?add_special_tokens=false``): the API's routes
    read their parameters from the JSON body alone, so it answered as if unsaid (a whole
    answer where a stream was asked). A query parameter no body field is named so (an Azure
    client's ``api-version``) is not the body's and is ignored, as OpenAI and vLLM ignore it.
    A request without a query (nearly every one) is not parsed for one: Starlette's
    ``query_params`` of an empty query string has no key (about 10 of the event loop's Python
    calls a request; issue 28, stop 73)."""
    if not request.scope.get("query_string"):
        return None
    given = sorted(key for key in request.query_params if key in model.model_fields)
    if not given:
        return None
    key = given[0]
    return Refusal(invalid(f"{key}={shown(request.query_params[key], 64)}: given in the query, "
                           f"which this route does not read; send {key} in the JSON body"), key)


def model_refusal(name: str | None, served: tuple[str, ...]) -> Refusal | None:
    """404 ``model_not_found`` unless ``name`` is absent or one of the served names."""
    if name is None or name in served:
        return None
    return Refusal(Status.failure("request.model_not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
                                  f"model={shown(name, 200)} does not exist; served: "
                                  f"{', '.join(served)}"), "model", 404)


# ---- chat template --------------------------------------------------------------------------
#: fields of a history message this model cannot render (no audio; the deprecated function
#: calls: tool_calls are rendered): refused unless null (or an empty list)
UNRENDERABLE = {"function_call": "the deprecated function_call: send tool_calls instead",
                "audio": "audio in the history is not supported"}


def content_refusal(message: ChatMessage, index: int) -> Refusal | None:
    """The 400 for a message without a field its role needs, as OpenAI answers it (None when
    it has them): ``content`` (missing, null, or an empty list of parts) for a system,
    developer or user message and for a tool message, which also needs ``tool_call_id``; an
    assistant message may leave ``content`` out when it has ``tool_calls`` (or, as the SDK
    dumps a refused answer, a ``refusal``; or reasoning, a reply cut while it reasoned)."""
    role = message.role
    if role == "tool" and message.tool_call_id is None:
        return Refusal(invalid(f"messages[{index}].tool_call_id: missing, a \"tool\" message "
                               "needs the id of the call it answers"),
                       f"messages.{index}.tool_call_id")
    if message.content is not None and message.content != []:
        return None
    if role == "assistant":
        if (message.tool_calls or message.refusal is not None
                or message.reasoning_content is not None or message.reasoning is not None):
            return None  # (a reply cut while it reasoned: its reasoning, no content)
        needs = "content or tool_calls"
    else:
        needs = "content (a string or a list of text parts)"
    field = f"messages[{index}].content"
    given = f"{field}: missing (or null)" if message.content is None else f"{field}=[]: no part"
    return Refusal(invalid(f"{given}, a {shown(role)} message needs {needs}"),
                   f"messages.{index}.content")


#: content parts whose ``text`` is text: chat's own, and the Responses API's, which vLLM's chat
#: takes as text too (a conversation carried over from /v1/responses)
TEXT_PARTS = ("text", "input_text", "output_text")
#: the keys each kind of content part takes, chat's and the Responses API's: its ``type`` and
#: its text, and what the SDK (3.51) sends with it, each ignored: a text part's
#: ``prompt_cache_breakpoint`` (a caching hint: nothing is cached, as ``prompt_cache_options``),
#: an output part's ``annotations`` and ``logprobs`` as a Response gave them back and
#: ``parsed`` (``responses.parse``). Another key is refused naming it, as an unknown field of
#: the body is (until stop 73 it was taken without a word: a typo'd ``txt`` beside ``text``)
PART_KEYS: dict[str, frozenset[str]] = {
    "text": frozenset({"type", "text", "prompt_cache_breakpoint"}),
    "input_text": frozenset({"type", "text", "prompt_cache_breakpoint"}),
    "output_text": frozenset({"type", "text", "annotations", "logprobs", "parsed"}),
    "refusal": frozenset({"type", "refusal"}),
}


def unknown_part_key(part: dict[str, Any], at: str, param: str) -> Refusal | None:
    """The 400 naming the first key of content part ``part`` (at ``at``, ``param`` its
    path) that :data:`PART_KEYS` does not list for its type; None when there is none (or the
    type is not one of them: its own refusal says so)."""
    kind = part.get("type")
    keys = PART_KEYS.get(kind) if isinstance(kind, str) else None
    extra = sorted(str(key) for key in part if keys is not None and key not in keys)
    if not extra:
        return None
    return Refusal(invalid(f"{at}.{extra[0][:80]}: unknown key of a {kind} part, "
                           "refused"), f"{param}.{extra[0][:80]}")


def tool_answer_refusal(messages: list[ChatMessage]) -> Refusal | None:
    """The 400 of a ``tool`` message answering no call of the assistant message it follows,
    in OpenAI's words (None when each answers one): a tool message must follow an assistant
    message with ``tool_calls`` (other tool messages between them, the answers to its other
    calls), ``param: messages.N.role``, and its ``tool_call_id`` must be one of those calls'
    ids, ``param: messages.N.tool_call_id``. Until stop 75 either was taken: the model read an
    answer to a call it never made (a history trimmed between the call and its answer, a
    mistyped id). The Responses API's ``function_call_output`` has its own rule
    (``responses_api.orphan_output``: a ``function_call`` item of the input has its
    ``call_id``). A tool message without ``tool_call_id`` is ``content_refusal``'s."""
    calls: list[Any] | None = None  # the ids of the assistant message the tool ones answer
    called_at = -1
    for index, message in enumerate(messages):
        if message.role == "assistant" and message.tool_calls:
            calls = [call.get("id") for call in message.tool_calls if isinstance(call, dict)]
            called_at = index
        elif message.role != "tool":
            calls = None
        elif message.tool_call_id is None:
            continue
        elif calls is None:
            before = (f"messages[{index - 1}] is a {shown(messages[index - 1].role, 40)} "
                      "message" + (" without tool_calls" if messages[index - 1].role
                                   == "assistant" else "") if index else "it is the first")
            return Refusal(invalid(
                f"messages[{index}].role='tool': messages with role 'tool' must be a response "
                f"to a preceeding message with 'tool_calls' ({before}; send the assistant "
                "message with the call before its answer)"), f"messages.{index}.role")
        elif message.tool_call_id not in calls:
            listed = ", ".join(shown(str(c), 60) for c in calls[:8]) or "none with an id"
            return Refusal(invalid(
                f"messages[{index}].tool_call_id={shown(message.tool_call_id, 80)}: "
                f"'tool_call_id' of {shown(message.tool_call_id, 80)} not found in "
                f"'tool_calls' of previous message (messages[{called_at}] calls {listed})"),
                f"messages.{index}.tool_call_id")
    return None


def message_text(message: ChatMessage, index: int) -> str:
    """The text of a message: a string, or its text parts (:data:`TEXT_PARTS`; an assistant's
    ``refusal`` parts, which the SDK's ``ChatCompletionAssistantMessageParam`` allows, by
    their ``refusal``) joined by a line end, as vLLM joins them for a text model's template
    (they were run together: "Part one.Part two."); other parts refused; an assistant
    message without content: its ``refusal``, if any."""
    if message.role not in CHAT_ROLES:
        raise Refusal(invalid(f"messages[{index}].role={shown(message.role, 80)}: must be one of "
                              f"{', '.join(CHAT_ROLES)}"), f"messages.{index}.role")
    for key, why in UNRENDERABLE.items():
        value = getattr(message, key)
        if value is not None and value != []:
            raise Refusal(invalid(f"messages[{index}].{key}={shown(value, 80)}: {why}"),
                          f"messages.{index}.{key}")
    missing = content_refusal(message, index)
    if missing is not None:
        raise missing
    if message.content is None:
        return message.refusal or ""
    if isinstance(message.content, str):
        return message.content
    texts = []
    for j, part in enumerate(message.content):
        at = f"messages[{index}].content[{j}]"
        kind = part.get("type")
        field = ("text" if kind in TEXT_PARTS
                 else "refusal" if kind == "refusal" and message.role == "assistant" else None)
        if field is None:
            raise Refusal(invalid(f"{at}.type={shown(kind, 80)}: only text parts are "
                                  f"supported ({', '.join(TEXT_PARTS)}; refusal in an "
                                  "assistant message)"), f"messages.{index}.content.{j}.type")
        if not isinstance(part.get(field), str):
            raise Refusal(invalid(f"{at}.{field}={shown(part.get(field), 80)}: must be a string"),
                          f"messages.{index}.content.{j}.{field}")
        unknown = unknown_part_key(part, at, f"messages.{index}.content.{j}")
        if unknown is not None:
            raise unknown
        texts.append(part[field])
    return "\n".join(texts)


#: an assistant message's reasoning: vLLM's older name and its newer one
REASONING_FIELDS = ("reasoning_content", "reasoning")


def reasoning_text(message: ChatMessage, index: int) -> str | None:
    """An assistant message's reasoning, None when it has none: its ``reasoning_content`` or
    ``reasoning`` (one text under two names: vLLM reads ``reasoning`` and gives the template
    both; clients of older vLLM, DeepSeek, litellm and pydantic-ai send
    ``reasoning_content``; litellm also its ``provider_specific_fields.reasoning``). Refused
    (400 naming the field): two of them given and different (one would be lost), reasoning
    on another role's message (no template reads it there), and
    non-empty ``thinking_blocks`` (litellm's Anthropic blocks: signed for Anthropic,
    nothing a Qwen3 template reads; send their text as ``reasoning_content``)."""
    if message.thinking_blocks:
        raise Refusal(invalid(f"messages[{index}].thinking_blocks="
                              f"{shown(message.thinking_blocks, 80)}: Anthropic-style thinking "
                              "blocks are not supported: send the reasoning text as "
                              "reasoning_content (or null/[] thinking_blocks)"),
                      f"messages.{index}.thinking_blocks")
    given = {key: value for key in REASONING_FIELDS
             if (value := getattr(message, key)) is not None}
    for key, value in (message.provider_specific_fields or {}).items():
        if key not in REASONING_FIELDS or value is None:
            continue  # (litellm's other provider metadata: nothing a template reads)
        field = f"provider_specific_fields.{key}"
        if not isinstance(value, str):
            raise Refusal(invalid(f"messages[{index}].{field}={shown(value, 80)}: must be a "
                                  "string (the reasoning text) or null"),
                          f"messages.{index}.{field}")
        given[field] = value
    if not given:
        return None
    if message.role != "assistant":
        key = next(iter(given))
        raise Refusal(invalid(f"messages[{index}].{key}={shown(given[key], 80)}: only an "
                              f"assistant message carries reasoning, not a "
                              f"{shown(message.role, 80)} one"), f"messages.{index}.{key}")
    first, *others = given.items()
    for key, value in others:
        if value != first[1]:
            raise Refusal(invalid(f"messages[{index}].{key}={shown(value, 80)}: differs from "
                                  f"its {first[0]}={shown(first[1], 80)}; send one of them "
                                  "(they are one text under two names)"),
                          f"messages.{index}.{key}")
    return first[1]


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """A message as the chat template reads it: role and content, its ``name`` when given
    (as vLLM passes it: a template may write the speaker's name; it was dropped), an
    assistant's reasoning as ``reasoning_content`` and ``reasoning`` (as vLLM passes it:
    Qwen3's template writes it in ``<think>`` for the turns after the last user message;
    the plain template does not write it), an assistant's ``tool_calls`` (checked:
    grammar.check_history_calls), a tool message's ``tool_call_id``."""
    entry: dict[str, Any] = {"role": message.role, "content": message_text(message, index)}
    if message.name is not None:
        entry["name"] = message.name
    reasoning = reasoning_text(message, index)
    if reasoning is not None:
        entry["reasoning_content"] = entry["reasoning"] = reasoning
    if message.tool_calls:
        try:
            entry["tool_calls"] = grammar.check_history_calls(
                message.tool_calls, f"messages.{index}.tool_calls")
        except grammar.GrammarError as err:
            raise Refusal(invalid(str(err)), err.param) from None
    if message.tool_call_id is not None:
        entry["tool_call_id"] = message.tool_call_id
    return entry


def render_chat(messages: list[ChatMessage], tok: Tokenizer, add_generation_prompt: bool = True,
                template_kwargs: dict[str, Any] | None = None,
                continue_final: bool = False, tools: grammar.ToolSetup | None = None) -> str:
    """The prompt text of ``messages``: the tokenizer's chat template (Jinja, sandboxed, as
    transformers renders it, with ``template_kwargs`` as extra variables: vLLM's
    ``chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``) when it has one, else the plain
    template (which has no such switches). ``add_generation_prompt``: open the assistant's
    turn (the plain template's ``assistant:``). ``continue_final``: vLLM's
    ``continue_final_message``, the last message (an assistant's) left open so the reply
    continues it: the text is cut right after its content. ``tools``: the request's tools,
    the template's ``tools`` variable (the plain template: a ``tools:`` line first); an
    assistant's ``tool_calls`` are the template's to render (the plain one writes them as
    Qwen3 does, after the content)."""
    plain = [_template_message(m, i) for i, m in enumerate(messages)]
    if continue_final:
        if add_generation_prompt:
            raise Refusal(invalid("continue_final_message=true needs add_generation_prompt="
                                  "false (the final message is continued, no new turn)"),
                          "continue_final_message")
        if plain[-1]["role"] != "assistant":
            raise Refusal(invalid(f"continue_final_message=true: the last message is a "
                                  f"{shown(plain[-1]['role'])} one, not an assistant's"),
                          "continue_final_message")
    template = getattr(tok, "chat_template", None)
    declared = list(tools.declared) if tools is not None and tools.declared else None
    if not template:
        text = (grammar.tools_preamble(declared) if declared else "") + "".join(
            f"{m['role']}: {m['content']}"
            f"{grammar.call_text(m['tool_calls']) if m.get('tool_calls') else ''}\n"
            for m in plain) + ("assistant:" if add_generation_prompt else "")
        return text[:-1] if continue_final else text  # no line end: the message goes on
    text = _render_template(template, tok, plain, add_generation_prompt,
                            {**(template_kwargs or {}), **({"tools": declared} if declared else {})})
    if continue_final:
        final = plain[-1]["content"]
        at = text.rfind(final) if final else -1
        if at < 0 and final.strip():  # a template that trims the content (Llama 3.1's
            # ``| trim``): cut after the trimmed text, as transformers does (it was refused)
            final = final.strip()
            at = text.rfind(final)
        if at < 0:
            raise Refusal(invalid("continue_final_message=true: the chat template does not "
                                  "write the final message's content as it is"),
                          "continue_final_message")
        text = text[:at + len(final)]
    return text


def _render_template(template: str, tok: Tokenizer, plain: list[dict[str, Any]],
                     add_generation_prompt: bool, template_kwargs: dict[str, Any] | None
                     ) -> str:
    try:
        return _jinja_template(template).render(**{
            **(template_kwargs or {}), "messages": [_with_parsed_arguments(m) for m in plain],
            "add_generation_prompt": add_generation_prompt, "bos_token": tok.bos_token,
            "eos_token": tok.eos_token})
    except Exception as err:  # noqa: BLE001 - a template's raise_exception() or a rendering error
        raise Refusal(invalid(f"messages: the chat template refused them: {err}"),
                      "messages") from None


def _jinja_template(source: str) -> Any:
    return compiled_chat_template(source)


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """``message`` as a chat template reads an assistant's tool calls: each call's
    ``arguments`` (OpenAI's JSON text) parsed into its value, as transformers' templates expect
    them and vLLM passes them (Llama 3.1 writes ``arguments | tojson``: given the text, it
    wrote the arguments as one quoted string; Qwen3-Coder's ``arguments | items`` failed);
    empty arguments are ``{}``; text that is no JSON stays as given."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        fn = dict(call["function"])
        text = fn.get("arguments")
        if not text:
            fn["arguments"] = {}
        else:
            try:
                fn["arguments"] = json.loads(text)
            except (ValueError, RecursionError):
                pass  # the model's own text, written as it is
        parsed.append({**call, "function": fn})
    return {**message, "tool_calls": parsed}


# ---- text, stop strings, logprobs -----------------------------------------------------------
class TextOutput:
    """Tokens -> text, cut at the first stop string (not included, like OpenAI; included with
    ``keep_stop``, vLLM's ``include_stop_str_in_output``). ``add``
    returns the text that became final; text that could still start a stop string is held
    back until it cannot. ``stopped`` once a stop string matched. With ``min_tokens`` (vLLM's),
    a stop string counts only once more than that many tokens were added, and only a match
    that ends in the text after theirs, as vLLM's detokenizer checks them."""

    def __init__(self, tok: Tokenizer, stop: tuple[str, ...], keep_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self._detok = tok.detokenizer()
        self._stop = stop
        self._keep_stop = keep_stop  # vLLM's include_stop_str_in_output
        self._min_tokens = min_tokens
        self._tokens = 0
        self._check_from = 0  # no stop string may end at or before this index of ``text``
        self.text = ""
        self._sent = 0
        self.stopped = False
        #: the stop string that ended the text (vLLM's ``stop_reason``), once ``stopped``
        self.stop_string: str | None = None
        # the hold-back (``_held``): per stop string, its KMP prefix function and the length
        # of its longest prefix the text ends with, carried over the characters fed so far
        self._prefix = [_prefix_function(s) for s in stop]
        self._matched = [0] * len(stop)
        self._fed = 0

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self._tokens += 1
        return self._emit(self._unchecked(self.text + self._detok.feed(token)), final=False)

    def flush(self) -> str:
        if self.stopped:
            return ""
        return self._emit(self._unchecked(self.text + self._detok.flush()), final=True)

    def _unchecked(self, text: str) -> str:
        """``text``, noting that none of it may end a stop string while at most
        ``min_tokens`` tokens were added."""
        if self._tokens <= self._min_tokens:
            self._check_from = len(text)
        return text

    @property
    def sent(self) -> int:
        """Characters of ``text`` already returned by :meth:`add` (the client has them)."""
        return self._sent

    def _emit(self, text: str, final: bool) -> str:
        if self._stop:
            start = max(0, self._sent - max(len(s) for s in self._stop))
            hits = [(p, len(s), s) for p, s in
                    ((text.find(s, max(start, self._check_from - len(s) + 1)), s)
                     for s in self._stop) if p >= 0]
            if hits:
                at, length, self.stop_string = min(hits)  # the first match (the shorter
                # string at a tie)
                text = text[:at + length] if self._keep_stop else text[:at]
                self.stopped = final = True
        self.text = text
        # (no stop string: nothing is held back, ``_held`` would say 0; not asked, about 16
        # of the event loop's Python calls a plain request; issue 28, stop 73)
        end = len(text) if final or not self._stop else len(text) - self._held(text)
        piece = text[self._sent:end]
        self._sent = max(self._sent, end)
        return piece

    def _held(self, text: str) -> int:
        """Length of the longest end of ``text`` that starts some stop string (shorter than
        it: a whole one is a match). ``text`` extends the one of the previous call: only its
        new characters are fed to each stop string's matcher (KMP), so a token costs its own
        characters, not every suffix up to each stop string's length."""
        new = text[self._fed:]
        self._fed = len(text)
        for j, s in enumerate(self._stop):
            k = self._matched[j]
            if k == 0 and s[0] not in new:
                continue  # (the usual case: nothing of it started, nor starts here)
            prefix = self._prefix[j]
            for c in new:
                while k and s[k] != c:
                    k = prefix[k - 1]
                if s[k] == c:
                    k += 1
                    if k == len(s):  # a whole match (``_emit`` ended the text there)
                        k = prefix[k - 1]
            self._matched[j] = k
        return max(self._matched, default=0)


def finished_text(out: TextOutput, run: RequestRun) -> str:
    """The rest of the answer's text once ``run``'s generation ended (``out.flush``): the
    text held back, after the stop token's own when one ended it and the request asked for
    ``include_stop_str_in_output`` (vLLM writes it then)."""
    piece = ""
    if run.stop_token is not None and run.sampling.include_stop_str_in_output:
        piece = out.add(run.stop_token)
    return piece + out.flush()


def _prefix_function(s: str) -> list[int]:
    """KMP's prefix function of ``s``: entry i is the length of the longest proper prefix of
    ``s[:i + 1]`` that also ends it."""
    table = [0] * len(s)
    k = 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = table[k - 1]
        if s[i] == s[k]:
            k += 1
        table[i] = k
    return table


def prompt_rows(body: CompletionRequest) -> int | None:
    """How many top tokens each prompt position keeps (``Admission.prompt_logprobs``), or
    None when the prompt's log-probabilities are not asked for: ``echo`` with ``logprobs``
    (OpenAI) and ``prompt_logprobs`` (vLLM) both need them."""
    if body.prompt_logprobs is not None and \
            not 0 <= body.prompt_logprobs <= sampling.MAX_LOGPROBS:
        raise Refusal(invalid(f"prompt_logprobs={shown(body.prompt_logprobs)}: must be in "
                              f"[0, {sampling.MAX_LOGPROBS}]"), "prompt_logprobs")
    wanted = [n for n in (body.logprobs if body.echo else None, body.prompt_logprobs)
              if n is not None]
    return max(wanted) if wanted else None


def echo_logprobs(tok: Tokenizer, prompt: list[int], rows: list[TokenLogprobs], top: int,
                  offset: int) -> dict[str, Any]:
    """The prompt's part of an echoed completion's ``logprobs``: one entry per prompt token,
    the first one's logprob and top null (nothing precedes it), as OpenAI and vLLM answer;
    ``top`` most likely tokens per position (the request's ``logprobs``)."""
    tokens = [tok.token_text(t) for t in prompt]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {"tokens": tokens,
            "token_logprobs": [None] + [r.logprob for r in rows],
            "top_logprobs": [None] + [top_entries(tok, r, top) for r in rows],
            "text_offset": offsets}


def top_entries(tok: Tokenizer, info: TokenLogprobs, k: int | None = None) -> dict[str, float]:
    """One position's ``top_logprobs``: its ``k`` (default: all kept) most likely tokens and
    the token at the position (the sampled one, or the prompt's), so up to k + 1 entries
    (OpenAI: "the API will always return the logprob of the sampled token"; vLLM does the same,
    and ``logprobs: 0`` is that token alone). The map is keyed by text, so two tokens of one
    text (byte pieces of a character, each U+FFFD on its own) are one entry holding the more
    likely one's logprob, the first of ``info.top`` (most likely first): until stop 66 the less
    likely one's replaced it, as vLLM's dict comprehension still does (vllm-project/vllm#44319),
    so that the sampled token's own entry could be less than its ``token_logprobs``; sglang's
    fix keeps the first (sgl-project/sglang#32387). Chat's list keeps every token apart."""
    entries: dict[str, float] = {}
    for t, lp in info.top[:k]:
        entries.setdefault(tok.token_text(t), lp)
    entries.setdefault(tok.token_text(info.token), info.logprob)
    return entries


def vllm_prompt_logprobs(tok: Tokenizer, prompt: list[int], rows: list[TokenLogprobs],
                         ranks: list[int], top: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: null for the first prompt token, then per token a map
    token id -> ``{"logprob", "rank", "decoded_token"}`` holding the prompt token and the
    ``top`` most likely ones (rank 1 the most likely)."""
    out: list[dict[str, Any] | None] = [None]
    for token, row, rank in zip(prompt[1:], rows, ranks):
        entry = {str(t): {"logprob": lp, "rank": i + 1, "decoded_token": tok.token_text(t)}
                 for i, (t, lp) in enumerate(row.top[:top])}
        entry[str(token)] = {"logprob": row.logprob, "rank": rank,
                             "decoded_token": tok.token_text(token)}
        out.append(entry)
    return out


def completion_logprobs(tok: Tokenizer, infos: list[TokenLogprobs], offset: int) -> dict[str, Any]:
    """The legacy completions ``logprobs`` object (``top_logprobs``: ``top_entries``)."""
    tokens = [tok.token_text(i.token) for i in infos]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)

    return {"tokens": tokens, "token_logprobs": [i.logprob for i in infos],
            "top_logprobs": [top_entries(tok, i) for i in infos], "text_offset": offsets}


def chat_logprobs(tok: Tokenizer, infos: list[TokenLogprobs]) -> dict[str, Any]:
    """The chat ``logprobs`` object: ``{"content": [...]}``."""
    def entry(token: int, logprob: float) -> dict[str, Any]:
        return {"token": tok.token_text(token), "logprob": logprob,
                "bytes": tok.token_bytes(token)}
    return {"content": [{**entry(i.token, i.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in i.top]} for i in infos]}


# ---- continuing a generation handed over by another replica (drivers/serving/handoff.py) -----
#: how a stream handed to a sibling by a draining replica ends here (the client never sees it)
HANDED_OFF = Status.unavailable(Phase.ADMISSION, "replica draining: the request was handed to "
                                "a sibling replica")


def handed_off(run: RequestRun) -> None:
    """``run`` ends here, handed to a sibling replica by a drain: its status says so (the
    client never sees it), and it is counted as no failure (``metrics.mark_handed_off``)."""
    run.status, run.handed_off = HANDED_OFF, True
    metrics.mark_handed_off()


def resume_refusal(resume: handoff.Resume, run: RequestRun) -> Refusal | None:
    """Why ``resume`` cannot continue ``run`` (None: it can)."""
    tokens = resume.tokens
    bad = next((i for i, t in enumerate(tokens) if t >= run.logits.shape[0]), None)
    if bad is not None:
        return Refusal(invalid(f"resume.tokens[{bad}]={shown(tokens[bad])} outside the vocabulary "
                               f"[0, {run.logits.shape[0]})"), "resume")
    if len(tokens) > run.max_tokens:
        return Refusal(invalid(f"resume.tokens: {len(tokens)} tokens > max_tokens="
                               f"{run.max_tokens}"), "resume")
    return None


def continue_from(resume: handoff.Resume, run: RequestRun, out: TextOutput, shape: _Shape,
                  sse: bool) -> None:
    """Set ``run`` up to continue after ``resume.tokens`` (its first job re-prefills prompt
    + tokens, ``RequestRun.next_request``; token ``len(tokens)`` is sampled with the same
    seed and index as it would have been) and rebuild what the client was already sent: the
    detokenizer and stop-string hold-back state (``out``), the id, ``created``, echo, text
    offsets and the chat opening (``shape``). A whole (non-streaming) answer with logprobs
    (or prompt logprobs) needs every token's logprobs (and the prompt's rows): it restarts
    from the prompt with the same seed instead. A stream that sent tokens sent the prompt's
    logprobs with the first: they are not computed again."""
    tokens = list(resume.tokens)
    if not sse and (run.sampling.logprobs is not None or run.prompt_top is not None):
        tokens = []
    run.tokens = tokens
    if tokens:
        run.prompt_top = None
    for token in tokens:
        out.add(token)
    shape.resumed(resume, len(tokens) if sse else 0, out.sent)  # a whole answer: none sent
    if out.stopped:
        run.finish_reason, run.stop_reason = "stop", out.stop_string
    elif len(tokens) >= run.max_tokens:
        run.finish_reason = "length"


# ---- several choices: prompt lists and n ----------------------------------------------------
def choices_refusal(prompts: int, n: int, cap: int) -> None:
    """Raise :class:`Refusal` when ``prompts`` x ``n`` choices exceed the server's
    ``max_choices`` (naming ``n``, or ``prompt`` when n is 1)."""
    if prompts * n <= cap:
        return
    if n == 1:
        raise Refusal(invalid(f"prompt: {prompts} prompts > max_choices={cap}, the server's "
                              "cap on choices (prompts x n) per request; send fewer"),
                      "prompt")
    raise Refusal(invalid(f"n={shown(n)}: {prompts} prompt(s) x n = {shown(prompts * n)} choices > "
                          f"max_choices={cap}, the server's cap per request"), "n")


log = logging.getLogger("calexec.server")


def unexpected_failure(request: Request, exc: BaseException) -> Status:
    """The answer to a completion that met an error this server did not foresee (a bug)
    after its response or its choices started: the app's 500 (``server.unexpected_error``,
    drivers/serving/server.py), logged with its traceback. A stream sends it as its error
    event; a request of several choices answers it instead of its other choices."""
    log.error("request %s: %s %s: unexpected %s (traceback below)",
              wire.request_id(request.scope), request.method, request.url.path[:200],
              type(exc).__name__, exc_info=exc)
    return Status.failure("server.unexpected_error", Category.PROGRAMMING, Phase.VALIDATE,
                          f"{request.method} {request.url.path[:200]}: an unexpected error "
                          f"({type(exc).__name__}); the server logged it")


def choice_seed(seed: int | None, k: int) -> int | None:
    """The seed of choice ``k`` of a prompt with ``seed`` (k < n: its index among that
    prompt's ``n`` choices): choice 0 keeps it (n=1 draws the same), the others get one
    derived from (seed, k), so every choice of a prompt draws differently, the same request
    draws the same choices again, and a prompt of a list draws what it draws alone."""
    if seed is None or k == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{k}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1  # in [0, 2**63): a valid seed


def fleet_retryable(status: Status, service: CompletionService) -> bool:
    """Whether a stream that ends with ``status`` is one the fleet ingress may resume on a
    sibling (its progress report's ``retryable``): a retryable or device-side category, or a
    replica that no longer serves (draining, recovering); never an operator's cancel
    (``request.aborted``), which a sibling would otherwise run again from where it stopped
    when the cancelling replica drains."""
    if status.code == ABORTED:
        return False
    return status.category in RESUMABLE or not service.ready


class _Choices:
    """The shared state of a request of several choices (``_generate_many``)."""

    def __init__(self, n: int, count: int, response_id: str, x_request_id: str,
                 service: CompletionService) -> None:
        self.n = n
        #: counts the choices waiting for room (``calexec_stream_choices_waiting``)
        self._service = service
        self.id, self.created = response_id, int(time.time())
        #: the response's ``x-request-id`` (each choice's dump record names it)
        self.x_request_id = x_request_id
        #: (status, param, counted already by the run's finish)
        self.failure: tuple[Status, str | None, bool] | None = None
        self.results: list[dict[str, Any] | None] = [None] * count
        self.extra: dict[str, Any] = {}
        self.runs: list[RequestRun] = []
        #: a stream's ``wire.SendCut`` (each run holds it: a cancel cuts a stalled send)
        self.sending: wire.SendCut | None = None
        #: the shapes of the choices started so far (the first one opens every choice)
        self.shapes: list[_Shape] = []
        #: a stream's chunks, in the order the choices make them; None: every choice ended
        self.events: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        #: at most this many chunks wait for the sender (:meth:`put`): a client that stops
        #: reading holds its choices back, as one choice's stream is held
        self.room = STREAM_AHEAD * count
        self._taken = asyncio.Event()
        self.prompt_tokens = self.completion_tokens = 0
        #: the fleet's progress channel (drivers/serving/handoff.py), None without it
        self.progress: Callable[[dict], None] | None = None
        #: a resumed stream: the events of each choice its client already has (not sent)
        self.skip: list[int] = [0] * count
        self._events_of = [0] * count

    @staticmethod
    def index_of(chunk: dict[str, Any]) -> int | None:
        """The choice a stream's chunk is of (None: no choice's)."""
        choices = chunk.get("choices")
        if isinstance(choices, list) and len(choices) == 1 and isinstance(choices[0], dict):
            index = choices[0].get("index")
            return index if isinstance(index, int) else None
        return None

    def owed(self, k: int | None) -> bool:
        """Whether choice ``k``'s next event goes to the client (not one a resumed stream's
        client has); reported to the fleet's progress channel before it goes out."""
        if k is None or not 0 <= k < len(self.skip):
            return True
        self._events_of[k] += 1
        if self._events_of[k] <= self.skip[k]:
            return False
        if self.progress is not None:
            self.progress({"events": [k]})
        return True

    async def put(self, chunk: dict[str, Any]) -> None:
        """Queue a stream's chunk, once there is room (the sender took enough); a choice
        waiting for room is counted in ``service.stream_choices_waiting``."""
        if self.events.qsize() >= self.room:
            self._service.stream_choices_waiting += 1
            try:
                while self.events.qsize() >= self.room:
                    self._taken.clear()
                    await self._taken.wait()
            finally:  # (a cut or a disconnect cancels the wait)
                self._service.stream_choices_waiting -= 1
        self.events.put_nowait(chunk)

    async def take(self) -> dict[str, Any] | None:
        """The next chunk for the sender (None: every choice ended); wakes a waiting put."""
        item = await self.events.get()
        self._taken.set()
        return item

    def fail(self, status: Status, param: str | None, counted: bool) -> None:
        """The first failure is the answer, except that a choice's own failure replaces a
        knock-on (``lifecycle.unavailable``: the recovery one choice's device fault set off
        ends the others too, and which of them the loop saw first was a race)."""
        if self.failure is None or (knock_on(self.failure[0]) and not knock_on(status)
                                    and status.category is not Category.CANCELLED):
            self.failure = (status, param, counted)

    def knocked_on(self) -> bool:
        """The answer so far is a knock-on: a choice still running may hold its cause."""
        return self.failure is not None and knock_on(self.failure[0])

    def count(self, k: int, run: RequestRun) -> None:
        """Usage as OpenAI counts it: a prompt's tokens once (its first choice), every
        choice's completion tokens."""
        if k % self.n == 0:
            self.prompt_tokens += len(run.prompt)
        self.completion_tokens += len(run.tokens)

    def failed_to_finish(self) -> bool:
        return any(result is None for result in self.results)

    def usage(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


# ---- routes ---------------------------------------------------------------------------------
@attrs.frozen
class ChatPath:
    """The chat route's pipeline, for a route that answers through it (the Responses API,
    drivers/serving/responses_api.py): ``read(request, model)`` the checked body of a
    generation (auth, media type, size, the served model) or :class:`Refusal`;
    ``answer(request, chat_body, response_id, prompt_param, max_tokens_param)`` the chat's
    answer to it, as ``/v1/chat/completions`` gives it; ``refused(err)`` a refusal's error response, counted
    as a failed request; ``answered(err)`` one that is no generation's, not counted;
    ``count(request, chat_body)`` its prompt tokens."""

    read: Callable[[Request, type[Any]], Coroutine[Any, Any, Any]]
    answer: Callable[..., Coroutine[Any, Any, Response]]
    refused: Callable[[Refusal], Response]
    answered: Callable[[Refusal], Response]
    #: the prompt tokens a chat body is admitted with (its messages and tools rendered as the
    #: chat route renders them), nothing generated; :class:`Refusal` as the chat route's (its
    #: tools and ``response_format`` checked and compiled as the answer's: ``planned``)
    count: Callable[[Request, ChatRequest], Coroutine[Any, Any, int]]


def add_routes(app: FastAPI, owner: RouteService, fail: Callable[..., Response]
               ) -> ChatPath:
    """Register the OpenAI endpoints on ``app`` (``fail(status, param, http_status)`` renders
    and counts an error); the chat pipeline, for the routes built on it."""

    config = owner.service.config

    def served_names() -> tuple[str, ...]:
        service = owner.service
        names = [config.model_name]
        manifest_name = getattr(getattr(service.executor, "manifest", None), "name", None)
        if isinstance(manifest_name, str) and manifest_name not in names:
            names.append(manifest_name)
        return tuple(names)

    def refused(err: Refusal) -> Response:
        """A completion or chat request refused: answered and counted in
        ``calexec_request_failures_total`` once, whatever its choices (an admitted request
        counts each of its choices once, in it or in ``calexec_request_success_total``)."""
        return fail(err.status, err.param, err.http_status, headers=err.headers)

    def answered(err: Refusal) -> Response:
        """The refusal of a request that is no completion (``/v1/models``, ``/tokenize``,
        ``/detokenize``, ``/tokenizer_info``): answered, not counted as a failed completion
        request (their successes are counted nowhere, so a poller of ``/v1/models`` without the
        API key, or a client's bad ``/tokenize``, made the completions' failure rate)."""
        return fail(err.status, err.param, err.http_status, count=False, headers=err.headers)

    async def read(request: Request, model: type[Body], admits: bool = False) -> Body:
        """The request's checked body. ``admits``: a completion or chat, which, sent with
        ``Expect: 100-continue`` while the server drains, is refused before its body is read
        (:func:`draining_refusal`; without the expectation its body is read, as it is on
        its way, and admission refuses it)."""
        service = owner.service
        auth = auth_refusal(request, config.api_key)
        if auth is not None:
            raise auth
        if admits and service.draining and wire.expects_continue(request):
            raise draining_refusal()
        framing = wire.body_framing(request)  # (the media type, then the codings)
        if framing is not None:
            field, value = framing
            if field == "content-type":
                raise Refusal(invalid(f"content-type {shown(value)}: the body must be JSON "
                                      "(application/json)"), None, 415)
            if field == "content-encoding":
                raise Refusal(invalid(f"content-encoding {shown(value)}: not supported, send "
                                      "the body uncompressed"), None, 415, wire.IDENTITY_ONLY)
            raise Refusal(error_bodies.transfer_coding_refused(value), None, 501)
        raw = await wire.body_or_refusal(request, config.max_body_bytes, config.body_timeout_s,
                                         service.bodies)
        if isinstance(raw, wire.BodyRefusal):  # 499 (nobody reads it), 408, 413: counted
            raise Refusal(raw.status, None, raw.http_status, raw.headers)
        body = parse(model, raw)
        in_query = query_field_refusal(request, model)
        if in_query is not None:
            raise in_query
        not_found = model_refusal(getattr(body, "model", None), served_names())
        if not_found is not None:
            raise not_found
        return body

    def truncated(ids: list[int], keep: int | None) -> list[int]:
        """vLLM's ``truncate_prompt_tokens``: the last ``keep`` ids (-1: the context's
        length); ``ids`` itself when nothing is cut. A ``keep`` above the context's length
        is refused naming it (as vLLM: "greater than max_model_len"), whatever the prompt's
        length: it asks for more than the model can take, so it truncates nothing where a
        long prompt needs it."""
        if keep == 0:
            raise Refusal(invalid("truncate_prompt_tokens=0: must be >= 1, or -1 for the "
                                  "model's context"), "truncate_prompt_tokens")
        context = max_seq()
        if keep is not None and context is not None and keep > context:
            raise Refusal(invalid(f"truncate_prompt_tokens={keep!s:.80}: must be at most the "
                                  f"model's context, max_model_len={context} (or -1 for it)"),
                          "truncate_prompt_tokens")
        limit = context if keep == -1 else keep
        return ids if limit is None or len(ids) <= limit else ids[len(ids) - limit:]

    # the generation served, or during a recovery's gap between two generations the last one
    # (service.contracts): a request is checked, and waits for Ready, as every other one
    def vocab() -> int | None:
        service = owner.service
        generation = service.contracts
        return None if generation is None else generation.vocab_size

    def max_seq() -> int | None:
        service = owner.service
        generation = service.contracts
        return None if generation is None else generation.submodels[TaskKind.DECODE].max_seq

    def chat_default(prompt_len: int, prompt_param: str = "messages") -> int:
        """A chat's ``max_tokens`` when the body gives none: ``CHAT_DEFAULT_MAX_TOKENS``, or
        what the context leaves after the prompt when that is less (as vLLM and OpenAI: a
        long conversation that fits is answered, never refused for a number the client did
        not send); messages leaving no room are refused naming them (``prompt_param``: the
        body's field, ``input`` on /v1/responses)."""
        limit = max_seq()
        if limit is None or prompt_len + CHAT_DEFAULT_MAX_TOKENS <= limit:
            return CHAT_DEFAULT_MAX_TOKENS
        if prompt_len >= limit:  # phrased as OpenAI and vLLM do: clients look for it
            raise Refusal(context_exceeded(
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{prompt_param} take {prompt_len} tokens, which leaves no room for the reply. "
                f"Please reduce the length of the {prompt_param}."), prompt_param)
        return limit - prompt_len

    #: the requests compiling a grammar now (:func:`compiled`), each in one of as many
    #: worker threads (``compile_threads``, never waited for: a turn here is taken first)
    compiles = anyio.CapacityLimiter(GRAMMAR_THREADS)
    compile_threads = anyio.CapacityLimiter(GRAMMAR_THREADS)

    async def compiled(request: Request, timeout: float | None, build: Callable[..., Any],
                       *args: Any) -> Any:
        """:func:`structure` in a worker thread, for a request that asks for a grammar: a
        schema's checks and llguidance's compile take seconds for a large one (a
        ``json_schema`` of 2,000 ``anyOf`` branches, 170 KB: 12 s), which on the event loop
        stalled every other client, streams and ``/health`` alike, that long. A request
        past ``GRAMMAR_THREADS`` others waits for its turn at most its ``timeout`` (the
        body's, or the server's ``--timeout``): then a 504 naming it (it waited with no
        bound, whatever timeout it gave, while others' large grammars compiled)."""
        told = config.default_timeout_s if timeout is None else timeout
        deadline = anyio.current_time() + min(told, config.max_timeout_s)
        with anyio.move_on_after(min(told, config.max_timeout_s)) as waiting:
            await compiles.acquire()
        if waiting.cancelled_caught:
            raise Refusal(Status.deadline(Phase.ADMISSION, (
                f"request timeout={told:g} s passed waiting for one of the server's "
                f"{GRAMMAR_THREADS} grammar compile threads (each compiling another request's "
                "response_format or tools); the request ended there: give a larger timeout "
                "or send it again later")), "timeout")
        # the compile stops at its next step once the request's timeout passes, its client
        # disconnects or it is cancelled (grammar.Checkpoint): an abandoned compile held its
        # thread to its end, and two of them every other grammar request. A step inside
        # llguidance (one build of a large grammar) still runs to its end: it cannot stop.
        check = grammar.Checkpoint()
        outcome: list[Any] = []

        async def work() -> None:
            async with anyio.create_task_group() as watch:
                watch.start_soon(_stop_at, deadline, check)
                try:
                    outcome.append(await owner.service.in_worker(  # (the loop starts no thread)
                        functools.partial(structure, build, *args, check=check),
                        limiter=compile_threads))
                except Exception as err:  # noqa: BLE001 - raised below as it is (no group)
                    outcome.append(err)
                finally:
                    watch.cancel_scope.cancel()
        try:
            await wire.until_disconnect(request, work)
        finally:
            compiles.release()
        if not outcome or isinstance(outcome[0], grammar.Abandoned) and check.why != "timeout":
            raise Refusal(Status.cancelled(Phase.CANCEL, (
                "client disconnected while the request's grammar compiled; the compile "
                "stopped there")), None)
        done = outcome[0]
        if isinstance(done, Exception) and not isinstance(done, grammar.Abandoned):
            raise done
        if isinstance(done, grammar.Abandoned):
            raise Refusal(Status.deadline(Phase.ADMISSION, (
                f"request timeout={told:g} s passed while its grammar compiled (its "
                "response_format or tools); the request ended there: give a larger timeout "
                "or a smaller schema")), "timeout")
        return done

    async def _stop_at(deadline: float, check: grammar.Checkpoint) -> None:
        try:
            await anyio.sleep_until(deadline)
            check.stop("timeout")
        finally:  # (also when the request is cancelled: its compile stops too)
            check.stop("cancelled")

    def structure(build: Callable[..., Any], *args: Any,
                  check: Callable[[], None] = grammar.go_on) -> Any:
        """A grammar.* builder's result for this server's tokenizer and vocabulary
        (``tool_setup``: no model needed); its GrammarError is the 400 naming the field;
        ``check`` is the compile's checkpoint (grammar.Abandoned: returned, not raised)."""
        service = owner.service
        try:
            if build is grammar.tool_setup:
                return build(*args)
            n = vocab()
            if n is None:  # no generation served yet: a grammar needs the vocabulary
                asked = grammar.response_format_schema(args[0])
                if asked is None and not (len(args) > 1 and args[1].tools):
                    return None
                raise Refusal(Status.unavailable(Phase.ADMISSION, "device lifecycle is "
                                                 f"{service.executor.state}"), None)
            return build(*args, service.tokenizer, n, config.end_token_id, check)
        except grammar.Abandoned as gone:
            return gone
        except grammar.GrammarError as err:
            raise Refusal(invalid(str(err)), err.param) from None

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        auth = auth_refusal(request, config.api_key)
        if auth is not None:
            return answered(auth)
        return JSONResponse({"object": "list",
                             "data": [model_card(name) for name in served_names()]})

    def model_card(name: str) -> dict[str, Any]:
        service = owner.service
        return {"id": name, "object": "model", "created": int(service.started_at),
                "owned_by": "calexec", "root": config.model_name, "parent": None,
                "max_model_len": max_seq()}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> Response:
        """One served model (the SDK's ``models.retrieve``); 404 ``model_not_found`` else."""
        auth = auth_refusal(request, config.api_key)
        if auth is not None:
            return answered(auth)
        not_found = model_refusal(model_id, served_names())
        if not_found is not None:
            return answered(not_found)
        return JSONResponse(model_card(model_id))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        # named first: an error answer carries the id an answer would have had; a cancel by
        # it (or its x-request-id) sticks from now on (service.arriving)
        response_id = new_response_id(request, _CompletionShape.PREFIX)
        with owner.service.arriving(request.scope, response_id):
            return await _completions(request, response_id)

    async def _completions(request: Request, response_id: str) -> Response:
        service = owner.service
        try:
            body = await read(request, CompletionRequest, admits=True)
            refusal(body)
            # null: the start of a document (OpenAI's document separator; the end token here)
            prompt = [config.end_token_id] if body.prompt is None else body.prompt
            # a list of strings or of token lists: a batch, one choice (n) per prompt
            batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
            prompts = cast(list[str | list[int]], prompt if batch else [prompt])
            choices_refusal(len(prompts), body.n, config.max_choices)
            rows = prompt_rows(body)
            params = sampling_params(body, body.logprobs, vocab(), config.end_token_id)
            shaped = (None if body.response_format is None
                      else await compiled(request, body.timeout, grammar.completion_structure,
                                           body.response_format))
            if shaped is not None:  # (no copy of the params when there is no grammar)
                params = attrs.evolve(params, grammar=shaped)
            special = True if body.add_special_tokens is None else body.add_special_tokens
            prepared: list[tuple[list[int], str]] = []  # (prompt ids, echo) per prompt
            for one in prompts:
                ids = (service.tokenizer.encode(one, special) if isinstance(one, str)
                       else list(one))
                kept = truncated(ids, body.truncate_prompt_tokens)
                echo = (one if isinstance(one, str) and kept is ids
                        else service.tokenizer.decode(kept)) if body.echo else ""
                prepared.append((kept, echo))
        except Refusal as err:
            return refused(err)
        wanted = 16 if body.max_tokens is None else body.max_tokens

        def shape_of(echo: str) -> _Shape:
            shape = _CompletionShape(echo, body.echo and body.logprobs is not None,
                                     body.prompt_logprobs)
            shape.prompt_ids = body.return_token_ids
            shape.continuous_usage = continuous_usage(body)
            return shape

        def admission(ids: list[int], j: int = 0) -> Admission:  # j: the choice of its prompt
            return Admission(ids, wanted, body.stream, body.timeout, prompt_logprobs=rows,
                             n_param=body.n if j == 0 else None)
        if len(prepared) == 1 and body.n == 1:  # one choice, a one-prompt list's too
            # (LangChain's OpenAI LLM sends one): the answer is the same, and it reports
            # progress, so the fleet resumes it on a sibling and a draining replica hands it
            # off, as a plain prompt
            ids, echo = prepared[0]
            return await _generate(request, admission(ids), params, shape_of(echo),
                                   include_usage(body), response_id)
        return await _generate_many(
            request, [(admission(ids, j), shape_of(echo))
                      for ids, echo in prepared for j in range(body.n)],
            body.n, params, include_usage(body), response_id)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        response_id = new_response_id(request, _ChatShape.PREFIX)
        with owner.service.arriving(request.scope, response_id):  # (a cancel sticks)
            try:
                body = await read(request, ChatRequest, admits=True)
            except Refusal as err:
                return refused(err)
            return await chat_answer(request, body, response_id)

    async def chat_answer(request: Request, body: ChatRequest, response_id: str,
                          prompt_param: str = "messages", max_tokens_param: str | None = None
                          ) -> Response:
        """The answer to the chat ``body`` (read and checked by :func:`parse`): its JSON, its
        stream (a ``wire.BoundedStreamingResponse``), or its error (counted). ``prompt_param``
        and ``max_tokens_param``: the fields an admission's refusal names (a route that
        translated its own body into ``body`` names its own; None: the chat field given)."""
        try:
            refusal(body)
            top = body.top_logprobs
            # 0 without logprobs asks for nothing (vLLM takes it): only more is refused
            if top and not body.logprobs:
                raise Refusal(invalid(f"top_logprobs={shown(top)}: needs logprobs=true"),
                              "top_logprobs")
            if top is not None and not 0 <= top <= sampling.MAX_LOGPROBS:
                raise Refusal(invalid(f"top_logprobs={shown(top)}: must be in "
                                      f"[0, {sampling.MAX_LOGPROBS}]"), "top_logprobs")
            if body.max_tokens is not None and body.max_completion_tokens is not None \
                    and body.max_tokens != body.max_completion_tokens:
                raise Refusal(invalid(f"max_completion_tokens={shown(body.max_completion_tokens)} "
                                      f"and max_tokens={shown(body.max_tokens)} differ: "
                                      "give one"),
                              "max_completion_tokens")
            choices_refusal(1, body.n, config.max_choices)
            params = sampling_params(body, (top or 0) if body.logprobs else None, vocab(),
                                     config.end_token_id)
            tools, plan = await planned(request, body)
            if plan is not None:  # (no copy of the params when there is no grammar)
                params = attrs.evolve(params, grammar=plan)
            ids = chat_prompt(body, tools)
            if prompt_param == "messages":  # (the Responses API's input: its own rule)
                orphan = tool_answer_refusal(body.messages)
                if orphan is not None:
                    raise orphan
            wanted = (body.max_completion_tokens or body.max_tokens
                      or chat_default(len(ids), prompt_param))
        except Refusal as err:
            return refused(err)
        admission = Admission(ids, wanted, body.stream, body.timeout, prompt_param=prompt_param,
                              max_tokens_param=max_tokens_param or (
                                  "max_completion_tokens" if body.max_tokens is None
                                  and body.max_completion_tokens is not None else "max_tokens"))

        def chat_shape() -> _Shape:
            shape = (_ToolChatShape(plan.tools, plan.named,
                                    plan.named or plan.tool_choice == "required")
                     if plan is not None and plan.tools else _ChatShape())
            shape.prompt_ids = body.return_token_ids
            shape.continuous_usage = continuous_usage(body)
            if body.service_tier is not None:  # (one tier: the one used, whatever was asked)
                shape.service_tier = "default"
            return shape
        if body.n == 1:
            return await _generate(request, admission, params, chat_shape(),
                                   include_usage(body), response_id)
        return await _generate_many(
            request, [(attrs.evolve(admission, n_param=body.n if j == 0 else None), chat_shape())
                      for j in range(body.n)], body.n, params, include_usage(body), response_id)

    def chat_prompt(body: ChatRequest, tools: grammar.ToolSetup | None) -> list[int]:
        """The prompt ids of the chat ``body`` (``tools``: its checked tools, rendered by the
        template)."""
        service = owner.service
        text = render_chat(body.messages, service.tokenizer, body.add_generation_prompt,
                           body.chat_template_kwargs, body.continue_final_message, tools)
        return truncated(service.tokenizer.encode(text, bool(body.add_special_tokens)),
                         body.truncate_prompt_tokens)

    async def planned(request: Request, body: ChatRequest
                      ) -> tuple[grammar.ToolSetup | None, Any]:
        """The chat ``body``'s checked tools and the structure its answer is generated under
        (its ``response_format`` and tools, compiled: :func:`compiled`; None without them), or
        :class:`Refusal` naming the field."""
        tools = structure(grammar.tool_setup, body.tools, body.tool_choice)
        given = (grammar.chat_structure, body.response_format, tools, body.parallel_tool_calls)
        return tools, (structure(*given) if body.response_format is None and not body.tools
                       else await compiled(request, body.timeout, *given))

    async def count(request: Request, body: ChatRequest) -> int:
        """The prompt tokens the chat ``body`` is admitted with, its tools and structure
        checked as its answer checks them (until stop 75 only the tools' names and shapes: a
        ``response_format`` or tool schema the answer refuses was counted, 200)."""
        tools, _ = await planned(request, body)
        return len(chat_prompt(body, tools))

    async def read_body(request: Request, model: type[Body]) -> Body:
        """:func:`read` of a generation's body (``admits``), for a route of its own module."""
        return await read(request, model, admits=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        service = owner.service
        try:
            body = await read(request, TokenizeRequest)
            given = [name for name in ("prompt", "content", "messages")
                     if getattr(body, name) is not None]
            if len(given) != 1:
                raise Refusal(invalid("give exactly one of prompt, content (llama-server) and "
                                      f"messages; got {given or 'none'}"),
                              given[1] if len(given) > 1 else "prompt")
            # chat's fields: named, not ignored (until stop 75 add_generation_prompt: false
            # and chat_template_kwargs were taken with a prompt and changed nothing)
            chat_only = {"tools": body.tools not in (None, False),
                         "continue_final_message": body.continue_final_message,
                         "add_generation_prompt": not body.add_generation_prompt,
                         "chat_template_kwargs": bool(body.chat_template_kwargs)}
            for name, given_here in chat_only.items():
                if given_here and body.messages is None:
                    raise Refusal(invalid(f"{name}: only with messages (the chat template "
                                          "renders a chat's prompt)"), name)
            text = body.prompt if body.prompt is not None else body.content
            if text is not None:
                special = body.add_special if body.add_special is not None \
                    else body.add_special_tokens is not False
                ids = service.tokenizer.encode(text, special)
            elif body.messages is not None:  # (exactly one of the three)
                tools = structure(grammar.tool_setup, body.tools, None)
                ids = service.tokenizer.encode(
                    render_chat(body.messages, service.tokenizer, body.add_generation_prompt,
                                body.chat_template_kwargs, body.continue_final_message,
                                tools),
                    add_special_tokens=bool(body.add_special_tokens))
        except Refusal as err:
            return answered(err)
        texts = [service.tokenizer.token_text(t) for t in ids] \
            if body.return_token_strs or body.with_pieces else None
        tokens: list[Any] = list(ids) if not body.with_pieces or texts is None else \
            [{"id": t, "piece": piece} for t, piece in zip(ids, texts)]
        return JSONResponse({"count": len(ids), "max_model_len": max_seq(), "tokens": tokens,
                             "token_strs": texts if body.return_token_strs else None})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        """vLLM's ``GET /tokenizer_info``: the special tokens and chat template a client needs
        to tokenize as this server does through ``/tokenize`` and ``/detokenize`` (lm-eval's
        ``tokenizer_backend=remote``). A special token the tokenizer has no text for (the
        byte-level tokenizer's end token) is null."""
        service = owner.service
        auth = auth_refusal(request, config.api_key)
        if auth is not None:
            return answered(auth)
        tok = service.tokenizer
        return JSONResponse({"tokenizer_class": type(tok).__name__,
                             "eos_token": tok.eos_token or None,
                             "bos_token": tok.bos_token or None, "pad_token": None,
                             "chat_template": tok.chat_template,
                             "model_max_length": max_seq()})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's ``POST /detokenize``. An id outside the served vocabulary is a 400 naming
        it, as in a prompt (a ``--tokenizer``'s decode dropped it silently, the byte-level
        tokenizer printed ``<id>``: the same ids read differently by tokenizer)."""
        service = owner.service
        try:
            body = await read(request, DetokenizeRequest)
            n = vocab()
            bad = next((i for i, t in enumerate(body.tokens) if n is not None and t >= n),
                       None)
            if bad is not None:
                raise Refusal(invalid(f"tokens[{bad}]={body.tokens[bad]} outside the "
                                      f"vocabulary [0, {n})"), "tokens")
        except Refusal as err:
            return answered(err)
        return JSONResponse({"prompt": service.tokenizer.decode(body.tokens)})

    def _resume_of(request: Request, params: SamplingParams
                   ) -> tuple[handoff.Resume | None, SamplingParams] | Response:
        """The fleet's resume state of ``request`` (None: not a resumed request) and
        ``params`` with its sampling seed, or the 400 naming ``resume`` when it does not
        parse."""
        if request.scope.get(handoff.RESUME) is None:
            return None, params
        try:
            resume = handoff.Resume.parse(request.scope[handoff.RESUME])
            if resume.seed is not None:
                params = attrs.evolve(params, seed=resume.seed)
        except (handoff.ResumeError, SamplingError) as err:
            return refused(Refusal(invalid(str(err)), "resume"))
        return resume, params

    async def _generate(request: Request, admission: Admission, params: SamplingParams,
                        shape: _Shape, usage_chunk: bool, response_id: str) -> Response:
        # the fleet's out-of-band channel (drivers/serving/handoff.py): ASGI scope keys only
        # drivers/fleet/edge.serve_relayed sets; an HTTP request cannot carry them
        service = owner.service
        progress = request.scope.get(handoff.PROGRESS)
        resumed = _resume_of(request, params)
        if isinstance(resumed, Response):
            return resumed
        resume, params = resumed
        if resume is not None:
            if resume.timeout is not None:
                admission.timeout = min(resume.timeout,
                                        admission.timeout or config.default_timeout_s)
        told = service.arrived(request.scope)  # (then admitted: nothing awaited between)
        if told is not None:  # an operator cancelled it before its admission
            return fail(told, None)
        run, status, param = service.admit(admission)
        if run is None:
            return fail(status, param)
        run.sampling = params
        out = TextOutput(service.tokenizer, params.stop, params.include_stop_str_in_output,
                         params.min_tokens)
        shape.start(service, run, response_id)
        if resume is not None:
            bad = resume_refusal(resume, run)
            if bad is not None:
                await service.finish(run)
                return refused(bad)
            continue_from(resume, run, out, shape, admission.sse)
            wire.name_request(request.scope, shape.id)  # the id the first replica started
        run.x_request_id = wire.request_id(request.scope)  # (its dump record names it,
        run.response_id = shape.id                         # and the body's id)
        if progress is not None:
            progress({"seed": params.seed, "id": shape.id, "created": shape.created,
                      "prompt_tokens": len(run.prompt)})
        # nothing reads a token before the whole answer (the JSON one) or before its chunk
        # (a stream's) unless a stop string may end it or a fleet drain may hand it off: its
        # decode steps may go in a burst (ServerConfig.decode_bursts, stream_bursts)
        run.bursts = not params.stop and progress is None
        if admission.sse:
            return await _sse_response(request, run, out, shape, usage_chunk, progress)
        handed = False
        try:
            async def drive() -> None:
                nonlocal handed
                while (token := await service.advance(run)) is not None:
                    out.add(token)
                    if out.stopped:
                        run.finish_reason, run.stop_reason = "stop", out.stop_string
                    elif progress is not None and hand_off(request, run):  # (it needs progress)
                        handed = True
                        handed_off(run)
                        return
            await wire.until_disconnect(request, drive)
        except Exception as exc:  # noqa: BLE001 - a bug: its 500, answered here
            run.status = unexpected_failure(request, exc)  # (counted by finish())
        finally:
            await service.finish(run, abandoned=True)
        if run.status is not None:
            if handed and progress is not None:  # (a hand-off needs the progress channel)
                progress({"handoff": "drained"})
            return fail(run.status, failure_param(run), count=False)  # counted by finish()
        finished_text(out, run)
        return JSONResponse(shape.whole(out.text, run))

    async def _generate_many(request: Request, specs: list[tuple[Admission, _Shape]], n: int,
                             params: SamplingParams, usage_chunk: bool, response_id: str
                             ) -> Response:
        """A request of several choices (a prompt list, ``n`` > 1): choice ``k`` (``index``
        k = prompt_i * n + j) is a run of its own through the same admission as a separate
        request, at most ``service.choice_concurrency`` at once (the rest wait for their
        turn), sampled with :func:`choice_seed` of j (the prompt's own choice: a prompt
        draws the same in a list as alone). The first failure ends the request with
        that error: the other choices are cancelled and every run releases what it holds.
        No hand-off: a draining replica finishes such a request itself. Through the fleet
        (a progress channel) it reports its seed, id and ``created`` and, before each
        event, the choice the event is of; a sibling resuming it (``resume.choices``) runs
        every choice again from its start with that seed, id and ``created`` and sends, of
        each choice, only the events after those the client has (drivers/serving/handoff.py).
        """
        service = owner.service
        progress = request.scope.get(handoff.PROGRESS)
        resumed = _resume_of(request, params)
        if isinstance(resumed, Response):
            return resumed
        resume, params = resumed
        if resume is not None:
            if resume.tokens or len(resume.choices) > len(specs):
                return refused(Refusal(invalid(
                    "resume: a request of several choices (a prompt list or n > 1) is run "
                    "again from its start (resume.choices), not re-prefilled from tokens"),
                    "resume"))
            if resume.id is not None:
                response_id = resume.id
                wire.name_request(request.scope, resume.id)  # the id the first replica started
                service.arrival_renamed(request.scope, resume.id)
            if resume.timeout is not None:
                first_timeout = specs[0][0].timeout or config.default_timeout_s
                specs[0] = (attrs.evolve(specs[0][0], timeout=min(resume.timeout,
                                                                  first_timeout)), specs[0][1])
        for k, (admission, _) in enumerate(specs[::n]):  # every prompt checked first
            ids, status, param = service.check(admission)
            if ids is None:
                if len(specs) > n and param is not None:  # an element of a prompt list:
                    # which one (the message's start kept: clients match on it)
                    status = attrs.evolve(status, message=f"{status.message} (prompt list "
                                          f"element {k})")
                return fail(status, param)
        first = specs[0][0]
        timeout = config.default_timeout_s if first.timeout is None else first.timeout
        deadline = time.monotonic() + timeout  # the request's: every choice ends by it
        state = _Choices(n, len(specs), response_id, wire.request_id(request.scope),
                         service)
        if resume is not None and resume.created is not None:
            state.created = resume.created
        if resume is not None:
            state.skip = list(resume.choices) + [0] * (len(specs) - len(resume.choices))
        state.progress = progress
        if progress is not None:
            progress({"seed": params.seed, "id": state.id, "created": state.created,
                      "prompt_tokens": sum(len(a.prompt) for a, _ in specs),  # (each re-prefilled)
                      "choices": len(specs)})

        async def one(k: int, admission: Admission, shape: _Shape,
                      limit: anyio.Semaphore, scope: anyio.CancelScope,
                      opened: OpenRequest) -> None:
            async with limit:
                if opened.cancelled is not None and state.failure is None:
                    # an operator cancelled the request between two choices (no run of it
                    # was in progress to tell): no choice more is admitted; the answer is
                    # the cancel's, counted here as a later choice's refusal is
                    state.fail(opened.cancelled, None, counted=False)
                    scope.cancel()
                if state.failure is None:
                    # (each prompt's own choice j = k % n: a prompt of a list draws as it
                    # draws alone, whatever else the list holds, as vLLM seeds each prompt)
                    await _run_choice(k, admission, shape, state, scope, deadline,
                                      attrs.evolve(params, seed=choice_seed(params.seed, k % n)))

        async def produce() -> None:
            try:
                limit = anyio.Semaphore(service.choice_concurrency)
                # a drain waits for it between two choices, and a cancel finds it then
                with service.open_request(state.id, state.x_request_id) as opened:
                    told = service.arrived(request.scope)  # (a cancel before: none admitted)
                    if told is not None and opened.cancelled is None:
                        opened.cancelled = told
                    async with anyio.create_task_group() as tg:
                        for k, (admission, shape) in enumerate(specs):
                            tg.start_soon(one, k, admission, shape, limit, tg.cancel_scope,
                                          opened)
            except Exception as exc:  # noqa: BLE001 - a bug in a choice: the request's
                # answer, never a success short of that choice (its stream ended with [DONE])
                state.fail(unexpected_failure(request, exc), None, counted=False)
            finally:
                state.events.put_nowait(None)  # the end, after every run finished

        if not first.sse:
            await wire.until_disconnect(request, produce)
            if state.failure is not None:
                status, param, counted = state.failure
                return fail(status, param, count=not counted)
            if state.failed_to_finish():  # the client left: nobody reads the answer
                return fail(Status.cancelled(Phase.CANCEL, "client disconnected"),
                            count=False)
            head = specs[0][1]
            return JSONResponse({**head._head(), "choices": state.results,
                                 "usage": state.usage(), **state.extra})
        return await _sse_many(request, specs[0][1], state, produce, deadline, usage_chunk)

    async def _run_choice(k: int, admission: Admission, shape: _Shape, state: _Choices,
                          scope: anyio.CancelScope, deadline: float,
                          params: SamplingParams) -> None:
        """Choice ``k`` of a request of several (``_generate_many``): its chunks go to
        ``state.events`` (streamed), its choice to ``state.results`` (not streamed); a
        failure goes to ``state.failure`` and cancels the request's other choices."""
        # the request's deadline (its timeout kept for the messages that name it)
        # a choice after one that was admitted is part of an admitted request: a drain
        # started since lets it run (it refuses only requests not yet admitted)
        service = owner.service
        run, status, param = service.admit(attrs.evolve(admission, deadline=deadline),
                                           admitted=bool(state.runs))
        if run is None:
            state.fail(status, param, counted=False)
            scope.cancel()
            return
        state.runs.append(run)
        run.send_cut = state.sending  # (streamed: the one response's sends; else None)
        run.sampling = params
        out = TextOutput(service.tokenizer, params.stop, params.include_stop_str_in_output,
                         params.min_tokens)
        shape.start(service, run, state.id)
        shape.created, shape.index = state.created, k
        run.x_request_id, run.response_id = state.x_request_id, state.id
        state.shapes.append(shape)
        sse = admission.sse
        try:
            token = await service.advance(run)
            while token is not None:
                piece = out.add(token)
                if out.stopped:
                    run.finish_reason, run.stop_reason = "stop", out.stop_string
                if sse:
                    sent = shape.piece_chunk(piece, token, run)
                    if sent is not None:
                        await state.put(sent)
                token = await service.advance(run)
            if run.status is not None:
                state.fail(run.status, failure_param(run), counted=True)  # counted by finish()
                scope.cancel()
                return
            if sse:
                await state.put(shape.last_chunk(finished_text(out, run), run))
            else:
                finished_text(out, run)
                whole = shape.whole(out.text, run)
                state.results[k] = whole["choices"][0]
                if "prompt_token_ids" in whole:  # chat: the request's, not the choice's
                    state.extra["prompt_token_ids"] = whole["prompt_token_ids"]
            state.count(k, run)
        finally:
            if state.knocked_on() and not run.done and run.handle is not None:
                # another choice ended with a knock-on of a recovery: the job this one was
                # waiting for (cancelled with it) may be the one whose fault set that recovery
                # off; it has been reported, so it resolves now, and its failure is the answer
                handle = run.handle
                with anyio.CancelScope(shield=True):
                    result = await handle.wait_async(run.deadline)
                if (handle.done and isinstance(result, Status) and not result.ok
                        and result.category is not Category.DEADLINE):
                    state.fail(result, None, counted=True)
                    if state.failure is not None and state.failure[0] is result:
                        run.status = result  # (its finish counts it)
            if state.failure is not None and not run.done:
                # not request.cancelled (499: the client is gone): no client left; the
                # request's answer is the other choice's failure
                run.status = run.cancelled or Status.failure(
                    "request.choice_cancelled", Category.CANCELLED, Phase.CANCEL,
                    "another choice of the request failed", seq_id=run.seq_id)
            await service.finish(run, abandoned=True)

    async def _sse_many(request: Request, head: _Shape, state: _Choices,
                        produce: Callable[[], Coroutine[Any, Any, None]], deadline: float,
                        usage_chunk: bool) -> Response:
        """The stream of a request of several choices: each chunk carries one choice (its
        ``index``), the usage chunk (``include_usage``) sums them, ``[DONE]`` once at the
        end; a failure before the first chunk is the response's status, after it an error
        event (no ``[DONE]``), as for one choice."""
        service = owner.service
        # (before a choice runs: each run holds it; a cancel finds it in service.streams
        # once every choice ended and the tail is still going out)
        state.sending = wire.SendCut(service.streams, (state.id, state.x_request_id))
        producer = asyncio.get_running_loop().create_task(produce())

        async def stop() -> None:  # the choices end and release what they hold
            producer.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({producer})

        first: dict[str, Any] | None = None

        async def first_event() -> None:  # may wait for sequence ids: watch for disconnect
            nonlocal first
            first = await state.take()
        try:
            await wire.until_disconnect(request, first_event)
        except BaseException:
            await stop()
            raise
        if first is None:
            await stop()
            if state.failure is not None:
                status, param, counted = state.failure
                return fail(status, param, count=not counted)
            return fail(Status.cancelled(Phase.CANCEL, "client disconnected"), count=False)

        async def events() -> AsyncIterator[bytes]:
            item: dict[str, Any] | None = first
            try:
                # every choice's opening first, in index order (a chat's role delta): the
                # SDK's stream helper adds a choice it has not seen at the end of its list
                for k in range(len(state.results)):
                    for chunk in state.shapes[0].opening_chunks(k):
                        if state.owed(k):
                            yield wire.sse(chunk)
                while item is not None:
                    if state.owed(_Choices.index_of(item)):
                        yield wire.sse(item)
                    item = await state.take()
                if state.failure is not None:
                    status, param, counted = state.failure
                    if not counted:  # (a later choice refused admission)
                        service.metrics.observe_refusal(status)
                    if state.progress is not None:
                        state.progress({"error": status.code,
                                        "retryable": fleet_retryable(status, service),
                                        "cause": "drained" if service.draining
                                        else "unavailable"})
                    yield wire.sse({"error": error_bodies.error_body(
                        status, param or error_bodies.PARAM_OF_CODE.get(status.code))})
                    return
                if state.sending is not None and state.sending.why is not None:
                    # an operator's cancel after every choice ended (each counted as it
                    # ended), before the tail went out: its error event, not [DONE]
                    yield wire.sse({"error": error_bodies.error_body(state.sending.why, None)})
                    return
                tail = b"data: [DONE]\n\n"
                if usage_chunk:
                    tail = wire.sse({**head._head(chunk=True), "choices": [],
                                     "usage": state.usage()}) + tail
                if state.progress is not None:  # one message: a cut never splits the tail
                    state.progress({"final": True})
                metrics.mark_whole()  # (said here: the answer's bytes could read as [DONE])
                yield tail
            finally:
                await stop()

        async def cut() -> None:
            for run in list(state.runs):
                await service.cut(run)
            await stop()

        return wire.BoundedStreamingResponse(
            events(), service.sends, lambda: deadline + config.deadline_slack_s, cut,
            state.sending, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def hand_off(request: Request, run: RequestRun) -> bool:
        """A draining replica hands a fleet request (one with a progress channel) to a
        sibling at a token boundary, when one serves (drivers/serving/handoff.py)."""
        handing = request.scope.get(handoff.HANDOFF)  # (per token: the service only if so)
        return (handing is not None and owner.service.draining and not run.done
                and request.scope.get(handoff.PROGRESS) is not None and bool(handing()))

    async def _sse_response(request: Request, run: RequestRun, out: TextOutput, shape: _Shape,
                            usage_chunk: bool, progress: Callable[[dict], None] | None = None
                            ) -> Response:
        service = owner.service
        first: int | None = None
        # (a cancel cuts a send waiting for the client, its generation still on or ended)
        sending = run.send_cut = wire.SendCut(service.streams,
                                              (run.response_id, run.x_request_id))

        async def first_token() -> None:  # may wait for a sequence id: watch for disconnect
            nonlocal first
            first = await service.advance(run)
        try:
            await wire.until_disconnect(request, first_token)
        except BaseException:
            await service.finish(run, abandoned=True)
            raise
        if first is None and not run.done:  # the client left before the first token
            await service.finish(run, abandoned=True)
            return fail(run.status, failure_param(run), count=False)
        if run.status is not None:
            await service.finish(run)
            return fail(run.status, failure_param(run), count=False)

        async def events() -> AsyncIterator[bytes]:
            token = first
            try:
                for opening in shape.opening_chunks():
                    yield wire.sse(opening)
                # Events of tokens a streamed burst already took (service.token_ready: the
                # next advance does not wait) go out in one send with the next ones: the
                # same bytes, fewer writes when the loop is behind the device. At most
                # STREAM_AHEAD events a send, so a burst that stays ahead of the loop never
                # holds the client's tokens back; never with a progress channel (no burst).
                ready: list[bytes] = []
                while token is not None:
                    piece = out.add(token)
                    if out.stopped:
                        run.finish_reason, run.stop_reason = "stop", out.stop_string
                    if progress is not None:  # before its chunk: the chunk commits it
                        progress({"tokens": [token]})
                    chunk = shape.piece_chunk(piece, token, run)
                    if chunk is not None:
                        ready.append(wire.sse(chunk))
                    if ready and not (progress is None and service.token_ready(run)
                                      and len(ready) < STREAM_AHEAD):
                        yield b"".join(ready)
                        ready = []
                    if progress is not None and hand_off(request, run):  # (it needs progress)
                        handed_off(run)
                        progress({"handoff": "drained"})
                        return  # no [DONE]: the fleet ingress continues on a sibling
                    token = await service.advance(run)
                # the generation ended: the device's share comes back now, not once the
                # client read the last bytes (a client that stopped reading held it until
                # the deadline + slack, stop 75)
                await service.generation_ended(run)
                if ready:  # (the stream ended without a token that said so)
                    yield b"".join(ready)
                if run.status is None and run.cancelled is not None:
                    # an operator's cancel after the generation ended, before the tail went
                    # out: its error event, not [DONE] (counted request.aborted), as a cancel
                    # of a stream still generating
                    run.status = run.cancelled
                if run.status is not None:
                    if progress is not None:
                        progress({"error": run.status.code,
                                  "retryable": fleet_retryable(run.status, service),
                                  "cause": "drained" if service.draining else "unavailable"})
                    yield wire.sse({"error": error_bodies.error_body(
                        run.status, failure_param(run)
                        or error_bodies.PARAM_OF_CODE.get(run.status.code))})
                else:
                    tail = [wire.sse(shape.last_chunk(finished_text(out, run), run))]
                    if usage_chunk:
                        tail.append(wire.sse(shape.usage_chunk(run)))
                    tail.append(b"data: [DONE]\n\n")
                    if progress is not None:
                        progress({"final": True})
                    metrics.mark_whole()  # (said here: the answer's bytes could read as [DONE])
                    # one message: one send instead of two or three (the same bytes), and a
                    # cut never splits the tail
                    yield b"".join(tail)
            except Exception as exc:  # noqa: BLE001 - a bug: the stream's error event, as
                # for a failure (the connection was cut without one); counted by finish()
                run.status = unexpected_failure(request, exc)
                yield wire.sse({"error": error_bodies.error_body(run.status, None)})
            finally:
                await service.finish(run, abandoned=True)

        # every send bounded by the request's deadline + slack: a client that stops reading
        # is cut there, and its sequence, KV and pre-armed slot come back (service.cut)
        return wire.BoundedStreamingResponse(
            events(), service.sends, lambda: run.deadline + config.deadline_slack_s,
            lambda: service.cut(run), sending, media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"})

    return ChatPath(read_body, chat_answer, refused, answered, count)


class TokenizeRequest(BaseModel):
    """``POST /tokenize``: vLLM's bodies, ``prompt`` (+ ``add_special_tokens``, default true)
    or chat ``messages`` (+ ``add_generation_prompt``, ``continue_final_message``,
    ``add_special_tokens`` (default false, as chat), ``chat_template_kwargs``, ``tools``), with
    ``return_token_strs``; or llama-server's ``content`` (+ ``add_special``, ``with_pieces``:
    ``tokens`` as ``{"id", "piece"}`` objects)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    content: StrictStr | None = None  # llama-server
    # at least one, as chat's: [] was tokenized as the generation prompt alone
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    # null: true for a prompt, false for messages (the chat template writes its own), as
    # vLLM's TokenizeCompletionRequest and TokenizeChatRequest and as the chat route
    add_special_tokens: StrictBool | None = None
    add_special: StrictBool | None = None  # llama-server's add_special_tokens
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False  # vLLM's TokenizeChatRequest, as chat's
    chat_template_kwargs: dict[StrictStr, Any] | None = None
    # vLLM's TokenizeChatRequest: the tools the chat template writes into the prompt, so the
    # count is a tool-using chat's own (checked as chat checks them)
    tools: Any = None
    return_token_strs: StrictBool = False
    with_pieces: StrictBool = False  # llama-server

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_nulls(cls, data)


class DetokenizeRequest(BaseModel):
    """vLLM's ``POST /detokenize``."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0, lt=1 << 31)]]


def new_response_id(request: Request, prefix: str) -> str:
    """A new response body ``id`` (``cmpl-``/``chatcmpl-`` + a random hex: random as vLLM's,
    since a counter repeats across restarts and a fleet's replicas), also the request's
    ``x-request-id`` unless the client sent its own (wire.RequestIds)."""
    made = f"{prefix}-{wire.uuid4_hex()}"
    wire.name_request(request.scope, made)
    return made


def _stop_ids(run: RequestRun) -> list[int]:
    """The end or stop token that ended ``run`` (the last of ``run.tokens``), as a stream's
    last chunk lists it: ``[]`` when none did."""
    return [] if run.stop_token is None else [run.stop_token]


def _usage(run: RequestRun, tokens: int | None = None) -> dict[str, int]:
    """``run``'s usage: its prompt and ``tokens`` generated tokens (default: all of them)."""
    done = len(run.tokens) if tokens is None else tokens
    return {"prompt_tokens": len(run.prompt), "completion_tokens": done,
            "total_tokens": len(run.prompt) + done}


class _Shape:
    """The JSON of one kind of response (completion or chat)."""

    PREFIX = "cmpl"
    #: the choice's ``index`` (a request of several choices: prompt_i * n + j)
    index = 0
    #: vLLM's ``return_token_ids``: the prompt's ids too (``prompt_token_ids``: the completion's
    #: choice, the chat response; when streamed, in the first chunk); ``token_ids`` always
    prompt_ids = False
    #: vLLM's ``stream_options.continuous_usage_stats`` (:func:`continuous_usage`): every
    #: chunk of the stream carries ``usage``, the choice's prompt and the tokens its text
    #: reached so far (an opening: none), as vLLM's; the usage chunk still ends the stream
    continuous_usage = False

    def start(self, service: CompletionService, run: RequestRun, response_id: str) -> None:
        """Start the response ``response_id`` (:func:`new_response_id`) of ``run``."""
        self.service, self.run, self.created = service, run, int(time.time())
        self.id = response_id
        self.tok = service.tokenizer
        self.sent_logprobs = 0
        self.opened = False
        #: generated tokens the stream's chunks reached (``piece_chunk``, ``last_chunk``): a
        #: decode burst's tokens taken ahead of them are not counted before their chunk
        self.streamed = 0

    def resumed(self, resume: handoff.Resume, tokens: int, sent_chars: int) -> None:
        """Continue a response another replica started: its id and ``created``; ``tokens``
        tokens (``sent_chars`` characters of text) and the opening were sent already."""
        self.streamed = tokens
        self.id = resume.id or self.id
        self.created = self.created if resume.created is None else resume.created
        self.opened = resume.opened

    def _new_logprobs(self, run: RequestRun) -> list[TokenLogprobs]:
        infos = run.token_logprobs[self.sent_logprobs:]
        self.sent_logprobs = len(run.token_logprobs)
        return infos

    def opening(self, index: int | None = None) -> list[dict[str, Any]]:
        """The chunks that open the stream of choice ``index`` (default: this shape's)."""
        return []

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        raise NotImplementedError  # each kind of response has its own

    def whole(self, text: str, run: RequestRun) -> dict[str, Any]:
        raise NotImplementedError

    def piece(self, text: str, token: int, run: RequestRun) -> dict[str, Any] | None:
        """The chunk of one token (None: nothing to send yet, its text is held back)."""
        raise NotImplementedError

    def last(self, text: str, run: RequestRun) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, run: RequestRun) -> dict[str, Any]:
        return {**self._head(chunk=True), "choices": [], "usage": _usage(run)}

    # a stream's chunks: the shape's own, with ``usage`` so far when ``continuous_usage``
    def _stamped(self, chunk: dict[str, Any] | None, run: RequestRun, tokens: int
                 ) -> dict[str, Any] | None:
        if chunk is not None and self.continuous_usage:
            chunk["usage"] = _usage(run, tokens)
        return chunk

    def opening_chunks(self, index: int | None = None) -> list[dict[str, Any]]:
        """:meth:`opening` as streamed (no token generated yet, as vLLM's role chunk)."""
        return [cast(dict[str, Any], self._stamped(chunk, self.run, 0))
                for chunk in self.opening(index)]

    def piece_chunk(self, text: str, token: int, run: RequestRun) -> dict[str, Any] | None:
        """:meth:`piece` as streamed: its usage counts the token (and any held back
        before it, whose chunk this is)."""
        self.streamed += 1
        return self._stamped(self.piece(text, token, run), run, self.streamed)

    def last_chunk(self, text: str, run: RequestRun) -> dict[str, Any]:
        """:meth:`last` as streamed: its usage counts every generated token (the end or
        stop token that ended it too), as the usage chunk and the whole answer do."""
        self.streamed = len(run.tokens)
        return cast(dict[str, Any], self._stamped(self.last(text, run), run, self.streamed))


class _CompletionShape(_Shape):
    def __init__(self, echo: str, echo_rows: bool = False, vllm_rows: int | None = None
                 ) -> None:
        self.echo = echo
        #: the echoed prompt's logprobs go ahead of the first generated token's (once)
        self.echo_rows = echo_rows
        #: vLLM's ``prompt_logprobs`` (its top count): in the answer, or a stream's first
        #: chunk (once)
        self.vllm_rows = vllm_rows
        self.ids_sent = False  # the prompt's ids went out (return_token_ids, a stream)
        #: ``logprobs.text_offset`` of the next token: the length of the earlier tokens'
        #: texts, as the non-streamed answer counts it (never the text sent so far, which a
        #: stop string may hold back)
        self.text_at = 0

    def resumed(self, resume: handoff.Resume, tokens: int, sent_chars: int) -> None:
        super().resumed(resume, tokens, sent_chars)
        if tokens:  # the echo went out with the first token's chunk
            self.ids_sent = True
            self.text_at = sum(len(self.tok.token_text(t)) for t in self.run.tokens[:tokens])
            if self.echo_rows:  # the prompt's logprobs went out first: offsets count it
                self.text_at += sum(len(self.tok.token_text(t)) for t in self.run.prompt)
            self.echo_rows, self.vllm_rows = False, None
            self.echo = ""

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion",
                "created": self.created, "model": self.service.config.model_name,
                "system_fingerprint": self.service.system_fingerprint}

    def _choice(self, text: str, tokens: list[int], run: RequestRun, finish: str | None,
                infos: list[TokenLogprobs] | None) -> dict[str, Any]:
        logprobs = None
        if run.sampling.logprobs is not None and infos is not None:
            head = None
            if self.echo_rows:
                self.echo_rows = False
                head = echo_logprobs(self.tok, run.prompt, run.prompt_rows,
                                     run.sampling.logprobs, self.text_at)
                self.text_at += sum(len(t) for t in head["tokens"])
            logprobs = completion_logprobs(self.tok, infos, self.text_at)
            self.text_at += sum(len(t) for t in logprobs["tokens"])
            if head is not None:
                logprobs = {key: head[key] + logprobs[key] for key in logprobs}
        # vLLM's stop_reason: on every chunk of a stream, null until the one that finishes
        choice = {"index": self.index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish, "stop_reason": None if finish is None else
                  run.stop_reason, "token_ids": tokens}
        if self.vllm_rows is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tok, run.prompt, run.prompt_rows, run.prompt_ranks, self.vllm_rows)
            self.vllm_rows = None
        return choice

    def whole(self, text: str, run: RequestRun) -> dict[str, Any]:
        choice = self._choice(self.echo + text, run.tokens, run, run.finish_reason,
                              run.token_logprobs)
        if self.prompt_ids:
            choice["prompt_token_ids"] = run.prompt
        return {**self._head(), "choices": [choice], "usage": _usage(run)}

    def _first(self, chunk: dict[str, Any], run: RequestRun) -> dict[str, Any]:
        """``chunk`` with the prompt's ids when it is the stream's first (``prompt_ids``)."""
        if self.prompt_ids and not self.ids_sent:
            chunk["choices"][0]["prompt_token_ids"] = run.prompt
        self.ids_sent = True
        return chunk

    def _with_echo(self, text: str) -> str:
        """``text`` after the echoed prompt, if the prompt was not sent yet (the first chunk
        carries it; with no token generated, the last one)."""
        if self.echo:
            text, self.echo = self.echo + text, ""
        return text

    def piece(self, text: str, token: int, run: RequestRun) -> dict[str, Any]:
        return self._first({**self._head(), "choices": [self._choice(
            self._with_echo(text), [token], run, None, self._new_logprobs(run))]}, run)

    def last(self, text: str, run: RequestRun) -> dict[str, Any]:
        # no usage here: only the usage chunk carries it, when include_usage asks (as chat)
        return self._first({**self._head(), "choices": [self._choice(
            self._with_echo(text), _stop_ids(run), run, run.finish_reason,
            self._new_logprobs(run))]}, run)


class _ChatShape(_Shape):
    PREFIX = "chatcmpl"
    #: the answer's ``service_tier`` (``"default"``: one tier here) when the request set one,
    #: on the whole answer and every chunk, as OpenAI's ``ChatCompletion`` and
    #: ``ChatCompletionChunk`` say ("when the service_tier parameter is set, the response
    #: body will include the service_tier value ... actually used"); None: left out
    service_tier: str | None = None

    def _head(self, chunk: bool = False) -> dict[str, Any]:
        head = {"id": self.id,
                "object": "chat.completion.chunk" if chunk else "chat.completion",
                "created": self.created, "model": self.service.config.model_name,
                "system_fingerprint": self.service.system_fingerprint}
        if self.service_tier is not None:
            head["service_tier"] = self.service_tier
        return head

    def _logprobs(self, run: RequestRun, infos: list[TokenLogprobs]) -> dict[str, Any] | None:
        return None if run.sampling.logprobs is None else chat_logprobs(self.tok, infos)

    def whole(self, text: str, run: RequestRun) -> dict[str, Any]:
        return {**self._head(), "choices": [{
            "index": self.index, "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(run, run.token_logprobs),
            "finish_reason": run.finish_reason, "stop_reason": run.stop_reason,
            "token_ids": run.tokens}],
            "usage": _usage(run), **({"prompt_token_ids": run.prompt} if self.prompt_ids else {})}

    def opening(self, index: int | None = None) -> list[dict[str, Any]]:
        if self.opened:  # a replica before this one sent it
            return []
        return [{**self._head(chunk=True), "choices": [{
            "index": self.index if index is None else index, "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None}],
            **({"prompt_token_ids": self.run.prompt} if self.prompt_ids else {})}]

    def piece(self, text: str, token: int, run: RequestRun) -> dict[str, Any] | None:
        return {**self._head(chunk=True), "choices": [{
            "index": self.index, "delta": {"content": text},
            "logprobs": self._logprobs(run, self._new_logprobs(run)), "finish_reason": None,
            "token_ids": [token]}]}

    def last(self, text: str, run: RequestRun) -> dict[str, Any]:
        infos = self._new_logprobs(run)  # the stop token's, if one ended it
        chunk = {**self._head(chunk=True), "choices": [{
            "index": self.index, "delta": {"content": text} if text else {},
            "logprobs": self._logprobs(run, infos) if infos else None,
            "finish_reason": run.finish_reason, "stop_reason": run.stop_reason}]}
        if run.stop_token is not None:
            chunk["choices"][0]["token_ids"] = _stop_ids(run)
        return chunk


class _ToolChatShape(_ChatShape):
    """A chat response that may call tools (drivers/serving/grammar.py): the message's
    ``tool_calls`` (``content`` the text outside them, null when none) and ``finish_reason``
    ``"tool_calls"`` when the output made calls (``"stop"`` for the calls of a named
    ``tool_choice``, as OpenAI answers them); streamed, ``delta.tool_calls`` pieces as
    OpenAI sends them (grammar.ToolCallStream). A token whose text is held back (it may open
    or close a call) sends no chunk: its id goes with the next one."""

    def __init__(self, tools: tuple[grammar.Tool, ...], named: bool = False,
                 forced: bool = False) -> None:
        self.tools = tools
        #: ``tool_choice`` named the function: its calls end ``"stop"``, as OpenAI's (and
        #: vLLM's) do; "auto" and "required" calls end ``"tool_calls"``
        self.named = named
        #: a named function's output is its arguments alone (grammar.chat_structure)
        self.function = tools[0].name if named else None
        #: the output is calls only (named or "required"): a call cut in its arguments is
        #: the call, as streamed (grammar.parse_tool_calls)
        self.forced = forced
        self.calls = grammar.ToolCallStream(self.function, forced)
        self.held_ids: list[int] = []

    def opening(self, index: int | None = None) -> list[dict[str, Any]]:
        # content null, as OpenAI's first chunk of a tool call: the answer may be calls only,
        # whose whole message has content null; text that follows fills it in. An opening
        # "" made the SDK's stream helper (and any client that joins the deltas) end a call
        # with content "" where the whole answer says null, after an empty content.delta.
        chunks = super().opening(index)
        for chunk in chunks:
            chunk["choices"][0]["delta"]["content"] = None
        return chunks

    def _finish(self, run: RequestRun, calls: int) -> str | None:
        """``"tool_calls"`` when the output ended (not at ``max_tokens``) with ``calls``
        whole calls made: a stop string that cut the last call's arguments leaves
        ``"stop"``, whole and streamed alike (the whole answer said ``"tool_calls"`` of
        arguments that are no JSON, the stream ``"stop"`` even of a call whose closing
        markup alone the stop string cut)."""
        if calls and run.finish_reason == "stop" and not self.named:
            return "tool_calls"
        return run.finish_reason

    def whole(self, text: str, run: RequestRun) -> dict[str, Any]:
        answer = super().whole(text, run)
        content, calls = grammar.parse_tool_calls(text, self.function, self.forced)
        choice = answer["choices"][0]
        choice["message"] = {"role": "assistant", "content": content,
                             **({"tool_calls": calls} if calls else {})}
        whole = bool(calls) and grammar.whole_json(calls[-1]["function"]["arguments"])
        choice["finish_reason"] = self._finish(run, len(calls) if whole else 0)
        return answer

    def _chunk(self, delta: dict[str, Any], run: RequestRun, token_ids: list[int],
               finish: str | None = None) -> dict[str, Any]:
        infos = self._new_logprobs(run)  # none left for a last chunk that holds no token:
        # null there, as a text chat's last chunk (it was {"content": []})
        return {**self._head(chunk=True), "choices": [{
            "index": self.index, "delta": delta,
            "logprobs": self._logprobs(run, infos) if infos else None, "finish_reason": finish,
            "token_ids": token_ids}]}

    def piece(self, text: str, token: int, run: RequestRun) -> dict[str, Any] | None:
        self.held_ids.append(token)
        deltas = self.calls.feed(text)
        if not deltas:
            return None
        ids, self.held_ids = self.held_ids, []
        return self._chunk(_merged(deltas), run, ids)

    def last(self, text: str, run: RequestRun) -> dict[str, Any]:
        deltas = self.calls.feed(text, final=True)
        finish = self._finish(run, 0 if self.calls.args_cut else self.calls.calls)
        ids, self.held_ids = self.held_ids + _stop_ids(run), []
        chunk = self._chunk(_merged(deltas) if deltas else {}, run, ids, finish)
        chunk["choices"][0]["stop_reason"] = run.stop_reason
        if not ids:
            del chunk["choices"][0]["token_ids"]
        return chunk


def _merged(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """Deltas of one token as one chunk's ``delta``: content joined, tool call pieces listed
    (a call's first piece and its arguments' first piece are one entry)."""
    content = "".join(d["content"] for d in deltas if "content" in d)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        for piece in d.get("tool_calls", ()):
            if calls and calls[-1]["index"] == piece["index"] and "id" not in piece:
                calls[-1]["function"]["arguments"] += piece["function"]["arguments"]
            else:
                calls.append({**piece, "function": dict(piece["function"])})
    merged: dict[str, Any] = {}
    if content:
        merged["content"] = content
    if calls:
        merged["tool_calls"] = calls
    return merged
