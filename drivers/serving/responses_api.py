"""OpenAI's Responses API, ``POST /v1/responses``, on the chat path (docs/server.md,
"Responses API").

A Responses body is translated into a chat body (``input`` items -> ``messages``,
``instructions`` -> a system message first, ``max_output_tokens`` -> ``max_completion_tokens``,
``text.format`` -> ``response_format``, the flat function tools -> chat's), answered by
``/v1/chat/completions``' own pipeline (openai_api.ChatPath: admission, deadlines,
structured outputs, tools, cancellation, metrics, errors), and its answer translated back: the
chat completion into a Response object, the chat stream into the Responses' semantic events
(``response.created`` ... ``response.completed``, each with its ``sequence_number``), a chat
error into the same OpenAI error with the Responses' field named in ``param``.

Nothing is stored: ``store`` is accepted (OpenAI's default is true) and nothing is kept, so
``previous_response_id``, ``conversation`` and ``background`` are refused, and
``GET``/``DELETE /v1/responses/{id}`` answer 404 naming the id.
"""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import attrs
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

from calexec.contracts.errors import Category
from calexec.contracts.fields import shown
from calexec.contracts.status import Phase, Status
from calexec.drivers.serving import metrics, wire
from calexec.drivers.serving.openai_api import (
    ChatPath,
    ChatRequest,
    Number,
    Refusal,
    auth_refusal,
    drop_nulls,
    invalid,
    metadata_refusal,
    parse,
    unknown_part_key,
)
from calexec.drivers.serving.service import RouteService

#: ``input`` message roles (a ``tool`` answer is a ``function_call_output`` item)
INPUT_ROLES = ("user", "system", "developer", "assistant")
#: the keys of each input item kind (the SDK sends an output item back as it got it)
ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
             # parsed_arguments: the SDK's parse of the arguments (responses.parse), ignored
             "function_call": {"type", "id", "call_id", "name", "arguments", "status",
                               "parsed_arguments"},
             "function_call_output": {"type", "id", "call_id", "output", "status"}}


def _direct(value: Any) -> bool:
    return value is None or value == {"type": "direct"}


def _not_true(value: Any) -> bool:
    return value is None or value is False


#: fields the SDK (openai 3.51) declares on an input item or a function tool beyond what
#: this server reads, taken at the values that say what the server does (a client sends its
#: items and tools back dumped whole, ``model_dump(by_alias=True)``: every one null), refused
#: otherwise: kind -> key -> (accepted?, why refused). Until stop 72 every one was an
#: unknown key, null included
NEUTRAL_KEYS: dict[str, dict[str, tuple[Callable[[Any], bool], str]]] = {
    "function_call": {
        "async": (_not_true, "asynchronous function calls are not supported (null or false)"),
        "caller": (_direct, "only calls the model made directly (null or {\"type\": "
                   "\"direct\"}): programmatic tool calling is not supported"),
        "namespace": (lambda v: v is None, "a function in a namespace is not served (the "
                      "tools here are flat function tools): null")},
    "function_call_output": {
        "caller": (_direct, "only outputs of calls the model made directly (null or "
                   "{\"type\": \"direct\"}): programmatic tool calling is not supported"),
        "namespace": (lambda v: v is None, "a function in a namespace is not served (the "
                      "tools here are flat function tools): null"),
        # the function's name: call_id already ties the output to its call
        "name": (lambda v: v is None or isinstance(v, str), "must be a string or null")},
    "tool": {
        "async": (_not_true, "asynchronous function calls are not supported (null or false)"),
        "allowed_callers": (lambda v: v is None or (isinstance(v, list) and "direct" in v),
                            "the model here calls functions directly only: null or a list "
                            "with \"direct\""),
        "defer_loading": (_not_true, "tool search is not supported: a deferred function "
                          "would never be loaded (null or false)"),
        "output_schema": (lambda v: v is None, "a function's output_schema is not supported "
                          "(null)")},
}


def _neutral(kind: str, item: dict[str, Any], at: str, param: str) -> dict[str, Any]:
    """``item`` without its :data:`NEUTRAL_KEYS` of ``kind``, each checked (a value asking
    for what this server does not do: :class:`Refusal` naming ``at.KEY`` / ``param.KEY``)."""
    keys = NEUTRAL_KEYS[kind]
    for key in sorted(set(item) & set(keys)):
        accepted, why = keys[key]
        if not accepted(item[key]):
            raise refuse(f"{at}.{key}={shown(item[key], 80)}: {why}", f"{param}.{key}")
    return {k: v for k, v in item.items() if k not in keys}
#: text parts of a message's content (an assistant's as the server sent them: annotations,
#: logprobs, and the SDK's ``parsed`` of responses.parse, all ignored)
TEXT_PARTS = ("input_text", "output_text")
log = logging.getLogger(__name__)

#: the ``include`` that asks for the output text's logprobs (the only one honoured)
LOGPROBS = "message.output_text.logprobs"
NOTHING_STORED = ("this server stores no responses (store is accepted, nothing is kept): "
                  "send the whole conversation in input")
