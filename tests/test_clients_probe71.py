"""Stop 71's probe with real clients (docs/traceability.md "Found at stop 71 (clients)"): the
official ``openai`` SDK (3.51, the pinned one) and LangChain's OpenAI integration
(``langchain-openai``, the ``[clients]`` extra), unmodified, against a loopback server on the
synthetic model, as a team adopting the server runs them. Client timeout 30 s, no retries.

LangChain is imported inside its tests (``needs.module``): without the extra they are skipped
(``.ci/run`` installs it and runs them again with nothing skipped) and the SDK's tests still
run."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import needs
from calexec.drivers.serving import byte_tokenizer as tokenizer
from test_server_support import MODEL, openai_server, oracle_tokens, server_idle, wait_for

openai = needs.module("openai", "clients")
httpx = needs.module("httpx", "server")

TIMEOUT_S = 30.0


@pytest.fixture(scope="module", name="served")
def served_fixture(tmp_path_factory) -> Iterator[tuple]:
    """``(url, sdk, service)``: a server with ``create_app``'s defaults, its ``/v1`` URL and
    an official ``openai`` client for it."""
    with openai_server(tmp_path_factory.mktemp("calbin"), timeout=TIMEOUT_S) as (
            server, sdk, service):
        yield f"{server.url}/v1", sdk, service


def _max_seq(sdk) -> int:
    return sdk.models.retrieve(MODEL).model_extra["max_model_len"]


def _completion_answer(prompt: str, n: int) -> str:
    """The oracle's greedy ``n`` tokens after ``prompt`` (completions: no template)."""
    return tokenizer.decode(oracle_tokens(tokenizer.encode(prompt), n))


# ---- a context overflow, as LangChain tells it ----------------------------------------------------
def _overflowing_bodies(max_seq: int) -> list[tuple[str, str, dict]]:
    """(what, route, body) of every way a request overflows the context."""
    long_text = "x" * (max_seq + 5)
    fits = "x" * (max_seq - 40)
    return [("prompt over the context", "completions", {"prompt": long_text, "max_tokens": 4}),
            ("prompt + max_tokens over it", "completions", {"prompt": fits, "max_tokens": 100}),
            ("messages over the context", "chat",
             {"messages": [{"role": "user", "content": long_text}], "max_tokens": 4}),
            ("messages + max_completion_tokens over it", "chat",
             {"messages": [{"role": "user", "content": fits}], "max_completion_tokens": 100}),
            ("messages leaving no room for the default", "chat",
             {"messages": [{"role": "user", "content": long_text}]})]


def test_the_sdks_error_text_names_a_context_overflow_by_its_code(served):
    """The SDK 3.x writes only the body's ``error.message`` into the exception's text (``str(e)``,
    ``e.message``; 1.x and 2.x wrote the whole body, code included), and LangChain, litellm
    and the like tell a context overflow from any other 400 by that text: the message carries
    the code ``context_length_exceeded`` as well as OpenAI's wording, for every overflow."""
    _, sdk, _ = served
    for what, route, body in _overflowing_bodies(_max_seq(sdk)):
        call = sdk.completions.create if route == "completions" else sdk.chat.completions.create
        with pytest.raises(openai.BadRequestError) as caught:
            call(model=MODEL, **body)
        error = caught.value
        assert error.code == "context_length_exceeded", (what, error.body)
        assert "context_length_exceeded" in str(error), (what, str(error))
        assert "maximum context length" in error.message, (what, error.message)


def test_langchain_raises_its_context_overflow_error_for_a_prompt_past_the_context(served):
    """LangChain's ``ChatOpenAI`` maps a 400 to ``ContextOverflowError`` (langchain-core's
    provider-neutral error an application, or an agent's summarizing step, catches to shorten
    the conversation) when the exception's text says ``context_length_exceeded``. With the
    pinned SDK that text is the message alone, and the server's ("This model's maximum
    context length is ...", OpenAI's older wording) did not say it: every overflow was a
    plain ``OpenAIInvalidRequestError``, invoked, streamed and over ``/v1/responses``."""
    langchain_openai = needs.module("langchain_openai", "clients")
    exceptions = needs.module("langchain_core.exceptions", "clients")
    url, sdk, _ = served
    long_text = "x" * (_max_seq(sdk) + 5)
    for extra in ({}, {"use_responses_api": True}):
        chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="unused",
                                           max_tokens=4, timeout=TIMEOUT_S, max_retries=0,
                                           **extra)
        with pytest.raises(exceptions.ContextOverflowError):
            chat.invoke(long_text)
        with pytest.raises(exceptions.ContextOverflowError):
            list(chat.stream(long_text))
    big = langchain_openai.ChatOpenAI(model=MODEL, base_url=url, api_key="unused",
                                      max_tokens=_max_seq(sdk), timeout=TIMEOUT_S, max_retries=0)
    with pytest.raises(exceptions.ContextOverflowError):
        big.invoke("hello")  # the prompt fits, prompt + max_tokens does not


