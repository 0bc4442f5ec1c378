"""Stop 57's probe with real clients (the official ``openai`` SDK, sync and streamed) against a
loopback server on the synthetic model: what a client reading vLLM's documented answer met,
each pinned here (docs/traceability.md "Found at stop 57 (clients)"). Client timeout 10 s, no
retries."""

from __future__ import annotations

import openai
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from test_server_support import (
    MODEL,
    oracle_tokens,
    sdk_client_fixture,  # noqa: F401 - the fixture ``client``
)

PROMPT = "hello"
MESSAGES = [{"role": "user", "content": PROMPT}]


def _greedy(n: int, chat: bool) -> list[int]:
    text = f"user: {PROMPT}\nassistant:" if chat else PROMPT
    return oracle_tokens(tokenizer.encode(text), n)


def _ends(client: openai.OpenAI, chat: bool, **kwargs) -> list[tuple[str | None, object]]:
    """``(finish_reason, stop_reason)`` of the whole answer and of the stream's finishing
    chunk (``stop_reason`` read as the SDK gives a field it has no attribute for)."""
    create = client.chat.completions.create if chat else client.completions.create
    body = {"messages": MESSAGES} if chat else {"prompt": PROMPT}
    whole = create(model=MODEL, temperature=0, **body, **kwargs).choices[0]
    ends = [(whole.finish_reason, (whole.model_extra or {}).get("stop_reason", "absent"))]
    for chunk in create(model=MODEL, temperature=0, stream=True, **body, **kwargs):
        for choice in chunk.choices:
            if choice.finish_reason is not None:
                ends.append((choice.finish_reason,
                             (choice.model_extra or {}).get("stop_reason", "absent")))
    return ends


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_stop_reason_names_the_stop_string_or_token_id_that_ended_the_answer(
        client: openai.OpenAI, chat):
    """vLLM answers every choice with ``stop_reason``: the ``stop`` string that ended it,
    or the ``stop_token_ids`` id, null when it ended another way (``max_tokens``, the end
    token); a client telling which of its stops fired (an eval harness with several stop
    sequences, a tool loop stopping on an id) read it, and the server sent no such field
    (the SDK's ``model_extra`` had none), streamed or not."""
    tokens = _greedy(6, chat)
    # a stop string: the text of the third token (a byte of the byte-level tokenizer)
    stop = tokenizer.decode(tokens[2:3])
    assert stop and stop not in tokenizer.decode(tokens[:2]), (tokens, stop)
    assert _ends(client, chat, max_tokens=6, stop=["\x00never", stop]) == [("stop", stop)] * 2
    # a stop token id: the id itself, an int
    assert _ends(client, chat, max_tokens=6, extra_body={"stop_token_ids": [tokens[3]]}) \
        == [("stop", tokens[3])] * 2
    # the length: null
    assert _ends(client, chat, max_tokens=2) == [("length", None)] * 2
