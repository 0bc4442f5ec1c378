"""Tests ported from vLLM's OpenAI-server suite (vllm-project/vllm, tests/entrypoints/openai/),
issue 27: the ones that apply to this server, run against a loopback server on the synthetic
model through the official ``openai`` client (vLLM's tests use the same client). Each test
names its source file and test. Adapted: the model name, expected text (the synthetic model's
tokens are checked against the numpy oracle where vLLM checks lengths or equality), vLLM's
async client (the sync one here), sizes (kept CI-small). Not ported: LoRA, multimodal,
prompt embeds, beam search, ``prompt_logprobs`` (vLLM extensions this server refuses by name,
docs/server.md; ``continuous_usage_stats``, served since stop 63, has its own tests in
test_clients_continuous_usage.py), structured outputs (the structured-outputs
branch brings its own tests), server-process flags.
"""

from __future__ import annotations

import concurrent.futures

import httpx
import openai
import pytest

from calexec.drivers.serving import byte_tokenizer as tokenizer
from calexec.drivers.synthetic.calbin import VOCAB
from test_server_support import MODEL, live_fixture, oracle_tokens  # noqa: F401 - `live`


def _greedy_text(prompt: list[int], n: int) -> str:
    return tokenizer.decode(oracle_tokens(prompt, n))


# ---- basic/test_basic.py ----------------------------------------------------------------------
def test_check_health(live):
    # vllm tests/entrypoints/openai/basic/test_basic.py::test_check_health
    server, _, _ = live
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_request_wrong_content_type(live):
    # vllm tests/entrypoints/openai/basic/test_basic.py::test_request_wrong_content_type
    _, client, _ = live
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(
            messages=[{"role": "user", "content": "Write a long story"}], model=MODEL,
            max_tokens=10, extra_headers={"Content-Type": "application/x-www-form-urlencoded"})


def test_request_cancellation(live):
    # vllm tests/entrypoints/openai/basic/test_basic.py::test_request_cancellation
    # (vLLM: 200 requests of 10000 tokens with a 0.5 s client timeout; here 12 of 400 tokens
    # with 0.3 s: each takes seconds on the emulated device, so every one times out and the
    # server must cancel them, or the request after them would wait behind their tokens)
    server, _, service = live
    impatient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                              timeout=0.3)
    chat_input = [{"role": "user", "content": "Write a long story"}]

    def one():
        with pytest.raises(openai.APITimeoutError):
            impatient.chat.completions.create(messages=chat_input, model=MODEL,
                                              max_tokens=400, extra_body={"min_tokens": 400})

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        for future in [pool.submit(one) for _ in range(12)]:
            future.result(timeout=30)
    patient = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                            timeout=5)
    response = patient.chat.completions.create(messages=chat_input, model=MODEL, max_tokens=10)
    assert len(response.choices) == 1


# ---- completion/test_completion.py ------------------------------------------------------------
def test_single_completion(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_single_completion
    _, client, _ = live
    prompt = "Hello, my name is"
    completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                           temperature=0.0)
    assert completion.id is not None
    assert completion.choices is not None and len(completion.choices) == 1
    choice = completion.choices[0]
    assert choice.text == _greedy_text(tokenizer.encode(prompt), 5)  # vLLM: len >= 5
    assert choice.finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 5
    assert completion.usage.prompt_tokens == len(tokenizer.encode(prompt))  # vLLM: 6
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 5
    # test using token IDs
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 1
    assert getattr(completion.choices[0], "prompt_logprobs", None) is None


def test_no_logprobs(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_no_logprobs
    _, client, _ = live
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=None)
    assert completion.choices[0].logprobs is None


def test_zero_logprobs(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_zero_logprobs
    _, client, _ = live
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=0)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert len(choice.logprobs.top_logprobs[0]) == 1


def test_some_logprobs(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_some_logprobs
    _, client, _ = live
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=5)
    choice = completion.choices[0]
    assert choice.logprobs is not None
    assert choice.logprobs.token_logprobs is not None
    assert choice.logprobs.top_logprobs is not None
    assert 5 <= len(choice.logprobs.top_logprobs[0]) <= 6


