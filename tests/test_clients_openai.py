"""Issue 27, real clients: the official ``openai`` SDK (the [test] extra's, pinned in
constraints.txt), unmodified, in the loops application code writes, against a loopback server on
the synthetic model: the multi-turn chat loop that appends ``resp.choices[0].message
.model_dump()`` (the assistant message with ``refusal``, ``tool_calls``, ``function_call``,
``audio`` null), the same loop streamed (the deltas joined into the next turn's assistant
message, ``include_usage`` on), and a completion prompt list. Every reply is checked against the
numpy oracle's greedy tokens. Client timeout: 10 s, no retries."""

from __future__ import annotations

import openai
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from test_server_support import MODEL, openai_server, oracle_tokens

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (_, sdk, _):
        yield sdk


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
