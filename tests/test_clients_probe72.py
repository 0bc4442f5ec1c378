"""Stop 72's probe with real clients (docs/traceability.md "Found at stop 72 (clients)"): the
official ``openai`` SDK (3.51, the pinned one), unmodified, against a loopback server on the
synthetic model with the uvicorn configuration ``calexec serve`` runs (``serve_like``), as a
team adopting the server calls it. Client timeout 30 s, no retries."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import needs
from test_server_support import MODEL, serve_like_fixture  # noqa: F401 - the fixture

openai = needs.module("openai", "clients")

TIMEOUT_S = 30.0


@pytest.fixture(scope="module", name="sdk")
def sdk_fixture(serve_like) -> Iterator:
    client = openai.OpenAI(base_url=f"{serve_like.url}/v1", api_key="unused", max_retries=0,
                           timeout=TIMEOUT_S)
    yield client
    client.close()


# ---- SDK methods of endpoints this server does not serve ---------------------------------------
def test_the_sdks_responses_compact_is_told_compaction_is_not_served(sdk):
    """``client.responses.compact(model=..., input=...)`` (``POST /v1/responses/compact``,
    the SDK's compaction pass an agent runs when its conversation grows) reached the
    stored-response route ``/v1/responses/{response_id}`` and was a 405 ``POST
    /v1/responses/compact: method not allowed (allowed: DELETE, HEAD, GET)``, as if
    ``compact`` were the id of a stored response and another method would do: the user was
    sent the wrong way. It is now the 404 of an endpoint not served, saying why and what to
    send instead, as the other such endpoints say (tests/test_clients_probe64.py)."""
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.compact(model=MODEL, input="hello")
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "not_found", error
    message = error["message"]
    assert message.startswith("POST /v1/responses/compact: no such route: "), message
    assert "compaction" in message and "send the whole conversation in input" in message
    assert "method not allowed" not in message
    assert caught.value.response.headers.get("allow") is None


def test_a_stored_response_named_compact_is_still_looked_up_as_one(sdk):
    """``GET``/``DELETE /v1/responses/compact`` are the stored-response routes' own answer
    (the id ``compact`` is not found: nothing is stored), unchanged."""
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.retrieve("compact")
    assert caught.value.body["param"] == "response_id"
    assert "response \"compact\" not found" in caught.value.body["message"]


def test_the_sdks_chat_completions_list_is_told_nothing_is_stored(sdk):
    """``client.chat.completions.list()`` (``GET /v1/chat/completions``: the stored chat
    completions) was a 405 ``method not allowed (allowed: POST)`` and nothing more, where the
    SDK's other stored-completion methods (``retrieve``, ``update``, ``delete``,
    ``messages.list``) are told that this server stores nothing (stop 64). The 405 and its
    ``Allow: POST`` stay (the path is the chat route, for POST), and its message says why."""
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.chat.completions.list()
    assert caught.value.status_code == 405
    assert caught.value.response.headers.get("allow") == "POST"
    message = caught.value.body["message"]
    assert message.startswith("GET /v1/chat/completions: method not allowed (allowed: POST)")
    assert "this server stores nothing" in message, message


def test_the_sdks_responses_websocket_mode_is_told_it_is_not_served(serve_like, sdk):
    """``client.responses.connect()`` (the Responses WebSocket mode: ``GET /v1/responses``
    asking to upgrade to a WebSocket) was refused with the 405 of a plain ``GET``, ``method
    not allowed (allowed: POST)``: nothing said the mode is not served nor what to use. The
    405 stays (``calexec serve`` speaks no WebSocket: the handshake is served as a plain
    request) and its message now says so and names ``POST /v1/responses`` with ``stream``."""
    httpx = needs.module("httpx", "server")
    head = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13",
            "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="}
    answer = httpx.get(f"{serve_like.url}/v1/responses", headers=head, timeout=TIMEOUT_S)
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    message = answer.json()["error"]["message"]
    assert message.startswith("GET /v1/responses: method not allowed (allowed: POST)")
    assert "WebSocket" in message and "POST /v1/responses" in message and "stream" in message
    plain = httpx.get(f"{serve_like.url}/v1/responses", timeout=TIMEOUT_S).json()
    assert plain["error"]["message"] == ("GET /v1/responses: method not allowed "
                                         "(allowed: POST)")
    websockets = needs.module("websockets", "clients")
    with pytest.raises(websockets.exceptions.InvalidStatus) as caught:
        with sdk.responses.connect():
            pass
    assert caught.value.response.status_code == 405
    assert b"WebSocket" in bytes(caught.value.response.body)


# ---- the SDK's Responses items and tools sent back with every field ------------------------------
#: a function tool the synthetic model calls with whole arguments under "required"
ADD = {"type": "function", "name": "add", "description": "add", "strict": True, "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}


def _called(sdk):
    """A Response whose output is one function call of ``ADD``."""
    answer = sdk.responses.create(model=MODEL, input="add", tools=[ADD], tool_choice="required",
                                  parallel_tool_calls=False, max_output_tokens=100)
    assert [item.type for item in answer.output] == ["function_call"], answer.output
    return answer


def test_the_sdks_output_items_dumped_whole_are_taken_back_as_input(sdk):
    """The SDK (3.51) declares on a ``function_call`` item ``async``, ``caller`` and
    ``namespace`` (on its output type and its input ``ResponseFunctionToolCallParam``), and on
    a ``function_call_output`` input ``caller``, ``name`` and ``namespace``. A client sending
    the previous output back dumped whole (``item.model_dump(by_alias=True)``, ``mode="json"``:
    ``"async": null, "caller": null, "namespace": null``) or writing the output item with
    its function's ``name`` and ``caller: {"type": "direct"}`` was refused, 400 ``input[1].async:
    unknown key of a function_call item``, though every value said what the server does.
    Those neutral values are now taken (the next turn is the same conversation as without
    them); a value that asks for what this server does not do is refused naming it (next
    test)."""
    answer = _called(sdk)
    call = answer.output[0]
    plain = [{"role": "user", "content": "add"}, *answer.output,
             {"type": "function_call_output", "call_id": call.call_id, "output": "3"}]
    whole = [{"role": "user", "content": "add"},
             *[item.model_dump(mode="json", by_alias=True) for item in answer.output],
             {"type": "function_call_output", "call_id": call.call_id, "output": "3",
              "name": call.name, "caller": {"type": "direct"}, "namespace": None}]
    assert {"async", "caller", "namespace"} <= set(whole[1]), whole[1]
    replies = [sdk.responses.create(model=MODEL, input=items, tools=[ADD], max_output_tokens=6)
               for items in (plain, whole)]
    assert replies[0].output_text == replies[1].output_text
    assert replies[0].usage.input_tokens == replies[1].usage.input_tokens


@pytest.mark.parametrize(("where", "key", "value", "words"), [
    ("call", "async", True, "asynchronous"),
    ("call", "caller", {"type": "program", "caller_id": "ci_1"}, "programmatic"),
    ("call", "namespace", "tools", "namespace"),
    ("output", "caller", {"type": "program", "caller_id": "ci_1"}, "programmatic"),
    ("output", "namespace", "tools", "namespace"),
    ("output", "name", 7, "string"),
])
def test_an_items_field_asking_what_is_not_served_is_refused_naming_it(sdk, where, key, value,
                                                                       words):
    answer = _called(sdk)
    call = answer.output[0].model_dump(mode="json", by_alias=True, exclude_none=True)
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "3"}
    (call if where == "call" else output)[key] = value
    index = 1 if where == "call" else 2
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.responses.create(model=MODEL, input=[{"role": "user", "content": "add"}, call, output],
                             tools=[ADD], max_output_tokens=6)
    error = caught.value.body
    assert error["param"] == f"input.{index}.{key}", error
    assert error["message"].startswith(f"input[{index}].{key}="), error
    assert words in error["message"], error


def test_the_sdks_function_tool_dumped_whole_is_taken(sdk):
    """The SDK's Responses ``FunctionTool`` (3.51) has ``allowed_callers``, ``async``,
    ``defer_loading`` and ``output_schema`` beside chat's fields: the tools echoed in a
    Response and sent again dumped whole (``tool.model_dump(by_alias=True)``: all null), or
    written with ``defer_loading: false`` or ``allowed_callers: ["direct"]``, were a 400
    ``tools.0.allowed_callers: unknown field``. Their neutral values are now taken (the same
    answer as without them); others are refused naming the field."""
    answer = _called(sdk)
    echoed = answer.tools[0].model_dump(mode="json", by_alias=True)
    assert {"allowed_callers", "async", "defer_loading", "output_schema"} <= set(echoed)
    written = {**ADD, "defer_loading": False, "async": False, "allowed_callers": ["direct"]}
    # (the rendered prompt writes a tool's keys in their order: each is compared with the
    # tool of the same keys, in the same order, without those fields)
    for tool, alone in ((echoed, answer.tools[0].model_dump(mode="json", exclude_none=True)),
                        (written, ADD)):
        again, plain = (sdk.responses.create(
            model=MODEL, input="add", tools=[each], tool_choice="required",
            parallel_tool_calls=False, max_output_tokens=100) for each in (tool, alone))
        assert [(o.name, o.arguments) for o in again.output] == [
            (o.name, o.arguments) for o in plain.output]
        assert again.usage.input_tokens == plain.usage.input_tokens
    for key, value, words in (("defer_loading", True, "tool search"),
                              ("async", True, "asynchronous"),
                              ("allowed_callers", ["programmatic"], "directly"),
                              ("output_schema", {"type": "string"}, "output_schema")):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model=MODEL, input="add", tools=[{**ADD, key: value}],
                                 max_output_tokens=6)
        error = caught.value.body
        assert error["param"] == f"tools.0.{key}", error
        assert error["message"].startswith(f"tools[0].{key}="), error
        assert words in error["message"], error


def test_responses_tool_choice_auto_without_tools_is_the_default_it_echoes(sdk):
    """A Response without tools says ``tool_choice: "auto"`` (OpenAI's default, echoed), and
    the same value sent back (``tool_choice=previous.tool_choice``; a framework sending
    ``"auto"`` whatever its tool list, empty included) was a 400 ``tool_choice="auto": needs
    tools``: vLLM's ``/v1/responses`` defaults it to ``"auto"`` and takes it without tools.
    ``"auto"`` without tools is now the default it is on ``/v1/responses`` (the same answer
    as without it); ``"required"`` or a named function without tools stays a 400 naming
    ``tool_choice``, and chat keeps OpenAI's refusal of any choice without tools."""
    plain = sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    assert plain.tool_choice == "auto" and plain.tools == []
    for extra in ({"tool_choice": plain.tool_choice}, {"tool_choice": "auto", "tools": []}):
        again = sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4, **extra)
        assert again.output_text == plain.output_text and again.tool_choice == "auto"
        assert again.usage.input_tokens == plain.usage.input_tokens
    counted = sdk.responses.input_tokens.count(model=MODEL, input="hello", tool_choice="auto")
    assert counted.input_tokens == plain.usage.input_tokens
    for choice in ("required", {"type": "function", "name": "add"}):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4,
                                 tool_choice=choice)
        assert caught.value.body["param"] == "tool_choice", caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                    max_tokens=4, tool_choice="auto")
    assert caught.value.body["param"] == "tool_choice", caught.value.body