#: the 404 of ``POST /v1/responses/{id}/cancel``: OpenAI cancels ``background`` responses only
NOT_CANCELLABLE = ("this server keeps no responses to cancel (OpenAI cancels a background "
                   "response, and background is not run here); a request in progress is "
                   "cancelled by an operator: POST /admin/cancel/{id} with the admin token")


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. Unknown fields are refused, as chat's are; the fields this
    server cannot honour are declared ``Any`` and refused (400 naming them) unless neutral
    (:func:`unsupported`)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]]
    instructions: StrictStr | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: Number | None = None
    top_p: Number | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    metadata: dict[StrictStr, StrictStr] | None = None  # echoed, kept nowhere
    user: StrictStr | None = None
    store: StrictBool | None = None  # accepted: nothing is stored
    stream: StrictBool = False
    stream_options: dict[str, Any] | None = None  # include_obfuscation: none is added
    # one tier: echoed as "default"; the SDK's values (openai 3.51's responses.ServiceTier), as
    # chat checks its own
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast",
                          "ultrafast"] | None = None
    safety_identifier: StrictStr | None = None
    prompt_cache_key: StrictStr | None = None
    prompt_cache_options: dict[str, Any] | None = None  # nothing is cached, as on chat
    prompt_cache_retention: Literal["in_memory", "in-memory", "24h"] | None = None
    truncation: StrictStr | None = None  # "disabled" only
    timeout: Number | None = Field(default=None, gt=0)  # calexec: per-request deadline (s)
    seed: StrictInt | None = None  # vLLM's extension
    # refused unless neutral (``unsupported``)
    previous_response_id: Any = None
    conversation: Any = None
    background: StrictBool | None = None  # true refused
    reasoning: Any = None
    include: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # chat's top_logprobs
    context_management: Any = None
    # the SDK 3.51's, echoed null in every Response: null is "not given", a value refused
    # (:data:`NOT_SERVED_FIELDS`; unknown parameters, null included, until stop 72)
    moderation: Any = None
    image: Any = None
    access_programs: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_nulls(cls, data)


class InputTokensRequest(BaseModel):
    """``POST /v1/responses/input_tokens`` (the SDK's ``responses.input_tokens.count``): the
    fields of a Responses body that make its prompt, checked as ``/v1/responses`` checks
    them (:func:`counted_body`)."""

    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    input: StrictStr | list[dict[str, Any]] | None = None
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    text: dict[str, Any] | None = None
    truncation: StrictStr | None = None
    # refused unless neutral, as on /v1/responses
    previous_response_id: Any = None
    conversation: Any = None
    reasoning: Any = None
    personality: Any = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_nulls(cls, data)


def counted_body(body: InputTokensRequest) -> ChatRequest:
    """The chat body whose prompt is the input ``body`` counts: the Responses body of the
    same fields (:func:`unsupported` and :func:`chat_body` check it, as /v1/responses)."""
    if body.personality is not None:
        raise refuse(f"personality={shown(body.personality, 80)}: the served model has one "
                     "personality", "personality")
    if body.input is None:
        raise refuse("input: missing, give the input to count (a string or a list of items)",
                     "input")
    fields = body.model_dump(exclude_none=True, exclude={"personality"})
    responses = ResponsesRequest.model_validate(fields)
    unsupported(responses)
    return chat_body(responses)


def refuse(message: str, param: str) -> Refusal:
    return Refusal(invalid(message), param)


#: ``include`` values that ask for data of items this server never outputs (reasoning items: the
#: model does not reason; built-in tools' calls and input images: refused), so there is nothing
#: to add and they are accepted, as vLLM accepts them: a client that always asks for
#: ``reasoning.encrypted_content`` with ``store: false`` (Inspect's ``openai`` provider for a
#: model it does not know, Codex-style agents) is served. ``message.output_text.logprobs`` asks
#: is given (the output text's logprobs, as ``top_logprobs``, through chat's logprobs).
VACUOUS_INCLUDES = frozenset({
    "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs"})


def _check_include(include: Any) -> None:
    if include is None:
        return
    if not isinstance(include, list):
        raise refuse(f"include={shown(include, 80)}: must be a list of strings", "include")
    for i, value in enumerate(include):
        # (the output text's logprobs are given; the others name items never output)
        if not isinstance(value, str) or (value != LOGPROBS and value not in VACUOUS_INCLUDES):
            raise refuse(f"include.{i}={shown(value, 80)}: not one of "
                         f"{', '.join(sorted({LOGPROBS, *VACUOUS_INCLUDES}))}", f"include.{i}")


#: fields of a Responses body refused unless null, and why
NOT_SERVED_FIELDS = (
    ("moderation", "moderation is not performed by this server"),
    ("image", "the served model reads and writes text only (no image options)"),
    ("access_programs", "domain-specific access programs are not supported"))


