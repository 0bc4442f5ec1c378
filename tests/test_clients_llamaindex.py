"""Issue 27, real clients: llama-index's ``OpenAILike`` LLM (``llama-index-llms-openai-like``),
unmodified, against a loopback server on the synthetic model: ``complete``, ``chat`` and
``stream_complete`` / ``stream_chat``, each checked against the numpy oracle's greedy tokens.

Installed by ``.ci/clients`` only, without pip's dependency check for one package:
``llama-index-llms-openai`` (which ``OpenAILike`` subclasses) declares ``openai<3``, and the
project pins ``openai==3.51.0`` (constraints.txt), so pip cannot resolve both; ``.ci/clients``
installs the two llama-index LLM packages with ``--no-deps`` on top of ``llama-index-core``,
and this test is what shows that the client works with the SDK the project pins
(docs/server.md "Real clients"). Client timeout 10 s, no retries; no tokenizer is fetched
(``OpenAILike`` uses none unless given one)."""

from __future__ import annotations

import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from needs import module
from test_server_support import MODEL, openai_server, oracle_tokens

INSTALL = ("bash .ci/clients installs it (llama-index-core, then llama-index-llms-openai and "
           "llama-index-llms-openai-like with --no-deps: they declare openai<3)")
openai_like = module("llama_index.llms.openai_like", "clients", INSTALL)
llms = module("llama_index.core.llms", "clients", INSTALL)

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, _, _):
        yield openai_like.OpenAILike(model=MODEL, api_base=f"{server.url}/v1", api_key="unused",
                                     temperature=0, max_tokens=4, timeout=TIMEOUT_S,
                                     max_retries=0, is_chat_model=False, context_window=2048)


def _greedy(text: str, n: int = 4) -> str:
    return tokenizer.decode(oracle_tokens(tokenizer.encode(text), n))


def _chat_messages(text: str) -> list:
    return [llms.ChatMessage(role="system", content="You are terse."),
            llms.ChatMessage(role="user", content=text)]


def test_complete(llm):
    assert llm.complete("Once upon a time").text == _greedy("Once upon a time")


def test_stream_complete(llm):
    pieces = [r.delta for r in llm.stream_complete("Stream this")]
    assert len(pieces) >= 4
    assert "".join(p or "" for p in pieces) == _greedy("Stream this")


def test_chat(llm):
    # is_chat_model=False: llama-index renders the messages itself and sends a completion;
    # a chat model (below) sends them to /v1/chat/completions
    chat_llm = openai_like.OpenAILike(model=MODEL, api_base=llm.api_base, api_key="unused",
                                      temperature=0, max_tokens=4, timeout=TIMEOUT_S,
                                      max_retries=0, is_chat_model=True, context_window=2048)
    reply = chat_llm.chat(_chat_messages("Hi!"))
    rendered = "system: You are terse.\nuser: Hi!\nassistant:"
    assert reply.message.role == "assistant"
    assert reply.message.content == _greedy(rendered)
    streamed = "".join(r.delta or "" for r in chat_llm.stream_chat(_chat_messages("Hi!")))
    assert streamed == _greedy(rendered)
