"""Issue 27, real clients: the official ``openai`` SDK (the [test] extra's, pinned in
constraints.txt), unmodified, in the loops application code writes, against a loopback server on
the synthetic model: the multi-turn chat loop that appends ``resp.choices[0].message
.model_dump()`` (the assistant message with ``refusal``, ``tool_calls``, ``function_call``,
``audio`` null), the same loop streamed (the deltas joined into the next turn's assistant
message, ``include_usage`` on), and a completion prompt list. Every reply is checked against the
numpy oracle's greedy tokens. Client timeout: 10 s, no retries."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

import needs
from calexec.drivers.serving import byte_tokenizer as tokenizer
from test_server_support import (
    MODEL,
    oracle_tokens,
    sdk_client_fixture,  # noqa: F401 - the fixture ``client``
)


def _plain_prompt(messages: list[dict]) -> list[int]:
    """The prompt the server's plain template renders (no tokenizer.json: byte-level ids)."""
    text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
    return tokenizer.encode(text)


def test_multi_turn_loop_appending_model_dump(client: openai.OpenAI):
    messages: list[dict] = [{"role": "system", "content": "You are terse."}]
    for turn in ("Hello!", "Tell me more.", "Thanks, bye."):
        messages.append({"role": "user", "content": turn})
        prompt = _plain_prompt(messages)
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                              temperature=0)
        message = resp.choices[0].message
        assert message.content == tokenizer.decode(oracle_tokens(prompt, 4))
        assert resp.usage is not None and resp.usage.prompt_tokens == len(prompt)
        dumped = message.model_dump()
        # what makes the second turn a 400 on a server that knows only role and content
        assert {"refusal", "tool_calls", "function_call", "audio"} <= set(dumped)
        messages.append(dumped)
    assert len(messages) == 7


def test_multi_turn_loop_streamed(client: openai.OpenAI):
    messages: list[dict] = [{"role": "user", "content": "Count with me."}]
    for turn in ("One.", "Two."):
        prompt = _plain_prompt(messages)
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True})
        text, role, usage, finish = "", None, None, None
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                role = choice.delta.role or role
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        assert (role, finish) == ("assistant", "length")
        assert text == tokenizer.decode(oracle_tokens(prompt, 5))
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == \
            (len(prompt), 5)
        messages += [{"role": role, "content": text}, {"role": "user", "content": turn}]


def test_a_completion_prompt_list_answers_each_prompt(client: openai.OpenAI):
    prompts = ["abc", "de"]
    done = client.completions.create(model=MODEL, prompt=prompts, max_tokens=3, temperature=0)
    assert [c.index for c in done.choices] == [0, 1]
    for choice, prompt in zip(done.choices, prompts):
        assert choice.text == tokenizer.decode(oracle_tokens(tokenizer.encode(prompt), 3))


class Person(pydantic.BaseModel):
    # bounded: the synthetic model's random weights never close an unbounded string
    # (test_clients_langchain.py); extra="forbid" makes the schema strict-compatible
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.mark.filterwarnings("ignore:Pydantic serializer warnings")  # the SDK's model_dump
def test_the_parse_helpers_messages_go_back_into_the_next_turn(client: openai.OpenAI):
    """The SDK's structured-output helpers (``chat.completions.parse``, ``.stream``) answer a
    ``ParsedChatCompletionMessage``: the message plus ``parsed`` (the client's own parse of the
    content; ``tool_calls[i].function.parsed_arguments``, a streamed call's ``index``).
    Application code appends it to ``messages`` as it is (OpenAI's function-calling guide
    does), so the next turn sends ``parsed`` back: it must be accepted (it was a 400
    ``messages.1.parsed``, unknown parameter)."""
    needs.module("llguidance", "server")
    tool = openai.pydantic_function_tool(Person)
    question = {"role": "user", "content": "Invent a person."}
    answer = client.chat.completions.parse(model=MODEL, messages=[question], max_tokens=100,
                                           temperature=0, response_format=Person)
    assert isinstance(answer.choices[0].message.parsed, Person)
    called = client.chat.completions.parse(model=MODEL, messages=[question], max_tokens=100,
                                           temperature=0, tools=[tool], tool_choice="required",
                                           parallel_tool_calls=False)
    with client.chat.completions.stream(model=MODEL, messages=[question], max_tokens=100,
                                        temperature=0, tools=[tool], tool_choice="required",
                                        parallel_tool_calls=False) as stream:
        streamed = stream.get_final_completion()
    for reply in (answer, called, streamed):
        message = reply.choices[0].message
        history: list = [question, message]  # the object itself, as the guide appends it
        for call in message.tool_calls or []:
            assert isinstance(call.function.parsed_arguments, Person)
            history.append({"role": "tool", "tool_call_id": call.id, "content": "noted"})
        if not message.tool_calls:
            history.append({"role": "user", "content": "Another."})
        for turn in (history, [question, message.model_dump()] + history[2:]):
            more = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=2,
                                                  temperature=0)
            assert more.choices[0].finish_reason == "length"


