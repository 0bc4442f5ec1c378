"""Stop 53's probe with real clients (the official ``openai`` SDK) against a loopback server on
the synthetic model: what a user of these clients hit, each pinned here. Client timeout 10 s,
no retries."""

from __future__ import annotations

import openai
import pytest

import needs
from test_server_support import (
    MODEL,
    sdk_client_fixture,  # noqa: F401 - the fixture ``client``
)

#: a tool whose arguments the synthetic model's random weights close (one bounded integer)
TOOL = {"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["x"], "additionalProperties": False}}}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("tool_choice", ["auto", "required",
                                         {"type": "function", "function": {"name": "get"}}])
def test_a_streamed_tool_using_chat_joins_into_the_whole_answer(client: openai.OpenAI,
                                                                 tool_choice):
    """A chat with tools streams an opening ``content: null`` (OpenAI's first chunk of a tool
    call: a call's whole message has content null), so the SDK's ``chat.completions.stream``
    helper ends with the whole answer's message: a call with content null and no
    ``content.delta`` event (an opening ``""`` gave content ``""`` after an empty
    ``content.delta``), text (here ``auto``: the synthetic model writes text) as the text."""
    needs.module("llguidance", "server")
    kwargs = {"model": MODEL, "messages": MESSAGES, "tools": [TOOL],
              "tool_choice": tool_choice, "max_tokens": 120, "temperature": 0}
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls = whole.message.tool_calls
    if tool_choice != "auto":  # (OpenAI's: a named function's calls end "stop")
        assert whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")
        assert whole.message.content is None
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    first = chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content is None
    assert "content" in first.model_fields_set  # sent, as null
    with client.chat.completions.stream(**kwargs) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion().choices[0]
    assert ("content.delta" in events) == (whole.message.content is not None)
    assert final.finish_reason == whole.finish_reason
    assert final.message.content == whole.message.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls or ()] \
        == [(c.function.name, c.function.arguments) for c in calls or ()]


def test_a_chat_without_tools_still_opens_with_empty_content(client: openai.OpenAI):
    """Text only (no tools, or ``tool_choice: "none"``): the opening keeps OpenAI's and vLLM's
    ``content: ""``."""
    for extra in ({}, {"tools": [TOOL], "tool_choice": "none"}):
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, temperature=0, stream=True, **extra))
        assert chunks[0].choices[0].delta.content == ""


def test_a_bad_token_in_a_late_prompt_list_element_is_named_with_its_position(
        client: openai.OpenAI):
    """A prompt list of token-id lists with one bad id far in (lm-eval's ``None`` prefix token
    in a batch, docs/server.md), or one list of ids with a null at its end: the 400 names
    ``prompt`` and the item, ``prompt[3][0]=null``; the message used to show the value cut to
    80 characters, the first ids only."""
    prompts = [[300 + i] * 30 for i in range(3)] + [[None, 301, 302]]
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=prompts, max_tokens=1)  # type: ignore[arg-type]
    assert refused.value.param == "prompt"
    message = refused.value.message
    assert "prompt[3][0]=null" in message and "list[list[int]]" in message, message
    # one list of ids with a null far in: named as well (the list[int] form is the closest)
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=[300] * 40 + [None],  # type: ignore[list-item]
                                  max_tokens=1)
    assert "prompt[40]=null" in refused.value.message and "as list[int]" in refused.value.message
    # a value of no form at all still names the forms
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt=5, max_tokens=1)  # type: ignore[arg-type]
    assert "prompt=5: must be one of str, list[int], list[str], list[list[int]]" in \
        refused.value.message
