"""The OpenAI surface (issue 15 §3-§4) through the official ``openai`` client on a loopback
server: models.list(), completions, chat, streaming with usage, seeded sampling, stop strings,
logprobs, every refused parameter a 400 naming it, 404 for a wrong model, the API key, the
/tokenize and /detokenize bodies, and a Hugging Face tokenizer.json built here (nothing is
downloaded)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.serving.server import ServerConfig, create_app
from test_server_support import (
    LiveServer,
    live_fixture,  # noqa: F401 - the fixture `live`
    metric_value,
    oracle_tokens,
    started_executor,
    wait_for,
)

MODEL = "calexec-qwen3-synthetic"


def _tokens(client, **body):
    done = client.completions.create(model=MODEL, **body)
    return done.choices[0].model_extra["token_ids"]


# ---- models, completions, chat ------------------------------------------------------------
def test_models_list_names_the_served_model_and_the_manifest_name(live):
    _, client, _ = live
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL, "qwen3_synthetic"]
    # both names are accepted in requests
    done = client.completions.create(model="qwen3_synthetic", prompt=[1, 2], max_tokens=1)
    assert done.model == MODEL


def test_temperature_zero_or_absent_is_the_greedy_oracle(live):
    _, client, _ = live
    prompt = [21, 22, 23]
    expected = oracle_tokens(prompt, 6)
    assert _tokens(client, prompt=prompt, max_tokens=6) == expected
    assert _tokens(client, prompt=prompt, max_tokens=6, temperature=0, seed=11) == expected


def test_seeded_sampling_is_reproducible(live):
    _, client, _ = live
    body = dict(prompt=[31, 32, 33], max_tokens=8, temperature=1.0)
    first = _tokens(client, seed=1234, **body)
    assert _tokens(client, seed=1234, **body) == first
    assert _tokens(client, seed=1234, stream=False, top_p=1.0, **body) == first
    others = [_tokens(client, seed=s, **body) for s in (1, 2, 3)]
    assert any(o != first for o in others)  # another seed may differ: here some does
    assert first != oracle_tokens([31, 32, 33], 8)  # it is not the greedy choice
    # streaming draws the same tokens for the same seed
    chunks = client.completions.create(model=MODEL, seed=1234, stream=True, **body)
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == first


def test_chat_completion_plain_template_and_stream(live):
    _, client, service = live
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    done = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5)
    rendered = "system: be brief\nuser: hi\nassistant:"
    prompt = tokenizer.encode(rendered)
    expected = oracle_tokens(prompt, 5)
    assert done.object == "chat.completion"
    assert done.choices[0].message.role == "assistant"
    assert done.choices[0].message.content == tokenizer.decode(expected)
    assert done.usage.prompt_tokens == len(prompt) and done.usage.completion_tokens == 5
    stream = client.chat.completions.create(model=MODEL, messages=messages,
                                            max_completion_tokens=5, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    # the client stops reading at [DONE]; the server frees the sequence as the response ends
    # (after the decode stream's pre-armed job is released): bounded wait, not a sleep
    wait_for(lambda: service.sequences.in_use == 0, what="sequence released after the stream")


def test_completion_stream_usage_chunk(live):
    _, client, _ = live
    chunks = list(client.completions.create(model=MODEL, prompt=[4, 5], max_tokens=3,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == 2 and chunks[-1].usage.completion_tokens == 3
    # include_usage false (or absent): no usage chunk, no chunk carries usage
    for options in ({"include_usage": False}, None):
        plain = list(client.completions.create(model=MODEL, prompt=[4, 5], max_tokens=3,
                                               stream=True, stream_options=options))
        assert plain[-1].choices and all(c.usage is None for c in plain), options


def test_stop_strings_cut_the_text_also_when_streaming(live):
    _, client, _ = live
    prompt = [41, 42, 43]
    greedy = oracle_tokens(prompt, 6)
    stop = f"<{greedy[2]}>"
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stop=stop)
    assert done.choices[0].text == tokenizer.decode(greedy[:2])
    assert done.choices[0].finish_reason == "stop"
    assert done.usage.completion_tokens == 3  # the token that completed the stop string
    pieces = [c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=6, stop=["zz", stop], stream=True)]
    assert "".join(pieces) == done.choices[0].text
    # a stop string spanning two tokens
    span = f"{greedy[0]}><{greedy[1]}"
    two = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, stop=[span])
    assert two.choices[0].text == "<" and two.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_generation(live):
    _, client, _ = live
    prompt = [51, 52]
    greedy = oracle_tokens(prompt, 5)
    done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                     extra_body={"stop_token_ids": [greedy[3]]})
    # the stop token was generated: listed and counted (as vLLM), its text not written
    assert done.choices[0].model_extra["token_ids"] == greedy[:4]
    assert done.choices[0].text == tokenizer.decode(greedy[:3])
    assert done.choices[0].finish_reason == "stop"


def test_echo_prepends_the_prompt(live):
    _, client, _ = live
    done = client.completions.create(model=MODEL, prompt="abc", max_tokens=2, echo=True)
    assert done.choices[0].text.startswith("abc") and len(done.choices[0].text) > 3
    chunks = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=2,
                                            echo=True, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == done.choices[0].text


def test_echo_with_no_generated_token_keeps_the_prompt_when_streaming(live):
    """Issue 24 item 7: the first greedy token is a stop token, so nothing is generated; the
    whole answer is the echoed prompt, and the stream used to lose it (its only chunk is the
    last one, which did not carry the echo)."""
    _, client, _ = live
    first = oracle_tokens(tokenizer.encode("abc"), 1)[0]
    body = dict(model=MODEL, prompt="abc", max_tokens=4, echo=True,
                extra_body={"stop_token_ids": [first]})
    done = client.completions.create(**body)
    assert done.choices[0].text == "abc" and done.usage.completion_tokens == 1  # the stop token
    assert done.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(stream=True, **body))
    assert "".join(c.choices[0].text for c in chunks) == "abc"
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_logprobs_shapes(live):
    _, client, _ = live
    done = client.completions.create(model=MODEL, prompt=[61, 62], max_tokens=4, logprobs=3)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 3 and top for top in lp.top_logprobs)
    assert all(x <= 0 for x in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(x) for top, x in
               zip(lp.top_logprobs, lp.token_logprobs))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "x"}],
                                          max_tokens=3, logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.bytes == list(c.token.encode("utf-8")) for c in content)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                    "content": "x"}],
                                            max_tokens=3, logprobs=True, top_logprobs=2,
                                            stream=True)
    streamed = [e for c in stream if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [c.token for c in content]


def test_streamed_text_offsets_equal_the_whole_answers_when_a_stop_string_holds_text(live):
    """Issue 24 item 7: "<g1>" could begin the stop string "<g1>zz", so it is held back and
    sent with the next token's chunk; the streamed ``text_offset`` counted the text sent so
    far and fell behind the non-streamed one from there on."""
    _, client, _ = live
    prompt = [41, 42, 43]
    greedy = oracle_tokens(prompt, 4)
    assert greedy[2] != greedy[1]
    body = dict(model=MODEL, prompt=prompt, max_tokens=4, logprobs=1, stop=f"<{greedy[1]}>zz")
    whole = client.completions.create(**body).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **body))
    assert [c.choices[0].text for c in chunks][1] == ""  # held back: the case under test
    streamed = [at for c in chunks if c.choices[0].logprobs
                for at in c.choices[0].logprobs.text_offset]
    assert streamed == whole.text_offset
    assert whole.text_offset == [sum(len(t) for t in whole.tokens[:i]) for i in range(4)]


# ---- refusals -----------------------------------------------------------------------------
COMPLETION_REFUSED = [
    ("logit_bias", {"5": 101}), ("presence_penalty", 2.5), ("frequency_penalty", -2.1),
    ("best_of", 2), ("suffix", "tail"), ("n", 0), ("logprobs", 21), ("temperature", -1),
    ("temperature", 3), ("top_p", 0), ("top_k", -3), ("seed", "x"), ("max_tokens", -1),
    ("stop", [""]), ("stop_token_ids", [-1]), ("repetition_penalty", 0),
    ("stream_options", {"include_usage": True}), ("prompt_logprobs", 21)]
CHAT_REFUSED = [
    # tools and response_format are honoured (tests/test_openai_structured.py): their bad forms
    ("tools", [{"type": "custom", "custom": {"name": "f"}}]), ("tool_choice", "auto"),
    ("functions", [{"name": "f"}]), ("function_call", "auto"),
    ("response_format", {"type": "regex"}), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy"}), ("prediction", {"type": "content", "content": "x"}),
    ("reasoning_effort", "low"), ("verbosity", "low"), ("web_search_options", {}),
    ("logit_bias", {"a": 1}), ("presence_penalty", 3), ("n", 129), ("top_logprobs", 2),
    ("max_completion_tokens", 0), ("messages", [{"role": "function", "content": "x"}]),
    ("guided_json", {})]


@pytest.mark.parametrize(("field", "value"), COMPLETION_REFUSED)
def test_completions_refuse_with_a_400_naming_the_parameter(live, field, value):
    server, _, _ = live
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 2, field: value}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].split(".")[0] == field and error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("field", "value"), CHAT_REFUSED)
def test_chat_refuses_with_a_400_naming_the_parameter(live, field, value):
    server, _, _ = live
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            field: value}
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0] == field


@pytest.mark.parametrize(("path", "field", "value", "param"), [
    ("/v1/completions", "prompt", 5, "prompt"),
    ("/v1/completions", "prompt", [1, "a"], "prompt"),
    ("/v1/completions", "temperature", "hot", "temperature"),
    ("/v1/completions", "stop", 7, "stop"),
    ("/v1/chat/completions", "messages", [{"role": "user", "content": 5}], "messages.0.content"),
    ("/v1/chat/completions", "messages", [{"role": "user", "x": 1}], "messages.0.x")])
def test_a_wrong_type_names_the_field_and_value_not_the_union_branch(live, path, field, value,
                                                                     param):
    """Issue 24 item 7: ``error.param`` used to carry pydantic's union branch
    (``prompt.str``, ``temperature.int``); it is the field's path in the body, and the
    message names the value and, for a union, every accepted form."""
    server, _, _ = live
    body = {"prompt": [1, 2]} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{server.url}{path}", json={**body, "max_tokens": 1, field: value},
                   timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert error["message"].startswith(f"{param}"), error
    if field in ("prompt", "temperature", "stop"):
        assert error["message"].startswith(f"{param}={json.dumps(value)}: must be one of "), error
        assert {"prompt": "list[int]", "temperature": "float",
                "stop": "list[str]"}[field] in error["message"]


def test_neutral_values_of_refused_parameters_are_accepted(live):
    _, client, _ = live
    done = client.completions.create(model=MODEL, prompt=[1, 2], max_tokens=1, logit_bias={},
                                     presence_penalty=0, frequency_penalty=0.0, best_of=1,
                                     n=1, user="alice")
    assert done.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                                  "content": "a"}],
                                          max_tokens=1, tool_choice="none", user="bob",
                                          response_format={"type": "text"}, metadata={"k": "v"},
                                          store=False)
    assert chat.choices[0].finish_reason == "length"


def test_a_bad_prompt_in_a_batch_is_refused_naming_the_prompt(live):
    """Every prompt of a list is checked before any runs (tests/test_openai_batches.py has
    the batches themselves)."""
    _, client, service = live
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[[1, 2], [1 << 30]], max_tokens=1)
    assert err.value.body["param"] == "prompt" and "outside the vocabulary" in \
        err.value.body["message"]
    assert service.sequences.in_use == 0


def test_a_wrong_model_is_a_404_like_vllm(live):
    server, client, service = live
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=1)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    exposition = httpx.get(f"{server.url}/metrics").text
    assert metric_value(exposition, "calexec_request_failures_total",
                        {"code": "request.model_not_found"}) >= 2


# ---- tokenize / detokenize ----------------------------------------------------------------
def test_tokenize_and_detokenize_bodies(live):
    server, _, _ = live
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "prompt": "héllo"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == tokenizer.encode("héllo") and body["count"] == 6
    assert body["max_model_len"] == 40960
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": body["tokens"]})
    assert back.json() == {"prompt": "héllo"}
    chat = httpx.post(f"{server.url}/tokenize",
                      json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == tokenizer.encode("user: hi\nassistant:")
    for tokens in (["a"], [-1], [1 << 40]):
        bad = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens})
        assert bad.status_code == 400 and bad.json()["error"]["param"].startswith("tokens")


# ---- API key ------------------------------------------------------------------------------
def test_api_key_guards_the_openai_endpoints_only(tmp_path):
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(api_key="s3cret"))
    try:
        with LiveServer(app) as server:
            wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                wrong.completions.create(model=MODEL, prompt="x", max_tokens=1)
            assert err.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                wrong.models.list()
            assert httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}).status_code == 401
            # the key under another scheme than Bearer (any case) is not the API key
            for header in ("Basic s3cret", "Token s3cret", "s3cret"):
                r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": header},
                               json={"prompt": "x", "max_tokens": 1}, timeout=30)
                assert r.status_code == 401, header
            r = httpx.post(f"{server.url}/v1/completions", headers={"Authorization": "bearer s3cret"},
                           json={"prompt": "x", "max_tokens": 1}, timeout=30)
            assert r.status_code == 200, r.text
            right = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret", max_retries=0)
            assert right.completions.create(model=MODEL, prompt="x", max_tokens=1).usage
            assert [m.id for m in right.models.list()][0] == MODEL
            for path in ("/health", "/ready", "/metrics"):
                assert httpx.get(f"{server.url}{path}").status_code == 200, path
    finally:
        executor.shutdown(5.0)


# ---- a Hugging Face tokenizer.json --------------------------------------------------------
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _byte_level_bpe(text: str):
    """A byte-level BPE tokenizer (GPT-2's alphabet, as Qwen3's) trained on ``text``: nothing
    is downloaded."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text] * 20, trainer)
    return tok


