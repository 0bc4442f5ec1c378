"""Issue 27, real clients: LangChain's OpenAI integration (``langchain-openai``, the
``[clients]`` extra), unmodified, against a loopback server on the synthetic model.

``ChatOpenAI``: ``invoke``, ``stream``, ``batch`` (each checked against the numpy oracle's
greedy tokens), ``with_structured_output`` with a pydantic model (LangChain's default method
sends ``response_format`` ``json_schema``) and ``bind_tools`` with one tool (``tools``); the
``OpenAI`` completion LLM: ``invoke`` and ``batch`` (it always sends ``prompt`` as a list).
Async (one event loop for the module): ``ainvoke``, ``astream``, ``abatch``,
``astream_events``, and the ``bind_tools`` loop that sends a ``ToolMessage`` back for a
second turn. ``ChatOpenAI(use_responses_api=True)``: ``invoke`` and ``stream`` over
``/v1/responses``.

``with_structured_output`` and ``bind_tools`` are written to the OpenAI contract: they need the
grammar engine of issue 27's structured-outputs branch and fail without it (on this server a
``response_format`` json_schema and ``tools`` are refused with a 400). LangChain never calls
tiktoken here (only ``get_num_tokens`` does; nothing is downloaded). Client timeout 10 s, no
retries."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from needs import module
from test_server_support import MODEL, openai_server, oracle_tokens

langchain_openai = module("langchain_openai", "clients")
openai = module("openai", "clients")

TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (server, _, _):
        yield f"{server.url}/v1"


def _chat(url: str, max_tokens: int = 4, **extra):
    return langchain_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="unused",
                                       temperature=0, max_tokens=max_tokens, timeout=TIMEOUT_S,
                                       max_retries=0, **extra)


def _chat_answer(prompt: str, n: int) -> str:
    """The greedy reply the plain chat template gives to one user message."""
    return tokenizer.decode(oracle_tokens(tokenizer.encode(f"user: {prompt}\nassistant:"), n))


def _completion_answer(prompt: str, n: int) -> str:
    return tokenizer.decode(oracle_tokens(tokenizer.encode(prompt), n))


# ---- ChatOpenAI ---------------------------------------------------------------------------------
def test_chat_invoke(url):
    reply = _chat(url).invoke("Hello there")
    assert reply.content == _chat_answer("Hello there", 4)
    assert reply.response_metadata["finish_reason"] == "length"
    assert reply.usage_metadata["output_tokens"] == 4


def test_chat_stream(url):
    chunks = list(_chat(url, stream_usage=True).stream("Stream to me"))
    assert len(chunks) >= 4
    assert "".join(c.content for c in chunks) == _chat_answer("Stream to me", 4)
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == 4


def test_chat_batch(url):
    prompts = ["one", "two", "three"]
    replies = _chat(url).batch(prompts)
    assert [r.content for r in replies] == [_chat_answer(p, 4) for p in prompts]


def test_chat_with_structured_output_parses_into_the_pydantic_model(url):
    # bounded fields: the synthetic model's random weights never close an unbounded string by
    # themselves (a real model does); the grammar enforces the bound (docs/server.md). A
    # character may take up to 4 byte tokens: max_tokens leaves room for the bound's worst case
    class Person(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=12)
        age: int = pydantic.Field(ge=0, le=150)

    structured = _chat(url, max_tokens=200).with_structured_output(Person)
    person = structured.invoke("Invent a person.")
    assert isinstance(person, Person)  # every response parses against the schema


def test_chat_bind_tools_answers_an_openai_shaped_tool_call(url):
    class get_weather(pydantic.BaseModel):  # noqa: N801 - the tool's name, as a function's
        """The weather in a city."""

        # bounded, as in the structured-output test above, and no other key: the greedy
        # synthetic model may write key after key until max_tokens where the schema allows
        # them (it did once a named call's output became its arguments alone, stop 58)
        model_config = pydantic.ConfigDict(extra="forbid")
        city: str = pydantic.Field(max_length=12)

    bound = _chat(url, max_tokens=200).bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke("Weather in Paris?")
    assert reply.tool_calls, reply
    call = reply.tool_calls[0]
    assert call["name"] == "get_weather"
    assert isinstance(call["args"], dict) and isinstance(call["args"].get("city"), str)
    assert len(call["args"]["city"]) <= 12
    json.dumps(call["args"])


def test_chat_over_the_responses_api_invokes_and_streams(url):
    """``ChatOpenAI(use_responses_api=True)`` talks to ``POST /v1/responses`` (stop 63: it
    was a 404): the reply and the streamed text are the greedy answer; the metadata is the
    Response's (status incomplete: max_tokens, sent as max_output_tokens, cut it)."""
    chat = _chat(url, use_responses_api=True)
    reply = chat.invoke("Hello there")
    assert reply.text == _chat_answer("Hello there", 4)
    assert reply.response_metadata["id"].startswith("resp_")
    assert reply.response_metadata["incomplete_details"] == {"reason": "max_output_tokens"}
    assert reply.usage_metadata["output_tokens"] == 4
    streamed = "".join(chunk.text for chunk in chat.stream("Hello there"))
    assert streamed == reply.text


# ---- the OpenAI completion LLM ---------------------------------------------------------------
def _llm(url: str, **extra):
    return langchain_openai.OpenAI(model=MODEL, base_url=url, api_key="unused", temperature=0,
                                   max_tokens=3, timeout=TIMEOUT_S, max_retries=0, **extra)


def test_llm_invoke_sends_a_one_element_prompt_list(url):
    assert _llm(url).invoke("abc") == _completion_answer("abc", 3)


