"""Issue 27, "clients work unchanged": every field of the OpenAI completions and chat request
types of the pinned ``openai`` SDK (constraints.txt) is accepted with its documented type, null
included, and honoured or refused with a 400 naming it; the vLLM extensions (sampling fields on
the host-side FP32 row, template switches); the error surface (OpenAI-shaped bodies on every
route, ``context_length_exceeded``, 415, ``/v1/models/{id}``, CORS) on a loopback server."""

from __future__ import annotations

import json
import typing

import attrs
import httpx
import numpy as np
import openai
import pytest
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params

from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving import sampling
from calexec.drivers.serving.openai_api import ChatRequest, CompletionRequest
from calexec.drivers.serving.sampling import SamplingParams
from calexec.drivers.serving.server import ServerConfig, create_app
from calexec.drivers.synthetic.calbin import VOCAB
from test_server_support import (
    LiveServer,
    bos_tokenizer,
    live_fixture,  # noqa: F401 - the fixture `live`
    oracle_tokens,
    started_executor,
)

MODEL = "calexec-qwen3-synthetic"


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
    ("prompt_cache_key", "k"), ("service_tier", "auto"), ("service_tier", "priority"),
    ("prompt_cache_retention", "in_memory"), ("store", False),
    ("metadata", {"k": "v"}), ("safety_identifier", "s"), ("modalities", ["text"])])
def test_chat_accepts_the_sdks_non_null_fields_it_can_honour(live, field, value):
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            field: value}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(("field", "value"), [
    ("service_tier", "bogus"), ("service_tier", ""), ("service_tier", 1),
    ("prompt_cache_retention", "forever")])
def test_chat_refuses_a_value_outside_the_fields_set_naming_field_and_values(live, field, value):
    """OpenAI answers 400 for a service tier or cache retention it does not have; these were
    taken as any string."""
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            field: value}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field, error
    assert '"auto"' in error["message"] or '"24h"' in error["message"], error


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


