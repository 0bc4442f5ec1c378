"""Stop 64's probe with real clients (the official ``openai`` SDK, langchain-openai) against a
loopback server on the synthetic model: what a client met, each pinned here
(docs/traceability.md "Found at stop 64 (clients)"). Client timeout 10 s, no retries."""

from __future__ import annotations

import openai
import pytest

import needs
from calexec.drivers.serving import grammar
from test_server_support import (
    MODEL,
    sdk_client_fixture,  # noqa: F401 - the fixture ``client``
    streamed_chat,
)

TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"], "additionalProperties": False}}}
#: a tool the greedy synthetic model calls twice under "required" (seed of the synthetic calbin)
TWICE = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}
MESSAGES = [{"role": "user", "content": "hi"}]
#: a call's opening tag, one token a byte (the byte-level tokenizer)
TAG = grammar.CALL_OPEN


def _whole(client: openai.OpenAI, **kwargs) -> tuple[str | None, list, str | None]:
    choice = client.chat.completions.create(**kwargs).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
    return choice.message.content, calls, choice.finish_reason


@pytest.mark.parametrize("cut", [1, 3, len(TAG) - 1])
def test_a_required_call_cut_inside_its_tag_is_no_content_whole_as_streamed(
        client: openai.OpenAI, cut):
    """``tool_choice: "required"`` and a ``max_tokens`` that cuts the output inside the
    ``<tool_call>`` tag itself: the grammar's markup (``<``, ``<to``, ``<tool_call``) was the
    message's content, whole and streamed, where a cut one token later (in the rest of the
    opening) is content null (stop 58; docs/server.md: "a ``<tool_call>`` opening cut short
    is no content"). A required answer holds calls only: now content null, no call,
    ``finish_reason: length``."""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL], "tool_choice": "required",
              "max_tokens": cut, "temperature": 0}
    assert _whole(client, **kwargs) == (None, [], "length")
    assert streamed_chat(client, **kwargs) == (None, [], "length")


@pytest.mark.parametrize("into", [1, 4, len(TAG) - 1])
def test_a_second_call_cut_inside_its_tag_leaves_the_first_and_no_content(
        client: openai.OpenAI, into):
    """``max_tokens`` cut a required answer ``into`` tokens into the tag of its second call:
    the answer had the first call and the line end plus the cut tag as content
    (``"\\n<to"``): langchain's ``AIMessage`` carried markup as text beside its tool call.
    The grammar lets only calls follow a call, so that text is markup: now the first call,
    content null, whole and streamed alike (docs/server.md: "cut ... in the opening of one
    more call has the calls")."""
    needs.module("llguidance", "server")
    base = {"model": MODEL, "messages": MESSAGES, "tools": [TWICE], "tool_choice": "required",
            "temperature": 0}
    content, calls, _ = _whole(client, **base, max_tokens=200)
    assert content is None and len(calls) >= 2, (content, calls)
    first = len(f'{TAG}\n{{"name":"f","arguments":{calls[0][1]}}}\n{grammar.CALL_CLOSE}\n')
    kwargs = {**base, "max_tokens": first + into}
    assert _whole(client, **kwargs) == (None, [calls[0]], "length")
    assert streamed_chat(client, **kwargs) == (None, [calls[0]], "length")


@pytest.mark.parametrize(("text", "forced", "content"), [
    ("<tool_c", True, None),
    ("<tool_c", False, "<tool_c"),  # "auto": text may hold a "<"; no call was made
    ("so <t", False, "so <t"),
    ('<tool_call>\n{"name":"get","arguments":{"x":1}}\n</tool_call>\n<tool_', False, None),
])
def test_a_cut_tag_is_markup_where_only_calls_can_follow(text, forced, content):
    """The parse of a whole answer and the stream fed one piece: a cut tag is markup under
    ``required`` and after a call, text under ``auto`` before any call."""
    stream = grammar.ToolCallStream(None, forced)
    deltas = stream.feed(text, final=True)
    assert ("".join(d.get("content", "") for d in deltas) or None) == content
    parsed, calls = grammar.parse_tool_calls(text, None, forced)
    assert parsed == content
    assert len(calls) == text.count("</tool_call>")