def _hf_tokenizer(tmp_path):
    tok = _byte_level_bpe("hello world, hello calexec <|user|> <|assistant|>")
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "eos_token": "<|endoftext|>"}))
    return tok, path


def test_hf_tokenizer_json_serves_text_chat_and_tokenize(tmp_path):
    tok, path = _hf_tokenizer(tmp_path)
    pytest.importorskip("jinja2")
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(path)))
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            ids = tok.encode("hello world").ids
            done = client.completions.create(model=MODEL, prompt="hello world", max_tokens=3)
            assert done.usage.prompt_tokens == len(ids)
            expected = oracle_tokens(ids, 3)
            assert done.choices[0].model_extra["token_ids"] == expected
            assert done.choices[0].text == tok.decode(expected)
            messages = [{"role": "user", "content": "hello"}]
            rendered = "<|user|>hello<|endoftext|><|assistant|>"
            counted = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()
            assert counted["tokens"] == tok.encode(rendered, add_special_tokens=False).ids
            chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
            assert chat.usage.prompt_tokens == counted["count"]
            back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()
            assert back["prompt"] == "hello world"
    finally:
        executor.shutdown(5.0)


def test_hf_tokens_outside_the_calbin_vocabulary_are_a_400_naming_the_prompt(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers
    tok = tokenizers.Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 5, "world": 200000},
                                                unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(tmp_path)))  # the directory
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            assert client.completions.create(model=MODEL, prompt="hello", max_tokens=1).usage
            with pytest.raises(openai.BadRequestError) as err:
                client.completions.create(model=MODEL, prompt="hello world", max_tokens=1)
            assert err.value.body["param"] == "prompt"
            assert "prompt[1]=200000" in err.value.body["message"]
    finally:
        executor.shutdown(5.0)