def test_a_reasoning_effort_refusal_names_the_switch_this_server_has(live):
    """An OpenAI client that asks a reasoning model for less thinking sends
    ``reasoning_effort``; Qwen3's thinking is its chat template's ``enable_thinking``. The 400
    names the field and where the switch is, not only "not supported"."""
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "reasoning_effort": "low"}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "reasoning_effort", error
    assert "chat_template_kwargs" in error["message"] and "enable_thinking" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_top_logprobs_0_without_logprobs_is_neutral_and_more_is_refused(live, stream):
    """``logprobs: false`` with ``top_logprobs: 0`` (a client that serialises both of its
    settings) asks for nothing: vLLM takes it, and this server refused it as "needs
    logprobs=true". It answers without logprobs; a positive ``top_logprobs`` without
    ``logprobs`` is still a 400 naming ``top_logprobs``."""
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "logprobs": False, "top_logprobs": 0, "stream": stream}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    if stream:
        chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {")]
        assert all(c["choices"][0]["logprobs"] is None for c in chunks if c["choices"])
    else:
        assert r.json()["choices"][0]["logprobs"] is None
    for more in ({"top_logprobs": 1}, {"top_logprobs": 1, "logprobs": None}):
        r = httpx.post(f"{server.url}/v1/chat/completions", json={**body, **more}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "top_logprobs" and "needs logprobs=true" in error["message"]


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
    # tool calls are rendered (tests/test_openai_structured.py): a malformed one is refused
    ("tool_calls", [{"id": "c1", "type": "function", "function": {"name": "f"}}]),
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
    assert r.json()["error"]["param"].startswith(f"messages.1.{key}")


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


# ---- 2. vLLM's sampling and template extensions ------------------------------------------------
def _reference_row(raw: np.ndarray, prompt: list[int], output: list[int], bias: dict[int, float],
                   repetition: float, presence: float, frequency: float) -> np.ndarray:
    """vLLM's processors, written out one token at a time (float64): bias, repetition over
    prompt + output, then frequency x count and presence over the output."""
    row = [float(x) for x in raw]
    for token, b in bias.items():
        row[token] += b
    for token in set(prompt) | set(output):
        row[token] = row[token] / repetition if row[token] > 0 else row[token] * repetition
    for token in set(output):
        row[token] -= frequency * output.count(token) + presence
    return np.array(row)


@pytest.mark.parametrize(("bias", "repetition", "presence", "frequency"), [
    ({3: 5.0, 9: -100.0}, 1.0, 0.0, 0.0), ({}, 1.7, 0.0, 0.0), ({}, 0.6, 0.0, 0.0),
    ({}, 1.0, 1.5, 0.0), ({}, 1.0, 0.0, -0.7), ({11: 2.5}, 1.3, 0.4, 0.9)])
def test_process_equals_the_reference_computation(bias, repetition, presence, frequency):
    raw = np.random.default_rng(5).normal(0, 3, 64).astype(np.float32)
    prompt, output = [1, 2, 3, 2], [9, 11, 11, 40, 3, 11]
    params = SamplingParams(logit_bias=tuple(bias.items()), repetition_penalty=repetition,
                            presence_penalty=presence, frequency_penalty=frequency)
    got = sampling.process(raw, params, prompt, output)
    want = _reference_row(raw, prompt, output, bias, repetition, presence, frequency)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)
    assert not np.array_equal(got, raw)  # each case changes the row
    assert raw.dtype == np.float32 and got is not raw


def test_min_p_draws_equal_the_reference_computation():
    """With the same per-token generator (``[seed, index]``): softmax of row / temperature,
    tokens below min_p x the top probability dropped, then the inverse CDF of the rest."""
    raw = np.random.default_rng(8).normal(0, 2, 50).astype(np.float32)
    params = SamplingParams(temperature=0.8, min_p=0.2, seed=77)
    kept = set()
    for index in range(300):
        p = np.exp((raw.astype(np.float64) - raw.max()) / 0.8)
        p /= p.sum()
        p = np.where(p >= 0.2 * p.max(), p, 0.0)
        u = np.random.default_rng([77, index]).random()
        want = int(np.searchsorted(np.cumsum(p), u * p.sum(), side="right"))
        assert sampling.pick(raw, params, index)[0] == want, index
        kept.add(want)
    allowed = {int(i) for i in np.flatnonzero(np.exp((raw - raw.max()) / 0.8) >= 0.2)}
    assert kept <= allowed and len(allowed) < 50  # min_p cut some tokens off


def test_penalised_greedy_generation_equals_the_oracle_with_the_reference_processors(live):
    """End to end: greedy with logit_bias and the three penalties is the argmax of the
    oracle's FP32 row after the reference processors, step by step (greedy ahead must not fire
    the raw argmax)."""
    from calexec.drivers.synthetic import calbin, oracle
    _, client, _ = live
    prompt, n = [21, 22, 23], 10
    # the bias makes 100 the first choice; the penalties then keep it from being chosen again
    bias, repetition, presence, frequency = {100: 12.0}, 2.5, 1.0, 1.5
    seq = oracle.OracleSequence(calbin.DEFAULT_SEED)
    seq.run(prompt)
    want: list[int] = []
    for _ in range(n):
        raw = oracle.bf16_to_f32(oracle.logits_bf16(seq.states[-1]))
        token = int(np.argmax(_reference_row(raw, prompt, want, bias, repetition, presence,
                                             frequency)))
        want.append(token)
        seq.run([token])
    done = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=n, logit_bias={"100": 12},
        presence_penalty=presence, frequency_penalty=frequency,
        extra_body={"repetition_penalty": repetition})
    assert done.choices[0].model_extra["token_ids"] == want
    assert want[0] == 100 and want.count(100) == 1  # the bias and the penalties both acted
    assert want != oracle_tokens(prompt, n)


def test_logit_bias_forces_a_token_streamed_and_whole(live):
    _, client, _ = live
    body = dict(model=MODEL, prompt=[5, 6], max_tokens=4, logit_bias={"321": 100})
    assert _ids(client.completions.create(**body)) == [321] * 4
    chunks = client.completions.create(stream=True, **body)
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == [321] * 4


def _ids(done) -> list[int]:
    return done.choices[0].model_extra["token_ids"]


@pytest.mark.parametrize(("field", "value"), [
    ("stop_token_ids", [5, VOCAB]), ("logit_bias", {str(VOCAB): 1}), ("logit_bias", {"x": 1}),
    ("logit_bias", {"5": 101}), ("min_p", 1.5), ("repetition_penalty", 0),
    ("presence_penalty", 2.5), ("frequency_penalty", -3)])