# ---- LangChain's OpenAI LLM batches 20 prompts per request ----------------------------------------
def test_langchain_llm_batch_of_its_default_batch_size_is_served(served):
    """LangChain's ``OpenAI`` completion LLM sends the prompts of ``batch``/``generate`` as
    one ``prompt`` list per ``batch_size`` (20 by default, after OpenAI's guidance). The
    server's default ``max_choices`` was 16: ``llm.batch(prompts)`` of 17 to 20 prompts (and
    every sub-batch of a longer list) was a 400 ``prompt: 17 prompts > max_choices=16``. The
    default is now OpenAI's own cap on ``n``, 128: the batch is served, each answer its own
    prompt's, in order, synchronously and async."""
    langchain_openai = needs.module("langchain_openai", "clients")
    url, _, service = served
    llm = langchain_openai.OpenAI(model=MODEL, base_url=url, api_key="unused", temperature=0,
                                  max_tokens=2, timeout=TIMEOUT_S, max_retries=0)
    assert llm.batch_size == 20
    prompts = [f"prompt {i}" for i in range(45)]  # sub-batches of 20, 20 and 5
    assert llm.batch(prompts) == [_completion_answer(p, 2) for p in prompts]
    wait_for(lambda: server_idle(service), TIMEOUT_S, "the server to be idle")


def test_the_sdk_is_served_n_up_to_openais_cap(served):
    """``n`` up to 128 (OpenAI's own cap on it) is served by default, each choice in
    index order; 129 is the 400 naming ``n`` and the server's cap."""
    _, sdk, service = served
    whole = sdk.completions.create(model=MODEL, prompt="abc", n=128, max_tokens=1,
                                   temperature=0)
    assert [c.index for c in whole.choices] == list(range(128))
    assert {c.text for c in whole.choices} == {_completion_answer("abc", 1)}
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                    n=129, max_tokens=1)
    assert caught.value.param == "n" and "max_choices=128" in caught.value.message
    wait_for(lambda: server_idle(service), TIMEOUT_S, "the server to be idle")


# ---- a base URL without /v1 (or with it twice) ---------------------------------------------------
@pytest.mark.parametrize("suffix", ["", "/v1/v1"], ids=["without-v1", "v1-twice"])
def test_a_client_whose_base_url_misses_v1_is_told_where_the_routes_are(served, suffix):
    """``OpenAI(base_url="http://host:port")`` (``ChatOpenAI(base_url=...)``, llama-index's
    ``api_base``) without the ``/v1`` every OpenAI-compatible server's routes sit under, or
    with it twice, got ``404 POST /chat/completions: no such route (docs/server.md lists
    them)``, naming no fix. The 404 (same code, same shape, nothing served) now names the
    route the path reaches under ``/v1`` and says the base URL ends with ``/v1``; a path
    that is no route under ``/v1`` either is told only that it is none."""
    url, _, _ = served
    root = url.removesuffix("/v1") + suffix
    sdk = openai.OpenAI(base_url=root, api_key="unused", max_retries=0, timeout=TIMEOUT_S)
    calls = [("POST /chat/completions", "POST /v1/chat/completions", lambda: sdk.chat.completions
              .create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)),
             ("POST /completions", "POST /v1/completions",
              lambda: sdk.completions.create(model=MODEL, prompt="x", max_tokens=2)),
             ("GET /models", "GET /v1/models", lambda: sdk.models.list()),
             ("GET /models/" + MODEL, "GET /v1/models/" + MODEL,
              lambda: sdk.models.retrieve(MODEL)),
             ("POST /responses", "POST /v1/responses",
              lambda: sdk.responses.create(model=MODEL, input="x", max_output_tokens=2))]
    for sent, served_route, call in calls:
        sent = sent.replace(" /", f" {suffix}/", 1)
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        error = caught.value
        assert error.code == "not_found" and error.param is None, error.body
        assert error.message.startswith(
            f"Error code: 404 - {sent}: no such route: {served_route} is one (the OpenAI "
            "routes are under /v1"), error.message
        assert "base URL ends with /v1" in error.message, error.message
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.embeddings.create(model=MODEL, input="x")  # no route under /v1 either
    assert "OpenAI routes are under" not in caught.value.message, caught.value.message


def test_a_path_missing_v1_asked_with_another_method_names_the_route_not_the_method(served):
    """``GET /chat/completions`` (a base URL without ``/v1`` and the wrong method): the route
    it meant takes POST only, so the 404 names the route and says it is for another
    method, never ``GET /v1/chat/completions is one``."""
    url, _, _ = served
    answer = httpx.get(url.removesuffix("/v1") + "/chat/completions", timeout=TIMEOUT_S)
    assert answer.status_code == 404, answer.text
    message = answer.json()["error"]["message"]
    assert message.startswith("GET /chat/completions: no such route: /v1/chat/completions is "
                              "one, for another method than GET (the OpenAI routes are under "
                              "/v1"), message
