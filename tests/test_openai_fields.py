"""Issue 27, "clients work unchanged": every field of the OpenAI completions and chat request
types of the pinned ``openai`` SDK (constraints.txt) is accepted with its documented type, null
included, and honoured or refused with a 400 naming it; the vLLM extensions (sampling fields on
the host-side FP32 row, template switches); the error surface (OpenAI-shaped bodies on every
route, ``context_length_exceeded``, 415, ``/v1/models/{id}``, CORS) on a loopback server."""

from __future__ import annotations

import typing

import httpx
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.openai_api import ChatRequest, CompletionRequest
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import LiveServer, oracle_tokens, started_executor

MODEL = "calexec-qwen3-synthetic"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    executor = started_executor(tmp_path_factory.mktemp("calbin"))
    app = create_app(executor, ServerConfig())
    with LiveServer(app) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=30)
        yield server, client, app.state.service
    executor.shutdown(5.0)


def _sdk_fields(params: type) -> dict[str, object]:
    """The SDK request type's fields and their (resolved) annotations."""
    return typing.get_type_hints(params)


def _nullable(hint: object) -> bool:
    if typing.get_origin(hint) in (typing.Required, typing.NotRequired):
        hint = typing.get_args(hint)[0]
    return hint is type(None) or type(None) in typing.get_args(hint)


COMPLETION_SDK = _sdk_fields(completion_params.CompletionCreateParamsNonStreaming)
CHAT_SDK = _sdk_fields(chat_params.CompletionCreateParamsNonStreaming)


# ---- 1. every SDK field is a declared field, null included -----------------------------------
def test_every_sdk_field_is_a_declared_field_of_the_request_bodies():
    assert set(COMPLETION_SDK) <= set(CompletionRequest.model_fields), \
        sorted(set(COMPLETION_SDK) - set(CompletionRequest.model_fields))
    assert set(CHAT_SDK) <= set(ChatRequest.model_fields), \
        sorted(set(CHAT_SDK) - set(ChatRequest.model_fields))


@pytest.mark.parametrize("field", sorted(f for f, h in COMPLETION_SDK.items()
                                         if _nullable(h) and f not in ("model", "prompt")))
def test_completions_accept_null_for_every_nullable_sdk_field(live, field):
    server, _, _ = live
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, field: None}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


@pytest.mark.parametrize("field", sorted(f for f, h in CHAT_SDK.items()
                                         if _nullable(h) and f not in ("model", "messages")))
def test_chat_accepts_null_for_every_nullable_sdk_field(live, field):
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            field: None}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


def test_null_means_the_default():
    """``n: null`` is one choice, ``echo: null`` no echo, ``stream: null`` a whole answer."""
    body = CompletionRequest.model_validate_json(
        b'{"prompt": [1], "n": null, "echo": null, "stream": null, "logprobs": null}')
    assert (body.n, body.echo, body.stream, body.logprobs) == (1, False, False, None)
    chat = ChatRequest.model_validate_json(
        b'{"messages": [{"role": "user", "content": "x"}], "logprobs": null, "n": null}')
    assert (chat.logprobs, chat.n) == (False, 1)


def test_a_null_prompt_is_the_start_of_a_document(live):
    """OpenAI: with no prompt the model generates as if from the start of a new document (its
    document separator, the end token here)."""
    server, _, service = live
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"model": MODEL, "prompt": None, "max_tokens": 3}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 1
    expected = oracle_tokens([service.config.end_token_id], 3)
    assert r.json()["choices"][0]["token_ids"] == expected


@pytest.mark.parametrize(("field", "value"), [
    ("user", "u1"), ("parallel_tool_calls", True), ("tool_choice", "none"), ("tools", []),
    ("functions", []), ("function_call", "none"), ("response_format", {"type": "text"}),
    ("prompt_cache_options", {"mode": "implicit"}), ("prompt_cache_retention", "24h"),
    ("prompt_cache_key", "k"), ("service_tier", "auto"), ("store", False),
    ("metadata", {"k": "v"}), ("safety_identifier", "s"), ("modalities", ["text"])])
def test_chat_accepts_the_sdks_non_null_fields_it_can_honour(live, field, value):
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            field: value}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [
    ("moderation", {"model": "omni-moderation-latest"}), ("web_search_options", {}),
    ("audio", {"voice": "alloy", "format": "wav"})])
def test_chat_refuses_what_this_model_cannot_honour_naming_it(live, field, value):
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            field: value}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_stream_options_include_obfuscation_is_accepted(live):
    _, client, _ = live
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True,
        stream_options={"include_obfuscation": False}))
    assert chunks and all(c.usage is None for c in chunks)


# ---- the multi-turn loop through the SDK -----------------------------------------------------
def test_multi_turn_model_dump_loop_through_the_sdk(live):
    """``messages.append(resp.choices[0].message.model_dump())``: the assistant message carries
    ``refusal``, ``annotations``, ``audio``, ``function_call`` and ``tool_calls`` as null."""
    _, client, _ = live
    messages: list[dict] = [{"role": "system", "content": "be brief"}]
    replies = []
    for turn in ("hi", "and then?", "bye"):
        messages.append({"role": "user", "content": turn})
        resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=3)
        dumped = resp.choices[0].message.model_dump()
        assert {"refusal", "audio", "function_call", "tool_calls"} <= set(dumped)
        messages.append(dumped)
        replies.append(dumped["content"])
    rendered = "".join(f"{m['role']}: {m['content']}\n" for m in messages[:-1]) + "assistant:"
    assert resp.usage.prompt_tokens == len(tokenizer.encode(rendered))
    assert resp.choices[0].message.content == tokenizer.decode(
        oracle_tokens(tokenizer.encode(rendered), 3))


def test_an_assistant_refusal_in_the_history_is_its_text(live):
    server, _, _ = live
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": None, "refusal": "no"},
                {"role": "user", "content": "b"}]
    r = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenizer.encode("user: a\nassistant: no\nuser: b\nassistant:")


@pytest.mark.parametrize(("key", "value"), [
    ("tool_calls", [{"id": "c1", "type": "function",
                     "function": {"name": "f", "arguments": "{}"}}]),
    ("function_call", {"name": "f", "arguments": "{}"}),
    ("audio", {"id": "audio_1"})])
def test_history_the_model_cannot_render_is_refused_naming_the_message_field(live, key, value):
    server, _, _ = live
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": None, key: value},
                {"role": "user", "content": "b"}]
    r = httpx.post(f"{server.url}/v1/chat/completions",
                   json={"model": MODEL, "messages": messages, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"messages.1.{key}"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/completions", {"prompt": [1], "best_of_n": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_x": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "extra": None}]})])
def test_fields_neither_openai_nor_vllm_defines_are_still_refused_naming_them(live, path, body):
    server, _, _ = live
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400, r.text
    param = r.json()["error"]["param"]
    assert param.split(".")[-1] in ("best_of_n", "guided_x", "extra"), param
    assert "unknown parameter" in r.json()["error"]["message"]
