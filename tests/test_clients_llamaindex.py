"""Issue 27, real clients: llama-index's ``OpenAILike`` LLM (``llama-index-llms-openai-like``),
unmodified, against a loopback server on the synthetic model: ``complete``, ``chat`` and
``stream_complete`` / ``stream_chat``, each checked against the numpy oracle's greedy tokens;
and its async API (``acomplete``, ``astream_complete``, ``achat``, ``astream_chat``, as a chat
model and not): one by one, 12 at once (``asyncio.gather``), and a consumer task cancelled in
the middle of a stream or a whole answer, or more of them than the server has sequence ids
(some waiting for one), after which the server holds nothing. And ``OpenAIResponses``
(``llama-index-llms-openai``) on /v1/responses: complete, chat, their streams, a required
tool call, ``structured_predict``.

Installed by ``.ci/clients`` only, without pip's dependency check for one package:
``llama-index-llms-openai`` (which ``OpenAILike`` subclasses) declares ``openai<3``, and the
project pins ``openai==3.51.0`` (constraints.txt), so pip cannot resolve both; ``.ci/clients``
installs the two llama-index LLM packages with ``--no-deps`` on top of ``llama-index-core``,
and this test is what shows that the client works with the SDK the project pins
(docs/server.md "Real clients"). Client timeout 10 s, no retries; no tokenizer is fetched
(``OpenAILike`` uses none unless given one)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pydantic
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from needs import module
from test_server_support import (
    MODEL,
    metric_value,
    openai_server,
    oracle_tokens,
    server_idle,
    wait_for,
)

INSTALL = ("bash .ci/clients installs it (llama-index-core, then llama-index-llms-openai and "
           "llama-index-llms-openai-like with --no-deps: they declare openai<3)")
openai_like = module("llama_index.llms.openai_like", "clients", INSTALL)
llms = module("llama_index.core.llms", "clients", INSTALL)
li_openai = module("llama_index.llms.openai", "clients", INSTALL)
li_tools = module("llama_index.core.tools", "clients", INSTALL)
li_prompts = module("llama_index.core.prompts", "clients", INSTALL)

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                service):
        yield server, service, sdk


def _openai_like(server, is_chat_model: bool = False, max_tokens: int = 4, http=None,
                 **settings):
    """An ``OpenAILike`` for ``server``. Its async client is made once per instance on the
    event loop that first uses it, so each async test makes its own instance and gives it
    ``http`` (an ``openai.DefaultAsyncHttpxClient``) to close on that loop."""
    return openai_like.OpenAILike(model=MODEL, api_base=f"{server.url}/v1", api_key="unused",
                                  temperature=0, max_tokens=max_tokens, timeout=TIMEOUT_S,
                                  max_retries=0, is_chat_model=is_chat_model,
                                  context_window=2048, async_http_client=http, **settings)


@pytest.fixture(scope="module")
def llm(served):
    return _openai_like(served[0])


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


# ---- the async API ---------------------------------------------------------------------------
# As a chat model, ``acomplete`` sends the prompt as one user message to /v1/chat/completions
# (the server's template renders it); not as one, ``achat`` renders the messages with
# llama-index's ``messages_to_prompt`` (each "role: content", then "assistant: ", a trailing
# space) and sends a completion.
def _sent(text: str, is_chat_model: bool, chat: bool) -> str:
    """The prompt the server generates from for ``text`` (a user message when ``chat``)."""
    if is_chat_model:
        return f"user: {text}\nassistant:"
    return f"user: {text}\nassistant: " if chat else text


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S * 2))


async def _ask(llm, how: str, text: str) -> str:
    """One request through ``llm``'s async API (``how`` is the method); the answer's text."""
    if how == "acomplete":
        return (await llm.acomplete(text)).text
    if how == "achat":
        reply = await llm.achat([llms.ChatMessage(role="user", content=text)])
        assert reply.message.role == "assistant"
        return reply.message.content or ""
    if how == "astream_complete":
        pieces = [r.delta or "" async for r in await llm.astream_complete(text)]
    else:
        pieces = [r.delta or "" async for r in await llm.astream_chat(
            [llms.ChatMessage(role="user", content=text)])]
    assert len([p for p in pieces if p]) == 4, pieces  # one delta per token
    return "".join(pieces)


def _ran_to_length(server) -> float:
    """Requests that succeeded generating all the tokens they asked for, from /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT_S).text
    return metric_value(text, "calexec_request_success_total",
                        {"finished_reason": "length"}) or 0.0