def unsupported(body: ResponsesRequest) -> None:
    """:class:`Refusal` for the first field this server cannot honour."""
    metadata_refusal(body.metadata)
    for name, why in NOT_SERVED_FIELDS:
        value = getattr(body, name)
        if value is not None:
            raise refuse(f"{name}={shown(value, 80)}: {why}", name)
    if body.previous_response_id is not None:
        raise refuse(f"previous_response_id={shown(body.previous_response_id, 80)}: "
                     f"{NOTHING_STORED}", "previous_response_id")
    if body.conversation is not None:
        raise refuse(f"conversation={shown(body.conversation, 80)}: {NOTHING_STORED}",
                     "conversation")
    if body.background:
        raise refuse(f"background={shown(body.background, 80)}: background responses are "
                     "not supported (nothing is stored to poll)", "background")
    if body.reasoning not in (None, {}) and not (isinstance(body.reasoning, dict) and all(
            v is None for v in body.reasoning.values())):
        raise refuse(f"reasoning={shown(body.reasoning, 80)}: the served model does not "
                     "reason", "reasoning")
    _check_include(body.include)
    if body.prompt is not None:
        raise refuse(f"prompt={shown(body.prompt, 80)}: stored prompt templates are not "
                     "supported (nothing is stored)", "prompt")
    calls = body.max_tool_calls  # OpenAI's bound on calls to built-in tools, which are
    # refused here (``tools``): any count is honoured, none being made (a 400 until stop 71)
    if calls is not None and (type(calls) is not int or calls < 0):
        raise refuse(f"max_tool_calls={shown(calls, 80)}: must be an integer >= 0 or null "
                     "(it bounds calls to built-in tools, which this server has none of: any "
                     "count is honoured)", "max_tool_calls")
    if body.context_management is not None:
        raise refuse(f"context_management={shown(body.context_management, 80)}: not "
                     "supported", "context_management")
    if body.truncation not in (None, "disabled"):
        raise refuse(f"truncation={shown(body.truncation, 80)}: only \"disabled\" (a "
                     "conversation longer than the context is refused, never cut)",
                     "truncation")
    if body.stream_options is not None:
        if not body.stream:
            raise refuse("stream_options: only allowed with stream=true", "stream_options")
        unknown = set(body.stream_options) - {"include_obfuscation"}
        if unknown:
            key = sorted(unknown)[0][:80]
            raise refuse(f"stream_options.{key}: unknown option (only include_obfuscation)",
                         f"stream_options.{key}")
        obfuscation = body.stream_options.get("include_obfuscation")
        if obfuscation is not None and not isinstance(obfuscation, bool):
            # (taken whatever it was: a "false" string read as nothing said, where chat
            # refuses stream_options.include_usage of the wrong type)
            raise refuse(f"stream_options.include_obfuscation={shown(obfuscation, 80)}: must "
                         "be a boolean, true or false (no obfuscation is added either way)",
                         "stream_options.include_obfuscation")


# ---- request: Responses -> chat ----------------------------------------------------------------
def _part_text(part: Any, at: str, param: str) -> str:
    if not isinstance(part, dict):
        raise refuse(f"{at}={shown(part, 80)}: a content part must be an object", param)
    kind = part.get("type")
    unknown = unknown_part_key(part, at, param)  # (a text part's unknown key was taken)
    if kind in TEXT_PARTS:
        if not isinstance(part.get("text"), str):
            raise refuse(f"{at}.text={shown(part.get('text'), 80)}: must be a string",
                         f"{param}.text")
        if unknown is not None:
            raise unknown
        return str(part["text"])
    if kind == "refusal" and isinstance(part.get("refusal"), str):
        if unknown is not None:
            raise unknown
        return str(part["refusal"])
    raise refuse(f"{at}.type={shown(kind, 80)}: only text parts (input_text, output_text) "
                 "are supported: the served model reads no images, files or audio",
                 f"{param}.type")


def _content(item: dict[str, Any], i: int) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise refuse(f"input[{i}].content={shown(content, 80)}: a string or a list of text "
                     "parts", f"input.{i}.content")
    return "\n".join(_part_text(part, f"input[{i}].content[{j}]", f"input.{i}.content.{j}")
                     for j, part in enumerate(content))


def _text_of_output(output: Any, i: int) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list) and output:
        return "\n".join(_part_text(part, f"input[{i}].output[{j}]", f"input.{i}.output.{j}")
                         for j, part in enumerate(output))
    raise refuse(f"input[{i}].output={shown(output, 80)}: a string or a list of text parts",
                 f"input.{i}.output")