def test_logprobs_bytes_with_a_byte_level_bpe_tokenizer_json(tmp_path):
    """Chat logprobs' ``bytes`` with ``--tokenizer``: a byte-level BPE tokenizer.json (GPT-2's
    alphabet, as Qwen3's and Llama 3's; trained here, nothing is downloaded) writes "é" as two
    byte tokens when it has no merge for it ("Ã" for 0xC3, "©" for 0xA9): each entry's
    ``bytes`` must be its byte, so that the client rebuilds the character by joining them, as
    OpenAI documents the field (they were U+FFFD's three: the token decoded on its own). The
    byte-level tokenizer's case: tests/test_clients_openai.py."""
    tok = _byte_level_bpe("hello world")
    tok.save(str(tmp_path / "tokenizer.json"))
    split = [tok.token_to_id("\u00c3"), tok.token_to_id("\u00a9")]
    assert tok.decode(split) == "\u00e9"
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig(tokenizer_path=str(tmp_path / "tokenizer.json")))
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0,
                                   timeout=30)
            reply = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Say \u00e9."}],
                max_tokens=6, temperature=0, logprobs=True, top_logprobs=0,
                extra_body={"allowed_token_ids": split})
    finally:
        executor.shutdown(5.0)
    ids = reply.choices[0].model_extra["token_ids"]
    assert len(ids) == 6 and set(ids) <= set(split)
    assert [entry.bytes for entry in reply.choices[0].logprobs.content] == [
        [0xC3] if token == split[0] else [0xA9] for token in ids]