def test_too_many_completion_logprobs(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::
    #   test_too_many_completion_logprobs
    _, client, _ = live
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                  temperature=0.0, logprobs=21)
    with pytest.raises((openai.BadRequestError, openai.APIError)):
        stream = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0, logprobs=30, stream=True)
        for _ in stream:
            pass
    # the server should still work afterwards
    completion = client.completions.create(model=MODEL, prompt=[0, 0, 0, 0, 0], max_tokens=5,
                                           temperature=0.0)
    assert len(completion.choices[0].text) >= 0


def test_completion_streaming(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_completion_streaming
    _, client, _ = live
    prompt = "What is an LLM?"
    single = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                       temperature=0.0)
    single_output = single.choices[0].text
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                       temperature=0.0, stream=True)
    chunks: list[str] = []
    finish_reason_count = 0
    for chunk in stream:
        chunks.append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    # finish reason should only return in last block
    assert finish_reason_count == 1
    assert chunk.choices[0].finish_reason == "length"
    assert "".join(chunks) == single_output


@pytest.mark.xfail(strict=True, reason="known difference: vLLM sends the finish_reason on the "
                   "last token's chunk; this server (as OpenAI's own completions stream) "
                   "sends it on a chunk of its own whose text is what a stop string held "
                   "back, usually empty (docs/server.md)")
def test_completion_streaming_last_chunk_carries_text(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_completion_streaming,
    # its `assert chunk.choices[0].text` on the finish chunk
    _, client, _ = live
    stream = client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=5,
                                       temperature=0.0, stream=True)
    chunk = list(stream)[-1]
    assert chunk.choices[0].finish_reason == "length"
    assert chunk.choices[0].text


def _n_choices(client, stream: bool):
    """n=3 sampled choices of one prompt, 50 tokens at most. vLLM's model ends some choices
    early with its EOS; the synthetic model's random tokens almost never reach the end token,
    so the stop string ``<12`` (the rendering of every token id starting with 12) ends
    each choice at a different point."""
    return client.completions.create(model=MODEL, prompt="What is an LLM?", max_tokens=50,
                                     n=3, temperature=1.0, stream=stream, seed=42, stop=["<12"],
                                     **({} if stream else {"logprobs": 0}))