def _string(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise refuse(f"input[{i}].{key}={shown(value, 80)}: must be a string",
                     f"input.{i}.{key}")
    return value


def messages_of(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The chat messages of ``instructions`` and ``input``: message items as messages,
    ``function_call`` items as the tool calls of an assistant message (consecutive ones, and
    an assistant message just before them, are one message), ``function_call_output`` items
    as ``tool`` messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return [*messages, {"role": "user", "content": body.input}]
    if not body.input:
        raise refuse("input=[]: at least one item", "input")
    calls: set[str] = set()  # the call_id of every function_call item
    outputs: list[tuple[int, str]] = []  # (index, call_id) of every function_call_output
    for i, item in enumerate(body.input):
        kind = item.get("type", "message" if "role" in item else None)
        keys = ITEM_KEYS.get(kind) if isinstance(kind, str) else None
        if "type" not in item and "role" not in item:
            # (blamed on a type it never sent: "input[0].type=null: must be one of ...")
            raise refuse(f"input[{i}]: an item needs a type (message, function_call, "
                         "function_call_output) or, for a message, a role ("
                         f"{', '.join(INPUT_ROLES)}); it has neither", f"input.{i}")
        if kind == "item_reference":
            raise refuse(item_reference(i, item.get("id")), f"input.{i}.type")
        if keys is None:
            raise refuse(f"input[{i}].type={shown(kind, 80)}: must be one of message, "
                         "function_call, function_call_output (item references and built-in "
                         "tools' items are not supported: nothing is stored)",
                         f"input.{i}.type")
        if kind in NEUTRAL_KEYS:
            item = _neutral(kind, item, f"input[{i}]", f"input.{i}")
        extra = sorted(set(item) - keys)
        if extra:
            raise refuse(f"input[{i}].{extra[0][:80]}: unknown key of a {kind} item, refused",
                         f"input.{i}.{extra[0][:80]}")
        if item.get("id") is not None and not isinstance(item["id"], str):
            raise refuse(f"input[{i}].id={shown(item['id'], 80)}: must be a string",
                         f"input.{i}.id")
        if item.get("status") is not None and item["status"] not in ITEM_STATUSES:
            raise refuse(f"input[{i}].status={shown(item['status'], 80)}: must be one of "
                         f"{', '.join(ITEM_STATUSES)}", f"input.{i}.status")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise refuse(f"input[{i}].role={shown(role, 80)}: must be one of "
                             f"{', '.join(INPUT_ROLES)}", f"input.{i}.role")
            messages.append({"role": role, "content": _content(item, i)})
        elif kind == "function_call":
            calls.add(_string(item, "call_id", i))
            call = {"id": _string(item, "call_id", i), "type": "function",
                    "function": {"name": _string(item, "name", i),
                                 "arguments": _string(item, "arguments", i)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            outputs.append((i, _string(item, "call_id", i)))
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", i),
                             "content": _text_of_output(item.get("output"), i)})
    for i, call_id in outputs:
        if call_id not in calls:
            raise refuse(orphan_output(i, call_id), f"input.{i}.call_id")
    return messages


def item_reference(index: int, reference: Any) -> str:
    """The refusal of the ``item_reference`` item ``input[index]``: nothing is stored, so the
    item it names is not here. A client sends one for an item of an earlier answer while its
    ``store`` is true, whatever the answer said (``store: false``): the AI SDK's ``openai``
    provider (its Responses default) for every assistant turn of a history it answered, its
    ``store`` option true unless given; until stop 75 the message said only that references
    are not supported, and not which setting sends the item itself."""
    return (f"input[{index}].type=\"item_reference\" (id {shown(reference, 80)}): the item "
            f"of an earlier response it names is not here, nothing is stored: send the item "
            f"itself, as a client does with store: false (the AI SDK's openai provider sends "
            f"references while its store option is true, its default: give "
            f"providerOptions.openai.store = false)")


def orphan_output(index: int, call_id: str) -> str:
    """The refusal of the ``function_call_output`` item ``input[index]`` whose ``call_id``
    names no ``function_call`` item of the input. OpenAI answers it with a 400, "No tool call
    found for function call output with call_id ...": the model would read an answer to a
    call it never made (until stop 74 it was taken, a ``tool`` message of no call). Nothing is
    stored here, so the call can only come from the input: the Agents SDK and an SDK's
    ``input += response.output`` send it back with its output."""
    return (f"input[{index}].call_id={shown(call_id, 80)}: No tool call found for function "
            f"call output with call_id {shown(call_id, 80)} (no function_call item of the "
            f"input has it: send the function_call item the response gave with its output; "
            f"previous_response_id is not supported, nothing is stored)")


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's; any other tool (the built-in ones) refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise refuse(f"tools[{i}].type={shown(tool.get('type'), 80)}: only function tools "
                         "are supported (no built-in tools: web_search, file_search, "
                         "code_interpreter, computer_use, mcp, ...)", f"tools.{i}.type")
        tool = _neutral("tool", tool, f"tools[{i}]", f"tools.{i}")
        out.append({"type": "function",
                    "function": {k: v for k, v in tool.items() if k != "type"}})
    return out


#: ``tool_choice``'s strings
TOOL_CHOICES = ("none", "auto", "required")
#: an item's ``status`` (as the server sends it; an SDK sends its output items back so)
ITEM_STATUSES = ("in_progress", "completed", "incomplete")


def chat_tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if isinstance(choice, str) and choice not in TOOL_CHOICES:
        raise refuse(f"tool_choice={shown(choice, 80)}: must be \"none\", \"auto\", "
                     "\"required\", {\"type\": \"function\", \"name\": ...} or "
                     "{\"type\": \"allowed_tools\", \"mode\": ..., \"tools\": [...]}",
                     "tool_choice")
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "allowed_tools":
        return chat_allowed_tools(choice)
    if choice.get("type") != "function":
        raise refuse(f"tool_choice.type={shown(choice.get('type'), 80)}: only \"function\" "
                     "or \"allowed_tools\" (or the strings auto, none, required)",
                     "tool_choice.type")
    extra = sorted(set(choice) - {"type", "name"})
    if extra:
        raise refuse(f"tool_choice.{extra[0][:80]}: unknown key, refused",
                     f"tool_choice.{extra[0][:80]}")
    return {"type": "function", "function": {"name": choice.get("name")}}


def chat_allowed_tools(choice: dict[str, Any]) -> dict[str, Any]:
    """The Responses' ``tool_choice: {"type": "allowed_tools", "mode": ..., "tools": [{"type":
    "function", "name": ...}, ...]}`` as chat's (``{"type": "allowed_tools", "allowed_tools":
    {"mode", "tools": [{"type": "function", "function": {"name"}}]}}``), which chat's check
    (``grammar.tool_setup``) judges; its refusals name the Responses' fields
    (:func:`responses_param`)."""
    extra = sorted(set(choice) - {"type", "mode", "tools"})
    if extra:
        raise refuse(f"tool_choice.{extra[0][:80]}: unknown key, refused (allowed_tools takes "
                     "mode and tools)", f"tool_choice.{extra[0][:80]}")
    listed = choice.get("tools")
    if isinstance(listed, list):
        listed = [{"type": tool.get("type"),
                   "function": {k: v for k, v in tool.items() if k != "type"}}
                  if isinstance(tool, dict) else tool for tool in listed]
    return {"type": "allowed_tools",
            "allowed_tools": {"mode": choice.get("mode"), "tools": listed}}


def response_format(text: dict[str, Any] | None) -> Any:
    """``text.format`` as chat's ``response_format`` (None: plain text)."""
    if text is None:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise refuse(f"text.{extra[0][:80]}: unknown key, refused", f"text.{extra[0][:80]}")
    if text.get("verbosity") not in (None, "medium"):  # the default (the Agents SDK sends it)
        raise refuse(f"text.verbosity={shown(text['verbosity'], 80)}: only \"medium\" (the "
                     "default): the served model has one verbosity, so \"low\" or \"high\" "
                     "cannot be honoured", "text.verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise refuse(f"text.format={shown(fmt, 80)}: must be an object", "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        return {"type": "json_schema",
                "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    raise refuse(f"text.format.type={shown(kind, 80)}: must be one of text, json_object, "
                 "json_schema", "text.format.type")


def wants_logprobs(body: ResponsesRequest) -> bool:
    """Whether the output text carries logprobs: ``include`` names them, or ``top_logprobs``
    asks for some (as OpenAI: top tokens are given with the logprobs they belong to)."""
    return LOGPROBS in (body.include or ()) or bool(body.top_logprobs)


def logprobs_of(chat_logprobs: Any) -> list[dict[str, Any]]:
    """The Responses' ``logprobs`` (``{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}`` per token) of a chat choice's or chunk's ``logprobs`` (its ``content``: the same
    entries), empty when it has none."""
    if not isinstance(chat_logprobs, dict):
        return []
    return list(chat_logprobs.get("content") or [])


def text_logprobs(entries: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The entries of ``entries`` (a generation's tokens, in order) that wrote ``text``, the
    output's text before its tool calls: the longest run from the first whose bytes stay
    within the text's (the calls' tokens are no part of the output text)."""
    room, kept = len(text.encode()), []
    for entry in entries:
        room -= len(entry.get("bytes") or ())
        if room < 0:
            break
        kept.append(entry)
    return kept


def call_status(arguments: str, cut: bool) -> str:
    """A function call's ``status``: "incomplete" when the output was ``cut`` at its maximum
    in the call's arguments (they are no whole JSON), else "completed"."""
    if cut:
        try:
            json.loads(arguments)
        except ValueError:
            return "incomplete"
    return "completed"


def chat_body(body: ResponsesRequest) -> ChatRequest:
    """The chat request that answers ``body`` (checked by chat's own parser)."""
    given: dict[str, Any] = {
        "model": body.model, "messages": messages_of(body), "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "tools": chat_tools(body.tools),
        # "auto" without tools: the default every Response echoes, taken as vLLM's
        # /v1/responses takes it (chat keeps OpenAI's refusal of a choice without tools; a
        # 400 here until stop 72, so a Response's own tool_choice sent back was refused)
        "tool_choice": None if body.tool_choice == "auto" and not body.tools
        else chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text), "timeout": body.timeout,
        "seed": body.seed, "user": body.user}
    if body.tool_choice not in (None, "none", "auto") and not body.tools:
        # ("auto": taken above) (chat's refusal showed the chat form it was translated into, {"type": "function",
        # "function": {"name": ...}}, a value the client never sent)
        raise refuse(f"tool_choice={shown(body.tool_choice, 80)}: needs tools", "tool_choice")
    if body.stream:  # the usage of response.completed, and of response.failed: each chunk
        # carries the usage so far (vLLM's continuous_usage_stats), so a stream that fails
        # says the tokens it used (``usage: null`` until stop 64, where OpenAI's says them)
        given["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    if wants_logprobs(body):  # chat's logprobs, its top_logprobs the same
        given["logprobs"], given["top_logprobs"] = True, body.top_logprobs or 0
    try:
        return parse(ChatRequest, json.dumps(
            {k: v for k, v in given.items() if v is not None}).encode())
    except Refusal as err:
        raise responses_refusal(err) from None


#: chat's names of a field, as its refusals write them, and the Responses' (the message of a
#: refusal of the translated chat body speaks of the fields the client sent)
CHAT_WORDS = ((re.compile(r"\btools\.(\d+)\.function\."), r"tools.\1."),
              (re.compile(r"\btool_choice\.function\.name\b"), "tool_choice.name"),
              (re.compile(r"\btool_choice\.allowed_tools\."), "tool_choice."),
              (re.compile(r"\bresponse_format\.json_schema\b"), "text.format"),
              (re.compile(r"\bresponse_format\b"), "text.format"),
              (re.compile(r"\bmax_(completion_)?tokens\b"), "max_output_tokens"),
              (re.compile(r"\bmessages(\[\d+\])?"), "input"))


def responses_message(message: str) -> str:
    """A chat refusal's message with the Responses' field names."""
    for chat, responses in CHAT_WORDS:
        message = chat.sub(responses, message)
    return message


def responses_refusal(err: Refusal) -> Refusal:
    """``err`` (a refusal of the chat body) as the Responses body names its fields."""
    err.param = responses_param(err.param)
    err.status = attrs.evolve(err.status, message=responses_message(err.status.message))
    return err


def responses_param(param: str | None) -> str | None:
    """A chat error's ``param`` as the Responses body names the field."""
    if param is None:
        return None
    head, _, rest = param.partition(".")
    if head == "messages":
        return "input"
    if head in ("max_tokens", "max_completion_tokens"):
        return "max_output_tokens"
    if head == "response_format":
        return "text.format" + ("." + rest.removeprefix("json_schema.").removeprefix(
            "json_schema") if rest and rest != "json_schema" else "")
    if head == "tools" and ".function." in param:
        return param.replace(".function.", ".", 1)
    if head == "tool_choice":
        return param.replace(".allowed_tools.", ".", 1).replace(".allowed_tools", "").replace(
            ".function.", ".", 1).replace(".function", "")
    return param


# ---- answer: chat -> Response --------------------------------------------------------------
def _hex() -> str:
    return uuid.uuid4().hex


class Answer:
    """The Response object of one request, built from its chat answer (whole or streamed)."""

    def __init__(self, body: ResponsesRequest, response_id: str, model: str) -> None:
        self.body, self.id, self.model = body, response_id, model
        self.created = int(time.time())
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None

    def message(self, text: str, status: str,
                logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"id": f"msg_{_hex()}", "type": "message", "role": "assistant",
                "status": status, "content": [self.text_part(text, logprobs)]}

    @staticmethod
    def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"type": "output_text", "text": text, "annotations": [],
                "logprobs": list(logprobs or [])}

    @staticmethod
    def call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
        return {"id": f"fc_{_hex()}", "type": "function_call", "call_id": call_id,
                "name": name, "arguments": arguments, "status": status}

    def set_usage(self, usage: dict[str, Any]) -> None:
        self.usage = {"input_tokens": usage["prompt_tokens"],
                      # cache_write_tokens: required by the SDK's ResponseUsage (3.51)
                      "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": usage["total_tokens"]}

    def response(self, status: str, finish: str | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            # when the answer ended, a completed one only (OpenAI's: null while in progress and
            # for an incomplete or failed Response)
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length"
            else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": body.max_tool_calls, "metadata": body.metadata or {}, "model": self.model,
            "output": list(self.output),
            "parallel_tool_calls": True if body.parallel_tool_calls is None
            else body.parallel_tool_calls,
            "previous_response_id": None, "reasoning": None,
            "service_tier": "default", "store": False,  # nothing is kept, whatever was asked
            "temperature": 0.0 if body.temperature is None else body.temperature,
            "text": {"format": (body.text or {}).get("format") or {"type": "text"},
                     "verbosity": "medium"},
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "tools": body.tools or [], "top_p": 1.0 if body.top_p is None else body.top_p,
            # the request's hints, echoed as OpenAI echoes them: honoured (top_logprobs) or
            # nothing to do here (no cache, no safety checks), never a value not asked for
            "top_logprobs": body.top_logprobs, "prompt_cache_key": body.prompt_cache_key,
            # "in-memory" (the spelling the SDK's request type also takes) as its Response
            # type spells it, "in_memory"
            "prompt_cache_retention": None if body.prompt_cache_retention is None
            else body.prompt_cache_retention.replace("-", "_"),
            "safety_identifier": body.safety_identifier,
            "truncation": "disabled", "usage": self.usage, "user": body.user}

    def whole(self, chat: dict[str, Any]) -> dict[str, Any]:
        """The Response of a chat completion."""
        choice = chat["choices"][0]
        finish = choice["finish_reason"]
        status = "incomplete" if finish == "length" else "completed"
        message = choice["message"]
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            text, logprobs = message.get("content") or "", logprobs_of(choice.get("logprobs"))
            self.output.append(self.message(text, status, text_logprobs(logprobs, text)
                                            if calls else logprobs))
        for k, call in enumerate(calls):
            arguments = call["function"]["arguments"]
            self.output.append(self.call(call["id"], call["function"]["name"], arguments,
                                         call_status(arguments, finish == "length"
                                                     and k == len(calls) - 1)))
        self.set_usage(chat["usage"])
        return self.response(status, finish)


class EventStream:
    """The Responses' events of a chat stream: :meth:`chunk` per chat chunk, :meth:`end` at
    its ``[DONE]``, :meth:`failed` for its error event; each returns the SSE bytes."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.seq = 0
        self.text: dict[str, Any] | None = None  # the open message item
        self.text_index = -1
        self.calls: dict[int, tuple[int, dict[str, Any]]] = {}  # chat index -> (output, item)
        self.open_call: int | None = None  # the chat index of the call being streamed
        self.finish: str | None = None
        #: logprobs of tokens whose text is not sent yet (held back, or the end's)
        self.pending: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()

    def opening(self) -> bytes:
        response = self.answer.response("in_progress")
        return (self.event("response.created", response=response)
                + self.event("response.in_progress", response=response))

    def _close_text(self, status: str = "completed", call: bool = False) -> bytes:
        """Close the open message; ``call``: a tool call follows (the logprobs not sent yet
        are its markup's, not the text's)."""
        item = self.text
        if item is None:
            return b""
        self.text = None
        item["status"] = status
        part = item["content"][0]
        if not call:
            part["logprobs"] += self.pending
        self.pending = []
        text, logprobs = part["text"], part["logprobs"]
        at = {"item_id": item["id"], "output_index": self.text_index}
        return (self.event("response.output_text.done", **at, content_index=0, text=text,
                           logprobs=logprobs)
                + self.event("response.content_part.done", **at, content_index=0,
                             part=Answer.text_part(text, logprobs))
                + self.event("response.output_item.done", output_index=self.text_index,
                             item=dict(item, content=[dict(item["content"][0])])))

    def _close_call(self, cut: bool = False) -> bytes:
        """Close the open call; ``cut``: the output ended at its maximum, maybe in it."""
        if self.open_call is None:
            return b""
        index, item = self.calls[self.open_call]
        self.open_call = None
        item["status"] = call_status(item["arguments"], cut)
        return (self.event("response.function_call_arguments.done", item_id=item["id"],
                           output_index=index, arguments=item["arguments"], name=item["name"])
                + self.event("response.output_item.done", output_index=index, item=dict(item)))

    def _text(self, delta: str, logprobs: list[dict[str, Any]] | None = None) -> bytes:
        out = b""
        if self.text is None:
            out += self._close_call()
            self.text = self.answer.message("", "in_progress")
            self.text["content"] = []
            self.text_index = len(self.answer.output)
            self.answer.output.append(self.text)
            at = {"item_id": self.text["id"], "output_index": self.text_index}
            out += self.event("response.output_item.added", output_index=self.text_index,
                              item=dict(self.text, content=[]))
            self.text["content"].append(Answer.text_part(""))
            out += self.event("response.content_part.added", **at, content_index=0,
                              part=Answer.text_part(""))
        sent = self.pending + list(logprobs or [])
        self.pending = []
        self.text["content"][0]["text"] += delta
        self.text["content"][0]["logprobs"] += sent
        return out + self.event("response.output_text.delta", item_id=self.text["id"],
                                output_index=self.text_index, content_index=0, delta=delta,
                                logprobs=sent)

    def _call(self, piece: dict[str, Any]) -> bytes:
        out = b""
        k = piece.get("index", 0)
        function = piece.get("function") or {}
        if k not in self.calls:
            out += self._close_text(call=True) + self._close_call()
            item = Answer.call(piece.get("id") or "", function.get("name") or "", "",
                               "in_progress")
            self.calls[k] = (len(self.answer.output), item)
            self.answer.output.append(item)
            self.open_call = k
            out += self.event("response.output_item.added", output_index=self.calls[k][0],
                              item=dict(item))
        index, item = self.calls[k]
        delta = function.get("arguments") or ""
        if delta:
            item["arguments"] += delta
            out += self.event("response.function_call_arguments.delta", item_id=item["id"],
                              output_index=index, delta=delta)
        return out

    def chunk(self, chunk: dict[str, Any]) -> bytes:
        if chunk.get("usage"):
            self.answer.set_usage(chunk["usage"])
        out = b""
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            logprobs = logprobs_of(choice.get("logprobs"))
            if delta.get("content"):
                out += self._text(delta["content"], logprobs)
            elif not delta.get("tool_calls"):  # text held back, or the end's token
                self.pending += logprobs
            for piece in delta.get("tool_calls") or ():
                out += self._call(piece)
            if choice.get("finish_reason") is not None:
                self.finish = choice["finish_reason"]
        return out

    def end(self) -> bytes:
        incomplete = self.finish == "length"
        status = "incomplete" if incomplete else "completed"
        out = self._close_text(status) + self._close_call(incomplete)
        if not self.answer.output:  # no text, no call: the empty message, as whole() has it
            out += self._text("") + self._close_text(status)
        return out + self.event(f"response.{status}",
                                response=self.answer.response(status, self.finish))

    def failed(self, error: dict[str, Any]) -> bytes:
        """``response.failed`` for chat's error event ``error``: its ``response.error`` in the
        documented shape, ``code`` one of OpenAI's (``rate_limit_exceeded`` for a rate limit,
        else ``server_error``: chat's own code, ``request.deadline``, is no value a validating
        client takes), chat's code kept at the end of the message, its error type in ``type``."""
        for item in self.answer.output:
            if item["status"] == "in_progress":
                item["status"] = "incomplete"
        kind = error.get("type")
        code = "rate_limit_exceeded" if kind == "rate_limit_error" else "server_error"
        message = error.get("message") or "the response failed"
        if error.get("code") and error["code"] != code:
            message = f"{message} ({error['code']})"
        return self.event("response.failed", response=self.answer.response(
            "failed", error={"code": code, "message": responses_message(message),
                             "type": kind, "param": responses_param(error.get("param"))}))


def _error_answer(answer: Response) -> Response:
    """A chat error response with the Responses' ``param``; its status and headers kept."""
    try:
        body = json.loads(bytes(answer.body))
    except ValueError:
        return answer
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        error["param"] = responses_param(error.get("param"))
        for holder in (error, body.get("status")):
            if isinstance(holder, dict) and isinstance(holder.get("message"), str):
                holder["message"] = responses_message(holder["message"])
    headers = {k: v for k, v in answer.headers.items()
               if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(body, answer.status_code, headers=headers)


def add_routes(app: FastAPI, owner: RouteService, chat: ChatPath) -> None:
    """``POST /v1/responses`` (on ``chat``) and the 404s of the stored-response routes."""

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        response_id = f"resp_{_hex()}"
        wire.name_request(request.scope, response_id)
        with owner.service.arriving(request.scope, response_id):  # (a cancel sticks)
            return await _responses(request, response_id)

    async def _responses(request: Request, response_id: str) -> Response:
        service = owner.service
        try:
            body = await chat.read(request, ResponsesRequest)
            unsupported(body)
            chat_request = chat_body(body)
        except Refusal as err:
            return chat.refused(err)
        answer = Answer(body, response_id, service.config.model_name)
        result = await chat.answer(request, chat_request, response_id, "input",
                                   "max_output_tokens")
        if result.status_code != 200:
            return _error_answer(result)
        if not isinstance(result, wire.BoundedStreamingResponse):
            return JSONResponse(answer.whole(json.loads(bytes(result.body))))
        return wire.BoundedStreamingResponse(
            _relay(result, EventStream(answer)), result.bounds, result.until, result.on_cut,
            result.sending, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/responses/input_tokens")
    async def input_tokens(request: Request) -> Response:
        """The prompt tokens a Responses body would be admitted with, nothing generated
        (OpenAI's ``{"object": "response.input_tokens", "input_tokens": N}``); refusals are
        /v1/responses' own, not counted as failed requests."""
        try:
            body = await chat.read(request, InputTokensRequest)
            count = await chat.count(request, counted_body(body))
        except Refusal as err:
            return chat.answered(responses_refusal(err))
        return JSONResponse({"object": "response.input_tokens", "input_tokens": count})

    def not_stored(response_id: str, why: str = NOTHING_STORED) -> Response:
        return chat.answered(Refusal(Status.failure(
            "request.not_found", Category.INVALID_REQUEST, Phase.VALIDATE,
            f"response {shown(response_id, 80)} not found: {why}"),
            "response_id", 404))

    async def stored(request: Request, response_id: str) -> Response:
        service = owner.service
        auth = auth_refusal(request, service.config.api_key)
        if auth is not None:
            return chat.answered(auth)
        return not_stored(response_id)

    async def cancel(request: Request, response_id: str) -> Response:
        """OpenAI's cancel of a ``background`` response, which this server does not run
        (``background: true`` is refused): no response is kept to cancel. A request in
        progress is an operator's to cancel, and the 404 says how."""
        service = owner.service
        auth = auth_refusal(request, service.config.api_key)
        if auth is not None:
            return chat.answered(auth)
        return not_stored(response_id, NOT_CANCELLABLE)

    app.add_api_route("/v1/responses/{response_id}", stored, methods=["GET", "DELETE"])
    app.add_api_route("/v1/responses/{response_id}/input_items", stored, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}/cancel", cancel, methods=["POST"])


async def _relay(chat: wire.BoundedStreamingResponse, events: EventStream
                 ) -> AsyncIterator[bytes]:
    """The Responses' events of the chat stream ``chat`` (its body closed with this one: its
    ``finally`` gives back what the request holds)."""
    inner = chat.body_iterator
    try:
        yield events.opening()
        pending = b""
        async for piece in inner:
            pending += piece.encode() if isinstance(piece, str) else bytes(piece)
            out = b""
            try:
                while b"\n\n" in pending:
                    frame, pending = pending.split(b"\n\n", 1)
                    data = frame.removeprefix(b"data: ")
                    if data == b"[DONE]":
                        end = out + events.end()
                        metrics.mark_whole()  # (response.completed or .incomplete)
                        yield end
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        yield out + events.failed(chunk["error"])
                        return
                    out += events.chunk(chunk)
            except Exception as exc:  # noqa: BLE001 - a bug here: the stream's failure, said
                log.exception("request %s: translating the chat stream", events.answer.id)
                metrics.mark_whole(False)  # (the chat stream said [DONE]: not this answer)
                yield out + events.failed({"code": "server_error", "message":
                                           f"unexpected {type(exc).__name__} (server log)"})
                return
            if out:
                yield out
        # ended with neither [DONE] nor an error event: said, never a silently cut stream
        yield events.failed({"code": "server_error",
                             "message": "the response's stream ended before it finished"})
    finally:
        close = getattr(inner, "aclose", None)
        if close is not None:
            await close()
