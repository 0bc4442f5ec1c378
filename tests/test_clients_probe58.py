"""Stop 58's probe with real clients (the official ``openai`` SDK) against a loopback server on
the synthetic model: what a client reading vLLM's or OpenAI's answer met, each pinned here
(docs/traceability.md "Found at stop 58 (clients)"). Client timeout 10 s, no retries."""

from __future__ import annotations

import openai
import pytest

import needs
from calexec.drivers.serving import grammar
from test_server_support import MODEL, openai_server

TIMEOUT_S = 10.0

TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "hi"}]
#: the call's opening as the grammar writes it, one token a byte (the byte-level tokenizer)
OPENING = '<tool_call>\n{"name":"get","arguments":'


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (_, sdk, _):
        yield sdk


def _streamed(client: openai.OpenAI, **kwargs) -> tuple[str | None, list, str | None]:
    """``(content, [(name, arguments)], finish_reason)`` of a chat stream's deltas joined."""
    content: str | None = None
    calls: dict[int, list[str]] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for call in choice.delta.tool_calls or ():
                entry = calls.setdefault(call.index, ["", ""])
                entry[0] += (call.function.name or "") if call.function else ""
                entry[1] += (call.function.arguments or "") if call.function else ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[k]) for k in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("cut", [12, 16, len(OPENING) - 1])
def test_a_tool_call_cut_in_its_opening_is_no_content_whole_as_streamed(
        client: openai.OpenAI, tool_choice, cut):
    """``max_tokens`` cut a forced call (``required``, a named tool) inside its opening
    ``<tool_call>\\n{"name":"get","arguments":``, the grammar's markup: the stream sent no
    content and no call (docs/server.md: "a ``<tool_call>`` opening cut short is no content",
    "whole or streamed alike"), while the whole answer gave the markup itself as the
    message's content (``'<tool_call>\\n{"na'``), text no client asked for and that the
    ``required`` tool choice promises is not there. Both now answer content null, no call,
    ``finish_reason: length``."""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL], "tool_choice": tool_choice,
              "max_tokens": cut, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "length"
    assert whole.message.tool_calls is None
    assert whole.message.content is None, whole.message.content
    assert _streamed(client, **kwargs) == (None, [], "length")


@pytest.mark.parametrize(("text", "content"), [
    ('<tool_call>\n{"na', None),
    ('<tool_call>\n{"name":"get",', None),
    ('so <tool_call>\n{"name":"get","argu', "so "),
])
def test_an_auto_answer_cut_in_its_first_call_s_opening_parses_as_it_streams(text, content):
    """The same with ``tool_choice: auto``, where text may come first: the whole answer's
    parse (``grammar.parse_tool_calls``) kept the opening of the first call as content when
    ``max_tokens`` cut it before the call was named, while the stream (``ToolCallStream``)
    dropped it; an opening of a later call was already dropped by both."""
    stream = grammar.ToolCallStream()
    deltas = stream.feed(text, final=True)
    assert "".join(d.get("content", "") for d in deltas) == (content or "")
    assert stream.cut and stream.calls == 0
    assert grammar.parse_tool_calls(text) == (content, [])


@pytest.mark.parametrize("tool_choice", ["required",
                                         {"type": "function", "function": {"name": "get"}}],
                         ids=["required", "named"])
@pytest.mark.parametrize("into", [1, 3, 5])
def test_a_forced_call_cut_in_its_arguments_is_the_call_whole_as_streamed(
        client: openai.OpenAI, tool_choice, into):
    """``max_tokens`` cut a forced call (``required``, a named tool: the grammar writes the
    call, the model only its arguments) ``into`` tokens into its arguments: the stream sent
    the call with its arguments as generated (``{"x``), as OpenAI streams a cut call and as
    vLLM answers a named tool's cut arguments whole or streamed, while the whole answer gave
    no call and the grammar's markup as the message's content
    (``'<tool_call>\\n{"name":"get","arguments":{"x'``): langchain's
    ``with_structured_output(method="function_calling")`` and ``bind_tools`` read a call from
    ``stream`` and none, with markup as text, from ``invoke``. The whole answer now has the
    call as streamed, content null, ``finish_reason: length``."""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL], "tool_choice": tool_choice,
              "max_tokens": len(OPENING) + into, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    streamed = _streamed(client, **kwargs)
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()]
    assert (whole.message.content, calls, whole.finish_reason) == streamed
    assert whole.message.content is None and whole.finish_reason == "length"
    assert len(calls) == 1 and calls[0][0] == "get", calls
    assert calls[0][1].startswith("{") and len(calls[0][1]) == into, calls