def _answer(client: openai.OpenAI, messages: list) -> tuple[str | None, int]:
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                            temperature=0)
    assert answer.usage is not None
    return answer.choices[0].message.content, answer.usage.prompt_tokens


@pytest.mark.parametrize(("role", "part"), [
    ("assistant", {"type": "refusal", "refusal": "I can't help with that."}),
    ("user", {"type": "input_text", "text": "I can't help with that."}),
    ("assistant", {"type": "output_text", "text": "I can't help with that.", "annotations": []}),
], ids=["refusal", "input_text", "output_text"])
def test_a_refusal_or_responses_text_part_is_the_messages_text(client: openai.OpenAI, role, part):
    """An assistant message whose content is a list holding a ``refusal`` part (the SDK's
    ``ChatCompletionAssistantMessageParam`` allows ``ChatCompletionContentPartRefusalParam``
    there) and the Responses API's text parts (``input_text``, ``output_text``: a
    conversation carried over from /v1/responses), which vLLM's chat renders as text, were a
    400 ``only text parts are supported``, naming a text part. Each is now the message's
    text: the answer and its prompt are those of the same message with a string content."""
    text = part.get("text", part.get("refusal"))
    def conversation(content):
        return [{"role": "user", "content": "hi"}, {"role": role, "content": content},
                {"role": "user", "content": "and?"}]
    assert _answer(client, conversation([part])) == _answer(client, conversation(text))


def test_a_refusal_part_outside_an_assistant_message_is_still_refused_naming_it(
        client: openai.OpenAI):
    """A ``refusal`` part is the model's: in a user message it is a 400 naming its place and
    the parts a message may hold."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}])
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "messages.0.content.0.type", error
    assert error["message"].startswith('messages[0].content[0].type="refusal": only text parts '
                                       "are supported (text, input_text, output_text; refusal "
                                       "in an assistant message)"), error


def test_a_body_over_max_body_bytes_says_what_to_do(client: openai.OpenAI):
    """A completion whose body is over the server's ``max_body_bytes`` (lm-eval's batches of
    long windows: 4 of 40,000 token ids are about 1.3 MB) was a 413 saying only ``request body
    exceeds max_body_bytes=1048576``: the client could not tell it is the server's setting.
    The message now says to send a smaller body or start the server with a larger
    ``--max-body-bytes`` (docs/server.md's 413 row)."""
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=[[151643] * 40_000] * 4, max_tokens=0)
    assert caught.value.status_code == 413
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["message"] == (
        "request body exceeds max_body_bytes=1048576: send a smaller body (fewer or shorter "
        "prompts), or start the server with a larger --max-body-bytes"), error


#: a function tool as the Responses API writes one (flat)
FLAT = {"type": "function", "name": "get", "parameters": TOOL["function"]["parameters"]}


@pytest.mark.parametrize("body", [
    {"input": "hi"},
    {"input": "hi", "instructions": "Be brief.", "tools": [FLAT]},
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
               {"type": "function_call", "call_id": "c1", "name": "get",
                "arguments": '{"x": 1}'},
               {"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
     "tools": [FLAT], "text": {"format": {"type": "json_object"}}},
], ids=["text", "instructions-and-tools", "tool-round-trip"])
def test_responses_input_tokens_count_is_the_prompt_a_response_is_admitted_with(
        client: openai.OpenAI, body):
    """The SDK's ``responses.input_tokens.count`` (``POST /v1/responses/input_tokens``) was a
    405 ``method not allowed (allowed: DELETE, GET, HEAD)``, as if a ``GET`` of that path
    were something (it is the 404 of a stored response named ``input_tokens``). It now
    answers OpenAI's ``response.input_tokens`` object: the ``usage.input_tokens`` of the
    response to the same body (instructions, tools and tool round trips rendered as the
    Responses route renders them)."""
    needs.module("llguidance", "server")
    counted = client.responses.input_tokens.count(model=MODEL, **body)
    assert counted.object == "response.input_tokens"
    answered = client.responses.create(model=MODEL, max_output_tokens=1, **body)
    assert answered.usage is not None
    assert counted.input_tokens == answered.usage.input_tokens > 0