def test_parallel_no_streaming(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_parallel_no_streaming
    _, client, _ = live
    n = 3
    completion = _n_choices(client, stream=False)
    assert len(completion.choices) == n
    completion_repeats: dict[str, int] = {}
    output_token_lengths = set()
    for idx, choice in enumerate(completion.choices):
        assert choice.index == idx
        assert choice.finish_reason is not None
        completion_repeats[choice.text] = completion_repeats.get(choice.text, 0) + 1
        output_token_lengths.add(len(choice.logprobs.tokens))
    # subrequests finished at different times
    assert len(output_token_lengths) > 1
    # n unique completions
    assert len(completion_repeats) == n, completion_repeats


def test_parallel_streaming(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_parallel_streaming
    _, client, _ = live
    n, max_tokens = 3, 50
    chunks: list[list[str]] = [[] for _ in range(n)]
    finish_reason_count = 0
    for chunk in _n_choices(client, stream=True):
        index = chunk.choices[0].index
        chunks[index].append(chunk.choices[0].text)
        if chunk.choices[0].finish_reason is not None:
            finish_reason_count += 1
    assert finish_reason_count == n
    completion_repeats: dict[str, int] = {}
    chunk_lengths = set()
    for chunk_list in chunks:
        chunk_lengths.add(len(chunk_list))
        assert len(chunk_list) <= max_tokens
        text = "".join(chunk_list)
        completion_repeats[text] = completion_repeats.get(text, 0) + 1
    assert len(chunk_lengths) > 1
    assert len(completion_repeats) == n, completion_repeats


def test_completion_stream_options(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::
    #   test_completion_stream_options (without continuous_usage_stats: its checks are in
    #   test_clients_continuous_usage.py)
    _, client, _ = live
    prompt = "What is the capital of France?"
    body = dict(model=MODEL, prompt=prompt, max_tokens=5, temperature=0.0)
    for chunk in client.completions.create(**body, stream=True,
                                           stream_options={"include_usage": False}):
        assert chunk.usage is None
    stream = client.completions.create(**body, stream=True,
                                       stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices[0].finish_reason is None:
            assert chunk.usage is None
        else:
            assert chunk.usage is None
            final_chunk = next(stream)
            assert final_chunk.usage is not None
            assert final_chunk.usage.prompt_tokens > 0
            assert final_chunk.usage.completion_tokens > 0
            assert final_chunk.usage.total_tokens == (
                final_chunk.usage.prompt_tokens + final_chunk.usage.completion_tokens)
            assert final_chunk.choices == []
    for chunk in client.completions.create(**body, stream=True, stream_options={}):
        assert chunk.usage is None
    for options in ({"include_usage": None}, {"include_usage": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**body, stream=False, stream_options=options)


def test_batch_completions(live):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_batch_completions
    # (without its n=2 beam-search part: beam search is refused here)
    _, client, _ = live
    for prompts in (["Hello, my name is"] * 2, [[0, 0, 0, 0, 0]] * 2):
        batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                          temperature=0.0)
        assert len(batch.choices) == 2
        assert batch.choices[0].text == batch.choices[1].text
        stream = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5,
                                           temperature=0.0, stream=True)
        texts = [""] * 2
        for chunk in stream:
            assert len(chunk.choices) == 1
            choice = chunk.choices[0]
            texts[choice.index] += choice.text
        assert texts[0] == texts[1]


@pytest.mark.parametrize("logprobs_arg", [1, 0])
def test_echo_logprob_completion(live, logprobs_arg):
    # vllm tests/entrypoints/openai/completion/test_completion.py::test_echo_logprob_completion
    # (needs prompt logprobs: issue 27's echo-logprobs branch; a 400 without it)
    _, client, _ = live
    for prompt in ("Hello, my name is", [0, 0, 0, 0, 0]):
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5,
                                               temperature=0.0, echo=True,
                                               logprobs=logprobs_arg)
        prompt_text = tokenizer.decode(prompt) if isinstance(prompt, list) else prompt
        assert completion.choices[0].text.startswith(prompt_text)
        logprobs = completion.choices[0].logprobs
        assert logprobs is not None
        assert len(logprobs.text_offset) > 5
        assert len(logprobs.token_logprobs) > 5 and logprobs.token_logprobs[0] is None
        assert len(logprobs.top_logprobs) > 5 and logprobs.top_logprobs[0] is None
        for top_logprobs in logprobs.top_logprobs[1:]:
            assert max(logprobs_arg, 1) <= len(top_logprobs) <= logprobs_arg + 1
        assert len(logprobs.tokens) > 5


# ---- completion/test_prompt_validation.py -----------------------------------------------------
def test_out_of_vocab_token_ids(live):
    # vllm tests/entrypoints/openai/completion/test_prompt_validation.py::
    #   test_out_of_vocab_token_ids
    _, client, _ = live
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[999999], max_tokens=5, temperature=0.0)


def test_empty_prompt_list_rejected(live):
    # vllm tests/entrypoints/openai/completion/test_empty_prompt_list.py::
    #   test_empty_prompt_list_rejected (vLLM checks its request type; here over HTTP)
    _, client, _ = live
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[], max_tokens=5)


# ---- chat_completion/test_chat_logit_bias_validation.py -----------------------------------------
def test_chat_logit_bias_valid(live):
    # vllm .../chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_valid
    _, client, _ = live
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Testing valid logit bias"}],
        max_tokens=5, logit_bias={str(VOCAB - 1): 1.0})
    assert completion.choices[0].message.content is not None


def test_chat_logit_bias_invalid(live):
    # vllm .../chat_completion/test_chat_logit_bias_validation.py::test_chat_logit_bias_invalid
    _, client, _ = live
    invalid_token_id = VOCAB + 1
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing invalid logit bias"}],
            max_tokens=5, logit_bias={str(invalid_token_id): 1.0})
    assert excinfo.value.status_code == 400
    assert str(invalid_token_id) in str(excinfo.value)
    assert str(VOCAB) in str(excinfo.value)


def test_chat_logit_bias_non_integer_key(live):
    # vllm .../chat_completion/test_chat_logit_bias_validation.py::
    #   test_chat_logit_bias_non_integer_key
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing invalid key"}],
            max_tokens=5, logit_bias={"not_a_token_id": 50})
    assert excinfo.value.status_code == 400
    assert "not_a_token_id" in str(excinfo.value)
    assert "logit_bias" in str(excinfo.value)