ASYNC_METHODS = ["acomplete", "astream_complete", "achat", "astream_chat"]


@pytest.mark.parametrize("is_chat_model", [False, True], ids=["prompt", "chat-model"])
@pytest.mark.parametrize("how", ASYNC_METHODS)
def test_each_async_method_answers_the_oracle(served, how, is_chat_model):
    """``acomplete``, ``astream_complete``, ``achat``, ``astream_chat``, as a chat model
    (/v1/chat/completions) and not (/v1/completions): the text is the oracle's greedy
    continuation of what was sent, and the server is idle after."""
    server, service, _ = served
    text = f"async {how}"

    async def go() -> str:
        async with openai.DefaultAsyncHttpxClient() as http:
            return await _ask(_openai_like(server, is_chat_model, http=http), how, text)

    got = _run(go())
    assert got == _greedy(_sent(text, is_chat_model, "chat" in how))
    wait_for(lambda: server_idle(service), what=f"{how} released")


def test_an_async_chat_with_a_system_message_answers_the_oracle(served):
    """``achat`` and ``astream_chat`` of a system and a user message, as the sync
    ``test_chat`` sends them: the server's template renders both."""
    server, _, _ = served
    rendered = _greedy("system: You are terse.\nuser: Hi!\nassistant:")

    async def go() -> tuple[str, str]:
        async with openai.DefaultAsyncHttpxClient() as http:
            llm = _openai_like(server, is_chat_model=True, http=http)
            whole = await llm.achat(_chat_messages("Hi!"))
            streamed = "".join([r.delta or "" async for r in await llm.astream_chat(
                _chat_messages("Hi!"))])
        return whole.message.content or "", streamed

    assert _run(go()) == (rendered, rendered)


