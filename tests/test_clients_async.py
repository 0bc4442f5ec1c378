"""Real clients in their async, streaming and cancelling modes (branch asyncsweep): the
official ``openai`` SDK's ``AsyncOpenAI`` (the [test] extra's, pinned in constraints.txt),
unmodified, against a loopback server on the synthetic model. Requests run concurrently
(``asyncio.gather``), tasks are cancelled in the middle of a stream, streams are broken out
of; after each, the server holds nothing (no request active, every sequence id free, no
release pending) and later answers still equal the numpy oracle's greedy tokens. Also the
context's edge as clients meet it: a chat request that sends no ``max_tokens`` (LangChain's
``ChatOpenAI`` and the SDK send none by default) with a long conversation, the field a
context refusal names (``messages``, ``max_completion_tokens``); a timeout of several choices
as the async SDK reads it; ``stream_options`` whose values are null.

Client timeout: 30 s, no retries; every wait is bounded."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from test_server_support import MODEL, openai_server, oracle_tokens, server_idle, wait_for

TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, sdk,
                                                                                service):
        yield server, sdk, service


def _async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                              timeout=TIMEOUT_S)


def _chat_prompt(content: str) -> list[int]:
    """The prompt the plain template renders for one user message (byte-level ids)."""
    return tokenizer.encode(f"user: {content}\nassistant:")


def _max_seq(server) -> int:
    card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    return int(card["max_model_len"])


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT_S * 2))


# ---- AsyncOpenAI: concurrency, cancelling, response wrappers ----------------------------------
def _completion_answer(prompt: str, n: int) -> str:
    return tokenizer.decode(oracle_tokens(tokenizer.encode(prompt), n))


def _oracle_check(server) -> None:
    """A request after the others still answers the oracle's greedy tokens."""
    async def ask() -> str:
        client = _async_client(server)
        try:
            done = await client.completions.create(model=MODEL, prompt="after", max_tokens=6)
            return done.choices[0].text
        finally:
            await client.close()
    assert _run(ask()) == _completion_answer("after", 6)


def test_concurrent_async_requests_each_answer_the_oracle(served):
    """24 requests at once through one ``AsyncOpenAI`` (``asyncio.gather``): completions and
    chats, whole and streamed, one prompt each; every answer is its own prompt's greedy
    continuation (no answer crosses to another request), and the server is idle after."""
    server, _, service = served

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str]:
        text = f"question {i}"
        if i % 2:  # chat
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": 5}
            expected = tokenizer.decode(oracle_tokens(_chat_prompt(text), 5))
            if i % 4 == 1:
                whole = await client.chat.completions.create(model=MODEL, **body)
                return whole.choices[0].message.content or "", expected
            stream = await client.chat.completions.create(model=MODEL, stream=True, **body)
            return "".join([c.choices[0].delta.content or "" async for c in stream
                            if c.choices]), expected
        expected = _completion_answer(text, 5)
        if i % 4 == 0:
            whole = await client.completions.create(model=MODEL, prompt=text, max_tokens=5)
            return whole.choices[0].text, expected
        stream = await client.completions.create(model=MODEL, prompt=text, max_tokens=5,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices]), expected

    async def all_of_them() -> list[tuple[str, str]]:
        client = _async_client(server)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(24)))
        finally:
            await client.close()

    for got, expected in _run(all_of_them()):
        assert got == expected
    wait_for(lambda: server_idle(service), what="every request released")


@pytest.mark.parametrize("how", ["break", "cancel-stream", "cancel-whole", "cancel-n3-stream",
                                 "cancel-n3-whole"])
def test_an_async_client_that_gives_up_mid_generation_frees_everything(served, how):
    """A client that breaks out of ``async for`` (closing the stream), or whose task is
    cancelled mid-stream or while a whole answer (one choice or three) is being generated:
    the server stops the generation and gives back every sequence id well before the
    30000 tokens asked for could be generated (the wait is bounded), and the next answer is
    still the oracle's."""
    server, _, service = served
    n = 3 if "n3" in how else 1

    async def give_up() -> None:
        client = _async_client(server)
        try:
            body = {"model": MODEL, "prompt": "long", "max_tokens": 30000, "n": n}
            if how == "break":
                stream = await client.completions.create(stream=True, **body)
                async with stream:
                    seen = 0
                    async for _ in stream:
                        seen += 1
                        if seen == 5:
                            break
                return
            if how.endswith("stream"):
                started = asyncio.Event()

                async def read() -> None:
                    stream = await client.completions.create(stream=True, **body)
                    async for _ in stream:
                        started.set()
                task = asyncio.create_task(read())
                await asyncio.wait_for(started.wait(), TIMEOUT_S)
            else:
                task = asyncio.create_task(client.completions.create(**body))
                for _ in range(int(TIMEOUT_S / 0.01)):  # bounded: until it generates
                    if service.active == n:
                        break
                    await asyncio.sleep(0.01)
                assert service.active == n
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            await client.close()

    _run(give_up())
    wait_for(lambda: server_idle(service), timeout=15.0, what=f"the server idle after {how}")
    counts = service.sequences.counts()
    assert counts["free"] == counts["capacity"], counts
    _oracle_check(server)