def test_hf_stream_text_ends_as_decode_does_when_a_character_is_cut(tmp_path):
    """A stream (or a whole answer: the same detokenizer) cut by ``max_tokens`` or a stop
    token after the first byte of a two-byte character: ``tokenizers``' ``DecodeStream`` holds
    the byte back, and its end dropped it, so the answer's text was not the text of its
    ``token_ids`` (``tok.decode``: U+FFFD for the cut character, as the byte-level tokenizer's
    answer has). Whole characters and no cut: unchanged."""
    from calexec.drivers.serving.hf_tokenizer import HFTokenizer

    tok = _byte_level_bpe("hello world")
    tok.save(str(tmp_path / "tokenizer.json"))
    served = HFTokenizer(str(tmp_path / "tokenizer.json"))
    first, second = tok.token_to_id("\u00c3"), tok.token_to_id("\u00a9")
    hello = tok.encode("hello").ids
    for ids in (hello + [first], hello + [first, second], hello + [first, second, first],
                [first], hello, [first, first]):
        detok = served.detokenizer()
        text = "".join(detok.feed(t) for t in ids) + detok.flush()
        assert text == served.decode(ids) == tok.decode(ids), ids
    assert served.decode(hello + [first]) == "hello\ufffd"


# ---- calexec serve flags ------------------------------------------------------------------
def test_serve_once_with_api_key_and_tokenizer(tmp_path):
    from test_cli import calexec
    _, path = _hf_tokenizer(tmp_path)
    done = calexec("serve", "--once", "--api-key", "k3y", "--tokenizer", str(path))
    assert done.returncode == 0, done.stderr
    assert "Authorization: Bearer $CALEXEC_API_KEY" in done.stdout
    assert "byte-level tokenizer" not in done.stdout