def test_out_of_range_extension_values_are_a_400_naming_the_field(live, field, value):
    server, _, _ = live
    for path, body in (("/v1/completions", {"prompt": [1]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1, field: value},
                       timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field, r.json()
        assert field in r.json()["error"]["message"]


def test_return_token_ids_adds_the_prompts_ids(live):
    _, client, _ = live
    done = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=2,
                                     extra_body={"return_token_ids": True})
    assert done.choices[0].model_extra["prompt_token_ids"] == [7, 8, 9]
    plain = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=2)
    assert "prompt_token_ids" not in plain.choices[0].model_extra
    chunks = list(client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=2,
                                            stream=True, extra_body={"return_token_ids": True}))
    assert [c.choices[0].model_extra.get("prompt_token_ids") for c in chunks][:2] == \
        [[7, 8, 9], None]
    chat = client.chat.completions.create(model=MODEL, max_tokens=1,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == tokenizer.encode("user: hi\nassistant:")


def test_add_generation_prompt_false_leaves_the_assistant_turn_closed(live):
    _, client, _ = live
    chat = client.chat.completions.create(model=MODEL, max_tokens=1,
                                          messages=[{"role": "user", "content": "hi"}],
                                          extra_body={"add_generation_prompt": False})
    assert chat.usage.prompt_tokens == len(tokenizer.encode("user: hi\n"))


QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
              "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
              "{% if enable_thinking is defined and enable_thinking is false %}"
              "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_chat_template_kwargs_switch_qwen3_thinking_off(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    import json

    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["hello <think> </think> <|im_start|>"] * 10, trainers.BpeTrainer(
        vocab_size=280, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN3_LIKE}))
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(tmp_path / "tokenizer.json")))
    messages = [{"role": "user", "content": "hello"}]
    on = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            for kwargs, text in (({}, on), ({"enable_thinking": True}, on),
                                 ({"enable_thinking": False}, on + "<think>\n\n</think>\n\n")):
                chat = client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=1,
                    extra_body={"chat_template_kwargs": kwargs, "return_token_ids": True})
                assert chat.model_extra["prompt_token_ids"] == \
                    tok.encode(text, add_special_tokens=False).ids, kwargs
            # continue_final_message: the template's text cut right after the final content
            chat = client.chat.completions.create(
                model=MODEL, max_tokens=1,
                messages=[*messages, {"role": "assistant", "content": "hel"}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False,
                            "return_token_ids": True})
            assert chat.model_extra["prompt_token_ids"] == \
                tok.encode(on + "hel", add_special_tokens=False).ids
    finally:
        executor.shutdown(5.0)


# ---- 3. errors and routes -----------------------------------------------------------------------
def _openai_error(r: httpx.Response, status: int) -> dict:
    """The OpenAI-shaped error of ``r``, checked to be consistent with its HTTP status."""
    assert r.status_code == status, r.text
    body = r.json()
    assert "detail" not in body, body
    assert set(body["error"]) >= {"message", "type", "code", "param"}, body
    assert body["status"]["http_status"] == status, body
    return body["error"]


@pytest.mark.parametrize(("method", "path", "status"), [
    ("GET", "/v1/nothing", 404), ("POST", "/v2/completions", 404), ("GET", "/", 404),
    ("GET", "/v1/completions", 405), ("DELETE", "/v1/chat/completions", 405),
    ("POST", "/v1/models", 405), ("PUT", "/health", 405)])
def test_unknown_routes_and_wrong_methods_answer_openai_shaped_errors(live, method, path,
                                                                      status):
    server, _, _ = live
    r = httpx.request(method, f"{server.url}{path}", timeout=30)
    error = _openai_error(r, status)
    assert error["type"] == "invalid_request_error" and path in error["message"]
    if status == 405:
        assert r.headers["allow"]


def test_models_retrieve_by_id_and_404_for_an_unknown_one(live):
    server, client, _ = live
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "calexec"
    assert client.models.retrieve("qwen3_synthetic").id == "qwen3_synthetic"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("gpt-4o")
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    _openai_error(httpx.get(f"{server.url}/v1/models/org/gpt-4o", timeout=30), 404)