def test_streaming_and_raw_response_wrappers(served):
    """``with_streaming_response`` (the SSE lines as they come, headers first) and
    ``with_raw_response`` (headers, then ``parse()``) of the async SDK, on completions and
    chat: the content types the SDK decides by, and the parsed answers are the oracle's."""
    server, _, _ = served
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "raw"}], "max_tokens": 4}

    async def go() -> None:
        client = _async_client(server)
        try:
            async with client.chat.completions.with_streaming_response.create(
                    stream=True, **chat) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                lines = [line async for line in response.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert all(line.startswith("data: ") for line in lines), lines
            async with client.chat.completions.with_streaming_response.create(**chat) as response:
                assert response.headers["content-type"] == "application/json"
                whole = await response.parse()
            assert whole.choices[0].message.content == tokenizer.decode(
                oracle_tokens(_chat_prompt("raw"), 4))
            raw = await client.completions.with_raw_response.create(model=MODEL, prompt="raw",
                                                                    max_tokens=4)
            assert raw.http_response.status_code == 200
            assert raw.headers["content-type"] == "application/json"
            assert raw.parse().choices[0].text == _completion_answer("raw", 4)
        finally:
            await client.close()
    _run(go())


@pytest.mark.parametrize("temperature", [0, 0.9])
def test_an_async_n3_stream_with_logprobs_is_the_whole_answer(served, temperature):
    """``n=3`` + ``stream`` + ``logprobs`` (+ usage) through the async SDK, seeded: each
    choice's streamed text, log-probabilities and finish reason are those of the same request
    answered whole, and the usage chunk counts the three choices' tokens."""
    server, _, _ = served
    body = {"model": MODEL, "messages": [{"role": "user", "content": "three"}],
            "max_tokens": 5, "n": 3, "seed": 11, "temperature": temperature,
            "logprobs": True, "top_logprobs": 2}

    async def go():
        client = _async_client(server)
        try:
            whole = await client.chat.completions.create(**body)
            stream = await client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **body)
            got: dict[int, list] = {}
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
                for choice in chunk.choices:
                    entry = got.setdefault(choice.index, ["", [], None])
                    entry[0] += choice.delta.content or ""
                    if choice.logprobs and choice.logprobs.content:
                        entry[1] += [(e.token, e.logprob) for e in choice.logprobs.content]
                    entry[2] = choice.finish_reason or entry[2]
            return whole, got, usage
        finally:
            await client.close()

    whole, got, usage = _run(go())
    assert sorted(got) == [0, 1, 2]
    for choice in whole.choices:
        expected = [choice.message.content,
                    [(e.token, e.logprob) for e in choice.logprobs.content],
                    choice.finish_reason]
        assert got[choice.index] == expected
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens == 15


# ---- the context's edge ------------------------------------------------------------------------
@pytest.mark.parametrize("sent", [{}, {"max_tokens": None}, {"max_completion_tokens": None}],
                         ids=["absent", "max_tokens-null", "max_completion_tokens-null"])
def test_a_chat_without_max_tokens_gets_what_the_context_leaves(served, sent):
    """A chat body without ``max_tokens`` (or with null: the SDK's and LangChain's default)
    whose messages leave fewer than the default 256 tokens of context was refused with a 400
    ``context_length_exceeded`` blaming ``max_tokens=256``, a number the client never sent:
    a long conversation that fits failed. As vLLM and OpenAI do, the default is what the
    context leaves (at most 256 here): the reply runs to the context's end, ``length``."""
    server, client, service = served
    max_seq = _max_seq(server)
    content = "x" * (max_seq - len(_chat_prompt("")) - 3)  # leaves 3 tokens of context
    prompt = _chat_prompt(content)
    assert max_seq - len(prompt) == 3
    reply = client.chat.completions.create(model=MODEL, temperature=0, **sent,
                                           messages=[{"role": "user", "content": content}])
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert reply.usage is not None and reply.usage.completion_tokens == 3
    assert reply.usage.prompt_tokens == len(prompt)
    assert choice.message.content == tokenizer.decode(oracle_tokens(prompt, 3))
    wait_for(lambda: server_idle(service), what="the long request released")