@pytest.mark.parametrize(("argv", "named"), [
    (["--tokenizer", "/nonexistent/tokenizer.json"], "--tokenizer='/nonexistent/tokenizer.json'"),
    (["--api-key", " "], "--api-key is empty")])
def test_serve_flag_errors_are_one_line_exit_2(argv, named):
    from test_cli import calexec, one_line
    done = calexec("serve", "--once", *argv)
    assert done.returncode == 2
    assert named in one_line(done.stderr)


# ---- metrics ------------------------------------------------------------------------------
def test_request_metrics_carry_model_name_and_token_histograms(live):
    server, client, _ = live
    before = httpx.get(f"{server.url}/metrics").text
    labels = {"model_name": MODEL}
    n0 = metric_value(before, "calexec_request_prompt_tokens_count", labels) or 0
    s0 = metric_value(before, "calexec_request_prompt_tokens_sum", labels) or 0
    g0 = metric_value(before, "calexec_request_generation_tokens_sum", labels) or 0
    client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    after = httpx.get(f"{server.url}/metrics").text
    assert metric_value(after, "calexec_request_prompt_tokens_count", labels) == n0 + 1
    assert metric_value(after, "calexec_request_prompt_tokens_sum", labels) == s0 + 3
    assert metric_value(after, "calexec_request_generation_tokens_sum", labels) == g0 + 2
    assert metric_value(after, "calexec_requests_total", {"stream": "false", **labels}) >= 1
    assert metric_value(after, "calexec_request_success_total",
                        {"finished_reason": "length", **labels}) >= 1
    # a streamed request is counted under stream="true", not "false"
    streamed = metric_value(after, "calexec_requests_total", {"stream": "true", **labels}) or 0
    whole = metric_value(after, "calexec_requests_total", {"stream": "false", **labels})
    list(client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, stream=True))
    later = httpx.get(f"{server.url}/metrics").text
    assert metric_value(later, "calexec_requests_total", {"stream": "true", **labels}) \
        == streamed + 1
    assert metric_value(later, "calexec_requests_total", {"stream": "false", **labels}) == whole