def test_the_401_body_says_401_throughout(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(api_key="s3cret"))
    try:
        with LiveServer(app) as server:
            for path in ("/v1/completions", "/v1/chat/completions", "/tokenize"):
                r = httpx.post(f"{server.url}{path}", json={"prompt": "x"}, timeout=30)
                error = _openai_error(r, 401)
                assert error["type"] == "authentication_error"
                assert error["code"] == "invalid_api_key"
            r = httpx.get(f"{server.url}/v1/models/{MODEL}", timeout=30)
            assert _openai_error(r, 401)["code"] == "invalid_api_key"
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": [1] * 40961, "max_tokens": 1}, "prompt"),
    ({"prompt": [1, 2], "max_tokens": 40959}, "max_tokens")])
def test_a_context_overflow_is_context_length_exceeded(tmp_path, body, param):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(max_body_bytes=1 << 20))
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=MODEL, **body)
            error = err.value.body
            assert error["code"] == "context_length_exceeded" and error["param"] == param
            assert "maximum context length is 40960 tokens" in error["message"]
            assert str(len(body["prompt"])) in error["message"]
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize",
                                  "/detokenize"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_non_json_content_type_is_415(live, path, content_type):
    server, _, _ = live
    r = httpx.post(f"{server.url}{path}", content=b'{"prompt": [1], "tokens": [1]}',
                   headers={"content-type": content_type}, timeout=30)
    error = _openai_error(r, 415)
    assert content_type.split(";")[0] in error["message"] and "application/json" in error["message"]


def test_admin_reload_with_a_non_json_content_type_is_415(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(admin_token="t0ken"))
    try:
        with LiveServer(app) as server:
            r = httpx.post(f"{server.url}/admin/reload", content=b"calbin=/x",
                           headers={"authorization": "Bearer t0ken",
                                    "content-type": "application/x-www-form-urlencoded"},
                           timeout=30)
            assert "application/json" in _openai_error(r, 415)["message"]
            assert executor.state == "Ready"
    finally:
        executor.shutdown(5.0)


def test_json_content_types_are_accepted(live):
    server, _, _ = live
    for headers in ({"content-type": "application/json; charset=utf-8"},
                    {"content-type": "Application/JSON"}, {}):
        r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": [1], "max_tokens": 1}',
                       headers=headers, timeout=30)
        assert r.status_code == 200, (headers, r.text)


def _events(server, path: str, body: dict) -> list[dict]:
    import json
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("options", "usage_chunks"), [
    (None, 0), ({}, 0), ({"include_usage": False}, 0), ({"include_usage": True}, 1)])
def test_a_stream_carries_usage_once_on_a_final_chunk_only_when_asked(live, path, options,
                                                                      usage_chunks):
    server, _, _ = live
    body = {"model": MODEL, "max_tokens": 3, "stream": True,
            **({"prompt": [4, 5]} if path == "/v1/completions" else
               {"messages": [{"role": "user", "content": "hi"}]})}
    if options is not None:
        body["stream_options"] = options
    events = _events(server, path, body)
    with_usage = [i for i, e in enumerate(events) if e.get("usage")]
    assert len(with_usage) == usage_chunks, events
    if usage_chunks:
        assert with_usage == [len(events) - 1] and events[-1]["choices"] == []
        assert events[-1]["usage"]["completion_tokens"] == 3


def test_tokenize_takes_vllms_and_llama_servers_forms(live):
    server, _, service = live
    tok = service.tokenizer

    def tokenize(body: dict) -> dict:
        r = httpx.post(f"{server.url}/tokenize", json=body, timeout=30)
        assert r.status_code == 200, (body, r.text)
        return r.json()
    messages = [{"role": "user", "content": "hi"}]
    assert tokenize({"messages": messages, "add_generation_prompt": False})["tokens"] == \
        tokenizer.encode("user: hi\n")
    assert tokenize({"messages": messages, "add_generation_prompt": True})["tokens"] == \
        tokenizer.encode("user: hi\nassistant:")
    strs = tokenize({"prompt": "héllo", "return_token_strs": True})
    assert strs["token_strs"] == [tok.token_text(t) for t in tokenizer.encode("héllo")]
    assert strs["token_strs"] != strs["tokens"]
    assert tokenize({"prompt": "hi", "return_token_strs": None})["token_strs"] is None
    # llama-server: {"content"}, optional "add_special" and "with_pieces"
    assert tokenize({"content": "héllo"})["tokens"] == tokenizer.encode("héllo")
    assert tokenize({"content": "ab", "add_special": True})["tokens"] == tokenizer.encode("ab")
    pieces = tokenize({"content": "ab", "with_pieces": True})["tokens"]
    assert pieces == [{"id": t, "piece": tok.token_text(t)} for t in tokenizer.encode("ab")]
    for bad in ({"content": "a", "prompt": "b"}, {}, {"content": 5}):
        r = httpx.post(f"{server.url}/tokenize", json=bad, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] in ("prompt", "content"), r.text