def test_a_chat_whose_messages_fill_the_context_names_the_messages(served):
    """Messages that leave no room for a reply (exactly the context, or more) are the
    client's to shorten: the 400 ``context_length_exceeded`` names ``messages`` (the chat
    body has no ``prompt`` field: OpenAI names ``messages`` there; it named ``prompt`` when
    the body gave ``max_tokens``), never the ``max_tokens`` the client did not send."""
    server, client, _ = served
    max_seq = _max_seq(server)
    for extra, given in ((0, {}), (5, {}), (5, {"max_tokens": 4}), (5, {"n": 2}),
                         (5, {"max_tokens": 4, "n": 2, "stream": True})):
        content = "x" * (max_seq - len(_chat_prompt("")) + extra)
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, temperature=0, **given,
                                           messages=[{"role": "user", "content": content}])
        error = caught.value.body
        assert isinstance(error, dict), error
        assert (error["code"], error["param"]) == ("context_length_exceeded", "messages"), error
        assert error["message"].startswith(
            f"This model's maximum context length is {max_seq} tokens. However, "), error
        assert "max_tokens" not in error["message"], error


def test_a_chat_max_tokens_given_over_the_context_is_still_refused_naming_it(served):
    """Only the server's default is cut to the context: a ``max_tokens`` the client gave that
    does not fit is still a 400 naming ``max_tokens`` (as before; OpenAI and vLLM do too)."""
    server, client, _ = served
    max_seq = _max_seq(server)
    content = "x" * (max_seq - len(_chat_prompt("")) - 3)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, temperature=0, max_tokens=4,
                                       messages=[{"role": "user", "content": content}])
    error = caught.value.body
    assert isinstance(error, dict), error
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens"), error



def test_a_chat_max_completion_tokens_over_the_context_is_refused_naming_that_field(served):
    """The SDK's current field and what LangChain's ``ChatOpenAI(max_tokens=...)`` sends:
    ``max_completion_tokens``. One that does not fit the context was refused naming
    ``max_tokens`` ("max_tokens=4 for the completion"), a field the body did not have; the
    refusal names the field the body gave."""
    server, client, _ = served
    max_seq = _max_seq(server)
    content = "x" * (max_seq - len(_chat_prompt("")) - 3)
    for n in (1, 2):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, temperature=0, max_completion_tokens=4,
                                           n=n, messages=[{"role": "user", "content": content}])
        error = caught.value.body
        assert isinstance(error, dict), error
        assert (error["code"], error["param"]) == ("context_length_exceeded",
                                                   "max_completion_tokens"), error
        assert "max_completion_tokens=4" in error["message"], error


# ---- a timeout as the async SDK reads it -------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_of_several_choices_past_its_timeout_names_the_timeout_it_gave(served,
                                                                                  stream):
    """A request of several choices (``n`` > 1, a prompt list) whose ``timeout`` ran out was
    told ``request timeout=0.499873 s passed``: each choice's run was admitted with the time
    left of the request's deadline, and the message named that, not the ``timeout`` the
    client gave (a single choice names it, test_server_stream2.py). The message names the
    request's timeout; the deadline is still the request's, shared by its choices."""
    server, _, service = served

    async def ask(**body):
        client = _async_client(server)
        try:
            if not stream:
                await client.completions.create(model=MODEL, max_tokens=30000, **body)
                return None
            chunks = await client.completions.create(model=MODEL, max_tokens=30000,
                                                     stream=True, **body)
            async for _ in chunks:
                pass
            return None
        except openai.APIError as err:
            return err
        finally:
            await client.close()

    for body in ({"prompt": "x", "n": 2}, {"prompt": ["x", "y"]}, {"prompt": ["x"], "n": 3}):
        err = _run(ask(**body, extra_body={"timeout": 0.5}))
        assert err is not None, body
        if not stream:
            assert isinstance(err, openai.APIStatusError) and err.status_code == 504, err
        error = err.body  # the body's "error" object, as the SDK hands it over
        assert isinstance(error, dict) and error["code"].endswith(".deadline"), (body, error)
        assert error["message"].startswith("request timeout=0.5 s passed after "), (body, err)
        wait_for(lambda: server_idle(service), what="the timed-out choices released")


# ---- stream_options -----------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{"include_usage": None}, {"include_obfuscation": None},
                                     {"continuous_usage_stats": None},
                                     {"include_usage": None, "include_obfuscation": None}])
def test_stream_options_whose_values_are_null_mean_their_defaults(served, options):
    """``null`` for an optional field means its default (docs/server.md), inside
    ``stream_options`` too (a client serialising a model with unset fields sends them so;
    vLLM's ``StreamOptions`` declares them optional): ``{"include_usage": null}`` was a 400
    "must be a boolean". It streams as ``{}`` does: no usage chunk."""
    server, client, _ = served
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3,
                                            stream=True, stream_options=options))
    assert [c.usage for c in chunks] == [None] * len(chunks)
    text = "".join(choice.text for c in chunks for choice in c.choices)
    assert text == tokenizer.decode(oracle_tokens(tokenizer.encode("abc"), 3))
    for wrong in (0, 1, "true"):  # still no boolean: refused naming the options
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=MODEL, prompt="abc", max_tokens=3, stream=True,
                                      stream_options={**options, "include_usage": wrong})
        assert isinstance(caught.value.body, dict), caught.value
        assert caught.value.body["param"] == "stream_options", caught.value.body