def test_a_responses_body_of_a_responses_own_fields_is_taken(sdk):
    """Every request parameter of the SDK's ``responses.create`` a Response echoes, sent back
    as it echoes them (a client repeating a request from the Response's own settings, or
    passing each parameter with null for "not given"), is taken: ``access_programs``,
    ``image`` and ``moderation`` (the SDK 3.51's, echoed null) were each a 400 ``unknown
    parameter``, null included, where chat takes ``moderation: null``. Null is now "not
    given" for them, as for every other field; a value is refused naming it and why."""
    import inspect

    from openai.resources.responses import Responses

    names = set(inspect.signature(Responses.create).parameters) - {
        "self", "extra_headers", "extra_query", "extra_body", "timeout", "stream", "input"}
    first = sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    echoed = {k: v for k, v in first.model_dump(mode="json", by_alias=True).items()
              if k in names}
    assert {"access_programs", "image", "moderation"} <= set(echoed), sorted(echoed)
    again = sdk.responses.create(input="hello", **echoed)
    assert again.output_text == first.output_text
    for key, value, words in (("moderation", {"model": "omni-moderation-latest"},
                               "moderation is not performed"),
                              ("image", {"context_compression": "enabled"}, "text only"),
                              ("access_programs", {"programs": ["x"]}, "not supported")):
        with pytest.raises(openai.BadRequestError) as caught:
            sdk.responses.create(model=MODEL, input="hello", max_output_tokens=4,
                                 extra_body={key: value})
        error = caught.value.body
        assert error["param"] == key and words in error["message"], error