def test_kv_usage_fraction_follows_the_running_requests(tmp_path):
    from calexec.drivers.calrt.runtime import Emulator
    executor = started_executor(tmp_path)
    app = create_app(executor, ServerConfig())
    try:
        with LiveServer(app) as server:
            def usage() -> float:
                return metric_value(httpx.get(f"{server.url}/metrics").text,
                                    "calexec_kv_cache_usage_perc")
            assert usage() == 0.0
            Emulator(executor.device).set_latency(decode_us=50_000)
            with httpx.Client(base_url=server.url, timeout=30) as http:
                with http.stream("POST", "/v1/completions", json={
                        "prompt": [1, 2, 3], "max_tokens": 100, "stream": True}) as r:
                    lines = r.iter_lines()
                    assert next(lines).startswith("data: ")  # a token: the KV is reserved
                    running = usage()
                    # keep ``lines`` alive until here: a dropped iter_lines() generator may
                    # close the response (a disconnect: the request is cancelled)
                    assert next(lines) == ""  # the end of the first event
                    assert next(lines).startswith("data: ")
            assert 0.0 < running <= 1.0
            Emulator(executor.device).set_latency(decode_us=0)
            from test_server_support import wait_for
            wait_for(lambda: usage() == 0.0, what="the KV to be released")
    finally:
        executor.shutdown(5.0)


def test_h2d_d2h_histograms_observe_measured_copies_only():
    from calexec.contracts.types import JobTimings, TaskKind
    from calexec.drivers.serving.metrics import ServerMetrics
    metrics = ServerMetrics(lambda: {}, dict)
    stamps = dict(accepted_us=1, admitted_us=2, queued_us=3, submitted_us=4, completed_us=9)
    metrics.observe_job(TaskKind.DECODE, JobTimings(**stamps))  # not measured: 0.0
    def sample(name):
        return metrics.registry.get_sample_value(name, {"kind": "decode"})

    assert sample("calexec_job_h2d_seconds_sum") == 0
    assert sample("calexec_job_h2d_seconds_count") == 0
    metrics.observe_job(TaskKind.DECODE, JobTimings(**stamps, h2d_ms=2.0, d2h_ms=0.5))
    assert metrics.registry.get_sample_value("calexec_job_h2d_seconds_count",
                                             {"kind": "decode"}) == 1
    assert sample("calexec_job_d2h_seconds_sum") == pytest.approx(0.0005)


def test_an_unseeded_request_is_reproducible_from_its_dump_record(tmp_path):
    from calexec.drivers.serving.dumpsink import DumpSink
    executor = started_executor(tmp_path)
    sink = DumpSink(tmp_path / "dump", max_bytes=1 << 20, include_content=True)
    app = create_app(executor, ServerConfig(), sink)
    try:
        with LiveServer(app) as server:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            body = dict(model=MODEL, prompt=[71, 72], max_tokens=6, temperature=1.0)
            first = client.completions.create(**body).choices[0].model_extra["token_ids"]
            assert sink.flush(10)  # (the sink's writer thread appends the records)
            records = [json.loads(line) for path in (tmp_path / "dump").iterdir()
                       for line in path.read_text().splitlines()]
            seed = records[-1]["sampling"]["seed"]
            assert isinstance(seed, int) and records[-1]["token_ids"] == first
            again = client.completions.create(seed=seed, **body)
            assert again.choices[0].model_extra["token_ids"] == first
    finally:
        executor.shutdown(5.0)