# ---- CORS (off by default) ------------------------------------------------------------------------
PREFLIGHT = {"origin": "http://app.example:3000", "access-control-request-method": "POST",
             "access-control-request-headers": "authorization, content-type"}


def test_cors_is_off_by_default(live):
    server, _, _ = live
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=PREFLIGHT, timeout=30)
    _openai_error(r, 405)
    r = httpx.get(f"{server.url}/v1/models", headers={"origin": PREFLIGHT["origin"]}, timeout=30)
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_cors_origins_answer_preflights_and_mark_responses(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(cors_origins=("http://app.example:3000",)))
    try:
        with LiveServer(app) as server:
            r = httpx.options(f"{server.url}/v1/chat/completions", headers=PREFLIGHT,
                              timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] == PREFLIGHT["origin"]
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "authorization" in r.headers["access-control-allow-headers"].lower()
            r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1], "max_tokens": 1},
                           headers={"origin": PREFLIGHT["origin"]}, timeout=30)
            assert r.status_code == 200
            assert r.headers["access-control-allow-origin"] == PREFLIGHT["origin"]
            # a page's script may read the request id (and Retry-After)
            exposed = r.headers["access-control-expose-headers"].lower().split(",")
            assert {"x-request-id", "retry-after"} <= {h.strip() for h in exposed}, exposed
            assert r.headers["x-request-id"] == r.json()["id"]
            other = {**PREFLIGHT, "origin": "http://evil.example"}
            r = httpx.options(f"{server.url}/v1/chat/completions", headers=other, timeout=30)
            assert "access-control-allow-origin" not in r.headers
            error = _openai_error(r, 400)  # OpenAI-shaped, not Starlette's plain text
            assert error["param"] == "origin" and "origin" in error["message"]
    finally:
        executor.shutdown(5.0)



def test_cors_origin_star_admits_a_page_of_any_origin(tmp_path):
    """``--cors-origin '*'`` is accepted (docs/server.md): any page may call."""
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(cors_origins=("*",)))
    try:
        with LiveServer(app) as server:
            other = {**PREFLIGHT, "origin": "http://any.example"}
            r = httpx.options(f"{server.url}/v1/chat/completions", headers=other, timeout=30)
            assert r.status_code == 200, r.text
            assert r.headers["access-control-allow-origin"] in ("*", other["origin"])
    finally:
        executor.shutdown(5.0)

@pytest.mark.parametrize("origin", ["app.example", "ftp://x", "http://a.example/path", ""])
def test_a_cors_origin_that_can_never_match_is_refused_naming_it(origin):
    with pytest.raises(ValueError, match="cors_origins"):
        ServerConfig(cors_origins=(origin,))


def test_serve_refuses_a_bad_cors_origin_in_one_line():
    from test_cli import calexec, one_line
    done = calexec("serve", "--once", "--cors-origin", "app.example")
    assert done.returncode == 2
    assert "--cors-origin='app.example'" in one_line(done.stderr)


# ---- vLLM's min_tokens, ignore_eos, allowed_token_ids ---------------------------------------------
def test_min_tokens_and_allowed_token_ids_equal_the_reference_computation():
    raw = np.random.default_rng(3).normal(0, 3, 64).astype(np.float32)
    params = SamplingParams(min_tokens=2, end_token_ids=(7,), stop_token_ids=(9,),
                            allowed_token_ids=(7, 9, 20, 33))
    for output, held in (([], {7, 9}), ([1], {7, 9}), ([1, 2], set())):
        want = np.full(64, -np.inf)
        for t in {7, 9, 20, 33} - held:
            want[t] = raw[t]
        np.testing.assert_array_equal(sampling.process(raw, params, [], output), want)
    # and the draw stays among the allowed, unheld tokens
    sampled = {sampling.pick(raw, attrs.evolve(params, temperature=1.0, seed=4), i, None, [],
                             [])[0] for i in range(50)}
    assert sampled <= {20, 33}