def test_twelve_concurrent_async_requests_each_answer_the_oracle(served):
    """12 requests at once (``asyncio.gather``) through two ``OpenAILike`` (a chat model and
    not), every async method, one prompt each: every answer is its own prompt's greedy
    continuation (no answer crosses to another request), and the server is idle after."""
    server, service, _ = served

    async def all_of_them() -> list[tuple[str, str]]:
        asked = [(ASYNC_METHODS[i % 4], bool(i // 4 % 2), f"concurrent {i}") for i in range(12)]
        async with openai.DefaultAsyncHttpxClient() as http:
            by_kind = {chat_model: _openai_like(server, chat_model, http=http)
                       for chat_model in (False, True)}
            answers = await asyncio.gather(*(_ask(by_kind[chat_model], how, text)
                                             for how, chat_model, text in asked))
        return [(got, _greedy(_sent(text, chat_model, "chat" in how)))
                for got, (how, chat_model, text) in zip(answers, asked)]

    results = _run(all_of_them())
    assert len(results) == 12
    for got, expected in results:
        assert got == expected
    wait_for(lambda: server_idle(service), what="every concurrent request released")


@pytest.mark.parametrize("how,is_chat_model", [("astream_chat", True), ("astream_chat", False),
                                               ("astream_complete", False),
                                               ("astream_complete", True), ("achat", True),
                                               ("acomplete", False)])
def test_a_cancelled_async_consumer_frees_everything(served, how, is_chat_model):
    """A consumer task cancelled in the middle of an ``astream_chat`` / ``astream_complete``
    (after its first delta) or of a whole ``achat`` / ``acomplete`` (while it generates): the
    server stops the generation (it never succeeds with its 30000 tokens, as /metrics counts
    requests that ran to their length) and gives back every sequence id (the wait is
    bounded), and the next answer is still the oracle's."""
    server, service, _ = served
    length_before = _ran_to_length(server)

    async def give_up(http) -> None:
        llm = _openai_like(server, is_chat_model, max_tokens=30000, http=http)
        message = [llms.ChatMessage(role="user", content="long")]
        if how.startswith("astream"):
            started = asyncio.Event()

            async def read() -> None:
                stream = await (llm.astream_chat(message) if how == "astream_chat"
                                else llm.astream_complete("long"))
                async for response in stream:
                    if response.delta:
                        started.set()
            task = asyncio.create_task(read())
            await asyncio.wait_for(started.wait(), TIMEOUT_S)
        else:
            task = asyncio.create_task(llm.achat(message) if how == "achat"
                                       else llm.acomplete("long"))
            for _ in range(int(TIMEOUT_S / 0.01)):  # bounded: until it generates
                if service.active == 1:
                    break
                await asyncio.sleep(0.01)
        assert service.active == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # watched while the client is still open: the cancel itself must end the request
        await asyncio.to_thread(wait_for, lambda: server_idle(service), 15.0,
                                f"the server idle after {how}")

    async def cancelled() -> None:
        async with openai.DefaultAsyncHttpxClient() as http:
            await give_up(http)

    _run(cancelled())
    counts = service.sequences.counts()
    assert counts["free"] == counts["capacity"], counts
    assert _ran_to_length(server) == length_before  # it did not run to its end
    assert _openai_like(server).complete("after").text == _greedy("after")


@pytest.mark.parametrize("is_chat_model", [False, True], ids=["prompt", "chat-model"])
def test_async_logprobs_are_the_server_s(served, is_chat_model):
    """``logprobs=True, top_logprobs=2``: llama-index sends ``logprobs: 2`` to
    /v1/completions (an int there) and ``logprobs: true, top_logprobs: 2`` to chat. The
    logprobs of ``acomplete`` (not a chat model) and ``achat`` (a chat model) hold, for each
    generated token, its two most likely tokens, the greedy one first, with the values the
    SDK reads from the same request."""
    server, _, sdk = served
    text = "logprobs"
    greedy = [tokenizer.decode([t]) for t in oracle_tokens(
        tokenizer.encode(_sent(text, is_chat_model, is_chat_model)), 4)]

    async def go() -> list:
        async with openai.DefaultAsyncHttpxClient() as http:
            llm = _openai_like(server, is_chat_model, http=http, logprobs=True, top_logprobs=2)
            if is_chat_model:
                return (await llm.achat([llms.ChatMessage(role="user", content=text)])).logprobs
            return (await llm.acomplete(text)).logprobs

    got = [[(lp.token, lp.logprob) for lp in position] for position in _run(go()) or []]
    if is_chat_model:
        content = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4,
            temperature=0, logprobs=True, top_logprobs=2).choices[0].logprobs.content
        expected = [[(top.token, top.logprob) for top in entry.top_logprobs]
                    for entry in content]
    else:
        tops = sdk.completions.create(model=MODEL, prompt=text, max_tokens=4, temperature=0,
                                      logprobs=2).choices[0].logprobs.top_logprobs
        expected = [list(top.items()) for top in tops]
    assert [position[0][0] for position in got] == greedy
    assert all(len(position) == 2 for position in got), got
    assert got == expected


def test_cancelling_consumers_some_of_which_wait_for_a_sequence_id_frees_everything(served):
    """More ``astream_chat`` / ``astream_complete`` consumers than the server has sequence
    ids (4 more), all cancelled once every sequence id is leased and 4 requests wait for
    one: the waiting requests leave the queue, the generating ones stop (none ran to its
    length), every sequence id is free, and the next answer is still the oracle's."""
    server, service, _ = served
    capacity = service.sequences.counts()["capacity"]
    n = capacity + 4
    length_before = _ran_to_length(server)

    async def read(llm, i: int) -> None:
        stream = await (llm.astream_chat([llms.ChatMessage(role="user", content=f"q{i}")])
                        if i % 2 else llm.astream_complete(f"q{i}"))
        async for _ in stream:
            pass

    async def give_up() -> tuple[int, int]:
        async with openai.DefaultAsyncHttpxClient() as http:
            by_kind = {chat_model: _openai_like(server, chat_model, max_tokens=30000, http=http)
                       for chat_model in (False, True)}
            tasks = [asyncio.create_task(read(by_kind[bool(i % 2)], i)) for i in range(n)]
            for _ in range(int(TIMEOUT_S / 0.01)):  # bounded: until all of them arrived
                if service.active == n and service.sequences.in_use == capacity:
                    break
                await asyncio.sleep(0.01)
            seen = service.active, service.sequences.in_use
            for task in tasks:
                task.cancel()
            outcomes = await asyncio.gather(*tasks, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes), outcomes
            await asyncio.to_thread(wait_for, lambda: server_idle(service), 15.0,
                                    "the server idle after the cancels")
        return seen

    assert _run(give_up()) == (n, capacity)
    counts = service.sequences.counts()
    assert counts["free"] == counts["capacity"], counts
    assert _ran_to_length(server) == length_before
    assert _openai_like(server).complete("after").text == _greedy("after")


# ---- OpenAIResponses: the same client on /v1/responses (stop 63, clients third) -----------------
def _responses_llm(server, max_output_tokens: int = 4):
    return li_openai.OpenAIResponses(model=MODEL, api_base=f"{server.url}/v1", api_key="unused",
                                     temperature=0, max_output_tokens=max_output_tokens,
                                     timeout=TIMEOUT_S, max_retries=0, context_window=2048)


def test_openai_responses_complete_chat_and_stream_answer_the_oracle(served):
    """llama-index's ``OpenAIResponses`` (llama-index-llms-openai) against /v1/responses:
    ``complete``, ``chat``, ``stream_complete``, ``stream_chat`` are the oracle's greedy
    continuation of the conversation the server's template renders (a prompt is one user
    message)."""
    llm = _responses_llm(served[0])
    expected = _greedy("user: Once upon\nassistant:")
    assert llm.complete("Once upon").text == expected
    assert "".join(r.delta or "" for r in llm.stream_complete("Once upon")) == expected
    # llama-index sends a system message as a "developer" one on the Responses API (the plain
    # template renders the role as given)
    rendered = _greedy("developer: You are terse.\nuser: Hi!\nassistant:")
    reply = llm.chat(_chat_messages("Hi!"))
    assert reply.message.role == "assistant" and reply.message.content == rendered
    assert "".join(r.delta or "" for r in llm.stream_chat(_chat_messages("Hi!"))) == rendered


class _City(pydantic.BaseModel):
    # bounded: the synthetic model's random weights never close an unbounded string
    city: str = pydantic.Field(max_length=8)


class _Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)


def test_openai_responses_calls_a_tool_and_predicts_a_structure(served):
    """A required tool call (``chat_with_tools``, ``predict_and_call``: the function runs on
    the arguments the grammar held to its schema) and ``structured_predict`` of a pydantic
    model (its JSON schema as ``text.format``)."""
    called: list[str] = []

    def get_weather(city: str) -> str:
        called.append(city)
        return f"sunny in {city}"

    tool = li_tools.FunctionTool.from_defaults(get_weather, name="get_weather",
                                               description="The weather in a city.",
                                               fn_schema=_City)
    llm = _responses_llm(served[0], max_output_tokens=120)
    reply = llm.chat_with_tools([tool], user_msg="weather?", tool_required=True)
    [selection] = llm.get_tool_calls_from_response(reply)
    assert selection.tool_name == "get_weather"
    assert _City.model_validate(selection.tool_kwargs)
    answer = llm.predict_and_call([tool], user_msg="weather?", tool_required=True)
    assert len(called) == 1 and answer.response == f"sunny in {called[0]}"
    person = llm.structured_predict(_Person, li_prompts.PromptTemplate("a person: {x}"),
                                    x="y")
    assert isinstance(person, _Person) and 0 <= person.age <= 150