def test_logprobs_bytes_rebuild_the_text_of_a_character_split_over_tokens(client: openai.OpenAI):
    """OpenAI's ``logprobs.content[i].bytes`` are the token's own UTF-8 bytes, documented for
    exactly this case: a character written by several tokens, whose bytes the client joins to
    rebuild the text. The byte-level tokenizer writes "é" as two tokens (0xC3, 0xA9): each
    entry's ``bytes`` must be its one byte (they were U+FFFD's three, [239, 191, 189], the
    bytes of the token's text on its own), and the bytes of all entries decode to the
    content, whole and streamed. ``allowed_token_ids`` (vLLM's, ``extra_body``) keeps the
    choice among those two byte tokens."""
    split = tokenizer.encode("é")
    assert len(split) == 2
    body = dict(model=MODEL, messages=[{"role": "user", "content": "Say é."}], max_tokens=6,
                temperature=0, logprobs=True, top_logprobs=2,
                extra_body={"allowed_token_ids": split})
    whole = client.chat.completions.create(**body)
    entries = whole.choices[0].logprobs.content
    assert len(entries) == 6
    one_byte = [[t - tokenizer.BYTE_OFFSET] for t in split]  # [[0xC3], [0xA9]]
    for entry in entries:
        assert entry.bytes in one_byte, entry
        for top in entry.top_logprobs:  # the raw row's most likely: byte tokens or <id>s
            assert top.bytes in one_byte or top.bytes == list(top.token.encode()), top
    joined = bytes(b for entry in entries for b in entry.bytes)
    assert joined.decode("utf-8", errors="replace") == whole.choices[0].message.content
    text, streamed = "", []
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            streamed += choice.logprobs.content if choice.logprobs else []
    assert [e.bytes for e in streamed] == [e.bytes for e in entries]
    assert bytes(b for e in streamed for b in e.bytes).decode("utf-8", errors="replace") == text


@pytest.mark.parametrize("parameters", [None, {}, {"properties": {"n": {"type": "integer"}}}],
                         ids=["omitted", "empty", "no-type"])
def test_a_tool_calls_arguments_are_a_json_object(client: openai.OpenAI, parameters):
    """A function tool's ``arguments`` are a JSON object, whatever its ``parameters`` leave
    open: OpenAI's "omitting parameters defines a function with an empty parameter list" (a
    tool like ``get_time``: the call's arguments are ``{}``), and a schema without ``"type"``
    (``{}``, or ``properties`` alone) still describes the arguments object. Clients rely on it
    (LangChain's tool-call parser, the SDK's ``parsed_arguments``). Before: the omitted
    schema allowed any object (the synthetic model wandered into keys until max_tokens, no
    call) and the untyped ones any JSON value (``"arguments": 6E+9``)."""
    needs.module("llguidance", "server")
    function = {"name": "get_time", "description": "The time now."}
    if parameters is not None:
        function["parameters"] = parameters
    # greedy, then sampled: the first token of the arguments varies with the seed
    for sampling in [{"temperature": 0}] + [{"temperature": 1, "seed": s} for s in range(3)]:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "now"}],
            max_tokens=60, tools=[{"type": "function", "function": function}],
            tool_choice="required", parallel_tool_calls=False, **sampling)
        choice = reply.choices[0]
        if parameters is None:  # nothing to write but {}: the call completes
            assert choice.finish_reason == "tool_calls", choice
            assert [c.function.arguments for c in choice.message.tool_calls] == ["{}"]
        elif choice.finish_reason != "length":
            assert isinstance(json.loads(choice.message.tool_calls[0].function.arguments), dict)
        else:  # cut by max_tokens inside the call: the call, its arguments as generated
            # (a forced call, docs/server.md: it was the markup as content)
            assert choice.message.content is None, choice.message.content
            assert choice.message.tool_calls[0].function.arguments.startswith("{"), choice



class Address(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    city: str = pydantic.Field(max_length=8)


class Resident(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=8)
    home: Address


def test_a_tool_of_nested_pydantic_models_is_called(client: openai.OpenAI):
    """``openai.pydantic_function_tool`` of a model holding another writes the inner one
    under ``$defs`` and points at it with ``{"$ref": "#/$defs/Address"}``, a reference from
    the root of the parameters schema. The grammar embeds that schema in the call object
    (``arguments``), where ``#`` is the call's root: the request was a 400 (``tools``:
    "Pointer '/$defs/Address' does not exist"); the definitions now go with the reference.
    The parse helper's ``parsed_arguments`` are the nested models."""
    needs.module("llguidance", "server")
    tool = openai.pydantic_function_tool(Resident)
    assert "$defs" in tool["function"]["parameters"]
    reply = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Who lives where?"}],
        max_tokens=120, temperature=0, tools=[tool], tool_choice="required",
        parallel_tool_calls=False)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    resident = choice.message.tool_calls[0].function.parsed_arguments
    assert isinstance(resident, Resident) and isinstance(resident.home, Address)