def _oracle_rows_choice(prompt: list[int], n: int, choose) -> list[int]:
    """Greedy over the oracle's FP32 rows with ``choose(row, output) -> token``."""
    from calexec.drivers.synthetic import calbin, oracle
    seq = oracle.OracleSequence(calbin.DEFAULT_SEED)
    seq.run(prompt)
    out: list[int] = []
    for _ in range(n):
        token = choose(oracle.bf16_to_f32(oracle.logits_bf16(seq.states[-1])), out)
        out.append(token)
        seq.run([token])
    return out


def test_ignore_eos_min_tokens_and_allowed_token_ids_end_to_end(tmp_path):
    prompt = [40, 41, 42]
    greedy = oracle_tokens(prompt, 4)
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(end_token_id=greedy[0]))
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            body = dict(model=MODEL, prompt=prompt, max_tokens=4)
            stopped = client.completions.create(**body)
            # the end token is listed (generated, as vLLM lists it), its text not written
            assert _ids(stopped) == greedy[:1] and stopped.choices[0].text == ""
            assert stopped.choices[0].finish_reason == "stop"
            # ignore_eos: the end token is generated and the generation goes on (greedy ahead)
            done = client.completions.create(**body, extra_body={"ignore_eos": True})
            assert _ids(done) == greedy and done.choices[0].finish_reason == "length"
            # min_tokens: the end token cannot be chosen for the first 2 tokens
            def held(row, out):
                row = row.copy()
                if len(out) < 2:
                    row[greedy[0]] = -np.inf
                return int(np.argmax(row))
            want = _oracle_rows_choice(prompt, 4, held)
            done = client.completions.create(**body, extra_body={"min_tokens": 2})
            if greedy[0] in want[2:]:  # from the third token on, the end token ends it
                want = want[:want.index(greedy[0], 2) + 1]
            assert _ids(done) == want and want[0] != greedy[0]
            allowed = [5, 6, 7, 300]
            want = _oracle_rows_choice(prompt, 4, lambda row, out: allowed[int(np.argmax(
                row[allowed]))])
            done = client.completions.create(**body, extra_body={"allowed_token_ids": allowed})
            assert _ids(done) == want and set(want) <= set(allowed)
    finally:
        executor.shutdown(5.0)


@pytest.mark.parametrize(("field", "value"), [
    ("min_tokens", -1), ("allowed_token_ids", []), ("allowed_token_ids", [1, VOCAB]),
    ("ignore_eos", "yes")])
def test_bad_vllm_token_fields_are_a_400_naming_them(live, field, value):
    server, _, _ = live
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": [1], "max_tokens": 1, field: value}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


# ---- vLLM's include_stop_str_in_output, truncate_prompt_tokens, add_special_tokens ----------------
def test_include_stop_str_in_output_keeps_the_stop_string(live):
    _, client, _ = live
    prompt = [41, 42, 43]
    greedy = oracle_tokens(prompt, 6)
    body = dict(model=MODEL, prompt=prompt, max_tokens=6, stop=["zz", f"<{greedy[2]}>"],
                extra_body={"include_stop_str_in_output": True})
    done = client.completions.create(**body)
    assert done.choices[0].text == tokenizer.decode(greedy[:3])
    assert done.choices[0].finish_reason == "stop"
    pieces = [c.choices[0].text for c in client.completions.create(stream=True, **body)]
    assert "".join(pieces) == done.choices[0].text
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                      stop=f"<{greedy[2]}>")
    assert plain.choices[0].text == tokenizer.decode(greedy[:2])


