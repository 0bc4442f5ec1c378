"""Stop 61's probe with real clients (the official ``openai`` SDK) against a loopback server on
the synthetic model: what a client reading vLLM's answer met, each pinned here
(docs/traceability.md "Found at stop 61 (clients)"). Client timeout 10 s, no retries."""

from __future__ import annotations

import math

import openai
import pytest

import needs
from test_server_support import (
    MODEL,
    sdk_client_fixture,  # noqa: F401 - the fixture ``client``
)

MESSAGES = [{"role": "user", "content": "Is it raining?"}]
#: a classification as a structured output: which of two answers, and how sure
SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no"]},
    "score": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "score"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema",
                   "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
TOOL = {"type": "function", "function": {"name": "verdict", "parameters": SCHEMA,
                                         "strict": True}}
NAMED = {"type": "function", "function": {"name": "verdict"}}


def _whole(client: openai.OpenAI, **kwargs) -> list:
    answer = client.chat.completions.create(model=MODEL, messages=MESSAGES, **kwargs)
    return list(answer.choices[0].logprobs.content)


def _streamed(client: openai.OpenAI, **kwargs) -> list:
    content: list = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                **kwargs):
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                content.extend(choice.logprobs.content)
    return content


@pytest.mark.parametrize("fields", [
    pytest.param({"response_format": RESPONSE_FORMAT}, id="response_format"),
    pytest.param({"tools": [TOOL], "tool_choice": NAMED}, id="named_tool"),
])
@pytest.mark.parametrize("read", [_whole, _streamed], ids=["whole", "streamed"])
def test_a_structured_outputs_logprobs_are_over_the_tokens_its_grammar_allows(
        client: openai.OpenAI, fields, read):
    """vLLM applies a structured output's grammar bitmask to the logits before its sampler
    computes ``raw_logprobs``: a client reading ``logprobs`` of a ``response_format`` (or a
    forced tool call) answer, the usual way to ask how sure a classification is, gets the
    probabilities of the answers the schema allows. This server gave the unmasked row's:
    the ``{`` the grammar forces had logprob -17.6 (probability 2e-8), and every
    ``top_logprobs`` entry was a token the answer could never hold (``<102131>`` at -5.8),
    so ``yes`` vs ``no`` summed to almost nothing. Now: a forced token 0.0, the top tokens of
    each position are the allowed ones and their probabilities sum to 1 (at most 11 tokens
    are allowed anywhere in this schema, fewer than the 20 asked for)."""
    needs.module("llguidance", "server")
    content = read(client, max_tokens=40, logprobs=True, top_logprobs=20, **fields)
    text = "".join(item.token for item in content)
    assert content[0].logprob == 0.0, content[0]  # the grammar forces the opening "{"
    assert [top.token for top in content[0].top_logprobs] == ["{"]
    for item in content:
        tops = {top.token: top.logprob for top in item.top_logprobs}
        assert tops[item.token] == item.logprob, item
        assert math.fsum(math.exp(lp) for lp in tops.values()) == pytest.approx(1.0), item
    # the classification's own position: "y" or "n", and nothing else, with all the mass
    at = len('{"answer":"')
    assert text[:at] == '{"answer":"', text
    assert set(top.token for top in content[at].top_logprobs) == {"y", "n"}, content[at]