@pytest.mark.parametrize(("body", "param", "start"), [
    ({"input": "hi", "reasoning": {"effort": "low"}}, "reasoning",
     'reasoning={"effort": "low"}: the served model does not reason'),
    ({"instructions": "x"}, "input", "input: missing, give the input to count"),
    ({"input": "hi", "tools": [{"type": "function", "name": "a b"}]}, "tools.0.name",
     'tools.0.name="a b": must be a string of 1 to 64'),
    ({"input": "hi", "store": True}, "store", "store: unknown parameter"),
])
def test_responses_input_tokens_refuses_what_responses_refuses_naming_it(
        client: openai.OpenAI, body, param, start):
    """A body the count cannot honour is a 400 naming the Responses field, as /v1/responses
    names it (never chat's name of it)."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_tokens.count(model=MODEL, **body) if "store" not in body \
            else client.post("/responses/input_tokens", cast_to=object,
                             body={"model": MODEL, **body})
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == param and error["message"].startswith(start), error


@pytest.mark.parametrize(("call", "route", "why"), [
    (lambda c: c.embeddings.create(model=MODEL, input="hi"), "POST /v1/embeddings",
     "the served model generates text: embeddings, scores and classifications (pooling) are "
     "not served"),
    (lambda c: c.moderations.create(input="hi"), "POST /v1/moderations",
     "moderation is not performed by this server"),
    (lambda c: c.images.generate(prompt="a cat"), "POST /v1/images/generations",
     "the served model reads and writes text only"),
    (lambda c: c.files.list(), "GET /v1/files", "this server stores nothing"),
    (lambda c: c.chat.completions.retrieve("chatcmpl-1"), "GET /v1/chat/completions/chatcmpl-1",
     "this server stores nothing"),
], ids=["embeddings", "moderations", "images", "files", "stored-chat"])
def test_an_openai_endpoint_not_served_says_why(client: openai.OpenAI, call, route, why):
    """The SDK's ``embeddings.create`` (LangChain's ``OpenAIEmbeddings``, llama-index's
    ``OpenAIEmbedding``), ``moderations``, ``images``, ``files`` and the stored completions'
    ``chat.completions.retrieve`` were each a 404 ``no such route (docs/server.md lists
    them)``: the user could not tell a wrong base URL from an endpoint this server does not
    serve. The 404 (``code: not_found``) now says why."""
    with pytest.raises(openai.NotFoundError) as caught:
        call(client)
    error = caught.value.body
    assert isinstance(error, dict) and error["code"] == "not_found", error
    assert error["message"].startswith(f"{route}: no such route: {why}"), error
    assert error["message"].endswith("(docs/server.md lists them)"), error


def test_an_unknown_path_is_still_no_such_route_alone(client: openai.OpenAI):
    # (a path no route is near: since stop 71 ``/v1/completions/``, a slash away from a
    # route, names the route meant, tests/test_server_probe71.py)
    with pytest.raises(openai.NotFoundError) as caught:
        client.post("/frobnicate", cast_to=object, body={"prompt": "hi"})
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["message"] == "POST /v1/frobnicate: no such route (docs/server.md lists them)"


@pytest.mark.parametrize(("stop", "finish", "arguments"), [
    ("499", "stop", '{"a":-'),  # inside the arguments: no whole call
    ("</tool_call>", "tool_calls", '{"a":-499268}'),  # the closing markup: the call is whole
    ("}\n", "tool_calls", '{"a":-499268}'),
])
def test_a_stop_string_in_a_required_call_ends_it_alike_whole_and_streamed(
        client: openai.OpenAI, stop, finish, arguments):
    """A ``stop`` string met inside a ``required`` call's output: the whole answer said
    ``finish_reason: "tool_calls"`` whatever the cut (of arguments ``{"a":-``, no JSON: a
    client executed a call that was never whole), the stream ``"stop"`` whatever the cut
    (of a call whose closing markup alone the stop string took, the arguments whole, where
    vLLM's parser reads the call). Both now say ``"tool_calls"`` when the last call's
    arguments are whole and ``"stop"`` when the stop string cut them; the calls and content
    are the same whole and streamed."""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TWICE], "tool_choice": "required",
              "max_tokens": 120, "temperature": 0, "stop": [stop]}
    whole = _whole(client, **kwargs)
    assert whole == (None, [("f", arguments)], finish)
    assert streamed_chat(client, **kwargs) == whole