def test_truncate_prompt_tokens_keeps_the_last_k(live):
    server, client, _ = live
    prompt = list(range(100, 110))
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True,
                                     extra_body={"truncate_prompt_tokens": 3})
    assert done.usage.prompt_tokens == 3
    assert _ids(done) == oracle_tokens(prompt[-3:], 3)
    assert done.choices[0].text.startswith(tokenizer.decode(prompt[-3:]))
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == 10
    chat = client.chat.completions.create(model=MODEL, max_tokens=1,
                                          messages=[{"role": "user", "content": "hello"}],
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    r = httpx.post(f"{server.url}/v1/completions",
                   json={"prompt": [1], "max_tokens": 1, "truncate_prompt_tokens": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens"


def test_add_special_tokens_defaults_true_for_completions_false_for_chat(tmp_path):
    path = bos_tokenizer(tmp_path / "tokenizer.json")
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(path)))
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)

            def completion_ids(**extra) -> list[int]:
                done = client.completions.create(model=MODEL, prompt="hello", max_tokens=1,
                                                 extra_body={"return_token_ids": True, **extra})
                return done.choices[0].model_extra["prompt_token_ids"]

            def chat_ids(**extra) -> list[int]:
                done = client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello"}],
                    max_tokens=1, extra_body={"return_token_ids": True, **extra})
                return done.model_extra["prompt_token_ids"]
            assert completion_ids() == [1, 5]
            assert completion_ids(add_special_tokens=False) == [5]
            assert chat_ids()[0] != 1
            assert chat_ids(add_special_tokens=True) == [1, *chat_ids()]
    finally:
        executor.shutdown(5.0)


# ---- vLLM fields that cannot be honoured here: refused by name, with the reason -------------------
VLLM_REFUSED = [
    ("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("guided_choice", ["a"]),
    ("guided_grammar", "root ::= 'a'"), ("guided_decoding_backend", "xgrammar"),
    ("guided_whitespace_pattern", " "), ("structured_outputs", {"json": {}}),
    ("use_beam_search", True), ("length_penalty", 0.5),
    ("bad_words", ["x"]), ("priority", 1), ("skip_special_tokens", False),
    ("spaces_between_special_tokens", False), ("return_tokens_as_token_ids", True),
    ("logits_processors", ["x"]), ("kv_transfer_params", {}), ("vllm_xargs", {}),
    ("response_format", {"type": "grammar"})]
VLLM_NEUTRAL = {"guided_json": None, "prompt_logprobs": None, "use_beam_search": False,
                "length_penalty": 1.0, "bad_words": [], "priority": 0,
                "skip_special_tokens": True, "spaces_between_special_tokens": True,
                "return_tokens_as_token_ids": False, "request_id": "r-1", "cache_salt": "s"}


@pytest.mark.parametrize(("field", "value"), [
    *VLLM_REFUSED, ("prompt_embeds", "AAAA"),
    ("chat:continue_final_message", True), ("chat:echo", True), ("chat:prompt_logprobs", 1), ("chat:documents", []),
    ("chat:chat_template", "{{ messages }}"), ("chat:mm_processor_kwargs", {})])
def test_vllm_fields_that_cannot_be_honoured_are_refused_by_name_not_as_unknown(live, field,
                                                                                value):
    server, _, _ = live
    chat = field.startswith("chat:")
    field = field.removeprefix("chat:")
    path, body = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
                  if chat else ("/v1/completions", {"prompt": [1]}))
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1, field: value},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "unknown parameter" not in error["message"], error


def test_neutral_values_of_vllm_fields_are_accepted(live):
    server, _, _ = live
    for path, body in (("/v1/completions", {"prompt": [1], "echo": True}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                 "echo": False,
                                                 "continue_final_message": False})):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1, **VLLM_NEUTRAL},
                       timeout=30)
        assert r.status_code == 200, r.text


def test_continue_final_message_continues_the_assistants_message(live):
    server, client, _ = live
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure: {"}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    prompt = tokenizer.encode("user: hi\nassistant: Sure: {")
    assert chat.usage.prompt_tokens == len(prompt)
    assert chat.choices[0].message.content == tokenizer.decode(oracle_tokens(prompt, 3))
    for extra, body_messages in (({"continue_final_message": True}, messages),
                                 ({"continue_final_message": True,
                                   "add_generation_prompt": False}, messages[:1])):
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=30,
                       json={"messages": body_messages, "max_tokens": 1, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(("field", "value"), [("request_id", "req-7"), ("cache_salt", "s1")])
def test_vllm_metadata_fields_are_accepted_and_ignored(live, field, value):
    """vLLM's ``request_id`` and ``cache_salt`` (docs/server.md: I): 200, the same tokens."""
    server, _, _ = live
    for path, body in (("/v1/completions", {"prompt": [1, 2]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2, field: value},
                       timeout=30)
        plain = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == plain.json()["choices"][0]["token_ids"]