def test_llm_batch(url):
    prompts = ["abc", "xyz", "hello"]
    assert _llm(url).batch(prompts) == [_completion_answer(p, 3) for p in prompts]


# ---- async (branch asyncsweep) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def loop():
    """One event loop for the module's async tests, as an application has one: langchain-openai
    caches its default ``httpx.AsyncClient`` per base URL and timeout, bound to the loop of
    its first use (a second ``asyncio.run`` gets "Event loop is closed")."""
    running = asyncio.new_event_loop()
    yield running
    running.close()


@pytest.fixture(scope="module")
def http(loop):
    """The async tests' HTTP client (``http_async_client``), closed on the module's loop at
    the end: each ``OpenAI`` LLM built an ``AsyncOpenAI`` of its own and langchain-openai
    cached ``ChatOpenAI``'s, none ever closed (``ResourceWarning: unclosed socket`` when the
    collector found them, in whichever later test)."""
    client = openai.DefaultAsyncHttpxClient(timeout=TIMEOUT_S)
    yield client
    loop.run_until_complete(client.aclose())


@pytest.fixture
def achat(url, http):
    """``_chat`` for the async tests, on the module's client."""
    return lambda **extra: _chat(url, http_async_client=http, **extra)


@pytest.fixture
def allm(url, http):
    """``_llm`` for the async tests, on the module's client."""
    return lambda: _llm(url, http_async_client=http)


@pytest.fixture
def arun(loop):
    return lambda coro: loop.run_until_complete(asyncio.wait_for(coro, TIMEOUT_S * 3))


def test_chat_ainvoke_astream_and_abatch(achat, arun):
    """``ChatOpenAI``'s async calls (``AsyncOpenAI`` under it): ``ainvoke``, ``astream`` with
    usage, ``abatch`` (concurrent requests), each the oracle's greedy reply."""
    async def go():
        reply = await achat().ainvoke("Hello async")
        chunks = [c async for c in achat(stream_usage=True).astream("Stream async")]
        replies = await achat().abatch(["a1", "a2", "a3", "a4"])
        return reply, chunks, replies

    reply, chunks, replies = arun(go())
    assert reply.content == _chat_answer("Hello async", 4)
    assert reply.response_metadata["finish_reason"] == "length"
    assert "".join(c.content for c in chunks) == _chat_answer("Stream async", 4)
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert usage and usage[-1]["output_tokens"] == 4
    assert [r.content for r in replies] == [_chat_answer(p, 4) for p in ("a1", "a2", "a3", "a4")]


def test_chat_astream_events_reports_each_token_and_the_end(achat, arun):
    """``astream_events`` (v2), what agent frameworks and UIs subscribe to: a start, one
    ``on_chat_model_stream`` per token chunk (their text the oracle's reply) and an end
    whose output is the whole message."""
    async def go():
        return [e async for e in achat().astream_events("Events", version="v2")]

    events = arun(go())
    kinds = [e["event"] for e in events]
    assert kinds[0] == "on_chat_model_start" and kinds[-1] == "on_chat_model_end", kinds
    streamed = "".join(e["data"]["chunk"].content for e in events
                       if e["event"] == "on_chat_model_stream")
    assert streamed == _chat_answer("Events", 4)
    assert events[-1]["data"]["output"].content == streamed


def test_a_bind_tools_loop_sends_the_tool_result_back_for_a_second_turn(achat, arun):
    """The tool-calling loop as LangChain's docs write it, async: the model calls the tool
    (``bind_tools``, ``tool_choice`` forcing it), the application appends the ``AIMessage``
    (content "", ``tool_calls``) and a ``ToolMessage`` answering its call id, and asks again
    (tools still bound, ``auto``): the second turn is accepted and answered (the plain
    template renders the call and the tool's answer into its prompt), streamed too."""
    from langchain_core.messages import HumanMessage, ToolMessage

    class get_weather(pydantic.BaseModel):  # noqa: N801 - the tool's name, as a function's
        """The weather in a city."""

        model_config = pydantic.ConfigDict(extra="forbid")  # (no other key: as above)
        city: str = pydantic.Field(max_length=12)

    async def go():
        forced = achat(max_tokens=200).bind_tools([get_weather], tool_choice="get_weather")
        history: list = [HumanMessage("Weather in Paris?")]
        called = await forced.ainvoke(history)
        history.append(called)
        for call in called.tool_calls:
            history.append(ToolMessage(content="sunny, 21 C", tool_call_id=call["id"]))
        free = achat(max_tokens=8).bind_tools([get_weather])
        second = await free.ainvoke(history)
        streamed = [c async for c in free.astream(history)]
        return called, second, streamed

    called, second, streamed = arun(go())
    assert [c["name"] for c in called.tool_calls] == ["get_weather"], called
    assert second.response_metadata["finish_reason"] in ("length", "stop", "tool_calls")
    joined = streamed[0]
    for chunk in streamed[1:]:
        joined = joined + chunk
    assert joined.content == second.content  # greedy: the same reply, streamed
    assert [c["args"] for c in joined.tool_calls] == [c["args"] for c in second.tool_calls]


def test_llm_ainvoke_astream_and_abatch(allm, arun):
    """The ``OpenAI`` completion LLM's async calls: ``ainvoke``, ``astream`` (token pieces
    joining to the reply), ``abatch``."""
    async def go():
        return (await allm().ainvoke("abc"), [c async for c in allm().astream("xyz")],
                await allm().abatch(["abc", "hello"]))

    one, pieces, many = arun(go())
    assert one == _completion_answer("abc", 3)
    assert "".join(pieces) == _completion_answer("xyz", 3)
    assert many == [_completion_answer(p, 3) for p in ("abc", "hello")]