def test_chat_logit_bias_non_numeric_value(live):
    # vllm .../chat_completion/test_chat_logit_bias_validation.py::
    #   test_chat_logit_bias_non_numeric_value
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing invalid value"}],
            max_tokens=5, logit_bias={"1": "not_a_number"})
    assert excinfo.value.status_code == 400
    assert "logit_bias" in str(excinfo.value)


# ---- chat_completion/test_chat_stop_token_ids_validation.py -------------------------------------
def test_chat_stop_token_ids_valid(live):
    # vllm .../chat_completion/test_chat_stop_token_ids_validation.py::
    #   test_chat_stop_token_ids_valid
    _, client, _ = live
    completion = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Testing valid stop token ids"}],
        max_tokens=5, extra_body={"stop_token_ids": [VOCAB - 1]})
    assert completion.choices[0].message.content is not None


def test_chat_stop_token_ids_out_of_vocab(live):
    # vllm .../chat_completion/test_chat_stop_token_ids_validation.py::
    #   test_chat_stop_token_ids_out_of_vocab
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing stop token ids"}],
            max_tokens=5, extra_body={"stop_token_ids": [VOCAB + 1]})
    assert excinfo.value.status_code == 400
    assert str(VOCAB + 1) in str(excinfo.value)
    assert str(VOCAB) in str(excinfo.value)


def test_chat_stop_token_ids_negative(live):
    # vllm .../chat_completion/test_chat_stop_token_ids_validation.py::
    #   test_chat_stop_token_ids_negative
    _, client, _ = live
    with pytest.raises(openai.BadRequestError) as excinfo:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Testing stop token ids"}],
            max_tokens=5, extra_body={"stop_token_ids": [-1]})
    assert excinfo.value.status_code == 400


# ---- tokenization (serve/tokenize: test_tokenization.py) ----------------------------------------
def test_tokenize_detokenize_completions(live):
    # vllm tests/entrypoints/openai/test_tokenization.py::test_tokenize_completions and
    #   ::test_detokenize (add_special_tokens both ways, the count and max_model_len fields)
    server, _, _ = live
    prompt = "vllm1 This is a test prompt."
    tokens = tokenizer.encode(prompt)
    for add_special in (False, True):
        r = httpx.post(f"{server.url}/tokenize", timeout=10,
                       json={"add_special_tokens": add_special, "model": MODEL,
                             "prompt": prompt})
        assert r.status_code == 200, r.text
        result = r.json()
        assert result["tokens"] == tokens
        assert result["count"] == len(tokens)
        assert result["max_model_len"] > 0
        assert result["token_strs"] is None
    r = httpx.post(f"{server.url}/detokenize", json={"model": MODEL, "tokens": tokens},
                   timeout=10)
    assert r.status_code == 200, r.text
    assert r.json() == {"prompt": prompt}


def test_tokenizer_info_basic_and_consistent_with_tokenize(live):
    # vllm tests/entrypoints/openai/test_tokenization.py::test_tokenizer_info_basic and
    #   ::test_tokenizer_info_consistency_with_tokenize (plus the fields lm-eval's remote
    #   tokenizer reads: tests/test_clients_lmeval.py)
    server, _, service = live
    r = httpx.get(f"{server.url}/tokenizer_info", timeout=10)
    assert r.status_code == 200, r.text
    info = r.json()
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert info["tokenizer_class"] == type(service.tokenizer).__name__
    assert "eos_token" in info and "chat_template" in info
    tokenized = httpx.post(f"{server.url}/tokenize",
                           json={"model": MODEL, "prompt": "Hello world!"}, timeout=10).json()
    assert info["model_max_length"] >= tokenized["max_model_len"] > 0


# ---- models (test_models.py) --------------------------------------------------------------------
def test_check_models(live):
    # vllm tests/entrypoints/openai/test_models.py::test_check_models
    _, client, _ = live
    models = client.models.list().data
    served_model = models[0]
    assert served_model.id == MODEL
    assert all(model.root == MODEL for model in models)

